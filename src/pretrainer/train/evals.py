"""One eval round of the loop: held-out losses (and loss by position), downstream scores, the merged weights'
`val/ref`, the forecast refitted on `val/ref`, and the trend verdict; logged as one metrics row and its events."""

from __future__ import annotations

from ..analysis.outlook import Forecaster
from ..analysis.verdicts import HealthMonitor
from ..evaluation.downstream import Downstream
from ..evaluation.validation import Evaluator
from ..observe import events as ev
from .averaging import WeightAverage


class EvalRound:
    def __init__(
        self,
        *,
        evaluate: Evaluator,
        downstream: Downstream,
        forecaster: Forecaster | None,
        log,
        health: HealthMonitor | None,
        average: WeightAverage | None,
    ):
        """Args:
        evaluate: the held-out losses (and loss by position).
        downstream: lm-eval's scores, when the recipe asks for them.
        forecaster: the forecast part (None when `eval.forecast` is off).
        health: the main process's HealthMonitor (None elsewhere).
        average: the WeightAverage part (None when averaging is off)."""
        self.evaluate = evaluate
        self.downstream = downstream
        self.forecaster = forecaster
        self.log = log
        self.health = health
        self.average = average

    def baseline(self, span) -> dict[str, float]:
        """At initialisation: every later validation loss is read against it."""
        return {**self.evaluate(span.seq_len, span.micro_batch_size), **self.downstream(0)}

    def merged(self) -> dict[str, float]:
        """`val/ref` of the merged weights, swapped in for this one forward pass over the reference batches."""
        if self.average is None:
            return {}
        with self.average.swapped() as ready:
            return {ev.VAL_REF_MERGED: self.evaluate.reference()} if ready else {}

    def __call__(self, step: int, tokens: int, span, context: bool) -> dict[str, float]:
        vals = {
            **self.evaluate(span.seq_len, span.micro_batch_size, context),
            **self.merged(),
            **self.downstream(step),
        }
        forecast = None
        if self.forecaster is not None and ev.VAL_REF in vals:  # the loss curve's law, refitted on val/ref
            self.forecaster.observe(step, vals[ev.VAL_REF])
            if (forecast := self.forecaster.forecast()) is not None:
                vals.update(forecast.metrics)
        self.log.metrics(step, {"tokens": tokens, "stage": span.name, **vals})
        if forecast is not None:
            self.log.event(ev.FORECAST, step, **forecast.event)
            if forecast.drift is not None:
                self.log.event(ev.OFF_TRACK, step, **forecast.drift)
        if self.evaluate.context is not None:
            self.log.event(ev.CONTEXT, step, **self.evaluate.context)
        if self.health is not None:  # the same verdict as check_run.py, on what is logged so far
            verdict, reasons = self.health.verdict()
            self.log.event(ev.HEALTH, step, verdict=verdict, reasons=reasons)
        return vals
