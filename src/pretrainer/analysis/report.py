"""The report of a run directory that check_run.py prints: the verdict, per-stage summaries, the train/val gap,
incidents and what each rung of the stability ladder cost, throughput, the latest verified checkpoint, the gradient
noise scale and the measured critical batch, loss by position, downstream scores."""

from __future__ import annotations

import json
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from ..checkpoint import newest_valid, verify
from ..evaluation.context import context_verdict
from ..observe import events as ev
from .critical_batch import measured_lines, read_results
from .runfiles import RunFiles, as_float, load_run, val_of
from .verdicts import add_downstream, replayed, verdict


def _stage_summaries(run: RunFiles) -> list[dict[str, Any]]:
    """First and last loss, last validation and median throughput of each stage that started."""
    stages = {}
    for e in run.events:
        if e["event"] == ev.STAGE_START:
            stages[e["stage"]] = {"name": e["stage"], "start_step": e["step"], "seq_len": e.get("seq_len")}
    train = run.train
    for name, st in stages.items():
        rows = np.flatnonzero(train["stage"] == name)
        if len(rows):
            tps = train["tokens_per_s"][rows]
            tps = tps[np.isfinite(tps)]
            st.update(
                steps_logged=len(rows),
                loss_first=float(train["loss"][rows[0]]),
                loss_last=float(train["loss"][rows[-1]]),
                tokens_per_s=float(np.median(tps)) if len(tps) else None,
            )
        evs = [m for m in run.evals if m.get("stage") == name]
        if evs:
            st["val_last"] = as_float(val_of(evs[-1]))
    return list(stages.values())


def _gap(run: RunFiles) -> dict[str, Any] | None:
    """The train/validation gap at the first and last eval (validation: `val/ref`), and its trend."""
    curve = run.losses
    gaps = []
    for m in run.evals:
        a, b = np.searchsorted(curve.steps, [m["step"] - 10, m["step"] + 1])
        near = curve.values[a:b]
        near = near[np.isfinite(near)]
        if len(near) and m["step"] > 0:
            gaps.append((m["step"], as_float(val_of(m)) - float(np.median(near))))
    if not gaps:
        return None
    trend = gaps[-1][1] - gaps[0][1]
    return {
        "first": gaps[0][1],
        "last": gaps[-1][1],
        "trend": "widening" if trend > 0.05 else "narrowing" if trend < -0.05 else "stable",
    }


CBS_KEYS = ("step", "tokens", "batch_tokens", "cbs_tokens", "lo", "hi", "bounded", "suggested")
"""What check_run's JSON keeps of each critical-batch measurement."""


def _gns_summary(run: RunFiles) -> dict[str, Any] | None:
    """The latest gradient noise scale against the global batch."""
    gns = run.train["gns"]
    gns = gns[np.isfinite(gns)].tolist()
    gbt = ((run.recipe or {}).get("batch") or {}).get("global_batch_tokens")
    changes = [e for e in run.events if e["event"] == ev.BATCH_CHANGE]
    gbt = changes[-1]["global_batch_tokens"] if changes else gbt  # the batch now, under a batch schedule
    if not (gns and gbt and gns[-1] > 0):
        return None
    ratio = gbt / gns[-1]
    return {
        "b_simple_tokens": gns[-1],
        "global_batch_tokens": gbt,
        "ratio": ratio,
        # B_simple is a monitor, not a batch size: it underestimates the critical batch by up to orders of
        # magnitude (docs/BATCH.md), so it never says "shrink the batch" on its own
        "summary": f"gradient noise scale: {gns[-1]:,.0f} tokens (the global batch is {ratio:.2g}x it); it "
        "underestimates the critical batch, so it monitors the trend and does not size the batch",
    }


def gns_advice(measured: bool) -> str:
    """What to act on, said once beside the noise scale."""
    if measured:
        return "  act on the branching measurement below, not on the noise scale"
    return "  to size the batch, measure the critical batch by branching: scripts/critical_batch.py (docs/BATCH.md)"


def gap_reading(gap: dict[str, Any], verdict: str) -> str:
    """Why a widening gap sits beside a verdict that does not call it overfitting."""
    if gap["trend"] != "widening" or verdict == "overfitting":
        return ""
    return (
        ": training loss falls faster than validation (memorisation where the data repeats: `data/repeats/<source>`); "
        "not overfitting while validation still falls"
    )


