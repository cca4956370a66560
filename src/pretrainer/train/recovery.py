"""Closed-loop spike recovery, as decisions: roll back to the last good checkpoint, replay, and skip data that
spikes again. The handler never touches the model or the checkpoints; it returns a `Rollback` or an `Abort` and the
loop performs it.

1. On a spike (see spikes.py), roll back to the newest checkpoint whose weights predate the onset by at least one
   update (the update just before the first bad loss may itself be the cause), that verifies, and whose recorded
   losses were finite. It is protected from pruning until the episode ends (`protected()`), and so is the candidate
   of a run of suspect steps that may yet become a spike.
2. Replay. If the spike recurs on the same steps, the data are to blame: re-run the suspect steps' batches without
   gradients, blame the samples whose own loss is an outlier (all of the steps' samples when none stands out), and
   roll back again with them (plus `skip_margin`) as skips for the ledger.
3. If the replay stays healthy `confirm_steps` past the spike, it was transient (e.g. a corrupted optimizer state
   that the rollback removed): logged, nothing skipped.
4. More than `max_rollbacks` within `rollback_window` steps: `Abort` (exit code 76), checkpoints intact.

The handler sees the rest of the run through two read-only queries: `find_target(max_step)` (the newest good
checkpoint at or before a step) and `sample_losses` (the per-sample losses of a past step's batches, rebuilt from its
stage and data cursor).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable
from pathlib import Path

from ..checkpoint.format import Protected
from ..errors import PretrainerError
from ..files import atomic_write_json, read_json
from ..observe import events as ev
from ..recipe.sections import SpikesSection
from .decisions import OK, Abort, Decision, Rollback
from .spikes import SpikeDetector, outliers, sample_ranges

SPIKE_ABORT_EXIT = 76
LEDGER = "skip_ledger.json"


class SpikeAbort(PretrainerError):
    """The run stopped itself on a spike it could not recover from; checkpoints intact."""

    def __init__(self, message: str, exit_code: int = SPIKE_ABORT_EXIT):
        super().__init__(message)
        self.exit_code = exit_code


SampleLosses = Callable[[int, int, list[tuple[int, int]]], tuple[list[int], list[float]]]
"""(stage, cursor before the step, the stage's skips) -> (the step's global sample indices, each one's loss)."""


def read_ledger(output_dir: Path) -> dict | None:
    return read_json(Path(output_dir) / LEDGER)


def write_ledger(output_dir: Path, skips: list[list[int]], handler_state: dict) -> None:
    """skip_ledger.json in the run directory: the ledger plus the open episode, so a process killed during a replay
    resumes with both (checkpoints carry them too)."""
    atomic_write_json(Path(output_dir) / LEDGER, {"skips": skips, **handler_state})


def episode_target(path: Path, step: int, ledger: dict | None, verify: Callable[[Path], list[str]]) -> Path:
    """The checkpoint to resume from instead of `path` (at `step`): when a process died during a replay, the newest
    checkpoint may hold the spike, so go back to the open episode's target (if it still verifies)."""
    pend = (ledger or {}).get("pending")
    if pend and step > pend["onset"] - 2 and not verify(Path(pend["target"])):
        return Path(pend["target"])
    return path


class SpikeHandler:
    def __init__(
        self,
        cfg: SpikesSection,
        find_target: Callable[[int], Path | None],
        sample_losses: SampleLosses,
        log,
        alert: Callable[[str, str], None],
        leads: Callable[[int], dict | None] | None = None,
    ):
        """Args:
        leads: the layers that moved before a spike's onset (layer statistics), attached to the spike event."""
        self.cfg, self.find_target, self.sample_losses = cfg, find_target, sample_losses
        self.leads = leads
        self.log, self.alert = log, alert
        self.detector = SpikeDetector(
            cfg.window, cfg.threshold, cfg.persistence, cfg.min_history, grace_steps=cfg.grace_steps
        )
        self.steps: deque[tuple[int, int, int]] = deque(maxlen=cfg.window + cfg.persistence + cfg.confirm_steps)
        """(step, stage index, cursor before the step) of recent steps: enough to rebuild their batches."""
        self.pending: dict | None = None
        self.rollback_steps: list[int] = []

    # ------------------------------------------------------------------ per step

    def start_grace(self, step: int) -> None:
        self.detector.start_grace(step)

    def record(self, step: int, stage: int, cursor_before: int) -> None:
        self.steps.append((step, stage, cursor_before))

    def protected(self) -> Protected:
        """What retention must keep: the open episode's rollback target, and while a run of suspect steps is open,
        the newest checkpoint from before its onset less one update (where a spike confirmed later rolls back to)."""
        names = frozenset([Path(self.pending["target"]).name]) if self.pending else frozenset()
        suspect = self.detector.onset()
        return Protected(names, None if suspect is None else suspect - 2)

    def after_step(self, step: int, loss: float, grad_norm: float | None, skips: list[list[int]]) -> Decision:
        """Judge a finished step (its loss averaged over ranks and its gradient norm, on the host).

        Args:
            skips: the run's skip ledger as it stands (read only), for rebuilding past batches.
        """
        d = self.detector.update(step, loss, grad_norm)
        if d.kind == "suspect":
            return OK
        if d.kind == "ok":
            if self.pending and step >= self.pending["end"] + self.cfg.confirm_steps:
                self.log.event(ev.TRANSIENT, step, onset=self.pending["onset"], end=self.pending["end"])
                self.pending = None
            return OK
        self.log.event(
            ev.SPIKE,
            step,
            onset=d.onset,
            reason=d.reason,
            zscore=d.zscore,
            loss=loss,
            grad_norm=grad_norm,
            layers=self.leads(d.onset) if self.leads is not None else None,
        )
        self.alert("Loss spike", f"step {step}: {d.reason} (onset {d.onset})")
        p = self.pending
        if p and p["onset"] - self.cfg.persistence <= d.onset <= p["end"]:
            ranges, by = self.blame(d.onset, step, skips, d.expected)
            for stage, a, b in ranges:
                self.log.event(ev.SKIP, step, stage=stage, first=a, last=b, onset=d.onset, blame=by)
            p["end"] = step
            return self._rollback(Path(p["target"]), step, tuple(ranges))
        target = self.find_target(d.onset - 2)
        if target is None:
            return Abort(
                f"spike at step {step} ({d.reason}) and no checkpoint from before step {d.onset - 1}",
                SPIKE_ABORT_EXIT,
            )
        self.pending = {"onset": d.onset, "end": step, "target": str(target)}
        return self._rollback(target, step, ())

    def _rollback(self, target: Path, step: int, skips: tuple) -> Decision:
        recent = [s for s in self.rollback_steps if s > step - self.cfg.rollback_window]
        if len(recent) >= self.cfg.max_rollbacks:
            self.log.event(ev.ROLLBACK_LIMIT, step, rollbacks=len(recent), window=self.cfg.rollback_window)
            return Abort(
                f"{len(recent)} rollbacks within {self.cfg.rollback_window} steps (spikes.max_rollbacks); stopping "
                f"at step {step} with checkpoints intact in {target.parent}",
                SPIKE_ABORT_EXIT,
            )
        self.rollback_steps.append(step)
        return Rollback(target, step, skips)

    # ------------------------------------------------------------------ blame

    def blame(
        self, first_step: int, last_step: int, skips: list[list[int]], expected: float | None = None
    ) -> tuple[list[tuple[int, int, int]], str]:
        """Sample ranges to skip, and how they were chosen: `samples` (outliers by per-sample loss among the suspect
        steps' samples) or `steps` (all of the steps' samples, when no sample stands out).

        Args:
            expected: the trend's loss for the spike's steps. Outliers that would leave the rest of the batch still
                more than half the spike's excess above it do not explain the spike: then no sample stands out.
        """
        samples: list[tuple[int, int]] = []
        losses: list[float] = []
        latest = {step: (stage, cursor) for step, stage, cursor in self.steps}  # a replayed step counts once
        for step, (stage, cursor) in sorted(latest.items()):
            if first_step <= step <= last_step:
                idx, per_sample = self.sample_losses(stage, cursor, [(a, b) for s, a, b in skips if s == stage])
                samples += [(stage, i) for i in idx]
                losses += per_sample
        # 2.5 one-sided robust sd: generous on purpose; a wrongly blamed clean sample costs one skipped sequence,
        # a missed poisoned one costs another rollback
        bad = outliers(losses, 2.5)
        if bad and expected is not None and len(bad) < len(losses):
            rest = [v for k, v in enumerate(losses) if k not in set(bad)]
            if statistics.fmean(rest) - expected > (statistics.fmean(losses) - expected) / 2:
                bad = []  # the whole batch is elevated (PaLM's case): skipping a few samples would not help
        by = "samples" if bad else "steps"
        bad = bad or list(range(len(samples)))
        out = []
        for stage in sorted({s for s, _ in samples}):
            idx = [samples[k][1] for k in bad if samples[k][0] == stage]
            out += [(stage, a, b) for a, b in sample_ranges(idx, self.cfg.skip_margin)]
        return out, by

    # ------------------------------------------------------------------ persistence

    def merge_ledger(self, ledger: dict) -> None:
        """After a resume: the run directory's ledger may be newer than the checkpoint (killed during a replay)."""
        self.pending = ledger.get("pending")
        self.rollback_steps = sorted(set(self.rollback_steps) | set(ledger.get("rollbacks", [])))

    def state_dict(self) -> dict:
        return {"detector": self.detector.state_dict(), "pending": self.pending, "rollbacks": self.rollback_steps}

    def load_state_dict(self, state: dict) -> None:
        self.detector.load_state_dict(state["detector"])
        self.pending = state.get("pending")
        self.rollback_steps = list(state.get("rollbacks", []))

    def rewind(self, state: dict) -> None:
        """A rollback restores the detector's trend; the open episode and the rollbacks so far are history."""
        self.detector.load_state_dict(state["detector"])
