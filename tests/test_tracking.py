"""W&B (offline) read back with wandb's own protobuf schema: one run per training run, a history equal to
metrics.jsonl across a kill and a resume, rollbacks and skips on the dashboard; the performance metrics."""

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FIXTURES

from pretrainer.observe.tracking import read_jsonl, tracked
from pretrainer.observe.wandb_history import history, offline_files

ROOT = Path(__file__).resolve().parents[1]
BASE = [
    "--set",
    "logging.report_to=[wandb, tensorboard]",
    "--set",
    "checkpoint.every_tokens=4096",
    "--set",
    "stages.0.steps=24",
]


def launch(out, cache_dir, *extra, kill_at=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    env.pop("PRETRAINER_KILL_AT", None)
    if kill_at:
        env["PRETRAINER_KILL_AT"] = kill_at
    cmd = [
        sys.executable,
        "scripts/run_recipe.py",
        str(FIXTURES / "micro.yaml"),
        "--output-dir",
        str(out),
        "--set",
        f"data.cache_dir={cache_dir}",
        *BASE,
        *extra,
    ]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def wandb_rows(out: Path) -> dict[int, dict]:
    rid = (out / "wandb_id").read_text().strip()
    return history(offline_files(out, rid))


def assert_history_equals_metrics(out: Path):
    rows, metrics = wandb_rows(out), read_jsonl(out / "metrics.jsonl")
    assert sorted(rows) == list(range(len(metrics))), "W&B steps are not the rows of metrics.jsonl"
    for i, m in enumerate(metrics):
        for k, v in tracked(m).items():
            assert math.isclose(rows[i][k], v, rel_tol=1e-12), (i, k, rows[i][k], v)


@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory, cache_dir):
    out = tmp_path_factory.mktemp("wandb") / "run"
    proc = launch(out, cache_dir, kill_at="step:15")
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    proc = launch(out, cache_dir, "--resume", "auto")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out, proc


def test_one_wandb_run_across_a_kill_and_a_resume(killed_and_resumed):
    out, _ = killed_and_resumed
    rid = (out / "wandb_id").read_text().strip()
    runs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(r.name.endswith(f"-{rid}") for r in runs)  # two launches, one run id
    assert [e["event"] for e in read_jsonl(out / "events.jsonl")].count("resume") == 1


def test_history_equals_metrics_after_kill_with_backfill(killed_and_resumed):
    out, _ = killed_and_resumed
    assert_history_equals_metrics(out)
    backfills = [e for e in read_jsonl(out / "events.jsonl") if e["event"] == "tracker_backfill"]
    assert backfills and backfills[0]["rows"] > 0  # the killed launch's W&B file lacked its tail
    steps = {m["step"] for m in read_jsonl(out / "metrics.jsonl") if "loss" in m}
    assert {5, 10, 15, 20, 24} <= steps  # the killed launch's rows are there (logged again on resume if lost)


def test_performance_metrics_and_console(killed_and_resumed):
    out, proc = killed_and_resumed
    train = [m for m in read_jsonl(out / "metrics.jsonl") if "loss" in m]
    for m in train:
        assert 0 <= m["data_wait"] <= 1 and m["step_time_s"] > 0 and m["tokens_per_s"] > 0
        assert m["mem/host_peak_gb"] > 0 and "mfu" not in m  # no MFU on a CPU without logging.peak_tflops
    assert any("ckpt/blocked_s" in m for m in train)
    assert all(m["eval/seconds"] > 0 for m in read_jsonl(out / "metrics.jsonl") if "val/avg" in m)
    assert proc.stdout.count("run micro:") == 1 and "resumed from" in proc.stdout
    assert "done." in proc.stdout and "wandb sync" in proc.stdout and "check_run.py" in proc.stdout
    assert "Removed shared tensor" not in proc.stderr


