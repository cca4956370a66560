"""check_run.py at a run's real length (numbers for docs/BENCHMARKS.md, not a timed test): synthetic run directories
of 10k, 100k and 1M metric rows (a row every 10 steps, as the recipes log; 10 per-step losses in each), timed as a user
runs it, in a fresh process (imports included), and the spike replay alone against the step-by-step reference.

    python scripts/bench_check_run.py --rows 10000,100000,1000000 --out runs/bench_check_run
    python scripts/bench_check_run.py --rows 100000 --phases --curves 4     # where the time goes; 4 noisy curves

The curve: a power-law descent with Gaussian noise (sd 0.02), level shifts at the tiny recipe's stage starts, a WSD
decay over the last stage, and three injected spikes that recover. Rows carry the keys a real run logs (~1 KB each).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from pretrainer.analysis.replay import spike_episodes
from pretrainer.recipe.loading import dump_recipe, load_recipe

ROOT = Path(__file__).resolve().parents[1]
LOG_EVERY = 10


def make_run(out: Path, rows: int, seed: int = 0, record: bool = True) -> dict:
    """A finished run of `rows` metric rows: recipe.resolved.yaml, metrics.jsonl, events.jsonl and (`record`) the
    per-step record, as the trainer writes them (without it: a run from before the record)."""
    steps = rows * LOG_EVERY
    main, long = int(steps * 0.8), int(steps * 0.1)
    recipe = load_recipe(
        ROOT / "recipes" / "tiny.yaml",
        [
            f"stages.0.steps={main}",
            f"stages.1.steps={long}",
            f"stages.2.steps={steps - main - long}",
            f"eval.every_steps={max(1, steps // 100)}",
            f"run.output_dir={out}",
        ],
    )
    out.mkdir(parents=True, exist_ok=True)
    dump_recipe(recipe, out / "recipe.resolved.yaml")
    rng = np.random.default_rng(seed)
    s = np.arange(1, steps + 1)
    decay = np.clip((s - main - long) / max(1, steps - main - long), 0, 1)
    loss = 3 + 3 / np.sqrt(s) + 0.1 * (s > main) - 0.3 * (1 - np.sqrt(1 - decay)) + 0.02 * rng.standard_normal(steps)
    spikes = rng.choice(np.arange(steps // 10, main), 3, replace=False)
    for at in spikes:
        loss[at : at + 5] += 0.5
    lr = 3e-3 * np.minimum(1, s / 20) * np.sqrt(1 - decay)
    with open(out / "events.jsonl", "w") as ev:
        for i, (name, start) in enumerate([("main", 0), ("long", main), ("anneal", main + long)]):
            ev.write(
                json.dumps({"event": "stage_start", "step": start, "time": 0.0, "stage": name, "index": i}) + "\n"
            )
        ev.write(json.dumps({"event": "run_end", "step": steps, "time": steps * 0.036}) + "\n")
    if record:
        write_record(out, s, loss, lr, main, long)
    with open(out / "metrics.jsonl", "w") as f:
        for r in range(rows):
            a, b = r * LOG_EVERY, (r + 1) * LOG_EVERY
            stage = "main" if b <= main else "long" if b <= main + long else "anneal"
            row = {
                "step": b,
                "time": b * 0.036,
                "loss": float(loss[a:b].mean()),
                "tokens": b * 8192,
                "stage": stage,
                "lr": float(lr[b - 1]),
                "grad_norm": 0.3,
                "data/repeats/modules": 0,
                "instability/tokens_lost": 0,
                "tokens_per_s": 28000.0,
                "step_time_s": 0.036,
                "data_wait": 0.01,
                "step_losses": [[int(s[k]), float(loss[k])] for k in range(a, b)],
                "mem/host_peak_gb": 0.45,
                "gns/b_simple": 229.0,
                "layers/grad_norm_max": 0.18,
                "layers/grad_norm_argmax": 1,
                "layers/update_ratio_max": 0.2,
                "layers/update_ratio_argmax": 0,
                "layers/param_norm_max": 12.2,
                "layers/param_norm_argmax": 1,
            }
            f.write(json.dumps(row) + "\n")
            if b % recipe.eval.every_steps == 0:
                v = float(loss[b - LOG_EVERY : b].mean())
                f.write(json.dumps({"step": b, "tokens": b * 8192, "stage": stage, "val/ref": v, "val/avg": v}) + "\n")
    return {
        "steps": steps,
        "spikes": sorted(int(x) + 1 for x in spikes),
        "mb": (out / "metrics.jsonl").stat().st_size / 2**20,
    }


def write_record(out: Path, s: np.ndarray, loss: np.ndarray, lr: np.ndarray, main: int, long: int) -> None:
    """The per-step record in the trainer's format (`steprecord`'s two streams), a batch per `FLUSH_ROWS` steps."""
    import pyarrow as pa

    from pretrainer.observe import steprecord

    d = out / steprecord.DIR
    d.mkdir(parents=True, exist_ok=True)
    n = len(s)
    logged = np.flatnonzero(s % LOG_EVERY == 0)
    steps = {"step": s, "epoch": np.zeros(n, np.int32), "loss": loss.astype(np.float32), "grad_norm": np.full(n, 0.3)}
    rows = {
        "step": s[logged],
        "epoch": np.zeros(len(logged), np.int32),
        "stage": ((s[logged] > main).astype(np.int16) + (s[logged] > main + long)).astype(np.int16),
        "tokens": s[logged] * 8192,
        "applied": np.ones(len(logged), bool),
        "grad_norm": np.full(len(logged), 0.3),
        "row_loss": loss[: len(logged) * LOG_EVERY].reshape(-1, LOG_EVERY).mean(axis=1),
        "lr": lr[logged],
        "tokens_per_s": np.full(len(logged), 28000.0),
        "gns": np.full(len(logged), 229.0),
    }
    per_batch = steprecord.FLUSH_ROWS
    for name, cols, schema, every in (
        ("steps", steps, steprecord.step_schema(), per_batch),
        ("rows", rows, steprecord.row_schema(), per_batch // LOG_EVERY),
    ):
        options = pa.ipc.IpcWriteOptions(compression="zstd")
        with pa.OSFile(str(d / f"{name}-0000.arrows"), "wb") as sink:
            with pa.ipc.new_stream(sink, schema, options=options) as writer:
                for a in range(0, len(cols["step"]), every):
                    arrays = [pa.array(cols[f.name][a : a + every], type=f.type) for f in schema]
                    writer.write_batch(pa.record_batch(arrays, schema=schema))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="10000,100000,1000000")
    p.add_argument("--out", default="runs/bench_check_run")
    p.add_argument("--reference-steps", type=int, default=100_000, help="steps replayed by both replays")
    p.add_argument("--phases", action="store_true", help="also time each phase of check_run's work in-process")
    p.add_argument("--curves", type=int, default=0, help="also compare the replays on N noisy 60k-step curves")
    p.add_argument("--legacy", action="store_true", help="runs as written before the per-step record")
    p.add_argument("--json", action="store_true", help="one JSON object: per size seconds, peak_rss_mb, episodes")
    args = p.parse_args(argv)
    results = []
    for rows in (int(x) for x in args.rows.split(",")):
        run = Path(args.out) / f"rows_{rows}"
        info = make_run(run, rows, record=not args.legacy)
        seconds, peak_mb, rc, stdout, stderr = timed_check_run(run)
        if rc != 0:
            print(stderr, file=sys.stderr)
            return 1
        rep = json.loads(stdout)
        found = [e[0] for e in rep["replayed_spikes"]]
        results.append(
            {
                "rows": rows,
                **info,
                "seconds": seconds,
                "peak_rss_mb": peak_mb,
                "verdict": rep["verdict"],
                "found": found,
                "injected_found": sum(any(abs(f - x) <= 2 for f in found) for x in info["spikes"]),
            }
        )
        if args.phases:
            results[-1]["phases"] = phases(run)
        if not args.json:
            print(json.dumps(results[-1]))
    # the fast replay against the step-by-step one on the same curve
    curve = [(int(a), float(b)) for a, b in _losses(Path(args.out) / f"rows_{results[0]['rows']}")]
    curve = curve[: args.reference_steps]
    t = time.perf_counter()
    fast = spike_episodes(curve, [20])
    t_fast = time.perf_counter() - t
    t = time.perf_counter()
    slow = spike_episodes(curve, [20], batched=False)
    t_slow = time.perf_counter() - t
    same = [(e["onset"], e["detected"], e["recovered"]) for e in fast] == [
        (e["onset"], e["detected"], e["recovered"]) for e in slow
    ]
    check = {"replay_steps": len(curve), "fast_s": round(t_fast, 2), "stepwise_s": round(t_slow, 2), "same": same}
    checks = noisy_curves(seeds=args.curves) if args.curves else []
    if args.json:
        print(json.dumps({"sizes": results, "replay_check": check, "noisy_curves": checks}, indent=1))
    else:
        for c in [check, *checks]:
            print(json.dumps(c))
    return 0 if same and all(c["same"] for c in checks) else 1


def phases(run_dir: Path) -> dict:
    """Seconds of each phase of check_run's work in this process (the imports are timed by `main` in a fresh one)."""
    from pretrainer.analysis import outlook, report, runfiles, verdicts

    out, t = {}, time.perf_counter()
    run = runfiles.load_run(run_dir)
    out["read_json"], t = time.perf_counter() - t, time.perf_counter()
    verdicts.replayed(run)
    out["spike_replay"], t = time.perf_counter() - t, time.perf_counter()
    report.report(run_dir, run=run)
    out["report_incl_replay"], t = time.perf_counter() - t, time.perf_counter()
    outlook.forecast_report(run_dir, run=run)
    out["forecast"] = time.perf_counter() - t
    return {k: round(v, 2) for k, v in out.items()}


