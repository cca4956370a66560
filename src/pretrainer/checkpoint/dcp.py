"""FSDP2 checkpoints through `torch.distributed.checkpoint` (DCP): every rank writes its own shards, asynchronously,
and a checkpoint loads into any number of processes (DCP reshards on load).

Layout inside a checkpoint directory: `dcp/` (DCP's `.metadata` and one `__<rank>_0.distcp` per rank, holding the
model and optimizer state as `{"model": ..., "optim": ...}` from `get_state_dict`) and `random_states_<rank>.pkl`.
The asynchronous save blocks only while DCP stages the state into host memory (pinned where a GPU exists); the write
and the commit (per-rank hashes, manifest, rename: `commit.commit`) run in a background thread per rank over a
process group of their own, so they never interleave with the training loop's collectives.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from ..runtime import innermost_optimizer, rng_state, set_rng_state
from .commit import Group
from .writer import BackgroundWriter

SUBDIR = "dcp"


def _dcp():
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    return dcp, get_state_dict, set_state_dict


def _warm_stager():
    """A DCP stager that copies into the same host buffers every save (pinned where CUDA exists). torch's own
    `BlockingAsyncStager(cache_staged_state_dict=True)` always asks for pinned memory, which fails without CUDA."""
    from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
    from torch.distributed.checkpoint.staging import AsyncStager

    class WarmStager(AsyncStager):
        _synchronize_after_execute = False

        def __init__(self):
            self.cache = None

        def stage(self, state_dict):
            if self.cache is not None:
                try:
                    return _copy_state_dict(state_dict, self.cache)
                except (KeyError, RuntimeError, ValueError):  # another structure than last time: new buffers
                    self.cache = None
            self.cache = _create_cpu_state_dict(state_dict, pin_memory=torch.cuda.is_available())
            return _copy_state_dict(state_dict, self.cache)

        def synchronize_staging(self) -> None:
            pass

    return WarmStager()


class DcpCheckpointer:
    """Save and load model + optimizer as DCP shards. At most one asynchronous save in flight; `wait()` joins it and
    re-raises its error."""

    def __init__(self):
        # Gloo for the background thread's collectives (DCP's planning, the manifest gather): a group of its own,
        # so they never race the loop's collectives on the default group (NCCL on GPUs).
        self.group = Group(dist.new_group(backend="gloo")) if dist.is_initialized() else Group()
        self.writer = BackgroundWriter()
        """The thread that waits for DCP's write, then commits."""
        self.stager = None
        """DCP's staging buffers, kept between saves: copying into warm (pinned, on a GPU) memory instead of fresh
        allocations is most of the blocking time (docs/BENCHMARKS.md). Safe to reuse: one save
        is in flight at a time."""

    def _stager(self):
        if self.stager is None:
            self.stager = _warm_stager()
        return self.stager

    def save(self, model, optimizer, tmp: Path, finish: Callable[[Group], None], async_: bool) -> None:
        """Write the state into `tmp/dcp`, then `finish(group)` (the commit), in the background when `async_`.
        Returns once the state is staged (async) or committed (sync)."""
        dcp, get_state_dict, _ = _dcp()
        self.wait()
        tmp.mkdir(parents=True, exist_ok=True)
        torch.save(rng_state(), tmp / f"random_states_{self.group.rank}.pkl")
        msd, osd = get_state_dict(model, innermost_optimizer(optimizer))
        state = {"model": msd, "optim": osd}
        target = str(tmp / SUBDIR)
        if not async_:
            dcp.save(state, checkpoint_id=target, process_group=self.group.pg)
            finish(self.group)
            return
        future = dcp.async_save(state, checkpoint_id=target, process_group=self.group.pg, async_stager=self._stager())
        self.writer.submit(lambda: (future.result(), finish(self.group)))

    def wait(self) -> None:
        self.writer.wait()

    def load(self, model, optimizer, path: Path) -> None:
        """Load into the live (sharded) model and optimizer, whatever number of processes saved it."""
        dcp, get_state_dict, set_state_dict = _dcp()
        msd, osd = get_state_dict(model, innermost_optimizer(optimizer))
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=str(Path(path) / SUBDIR), process_group=self.group.pg)
        set_state_dict(
            model, innermost_optimizer(optimizer), model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        rng = Path(path) / f"random_states_{self.group.rank}.pkl"
        if rng.exists():  # absent when more ranks resume than saved: they keep their seeded state
            set_rng_state(torch.load(rng, weights_only=True))
