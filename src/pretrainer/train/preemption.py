"""Preemption: SIGTERM/SIGINT set a flag; the loop saves a checkpoint at the next step boundary all ranks agree on,
then exits with code 75 ("try again": resume with --resume auto)."""

from __future__ import annotations

import signal

import torch

from ..errors import PretrainerError

PREEMPTED_EXIT = 75  # EX_TEMPFAIL


class Preempted(PretrainerError):
    """The normal end of a preempted launch: one plain line from the first rank, exit 75, no traceback."""

    exit_code = PREEMPTED_EXIT
    label = ""
    every_rank = False


class PreemptFlag:
    def __init__(self):
        self.flag = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                signal.signal(sig, self._handler)
            except ValueError:  # not the main thread (e.g. under some test runners)
                pass

    def _handler(self, signum, frame) -> None:
        self.flag = True

    def check(self, accelerator, log_step: bool) -> bool:
        """Whether to stop now; with several processes, agreed on logging steps only (agreeing costs a collective)."""
        if accelerator.num_processes == 1:
            return self.flag
        if not log_step:
            return False
        t = torch.tensor([float(self.flag)], device=accelerator.device)
        return bool(accelerator.reduce(t, reduction="sum").item() > 0)
