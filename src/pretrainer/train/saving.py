"""When to save: every `every_tokens` tokens, every `every_minutes` of wall clock, at each stage end. Policy only:
the store (checkpoint/manager.py) writes what the loop asks it to."""

from __future__ import annotations

import time

import torch
from accelerate.utils import broadcast

from ..checkpoint import tokens_crossed
from ..recipe.sections import CheckpointSection


class SaveClock:
    def __init__(self, section: CheckpointSection, accelerator):
        self.section, self.acc = section, accelerator
        self.last_save = time.monotonic()

    def mark(self) -> None:
        """A save just happened (or the run just started): the wall-clock trigger counts from now."""
        self.last_save = time.monotonic()

    def due(self, tokens_before: int, tokens_now: int, stage_end: bool, log_step: bool) -> str | None:
        """Why a save is due after a step, or None. Token and stage-end triggers every step; the clock only on
        logging steps, decided by the main process and broadcast (ranks' clocks differ; all must save together)."""
        s = self.section
        if stage_end and s.at_stage_end:
            return "stage_end"
        if tokens_crossed(s.every_tokens, tokens_before, tokens_now):
            return "tokens"
        if not log_step or s.every_minutes is None:
            return None
        late = (time.monotonic() - self.last_save) / 60 >= s.every_minutes
        if self.acc.num_processes > 1:
            late = bool(broadcast(torch.tensor([float(late)], device=self.acc.device), from_process=0).item())
        return "time" if late else None
