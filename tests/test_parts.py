"""The trainer's parts built alone, without a Trainer: the checkpoint manager on a tiny model, the spike handler
through fake ports, the run plan, the live health monitor."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from accelerate import Accelerator
from transformers import LlamaConfig, LlamaForCausalLM

from pretrainer import checkpoint as ck
from pretrainer.checkpoint import CheckpointManager
from pretrainer.health import HealthMonitor, report
from pretrainer.recipe import load_recipe
from pretrainer.recovery import LEDGER, SpikeHandler
from pretrainer.sections import CheckpointSection, SpikesSection
from pretrainer.state import RunState


class Log:
    def __init__(self):
        self.events: list[tuple[str, int, dict]] = []

    def event(self, kind, step, **details):
        self.events.append((kind, step, details))

    def kinds(self):
        return [k for k, _, _ in self.events]


class Counter:
    """A minimal Stateful part."""

    def __init__(self):
        self.n = 0

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.n = state["n"]


def tiny_model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)  # fmt: skip
    return LlamaForCausalLM(cfg)


@pytest.fixture
def manager(tmp_path):
    acc = Accelerator(cpu=True)
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    state, counter, log = RunState(), Counter(), Log()
    section = CheckpointSection(keep_last=2, every_tokens=100, every_minutes=None)
    mgr = CheckpointManager(acc, section, tmp_path / "checkpoints", model=model, optimizer=opt, state=state,
                            parts={"counter": counter}, recipe={"optimizer": {"lr": 0.001}}, recipe_hash="abc",
                            stage_names=["main"], log=log,
                            extra_files={"tokenizer": lambda d: (d.mkdir(), (d / "t.json").write_text("{}"))})  # fmt: skip
    return mgr, model, state, counter, log


def test_manager_saves_parts_prunes_and_restores_alone(manager):
    mgr, model, state, counter, log = manager
    weights = {}
    for s in (1, 2, 3):
        state.step, state.tokens, counter.n = s, s * 100, s * 10
        state.add_skip(0, s, s)
        with torch.no_grad():
            next(model.parameters()).add_(1.0)
        weights[s] = next(model.parameters()).detach().clone()
        assert mgr.due((s - 1) * 100, s * 100, stage_end=False, log_step=False) == "tokens"
        mgr.save("tokens")
    names = [c.path.name for c in ck.list_checkpoints(mgr.root)]
    assert names == ["step_00000002", "step_00000003"]  # keep_last 2
    assert log.kinds().count("checkpoint") == 3 and log.kinds().count("prune") == 1
    meta = json.loads((mgr.root / "step_00000003" / ck.META).read_text())
    assert meta["step"] == 3 and meta["counter"] == {"n": 30} and meta["skips"] == [[0, 1, 1], [0, 2, 2], [0, 3, 3]]
    assert meta["recipe_hash"] == "abc" and (mgr.root / "step_00000003" / "tokenizer" / "t.json").exists()
    assert ck.verify(mgr.root / "step_00000003") == []

    restored = mgr.restore(mgr.root / "step_00000002")
    assert restored.step == 2 and state.step == 2 and state.tokens == 200 and counter.n == 20
    assert state.skips == [[0, 1, 1], [0, 2, 2]]
    assert torch.equal(next(model.parameters()), weights[2])


def test_manager_protection_rollback_target_and_resume_choice(manager):
    mgr, model, state, counter, log = manager
    for s in (1, 2, 3, 4):
        state.step, state.tokens = s, s * 100
        if s == 1:
            mgr.save("tokens")
            mgr.protect("step_00000001")  # an open spike episode's target survives pruning
        else:
            mgr.save("tokens")
    assert [c.meta["step"] for c in ck.list_checkpoints(mgr.root)] == [1, 3, 4]
    assert mgr.rollback_target(max_step=2) == mgr.root / "step_00000001"
    assert mgr.rollback_target(max_step=0) is None
    mgr.release("step_00000001")
    state.step, state.tokens = 5, 500
    mgr.save("tokens")
    assert [c.meta["step"] for c in ck.list_checkpoints(mgr.root)] == [4, 5]
    # a corrupted newest checkpoint is skipped by --resume auto, with the reason logged
    f = mgr.root / "step_00000005" / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-10])
    restored = mgr.resume("auto", allow_recipe_change=False)
    assert restored.step == 4 and "resume_skip" in log.kinds()
    # a recipe that changed what is trained is refused unless allowed
    mgr.recipe = {"optimizer": {"lr": 0.002}}
    with pytest.raises(Exception, match=r"optimizer.lr: 0.001 -> 0.002"):
        mgr.resume("auto", allow_recipe_change=False)


class FakeCheckpoints:
    """The Checkpoints port: one good checkpoint at step 10 whose restore puts the run state back there."""

    def __init__(self, state: RunState):
        self.state, self.protected, self.restores = state, set(), []

    def rollback_target(self, max_step):
        return Path("/ckpts/step_00000010") if max_step >= 10 else None

    def verify(self, path):
        return []

    def restore(self, path):
        self.restores.append(path)
        self.state.step, self.state.skips = 10, []
        return path

    def protect(self, name):
        self.protected.add(name)

    def release(self, name):
        self.protected.discard(name)


def test_spike_handler_rolls_back_then_skips_the_blamed_samples(tmp_path):
    state, log = RunState(), Log()
    port = FakeCheckpoints(state)
    poisoned = set(range(1204, 1208))

    def sample_losses(stage, cursor, skips):  # 8 samples per step; the poisoned ones stand out
        idx = list(range(cursor, cursor + 8))
        return idx, [9.0 if i in poisoned else 3.0 + 0.01 * (i % 3) for i in idx]

    h = SpikeHandler(SpikesSection(), state, port, sample_losses, log, lambda *a: None, tmp_path)
    h.start_grace(0)
    rng = np.random.default_rng(0)

    def run(first, last, spiky):
        for s in range(first, last + 1):
            h.record(s, 0, (s - 1) * 8)
            loss = 3.0 + 0.01 * rng.standard_normal() + (3.0 if s in spiky else 0.0)
            if h.after_step(s, loss, 1.0) is not None:
                return s
        return None

    # a 3-step spike from step 151 on: rolled back to the only checkpoint before it, which is then protected
    assert run(1, 200, spiky={151, 152, 153}) == 153
    assert port.restores == [Path("/ckpts/step_00000010")] and port.protected == {"step_00000010"}
    assert log.kinds().count("spike") == 1 and log.kinds().count("rollback") == 1
    # the replay spikes again on the same steps: the blamed samples go to the ledger, and back again
    healthy = {"history": [[s, 3.0 + 0.01 * rng.standard_normal()] for s in range(51, 151)], "grace_until": 0,
               "run": []}  # fmt: skip
    h.detector.load_state_dict(healthy)  # what the manager's restore gives the detector back
    assert run(151, 160, spiky={151, 152, 153}) == 153
    assert state.skips == [[0, 1204, 1207]]  # step 151's batch starts at sample 1200; 1204..1207 were poisoned
    ledger = json.loads((tmp_path / LEDGER).read_text())
    assert ledger["skips"] == [[0, 1204, 1207]] and ledger["pending"]["onset"] == 151
    # a healthy replay past confirm_steps closes the episode and releases the target
    h.detector.load_state_dict(healthy)
    assert run(151, 170, spiky=set()) is None
    assert "transient" in log.kinds() and port.protected == set()


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
