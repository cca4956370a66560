"""Closed-loop spike recovery, as decisions: roll back to the last good checkpoint, replay, and skip data that
spikes again. The handler never touches the model or the checkpoints; it returns a `Rollback` or an `Abort` and the
loop performs it.

1. On a spike (see spikes.py), roll back to the newest checkpoint whose weights predate the onset by at least one
   update (the update just before the first bad loss may itself be the cause), that verifies, and whose recorded
   losses were finite. It is protected from pruning until the episode ends (`protected()`), and so is the candidate
   of a run of suspect steps that may yet become a spike.
2. Blame, under the pre-spike weights: the `Rollback` names the steps to measure (`Measure`: the spike's and the
   steps before it); once the loop has restored the target it re-runs their samples without gradients and hands
   the losses to `blame`; samples that are measured outliers against the earlier steps' (and explain the spike) go
   to the skip ledger (plus `skip_margin`) before the replay.
   A data skip is permanent, so it needs that evidence; a recurrence alone is none (the replay is exact: a
   healthy run's noise excursion recurs to the last digit).
3. Replay. When nothing was blamed and the spike comes back on the same steps: a `recurred` event, the episode
   closes and the run goes on; when data were blamed and it still comes back: roll back and measure again.
4. If the replay stays healthy `confirm_steps` past the spike, it was transient (e.g. a corrupted optimizer state
   that the rollback removed): logged, nothing skipped.
5. More than `max_rollbacks` within `rollback_window` steps: `Abort` (exit code 76), checkpoints intact.
6. A spike whose every update skip-step held back (fewer than `persistence` in a row) never reached the weights:
   `absorbed`, no rollback.

The handler sees the rest of the run through one read-only query, `find_target(max_step)` (the newest good checkpoint
at or before a step); the per-sample losses it judges are measured by the loop and handed in. The open episode is one
frozen `Episode`, replaced (never mutated) as it moves on.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

from ..checkpoint.format import Protected
from ..errors import PretrainerError
from ..files import atomic_write_json, read_json
from ..observe import events as ev
from ..recipe.sections import SpikesSection
from ..stats import MAD_TO_SD
from .decisions import OK, Abort, Decision, Measure, Part, Rollback, StepAt, StepReport
from .spikes import SpikeDetector, sample_ranges

SPIKE_ABORT_EXIT = 76
LEDGER = "skip_ledger.json"


class SpikeAbort(PretrainerError):
    """The run stopped itself on a spike it could not recover from; checkpoints intact."""

    def __init__(self, message: str, exit_code: int = SPIKE_ABORT_EXIT):
        super().__init__(message)
        self.exit_code = exit_code


REFERENCE_STEPS = 8
"""Steps before a spike whose samples are the reference its samples are measured against."""
BLAME_SIGMAS = 4.0
"""Robust sd above the reference median that make a sample an outlier, at least. A per-sample loss averages a whole
sequence's tokens; a random-token or repeated-garbage sample sits tens of sd above, a hard but healthy one a few."""
BEYOND_REFERENCE = 1.25
"""And 25% beyond the reference's own most extreme sample: per-sample losses have heavy tails (the poison drill's
128 healthy reference samples reach 6.6 sd under z-loss, and a healthy suspect 4.4 sd, where the poisoned ones
sit at 13.8-20.7): a skip is permanent, so a sample must stand out from the healthy ones measured beside it."""


class Blame(NamedTuple):
    ranges: list[tuple[int, int, int]]
    """(stage, first, last) sample ranges to skip; empty: nothing stands out."""
    by: str
    """`samples` (measured outliers) or `none`."""
    evidence: dict
    """The counts and statistics the decision read (for the skip or recurred event)."""


