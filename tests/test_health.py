"""Verdicts on synthetic metrics made for each case; the report and picture of a real run."""

import json
import math
import os
import time

import check_run
import numpy as np
import pytest
import run_recipe
from conftest import FIXTURES

from pretrainer.observe.health import report, verdict


def curve(n=400, seed=0, floor=2.0):
    rng = np.random.default_rng(seed)
    s = np.arange(n)
    return list(zip(s.tolist(), (floor + 6 * np.exp(-s / 120) + 0.05 * rng.standard_normal(n)).tolist()))


def vals(losses, every=50, offset=0.05):
    return [(s, v + offset) for s, v in losses if s % every == 0 and s > 0]


def test_healthy_and_one_spike_is_still_healthy():
    losses = curve()
    assert verdict(losses, vals(losses), [], True, 0)[0] == "healthy"
    spiky = [(s, v * 3 if s == 300 else v) for s, v in losses]
    assert verdict(spiky, vals(losses), [], True, 0)[0] == "healthy"


def test_recovered_from_spikes():
    losses = curve()
    events = [{"event": "spike", "step": 200}, {"event": "rollback", "step": 202}]
    assert verdict(losses, vals(losses), events, True, 0)[0] == "recovered from spikes"


def test_diverging():
    losses = curve()[:250] + [(s, 2.8 + 0.02 * (s - 250)) for s in range(250, 400)]
    v, reasons = verdict(losses, [], [], False, 0)
    assert v == "diverging" and "above its best" in reasons[0]
    assert verdict(curve()[:300] + [(s, math.nan) for s in range(300, 400)], [], [], False, 0)[0] == "diverging"


def test_plateaued():
    rng = np.random.default_rng(1)
    losses = [(s, 3.0 + 0.02 * rng.standard_normal()) for s in range(400)]
    assert verdict(losses, [], [], True, 0)[0] == "plateaued"


def test_overfitting():
    losses = curve()
    val = [(50, 4.0), (100, 3.4), (150, 3.2), (200, 3.3), (250, 3.45), (300, 3.6)]
    assert verdict(losses, val, [], True, 0)[0] == "overfitting"


def test_stalled():
    assert verdict([], [], [], False, None)[0] == "stalled"
    assert verdict(curve(), [], [], False, idle_s=3 * 3600)[0] == "stalled"
    assert verdict(curve(), [], [], True, idle_s=3 * 3600)[0] != "stalled"  # a finished run is not stalled


def test_report_plot_and_trainer_health_events(tmp_path, cache_dir, capsys):
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
                "eval.every_steps=10",
            ]
        )
        == 0
    )
    capsys.readouterr()  # the run's own console blocks
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    health = [e for e in events if e["event"] == "health"]
    assert [e["step"] for e in health] == [10, 20, 30] and health[-1]["verdict"] == "healthy"
    png = tmp_path / "report.png"
    assert check_run.main([str(out), "--json", "--plot", str(png)]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["verdict"] == "healthy" and r["finished"] and r["step"] == 30
    assert r["latest_checkpoint"]["step"] == 30
    assert r["stages"][0]["name"] == "main" and r["stages"][0]["loss_last"] < r["stages"][0]["loss_first"]
    assert "gap" in r and r["throughput"]["tokens_per_s_median"] > 0
    assert r["gns"]["b_simple_tokens"] > 0 and "x the estimated critical batch" in r["gns"]["summary"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert check_run.main([str(out)]) == 0
    assert capsys.readouterr().out.startswith("verdict: healthy")


def test_live_run_without_logs_is_stalled(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("")
    old = time.time() - 7200
    os.utime(tmp_path / "metrics.jsonl", (old, old))
    assert report(tmp_path)["verdict"] == "stalled"
    assert check_run.main([str(tmp_path / "missing")]) == 2


@pytest.mark.parametrize("seed", range(3))
def test_no_verdict_flip_from_noise(seed):
    losses = curve(seed=seed)
    assert verdict(losses, vals(losses), [], True, 0)[0] == "healthy"


def test_report_uses_the_live_rule_on_the_logged_curve():
    """check_run.py judges spikes as the live detector does: a 3-step rise of 5 noise sd that came back is a
    recovered spike even with no events; one that never came back is divergence."""
    from pretrainer.train.spikes import spike_episodes

    losses = curve(n=600, seed=3)
    bumped = [(s, v + (0.25 if 400 <= s < 403 else 0.0)) for s, v in losses]  # noise sd is 0.05
    episodes = spike_episodes(bumped, grace_at=[20])
    assert [e["onset"] for e in episodes] == [400] and episodes[0]["recovered"] is not None
    assert verdict(bumped, vals(losses), [], True, 0, episodes=episodes)[0] == "recovered from spikes"
    assert spike_episodes(losses, grace_at=[20]) == []
    rng = np.random.default_rng(4)  # on a plateau, a jump of 5 noise sd that stays
    stuck = [(s, 3.0 + 0.05 * rng.standard_normal() + (0.25 if s >= 400 else 0.0)) for s in range(600)]
    episodes = spike_episodes(stuck, grace_at=[20])
    v, reasons = verdict(stuck, [], [], True, 0, episodes=episodes)
    assert v == "diverging" and "since a spike at step 400" in reasons[0]
