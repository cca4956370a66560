"""Closed-loop spike recovery: roll back to the last good checkpoint, replay, and skip data that spikes again.

1. On a spike (see spikes.py), roll back to the newest checkpoint whose weights predate the onset by at least one
   update (the update just before the first bad loss may itself be the cause), that verifies, and whose recorded
   losses were finite. It is protected from pruning until the episode ends.
2. Replay. If the spike recurs on the same steps, the data are to blame: re-run the suspect steps' batches without
   gradients, blame the samples whose own loss is an outlier (all of the steps' samples when none stands out), add
   them (plus `skip_margin`) to the skip ledger, roll back again and go on without them.
3. If the replay stays healthy `confirm_steps` past the spike, it was transient (e.g. a corrupted optimizer state
   that the rollback removed): logged, nothing skipped.
4. More than `max_rollbacks` within `rollback_window` steps stops the run (exit code 76), checkpoints intact.
"""

from __future__ import annotations

import json
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from . import checkpoint as ck
from .errors import PretrainerError
from .spikes import SpikeDetector, outliers, sample_ranges

if TYPE_CHECKING:
    from .trainer import Trainer

SPIKE_ABORT_EXIT = 76
LEDGER = "skip_ledger.json"


def read_ledger(output_dir: Path) -> dict | None:
    p = Path(output_dir) / LEDGER
    return json.loads(p.read_text()) if p.exists() else None


class SpikeAbort(PretrainerError):
    exit_code = SPIKE_ABORT_EXIT


