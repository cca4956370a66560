"""Muon as a recipe optimizer: the split, one optimizer object over both kinds, proof that it orthogonalises (and a
run that stops when it does not), exact resume, DDP equal to one process, and the refusal where it cannot run."""

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType
from conftest import run_micro, step_losses, tiny_llama
from safetensors.torch import load_file

from pretrainer.errors import PretrainerError
from pretrainer.observe.tracking import read_jsonl
from pretrainer.recipe.loading import load_recipe
from pretrainer.recipe.sections import OptimizerSection
from pretrainer.train.build import build
from pretrainer.train.engines.deepspeed_muon import build_deepspeed_muon
from pretrainer.train.measures.probe import OptimizerProbe
from pretrainer.train.optim import MuonAdamW, build_optimizer, split_for_muon

ROOT = Path(__file__).resolve().parents[1]
MUON = ["--set", "optimizer.type=muon"]  # for run_recipe.main


def tiny(tie: bool = True):
    return tiny_llama(tie=tie)


@pytest.mark.parametrize("tie", [True, False])
def test_hidden_matrices_on_muon_embeddings_head_norms_on_adamw(tie):
    model = tiny(tie)
    a = split_for_muon(model)
    assert a.muon and all(".layers." in n and "norm" not in n for n in a.muon)
    assert "model.embed_tokens.weight" in a.adamw and all(
        "norm" in n or "embed" in n or "lm_head" in n for n in a.adamw
    )
    assert ("lm_head.weight" in a.adamw) is (not tie)  # a tied head is the embedding, already on AdamW
    params = dict(model.named_parameters())
    assert all(params[n].ndim == 2 for n in a.muon)


def test_one_optimizer_over_both_kinds_steps_and_round_trips(tmp_path):
    model = tiny()
    opt, _, assign = build_optimizer(model, OptimizerSection(type="muon", lr=1e-2))
    assert isinstance(opt, MuonAdamW) and {g["use_muon"] for g in opt.param_groups} == {True, False}
    x = torch.randint(0, 64, (2, 16))
    for _ in range(2):
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    muon_p = dict(model.named_parameters())[assign.muon[0]]
    assert "momentum_buffer" in opt.state[muon_p]  # Muon's state, in the composite's state
    assert "exp_avg" in opt.state[model.model.embed_tokens.weight]  # AdamW's
    torch.save(opt.state_dict(), tmp_path / "o.pt")
    model2 = tiny()
    model2.load_state_dict(model.state_dict())
    opt2, _, _ = build_optimizer(model2, OptimizerSection(type="muon", lr=1e-2))
    opt2.load_state_dict(torch.load(tmp_path / "o.pt", weights_only=True))
    for m, o in ((model, opt), (model2, opt2)):  # the same next step from the restored state
        m(input_ids=x, labels=x).loss.backward()
        o.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), model2.parameters()))


def test_probe_tells_muon_from_adamw():
    x = torch.randint(0, 64, (4, 16))
    errs = {}
    for kind in ("muon", "adamw"):
        model = tiny()
        opt, _, _ = build_optimizer(model, OptimizerSection(type=kind, lr=1e-2))
        for g in opt.param_groups:  # judge AdamW's update of a hidden matrix as if it were Muon's
            g.setdefault("use_muon", kind == "adamw" and g["weight_decay"] > 0)
        probe = OptimizerProbe(opt, 1, expect_muon=False)
        for _ in range(3):
            model(input_ids=x, labels=x).loss.backward()
            probe.before()
            opt.step()
            probe.after(1)
            opt.zero_grad()
        errs[kind] = probe.take()["optim/muon/ortho_err"]
    assert errs["muon"] < 0.35 < 0.5 < errs["adamw"], errs


def test_refused_under_fsdp_and_zero0_with_one_line():
    recipe = load_recipe("tests/fixtures/micro.yaml", ["optimizer.type=muon"])
    tok = type("Tok", (), {"eos_token_id": 0, "pad_token_id": 0, "__len__": lambda self: 512})()

    def launch(kind, stage=None):
        plugin = SimpleNamespace(zero_stage=stage)
        return SimpleNamespace(distributed_type=kind, state=SimpleNamespace(deepspeed_plugin=plugin))

    with pytest.raises(PretrainerError, match="refused under FSDP: .* launch with DeepSpeed ZeRO"):
        build(recipe, launch(DistributedType.FSDP), tok, recipe.plan, 1)
    with pytest.raises(PretrainerError, match="under DeepSpeed ZeRO-0 is refused: .* plain SGD"):
        build(recipe, launch(DistributedType.DEEPSPEED, 0), tok, recipe.plan, 1)