def noisy_curves(n: int = 60_000, seeds: int = 4) -> list[dict]:
    """The fast replay against the step-by-step one on curves with Gaussian and heavy-tailed (t(3)) noise, small and
    large bumps, NaN and stage starts."""
    out = []
    for seed in range(seeds):
        rng = np.random.default_rng(seed)
        s = np.arange(1, n + 1)
        noise = 0.02 * (rng.standard_t(3, n) if seed % 2 else rng.standard_normal(n))
        loss = 3 + 3 / np.sqrt(s) + noise + 0.1 * (s > n // 2)
        for at in rng.choice(np.arange(1000, n - 100), 5, replace=False):
            loss[at : at + rng.integers(1, 6)] += rng.choice([0.05, 0.1, 0.5])
        loss[rng.choice(n, 3)] = np.nan
        curve, grace = list(zip(s.tolist(), loss.tolist())), [20, n // 2, 3 * n // 4]
        t = time.perf_counter()
        fast = spike_episodes(curve, grace)
        t_fast = time.perf_counter() - t
        t = time.perf_counter()
        slow = spike_episodes(curve, grace, batched=False)
        t_slow = time.perf_counter() - t
        key = [(e["onset"], e["detected"], e["recovered"]) for e in fast]
        same = key == [(e["onset"], e["detected"], e["recovered"]) for e in slow]
        out.append(
            {
                "seed": seed,
                "episodes": len(fast),
                "same": same,
                "fast_s": round(t_fast, 2),
                "stepwise_s": round(t_slow, 2),
            }
        )
    return out


MEASURE = """
import json, resource, subprocess, sys, time
t = time.perf_counter()
rc = subprocess.call(sys.argv[1:])
seconds = time.perf_counter() - t
print(json.dumps({"rc": rc, "seconds": seconds, "peak_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}), file=sys.stderr)
"""
"""Runs a command and reports its own time and peak RSS. Through this small process because a child's peak RSS
counts the memory of the process that started it, as of its exec (Linux): this benchmark holds a 10M-step curve."""


def timed_check_run(run: Path) -> tuple[float, float, int, str, str]:
    """`check_run.py RUN --json` in a fresh process: (seconds, its own peak RSS in MB, exit code, stdout, stderr)."""
    cmd = [sys.executable, "-c", MEASURE, sys.executable, str(ROOT / "scripts" / "check_run.py"), str(run), "--json"]
    cp = subprocess.run(cmd, capture_output=True, text=True)
    *err, last = cp.stderr.rstrip("\n").split("\n")
    m = json.loads(last)
    return round(m["seconds"], 2), round(m["peak_mb"]), m["rc"], cp.stdout, "\n".join(err)


def _losses(run: Path):
    with open(run / "metrics.jsonl") as f:
        for line in f:
            yield from json.loads(line).get("step_losses", [])


if __name__ == "__main__":
    raise SystemExit(main())
