"""scripts/slurm/train.sbatch under a fake Slurm: bash runs the job script as sbatch would, with stand-ins for srun
and scontrol on PATH (tests/fixtures/fake_slurm). The signal goes to the batch shell alone: USR1 as
`#SBATCH --signal=B:USR1@120` sends it before the time limit (the script requeues), SIGTERM as a preemption or a
scancel sends it (Slurm requeues a preempted job itself: the script does not)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import FIXTURES, ROOT, step_losses

from pretrainer.observe.tracking import read_jsonl

SCRIPT = ROOT / "scripts" / "slurm" / "train.sbatch"

FAKE_TRAINING = """#!/bin/bash
# stands in for python: records how it was launched, then waits; SIGTERM: "saves" and exits 75
echo "launch node=$SLURM_NODEID $*" >> "$FAKE_SLURM_LOG"
trap 'echo "saved node=$SLURM_NODEID" >> "$FAKE_SLURM_LOG"; exit 75' TERM
while [ ! -e "$FAKE_SLURM_LOG.done" ]; do sleep 0.1; done  # until the test says the training finished
exit "${FAKE_EXIT:-0}"
"""


def job_env(tmp_path: Path, nodes: int, **extra: str) -> dict:
    return {
        **os.environ,
        "PATH": f"{FIXTURES / 'fake_slurm'}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "4242",
        "SLURM_NNODES": str(nodes),
        "SLURM_JOB_NODELIST": f"node[1-{nodes}]",
        "FAKE_SLURM_LOG": str(tmp_path / "slurm.log"),
        "OMP_NUM_THREADS": "1",
        **extra,
    }


def submit(args: list[str], env: dict, log: Path) -> subprocess.Popen:
    """The job script as sbatch runs it: bash, in the repository, output appended to the job's log."""
    with open(log, "a") as f:
        return subprocess.Popen(["bash", str(SCRIPT), *args], cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)


def wait_for(check, timeout: float = 240.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and not check():
        time.sleep(0.2)
    assert check(), "timed out"


def test_the_job_script_forwards_the_signal_and_requeues_once_at_the_time_limit(tmp_path):
    fake = tmp_path / "python"
    fake.write_text(FAKE_TRAINING)
    fake.chmod(0o755)
    env = job_env(tmp_path, nodes=2, PYTHON=str(fake))
    log, record = tmp_path / "job.log", tmp_path / "slurm.log"
    job = submit(["recipes/tiny.yaml", "--set", "run.name=a b"], env, log)
    wait_for(lambda: record.exists() and record.read_text().count("launch node=") == 2)
    job.send_signal(signal.SIGUSR1)  # the batch shell only: the time limit is 120 s away
    assert job.wait(timeout=60) == 75, log.read_text()
    lines = record.read_text().splitlines()
    launches = sorted(x for x in lines if x.startswith("launch"))
    assert [x.split()[1] for x in launches] == ["node=0", "node=1"]
    for x in launches:  # one launcher per node, the rendezvous on the first node, the arguments intact
        assert " --num_machines 2 --num_processes 2 " in x and " --main_process_ip localhost " in x
        assert f"--machine_rank {x.split()[1][-1]} " in x
        assert x.endswith("scripts/run_recipe.py recipes/tiny.yaml --set run.name=a b --resume auto")
    assert sorted(x for x in lines if x.startswith("saved")) == ["saved node=0", "saved node=1"]
    assert [x for x in lines if x.startswith("requeue")] == ["requeue 4242"]
    assert "checkpoint saved; requeueing job 4242" in log.read_text()

    for requeue, expect in (("0", []), ("1", ["requeue 4242"])):  # a preemption: Slurm requeues (or REQUEUE_ON_TERM)
        record.unlink()
        job = submit(["recipes/tiny.yaml"], {**env, "REQUEUE_ON_TERM": requeue}, log)
        wait_for(lambda: record.exists() and record.read_text().count("launch node=") == 2)
        job.send_signal(signal.SIGTERM)
        assert job.wait(timeout=60) == 75, log.read_text()
        lines = record.read_text().splitlines()
        assert sorted(x for x in lines if x.startswith("saved")) == ["saved node=0", "saved node=1"]
        assert [x for x in lines if x.startswith("requeue")] == expect
    assert "not requeued from here" in log.read_text()

    for code in ("0", "2"):  # finished, or failed: no requeue, the step's code
        record.unlink()
        job = submit(["recipes/tiny.yaml"], {**env, "FAKE_EXIT": code}, log)
        wait_for(lambda: record.exists() and record.read_text().count("launch node=") == 2)
        (tmp_path / "slurm.log.done").touch()  # the training "finishes"
        assert job.wait(timeout=60) == int(code)
        (tmp_path / "slurm.log.done").unlink()
        assert "requeue" not in record.read_text()


@pytest.mark.slow  # a preempted Slurm job requeued and resumed on 1 and 2 fake nodes
@pytest.mark.distributed
@pytest.mark.parametrize("nodes", [1, 2])
def test_a_preempted_job_requeues_and_resumes_to_the_uninterrupted_losses(tmp_path, cache_dir, nodes):
    """Real training (the micro recipe under the flagship's ZeRO-1 config, on CPU) on 1 and 2 "nodes": the time
    limit's USR1 to the batch shell gives a checkpoint with reason preempt, one requeue, and the requeued job (the same script again)
    resumes to per-step losses equal to an uninterrupted job's; the appended log has no carriage return and no
    traceback."""
    sets = ["stages.0.steps=200", "eval.every_steps=0", "checkpoint.every_tokens=null", "precision.mixed=no"]
    args = lambda out: [  # noqa: E731
        str(FIXTURES / "micro.yaml"),
        "--output-dir",
        str(out),
        "--set",
        f"data.cache_dir={cache_dir}",
        *(x for s in sets for x in ("--set", s)),
    ]
    env = job_env(tmp_path, nodes, DS_ACCELERATOR="cpu", PYTHON=sys.executable)
    ref = tmp_path / "reference"
    assert submit(args(ref), env, tmp_path / "ref.log").wait(timeout=600) == 0, (tmp_path / "ref.log").read_text()

    out, log, record = tmp_path / "run", tmp_path / "job.log", tmp_path / "slurm.log"
    job = submit(args(out), env, log)
    wait_for(lambda: any(m.get("step", 0) >= 20 for m in read_jsonl(out / "metrics.jsonl")))
    job.send_signal(signal.SIGUSR1)
    assert job.wait(timeout=300) == 75, log.read_text()[-3000:]
    saved = [e for e in read_jsonl(out / "events.jsonl") if e["event"] == "checkpoint"]
    assert saved[-1]["reason"] == "preempt" and saved[-1]["step"] < 200
    assert record.read_text().splitlines() == ["requeue 4242"]
    requeued = submit(args(out), {**env, "SLURM_RESTART_COUNT": "1"}, log)
    assert requeued.wait(timeout=600) == 0, log.read_text()[-3000:]
    assert any(e["event"] == "resume" for e in read_jsonl(out / "events.jsonl"))
    assert step_losses(out) == step_losses(ref)
    text = log.read_text()
    assert "\r" not in text and "Traceback" not in text
    assert text.count("preempted at step") == 1 and "exitcode: 75" not in text  # torch elastic's line, quieted
    assert json.loads((out / "run.json").read_text())  # one run, continued
