"""The trainer's parts built alone, without a Trainer: the checkpoint manager on a tiny model, the spike handler
through fake ports, the run plan, the live health monitor."""

import json
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from accelerate import Accelerator
from transformers import LlamaConfig, LlamaForCausalLM

from pretrainer import checkpoint as ck
from pretrainer.analysis.report import report
from pretrainer.analysis.verdicts import HealthMonitor
from pretrainer.checkpoint import CheckpointManager
from pretrainer.checkpoint import format as ckformat
from pretrainer.recipe.loading import load_recipe
from pretrainer.recipe.sections import CheckpointSection, SpikesSection
from pretrainer.stability.decisions import Abort, Observed, Ok, Part, Rollback, StepReport
from pretrainer.stability.recovery import LEDGER, SpikeHandler, write_ledger
from pretrainer.train.resume import choose_checkpoint, recipe_changes, record_changes
from pretrainer.train.saving import SaveClock
from pretrainer.train.state import Parts, RunState


class Log:
    def __init__(self):
        self.events: list[tuple[str, int, dict]] = []

    def event(self, kind, step, **details):
        self.events.append((kind, step, details))

    def kinds(self):
        return [k for k, _, _ in self.events]


class Counter(Part):
    """A minimal part: state only."""

    def __init__(self):
        self.n = 0

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.n = state["n"]


def tiny_model():
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    return LlamaForCausalLM(cfg)


@pytest.fixture
def manager(tmp_path):
    acc = Accelerator(cpu=True)
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    state, counter, log = RunState(), Counter(), Log()
    parts = Parts()
    parts.register("counter", counter)
    section = CheckpointSection(keep_last=2, every_tokens=100, every_minutes=None)
    mgr = CheckpointManager(
        acc,
        section,
        tmp_path / "checkpoints",
        model=model,
        optimizer=opt,
        log=log,
        extra_files={"tokenizer": lambda d: (d.mkdir(), (d / "t.json").write_text("{}"))},
    )
    return mgr, model, state, parts, counter, log, SaveClock(section, acc)


def meta_of(state: RunState, parts: Parts, recipe=None) -> dict:
    """What the loop saves: the run state at the top level, each part under its name, the recipe."""
    recipe = recipe or {"optimizer": {"lr": 0.001}}
    return {
        **state.state_dict(),
        **parts.state_dict(),
        "stage": "main",
        "reason": "tokens",
        "recipe": recipe,
        "recipe_hash": "abc",
    }


def test_manager_saves_parts_prunes_and_restores_alone(manager):
    mgr, model, state, parts, counter, log, clock = manager
    weights = {}
    for s in (1, 2, 3):
        state.step, state.tokens, counter.n = s, s * 100, s * 10
        state.add_skip(0, s, s)
        with torch.no_grad():
            next(model.parameters()).add_(1.0)
        weights[s] = next(model.parameters()).detach().clone()
        assert clock.due((s - 1) * 100, s * 100, stage_end=False, log_step=False) == "tokens"
        mgr.save(meta_of(state, parts))
    names = [c.path.name for c in ck.list_checkpoints(mgr.root)]
    assert names == ["step_00000002", "step_00000003"]  # keep_last 2
    assert log.kinds().count("checkpoint") == 3 and log.kinds().count("prune") == 1
    meta = json.loads((mgr.root / "step_00000003" / ck.META).read_text())
    assert meta["step"] == 3 and meta["counter"] == {"n": 30} and meta["skips"] == [[0, 1, 1], [0, 2, 2], [0, 3, 3]]
    assert meta["recipe_hash"] == "abc" and (mgr.root / "step_00000003" / "tokenizer" / "t.json").exists()
    assert ck.verify(mgr.root / "step_00000003") == []

    restored = mgr.load(mgr.root / "step_00000002")  # the store loads weights; the loop hands meta to the parts
    state.load_state_dict(restored.meta)
    calls = []

    class Filed(Counter):  # a part with files of its own in the checkpoint (the averaged weights)
        def load_files(self, directory):
            calls.append(("files", directory))

        def load_state_dict(self, state):
            calls.append(("state", state))

    parts.register("filed", Filed())
    parts.load_state_dict({**restored.meta, "filed": {"n": 1}}, restored.path)
    assert calls == [("files", restored.path / "filed"), ("state", {"n": 1})]  # files first, in one place
    assert restored.step == 2 and state.step == 2 and state.tokens == 200 and counter.n == 20
    assert state.skips == [[0, 1, 1], [0, 2, 2]]
    assert torch.equal(next(model.parameters()), weights[2])
    # a rollback rewinds the position but keeps every skip known now (the ledger is history)
    state.add_skip(0, 9, 9)
    state.rewind(mgr.load(mgr.root / "step_00000002").meta)
    parts.load_state_dict({}, restored.path, rollback=True)  # no meta: the part's files are still read (reset)
    assert calls[-1] == ("files", restored.path / "filed")
    assert state.step == 2 and state.skips == [[0, 1, 1], [0, 2, 2], [0, 9, 9]]


