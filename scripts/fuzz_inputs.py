"""Damage every file the tools read and check that each tool answers in one line, never a traceback, and never
allocates past a gigabyte: random truncation and byte damage, N cases per reader (numbers for the hardening issue's
note; `tests/test_fuzz.py` runs a few cases per reader, `make test-slow` more).

    python scripts/fuzz_inputs.py --cases 1000                 # trains the micro recipe into a temporary run first
    python scripts/fuzz_inputs.py --run runs/micro --cases 50 --json

A reader is a file and the tool that reads it: the run's jsonl files, its per-step record (Arrow), its resolved recipe
and newest checkpoint's meta.json through `check_run.py`; a step,lr,loss CSV through `forecast.py --curve`; a recipe
through `inspect_recipe.py`. Each case restores the file, damages it one way (cut at a random byte, one byte or a run
of bytes overwritten, bytes inserted, a range deleted) and runs the tool in this process. A case passes when the
tool returns (exit 0, or 2 with its `error:` line); an exception out of `main` fails it. The process's address space
is capped at its size plus 1 GiB while the cases run, so an allocation past a gigabyte fails its case as well.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import random
import resource
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

CAP_BYTES = 1 << 30
"""What a case may allocate past the address space the process had before the cases."""


def damage(data: bytes, rng: random.Random) -> bytes:
    """One random damage of a file's bytes."""
    n = len(data)
    kind = rng.choice(("cut", "byte", "bytes", "insert", "delete"))
    at = rng.randrange(max(1, n))
    if kind == "cut":
        return data[:at]
    if kind == "byte":
        return data[:at] + bytes([rng.randrange(256)]) + data[at + 1 :]
    if kind == "bytes":
        k = rng.randint(2, 16)
        return data[:at] + rng.randbytes(k) + data[at + k :]
    if kind == "insert":
        return data[:at] + rng.randbytes(rng.randint(1, 16)) + data[at:]
    return data[:at] + data[at + rng.randint(1, 64) :]


def readers(run: Path, work: Path) -> list[tuple[str, Path, list[str], str]]:
    """(name, file to damage, argv, script) for every reader, on the working copies under `work`."""
    ckpt = max((work / "run" / "checkpoints").glob("step_*"))
    check = [str(work / "run"), "--json", "--verify", "fast"]
    out = [
        (name, work / "run" / name, check, "check_run")
        for name in ("metrics.jsonl", "events.jsonl", "evals.jsonl", "critical_batch.jsonl", "recipe.resolved.yaml")
    ]
    out += [(f"records/{p.name}", p, check, "check_run") for p in sorted((work / "run" / "records").glob("*.arrows"))]
    out.append(("checkpoint meta.json", ckpt / "meta.json", check, "check_run"))
    out.append(("final/config.json", work / "run" / "final" / "config.json", check, "check_run"))
    out.append(("forecast run evals.jsonl", work / "run" / "evals.jsonl", [str(work / "run"), "--json"], "forecast"))
    out.append(("curve.csv", work / "curve.csv", ["--curve", str(work / "curve.csv"), "--json"], "forecast"))
    out.append(("recipe.yaml", work / "recipe.yaml", [str(work / "recipe.yaml")], "inspect_recipe"))
    return out


def prepare(run: Path, work: Path) -> None:
    """Working copies: the run (with a critical-batch result if it has none), a curve CSV from its evals, a recipe."""
    shutil.copytree(run, work / "run")
    cbs = work / "run" / "critical_batch.jsonl"
    if not cbs.exists():
        meta = json.loads((max((run / "checkpoints").glob("step_*")) / "meta.json").read_text())
        record = {
            "checkpoint": "x",
            "step": meta["step"],
            "tokens": meta["tokens"],
            "batch_tokens": 1024,
            "branch_tokens": 8192,
            "trained_tokens": [8192, 8192],
            "sizes": [1024, 2048],
            "losses": [5.1, 5.2],
            "cbs_tokens": 1024,
            "lo": 1024,
            "hi": 2048,
            "bounded": True,
            "tolerance": 0.01,
            "suggested": "batch.schedule=[{from_tokens: 0, global_batch_tokens: 1024}]",
            "suggested_batch_tokens": 1024,
            "branches": [],
        }
        cbs.write_text(json.dumps(record) + "\n")
    rows = ["step,lr,loss"] + [
        f"{s},{1e-3 * min(1, s / 10) * (1 - s / 400)},{4 + 3 / s**0.3:.4f}" for s in range(1, 301)
    ]
    rows += [f"{s},{1e-3 * (1 - s / 400)}," for s in range(301, 400)]
    (work / "curve.csv").write_text("\n".join(rows) + "\n")
    recipe = (ROOT / "tests" / "fixtures" / "micro.yaml").read_text()
    base = ROOT / "recipes" / "_base" / "pretrain.yaml"
    (work / "recipe.yaml").write_text(recipe.replace("../../recipes/_base/pretrain.yaml", str(base)))


