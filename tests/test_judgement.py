"""The judgement benchmark's fast subset (scripts/bench_judgement.py --quick): real runs at the recipe defaults, every
automatic judgement counted from what the runs logged."""

import json

import bench_judgement
import pytest


def test_quick_corpus_healthy_runs_raise_nothing_poison_is_blamed_and_the_replay_is_the_live_rule(tmp_path, cache_dir):
    out = tmp_path / "j.json"
    args = ["--quick", "--work-dir", str(tmp_path / "runs"), "--cache-dir", str(cache_dir), "--out", str(out)]
    assert bench_judgement.main(args) == 0
    r = json.loads(out.read_text())
    assert r["healthy_steps"] == 600 and r["healthy_evals"] >= 10
    assert r["false_alarms"] == {k: 0 for k in r["false_alarms"]}, r["false_alarms"]
    (poison,) = [x for x in r["runs"] if x["kind"] == "data"]
    assert poison["rc"] == 0 and poison["delay"] is not None and poison["delay"] <= 3 + 1  # persistence + 1
    assert poison["blamed_overlaps_poison"] and poison["skipped_outside_poison"] == 0
    # check_run's replay of what each run lived equals the live rule's spikes, the rolled-back one included
    assert poison["live_spikes"] == [[300, 302]] and poison["counts"]["rollback"] == 1
    big = r["bumps"]["8 sd x 3"]  # an 8-sd bump of 3 steps on the runs' own noise: found within persistence steps
    assert big["placed"] == 4 and big["found"] == 4 and big["max_delay"] <= 3
    assert r["bumps"]["8 sd x 1"]["found"] == 0  # one step is skip-step's to judge, not the spike rule's
    assert all(x["replay_equals_live"] for x in r["runs"]), [
        (x["live_spikes"], x["replayed_spikes"]) for x in r["runs"]
    ]


def test_curves_from_elsewhere_are_judged_by_the_default_rule(tmp_path):
    """A per-step curve exported from another run (`step,loss,lr` CSV): the rule finds its one real bump, nothing
    else, and measures its reach on the curve's own noise; a file without a loss column is refused by name."""
    import numpy as np

    rng = np.random.default_rng(0)
    s = np.arange(1, 3001)
    loss = 3 + 3 / np.sqrt(s) + 0.02 * rng.standard_normal(len(s))
    loss[1999:2004] += 0.3  # steps 2000-2004: 15 sd of this noise
    lr = np.minimum(1.0, s / 50) * 3e-4
    path = tmp_path / "other.csv"
    path.write_text("step,lr,loss\n" + "".join(f"{a},{b},{c}\n" for a, b, c in zip(s, lr, loss)))
    r = bench_judgement.curves_judged([path], positions=2)
    (curve,) = r["curves"]
    assert curve["steps"] == 3000 and len(curve["spikes"]) == 1 and 2000 <= curve["spikes"][0][0] <= 2004
    assert r["bumps"]["8 sd x 3"]["found"] == 2 and r["bumps"]["8 sd x 1"]["found"] == 0
    (tmp_path / "bad.csv").write_text("step,value\n1,2.0\n")
    with pytest.raises(ValueError, match=r"bad\.csv: needs the columns step,loss"):
        bench_judgement.csv_series(tmp_path / "bad.csv")