def test_manager_protection_rollback_target_and_resume_choice(manager, tmp_path):
    mgr, model, state, parts, counter, log, clock = manager
    for s in (1, 2, 3, 4):
        state.step, state.tokens = s, s * 100
        # an open spike episode's target (step 1) survives pruning while the loop names it protected
        mgr.save(meta_of(state, parts), protected=ck.Protected(frozenset({"step_00000001"})))
    assert [c.meta["step"] for c in ck.list_checkpoints(mgr.root)] == [1, 3, 4]
    assert mgr.newest_good(max_step=2) == mgr.root / "step_00000001"
    assert mgr.newest_good(max_step=0) is None
    state.step, state.tokens = 5, 500
    mgr.save(meta_of(state, parts))  # the episode closed: nothing protected
    assert [c.meta["step"] for c in ck.list_checkpoints(mgr.root)] == [4, 5]
    # a corrupted newest checkpoint is skipped by --resume auto, with the reason logged
    f = mgr.root / "step_00000005" / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-10])
    path = choose_checkpoint(mgr, "auto", ledger=None)
    assert mgr.load(path).step == 4 and "resume_skip" in log.kinds()
    # a recipe that changed what is trained is refused unless allowed
    meta = ck.read_meta(path)
    with pytest.raises(Exception, match=r"optimizer.lr: 0.001 -> 0.002"):
        recipe_changes(path, meta, {"optimizer": {"lr": 0.002}}, False)
    diffs = recipe_changes(path, meta, {"optimizer": {"lr": 0.002}}, True)
    record_changes(meta, (diffs, []), log, tmp_path, True)
    assert "recipe_change" in log.kinds() and (tmp_path / "recipe.step_00000004.yaml").exists()


@pytest.fixture
def async_manager(manager, monkeypatch):
    """The manager with background saves, and a gate its writer waits on before it prunes: a save handed over
    while the gate is shut stays in flight (written and renamed, not yet pruned) until the gate opens."""
    mgr, model, state, parts, counter, log, clock = manager
    mgr.async_ok = True
    gate, order, prune = threading.Event(), [], mgr.prune
    gate.set()

    def held_prune(step, protected=ck.NOTHING):
        gate.wait(timeout=30)
        prune(step, protected)
        order.append("prune")

    monkeypatch.setattr(mgr, "prune", held_prune)
    return mgr, state, parts, gate, order


def third_in_flight(mgr, state, parts, gate) -> None:
    """Checkpoints 1 and 2 written and pruned; the save of 3 handed over with the gate shut (held before its prune)."""
    for s in (1, 2):
        state.step, state.tokens = s, s * 100
        mgr.save(meta_of(state, parts))
    mgr.finish()
    gate.clear()
    state.step, state.tokens = 3, 300
    mgr.save(meta_of(state, parts))