def report(
    output_dir: str | Path,
    stall_minutes: float = 30.0,
    verify_checkpoint: bool = True,
    deep: bool = True,
    run: RunFiles | None = None,
) -> dict[str, Any]:
    """Everything check_run.py prints: verdict, per-stage summaries, train/val gap, incidents, throughput, latest
    verified checkpoint, gradient noise scale. `run`: as `load_run` read it (read here when not given)."""
    run = run or load_run(output_dir)
    events = run.events
    finished = any(e["event"] == ev.RUN_END for e in events)
    idle = time.time() - run.last_write if run.last_write else None
    val = [(m["step"], val_of(m)) for m in run.evals]
    episodes = replayed(run)
    val_se = {m["step"]: m[ev.VAL_REF_SE] for m in run.evals if ev.VAL_REF_SE in m}
    v, reasons = verdict(run.losses, val, events, finished, idle, stall_minutes, episodes, val_se)
    if (remote := _remote(events)) is not None and remote["failing"]:  # only the event log knew
        reasons = [*reasons, f"remote copies failing: {remote['failed']} failed, last: {remote['last_error']}"]
    out: dict[str, Any] = {"dir": str(run.dir), "verdict": v, "reasons": reasons, "finished": finished}
    if run.damaged:  # read in part or not at all: the report stands on the rest
        out["damaged"] = list(run.damaged)
    out["replayed_spikes"] = [[e["onset"], e["detected"], e["recovered"]] for e in episodes]
    if remote is not None:
        out["remote"] = remote
    train = run.train
    if len(train["step"]):
        out["step"], out["tokens"] = int(train["step"][-1]), int(train["tokens"][-1])

    out["stages"] = _stage_summaries(run)
    if gap := _gap(run):
        out["gap"] = {**gap, "reading": gap_reading(gap, v)}
    out["incidents"] = {
        k: sum(e["event"] == k for e in events) for k in (ev.SPIKE, ev.ROLLBACK, ev.SKIP, ev.TRANSIENT, ev.RESUME)
    }
    out["skips"] = [[e["stage"], e["first"], e["last"]] for e in events if e["event"] == ev.SKIP]
    out["ladder"] = ladder(events)
    tps = train["tokens_per_s"][np.isfinite(train["tokens_per_s"])]
    if len(tps):
        out["throughput"] = {"tokens_per_s_median": float(np.median(tps)), "tokens_per_s_last": float(tps[-1])}

    if verify_checkpoint:  # the latest checkpoint that verifies
        check = partial(verify, scan=deep)  # offline: also read every tensor back for NaN/Inf
        cand, skipped = newest_valid(run.dir / "checkpoints", check=check)
        out["latest_checkpoint"] = (
            {"path": str(cand.path), "step": cand.meta["step"], "skipped": [[str(p), why] for p, why in skipped]}
            if cand
            else None
        )

    if gns := _gns_summary(run):
        out["gns"] = gns
    if measured := read_results(output_dir):
        train = run.train
        out["critical_batch"] = {
            "measured": [{k: r[k] for k in CBS_KEYS} for r in measured],
            "lines": measured_lines(measured, train["step"].tolist(), train["gns"].tolist()),
        }
    if context := _context(run):
        out["context"] = context
    if downstream := _downstream(run):
        out["downstream"] = downstream
    return out


def _remote(events: list[dict]) -> dict | None:
    """Remote copies: uploaded and failed counts, and whether the latest attempt failed (None: no remote)."""
    tries = [e for e in events if e["event"] in (ev.REMOTE_UPLOAD, ev.REMOTE_FAILED)]
    if not tries:
        return None
    failed = [e for e in tries if e["event"] == ev.REMOTE_FAILED]
    return {
        "uploaded": len(tries) - len(failed),
        "failed": len(failed),
        "failing": tries[-1]["event"] == ev.REMOTE_FAILED,
        "last_error": failed[-1]["error"][:200] if failed else None,
    }


def ladder(events: list[dict]) -> dict[str, dict]:
    """What each rung of the stability ladder cost: tier 1 skipped updates (one step's tokens each), tier 2
    rollbacks (the replayed steps' tokens), tier 3 data skips (samples left out; no compute lost); and for spikes
    the layers that moved first (layer statistics)."""
    skipped = [e for e in events if e["event"] == ev.SKIPPED_UPDATE]
    rollbacks = [e for e in events if e["event"] == ev.ROLLBACK]
    skips = [e for e in events if e["event"] == ev.SKIP]
    return {
        "skip_step": {"steps": len(skipped), "tokens": sum(e.get("tokens") or 0 for e in skipped)},
        "rollback": {
            "rollbacks": len(rollbacks),
            "replayed_steps": sum(e.get("replayed") or 0 for e in rollbacks),
            "tokens": sum(e.get("tokens") or 0 for e in rollbacks),
        },
        "data_skip": {"ranges": len(skips), "samples": sum(e["last"] - e["first"] + 1 for e in skips)},
        "leads": [
            {"spike_step": e["step"], **e["layers"]} for e in events if e["event"] == ev.SPIKE and e.get("layers")
        ],
    }


