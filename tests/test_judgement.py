"""The judgement benchmark's fast subset (scripts/bench_judgement.py --quick): real runs at the recipe defaults, every
automatic judgement counted from what the runs logged."""

import json

import bench_judgement


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
