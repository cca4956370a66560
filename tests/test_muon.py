"""Muon as a recipe optimizer: the split, one optimizer object over both kinds, proof that it orthogonalises (and a
run that stops when it does not), exact resume, DDP equal to one process, and the refusal where it cannot run."""

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
from pretrainer.train.optim import MuonAdamW, build_optimizer, split_for_muon
from pretrainer.train.probe import OptimizerProbe

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


def test_refused_under_deepspeed_and_fsdp_with_one_line():
    recipe = load_recipe("tests/fixtures/micro.yaml", ["optimizer.type=muon"])
    tok = type("Tok", (), {"eos_token_id": 0, "pad_token_id": 0, "__len__": lambda self: 512})()
    for kind in (DistributedType.DEEPSPEED, DistributedType.FSDP):
        acc = SimpleNamespace(distributed_type=kind)
        with pytest.raises(PretrainerError, match=f"refused under {kind.value}: .* launch with DDP"):
            build(recipe, acc, tok, recipe.plan, 1)


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
