"""End to end: one launch runs main -> long context -> anneal, handing off between stages without a restart."""

import json

import run_recipe
from conftest import FIXTURES

from pretrainer.observe.tracking import read_jsonl


def test_three_stage_run(tmp_path, cache_dir):
    out = tmp_path / "run"
    rc = run_recipe.main(
        [str(FIXTURES / "micro3.yaml"), "--output-dir", str(out), "--set", f"data.cache_dir={cache_dir}"]
    )
    assert rc == 0
    starts = [e for e in read_jsonl(out / "events.jsonl") if e["event"] == "stage_start"]
    assert [(e["stage"], e["step"], e["seq_len"]) for e in starts] == [
        ("main", 0, 64),
        ("long", 16, 256),
        ("anneal", 22, 64),
    ]
    assert starts[0]["rope"]["rope_theta"] == 10000.0
    assert starts[1]["rope"]["rope_theta"] == 160000.0 and starts[2]["rope"]["rope_theta"] == 160000.0
    assert starts[1]["long_docs"]["stdlib"] > 0

    metrics = read_jsonl(out / "metrics.jsonl")
    evals = [m for m in metrics if "val/avg" in m]
    assert {"val/stdlib", "val/curated", "val/avg"} <= set(evals[-1])
    assert evals[-1]["val/avg"] < evals[0]["val/avg"]
    stages_logged = [m["stage"] for m in metrics if "loss" in m]
    assert stages_logged[0] == "main" and stages_logged[-1] == "anneal" and "long" in stages_logged
    lrs = [m["lr"] for m in metrics if "loss" in m and m["stage"] == "anneal"]
    assert lrs == sorted(lrs, reverse=True) and lrs[-1] < 0.2 * 1e-2  # the decay runs during the anneal

    cfg = json.loads((out / "final" / "config.json").read_text())
    assert cfg["rope_parameters"]["rope_theta"] == 160000.0  # the RoPE it was trained with
    assert cfg["max_position_embeddings"] >= 256


def test_rollback_into_an_earlier_stage_restores_its_rope(tmp_path, cache_dir):
    import torch

    from pretrainer.recipe.loading import load_recipe
    from pretrainer.train.trainer import Trainer

    recipe = load_recipe(FIXTURES / "micro3.yaml", [f"data.cache_dir={cache_dir}"])
    t = Trainer(recipe, output_dir=tmp_path / "run")
    rotary = t.accelerator.unwrap_model(t.model).model.rotary_emb
    base = rotary.inv_freq.clone()
    assert t.rope.enter(-1, 1)["rope_theta"] == 160000.0  # the long stage raised the base
    assert not torch.equal(rotary.inv_freq, base)
    assert t.rope.enter(1, 0)["rope_theta"] == 10000.0  # rolled back into main: the recipe's own RoPE again
    assert torch.equal(rotary.inv_freq, base)
    assert t.rope.enter(0, 2)["rope_theta"] == 160000.0  # and forward again through long into anneal
