import pytest
import torch

from pretrainer.errors import RecipeError
from pretrainer.model import build_config, build_model, count_params
from pretrainer.sections import ModelSection

CFG = dict(
    model_type="llama",
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
)


def test_build_llama_with_init_std_and_gqa():
    sec = ModelSection(config=CFG, init_std=0.01)
    model = build_model(sec, build_config(sec))
    assert model.config.initializer_range == 0.01
    assert model.config.num_key_value_heads == 2
    std = model.model.layers[0].mlp.up_proj.weight.std().item()
    assert 0.008 < std < 0.012
    assert model.config._attn_implementation == "sdpa"
    out = model(input_ids=torch.randint(0, 512, (2, 16)), labels=torch.randint(0, 512, (2, 16)))
    assert torch.isfinite(out.loss)


def test_other_model_types_and_meta():
    sec = ModelSection(config=dict(model_type="gpt2", n_embd=32, n_layer=1, n_head=2, vocab_size=100))
    meta = build_model(sec, build_config(sec), meta=True)
    assert next(meta.parameters()).device.type == "meta"
    assert count_params(meta) > 0


def test_vocab_from_tokenizer_and_errors():
    cfg = dict(CFG)
    cfg.pop("vocab_size")
    assert build_config(ModelSection(config=cfg), vocab_size=777).vocab_size == 777
    with pytest.raises(RecipeError, match="smaller than the tokenizer"):
        build_config(ModelSection(config=CFG), vocab_size=1000)
    with pytest.raises(RecipeError, match="model.config.model_type"):
        build_config(ModelSection(config={"model_type": "no-such-model"}))
