"""Checkpoints never execute code: every `torch.load` while one is read is `weights_only=True`.

Accelerate already loads its own files that way; DeepSpeed's engine and `zero_to_fp32` ask for
`weights_only=False` and so would unpickle anything a crafted `*_optim_states.pt` holds. Inside `weights_only()`
their loads are forced to the weights-only unpickler, with the three plain DeepSpeed types its states contain
allow-listed; anything else (a class to instantiate, a function to call) is refused.
"""

from __future__ import annotations

import contextlib
import pickle
import threading
from pathlib import Path

from ..errors import PretrainerError, first_line

_LOCK = threading.Lock()


def _deepspeed_globals() -> list:
    try:
        from deepspeed.runtime.fp16.loss_scaler import LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address
    except ImportError:  # no DeepSpeed installed: no DeepSpeed checkpoint to read
        return []
    return [LossScaler, ZeroStageEnum, fragment_address]  # ZeRO-1/2 shards hold fragment_address(numel, start)


class UnsafeCheckpoint(PretrainerError):
    """A checkpoint file wanted to run code while loading; nothing of it was executed."""


@contextlib.contextmanager
def weights_only(where: str):
    """Force `weights_only=True` on every `torch.load` in the block; a refused file is an UnsafeCheckpoint."""
    import torch  # here: reading a run imports this module, and torch takes seconds

    real = torch.load

    def load(f, *args, **kwargs):
        kwargs["weights_only"] = True
        try:
            return real(f, *args, **kwargs)
        except pickle.UnpicklingError as e:
            raise UnsafeCheckpoint(f"{where}: {_name(f)}: refused to unpickle code ({first_line(e, 160)})") from None
        except RuntimeError as e:  # e.g. a raw pickle where a torch zip file belongs (mmap, weights-only)
            raise UnsafeCheckpoint(
                f"{where}: {_name(f)}: cannot be read without unpickling ({first_line(e, 160)})"
            ) from None

    with _LOCK, torch.serialization.safe_globals(_deepspeed_globals()):
        torch.load = load
        try:
            yield
        finally:
            torch.load = real


def _name(f) -> str:
    return Path(str(f)).name if isinstance(f, str | Path) else "a stream"
