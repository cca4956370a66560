"""Background checkpoint writes: a CPU snapshot taken synchronously, written to disk by one background thread."""

from __future__ import annotations

import random
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch
from accelerate.checkpointing import save_accelerator_state

from .integrity import tensors_finite


class Snapshot:
    """A CPU copy of model + optimizer + RNG state, taken synchronously, written by a background thread."""

    def __init__(self, accelerator, model, optimizer, pool: dict | None = None):
        """Args:
        pool: CPU buffers of the previous snapshot (whose write has finished), reused when shapes match:
            copying into warm memory avoids page faults, the larger part of the loop's blocking time."""
        copies: dict[int, torch.Tensor] = {}
        pool = pool if pool is not None else {}
        self.pool: dict = {}

        def copy(x: torch.Tensor, slot: int) -> torch.Tensor:
            buf = pool.get(slot)
            if buf is None or buf.shape != x.shape or buf.dtype != x.dtype:
                buf = torch.empty(x.shape, dtype=x.dtype, device="cpu", pin_memory=x.is_cuda)
            buf.copy_(x.detach(), non_blocking=x.is_cuda)
            self.pool[slot] = buf
            return buf

        def cpu(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                # Tied weights share storage: copy once, so the file stores them once (as save_state does).
                key = x.untyped_storage().data_ptr()
                if key not in copies or copies[key].shape != x.shape:
                    copies[key] = copy(x, len(self.pool))
                return copies[key]
            if isinstance(x, dict):
                return type(x)((k, cpu(v)) for k, v in x.items())
            if isinstance(x, list | tuple):
                return type(x)(cpu(v) for v in x)
            return x

        self.model_state = cpu(accelerator.get_state_dict(model, unwrap=True))
        self.optimizer_state = cpu(optimizer.state_dict())
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the non-blocking copies must land before the writer reads them
        self.rng = {
            "step": 0,
            "random_state": random.getstate(),
            "numpy_random_seed": np.random.get_state(),
            "torch_manual_seed": torch.get_rng_state(),
        }
        if torch.cuda.is_available():
            self.rng["torch_cuda_manual_seed"] = torch.cuda.get_rng_state_all()

    def finite(self) -> bool:
        """Every copied weight and optimizer value finite: the save's NaN/Inf check, run on this host copy by the
        writer thread instead of on the live state by the loop."""
        return bool(tensors_finite(list(self.pool.values())).item() == 1.0)

    def write(self, directory: Path, process_index: int) -> None:
        """The same files, names and formats as Accelerate's save_state, so load_state reads them."""

        class _Opt:
            def __init__(self, s):
                self.s = s

            def state_dict(self):
                return self.s

        save_accelerator_state(
            str(directory),
            [self.model_state],
            [_Opt(self.optimizer_state)],
            [],
            [],
            process_index,
            0,
            None,
            safe_serialization=True,
        )
        torch.save(self.rng, directory / f"random_states_{process_index}.pkl")


class BackgroundWriter:
    """At most one checkpoint write in flight; `wait()` joins it and re-raises its error."""

    def __init__(self):
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def submit(self, fn) -> None:
        self.wait()

        def run():
            try:
                fn()
            except BaseException as e:  # surfaced on the training thread by wait()
                self.error = e

        self.thread = threading.Thread(target=run, name="checkpoint-writer", daemon=False)
        self.thread.start()

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            err, self.error = self.error, None
            raise err