def run_case(script: str, argv: list[str]) -> tuple[int | None, str | None]:
    """(exit code, None) or (None, the exception's last traceback lines)."""
    module = __import__(script)
    sink = io.StringIO()
    try:
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            return module.main(argv), None
    except SystemExit as e:  # argparse's usage error: its two lines and exit 2
        return (e.code if isinstance(e.code, int) else 2), None
    except BaseException as e:  # noqa: BLE001 - the point: anything that escapes main is a failure
        if isinstance(e, KeyboardInterrupt):
            raise
        tb = traceback.format_exception(e)
        return None, "".join(tb[-3:]).strip()


def cap_address_space() -> int:
    """Limit this process's address space to its current size plus `CAP_BYTES` (Linux); returns that limit."""
    size = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                size = int(line.split()[1]) * 1024
    limit = size + CAP_BYTES
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    return limit


def train_micro(out: Path) -> Path:
    import subprocess

    cmd = [sys.executable, str(ROOT / "scripts" / "run_recipe.py"), str(ROOT / "tests" / "fixtures" / "micro.yaml")]
    cmd += ["--output-dir", str(out), "--set", f"data.cache_dir={out.parent / 'cache'}", "--set", "eval.every_steps=3"]
    subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT)
    return out


def fuzz(run: Path, cases: int, seed: int = 0, only: str | None = None) -> dict:
    """Every reader's cases; a summary per reader and the failures (at most 5 per reader)."""
    with tempfile.TemporaryDirectory(prefix="fuzz-") as tmp:
        work = Path(tmp)
        prepare(run, work)
        todo = [r for r in readers(run, work) if only is None or only in r[0]]
        for _, _, argv, script in todo:  # imports and first calls outside the cap
            run_case(script, argv)
        before = resource.getrlimit(resource.RLIMIT_AS)
        limit = cap_address_space()
        out = {"cases_per_reader": cases, "seed": seed, "address_space_cap_gib": round(limit / 2**30, 2)}
        try:
            out["readers"] = {
                name: _cases(path, argv, script, cases, f"{seed}:{name}") for name, path, argv, script in todo
            }
        finally:  # the cap is for the cases alone (a test process goes on to train)
            resource.setrlimit(resource.RLIMIT_AS, before)
    out["tracebacks"] = sum(r["tracebacks"] for r in out["readers"].values())
    return out


def _cases(path: Path, argv: list[str], script: str, cases: int, seed: str) -> dict:
    """One reader's damaged copies, its file restored afterwards."""
    pristine, rng = path.read_bytes(), random.Random(seed)
    codes, failures, t0 = {}, [], time.perf_counter()
    for i in range(cases):
        path.write_bytes(damage(pristine, rng))
        code, error = run_case(script, argv)
        codes[str(code)] = codes.get(str(code), 0) + 1
        if error is not None and len(failures) < 5:
            failures.append({"case": i, "error": error})
    path.write_bytes(pristine)
    return {
        "tool": script,
        "exit_codes": codes,
        "tracebacks": codes.get("None", 0),
        "failures": failures,
        "seconds": round(time.perf_counter() - t0, 1),
    }


HOSTILE = {
    "int": ["-5", "0", "1e3", "nan", "abc", "", "99999999999999999999"],
    "float": ["nan", "inf", "-1", "0", "1e400", "abc", ""],
    "steps": ["-5", "0", "1e3", "abc", "", "1,,2", "999999999999"],
    "path": ["", "/nonexistent/x", "/dev/null", "{dir}", "{file}"],
    "png": ["/nonexistent/dir/x.png", "{dir}", ""],
    "choice": ["bad", ""],
    "factors": [["0"], ["-1", "2"], ["abc"], ["1", "1"], ["1000000", "1"]],
    "set": [
        "batch.global_batch_tokens=-1",
        "stages=5",
        "model.config=null",
        "=",
        "a",
        "x.y.z=1",
        "optimizer.lr=nan",
        "schedule.warmup_steps=1000000000",
        "stages.0.steps=abc",
        "batch.schedule=[{}]",
        "stages.7.steps=3",
        "eval.every_steps=-1",
        "optimizer.type=sgd",
        "data.sources={}",
        "checkpoint.keep_last=0",
        "batch.schedule=[{from_tokens: 0, global_batch_tokens: 0}]",
        "stages.0.seq_len=100000",
    ],
}
"""Argument values a hurried user types: each is given to one flag of one script at a time."""