def test_tensorboard_plots_against_the_optimizer_step(killed_and_resumed):
    """TensorBoard has no custom x-axis: its step is the optimizer step (a row number would put step 20 at x=3 in
    one run and x=4 in another with other eval settings)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, _ = killed_and_resumed
    by_step = {m["step"]: m for m in read_jsonl(out / "metrics.jsonl") if "loss" in m}
    points = []
    for events in (out / "pretrainer").rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(events.parent))
        acc.Reload()
        if "loss" in acc.Tags()["scalars"]:
            points += [(e.step, e.value) for e in acc.Scalars("loss")]
    assert {s for s, _ in points} >= {5, 10, 20, 24}  # both launches (the killed one flushed what it could)
    for step, value in points:
        assert math.isclose(by_step[step]["loss"], value, rel_tol=1e-6), step


def test_wandb_run_identity(killed_and_resumed):
    """Named by the run directory, grouped by the recipe's run.name, a job type, stage and launch tags; charts
    against `train/step`."""
    from wandb.proto import wandb_internal_pb2 as pb

    from pretrainer.observe.wandb_history import records

    out, _ = killed_and_resumed
    rid = (out / "wandb_id").read_text().strip()
    runs, axes = [], {}
    for f in offline_files(out, rid):
        for raw in records(f):
            rec = pb.Record()
            rec.ParseFromString(raw)
            if rec.WhichOneof("record_type") == "run":
                runs.append(rec.run)
            elif rec.WhichOneof("record_type") == "metric" and rec.metric.glob_name:
                axes[rec.metric.glob_name] = (rec.metric.step_metric, rec.metric.options.hidden)
    assert runs and all(r.display_name == "run" and r.run_group == "micro" and r.job_type == "train" for r in runs)
    assert set(runs[0].tags) == {"stage:main", "launch:single"}
    # every chart's x-axis is the optimizer step; the markers (steps, not quantities) are off the automatic panels
    assert axes == {"*": ("train/step", False), "marker/*": ("train/step", True)}


def test_workspace_plots_every_quantity_the_run_logged(killed_and_resumed, capsys):
    """scripts/wandb_workspace.py's layout, from a real run's keys: every panel draws keys the run logged, and every
    key the run logged is on some panel, except the axes, the markers (steps) and the standard errors."""
    import wandb_workspace

    from pretrainer.observe.dashboard import X_AXIS, plotted, workspace_spec

    out, _ = killed_and_resumed
    keys = set().union(*(tracked(m) for m in read_jsonl(out / "metrics.jsonl")))
    spec = workspace_spec(keys)
    assert plotted(spec) <= keys
    left = {k for k in keys - plotted(spec) if not k.startswith("marker/") and not k.endswith("_se")}
    assert left == {"train/step", "train/tokens"}
    assert all(p["x"] in (X_AXIS, "train/tokens") for s in spec for p in s["panels"])
    assert wandb_workspace.main([str(out), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["sections"] == spec and printed["project"] == "pretrainer"


def test_check_run_stdout_is_the_report(killed_and_resumed):
    """Importing Accelerate imports DeepSpeed, whose CPU-detection notice went to stdout ahead of the report."""
    out, _ = killed_and_resumed
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}  # the notice needs DeepSpeed to detect
    proc = subprocess.run(
        [sys.executable, "scripts/check_run.py", str(out), "--verify", "fast"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("verdict: ") and "Setting accelerator" not in proc.stdout + proc.stderr


@pytest.mark.slow  # incidents as tracker rows; the default set holds the tracker history to metrics.jsonl
def test_rollback_and_skip_are_on_the_dashboard(tmp_path, cache_dir):
    from test_spikes import SPIKY

    out = tmp_path / "run"
    proc = launch(out, cache_dir, *SPIKY, "--set", "debug.inject.poison_samples=[0, 474, 485]")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert_history_equals_metrics(out)
    rows = wandb_rows(out).values()
    assert max(r.get("incidents/rollback", 0) for r in rows) == 1  # skipped under the restored weights
    assert max(r.get("incidents/skip", 0) for r in rows) >= 1
    assert any(r.get("marker/spike") == 31 for r in rows)
    replayed = [r["train/step"] for r in rows if "loss" in r]
    assert len(replayed) > len(set(replayed))  # a replayed step is a new row, at its own optimizer step


def test_mfu_with_a_peak(tmp_path, cache_dir):
    import run_recipe

    out = tmp_path / "run"
    assert (
        run_recipe.main(
            [
                str(FIXTURES / "micro.yaml"),
                "--output-dir",
                str(out),
                "--set",
                f"data.cache_dir={cache_dir}",
                "--set",
                "logging.peak_tflops=0.5",
            ]
        )
        == 0
    )
    mfus = [m["mfu"] for m in read_jsonl(out / "metrics.jsonl") if "loss" in m]
    assert mfus and all(0 < x < 1 for x in mfus)