class SpikeHandler:
    def __init__(self, trainer: Trainer):
        self.t = trainer
        c = trainer.recipe.spikes
        self.cfg = c
        self.detector = SpikeDetector(c.window, c.threshold, c.persistence, c.min_history, grace_steps=c.grace_steps)
        self.steps: deque[tuple[int, int, int]] = deque(maxlen=c.window + c.persistence + c.confirm_steps)
        """(step, stage index, cursor before the step) of recent steps: enough to rebuild their batches."""
        self.pending: dict | None = None
        self.rollback_steps: list[int] = []

    # ------------------------------------------------------------------ per step

    def record(self, step: int, stage: int, cursor_before: int) -> None:
        self.steps.append((step, stage, cursor_before))

    def after_step(self, step: int, loss: float, grad_norm: float | None) -> bool:
        """Judge a finished step. Returns True when it rolled back (the loop must re-read its state)."""
        d = self.detector.update(step, loss, grad_norm)
        log = self.t.log
        if d.kind == "suspect":
            return False
        if d.kind == "ok":
            if self.pending and step >= self.pending["end"] + self.cfg.confirm_steps:
                log.event("transient", step, onset=self.pending["onset"], end=self.pending["end"])
                self._close()
            return False
        log.event("spike", step, onset=d.onset, reason=d.reason, zscore=d.zscore, loss=loss, grad_norm=grad_norm)
        self.t.alert("Loss spike", f"step {step}: {d.reason} (onset {d.onset})")
        p = self.pending
        if p and p["onset"] - self.cfg.persistence <= d.onset <= p["end"]:
            ranges = self.blame(d.onset, step)
            for stage, a, b in ranges:
                self.t.state.skips.append([stage, a, b])
                log.event("skip", step, stage=stage, first=a, last=b, onset=d.onset)
            self.write_ledger()
            p["end"] = step
            return self.rollback(p["target"], step)
        target = self.choose_target(d.onset)
        if target is None:
            raise SpikeAbort(f"spike at step {step} ({d.reason}) and no checkpoint from before step {d.onset - 1}")
        self.pending = {"onset": d.onset, "end": step, "target": str(target)}
        self.t.ckpt.protected.add(target.name)
        return self.rollback(str(target), step)

    def _close(self) -> None:
        if self.pending:
            self.t.ckpt.protected.discard(Path(self.pending["target"]).name)
        self.pending = None

    # ------------------------------------------------------------------ rollback

    def choose_target(self, onset: int) -> Path | None:
        for c in reversed(ck.list_checkpoints(self.t.ckpt.root)):
            if c.meta["step"] > onset - 2:
                continue  # saved after the update that produced the first bad loss: suspect
            if not c.meta.get("loss_stats", {}).get("finite", True):
                continue
            if ck.verify(c.path):
                continue
            return c.path
        return None

    def rollback(self, target: str, step: int) -> bool:
        recent = [s for s in self.rollback_steps if s > step - self.cfg.rollback_window]
        if len(recent) >= self.cfg.max_rollbacks:
            self.t.log.event("rollback_limit", step, rollbacks=len(recent), window=self.cfg.rollback_window)
            raise SpikeAbort(
                f"{len(recent)} rollbacks within {self.cfg.rollback_window} steps (spikes.max_rollbacks); stopping "
                f"at step {step} with checkpoints intact in {self.t.ckpt.root}"
            )
        self.rollback_steps.append(step)
        skips = [list(x) for x in self.t.state.skips]
        pending, rollbacks = self.pending, list(self.rollback_steps)
        self.t.ckpt.restore(Path(target))
        # The ledger and the open episode are history, not state: a rollback must not forget them.
        self.t.state.skips = sorted([list(x) for x in {tuple(x) for x in skips + self.t.state.skips}])
        self.pending, self.rollback_steps = pending, rollbacks
        self.write_ledger()
        self.t.log.event("rollback", step, to_step=self.t.state.step, path=target, replayed=step - self.t.state.step)
        self.t.alert("Rollback", f"step {step} -> {self.t.state.step} ({target})")
        return True

    # ------------------------------------------------------------------ blame

    @torch.no_grad()
    def blame(self, first_step: int, last_step: int) -> list[tuple[int, int, int]]:
        """Sample ranges to skip: outliers by per-sample loss among the suspect steps' samples."""
        t, acc = self.t, self.t.accelerator
        samples: list[tuple[int, int]] = []
        losses: list[float] = []
        latest = {step: (stage, cursor) for step, stage, cursor in self.steps}  # a replayed step counts once
        for step, (stage, cursor) in sorted(latest.items()):
            if not first_step <= step <= last_step:
                continue
            batcher = t.batches_for(stage)
            skips = t.state.skips_for(stage)
            idx, _ = batcher.indices(cursor, skips)
            batches, _, _ = batcher.step_batches(cursor, acc.process_index, acc.num_processes, skips)
            mine = []
            for mb in batches:
                mb = mb.to(acc.device)
                logits = t.model(input_ids=mb, use_cache=False).logits.float()
                per_tok = F.cross_entropy(logits[:, :-1].transpose(1, 2), mb[:, 1:], reduction="none")
                mine.append(per_tok.mean(dim=1))
            per_row = acc.gather(torch.cat(mine)).tolist()  # rank order = sample order
            samples += [(stage, i) for i in idx]
            losses += per_row
        # 2.5 one-sided robust sd: generous on purpose; a wrongly blamed clean sample costs one skipped sequence,
        # a missed poisoned one costs another rollback
        bad = outliers(losses, 2.5) or list(range(len(samples)))
        out = []
        for stage in sorted({s for s, _ in samples}):
            idx = [samples[k][1] for k in bad if samples[k][0] == stage]
            out += [(stage, a, b) for a, b in sample_ranges(idx, self.cfg.skip_margin)]
        return out

    def write_ledger(self) -> None:
        """skip_ledger.json in the run directory: the ledger plus the open episode, so a process killed during a
        replay resumes with both (checkpoints carry them too)."""
        if self.t.accelerator.is_main_process:
            path = self.t.output_dir / LEDGER
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"skips": self.t.state.skips, **self.state_dict()}, indent=1))
            tmp.rename(path)

    # ------------------------------------------------------------------ persistence

    def state_dict(self) -> dict:
        return {"detector": self.detector.state_dict(), "pending": self.pending, "rollbacks": self.rollback_steps}

    def load_state_dict(self, state: dict) -> None:
        self.detector.load_state_dict(state["detector"])
        self.pending = state.get("pending")
        self.rollback_steps = list(state.get("rollbacks", []))
        if self.pending:
            self.t.ckpt.protected.add(Path(self.pending["target"]).name)


def poison(rows: list[np.ndarray], indices: list[int], first: int, last: int, vocab: int) -> list[np.ndarray]:
    """Fault injection: rows whose sample index lies in [first, last] become random tokens (seeded by the index,
    so the same data spike again on replay)."""
    out = []
    for row, i in zip(rows, indices):
        if first <= i <= last:
            row = np.random.default_rng(i).integers(0, vocab, size=len(row)).astype(row.dtype)
        out.append(row)
    return out