def test_deepspeed_muon_groups_follow_torchs_lr_rule():
    """DeepSpeed scales a matrix's update by sqrt(max(1, A/B)); each group's LR factor makes it torch's rule, and its
    weight decay keeps torch's `1 - lr * wd` (the unadjusted LR)."""
    from torch.optim._muon import _adjust_lr

    model = tiny(tie=False)
    section = OptimizerSection(type="muon", lr=1e-3)
    opt, _, assign = build_deepspeed_muon(model, section, 1)
    groups = [g for g in opt.param_groups if g["use_muon"]]
    assert sum(len(g["params"]) for g in groups) == len(assign.muon) and all(
        p.use_muon for g in groups for p in g["params"]
    )
    for g in groups:
        for p in g["params"]:
            a, b = p.shape
            builtin = math.sqrt(max(1, a / b))
            assert g["lr"] * builtin == pytest.approx(_adjust_lr(1e-3, "match_rms_adamw", p.shape))
            assert g["lr"] * g["weight_decay"] == pytest.approx(1e-3 * section.muon.weight_decay)
            assert g["ns_method"] == "standard" and g["momentum"] == section.muon.momentum
    rest = [p for g in opt.param_groups if not g["use_muon"] for p in g["params"]]
    assert len(rest) == len(assign.adamw) and not any(p.use_muon for p in rest)
    with pytest.raises(PretrainerError, match="nesterov: False, ns_steps: 5 are not available"):
        build_deepspeed_muon(model, OptimizerSection(type="muon", lr=1e-3, muon={"nesterov": False}), 2)


SETS = ["checkpoint.every_tokens=8192", "eval.every_steps=0", "optimizer.type=muon"]


def run(out: Path, cache_dir, *args, env=None, processes=1):
    return run_micro(out, cache_dir, *SETS, args=args, env=env, processes=processes)


