"""What the loop measures between logging steps: per-step losses kept on the device (one host transfer per logging
step), throughput, and the recent-loss statistics a checkpoint records."""

from __future__ import annotations

import math
import resource
import statistics
import time
from collections import deque
from typing import Any

import torch

# Dense bf16 peak TFLOP/s per device, for MFU (`logging.peak_tflops` overrides; unknown devices report no MFU).
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0, "L4": 121.0, "4090": 165.0}


def peak_tflops(configured: float | None) -> float | None:
    """The recipe's `logging.peak_tflops`, else the table's entry for the CUDA device, else None (CPU)."""
    if configured is not None:
        return configured
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    return None


def mfu(tokens_per_s: float, flops_per_token: float, devices: int, peak: float) -> float:
    """Model FLOPs utilization: the training FLOPs the run does per device-second over the device's peak."""
    return tokens_per_s * flops_per_token / (devices * peak * 1e12)


def memory_gb() -> dict[str, float]:
    """Device memory (CUDA: allocated, reserved, peak allocated) and this process's peak host memory, in GB.
    Reading them costs no device sync."""
    out = {"mem/host_peak_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}  # ru_maxrss is KiB
    if torch.cuda.is_available():
        out["mem/allocated_gb"] = torch.cuda.memory_allocated() / 2**30
        out["mem/reserved_gb"] = torch.cuda.memory_reserved() / 2**30
        out["mem/peak_gb"] = torch.cuda.max_memory_allocated() / 2**30
    return out


class StepWindow:
    """Per-step losses kept on the device between logging steps (no host sync), flushed with one transfer; wall
    time, steps, tokens and data-wait time since the clock was last reset."""

    def __init__(self):
        self.steps: list[int] = []
        self.losses: list[torch.Tensor] = []
        self.reset_clock()

    def add(self, step: int, loss: torch.Tensor, tokens: int) -> None:
        self.steps.append(step)
        self.losses.append(loss)
        self.tokens += tokens
        self.n += 1

    def flush(self, accelerator) -> tuple[list[int], list[float]]:
        """The window's steps and their losses averaged over ranks; empties the window."""
        values = accelerator.reduce(torch.stack(self.losses), reduction="mean").tolist()
        steps = self.steps
        self.steps, self.losses = [], []
        return steps, values

    def rates(self) -> dict[str, float]:
        """tokens/s, seconds per step and the fraction of wall time spent building batches, since the clock was last
        read or reset (after the flush's sync, so the device's work is in the wall time); restarts the clock."""
        dt = time.perf_counter() - self.t0
        out = {
            "tokens_per_s": self.tokens / dt if dt > 0 else float("nan"),
            "step_time_s": dt / self.n if self.n else float("nan"),
            "data_wait": min(1.0, self.data_s / dt) if dt > 0 else float("nan"),
        }
        self.reset_clock()
        return out

    def reset_clock(self) -> None:
        self.tokens, self.n, self.data_s, self.t0 = 0, 0, 0.0, time.perf_counter()


def train_record(steps: list[int], losses: list[float], window: StepWindow, **values: Any) -> dict[str, Any]:
    """One training metrics line: the window's mean loss, every step's loss, its rates, memory, and `values`."""
    rates = window.rates()
    return {
        "loss": sum(losses) / len(losses),
        **values,
        **rates,
        "step_losses": [[s, v] for s, v in zip(steps, losses)],
        **memory_gb(),
    }


class LossStats:
    """The last `size` logged training losses; a checkpoint records their summary, and a rollback never goes back
    to a checkpoint whose recent losses were not finite."""

    def __init__(self, size: int = 256):
        self.recent: deque[float] = deque(maxlen=size)

    def extend(self, losses: list[float]) -> None:
        self.recent.extend(losses)

    def state_dict(self) -> dict[str, Any]:
        losses = list(self.recent)
        finite = [x for x in losses if math.isfinite(x)]
        return {
            "n": len(losses),
            "finite": len(finite) == len(losses),
            "median": statistics.median(finite) if finite else None,
            "last": losses[-1] if losses else None,
            "min": min(finite) if finite else None,
            "max": max(finite) if finite else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # Only the summary is saved: the losses after a restore are the new timeline's.
        self.recent.clear()