def argument_cases(work: Path) -> list[tuple[str, list[str]]]:
    """(script, argv) for every hostile value of every flag of the scripts that read or start runs. Each training
    script's base arguments end in a refusal (an output dir that holds a run, branch directories that hold another
    run), so a value the validation lets through trains nothing."""
    run, cache = work / "run", yaml_cache(work / "run")
    ckpt = str(max((run / "checkpoints").glob("step_*")))
    foreign = work / "foreign"
    for k in range(1, 17):
        (foreign / f"x{k}").mkdir(parents=True, exist_ok=True)
        (foreign / f"x{k}" / "run.json").write_text('{"run_id": "someone-else"}')
    data = f"data.cache_dir={cache}"
    flags = {
        "check_run": (
            [str(run), "--json", "--verify", "fast"],
            {"--stall-minutes": "float", "--target": "float", "--plot": "png", "--verify": "choice"},
        ),
        "forecast": (
            [str(run), "--json"],
            {"--fit-until": "int", "--at": "steps", "--calibrate": "path", "--plot": "png", "--law": "choice"},
        ),
        "inspect_recipe": (
            [str(work / "recipe.yaml")],
            {
                "--set": "set",
                "--lr-at": "steps",
                "--gpus": "int",
                "--gpu-memory": "float",
                "--mfu": "float",
                "--peak-tflops": "float",
                "--plot": "png",
            },
        ),
        "run_recipe": (
            [str(work / "recipe.yaml"), "--output-dir", str(run), "--set", data],
            {"--set": "set", "--resume": "path", "--branch-decay-from": "path", "--verify": "choice"},
        ),
        "critical_batch": (
            [ckpt, "--out", str(foreign), "--set", data],
            {"--set": "set", "--tokens": "int", "--tolerance": "float", "--factors": "factors"},
        ),
    }
    cases = []
    for script, (base, options) in flags.items():
        for flag, kind in options.items():
            for value in HOSTILE[kind]:
                values = (
                    value
                    if isinstance(value, list)
                    else [value.replace("{dir}", str(work)).replace("{file}", str(work / "recipe.yaml"))]
                )
                cases.append((script, [*base, flag, *values]))
    branch = [str(work / "recipe.yaml"), "--set", data, "--branch-decay-from", ckpt, "--output-dir", str(run)]
    cases += [("run_recipe", [*branch, "--decay-steps", v]) for v in HOSTILE["int"]]
    return cases


def yaml_cache(run: Path) -> str:
    import yaml

    return yaml.safe_load((run / "recipe.resolved.yaml").read_text())["data"]["cache_dir"]


def fuzz_arguments(run: Path) -> dict:
    """Every hostile argument once; the exit codes and the failures."""
    with tempfile.TemporaryDirectory(prefix="fuzz-args-") as tmp:
        work = Path(tmp)
        prepare(run, work)
        cases = argument_cases(work)
        codes, failures, t0 = {}, [], time.perf_counter()
        for script, argv in cases:
            code, error = run_case(script, argv)
            codes[str(code)] = codes.get(str(code), 0) + 1
            if error is not None:
                failures.append({"script": script, "argv": argv[-2:], "error": error})
    return {
        "cases": len(cases),
        "exit_codes": codes,
        "tracebacks": len(failures),
        "failures": failures[:10],
        "seconds": round(time.perf_counter() - t0, 1),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", help="a finished run directory with checkpoints (default: train the micro recipe)")
    p.add_argument("--cases", type=int, default=100, help="damaged copies per reader")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", help="the readers whose name contains this")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fuzz-run-") as tmp:
        run = Path(args.run) if args.run else train_micro(Path(tmp) / "micro")
        result = fuzz(run, args.cases, args.seed, args.only)
        result["arguments"] = fuzz_arguments(run)
        result["tracebacks"] += result["arguments"]["tracebacks"]
    if args.json:
        print(json.dumps(result))
    else:
        for name, r in result["readers"].items():
            print(
                f"{name:<28} {r['tool']:<15} exit codes {r['exit_codes']}  tracebacks {r['tracebacks']}  {r['seconds']} s"
            )
            for f in r["failures"]:
                print(f"    case {f['case']}: {f['error'].splitlines()[-1]}")
        a = result["arguments"]
        print(f"arguments: {a['cases']} hostile values, exit codes {a['exit_codes']}, tracebacks {a['tracebacks']}")
        for f in a["failures"]:
            print(f"    {f['script']} {' '.join(f['argv'])}: {f['error'].splitlines()[-1]}")
        print(f"{result['tracebacks']} tracebacks in {args.cases} cases per reader and {a['cases']} argument values")
    return 1 if result["tracebacks"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
