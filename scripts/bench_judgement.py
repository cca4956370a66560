"""Every automatic judgement measured on a labelled corpus of real training runs, at the recipe defaults: how often
each fires on healthy runs (per 100k steps), and on runs with an incident of known onset whether it fired, how late,
and what it cost.

    python scripts/bench_judgement.py                       # the default corpus, a table
    python scripts/bench_judgement.py --steps 3000 --json   # longer healthy runs, machine-readable
    python scripts/bench_judgement.py --quick               # the test suite's subset (two short runs)
    python scripts/bench_judgement.py --curve a.csv b.csv   # the spike rule on per-step curves from elsewhere

Healthy runs: the micro recipe (tests/fixtures/micro.yaml) across seeds, learning rates from 3e-3 to 2e-2 (its
default is 1e-2), global batches of 256 to 4,096 tokens (the smaller, the noisier the per-step loss) and both
schedules, each with checkpoints every 50 steps and an eval every 50. Incidents, on the same recipe at step 300 of a
600-step run: poisoned samples (random tokens) in 3 steps, a one-step gradient fault (x1000), a NaN loss, Adam's
moments corrupted (x1e4).

Loss bumps of 0.5 and 1 nat and of 5 and 8 sd of the run's own noise, lasting 1, 3, 5 and 10 steps, are added, one
at a time, to the healthy runs' recorded per-step losses (their real noise) at 8 places each, and the spike rule
replayed (equal to the live rule, which the corpus checks): recall, delay and recovery by size. `--curve` does the
same on per-step curves exported from other runs (`step,loss[,lr]` CSV, W&B's history export or another
framework's log), with the recipe's default rule, and counts the spikes the rule finds on them as they are.

What is counted, from each run's own events.jsonl (what the live loop did, nothing recomputed): `skipped_update`,
`spike`, `rollback`, `skip` (data skipped for good), `recurred`, `absorbed`, `off_track`, and the `health` verdict
at every eval after warmup (anything but `healthy` on a healthy run is a false alarm); and check_run.py's replay of
the spike rule over the logged losses (`replayed_spikes`).
"""

from __future__ import annotations

import csv
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from pretrainer.cli import run_main, script_parser
from pretrainer.observe import events as ev
from pretrainer.observe.tracking import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
MICRO = ROOT / "tests" / "fixtures" / "micro.yaml"
COUNTED = (
    ev.SKIPPED_UPDATE,
    ev.SPIKE,
    ev.ROLLBACK,
    ev.SKIP,
    ev.RECURRED,
    ev.ABSORBED,
    ev.OFF_TRACK,
)
ONSET, INCIDENT_STEPS = 300, 600
SAMPLES_PER_STEP = 16  # micro: 1,024 tokens per step of 64-token rows

HEALTHY = {
    "seed 0": [],
    "seed 1": ["run.seed=1"],
    "seed 2": ["run.seed=2"],
    "seed 3": ["run.seed=3"],
    "seed 4": ["run.seed=4"],
    "lr 3e-3": ["optimizer.lr=3.0e-3"],
    "lr 2e-2": ["optimizer.lr=2.0e-2"],
    "batch 256": ["batch.global_batch_tokens=256"],
    "batch 512": ["batch.global_batch_tokens=512"],
    "batch 4096": ["batch.global_batch_tokens=4096"],
    "cosine": ["schedule.type=cosine", "schedule.min_lr_ratio=0.1"],
    "cosine seed 1": ["schedule.type=cosine", "schedule.min_lr_ratio=0.1", "run.seed=1"],
}
POISONED = ((ONSET - 1) * SAMPLES_PER_STEP, (ONSET + 2) * SAMPLES_PER_STEP - 1)
"""The samples of steps ONSET .. ONSET + 2 (inclusive), which the poison incident replaces with random tokens."""
INCIDENTS = {
    "poison 3 steps": ([f"debug.inject.poison_samples=[0, {POISONED[0]}, {POISONED[1]}]"], "data"),
    "grad x1000": ([f"debug.inject.grad_scale={{step: {ONSET}, factor: 1000}}"], "grad"),
    "nan loss": ([f"debug.inject.nan_step={ONSET}"], "nan"),
    "moments x1e4": ([f"debug.inject.corrupt_optimizer_step={ONSET}"], "optimizer"),
}


