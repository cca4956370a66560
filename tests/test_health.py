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

from pretrainer.analysis.plots import eval_curves, loss_limits
from pretrainer.analysis.report import report
from pretrainer.analysis.verdicts import verdict
from pretrainer.observe.tracking import read_jsonl


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
    # a small batch's noisy loss, flat for its first 40 steps (a micro run's brief early plateau): quarters of 10
    # steps cannot measure 0.2% of progress, so no verdict; flat for 40,000 steps they can
    noisy = 5.5 + 0.15 * rng.standard_normal(40_000)
    early = noisy[:40].copy()
    early[30:] += np.median(early[20:30]) - np.median(early[30:]) + 0.01  # its last quarter 0.2% above the one before
    assert verdict(list(enumerate(early.tolist())), [], [], False, 0)[0] == "healthy"
    assert verdict(list(enumerate(noisy.tolist())), [], [], False, 0)[0] == "plateaued"


def test_overfitting():
    losses = curve()
    val = [(50, 4.0), (100, 3.4), (150, 3.2), (200, 3.3), (250, 3.45), (300, 3.6)]
    assert verdict(losses, val, [], True, 0)[0] == "overfitting"
    # the same rise on an eval set whose own spread makes 0.4 nat two standard errors: noise, not overfitting
    assert verdict(losses, val, [], True, 0, val_se={s: 0.14 for s, _ in val})[0] == "healthy"
    assert verdict(losses, val, [], True, 0, val_se={s: 0.02 for s, _ in val})[0] == "overfitting"
    # evals that jump about (the weights move between them: a high LR, a small batch) against the lowest of them,
    # the judgement corpus's 512-token run at step 3,550: healthy; the same level rising over three evals is not
    jumpy = [3.862, 3.864, 3.771, 3.759, 3.600, 3.791, 3.766, 3.871, 3.664, 3.678, 3.739, 3.942]
    jumpy = list(zip(range(100, 1300, 100), jumpy))
    assert verdict(losses, jumpy, [], True, 0, val_se={s: 0.045 for s, _ in jumpy})[0] == "healthy"
    rise = [(100 * k, 3.6 + 0.01 * (-1) ** k) for k in range(1, 10)] + [(1000, 3.7), (1100, 3.8), (1200, 3.9)]
    assert verdict(losses, rise, [], True, 0, val_se={s: 0.02 for s, _ in rise})[0] == "overfitting"


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
    assert r["gns"]["b_simple_tokens"] > 0 and "underestimates the critical batch" in r["gns"]["summary"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    drawn = eval_curves(read_jsonl(out / "evals.jsonl"))
    assert drawn[:2] == ["val/ref", "val/avg"] and not any(k.endswith("_se") for k in drawn)
    assert check_run.main([str(out)]) == 0
    assert capsys.readouterr().out.startswith("verdict: healthy")


def test_the_pictures_loss_axis_holds_the_run_not_its_untrained_start():
    """The first tenth of the steps (the untrained start, ~2x the final loss) would squash the run into the top third;
    every later point stays inside the axis."""
    steps = list(range(0, 221, 10))
    train = [8.3 - 3 * min(s, 50) / 50 + 0.001 * s for s in steps]  # 8.3 at step 0, ~5.4 from step 50
    lo, hi = loss_limits([(steps, train), ([0, 50, 100, 220], [8.3, 5.5, 5.45, 5.35])])
    later = [v for s, v in zip(steps, train) if s >= 22] + [5.5, 5.45, 5.35]
    assert lo < min(later) and hi >= max(later) and hi < 7.5


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
    from pretrainer.analysis.replay import spike_episodes

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


def rough_curve(n, seed):
    """A per-step training curve with what the replay must get right: noise with heavy outliers (dropped from the
    window), short spikes that recover, a NaN, a stage start with a level shift, and a jump that never comes back."""
    rng = np.random.default_rng(seed)
    s = np.arange(1, n + 1)
    y = 3 + 3 / np.sqrt(s) + 0.02 * rng.standard_normal(n) + 0.4 * (rng.random(n) < 0.003) * rng.standard_normal(n)
    for at in rng.choice(np.arange(200, n // 2), 4, replace=False):
        y[at : at + rng.integers(1, 6)] += rng.uniform(0.05, 0.3)
    y[n // 3] = np.nan
    y[n // 2 :] += 0.1  # a stage start (a grace period there) with a level shift
    y[int(n * 0.9) :] += 2.0  # and a jump that stays: an episode that never recovers
    return list(zip(s.tolist(), y.tolist()))


@pytest.mark.parametrize("seed", range(2))
def test_fast_replay_decides_as_the_live_detector_step_by_step(seed):
    """check_run's batched replay (tables of trend fits, whole stretches of `ok` steps at once) finds the same
    episodes, to the last bit of their bounds, as feeding every step through the live SpikeDetector."""
    from pretrainer.analysis.replay import spike_episodes

    losses = rough_curve(6000, seed)
    graces = [20, 3000]
    fast, slow = spike_episodes(losses, graces), spike_episodes(losses, graces, batched=False)
    assert fast == slow
    assert len(slow) >= 3 and slow[-1]["recovered"] is None  # the curve exercised recovery and divergence
    assert any(e["recovered"] is not None for e in slow[:-1])


def test_a_window_is_fitted_alone_as_among_thousands():
    """One trend kernel: a row's fit does not depend on the rows beside it (no BLAS product whose blocking changes
    with the batch), so the live detector's fit of a window (one row) is the replay's (a batch), bit for bit, for
    full windows, short ones, gappy ones, and a judged step ahead of the window."""
    from pretrainer.stability.spikes import trend_fit, trend_fits

    rng = np.random.default_rng(0)
    for width, gappy in ((100, False), (100, True), (37, False)):
        rows = 2048
        if gappy:
            steps = np.sort(rng.choice(np.arange(10_000), (rows, width)), axis=1).astype(float) + np.arange(width)
            at = steps[:, -1] + rng.integers(1, 4, rows)
        else:
            steps = np.arange(width, dtype=float) + rng.integers(0, 10_000, rows)[:, None]
            at = steps[:, -1] + 1
        losses = 3 + 0.02 * rng.standard_normal((rows, width)) + 0.5 * (rng.random((rows, width)) < 0.02)
        batch = trend_fits(steps, losses, at, 3, 100)
        for i in rng.choice(rows, 40, replace=False):
            alone = trend_fits(steps[i : i + 1], losses[i : i + 1], at[i : i + 1], 3, 100)
            assert (alone.coef[0] == batch.coef[i]).all() and alone.scale[0] == batch.scale[i]
            assert trend_fit(steps[i], losses[i], at[i], 3, 100) == (batch.coef[i, 0], batch.scale[i])
        middle = trend_fits(steps[100:1100], losses[100:1100], at[100:1100], 3, 100)
        assert (middle.coef == batch.coef[100:1100]).all() and (middle.scale == batch.scale[100:1100]).all()


def test_a_short_or_gappy_window_widens_the_scale_a_full_one_keeps():
    """The trend's prediction error beyond a full window's: none for a full window of consecutive steps (judging
    the next step or, with suspects pending, one further on), some for a window with a gap or fewer steps."""
    from pretrainer.stability.spikes import trend_fits

    rng = np.random.default_rng(1)
    losses = 3 + 0.02 * rng.standard_normal((1, 100))
    full = np.arange(100.0)[None]
    nxt = trend_fits(full, losses, [100.0], 3, 100)
    ahead = trend_fits(full, losses, [102.0], 3, 100)
    assert ahead.scale[0] == pytest.approx(nxt.scale[0], rel=1e-9) and nxt.noise[0] == pytest.approx(ahead.noise[0])
    widening = nxt.scale[0] / nxt.noise[0]
    gap = full.copy()
    gap[0, 90:] += 30  # thirty steps not logged before the window's last ten
    gappy = trend_fits(gap, losses, [gap[0, -1] + 1], 3, 100)
    assert gappy.scale[0] / gappy.noise[0] > 1.03 * widening
    short = trend_fits(full[:, 70:], losses[:, 70:], [100.0], 3, 100)
    assert short.scale[0] / short.noise[0] > 1.03 * widening


def test_one_rule_live_and_replayed_with_the_runs_own_parameters():
    """The detector's defaults are the recipe's; check_run replays with the run's own `spikes` section (read from
    its resolved recipe), so a run that raised its threshold is judged offline by that threshold, as live."""
    from pretrainer.analysis.replay import spike_episodes
    from pretrainer.analysis.runfiles import spike_rule
    from pretrainer.recipe.sections import SpikesSection
    from pretrainer.stability.decisions import OK
    from pretrainer.stability.recovery import SpikeHandler
    from pretrainer.stability.spikes import SpikeDetector

    d, s = SpikeDetector(), SpikesSection()
    assert (d.window, d.threshold, d.persistence, d.min_history, d.grace_steps) == (
        s.window,
        s.threshold,
        s.persistence,
        s.min_history,
        s.grace_steps,
    )
    losses = curve(n=600, seed=3)
    bumped = [(st, v + (0.25 if 400 <= st < 403 else 0.0)) for st, v in losses]  # a 5-sd bump
    strict = SpikesSection(threshold=6.0, window=60)
    recipe = {"spikes": {"threshold": 6.0, "window": 60}}
    assert spike_rule(recipe) == strict and spike_rule(None) == s
    assert spike_rule({"spikes": {"threshold": 6.0, "a_field_from_later": 1}}).threshold == 6.0
    assert [e["onset"] for e in spike_episodes(bumped, [20])] == [400]
    assert spike_episodes(bumped, [20], strict) == spike_episodes(bumped, [20], strict, batched=False) == []

    class Log:
        def event(self, *a, **k):
            pass

    for cfg, onsets in ((s, [400]), (strict, [])):  # the live handler, fed the same steps, agrees
        h = SpikeHandler(cfg, lambda m: None, Log(), lambda *a: None)
        h.start_grace(20)
        found = [st for st, v in bumped if h.judge(st, v, 1.0) != OK]
        assert [st - cfg.persistence + 1 for st in found] == onsets


def test_evals_have_a_stream_of_their_own_and_older_runs_read_alike(tmp_path):
    """Eval rows go to evals.jsonl too (the same objects as metrics.jsonl's), so a reader of a long run parses no
    training row; a run written before the stream reads its evals from metrics.jsonl (a torn last line skipped), and
    resuming it writes the stream with the evals so far."""
    from accelerate import Accelerator

    from pretrainer.analysis.runfiles import eval_rows
    from pretrainer.observe.tracking import EVALS, RunLog

    rows = []
    for step in range(1, 400):
        rows.append({"step": step, "loss": 3.0, "step_losses": [[step, 3.0]]})
        if step % 7 == 0:
            rows.append({"step": step, "val/ref": 2.5 + step * 1e-3})
        if step % 11 == 0:
            rows.append({"step": step, "eval/hellaswag": 0.3})
    text = "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 400, "val/ref": 2.'  # killed mid-line
    old = tmp_path / "old"
    old.mkdir()
    (old / "metrics.jsonl").write_text(text)
    want = [r for r in rows if any(k.startswith(("val/", "eval/")) for k in r)]
    assert list(eval_rows(old)) == want
    log = RunLog(old, Accelerator(cpu=True), enabled=True)  # a resume of the old run
    assert list(eval_rows(old)) == want and (old / EVALS).exists()
    log.metrics(400, {"loss": 2.9})
    log.metrics(400, {"val/ref": 2.4})
    assert [r["step"] for r in eval_rows(old)][-2:] == [399, 400] and len(list(eval_rows(old))) == len(want) + 1
    new = [json.loads(line) for line in (old / "metrics.jsonl").read_text().splitlines()[-2:]]
    assert json.loads((old / EVALS).read_text().splitlines()[-1]) == new[-1] and "loss" in new[0]
