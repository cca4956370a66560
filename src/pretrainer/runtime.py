"""Process state that lives outside the model: the RNG streams, and the torch optimizer inside the wrappers."""

from __future__ import annotations

import contextlib
import random

import numpy as np


def innermost_optimizer(optimizer):
    """The torch optimizer inside Accelerate's wrapper (and DeepSpeed's, whose fp32 partitions hold the moments)."""
    while getattr(optimizer, "optimizer", None) is not None:
        optimizer = optimizer.optimizer
    return optimizer


def rng_state() -> dict:
    """Python, NumPy, torch (and CUDA) RNG states as tensors and plain tuples only, so they load with
    `weights_only=True`."""
    import torch  # here: reading a run (check_run) imports this module, and torch takes seconds

    name, keys, pos, has_gauss, gauss = np.random.get_state()
    out = {
        "random": random.getstate(),
        "numpy": (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_state(state: dict) -> None:
    import torch

    random.setstate(state["random"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


@contextlib.contextmanager
def rng_kept():
    """Restore every RNG stream on exit (a library that seeds its own must not change the training run)."""
    state = rng_state()
    try:
        yield
    finally:
        set_rng_state(state)


def fp8_capable() -> bool:
    """An NVIDIA GPU with fp8 tensor cores (compute capability 8.9+: Ada, Hopper, Blackwell)."""
    import torch

    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
