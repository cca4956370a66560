"""The W&B workspace a pretraining run is read by, as plain data: sections of line plots over `train/step`, chosen
from the keys a run actually logged (its sources, its per-layer statistics, its optimizer's). scripts/wandb_workspace.py
turns it into W&B's workspace objects and saves it; a test holds it to the keys of a real run."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from . import events as ev

X_AXIS = "train/step"


def _panel(title: str, y: list[str], x: str = X_AXIS, **options: Any) -> dict[str, Any]:
    return {"title": title, "x": x, "y": y, **options}


def workspace_spec(keys: Iterable[str]) -> list[dict[str, Any]]:
    """Sections (name, panels) for a run that logged `keys` (its tracked metric names). A panel whose keys the run
    never logged is left out; `marker/<kind>` (a step, not a quantity) is never plotted: `incidents/<kind>` is,
    a staircase that steps up at each incident."""
    keys = set(keys)

    def have(*names: str) -> list[str]:
        return [k for k in names if k in keys]

    def prefixed(prefix: str, suffix: str = "") -> list[str]:
        return sorted(k for k in keys if k.startswith(prefix) and k.endswith(suffix) and not k.endswith("_se"))

    sources = [k for k in prefixed("val/") if k not in ("val/ref", "val/ref_merged", "val/avg")]
    incidents = prefixed("incidents/")
    sections = [
        (
            "Loss",
            [
                _panel("training loss and val/ref", have("loss", "val/ref", "val/ref_merged")),
                _panel("val/ref against tokens", have("val/ref", "val/ref_merged"), x="train/tokens"),
                _panel(
                    "val/ref and its forecast (90% band)",
                    have("val/ref", "forecast/final", "forecast/final_lo", "forecast/final_hi"),
                ),
                _panel("validation loss per source", have("val/avg") + sources),
                _panel("stages (each step up: a stage starts)", have("incidents/stage_start")),
                _panel("loss by position in the context", prefixed("val_pos/")),
            ],
        ),
        (
            "Optimization",
            [
                _panel("learning rate", have("lr")),
                _panel("gradient norm (before clipping)", have("grad_norm"), log_y=True),
                _panel("batch (tokens)", have("batch_tokens", "gns/b_simple"), log_y=True),
                _panel("z-loss", have("loss/z")),
                _panel("update RMS per optimizer", prefixed("optim/", "update_rms")),
                _panel("Muon orthogonality error", have("optim/muon/ortho_err")),
            ],
        ),
        (
            "Incidents",
            [
                _panel("incidents (cumulative; each step up: one incident)", incidents),
                _panel("tokens lost to skipped updates", have("instability/tokens_lost")),
                _panel("forecast off track (1: above the band)", have("forecast/off_track")),
                _panel("data repeats per source", prefixed("data/repeats/")),
            ],
        ),
        (
            "Per-layer statistics",
            [_panel(k.removeprefix("layers/"), [k]) for k in prefixed("layers/", "_max")]
            + [_panel("layer of each maximum", prefixed("layers/", "_argmax"))],
        ),
        (
            "Throughput",
            [
                _panel("tokens per second", have("tokens_per_s")),
                _panel("MFU", have("mfu")),
                _panel("seconds per step, data wait", have("step_time_s", "data_wait")),
                _panel("memory (GB)", prefixed("mem/")),
                _panel("checkpoint: seconds the loop was blocked", have("ckpt/blocked_s")),
                _panel("eval seconds (held-out, lm-eval)", have("eval/seconds", "eval/lm_eval_seconds")),
            ],
        ),
    ]
    downstream = [k for k in prefixed(ev.EVAL_PREFIX) if ev.is_downstream_key(k)]
    if downstream:
        sections.append(("Downstream", [_panel(k.removeprefix("eval/"), [k]) for k in downstream]))
    return [
        {"name": name, "panels": [p for p in panels if p["y"]]}
        for name, panels in sections
        if any(p["y"] for p in panels)
    ]


def plotted(spec: list[dict[str, Any]]) -> set[str]:
    """Every key some panel of `spec` draws."""
    return {k for section in spec for panel in section["panels"] for k in panel["y"]}