@pytest.fixture(scope="module")
def muon_ref(tmp_path_factory, cache_dir):
    out = tmp_path_factory.mktemp("muon") / "ref"
    proc = run(out, cache_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_muon_run_logs_its_proof(muon_ref):
    events = read_jsonl(muon_ref / "events.jsonl")
    split = next(e for e in events if e["event"] == "optimizer")
    assert split["type"] == "muon" and split["muon"]["tensors"] == 14 and split["adamw"]["tensors"] == 6
    rows = [m for m in read_jsonl(muon_ref / "metrics.jsonl") if "optim/muon/ortho_err" in m]
    assert len(rows) == 6 and all(r["optim/muon/ortho_err"] < 0.5 for r in rows)  # every logging step
    assert all(r["optim/muon/update_rms"] > 0 and r["optim/adamw/update_rms"] > 0 for r in rows)


@pytest.mark.slow  # exact resume's representative is tests/test_checkpoint.py; this is Muon's state
def test_muon_resumes_bitwise(muon_ref, tmp_path, cache_dir):
    out = tmp_path / "run"
    assert run(out, cache_dir, env={"PRETRAINER_KILL_AT": "step:13"}).returncode < 0
    proc = run(out, cache_dir, "--resume", "auto")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert step_losses(out) == step_losses(muon_ref)
    a, b = load_file(str(muon_ref / "final/model.safetensors")), load_file(str(out / "final/model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_muon_that_does_not_orthogonalise_stops_the_run(tmp_path, cache_dir, monkeypatch, capsys):
    import run_recipe
    import torch.optim._muon as torch_muon

    monkeypatch.setattr(torch_muon, "_zeropower_via_newtonschulz", lambda grad, *a, **k: grad)  # bypassed
    argv = ["tests/fixtures/micro.yaml", "--output-dir", str(tmp_path / "run"), "--set", f"data.cache_dir={cache_dir}"]
    assert run_recipe.main(argv + MUON) == 2
    err = capsys.readouterr().err
    assert "error: optimizer.type: muon, but the update applied at step 5" in err and "is not Muon" in err
    # mid-run, with the progress bar on its line: the error still starts a line of its own (log readers grep ^error:)
    assert any(line.startswith("error: optimizer.type: muon") for line in err.split("\n"))


@pytest.mark.slow  # the DDP path's representative is tests/test_distributed.py; this is Muon's variation
def test_ddp_two_processes_equal_one_process(muon_ref, tmp_path, cache_dir):
    out = tmp_path / "ddp"
    proc = run(out, cache_dir, processes=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert next(e for e in read_jsonl(out / "events.jsonl") if e["event"] == "run_start")["world"] == 2
    a, b = step_losses(muon_ref), step_losses(out)
    # Newton-Schulz runs in bf16: two processes sum the gradients in another order, and 30 steps amplify it a little
    assert max(abs(a[k] - b[k]) for k in a) < 2e-3, {k: (a[k], b[k]) for k in list(a)[-3:]}


@pytest.mark.slow  # a variation of the DDP path above
def test_a_one_process_muon_checkpoint_resumes_on_two_processes(muon_ref, tmp_path, cache_dir):
    """Muon's momentum and AdamW's moments are one optimizer state, whole in a one-process checkpoint: a DDP launch
    of two processes continues it and ends where the one-process run ended."""
    from test_distributed import resumed_from

    out = tmp_path / "run"
    resumed_from(muon_ref, out, 16)
    proc = run(out, cache_dir, "--resume", "auto", processes=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = step_losses(muon_ref), step_losses(out)
    assert max(abs(a[k] - b[k]) for k in range(17, 31)) < 2e-3


def ds_muon(out: Path, cache_dir, config: str, *args, processes: int = 2, env=None):
    from test_distributed import launch

    sets = [a for s in SETS for a in ("--set", s)]
    return launch(config, out, cache_dir, *sets, *args, processes=processes, env=env)


def same_run_as_one_process(ref: Path, out: Path) -> None:
    """Losses within the DDP bar of one-process Muon; the logged norm is the gradient's (DeepSpeed's own order logs
    the orthogonalised update's, ~28 on this model against ~1); every logging step proves the orthogonalisation."""
    a, b = step_losses(ref), step_losses(out)
    assert a.keys() == b.keys() and max(abs(a[k] - b[k]) for k in a) < 2e-3, {k: (a[k], b[k]) for k in list(a)[-3:]}
    norms = [
        {m["step"]: m["grad_norm"] for m in read_jsonl(d / "metrics.jsonl") if "grad_norm" in m} for d in (ref, out)
    ]
    assert norms[0].keys() == norms[1].keys() and len(norms[0]) >= 6
    assert all(abs(norms[1][k] / norms[0][k] - 1) < 1e-2 for k in norms[0]), norms
    rows = [m for m in read_jsonl(out / "metrics.jsonl") if "optim/muon/ortho_err" in m]
    assert len(rows) == 6 and all(r["optim/muon/ortho_err"] < 0.5 for r in rows)


@pytest.mark.slow  # Muon under DeepSpeed's engine; the default set runs Muon itself and DeepSpeed with AdamW
@pytest.mark.distributed
def test_deepspeed_muon_on_one_process_equals_plain_muon(muon_ref, tmp_path, cache_dir):
    """DeepSpeed's Muon inside ZeRO-1 (here one rank holds every partition), our split, torch's LR rule, gradient
    clipping before the momentum: the run plain Muon trains. Two processes and ZeRO-2 are the slow variations."""
    out = tmp_path / "z1"
    proc = ds_muon(out, cache_dir, "zero1.yaml", processes=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "checkpoints/step_00000030/zero_to_fp32.py").exists()  # a DeepSpeed checkpoint: it ran under ZeRO
    same_run_as_one_process(muon_ref, out)


@pytest.mark.distributed
@pytest.mark.slow  # a variation of the one-process DeepSpeed Muon run above: partitions split across two ranks
@pytest.mark.parametrize("config", ["zero1.yaml", "zero2.yaml", "zero3.yaml"])
def test_deepspeed_muon_on_two_processes_equals_one_process(muon_ref, tmp_path, cache_dir, config):
    out = tmp_path / "run"
    proc = ds_muon(out, cache_dir, config)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert next(e for e in read_jsonl(out / "events.jsonl") if e["event"] == "run_start")["world"] == 2
    same_run_as_one_process(muon_ref, out)


@pytest.mark.distributed
@pytest.mark.slow  # exact resume's representative is tests/test_checkpoint.py; this is DeepSpeed Muon's state
@pytest.mark.parametrize("config", ["zero1.yaml", "zero2.yaml", "zero3.yaml"])
def test_deepspeed_muon_resumes_exactly(tmp_path, cache_dir, config):
    ref, out = tmp_path / "ref", tmp_path / "run"
    assert ds_muon(ref, cache_dir, config).returncode == 0
    assert ds_muon(out, cache_dir, config, env={"PRETRAINER_KILL_AT": "step:13"}).returncode != 0
    proc = ds_muon(out, cache_dir, config, "--resume", "auto")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert step_losses(out) == step_losses(ref)  # the momentum buffers and AdamW's moments came back exactly


@pytest.mark.distributed
@pytest.mark.slow  # skip-step under DeepSpeed's representative is tests/test_stability.py; this is Muon's norm
@pytest.mark.parametrize("config", ["zero1.yaml", "zero3.yaml"])
def test_deepspeed_muon_gradient_fault_is_skipped_on_the_gradients_norm(tmp_path, cache_dir, config):
    """A x1000 gradient at step 72: the gate judges the gradients' norm (DeepSpeed's own would be the update's,
    which a x1000 gradient barely moves), so the step is skipped and no weight moves, Muon matrices included."""
    from test_distributed import launch
    from test_stability import FAULT

    from pretrainer.checkpoint import list_checkpoints
    from pretrainer.checkpoint.export import export_checkpoint

    out = tmp_path / "run"
    sets = ["optimizer.type=muon", "stages.0.steps=72", "eval.every_steps=0", f"checkpoint.every_tokens={71 * 1024}"]
    proc = launch(config, out, cache_dir, *(a for s in [*sets, FAULT] for a in ("--set", s)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    skipped = [e for e in read_jsonl(out / "events.jsonl") if e["event"] == "skipped_update"]
    assert [(e["step"], e["reason"]) for e in skipped] == [(72, "grad_norm")]
    before = next(c.path for c in list_checkpoints(out / "checkpoints") if c.meta["step"] == 71)
    export_checkpoint(before, tmp_path / "hf")
    a, b = load_file(str(tmp_path / "hf/model.safetensors")), load_file(str(out / "final/model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)  # the skipped step moved no weight
