"""Run health from metrics.jsonl and events.jsonl: a verdict judged on trends over many steps, never one point.

Verdicts, first match wins: `stalled` (no logs, or none for a while in an unfinished run), `diverging` (the smoothed
training loss has risen well above its best, or ends non-finite), `overfitting` (validation rises while training
falls), `plateaued` (no measurable progress over the last quarter of the run), `recovered from spikes` (spikes
happened, the trend is healthy now), `healthy`. Trends use medians over windows, so a single spike moves nothing.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from ..checkpoint import newest_valid, verify
from ..evaluation.context import context_verdict
from ..observe import events as ev
from ..observe.steprecord import Record, read_record
from ..observe.tracking import read_jsonl
from ..recipe.sections import SpikesSection
from ..stats import diff_scatter
from .critical_batch import measured_lines, read_results
from .replay import lived_episodes, spike_episodes, timeline

DIVERGE_RATIO = 0.10
"""Smoothed loss this far (relative) above its best window is diverging."""
PLATEAU_RATIO = 0.002
"""Less relative improvement than this between the last two quarters is a plateau."""
OVERFIT_RATIO = 0.02
EVAL_SIGMAS = 3.0
"""A validation rise must also exceed this many standard errors of the difference (the two evals' `val/ref_se`)."""
"""Validation this far above its best, while training still falls, is overfitting."""


class LossSeries:
    """A per-step loss curve as two arrays (a long run has millions of steps: no Python tuple per step)."""

    def __init__(self, steps: np.ndarray, values: np.ndarray):
        self.steps, self.values = np.asarray(steps, np.int64), np.asarray(values, float)

    @classmethod
    def of(cls, pairs) -> LossSeries:
        if isinstance(pairs, LossSeries):
            return pairs
        pairs = list(pairs)
        return cls(np.array([s for s, _ in pairs], np.int64), np.array([as_float(v) for _, v in pairs], float))

    def __len__(self) -> int:
        return len(self.steps)

    def __iter__(self):
        return zip(self.steps.tolist(), self.values.tolist())


TRAIN_COLUMNS = ("step", "stage", "loss", "tokens", "tokens_per_s", "lr", "grad_norm", "gns")
"""What the report and the plot read of the training rows (`gns`: the row's `gns/b_simple`)."""


def _columns(rows: list[dict]) -> dict[str, np.ndarray]:
    """Training rows (dicts from metrics.jsonl) as the report's columns."""
    key = {"gns": "gns/b_simple"}
    numeric = [c for c in TRAIN_COLUMNS if c not in ("step", "stage", "tokens")]
    out = {c: np.array([as_float(m.get(key.get(c, c))) for m in rows], float) for c in numeric}
    out["step"] = np.array([m["step"] for m in rows], np.int64)
    out["stage"] = np.array([m.get("stage") for m in rows], object)
    out["tokens"] = np.array([m.get("tokens") or 0 for m in rows], np.int64)
    return out


def _record_columns(rec: Record, final: np.ndarray, stages: list[str]) -> dict[str, np.ndarray]:
    """The same columns from the record's logged rows on the final timeline: a row is there when its epoch is the
    epoch that step has on it (a step is run once per epoch)."""
    rows, whole = rec.rows, len(final) == len(rec)
    on_step, on_epoch = (rec.step, rec.epoch) if whole else (rec.step[final], rec.epoch[final])
    at = np.searchsorted(on_step, rows["step"])
    ok = at < len(on_step)
    ok[ok] &= on_step[at[ok]] == rows["step"][ok]
    ok[ok] &= on_epoch[at[ok]] == rows["epoch"][ok]
    rows = {k: v[ok] for k, v in rows.items()}
    order = np.argsort(rows["step"], kind="stable")
    rows = {k: v[order] for k, v in rows.items()}
    names = np.array(stages or ["?"], object)
    return {
        "step": rows["step"].astype(np.int64),
        "stage": names[np.minimum(rows["stage"].astype(np.int64), len(names) - 1)],
        "loss": rows["row_loss"],
        "tokens": rows["tokens"].astype(np.int64),
        "tokens_per_s": rows["tokens_per_s"],
        "lr": rows["lr"],
        "grad_norm": rows["grad_norm"].astype(float),
        "gns": rows["gns"],
    }


def load_run(output_dir: str | Path) -> dict[str, Any]:
    """Metrics, events and the per-step record of a run (live or finished). A step logged again after a rollback or
    resume replaces the earlier one in `losses` and `train`; `record` keeps every step as lived (None for runs
    written before it existed, whose per-step losses come from metrics.jsonl).

    With a record, metrics.jsonl is not parsed whole: only its eval lines are (found by a byte search), so a
    10M-step run reads in seconds in bounded memory."""
    d = Path(output_dir)
    events = read_jsonl(d / "events.jsonl")
    recipe = None
    if (d / "recipe.resolved.yaml").exists():
        recipe = yaml.safe_load((d / "recipe.resolved.yaml").read_text())
    mtime = (d / "metrics.jsonl").stat().st_mtime if (d / "metrics.jsonl").exists() else None
    rec = read_record(d)
    if rec is not None:
        evals = {m["step"]: m for m in _eval_rows(d / "metrics.jsonl")}
        final = timeline(rec.step)
        whole = len(final) == len(rec)  # nothing re-run: no copies
        losses = LossSeries(
            rec.step if whole else rec.step[final], (rec.loss if whole else rec.loss[final]).astype(float)
        )
        stages = [st.get("name") for st in (recipe or {}).get("stages") or []]
        train = _record_columns(rec, final, stages)
    else:
        train_rows: dict[int, dict] = {}
        evals, per_step = {}, {}
        for line, m in _rows(d / "metrics.jsonl"):
            if '"val/' in line and any(k.startswith("val/") for k in m):  # the text test first: 1M rows
                evals[m["step"]] = m
            elif "loss" in m:
                train_rows[m["step"]] = m
                for s, v in m.get("step_losses", []):
                    per_step[s] = v
        ordered = [train_rows[s] for s in sorted(train_rows)]
        losses = LossSeries.of(sorted(per_step.items()) or [(m["step"], m["loss"]) for m in ordered])
        train = _columns(ordered)
    return {
        "dir": d,
        "train": train,
        "evals": [evals[s] for s in sorted(evals)],
        "losses": losses,
        "record": rec,
        "final": final if rec is not None else None,
        "events": events,
        "recipe": recipe,
        "last_write": mtime,
    }


EVAL_MARKER = b"val/"
"""In every `val/...` and `eval/...` key: one search finds both (each search is a pass over the file, ~0.6 ns a
byte)."""
CHUNK_BYTES = 1 << 24


def _eval_rows(path: Path):
    """The eval lines of a metrics file, found by a byte search in 16 MB chunks (they are ~1% of the lines: parsing
    the rest would cost ~20 s per GB of JSON); a torn line is skipped."""
    if not path.exists():
        return
    with open(path, "rb") as f:
        tail = b""
        while chunk := f.read(CHUNK_BYTES):
            buf = tail + chunk
            cut = buf.rfind(b"\n") + 1
            yield from _marked_lines(buf, cut)  # searched in place: no copy of the chunk's whole lines
            tail = buf[cut:]
        yield from _marked_lines(tail, len(tail))


def _marked_lines(buf: bytes, stop: int):
    """The eval lines of `buf[:stop]`."""
    starts = []
    at = buf.find(EVAL_MARKER, 0, stop)
    while at >= 0:
        starts.append(buf.rfind(b"\n", 0, at) + 1)
        end = buf.find(b"\n", at, stop)
        at = buf.find(EVAL_MARKER, end, stop) if end >= 0 else -1
    for start in starts:
        end = buf.find(b"\n", start, stop)
        try:
            m = json.loads(buf[start : end if end >= 0 else stop])
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        if any(k.startswith(("val/", "eval/")) for k in m):
            yield m


def _rows(path: Path):
    """(line, record) of a metrics file, streamed (a long run's file is ~100 MB); a torn line is skipped."""
    if not path.exists():
        return
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                yield line, json.loads(line)
            except json.JSONDecodeError:
                continue


def spike_rule(run: dict[str, Any]) -> SpikesSection:
    """The run's own `spikes` section, as the live loop used it (the defaults for a run without a resolved recipe,
    or one written before a field existed)."""
    section = ((run["recipe"] or {}).get("spikes")) or {}
    try:
        return SpikesSection.model_validate(section)
    except ValueError:  # a recipe from another version: its known fields, the defaults for the rest
        known = {k: v for k, v in section.items() if k in SpikesSection.model_fields}
        try:
            return SpikesSection.model_validate(known)
        except ValueError:
            return SpikesSection()


def grace_starts(run: dict[str, Any]) -> list[int]:
    """Where the live spike rule restarted its grace period and forgot its trend: each stage start and each batch
    change after step 0."""
    kinds = (ev.STAGE_START, ev.BATCH_CHANGE)
    return sorted({e["step"] for e in run["events"] if e["event"] in kinds and e["step"] > 0})


def warmup_of(run: dict[str, Any]) -> int:
    """The grace the live rule started with: judging begins `grace_steps` after warmup."""
    return int((((run["recipe"] or {}).get("schedule") or {}).get("warmup_steps")) or 0)


def replayed(run: dict[str, Any]) -> list[dict]:
    """The live spike rule replayed with the run's own section: over what the run lived (its record: rolled-back
    and re-run steps included), or over the logged final timeline for runs written before the record."""
    cfg, graces, start = spike_rule(run), grace_starts(run), warmup_of(run)
    if (rec := run.get("record")) is not None:
        return lived_episodes(rec.step, rec.judged_loss(), rec.epoch, graces, cfg, start, run.get("final"))
    curve = run["losses"]
    return spike_episodes((curve.steps, curve.values), graces, cfg, start)


def val_of(m: dict) -> Any:
    """An eval line's comparable validation loss: `val/ref` (one fixed context and batches for the whole run), or
    `val/avg` in runs from before it existed."""
    return m.get(ev.VAL_REF, m.get(ev.VAL_AVG))


def as_float(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def _windows(values: np.ndarray, k: int) -> list[float]:
    """Medians of consecutive windows of `k` values (a partial last window left out)."""
    n = len(values) // k * k
    return np.median(values[:n].reshape(-1, k), axis=1).tolist() if n else []


def verdict(
    losses: list[tuple[int, float]],
    val: list[tuple[int, float]],
    events: list[dict],
    finished: bool,
    idle_s: float | None,
    stall_minutes: float = 30.0,
    episodes: list[dict] | None = None,
    val_se: dict[int, float] | None = None,
) -> tuple[str, list[str]]:
    """The verdict and the reasons for it (see the module docstring).

    Args:
        val_se: the standard error of each eval's `val/ref` (`val/ref_se`, from its fixed batches' spread): a rise
            of the validation loss counts only beyond `EVAL_SIGMAS` of it and of the series' own eval-to-eval
            scatter (`eval_scatter`), so a small, noisy eval set or a noisy run does not
            turn a healthy run into `overfitting`. Runs without it judge the ratio alone.
        episodes: spikes found by replaying the live rule over `losses` (`spike_replay.spike_episodes`); the live check
            passes None, since the live detector's own spikes are in `events`.
    """
    curve = LossSeries.of(losses)
    if not len(curve):
        return "stalled", ["no training metrics logged"]
    if not finished and idle_s is not None and idle_s > stall_minutes * 60:
        return "stalled", [f"no metrics for {idle_s / 60:.0f} minutes and no run_end"]
    values = curve.values
    tail = values[-max(3, len(values) // 20) :]
    if int((~np.isfinite(tail)).sum()) > len(tail) // 2:
        return "diverging", ["the latest training losses are not finite"]
    finite = values[np.isfinite(values)]
    k = max(3, len(finite) // 10)
    meds = _windows(finite, k)
    reasons: list[str] = []
    if len(meds) >= 3:
        best, last = min(meds[:-1]), meds[-1]
        if last > best * (1 + DIVERGE_RATIO) and last > meds[-2]:
            return "diverging", [f"smoothed loss {last:.4g} is {last / best - 1:.0%} above its best {best:.4g}"]
    last_step = int(curve.steps[-1])
    unrecovered = [e for e in episodes or [] if e["recovered"] is None and last_step - e["onset"] >= 10]
    if unrecovered:
        return "diverging", [f"the loss has stayed above its trend since a spike at step {unrecovered[-1]['onset']}"]
    vals = [(s, as_float(v)) for s, v in val if math.isfinite(as_float(v))]
    if len(vals) >= 3 and len(meds) >= 3:
        # levels, not single evals: the median of each eval and the two before it (the minimum of raw noisy evals
        # is biased low, and one high eval is no trend)
        v = [x for _, x in vals]
        level = [statistics.median(v[max(0, i - 2) : i + 1]) for i in range(len(v))]
        best = min(range(len(v) - 1), key=level.__getitem__)
        best_val, now = level[best], level[-1]
        se = val_se or {}
        noise = EVAL_SIGMAS * max(
            math.hypot(se.get(vals[-1][0]) or 0.0, se.get(vals[best][0]) or 0.0), math.sqrt(2) * eval_scatter(vals)
        )
        rising = now - best_val > max(best_val * OVERFIT_RATIO, noise) and v[-1] > v[-2]
        if rising and meds[-1] <= meds[-2]:
            return "overfitting", [
                f"validation {now:.4g} (median of the last 3 evals) rose {now / best_val - 1:.1%} above its best "
                f"{best_val:.4g} while training kept falling"
            ]
    if len(finite) >= 40:
        q = len(finite) // 4
        prev, last = float(np.median(finite[-2 * q : -q])), float(np.median(finite[-q:]))
        # "no measurable progress" needs medians that would measure PLATEAU_RATIO: the sd of their difference (1.2533
        # sd / sqrt(q) each, sd the per-step scatter) under it. Early in a run with a small batch they do not (a micro
        # run's first 40 steps at 1,024 tokens: 1.5% against 0.2%), and a brief early plateau is no verdict.
        resolution = math.sqrt(2) * 1.2533 * diff_scatter(finite[-2 * q :]) / math.sqrt(q)
        if (prev - last) / abs(prev) < PLATEAU_RATIO and resolution <= PLATEAU_RATIO * abs(prev):
            return "plateaued", [f"the last quarter improved {(prev - last) / abs(prev):.2%} on the one before"]
    n_spikes = max(sum(e["event"] == ev.SPIKE for e in events), len(episodes or []))
    if n_spikes:
        reasons.append(
            f"{n_spikes} spike(s), {sum(e['event'] == 'rollback' for e in events)} rollback(s); trend healthy"
        )
        return "recovered from spikes", reasons
    return "healthy", ["loss trend falling, no spikes"]


def eval_scatter(vals: list[tuple[int, float]], last: int = 10) -> float:
    """The eval-to-eval noise of a validation series: the robust sd of its last `last` successive differences (about
    their median, so a steady trend is not noise) over sqrt(2). It holds what `val/ref_se` cannot: the weights
    themselves move between evals (a high LR, a small batch), so two evals of the same batches differ by more than
    their batches' spread. 0 with fewer than 7 differences (too few to tell scatter from a bend in the curve)."""
    v = [x for _, x in vals[-(last + 1) :]]
    return diff_scatter(v) if len(v) >= 8 else 0.0


class HealthMonitor:
    """The live verdict during training, fed incrementally from the records the run logs (the `RunLog`'s reader),
    so a check costs no file I/O; seeded once from a resumed run's files. The same `verdict` as check_run.py."""

    def __init__(self, output_dir: str | Path | None = None):
        self.losses: dict[int, float] = {}
        self.val: dict[int, Any] = {}
        self.val_se: dict[int, float] = {}
        self.incidents: list[dict] = []
        self.context: dict | None = None
        """The latest `context` event's details (loss by position and its verdict)."""
        if output_dir is not None:
            run = load_run(output_dir)
            self.losses.update(run["losses"])  # (step, loss) pairs
            self.val.update((m["step"], val_of(m)) for m in run["evals"])
            self.val_se.update((m["step"], m[ev.VAL_REF_SE]) for m in run["evals"] if ev.VAL_REF_SE in m)
            self.incidents = [e for e in run["events"] if e["event"] in (ev.SPIKE, ev.ROLLBACK)]
            self.context = next((e for e in reversed(run["events"]) if e["event"] == ev.CONTEXT), None)

    def on_metrics(self, step: int, values: dict[str, Any]) -> None:
        if ev.VAL_REF in values or ev.VAL_AVG in values:
            self.val[step] = val_of(values)
            if (se := values.get(ev.VAL_REF_SE)) is not None:
                self.val_se[step] = se
        elif ev.LOSS in values:
            # a step logged again after a rollback replaces the earlier value, as in load_run
            self.losses.update((s, v) for s, v in values.get("step_losses") or [(step, values["loss"])])

    def on_event(self, kind: str, step: int, details: dict[str, Any]) -> None:
        if kind in (ev.SPIKE, ev.ROLLBACK):
            self.incidents.append({"event": kind, "step": step})
        elif kind == ev.CONTEXT:
            self.context = {"step": step, **details}

    def verdict(self) -> tuple[str, list[str]]:
        losses = sorted(self.losses.items())
        return verdict(
            losses, sorted(self.val.items()), self.incidents, finished=False, idle_s=0.0, val_se=self.val_se
        )


def _stage_summaries(run: dict[str, Any]) -> list[dict[str, Any]]:
    """First and last loss, last validation and median throughput of each stage that started."""
    stages = {}
    for e in run["events"]:
        if e["event"] == ev.STAGE_START:
            stages[e["stage"]] = {"name": e["stage"], "start_step": e["step"], "seq_len": e.get("seq_len")}
    train = run["train"]
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
        evs = [m for m in run["evals"] if m.get("stage") == name]
        if evs:
            st["val_last"] = as_float(val_of(evs[-1]))
    return list(stages.values())


def _gap(run: dict[str, Any]) -> dict[str, Any] | None:
    """The train/validation gap at the first and last eval (validation: `val/ref`), and its trend."""
    curve = run["losses"]
    gaps = []
    for m in run["evals"]:
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


def _gns_summary(run: dict[str, Any]) -> dict[str, Any] | None:
    """The latest gradient noise scale against the global batch."""
    gns = run["train"]["gns"]
    gns = gns[np.isfinite(gns)].tolist()
    gbt = ((run["recipe"] or {}).get("batch") or {}).get("global_batch_tokens")
    changes = [e for e in run["events"] if e["event"] == ev.BATCH_CHANGE]
    gbt = changes[-1]["global_batch_tokens"] if changes else gbt  # the batch now, under a batch schedule
    if not (gns and gbt and gns[-1] > 0):
        return None
    ratio = gbt / gns[-1]
    return {
        "b_simple_tokens": gns[-1],
        "global_batch_tokens": gbt,
        "ratio": ratio,
        "summary": f"the global batch is {ratio:.2g}x the estimated critical batch ({gns[-1]:,.0f} tokens)",
    }


def report(
    output_dir: str | Path,
    stall_minutes: float = 30.0,
    verify_checkpoint: bool = True,
    deep: bool = True,
    run: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Everything check_run.py prints: verdict, per-stage summaries, train/val gap, incidents, throughput, latest
    verified checkpoint, gradient noise scale. `run`: as `load_run` read it (read here when not given)."""
    run = run or load_run(output_dir)
    events = run["events"]
    finished = any(e["event"] == ev.RUN_END for e in events)
    idle = time.time() - run["last_write"] if run["last_write"] else None
    val = [(m["step"], val_of(m)) for m in run["evals"]]
    episodes = replayed(run)
    val_se = {m["step"]: m[ev.VAL_REF_SE] for m in run["evals"] if ev.VAL_REF_SE in m}
    v, reasons = verdict(run["losses"], val, events, finished, idle, stall_minutes, episodes, val_se)
    if (remote := _remote(events)) is not None and remote["failing"]:  # only the event log knew
        reasons = [*reasons, f"remote copies failing: {remote['failed']} failed, last: {remote['last_error']}"]
    out: dict[str, Any] = {"dir": str(run["dir"]), "verdict": v, "reasons": reasons, "finished": finished}
    out["replayed_spikes"] = [[e["onset"], e["detected"], e["recovered"]] for e in episodes]
    if remote is not None:
        out["remote"] = remote
    train = run["train"]
    if len(train["step"]):
        out["step"], out["tokens"] = int(train["step"][-1]), int(train["tokens"][-1])

    out["stages"] = _stage_summaries(run)
    if gap := _gap(run):
        out["gap"] = gap
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
        cand, skipped = newest_valid(run["dir"] / "checkpoints", check=check)
        out["latest_checkpoint"] = (
            {"path": str(cand.path), "step": cand.meta["step"], "skipped": [[str(p), why] for p, why in skipped]}
            if cand
            else None
        )

    if gns := _gns_summary(run):
        out["gns"] = gns
    if measured := read_results(output_dir):
        train = run["train"]
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


def _context(run: dict[str, Any]) -> dict[str, Any] | None:
    """The latest loss-by-position measurement, judged against the window `final/config.json` advertises (the
    window of the measurement while the run has no `final/`)."""
    found = [e for e in run["events"] if e["event"] == ev.CONTEXT]
    if not found:
        return None
    last = found[-1]
    if not last.get("buckets"):
        return {"step": last["step"], "verdict": last["verdict"]}
    config = run["dir"] / "final" / "config.json"
    advertised = json.loads(config.read_text())["max_position_embeddings"] if config.exists() else last["window"]
    return {"step": last["step"], "buckets": last["buckets"], **context_verdict(last["buckets"], advertised)}


def _downstream(run: dict[str, Any]) -> dict[str, dict] | None:
    """Each lm-eval score at its first and latest eval (the first is the untrained baseline when scored at step 0)."""
    out: dict[str, dict] = {}
    for m in run["evals"]:
        for k, v in m.items():
            if k.startswith("eval/") and k.count("/") >= 2 and "_stderr" not in k:  # eval/<task>/<metric>
                out.setdefault(k[5:], {"first_step": m["step"], "first": v}).update(last_step=m["step"], last=v)
    return out or None


def format_report(r: dict[str, Any]) -> str:
    lines = [f"verdict: {r['verdict']}  ({'; '.join(r['reasons'])})", f"run: {r['dir']}"]
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
        lines.append(f"train/val gap: {g['first']:+.4f} -> {g['last']:+.4f} ({g['trend']})")
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
        lines.append(r["gns"]["summary"])
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
