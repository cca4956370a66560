"""The loss-curve forecast: the fitter on curves drawn from the law, what the data identify, the off-track rule, CSV
curves, the script, and one real run's in-loop metrics and event."""

import json
import math
import time

import numpy as np
import pytest

from pretrainer.analysis.forecast import Curve, credible, fit, off_track, predict
from pretrainer.analysis.laws import LAWS, LawFit, basis
from pretrainer.analysis.outlook import csv_curve, forecast_report, law_line, outlook
from pretrainer.observe.tracking import read_jsonl
from pretrainer.recipe.schedules import wsd

N, W = 2000, 50
TRUE = LawFit.of("annealing", [0.4], [2.0, 3.0, 4e-4], 0.99)
"""The annealing law with L0 2, A 3, alpha 0.4, C 4e-4, lam 0.99."""
MPL = LawFit.of("multipower", [0.4, 0.0, 0.6, 0.6], [2.0, 3.0, 0.4])
"""The multi-power law with the exponents Luo et al. fitted (beta, gamma ~0.6), C 1, B 0.4."""


def curve_of(law: LawFit, lr, steps, warmup) -> np.ndarray:
    return law.predict(basis(lr, warmup, steps))


def schedule(kind: str) -> np.ndarray:
    if kind == "const":
        return np.array([s / W if s < W else 1.0 for s in range(N)])
    if kind == "cosine":
        return np.array([s / W if s < W else 0.5 * (1 + math.cos(math.pi * (s - W) / (N - W))) for s in range(N)])
    kw = dict(warmup_steps=W, total_steps=N, decay_steps=N // 5, decay_shape="1-sqrt", min_lr_ratio=0.0)
    return np.array([wsd(s, **kw) for s in range(N)])


def drawn(kind: str, seed: int = 0, every: int = 20, noise: float = 0.01, law: LawFit = TRUE) -> Curve:
    lr, steps = schedule(kind), np.arange(every, N + 1, every)
    y = curve_of(law, lr, steps, W) + noise * np.random.default_rng(seed).standard_normal(len(steps))
    return Curve(lr, steps, y, W, first=1)  # drawn from the law from the start: no early transient to leave out


def test_fitter_recovers_the_law_from_noisy_curves():
    f = fit([drawn("const"), drawn("cosine", seed=1)], laws=("annealing",))
    p = f.params
    assert f.calibrated and abs(p["L0"] - 2.0) < 0.05 and abs(p["A"] - 3.0) < 0.3 and abs(p["alpha"] - 0.4) < 0.05
    assert f.sigma == pytest.approx(0.01, rel=0.3)  # the residual is the noise that was added
    # the fitted law predicts a schedule it never saw: the WSD curve
    w = drawn("wsd", noise=0.0)
    v, lo, hi = predict(f, w.lr, w.steps, W)
    assert np.mean(np.abs(v - w.loss)) < 0.005 and lo[-1] <= w.loss[-1] <= hi[-1]


def test_the_law_that_predicts_best_is_chosen_and_says_so():
    """Curves drawn from the multi-power law: the annealing law's one shape of decay gain fits the cosine's first
    half but mispredicts its second; validation on the run's own later points sees it and chooses the multi-power
    law, whose forecast of the end lands within 1%. Drawn from the annealing law, it is not beaten."""
    half = drawn("cosine", seed=2, noise=0.003, law=MPL)
    cut = Curve(half.lr, half.steps[: len(half.steps) // 2], half.loss[: len(half.steps) // 2], W, first=1)
    f = fit([cut])
    assert f.law == "multipower" and f.validation["multipower"] < f.validation["annealing"], f.validation
    assert set(f.validation) == {"power", "annealing", "multipower"} and f.cuts >= 3
    value, lo, hi = predict(f, half.lr, [N], W)
    true = curve_of(MPL, half.lr, [N], W)[0]
    assert abs(value[0] - true) / true < 0.01 and lo[0] <= true <= hi[0]
    g = fit([Curve(half.lr, cut.steps, curve_of(TRUE, half.lr, cut.steps, W), W, first=1)])
    assert g.validation["annealing"] <= 1.05 * min(g.validation.values()), g.validation


def test_a_constant_lr_alone_is_stable_phase_only():
    f = fit([drawn("const")])
    assert not f.calibrated and f.mode == "stable-phase only" and f.law == "power"
    assert any("not calibrated" in n for n in f.notes)
    # its forecast for a decaying schedule has no decay gain: the stable power law, above what the decay gives
    w = drawn("wsd", noise=0.0)
    assert predict(f, w.lr, [N], W)[0][0] > w.loss[-1]


def test_a_law_that_forecasts_a_negative_loss_is_not_believed():
    """A decay gain larger than the loss itself (a multi-power fit on a few noisy points did this: -107% on a
    training-loss CSV cut at 30%) makes no forecast; below L0 is allowed (a decay gains beyond the constant-LR floor)."""
    lr = schedule("cosine")
    end = basis(lr, W, [N])
    wild = LawFit.of("annealing", [0.4], [0.1, 0.1, 1.0], 0.99)
    assert wild.predict(end)[0] < 0 and not credible(wild, end)
    assert credible(TRUE, end) and credible(MPL, end) and MPL.predict(end)[0] < MPL.coef[0]


def test_a_parameter_at_its_bound_is_reported():
    """A curve that is flat after a fast fall has no floor the points can place: L0 is held at 0 and said so."""
    lr, steps = schedule("const"), np.arange(20, N + 1, 20)
    y = 9.0 * np.maximum(steps, 1) ** -0.05  # a power law with no floor: the fit wants L0 < 0
    f = fit([Curve(lr, steps, y, W, first=1)])
    assert "L0" in f.at_bound and any("at a bound" in n for n in f.notes)
    assert f.as_dict()["at_bound"] == f.at_bound


def test_off_track_sees_a_drift_and_not_noise():
    healthy = drawn("const", seed=3)
    f = fit([Curve(healthy.lr, healthy.steps[:60], healthy.loss[:60], W)])
    assert off_track(f, Curve(healthy.lr, healthy.steps[:64], healthy.loss[:64], W)) == []
    drifting = Curve(healthy.lr, healthy.steps[:64], healthy.loss[:64].copy(), W)
    drifting.loss[60:] += np.array([0.05, 0.08, 0.11, 0.14])  # a slow rise the law does not foresee
    assert off_track(f, drifting) == [int(s) for s in healthy.steps[60:64]]


@pytest.mark.slow  # a drift seen live and remembered; the default set forecasts in the loop and in check_run
def test_the_loop_logs_a_drift_when_it_begins_and_check_run_remembers_it(tmp_path):
    """A drift the law later bends to follow (fitted on evals inside it) is on track at the end; the in-loop check
    saw it when it showed, logged one `off_track` event, and check_run says the run was off track."""
    import json

    from pretrainer.analysis.outlook import Forecaster, remembered_drift

    healthy = drawn("const", seed=3)
    loss = healthy.loss.copy()
    loss[40:] += 0.004 * np.arange(1, len(loss) - 39) ** 1.2  # from eval 40 a slow rise, never corrected
    fc, began = Forecaster(healthy.lr, W), []
    for k, (step, value) in enumerate(zip(healthy.steps.tolist(), loss.tolist())):
        fc.observe(step, value)
        if (out := fc.forecast()) is not None:
            assert out.metrics["forecast/off_track"] in (0.0, 1.0)
            if out.drift is not None:
                began.append((k, out.drift))
    assert began and 40 <= began[0][0] <= 50, began  # seen within ten evals of its start
    assert all(b[1]["evals"][0] > int(healthy.steps[39]) for b in began)
    fresh = Forecaster(healthy.lr, W)  # healthy: never
    for step, value in zip(healthy.steps.tolist(), healthy.loss.tolist()):
        fresh.observe(step, value)
        assert (out := fresh.forecast()) is None or out.drift is None
    events = [{"event": "off_track", "step": 999, **json.loads(json.dumps(began[0][1]))}]  # as logged
    was, line = remembered_drift(events, now_off=False)
    assert was == [began[0][1]] and line.startswith(f"was off track: evals at steps {began[0][1]['evals'][0]}-")
    assert remembered_drift(events, now_off=True)[1] is None  # today's verdict says it already
    assert remembered_drift([], now_off=False) == ([], None)


def test_fit_time_grows_slowly_with_points():
    w = schedule("wsd")
    times = {}
    for m in (10, 100, 1000):
        steps = np.linspace(1, N, m).astype(int)
        curve = Curve(w, steps, curve_of(TRUE, w, steps, W) + 0.01 * np.random.default_rng(m).standard_normal(m), W)
        t0 = time.perf_counter()
        fit([curve])
        times[m] = time.perf_counter() - t0
    assert times[1000] < 3.0, times  # under a second on this machine; room for a loaded CI core


def test_csv_curve_and_the_script(tmp_path, capsys):
    import forecast

    lr = schedule("cosine") * 3e-4
    steps = np.arange(1, N + 1)
    loss = curve_of(TRUE, lr / 3e-4, steps, W)
    path = tmp_path / "run.csv"
    rows = ["step,lr,loss"] + [
        f"{s},{v},{(loss[s - 1] if s <= 1200 and s % 20 == 0 else '')}" for s, v in zip(steps, lr)
    ]
    path.write_text("\n".join(rows) + "\n")
    c = csv_curve(path)
    assert len(c.lr) == N and c.steps.max() == 1200 and np.allclose(c.lr.max(), 1.0)
    assert forecast.main(["--curve", str(path), "--json", "--at", "1500,2000"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["final"]) >= {"value", "lo", "hi"} and set(out["at"]) == {"1500", "2000"}
    assert out["final"]["lo"] <= loss[-1] <= out["final"]["hi"]
    assert abs(out["final"]["value"] - loss[-1]) < 0.01
    assert out["law"] in ("annealing", "multipower") and out["law"] in out["validation"]["scores"]


def test_a_real_run_forecasts_in_the_loop_and_in_check_run(tmp_path, cache_dir, capsys):
    import check_run
    import forecast
    import run_recipe

    out = tmp_path / "run"
    sets = ["eval.every_steps=5", f"data.cache_dir={cache_dir}"]
    argv = ["tests/fixtures/micro.yaml", "--output-dir", str(out)] + [x for s in sets for x in ("--set", s)]
    assert run_recipe.main(argv) == 0
    rows = [m for m in read_jsonl(out / "metrics.jsonl") if "forecast/final" in m]
    # evals at 5, 10, ...; the fit starts at step 6 (twice the warmup): the fourth usable point, 25, starts it
    assert rows and rows[0]["step"] == 25
    assert all(r["forecast/final_lo"] <= r["forecast/final"] <= r["forecast/final_hi"] for r in rows)
    assert all(r["forecast/off_track"] in (0.0, 1.0) for r in rows)
    off = [e for e in read_jsonl(out / "events.jsonl") if e["event"] == "off_track"]
    assert len(off) <= sum(r["forecast/off_track"] for r in rows)  # an event only where a drift begins
    events = [e for e in read_jsonl(out / "events.jsonl") if e["event"] == "forecast"]
    # the decay is the last 3 steps: one eval (step 30) inside it is not yet a calibration
    assert len(events) == len(rows) and events[-1]["mode"] == "stable-phase only"
    assert events[-1]["law"] in LAWS and isinstance(events[-1]["validation"]["scores"], dict)
    fc = forecast_report(out)
    assert fc["lines"][0].startswith(("on track", "off track")) and fc["final"]["step"] == 30
    capsys.readouterr()
    assert check_run.main([str(out), "--target", "1.0", "--verify", "fast"]) == 0
    text = capsys.readouterr().out
    assert "forecast: " in text and "target 1: no" in text and "forecast: law: " in text
    # the per-step training loss beside val/ref: many more points, the same JSON shape
    assert forecast.main([str(out), "--train-loss", "--json"]) == 0
    both = json.loads(capsys.readouterr().out)
    assert both["fit"]["points"] > fc["fit"]["points"] + 10 and set(both["final"]) >= {"value", "lo", "hi"}


def test_momentum_is_the_first_order_filter():
    """The annealing momentum m_i = lam m_(i-1) + x_i, computed in blocks, against scipy's filter: the same to
    rounding over a long sequence (several blocks at every lam) and a short one."""
    from scipy.signal import lfilter

    from pretrainer.analysis.laws import LAMBDAS, momentum

    rng = np.random.default_rng(0)
    for n in (7, 300_000):
        x = np.maximum(rng.standard_normal(n), 0.0) * 1e-4
        for lam in LAMBDAS:
            want = lfilter([1.0], [1.0, -lam], x)
            np.testing.assert_allclose(momentum(x, lam), want, rtol=1e-12, atol=0)


def test_the_band_holds_one_eval_of_noise_and_the_drift_check_more():
    """The final value is one noisy eval: the band's noise is the curve's point-to-point scatter (the trend left out),
    so at the last observed step the band is ~Z90 x the noise added; the drift check keeps the fit's residual sd."""
    from pretrainer.analysis.forecast import Z90, drift_band, scatter

    c = drawn("cosine", seed=3, noise=0.02)
    assert scatter(c.loss) == pytest.approx(0.02, rel=0.25)  # a curve falling from 5 to 2: the descent is not noise
    assert scatter(c.loss[:3]) is None
    f = fit([c], laws=("annealing",))
    v, lo, hi = predict(f, c.lr, [int(c.steps[-1])], W)
    assert (hi - v)[0] == pytest.approx(Z90 * 0.02, rel=0.35)
    # a validated law's own error is measured at horizons: none at the last observed step, more further out
    assert f.law in f.validation and (hi - v)[0] == pytest.approx(Z90 * f.scatter)
    half = Curve(c.lr, c.steps[c.steps <= N // 2], c.loss[c.steps <= N // 2], W, first=1)
    fh = fit([half], laws=("annealing",))
    v2, _, hi2 = predict(fh, c.lr, [N // 2, N], W)
    assert fh.law in fh.validation and (hi2 - v2)[1] > 1.2 * (hi2 - v2)[0]
    dv, dhi = drift_band(f, c.lr, [int(c.steps[-1])], W)
    assert dv[0] == v[0] and dhi[0] - dv[0] >= Z90 * f.sigma


def test_an_independent_run_shares_the_law_and_this_run_keeps_its_own_level():
    """Seeds of one recipe differ by a level that persists: with another seed as calibration, the forecast carries
    the run's own level (its last points against the shared law) where validation says that predicted better; a
    branch decay, which starts where the run's points stop, shares the level."""
    lr, steps = schedule("cosine"), np.arange(20, N + 1, 20)
    rng = np.random.default_rng(5)
    law = curve_of(TRUE, lr, steps, W)
    run = law + 0.08 + 0.01 * rng.standard_normal(len(steps))  # 2-3% above its sibling, for good
    sibling = Curve(lr, steps, law + 0.01 * rng.standard_normal(len(steps)), W, first=1, same_run=False)
    half = Curve(lr, steps[steps <= N // 2], run[steps <= N // 2], W, first=1)
    f = fit([half, sibling])
    v, lo, hi = (x[0] for x in predict(f, lr, [N], W))
    truth = law[-1] + 0.08
    assert f.level == pytest.approx(0.08 / law[steps <= N // 2][-3:].mean(), rel=0.3)
    assert abs(v - truth) / truth < 0.01 and lo <= truth <= hi
    assert f.as_dict()["level"] == f.level and any("own level" in n for n in f.notes)
    assert f"own level {f.level:+.2%}" in law_line(f)  # check_run's law line says so
    shared = v / (1 + f.level)  # the shared law's level: the sibling's final, not this run's
    assert abs(shared - truth) / truth > 0.015
    branch = Curve(lr, steps[steps > N // 2], sibling.loss[steps > N // 2], W, same_run=False)
    assert fit([half, branch]).level == 0.0


def test_a_plateau_after_a_steady_fall_is_not_a_drift():
    """A healthy corpus run's `val/ref` (micro recipe at LR 2e-2, WSD over 2,000 steps, an eval every 50): the law
    fitted on its steady fall to step 550 has a residual sd of 0.013, a quarter of one eval's noise; the plateau
    that follows was called off track until the drift band held at least one eval's noise."""
    lr = np.concatenate([np.arange(3) / 3, np.ones(1797), 1 - np.sqrt(np.arange(1, 201) / 200)])
    steps = np.arange(50, 801, 50)
    loss = [5.428, 5.267, 5.379, 5.197, 4.953, 4.856, 4.609, 4.511, 4.382, 4.304, 4.218, 4.213, 4.225, 4.114, 4.136]
    loss += [4.193]
    curve = Curve(lr, steps, np.array(loss), 3)
    for k in (15, 16):
        part = Curve(lr, steps[:k], curve.loss[:k], 3)
        assert not outlook(part).off_track
    early = Curve(lr, steps[:11], curve.loss[:11], 3)
    f = fit([early])
    assert f.sigma < 0.5 * f.scatter  # the residual sd of a smooth stretch is not the eval noise
