"""The per-step record (observe/steprecord.py) and the replay of what a run lived (spike_replay.lived_episodes)."""

import numpy as np

from pretrainer.analysis.replay import lived_episodes, spike_episodes, timeline
from pretrainer.observe.steprecord import StepRecorder, read_record
from pretrainer.recipe.sections import SpikesSection
from pretrainer.stability.skip_step import Observed
from pretrainer.stability.spikes import SpikeDetector


def _curve(n: int, seed: int = 0, bump_at: int | None = None) -> np.ndarray:
    rng = np.random.default_rng(seed)
    s = np.arange(1, n + 1)
    loss = 3 + 3 / np.sqrt(s) + 0.02 * rng.standard_normal(n)
    if bump_at is not None:
        loss[bump_at - 1 : bump_at + 2] += 0.5
    return loss.astype(np.float32).astype(float)  # the device's float32, as the record keeps it


def test_record_round_trips_across_launches_and_drops_a_torn_batch(tmp_path):
    rec = StepRecorder(tmp_path, enabled=True)
    for s in range(1, 11):
        rec.observe(s, 0, Observed(1.0 + s, 0.5), s != 4, 0, 100 * s)
    rec.losses(list(range(1, 11)), [9.0] * 10, {"loss": 7.5, "lr": 1e-3, "tokens_per_s": 50.0})
    rec.close()
    rec = StepRecorder(tmp_path, enabled=True)  # a resume: a stream of its own, a new epoch
    rec.observe(6, 1, None, True, 0, 600)  # the guard off: the loss comes with the logging step
    rec.observe(7, 1, Observed(3.0, float("inf")), False, 0, 700)
    rec.losses([6, 7], [2.25, 3.0], {"loss": 2.625})
    rec.flush()
    rec.observe(8, 1, Observed(3.0, 0.5), True, 0, 800)
    rec.losses([8], [3.0])
    rec.flush()
    steps_file = rec.streams[0].path
    rec.streams[0].sink.close()  # killed: its stream never closed
    with open(steps_file, "r+b") as f:  # and the last batch torn mid-write
        f.truncate(f.seek(0, 2) - 40)
    r = read_record(tmp_path)
    assert r.step.tolist() == [*range(1, 11), 6, 7]
    assert r.epoch.tolist() == [0] * 10 + [1, 1]
    assert r.loss[:3].tolist() == [2.0, 3.0, 4.0]  # what the guard saw, not the window's value
    assert r.loss[10] == 2.25 and not r.bad_norm[10]  # an unread norm flags nothing
    assert r.bad_norm[11] and np.isnan(r.judged_loss()[11]) and r.judged_loss()[10] == 2.25
    rows = r.rows
    assert rows["step"].tolist() == [10, 7] and rows["epoch"].tolist() == [0, 1]
    assert rows["row_loss"].tolist() == [7.5, 2.625] and rows["grad_norm"][1] == float("inf")
    assert rows["tokens"].tolist() == [1000, 700] and rows["applied"].tolist() == [True, False]
    assert rows["lr"][0] == 1e-3 and np.isnan(rows["lr"][1]) and np.isnan(rows["gns"][0])
    assert r.step[timeline(r.step)].tolist() == list(range(1, 11))
    assert r.epoch[timeline(r.step)].tolist() == [0] * 5 + [1, 1] + [0] * 3  # re-run steps replace the first


def test_lived_replay_sees_a_rolled_back_spike_as_the_live_rule_did():
    """Epoch 0 runs to a spike (onset 300, detected 302) and rolls back to step 250; epoch 1 replays 251.. without
    it. The final timeline holds no spike; the lived replay finds the one the live detector acted on, judged from
    the state the live detector had (the steps before it, fed one at a time)."""
    cfg = SpikesSection()
    bumped, clean = _curve(302, bump_at=300), _curve(600, seed=1)
    clean[:250] = bumped[:250]
    steps = np.concatenate([np.arange(1, 303), np.arange(251, 601)])
    losses = np.concatenate([bumped, clean[250:]])
    epochs = np.concatenate([np.zeros(302, int), np.ones(350, int)])
    live = SpikeDetector.for_section(cfg)
    live.start_grace(3)
    verdicts = [(s, live.update(s, v)) for s, v in zip(range(1, 303), bumped.tolist())]
    spikes = [(d.onset, s) for s, d in verdicts if d.kind == "spike"]
    assert spikes == [(300, 302)]
    eps = lived_episodes(steps.astype(float), losses, epochs, (), cfg, start=3)
    assert [(e["onset"], e["detected"], e["epoch"]) for e in eps] == [(300, 302, 0)]
    final = timeline(steps)
    assert spike_episodes((steps[final].astype(float), losses[final]), (), cfg, start=3) == []


def test_after_a_spike_the_live_detector_waits_for_the_loss_to_come_back_as_the_replay_does():
    loss = _curve(400, seed=2)
    loss[199:260] += 0.5  # a long excursion: one spike, not one every `persistence` steps
    det = SpikeDetector()
    det.start_grace(3)
    kinds = [det.update(s, v) for s, v in zip(range(1, 401), loss.tolist())]
    assert sum(d.kind == "spike" for d in kinds) == 1
    assert [d.reason for d in kinds].index("recovered") == 260  # step 261: back under the pre-spike bound
    (ep,) = spike_episodes(list(zip(range(1, 401), loss.tolist())), (), None, start=3)
    assert (ep["onset"], ep["recovered"]) == (200, 261)
    state = det.state_dict()
    det.update(401, float("nan"))
    assert det.episode == float("inf")
    again = SpikeDetector()
    again.load_state_dict({**det.state_dict()})
    assert again.episode == float("inf") and state["episode"] is None


def test_the_replay_reads_the_recorded_float32_losses_exactly_as_their_float64_values():
    loss = _curve(3000, seed=3)
    loss[[500, 1200, 2500]] = np.nan
    for at in (800, 1700, 2200):
        loss[at : at + 4] += np.float32(0.3)
    loss32 = loss.astype(np.float32)
    steps = np.arange(1, 3001)
    pairs = list(zip(steps.tolist(), loss32.astype(float).tolist()))
    fast32 = spike_episodes((steps, loss32), [1500], None, start=3)
    assert len(fast32) >= 3
    assert fast32 == spike_episodes(pairs, [1500], None, start=3)
    assert [(e["onset"], e["detected"], e["recovered"]) for e in fast32] == [
        (e["onset"], e["detected"], e["recovered"])
        for e in spike_episodes(pairs, [1500], None, start=3, batched=False)
    ]