def test_background_save_never_prunes_a_target_chosen_while_it_runs(async_manager):
    """keep_last 2; checkpoints 1 and 2; the save of 3 is in flight when a spike (onset 3) chooses its target.
    Before the fix the episode chose step 1, which the in-flight commit then pruned (it held the protection of the
    moment it was handed over): the rollback target was gone. Choosing a target joins the write first, so the
    choice sees what a synchronous save would have left, and a chosen target is never pruned later."""
    mgr, state, parts, gate, order = async_manager
    third_in_flight(mgr, state, parts, gate)  # no episode, no suspicion when it was handed over
    threading.Timer(0.5, gate.set).start()
    target = mgr.newest_good(max_step=1)  # the episode's choice, made while the write runs
    protect = ck.Protected(frozenset({target.name})) if target else ck.NOTHING
    if target is not None:
        mgr.load(target)
    state.step, state.tokens = 4, 400
    mgr.save(meta_of(state, parts), protected=protect)
    mgr.finish()
    assert order[0] == "prune"
    assert target is None or target.exists(), f"the rollback target {target.name} was pruned under its episode"
    # the synchronous answer: step 1 went when 3 was saved, so no checkpoint predates this onset
    assert target is None and [c.meta["step"] for c in ck.list_checkpoints(mgr.root)] == [3, 4]


def test_a_load_never_overlaps_a_background_write(async_manager, monkeypatch):
    mgr, state, parts, gate, order = async_manager
    third_in_flight(mgr, state, parts, gate)
    order.clear()
    read_meta = ckformat.read_meta

    def noted(path):
        order.append("load")
        return read_meta(path)

    monkeypatch.setattr(ckformat, "read_meta", noted)
    threading.Timer(0.5, gate.set).start()
    mgr.load(mgr.root / "step_00000002")  # a rollback while the write of 3 is still in flight
    assert order == ["prune", "load"], order


def test_spike_handler_decides_rollbacks_and_skips_the_blamed_samples(tmp_path):
    """The handler only decides: it returns Rollback (target, skips) and never touches checkpoints or the state."""
    log, found = Log(), []
    poisoned = set(range(1204, 1208))

    def find_target(max_step):
        found.append(max_step)
        return Path("/ckpts/step_00000010") if max_step >= 10 else None

    def sample_losses(at):  # the loop's measurement: 8 samples per step; the poisoned ones stand out
        idx = list(range(at.cursor, at.cursor + 8))
        return idx, [9.0 if i in poisoned else 3.0 + 0.01 * (i % 3) for i in idx]

    h = SpikeHandler(SpikesSection(), find_target, log, lambda *a: None)
    h.start_grace(0)
    rng = np.random.default_rng(0)

    def run(first, last, spiky):
        for s in range(first, last + 1):
            h.record(s, 0, (s - 1) * 8)
            loss = 3.0 + 0.01 * rng.standard_normal() + (3.0 if s in spiky else 0.0)
            d = h.judge(s, loss, 1.0)
            if not isinstance(d, Ok):
                return s, d
        return None, None

    # a 3-step spike from step 151 on: while it is only suspect, the candidate target is kept from pruning; once
    # confirmed, roll back to the only checkpoint before it, which is then protected by name
    assert run(1, 151, spiky={151}) == (None, None) and h.protected() == ck.Protected(before=149)
    step, d = run(152, 200, spiky={152, 153})
    assert step == 153 and isinstance(d, Rollback) and (d.target, d.step) == (Path("/ckpts/step_00000010"), 153)
    assert (d.blame.first, d.blame.last) == (151, 153)
    # what to measure: the spike's 3 steps and the 8 before it, each with what rebuilds its batches
    assert [at.step for at in d.blame.steps] == list(range(143, 154)) and d.blame.steps[-1] == (153, 0, 152 * 8)
    assert h.protected().names == {"step_00000010"}
    assert log.kinds().count("spike") == 1
    # the loop restores the target and rewinds the parts (the detector's trend comes back, the episode stays
    # open), then measures the samples of steps 151-153 and the 8 steps before under the restored weights and
    # asks which to skip: step 151's batch starts at sample 1200; 1204..1207 were poisoned
    healthy = {
        "history": [[s, 3.0 + 0.01 * rng.standard_normal()] for s in range(51, 151)],
        "grace_until": 0,
        "run": [],
    }
    h.rewind({"detector": healthy, "pending": None, "rollbacks": []})
    assert h.pending is not None and h.rollback_steps == [153]
    assert h.blame(d.blame, {at.step: sample_losses(at) for at in d.blame.steps}) == [(0, 1204, 1207)]
    assert h.pending.blamed is True and h.pending.end == 153
    skip = [e for k, _, e in log.events if k == "skip"][0]
    assert skip["blame"] == "samples" and skip["evidence"]["outliers"] == 4
    assert skip["evidence"]["reference_samples"] == 8 * 8  # the 8 steps before the onset, 8 samples each
    write_ledger(tmp_path, [[0, 1204, 1207]], h.state_dict())
    ledger = json.loads((tmp_path / LEDGER).read_text())
    assert ledger["skips"] == [[0, 1204, 1207]] and ledger["pending"]["onset"] == 151
    # a healthy replay past confirm_steps closes the episode and releases the target
    assert run(151, 170, spiky=set()) == (None, None)
    assert "transient" in log.kinds() and h.protected() == ck.NOTHING