def parse_args(argv=None):
    p = script_parser(__doc__, recipe=False)
    p.add_argument("--steps", type=int, default=2000, help="steps of each healthy run")
    p.add_argument("--quick", action="store_true", help="two healthy runs of 300 steps and the poison incident")
    p.add_argument("--work-dir", type=Path, help="keep the runs here (default: a temporary directory)")
    p.add_argument("--cache-dir", type=Path, help="data.cache_dir for every run (default: inside the work dir)")
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of tables")
    p.add_argument("--out", type=Path, help="also write the JSON result here")
    p.add_argument(
        "--noise-models", action="store_true", help="only the rule's false alarms on 1M-step synthetic curves"
    )
    p.add_argument(
        "--curve",
        type=Path,
        nargs="+",
        help="only the rule on these per-step curves from elsewhere (CSV: step,loss[,lr]): spikes and bump recall",
    )
    return p.parse_args(argv)


def run(out: Path, cache: Path, steps: int, sets: list[str]) -> tuple[int, float]:
    """One training run of the micro recipe in this process: (exit code, seconds)."""
    import run_recipe

    args = [str(MICRO), "--output-dir", str(out), "--overwrite", "--set", f"data.cache_dir={cache}"]
    base = [f"stages.0.steps={steps}", "eval.every_steps=50", "logging.every_steps=10"]
    tokens_per_step = next((int(s.split("=")[1]) for s in sets if s.startswith("batch.global_batch_tokens")), 1024)
    base.append(f"checkpoint.every_tokens={50 * tokens_per_step}")
    for s in base + sets:
        args += ["--set", s]
    t0 = time.perf_counter()
    rc = run_recipe.main(args)
    return rc, time.perf_counter() - t0


def judged(out: Path) -> dict:
    """What a run's judgements did: counts by kind, the non-healthy verdicts after warmup, check_run's replay."""
    from pretrainer.analysis.report import report

    events = read_jsonl(out / "events.jsonl")
    steps = max((m["step"] for m in read_jsonl(out / "metrics.jsonl")), default=0)
    counts = {k: sum(e["event"] == k for e in events) for k in COUNTED}
    warm = 20 + 20  # warmup (micro: 3 steps) and the grace after it, rounded up to the first eval past both
    verdicts = [e for e in events if e["event"] == ev.HEALTH and e["step"] > warm]
    counts["verdict not healthy"] = sum(e["verdict"] != "healthy" for e in verdicts)
    replayed = report(out, verify_checkpoint=False, deep=False)["replayed_spikes"]
    counts["replayed spike"] = len(replayed)
    live = [[e["onset"], e["step"]] for e in events if e["event"] == ev.SPIKE]
    lost = sum(e.get("tokens", 0) for e in events if e["event"] in (ev.SKIPPED_UPDATE, ev.ROLLBACK))
    skipped = [(e["first"], e["last"]) for e in events if e["event"] == ev.SKIP]
    first = {k: min((e["step"] for e in events if e["event"] == k), default=None) for k in COUNTED}
    return {
        "steps": steps,
        "counts": counts,
        "evals": len(verdicts),
        "tokens_lost": lost,
        "skipped": skipped,
        "first": first,
        "live_spikes": live,
        "replayed_spikes": [[onset, detected] for onset, detected, _ in replayed],
        "replay_equals_live": live == [[onset, detected] for onset, detected, _ in replayed],
    }


def incident_outcome(kind: str, j: dict) -> dict:
    """Detected (and by what), the delay from the onset, and whether the response was the right rung."""
    c, f = j["counts"], j["first"]
    fired = [k for k in (ev.SKIPPED_UPDATE, ev.SPIKE, ev.ABSORBED) if c[k]]
    detected = min((f[k] for k in fired), default=None)
    out = {"detected_by": fired, "delay": None if detected is None else detected - ONSET}
    if kind == "data":
        lo, hi = POISONED
        out["blamed_overlaps_poison"] = any(a <= hi and b >= lo for a, b in j["skipped"])
        out["skipped_outside_poison"] = sum(max(0, lo - a) + max(0, b - hi) for a, b in j["skipped"])
    return out


BUMPS = ("0.5 nat", "1 nat", "5 sd", "8 sd")
"""Loss bumps added to the healthy runs' recorded per-step losses: in nats, or in the run's own noise there (the
robust sd around the trend of the 100 steps before, as the rule measures it)."""
BUMP_STEPS = (1, 3, 5, 10)
POSITIONS = 8


def bump_recall(run_dirs: list[Path], positions: int = POSITIONS) -> dict:
    """Recall and delay of the spike rule (the live rule: the replay equals it) on the healthy runs' own noise: each
    run's recorded per-step losses with a bump of each size and length added at `positions` places (one at a time,
    after warmup, the grace and a full window), replayed with the run's own rule. Found: an episode detected from the
    bump on whose onset lies within it (or up to `persistence` - 1 steps before: a suspect step of noise); delay: the
    detection step after the bump's first step; recovered: the loss came back under the pre-spike trend."""
    return bumps_on([_run_series(d) for d in run_dirs], positions)