def measured_outliers(
    losses: list[float], reference: list[float], spike_excess: float | None = None
) -> tuple[list[int], dict]:
    """Positions in `losses` that are outliers against `reference` (per-sample losses of healthy steps), when
    leaving them out explains at least half of the excess of `losses` over the reference and, given the spike's
    own excess over its trend (`spike_excess`), when the data reproduce at least half of it without the updates
    (a spike from a corrupted optimizer state has clean data: a hard sample among them is no culprit); and the
    evidence. Without a reference (a spike at a stage's first steps), the losses' own lower half is the reference."""
    finite = [v for v in losses if math.isfinite(v)]
    base = [v for v in reference if math.isfinite(v)]
    if len(base) < 3 and len(finite) >= 3:
        med_all = statistics.median(finite)
        base = [v for v in finite if v <= med_all]
    evidence: dict = {"suspect_samples": len(losses), "reference_samples": len(reference), "sigmas": BLAME_SIGMAS}
    if len(base) < 3:
        bad = [i for i, v in enumerate(losses) if not math.isfinite(v)]
        return bad, {**evidence, "outliers": len(bad)}
    med = statistics.median(base)
    scale = max(MAD_TO_SD * statistics.median(abs(v - med) for v in base), 0.01 * abs(med), 1e-8)
    bar = max(BLAME_SIGMAS, BEYOND_REFERENCE * (max(base) - med) / scale)
    bad = [i for i, v in enumerate(losses) if not math.isfinite(v) or (v - med) / scale > bar]
    mean_ref = statistics.fmean(base)
    mean_all = statistics.fmean(finite) if finite else math.inf
    blamed = set(bad)
    rest = [v for i, v in enumerate(losses) if i not in blamed]
    mean_rest = statistics.fmean(rest) if rest else mean_ref
    evidence.update(
        reference_median=med,
        reference_sd=scale,
        bar_sigmas=bar,
        suspect_mean=mean_all,
        reference_mean=mean_ref,
        outliers=len(bad),
    )
    explains = not rest or mean_rest - mean_ref <= (mean_all - mean_ref) / 2
    if bad and not explains:
        evidence["unexplained"] = "the outliers leave more than half of the excess: the whole batch is elevated"
        bad = []
    if spike_excess is not None:
        evidence["spike_excess"] = spike_excess
        if bad and not mean_all - mean_ref >= spike_excess / 2:
            evidence["unexplained"] = "the data reproduce under half of the spike without its updates: not the data"
            bad = []
    return bad, evidence


Measured = dict[int, tuple[list[int], list[float]]]
"""The loop's measurement of a `Measure`: step -> (its global sample indices, each one's loss under the restored
weights)."""


@dataclass(frozen=True)
class Episode:
    """An open spike episode: from its rollback until the replay stays healthy past it (`transient`), recurs on data
    that measured clean (`recurred`), or is rolled back again. Kept in checkpoints and the skip ledger, so a process
    killed during a replay resumes into it."""

    onset: int
    end: int
    """The last step of the spike (moved on when blamed data were skipped and it came back)."""
    target: str
    """The checkpoint it rolled back to: protected from pruning while the episode is open."""
    excess: float | None = None
    """The spike's mean excess over its trend (inf for a non-finite loss); None in checkpoints that predate it."""
    blamed: bool | None = None
    """After the blame: whether samples were skipped (None: not measured yet)."""
    evidence: dict | None = None
    """The blame's evidence (for the `recurred` event)."""

    def to_json(self) -> dict:
        """The ledger's form: the keys a checkpoint written before this class had, `blamed` and `evidence` once
        measured."""
        out = {"onset": self.onset, "end": self.end, "target": self.target, "excess": self.excess}
        if self.excess is None:
            del out["excess"]
        if self.blamed is not None:
            out.update(blamed=self.blamed, evidence=self.evidence)
        return out

    @classmethod
    def from_json(cls, d: dict | None) -> Episode | None:
        if not d:
            return None
        fields = ("onset", "end", "target", "excess", "blamed", "evidence")
        return cls(**{k: d[k] for k in fields if k in d})


def read_ledger(output_dir: Path) -> dict | None:
    return read_json(Path(output_dir) / LEDGER)


def write_ledger(output_dir: Path, skips: list[list[int]], handler_state: dict) -> None:
    """skip_ledger.json in the run directory: the ledger plus the open episode, so a process killed during a replay
    resumes with both (checkpoints carry them too)."""
    atomic_write_json(Path(output_dir) / LEDGER, {"skips": skips, **handler_state})


def blame_samples(measure: Measure, measured: Measured, margin: int) -> Blame:
    """The samples to skip for a spike, with the evidence: every sample of the spike's steps scored against the
    per-sample losses of the steps before it (`measure`'s reference). Blamed: the samples more than `BLAME_SIGMAS`
    robust sd above the reference median and `BEYOND_REFERENCE` times as far as the reference's own most extreme
    sample (non-finite ones always), and only when leaving them out takes at least half of the spike's excess over
    the reference mean away (`measured_outliers`); each widened by `margin`. Otherwise nothing is blamed: the data of
    those steps look like the data before them."""
    samples, losses, ref = [], [], []
    for at in measure.steps:
        idx, per_sample = measured[at.step]
        if at.step < measure.first:
            ref += per_sample
        else:
            samples += [(at.stage, i) for i in idx]
            losses += per_sample
    bad, evidence = measured_outliers(losses, ref, measure.excess)
    out = []
    for stage in sorted({s for s, _ in samples}):
        idx = [samples[k][1] for k in bad if samples[k][0] == stage]
        out += [(stage, a, b) for a, b in sample_ranges(idx, margin)]
    return Blame(out, "samples" if bad else "none", evidence)


