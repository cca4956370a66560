"""The sharding model (`recipe.sharding`) and the sizes it stands on (`model.shape`): exact parameter counts without
building the model, activations as measured, and the choice between launches. The collectives and resident state
it predicts are checked against real launches in tests/test_syncs.py."""

import subprocess
import sys

import pytest
import torch
from conftest import ROOT
from transformers import LlamaConfig, LlamaForCausalLM

from pretrainer.analysis.summary import vocab_size_for
from pretrainer.model.build import build_config, build_model, compute_of, count_params, non_embedding_params
from pretrainer.model.shape import shape_of
from pretrainer.recipe.loading import load_recipe
from pretrainer.recipe.sharding import activation_bytes, best, footprints, sharding_findings

RECIPES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "recipes").glob("*.yaml")) + ["tests/fixtures/micro.yaml"]
GIB = 2**30


@pytest.mark.parametrize("path", RECIPES)
def test_counts_from_the_config_equal_the_built_models(path):
    recipe = load_recipe(ROOT / path, check_model=False)
    vocab = vocab_size_for(recipe)
    shape = shape_of({**recipe.model.config, **({"vocab_size": vocab} if vocab else {})})
    model = build_model(recipe.model, config := build_config(recipe.model, vocab_size=vocab), meta=True)
    n_non_emb = non_embedding_params(model)
    assert (shape.params, shape.non_embedding) == (count_params(model), n_non_emb)
    assert shape.compute.flops_per_token(4096) == compute_of(config, n_non_emb).flops_per_token(4096)


def test_unknown_types_and_defaulted_fields_are_not_guessed():
    cfg = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
    assert shape_of({**cfg, "vocab_size": 512, "tie_word_embeddings": True, "model_type": "gpt2"}) is None
    assert shape_of({**cfg, "vocab_size": 512}) is None  # tie_word_embeddings left to the type's default


def saved_per_layer_token(h: int, i: int, heads: int, kv: int, tokens: int = 256) -> float:
    """Bytes autograd saves per token and decoder layer under bf16 autocast with SDPA (3 layers less 1, halved),
    less autocast's bf16 copies of the layer's weights (per layer, not per token)."""

    def saved(layers: int) -> int:
        shape = dict(hidden_size=h, intermediate_size=i, num_attention_heads=heads, num_key_value_heads=kv)
        cfg = LlamaConfig(**shape, num_hidden_layers=layers, vocab_size=256, attn_implementation="sdpa")
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg)
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        storages = {}

        def pack(t):
            s = t.untyped_storage()
            if s.data_ptr() not in params:
                storages[s.data_ptr()] = s.nbytes()
            return t

        ids = torch.randint(0, 256, (1, tokens))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
            model(input_ids=ids, labels=ids)
        return sum(storages.values())

    per_layer = (saved(3) - saved(1)) / 2
    head_dim = h // heads
    weight_copies = 2 * (2 * h * h + 2 * h * kv * head_dim + 3 * h * i)
    return (per_layer - weight_copies) / tokens


def test_activations_per_token_and_layer_are_what_autograd_saves():
    """Three widths spanning 4x (and two MLP ratios): the model's 32·h + 8·i bytes within 10%."""
    for h, i, heads, kv in ((256, 688, 4, 2), (512, 2048, 8, 2), (1024, 2752, 16, 4)):
        cfg = {"hidden_size": h, "intermediate_size": i, "num_hidden_layers": 1, "num_attention_heads": heads}
        shape = shape_of({**cfg, "num_key_value_heads": kv, "vocab_size": 256, "tie_word_embeddings": True})
        modelled = activation_bytes(shape, 1, False, fused_loss=True)
        measured = saved_per_layer_token(h, i, heads, kv)
        assert abs(measured / modelled - 1) < 0.10, (h, i, measured, modelled)


def test_the_1b_recipe_on_8_gpus_fits_zero1_and_zero3_shards_more_than_it_needs():
    recipe = load_recipe(ROOT / "recipes/1b_wsd.yaml", check_model=False)
    shape = shape_of(dict(recipe.model.config))
    options = {f.option: f for f in footprints(recipe, shape, 8)}
    # ZeRO-3 gathers the weights at each of the 16 micro batches; ZeRO-1 reduces once and gathers once
    assert options["zero3"].comm > 10 * options["zero1"].comm
    assert options["zero1"].comm < options["ddp"].comm  # bf16 gradients against DDP's fp32 ones
    assert best(list(options.values()), 80 * GIB).option == "zero1"
    ids = {o: [f.id for f in sharding_findings(list(options.values()), o, 8, 80 * GIB)] for o in options}
    assert ids == {"ddp": ["PT020"], "zero1": [], "zero2": ["PT021"], "zero3": ["PT021"], "fsdp2": ["PT021"]}
    # on 128 GPUs (one micro batch each) ZeRO-3 gathers once per step: the bytes no longer tell them apart much,
    # and neither launch is flagged
    many = footprints(recipe, shape, 128)
    for option in ("zero1", "zero3"):
        assert sharding_findings(many, option, 128, 80 * GIB) == []


def test_a_10b_model_needs_its_gradients_or_weights_sharded():
    sets = [
        "model.config.hidden_size=4096",
        "model.config.intermediate_size=11008",
        "model.config.num_hidden_layers=60",
    ]
    recipe = load_recipe(ROOT / "recipes/1b_wsd.yaml", [*sets, "model.gradient_checkpointing=true"], check_model=False)
    options = footprints(recipe, shape_of(dict(recipe.model.config)), 8)
    assert best(options, 80 * GIB).option in ("zero2", "zero3", "fsdp2")
    for unsharded in ("ddp", "zero1"):
        assert [f.id for f in sharding_findings(options, unsharded, 8, 80 * GIB)] == ["PT020"]


def test_inspect_recipe_reads_the_flagship_without_torch_and_lists_valid_gpu_counts():
    code = (
        "import sys, runpy; sys.argv = ['inspect_recipe.py', 'recipes/1b_wsd.yaml', '--gpus', '8', '--sharding', "
        "'zero1']; sys.path.insert(0, 'scripts'); import inspect_recipe; rc = inspect_recipe.main(sys.argv[1:]); "
        "assert rc == 0 and 'torch' not in sys.modules and 'transformers' not in sys.modules, sorted(sys.modules)"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "zero1" in proc.stdout and "<- best" in proc.stdout and "PT02" not in proc.stdout
    bad = subprocess.run(
        [sys.executable, "scripts/inspect_recipe.py", "recipes/1b_wsd.yaml", "--gpus", "256"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "valid counts: 1, 2, 4, 8, 16, 32, 64, 128" in bad.stderr


def test_the_launch_is_named_by_its_backend():
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from pretrainer.train.accelerator import sharding_option

    def acc(kind, stage=None, n=8):
        plugin = SimpleNamespace(zero_stage=stage)
        return SimpleNamespace(distributed_type=kind, num_processes=n, state=SimpleNamespace(deepspeed_plugin=plugin))

    assert sharding_option(acc(DistributedType.MULTI_GPU)) == "ddp"
    assert [sharding_option(acc(DistributedType.DEEPSPEED, s)) for s in (0, 1, 2, 3)] == [
        None,
        "zero1",
        "zero2",
        "zero3",
    ]
    assert sharding_option(acc(DistributedType.DEEPSPEED, 3, n=1)) is None
    assert sharding_option(acc(DistributedType.FSDP)) == "fsdp2"
    assert sharding_option(acc(DistributedType.NO, n=1)) is None