def test_a_spike_on_clean_data_that_recurs_is_accepted_not_skipped():
    """A noise excursion on healthy data replays to the last digit. Its samples measure clean under the restored
    weights, nothing is skipped; when it comes back, a `recurred` event closes the episode and the run goes on,
    and a later rollback to before it does not act on it again."""
    log, rng = Log(), np.random.default_rng(1)

    def sample_losses(at):
        idx = list(range(at.cursor, at.cursor + 8))
        return idx, [3.0 + 0.05 * rng.standard_normal() for _ in idx]

    h = SpikeHandler(SpikesSection(), lambda m: Path("/ckpts/step_00000010"), log, lambda *a: None)
    h.start_grace(0)
    curve = {s: 3.0 + 0.01 * np.sin(s) + (0.2 if s in (151, 152, 153) else 0.0) for s in range(1, 200)}

    def run(first, last):
        for s in range(first, last + 1):
            h.record(s, 0, (s - 1) * 8)
            d = h.judge(s, curve[s], 1.0)
            if not isinstance(d, Ok):
                return s, d
        return None, None

    state = h.detector.state_dict()
    step, d = run(1, 153)
    assert isinstance(d, Rollback) and (d.blame.first, d.blame.last) == (151, 153)
    h.rewind({"detector": state})
    assert h.blame(d.blame, {at.step: sample_losses(at) for at in d.blame.steps}) == [] and "skip" not in log.kinds()
    h.detector.load_state_dict(state)
    assert run(1, 199) == (None, None)  # the replay: the same spike, accepted
    assert log.kinds().count("recurred") == 1 and h.pending is None and h.recurred == [151]
    h.detector.load_state_dict(state)
    assert run(1, 199) == (None, None) and log.kinds().count("spike") == 2  # not judged a third time


def test_spike_handler_aborts_past_the_rollback_limit_and_without_a_target():
    h = SpikeHandler(SpikesSection(max_rollbacks=1), lambda m: Path("/c/step_00000001"), Log(), print)
    h.rollback_steps = [100]
    d = h._rollback(Path("/c/step_00000001"), 150, 149)
    assert isinstance(d, Abort) and d.exit_code == 76 and "1 rollbacks within 1000 steps" in d.message
    h = SpikeHandler(SpikesSection(), lambda m: None, Log(), lambda *a: None)
    h.detector.start_grace(0)
    d = h.judge(30, float("nan"), 1.0)
    assert isinstance(d, Abort) and "no checkpoint from before step 29" in d.message