def _run_series(d: Path) -> dict:
    """A run's timeline for the rule: its per-step losses, its own `spikes` section, grace starts and warmup."""
    from pretrainer.analysis.runfiles import grace_starts, load_run, spike_rule, warmup_of

    run = load_run(d)
    steps, loss = run.losses.steps, run.losses.values.astype(np.float32)
    return {
        "steps": steps,
        "loss": loss,
        "cfg": spike_rule(run.recipe),
        "graces": grace_starts(run.events),
        "warmup": warmup_of(run.recipe),
    }


def csv_series(path: Path) -> dict:
    """A per-step loss curve from elsewhere (`step,loss[,lr]` rows, as W&B or another framework exports it) under
    the recipe's default rule: warmup is where the LR peaks (0 without an `lr` column), no stage starts."""
    from pretrainer.recipe.sections import SpikesSection

    with open(path, newline="") as fh:
        rows = [r for r in csv.DictReader(fh) if (r.get("loss") or "").strip()]
    if not rows or not {"step", "loss"} <= set(rows[0]):
        raise ValueError(f"{path}: needs the columns step,loss (and optionally lr)")
    steps = np.array([int(float(r["step"])) for r in rows])
    loss = np.array([float(r["loss"]) for r in rows], np.float32)
    warmup = int(steps[int(np.argmax([float(r["lr"]) for r in rows]))]) if "lr" in rows[0] else 0
    return {"steps": steps, "loss": loss, "cfg": SpikesSection(), "graces": [], "warmup": warmup, "name": path.name}


def bumps_on(series: list[dict], positions: int = POSITIONS) -> dict:
    """`bump_recall` over curves given as `_run_series` / `csv_series` give them."""
    from pretrainer.analysis.replay import spike_episodes
    from pretrainer.stability.spikes import trend_fit

    out: dict[str, dict] = {}
    for size in BUMPS:
        for length in BUMP_STEPS:
            found = delays = recovered = placed = 0
            worst = 0
            for c in series:
                steps, loss, cfg, graces, warmup = c["steps"], c["loss"], c["cfg"], c["graces"], c["warmup"]
                first, last = warmup + cfg.grace_steps + cfg.window, len(steps) - length - 20
                for at in np.linspace(first, last, positions).astype(int).tolist():
                    value, unit = size.split()
                    if unit == "sd":
                        window = slice(at - cfg.window, at)
                        s, v = steps[window].astype(float), loss[window].astype(float)
                        _, sd = trend_fit(s, v, float(steps[at]), persistence=1)  # the per-step noise sd
                    bumped = loss.copy()
                    bumped[at : at + length] += np.float32(float(value) * (sd if unit == "sd" else 1.0))
                    eps = spike_episodes((steps, bumped), graces, cfg, warmup)
                    onset = int(steps[at])
                    # the spike is dated from its first suspect step, which noise can put just before the bump
                    early = onset - cfg.persistence + 1
                    hit = [e for e in eps if early <= e["onset"] < onset + length and e["detected"] >= onset]
                    placed += 1
                    if hit:
                        found += 1
                        delays += hit[0]["detected"] - onset
                        worst = max(worst, hit[0]["detected"] - onset)
                        recovered += hit[0]["recovered"] is not None
            out[f"{size} x {length}"] = {
                "placed": placed,
                "found": found,
                "recovered": recovered,
                "mean_delay": round(delays / found, 2) if found else None,
                "max_delay": worst if found else None,
            }
    return out


def curves_judged(paths: list[Path], positions: int = POSITIONS) -> dict:
    """The rule on per-step curves from elsewhere, taken as healthy: its spikes on each (false alarms, unless the
    curve had an incident) and its reach on each curve's own noise (bumps)."""
    from pretrainer.analysis.replay import spike_episodes

    series = [csv_series(p) for p in paths]
    rows = []
    for c in series:
        eps = spike_episodes((c["steps"], c["loss"]), c["graces"], c["cfg"], c["warmup"])
        rows.append(
            {"curve": c["name"], "steps": len(c["steps"]), "spikes": [[e["onset"], e["detected"]] for e in eps]}
        )
    steps = sum(r["steps"] for r in rows)
    spikes = sum(len(r["spikes"]) for r in rows)
    return {
        "curves": rows,
        "steps": steps,
        "spikes_per_100k_steps": round(spikes * 1e5 / max(steps, 1), 1),
        "bumps": bumps_on(series, positions),
    }


NOISE_MODELS = ("gaussian", "t5", "t3", "ar0.2", "ar0.4", "ar0.6")