def episode_target(path: Path, step: int, ledger: dict | None, verify: Callable[[Path], list[str]]) -> Path:
    """The checkpoint to resume from instead of `path` (at `step`): when a process died during a replay, the newest
    checkpoint may hold the spike, so go back to the open episode's target (if it still verifies)."""
    pend = (ledger or {}).get("pending")
    if pend and step > pend["onset"] - 2 and not verify(Path(pend["target"])):
        return Path(pend["target"])
    return path


class SpikeHandler(Part):
    """The spike rule as a part: each step recorded and judged (`after_step`), a rollback decided, the spike's samples
    blamed once the loop has measured them (`blame`), its episode and history in checkpoints and the ledger."""

    def __init__(
        self,
        cfg: SpikesSection,
        find_target: Callable[[int], Path | None],
        log,
        alert: Callable[[str, str], None],
        leads: Callable[[int], dict | None] | None = None,
    ):
        """Args:
        leads: the layers that moved before a spike's onset (layer statistics), attached to the spike event."""
        self.cfg, self.find_target = cfg, find_target
        self.leads = leads
        self.log, self.alert = log, alert
        self.detector = SpikeDetector.for_section(cfg)
        self.steps: deque[tuple[int, int, int]] = deque(maxlen=cfg.window + cfg.persistence + cfg.confirm_steps)
        """(step, stage index, cursor before the step) of recent steps: enough to rebuild their batches."""
        self.held: deque[int] = deque(maxlen=cfg.persistence)
        """The latest steps whose update skip-step held back (tier 1), for `absorbed`."""
        self.pending: Episode | None = None
        self.rollback_steps: list[int] = []
        self.recurred: list[int] = []
        """Onsets of spikes that recurred on the exact replay with no data to blame: history, kept across rollbacks,
        so a later rollback to before one does not act on it a second time."""

    # ------------------------------------------------------------------ per step

    def start_grace(self, step: int) -> None:
        self.detector.start_grace(step)

    def stage_start(self, step: int, tokens: int) -> None:
        """The loss level shifts (seq_len, RoPE, mixture): a grace period, the trend forgotten."""
        self.start_grace(step)

    def batch_change(self, step: int) -> None:
        """The noise changes with the batch: a grace period, as at a stage start."""
        self.start_grace(step)

    def after_step(self, report: StepReport) -> Decision:
        """Record the step (what rebuilds its batches, whether skip-step held its update back) and judge it."""
        self.record(report.step, report.stage, report.cursor, report.applied)
        return self.judge(report.step, report.observed.loss, report.observed.grad_norm)

    def record(self, step: int, stage: int, cursor_before: int, applied: bool = True) -> None:
        self.steps.append((step, stage, cursor_before))
        if not applied:
            self.held.append(step)

    def protected(self) -> Protected:
        """What retention must keep: the open episode's rollback target, and while a run of suspect steps is open,
        the newest checkpoint from before its onset less one update (where a spike confirmed later rolls back to)."""
        names = frozenset([Path(self.pending.target).name]) if self.pending else frozenset()
        suspect = self.detector.onset()
        return Protected(names, None if suspect is None else suspect - 2)

    def judge(self, step: int, loss: float, grad_norm: float | None) -> Decision:
        """Judge a finished step (its loss averaged over ranks and its gradient norm, on the host). The data of a
        spike are measured later, under the restored weights (the `Rollback`'s `Measure`, then `blame`)."""
        d = self.detector.update(step, loss, grad_norm)
        if d.kind == "suspect":
            return OK
        if d.kind == "ok":
            if self.pending and step >= self.pending.end + self.cfg.confirm_steps:
                self.log.event(ev.TRANSIENT, step, onset=self.pending.onset, end=self.pending.end)
                self.pending = None
            return OK
        if d.onset in self.recurred:  # judged already: the same steps, replayed exactly, with no data to blame
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
        if self._absorbed(d.onset, step):  # tier 1 held back every update of it: the weights never saw it
            self.log.event(ev.ABSORBED, step, onset=d.onset, steps=list(range(d.onset, step + 1)))
            return OK
        # the spike's mean excess over its trend, as the run saw it (inf for a non-finite loss)
        excess = d.zscore * d.noise if d.noise is not None else math.inf
        evidence = {"zscore": d.zscore, "onset": d.onset, "reason": d.reason, "excess": excess}
        p = self.pending
        if p and p.onset - self.cfg.persistence <= d.onset <= p.end:
            if not p.blamed:  # the data measured clean under the pre-spike weights, and it came back
                self.log.event(ev.RECURRED, step, onset=d.onset, evidence=p.evidence)
                self.pending = None
                self.recurred.append(d.onset)
                return OK
            self.pending = replace(p, end=step)  # blamed data were skipped and it came back: measure again
            return self._rollback(Path(p.target), step, d.onset, evidence)
        target = self.find_target(d.onset - 2)
        if target is None:
            return Abort(
                f"spike at step {step} ({d.reason}) and no checkpoint from before step {d.onset - 1}",
                SPIKE_ABORT_EXIT,
            )
        self.pending = Episode(d.onset, step, str(target), excess)
        return self._rollback(target, step, d.onset, evidence)

    def _absorbed(self, onset: int, step: int) -> bool:
        """Every step of the spike had its update held back by skip-step, and fewer than `persistence` updates in
        a row were: a longer run of held-back updates is a run that cannot go on without a rollback."""
        held = set(self.held)
        in_a_row = next(k for k in range(len(held) + 1) if step - k not in held)
        return all(s in held for s in range(onset, step + 1)) and in_a_row < self.cfg.persistence

    def blame(self, measure: Measure, measured: Measured) -> list[tuple[int, int, int]]:
        """After the loop restored the episode's target (the pre-spike weights) and measured `measure`'s steps under
        them: the samples of the spike's steps that stand out, to skip before the replay; logged as `skip` events
        with the evidence, and kept in the episode. Nothing blamed: the replay runs on the same data, and if the
        spike comes back it is `recurred` (the replay is exact, so a recurrence alone says nothing about the
        data)."""
        blamed = blame_samples(measure, measured, self.cfg.skip_margin)
        for stage, a, b in blamed.ranges:
            self.log.event(
                ev.SKIP,
                measure.last,
                stage=stage,
                first=a,
                last=b,
                onset=measure.first,
                blame=blamed.by,
                evidence=blamed.evidence,
            )
        if self.pending is not None:
            self.pending = replace(self.pending, blamed=bool(blamed.ranges), evidence=blamed.evidence)
        return blamed.ranges

    def _rollback(self, target: Path, step: int, onset: int, evidence: dict | None = None) -> Decision:
        recent = [s for s in self.rollback_steps if s > step - self.cfg.rollback_window]
        if len(recent) >= self.cfg.max_rollbacks:
            self.log.event(ev.ROLLBACK_LIMIT, step, rollbacks=len(recent), window=self.cfg.rollback_window)
            return Abort(
                f"{len(recent)} rollbacks within {self.cfg.rollback_window} steps (spikes.max_rollbacks); stopping "
                f"at step {step} with checkpoints intact in {target.parent}",
                SPIKE_ABORT_EXIT,
            )
        self.rollback_steps.append(step)
        return Rollback(target, step, self.measure(onset, step), evidence or {})

    # ------------------------------------------------------------------ blame

    def measure(self, first_step: int, last_step: int) -> Measure:
        """What to measure for a spike over steps `first_step..last_step`: its steps, and up to `REFERENCE_STEPS`
        steps before it in the same stage (the same weights: a sample's loss measured, not a step's replayed), each
        with the stage and data cursor that rebuild its batches."""
        latest = {step: (stage, cursor) for step, stage, cursor in self.steps}  # a replayed step counts once
        suspect_stage = {stage for step, (stage, _) in latest.items() if first_step <= step <= last_step}
        refs = [s for s in sorted(latest) if s < first_step and latest[s][0] in suspect_stage][-REFERENCE_STEPS:]
        steps = [StepAt(s, *latest[s]) for s in sorted(latest) if first_step <= s <= last_step or s in refs]
        excess = self.pending.excess if self.pending is not None else None
        return Measure(first_step, last_step, tuple(steps), excess)

    # ------------------------------------------------------------------ persistence

    def merge_ledger(self, ledger: dict) -> None:
        """After a resume: the run directory's ledger may be newer than the checkpoint (killed during a replay)."""
        self.pending = Episode.from_json(ledger.get("pending"))
        self.rollback_steps = sorted(set(self.rollback_steps) | set(ledger.get("rollbacks", [])))
        self.recurred = sorted(set(self.recurred) | set(ledger.get("recurred", [])))

    def state_dict(self) -> dict:
        return {
            "detector": self.detector.state_dict(),
            "pending": self.pending.to_json() if self.pending is not None else None,
            "rollbacks": self.rollback_steps,
            "recurred": self.recurred,
        }

    def load_state_dict(self, state: dict) -> None:
        self.detector.load_state_dict(state["detector"])
        self.pending = Episode.from_json(state.get("pending"))
        self.rollback_steps = list(state.get("rollbacks", []))
        self.recurred = list(state.get("recurred", []))

    def rewind(self, state: dict) -> None:
        """A rollback restores the detector's trend; the open episode and the rollbacks so far are history."""
        self.detector.load_state_dict(state["detector"])