def test_parts_registry_refuses_a_second_part_of_one_name():
    parts = Parts()
    parts.register("c", Counter())
    with pytest.raises(ValueError, match="already registered"):
        parts.register("c", Counter())
    with pytest.raises(TypeError, match="register_state"):
        parts.register("plain", object())


def test_parts_hear_each_moment_in_order_and_the_first_decision_wins():
    """One protocol: every part hears stage starts, batch changes and each step, in registration order; a state-only
    object (the LR schedule) is carried by checkpoints and hears nothing; the first part's decision other than
    carrying on is the loop's."""
    heard = []

    class Ear(Part):
        def __init__(self, name, decision=None):
            self.name, self.decision = name, decision

        def stage_start(self, step, tokens):
            heard.append((self.name, "stage", step, tokens))

        def batch_change(self, step):
            heard.append((self.name, "batch", step))

        def after_step(self, report):
            heard.append((self.name, "step", report.step))
            return self.decision

    first, second = Rollback(Path("/c/step_1"), 5), Abort("stop", 76)
    parts, lr = Parts(), Counter()
    parts.register_all({"a": Ear("a"), "b": Ear("b", first), "off": None, "c": Ear("c", second)})
    parts.register_state({"lr": lr})
    parts.stage_start(3, 300)
    parts.batch_change(4)
    report = StepReport(5, 0, 40, 500, 100, Observed(3.0, 1.0), True, None)
    assert parts.after_step(report) is first  # and `c` still heard the step
    assert heard == [
        ("a", "stage", 3, 300),
        ("b", "stage", 3, 300),
        ("c", "stage", 3, 300),
        ("a", "batch", 4),
        ("b", "batch", 4),
        ("c", "batch", 4),
        ("a", "step", 5),
        ("b", "step", 5),
        ("c", "step", 5),
    ]
    lr.n = 7
    assert parts.state_dict()["lr"] == {"n": 7} and "off" not in parts


def test_run_plan_is_derived_once_and_read_everywhere():
    r = load_recipe("recipes/tiny.yaml")
    plan = r.plan
    assert plan is r.plan and plan.total_steps == sum(s.steps for s in plan.spans)
    anneal = next(s for s in plan.spans if s.name == r.schedule.decay_stage)
    assert (plan.decay_start, plan.decay_steps) == (anneal.start_step, anneal.steps)
    assert plan.max_grad_norm == r.clipping.max_grad_norm
    assert load_recipe("recipes/tiny.yaml", ["clipping.max_grad_norm=0"]).plan.max_grad_norm is None
    assert load_recipe("recipes/tiny.yaml", ["clipping.max_grad_norm=null"]).plan.max_grad_norm is None


def test_health_monitor_incremental_equals_the_report(tmp_path):
    """The live monitor, fed record by record, gives the verdict check_run.py gives from the files."""
    rng = np.random.default_rng(0)
    metrics, events = [], []
    for k in range(1, 41):
        losses = [
            [s, float(8 * np.exp(-s / 150) + 2 + 0.02 * rng.standard_normal())] for s in range(k * 5 - 4, k * 5 + 1)
        ]
        metrics.append({"step": k * 5, "loss": losses[-1][1], "step_losses": losses})
        if k % 8 == 0:
            metrics.append({"step": k * 5, "val/avg": losses[-1][1] + 0.1})
    events.append({"event": "spike", "step": 77})
    events.append({"event": "rollback", "step": 77})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    live = HealthMonitor()
    for m in metrics:
        live.on_metrics(m["step"], m)
    for e in events:
        live.on_event(e["event"], e["step"], {})
    expected = report(tmp_path, verify_checkpoint=False)
    assert live.verdict() == (expected["verdict"], expected["reasons"])
    assert HealthMonitor(tmp_path).verdict() == live.verdict()  # seeded from the files on resume
