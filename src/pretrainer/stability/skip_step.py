"""Tier 1 of the stability ladder: absorb a bad step in place by not applying its update.

The ladder, in one place (the loop acts on each rung's decision):
1. **skip** (here): one step whose loss or pre-clip gradient norm is an outlier against the last `window` steps
   (mean + `sigmas` sd, OLMo 3's rule; a gradient norm must also be `grad_norm_ratio` x the mean) is not applied: weights and optimizer moments untouched, the LR schedule moves
   on. One step's tokens are lost. A non-finite loss or norm is always skipped.
2. **rollback** (recovery.py): a spike that persists `spikes.persistence` steps against the loss trend restores the
   last good checkpoint and replays.
3. **blame and skip data** (recovery.py): a spike that recurs on the replay skips the samples to blame.

The rule sees the host values the NaN guard reads anyway (the loss averaged over ranks and the global gradient norm),
so it adds no host synchronisation, and every rank reaches the same verdict from the same numbers. Under DeepSpeed,
whose engine steps inside `backward`, the same limits are applied on the device (ds_gate.py).
"""

from __future__ import annotations

import math
from collections import deque

from ..observe import events as ev
from ..recipe.stability import SkipStepSection
from .decisions import Observed, Part, Skipped, StepReport


def _mean_sd(values: deque[float]) -> tuple[float, float]:
    """Mean and sample sd in floats (statistics.stdev's exact fractions cost ~80 us per call on 128 values)."""
    n = len(values)
    mean = math.fsum(values) / n
    return mean, math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))


class SkipStep(Part):
    """The skip rule's history and verdicts; a part of the run state (checkpointed, rewound on rollback). The step
    asks `judge` before the update; as a part it counts and logs the updates held back, and restarts its history
    at each stage start and batch change."""

    def __init__(self, cfg: SkipStepSection, log=None):
        """Args:
        log: the run log its `skipped_update` events go to."""
        self.cfg = cfg
        self.log = log
        self.losses: deque[float] = deque(maxlen=cfg.window)
        self.norms: deque[float] = deque(maxlen=cfg.window)
        self.skipped = 0
        self.tokens_lost = 0

    def limits(self) -> tuple[float, float] | None:
        """(loss limit, gradient-norm limit) for the next step; None while the history is too short or the rule is
        off (then only non-finite steps are skipped)."""
        if not self.cfg.enabled or len(self.losses) < self.cfg.min_history:
            return None
        k = self.cfg.sigmas
        mean, sd = _mean_sd(self.losses)
        loss_limit = mean + k * sd
        if len(self.norms) < 2:
            return loss_limit, math.inf
        mean, sd = _mean_sd(self.norms)
        return loss_limit, max(mean + k * sd, self.cfg.grad_norm_ratio * mean)

    def judge(self, loss: float, grad_norm: float | None) -> Skipped | None:
        """The reason to skip this step and the limit it crossed, or None to apply it. Records the step's values
        (finite ones) in the history either way."""
        finite = math.isfinite(loss) and (grad_norm is None or math.isfinite(grad_norm))
        verdict = None if finite else Skipped("non_finite", math.nan)
        if finite and (lim := self.limits()) is not None:
            loss_limit, norm_limit = lim
            if loss > loss_limit:
                verdict = Skipped("loss", loss_limit)
            elif grad_norm is not None and grad_norm > norm_limit:
                verdict = Skipped("grad_norm", norm_limit)
        if finite:
            self.losses.append(loss)
            if grad_norm is not None:
                self.norms.append(grad_norm)
        return verdict

    def after_step(self, report: StepReport) -> None:
        """A step's update was held back (tier 1): count it and its tokens, and log the `skipped_update` event."""
        if report.skipped is not None:
            self.lost(report.step, report.observed, report.skipped, report.batch_tokens)

    def lost(self, step: int, observed: Observed, skipped: Skipped, tokens: int) -> None:
        self.skipped += 1
        self.tokens_lost += tokens
        self.log.event(
            ev.SKIPPED_UPDATE,
            step,
            loss=observed.loss,
            grad_norm=observed.grad_norm,
            reason=skipped.reason,
            limit=skipped.limit,
            tokens=tokens,
        )

    def start_stage(self) -> None:
        """A new stage shifts the loss level (seq_len, RoPE, mixture): judge it against its own steps only."""
        self.losses.clear()
        self.norms.clear()

    def stage_start(self, step: int, tokens: int) -> None:
        self.start_stage()

    def batch_change(self, step: int) -> None:
        """A larger batch has less gradient noise: its norms are judged against their own history too."""
        self.start_stage()

    def state_dict(self) -> dict:
        return {
            "losses": list(self.losses),
            "norms": list(self.norms),
            "skipped": self.skipped,
            "tokens_lost": self.tokens_lost,
        }

    def load_state_dict(self, state: dict) -> None:
        self.losses = deque(state["losses"], maxlen=self.cfg.window)
        self.norms = deque(state["norms"], maxlen=self.cfg.window)
        self.skipped, self.tokens_lost = state["skipped"], state["tokens_lost"]

    def rewind(self, state: dict) -> None:
        """A rollback restores the history (the replay judges as the first pass did); the counts are history."""
        self.losses = deque(state["losses"], maxlen=self.cfg.window)
        self.norms = deque(state["norms"], maxlen=self.cfg.window)