def _context(run: RunFiles) -> dict[str, Any] | None:
    """The latest loss-by-position measurement, judged against the window `final/config.json` advertises (the
    window of the measurement while the run has no `final/`). A measurement that does not read as one (a damaged
    event) is passed over."""
    found = [e for e in run.events if e["event"] == ev.CONTEXT and _context_ok(e)]
    if not found:
        return None
    last = found[-1]
    if not last.get("buckets"):
        return {"step": last["step"], "verdict": last["verdict"]}
    advertised = _advertised(run.dir / "final" / "config.json") or last["window"]
    return {"step": last["step"], "buckets": last["buckets"], **context_verdict(last["buckets"], advertised)}


def _context_ok(e: dict) -> bool:
    def num(v) -> bool:
        return isinstance(v, int | float) and not isinstance(v, bool)

    buckets = e.get("buckets")
    if not buckets:
        return isinstance(e.get("verdict"), str)
    return (
        isinstance(buckets, list)
        and type(e.get("window")) is int
        and all(isinstance(b, dict) and all(num(b.get(k)) for k in ("lo", "hi", "loss", "se")) for b in buckets)
    )


def _advertised(config: Path) -> int | None:
    """`max_position_embeddings` of an exported config (None: none, or not readable as one)."""
    try:
        value = json.loads(config.read_text(encoding="utf-8")).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        return None
    return value if type(value) is int else None


def _downstream(run: RunFiles) -> dict[str, dict] | None:
    """Each lm-eval score at its first and latest eval (the first is the untrained baseline when scored at step 0)."""
    out: dict[str, dict] = {}
    for m in run.evals:
        add_downstream(out, m["step"], m)
    return out or None


def format_report(r: dict[str, Any]) -> str:
    lines = [f"verdict: {r['verdict']}  ({'; '.join(r['reasons'])})", f"run: {r['dir']}"]
    for what in r.get("damaged", []):
        lines.append(f"warning: damaged file, read up to the damage or left out: {what}")
    if "step" in r:
        lines.append(f"step {r['step']:,}, tokens {r.get('tokens') or 0:,}, {'finished' if r['finished'] else 'live'}")
    for st in r["stages"]:
        if "loss_first" in st:
            tps = f", {st['tokens_per_s']:,.0f} tok/s" if st.get("tokens_per_s") else ""
            val = f", val {st['val_last']:.4g}" if "val_last" in st else ""
            lines.append(
                f"  stage {st['name']:<10} from step {st['start_step']:>7,}: loss {st['loss_first']:.4g} -> "
                f"{st['loss_last']:.4g}{val}{tps}"
            )
    if "gap" in r:
        g = r["gap"]
        lines.append(f"train/val gap: {g['first']:+.4f} -> {g['last']:+.4f} ({g['trend']}){g.get('reading', '')}")
    inc = r["incidents"]
    lines.append(", ".join(f"{k}s: {v}" for k, v in inc.items()))
    if rem := r.get("remote"):
        lines.append(f"remote copies: {rem['uploaded']} uploaded, {rem['failed']} failed")
    if r["skips"]:
        lines.append(f"skipped sample ranges: {r['skips']}")
    if lad := r.get("ladder"):
        t1, t2, t3 = lad["skip_step"], lad["rollback"], lad["data_skip"]
        lines.append(
            f"tokens lost per tier: skip-step {t1['steps']} step(s), {t1['tokens']:,} tokens; rollback "
            f"{t2['rollbacks']} ({t2['replayed_steps']:,} steps replayed, {t2['tokens']:,} tokens); data skip "
            f"{t3['ranges']} range(s), {t3['samples']:,} samples"
        )
        for lead in lad["leads"]:
            lines.append(
                f"  spike at step {lead['spike_step']:,}: layers moved first at step {lead['step']:,} "
                f"({lead['steps_before']} steps before the onset): {lead['moved']}"
            )
    if "throughput" in r:
        lines.append(f"throughput: {r['throughput']['tokens_per_s_median']:,.0f} tokens/s (median)")
    if "latest_checkpoint" in r:
        c = r["latest_checkpoint"]
        lines.append(f"latest verified checkpoint: {c['path']} (step {c['step']})" if c else "no verified checkpoint")
    if "gns" in r:
        lines += [r["gns"]["summary"], gns_advice("critical_batch" in r)]
    lines += r.get("critical_batch", {}).get("lines", [])
    if "context" in r:
        c = r["context"]
        lines.append(f"context (step {c['step']:,}): {c['verdict']}")
        if c.get("buckets"):
            lines.append(
                "  loss by position: " + ", ".join(f"{b['lo']}-{b['hi']} {b['loss']:.3f}" for b in c["buckets"])
            )
    for name, d in (r.get("downstream") or {}).items():
        lines.append(
            f"downstream {name}: {d['first']:.5g} (step {d['first_step']:,}) -> {d['last']:.5g} "
            f"(step {d['last_step']:,})"
        )
    return "\n".join(lines)