def noise_model_false_alarms(steps: int = 1_000_000, seed: int = 0) -> dict[str, float]:
    """Spikes the rule (its defaults) finds per 100k steps of synthetic healthy curves, 3 + 3/sqrt(step) plus noise
    of sd 0.02 with heavier tails (Student-t, 5 and 3 degrees of freedom, scaled to unit variance) or autocorrelation
    (AR(1) with Gaussian innovations): the rate the rule promises when a run's loss is not Gaussian."""
    from scipy.signal import lfilter

    from pretrainer.analysis.replay import spike_episodes

    out = {}
    for kind in NOISE_MODELS:
        rng = np.random.default_rng(seed)
        if kind == "gaussian":
            e = rng.standard_normal(steps)
        elif kind.startswith("t"):
            dof = int(kind[1:])
            e = rng.standard_t(dof, steps) / np.sqrt(dof / (dof - 2))
        else:
            rho = float(kind[2:])
            e = lfilter([1.0], [1.0, -rho], rng.standard_normal(steps)) * np.sqrt(1 - rho * rho)
        s = np.arange(1, steps + 1)
        loss = (3 + 3 / np.sqrt(s) + 0.02 * e).astype(np.float32)
        out[kind] = round(len(spike_episodes((s, loss), [], None, start=20)) * 1e5 / steps, 2)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)

    def body() -> int:
        if args.noise_models:
            print(json.dumps(noise_model_false_alarms()))
            return 0
        if args.curve:
            print(json.dumps(curves_judged(args.curve), indent=1))
            return 0
        with tempfile.TemporaryDirectory(prefix="judgement-") as tmp:
            work = args.work_dir or Path(tmp)
            cache = args.cache_dir or work / "cache"
            healthy = dict(list(HEALTHY.items())[:2]) if args.quick else HEALTHY
            incidents = dict(list(INCIDENTS.items())[:1]) if args.quick else INCIDENTS
            steps = 300 if args.quick else args.steps
            rows, total = [], {k: 0 for k in (*COUNTED, "verdict not healthy", "replayed spike")}
            healthy_steps = evals = 0
            dirs = []
            for name, sets in healthy.items():
                out = work / name.replace(" ", "_")
                dirs.append(out)
                rc, seconds = run(out, cache, steps, sets)
                j = judged(out)
                rows.append({"run": name, "kind": "healthy", "rc": rc, "seconds": round(seconds, 1), **j})
                healthy_steps += j["steps"]
                evals += j["evals"]
                for k, v in j["counts"].items():
                    total[k] += v
            bumps = bump_recall(dirs, positions=2 if args.quick else POSITIONS)
            for name, (sets, kind) in incidents.items():
                out = work / name.replace(" ", "_")
                rc, seconds = run(out, cache, INCIDENT_STEPS if not args.quick else 360, sets)
                j = judged(out)
                rows.append(
                    {
                        "run": name,
                        "kind": kind,
                        "rc": rc,
                        "seconds": round(seconds, 1),
                        **j,
                        **incident_outcome(kind, j),
                    }
                )
        rate = {k: round(v * 1e5 / max(healthy_steps, 1), 1) for k, v in total.items()}
        result = {
            "healthy_steps": healthy_steps,
            "healthy_evals": evals,
            "false_alarms": total,
            "per_100k_steps": rate,
            "bumps": bumps,
            "runs": rows,
        }
        if args.out:
            args.out.write_text(json.dumps(result, indent=1))
        if args.json:
            print(json.dumps(result, indent=1))
        else:
            print(table(result))
        return 0

    return run_main(body, debug=args.debug)


def table(r: dict) -> str:
    lines = [
        f"healthy corpus: {len([x for x in r['runs'] if x['kind'] == 'healthy'])} runs, {r['healthy_steps']:,} steps, "
        f"{r['healthy_evals']} evals after warmup",
        "",
        "| judgement | false alarms | per 100k healthy steps |",
        "|---|---|---|",
    ]
    for k, v in r["false_alarms"].items():
        lines.append(f"| {k} | {v} | {r['per_100k_steps'][k]} |")
    lines += [
        "",
        "| loss bump on the healthy runs' noise | placed | found | recovered | mean delay | max delay |",
        "|---|---|---|---|---|---|",
    ]
    for k, b in r["bumps"].items():
        lines.append(
            f"| {k} | {b['placed']} | {b['found']} | {b['recovered']} | {b['mean_delay']} | {b['max_delay']} |"
        )
    lines += [
        "",
        "| incident | rc | detected by | delay (steps) | rollbacks | data skipped | tokens lost |",
        "|---|---|---|---|---|---|---|",
    ]
    for x in r["runs"]:
        if x["kind"] == "healthy":
            continue
        skipped = x["skipped"] or "-"
        lines.append(
            f"| {x['run']} | {x['rc']} | {', '.join(x['detected_by']) or 'nothing'} | {x['delay']} | "
            f"{x['counts'][ev.ROLLBACK]} | {skipped} | {x['tokens_lost']:,} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
