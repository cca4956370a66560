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

The handler sees the rest of the run through two narrow collaborators: a `Checkpoints` port (choose, verify,
restore, protect and release a rollback target) and a `SampleLosses` function (the per-sample losses of a past
step's batches, rebuilt from its stage and data cursor).
"""

from __future__ import annotations

import json
import statistics
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from .errors import PretrainerError
from .sections import SpikesSection
from .spikes import SpikeDetector, outliers, sample_ranges
from .state import RunState

SPIKE_ABORT_EXIT = 76
LEDGER = "skip_ledger.json"


class SpikeAbort(PretrainerError):
    exit_code = SPIKE_ABORT_EXIT


class Checkpoints(Protocol):
    """What recovery needs of the checkpoint manager."""

    def rollback_target(self, max_step: int) -> Path | None: ...

    def verify(self, path: Path) -> list[str]: ...

    def restore(self, path: Path) -> Any: ...

    def protect(self, name: str) -> None: ...

    def release(self, name: str) -> None: ...


SampleLosses = Callable[[int, int, list[tuple[int, int]]], tuple[list[int], list[float]]]
"""(stage, cursor before the step, the stage's skips) -> (the step's global sample indices, each one's loss)."""


def read_ledger(output_dir: Path) -> dict | None:
    p = Path(output_dir) / LEDGER
    return json.loads(p.read_text()) if p.exists() else None


def resume_run(ckpt, handler: SpikeHandler | None, state: RunState, log, output_dir: Path, spec: str,
               allow_recipe_change: bool, is_main: bool):  # fmt: skip
    """Restore from `--resume` (`none`, `auto` or a path; an open spike episode's target when a process died in a
    replay), then merge the run directory's skip ledger, which may be newer than the checkpoint. Returns what was
    restored, or None."""
    redirect = handler.resume_target if handler else None
    restored = ckpt.resume(spec, allow_recipe_change, redirect)
    if restored is None:
        return None
    if ledger := read_ledger(output_dir):
        state.merge_skips(ledger["skips"])
        if handler is not None:
            handler.merge_ledger(ledger)
    log.event("resume", state.step, path=str(restored.path), tokens=state.tokens, stage=restored.meta["stage"],
              cursor=state.cursor, skips=state.skips)  # fmt: skip
    if is_main:
        print(f"resume: from {restored.path} at step {state.step}", flush=True)
    return restored


class SpikeHandler:
    def __init__(
        self,
        cfg: SpikesSection,
        state: RunState,
        checkpoints: Checkpoints,
        sample_losses: SampleLosses,
        log,
        alert: Callable[[str, str], None],
        run_dir: Path,
        is_main: bool = True,
    ):
        self.cfg, self.state, self.checkpoints, self.sample_losses = cfg, state, checkpoints, sample_losses
        self.log, self.alert, self.run_dir, self.is_main = log, alert, Path(run_dir), is_main
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

    def after_step(self, step: int, loss: float, grad_norm: float | None):
        """Judge a finished step. Returns what a rollback restored (the loop must re-read its state), or None."""
        d = self.detector.update(step, loss, grad_norm)
        if d.kind == "suspect":
            return None
        if d.kind == "ok":
            if self.pending and step >= self.pending["end"] + self.cfg.confirm_steps:
                self.log.event("transient", step, onset=self.pending["onset"], end=self.pending["end"])
                self._close()
            return None
        self.log.event("spike", step, onset=d.onset, reason=d.reason, zscore=d.zscore, loss=loss, grad_norm=grad_norm)
        self.alert("Loss spike", f"step {step}: {d.reason} (onset {d.onset})")
        p = self.pending
        if p and p["onset"] - self.cfg.persistence <= d.onset <= p["end"]:
            ranges, by = self.blame(d.onset, step, d.expected)
            for stage, a, b in ranges:
                self.state.add_skip(stage, a, b)
                self.log.event("skip", step, stage=stage, first=a, last=b, onset=d.onset, blame=by)
            self.write_ledger()
            p["end"] = step
            return self.rollback(p["target"], step)
        target = self.checkpoints.rollback_target(d.onset - 2)
        if target is None:
            raise SpikeAbort(f"spike at step {step} ({d.reason}) and no checkpoint from before step {d.onset - 1}")
        self.pending = {"onset": d.onset, "end": step, "target": str(target)}
        self.checkpoints.protect(target.name)
        return self.rollback(str(target), step)

    def _close(self) -> None:
        if self.pending:
            self.checkpoints.release(Path(self.pending["target"]).name)
        self.pending = None

    # ------------------------------------------------------------------ rollback

    def rollback(self, target: str, step: int):
        recent = [s for s in self.rollback_steps if s > step - self.cfg.rollback_window]
        if len(recent) >= self.cfg.max_rollbacks:
            self.log.event("rollback_limit", step, rollbacks=len(recent), window=self.cfg.rollback_window)
            raise SpikeAbort(
                f"{len(recent)} rollbacks within {self.cfg.rollback_window} steps (spikes.max_rollbacks); stopping "
                f"at step {step} with checkpoints intact in {Path(target).parent}"
            )
        self.rollback_steps.append(step)
        skips = [list(x) for x in self.state.skips]
        pending, rollbacks = self.pending, list(self.rollback_steps)
        restored = self.checkpoints.restore(Path(target))
        # The ledger and the open episode are history, not state: a rollback must not forget them.
        self.state.merge_skips(skips)
        self.pending, self.rollback_steps = pending, rollbacks
        self.write_ledger()
        self.log.event("rollback", step, to_step=self.state.step, path=target, replayed=step - self.state.step)
        self.alert("Rollback", f"step {step} -> {self.state.step} ({target})")
        return restored

    # ------------------------------------------------------------------ blame

    def blame(
        self, first_step: int, last_step: int, expected: float | None = None
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
                idx, per_sample = self.sample_losses(stage, cursor, self.state.skips_for(stage))
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

    # ------------------------------------------------------------------ ledger and persistence

    def write_ledger(self) -> None:
        """skip_ledger.json in the run directory: the ledger plus the open episode, so a process killed during a
        replay resumes with both (checkpoints carry them too)."""
        if self.is_main:
            path = self.run_dir / LEDGER
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"skips": self.state.skips, **self.state_dict()}, indent=1))
            tmp.rename(path)

    def resume_target(self, path: Path, step: int) -> Path:
        """The checkpoint to resume from instead of `path` (at `step`): when a process died during a replay, the
        newest checkpoint may hold the spike, so go back to the open episode's target."""
        pend = (read_ledger(self.run_dir) or {}).get("pending")
        if pend and step > pend["onset"] - 2 and not self.checkpoints.verify(Path(pend["target"])):
            return Path(pend["target"])
        return path

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
        if self.pending:
            self.checkpoints.protect(Path(self.pending["target"]).name)
