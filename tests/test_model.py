import pytest
import torch

from pretrainer.errors import RecipeError
from pretrainer.model.build import build_config, build_model, count_params
from pretrainer.model.section import ModelSection

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


def test_stage_rope_changes_rotary_buffers():
    from pretrainer.model.build import apply_stage_rope
    from pretrainer.recipe.sections import RopeSection

    cfg = dict(CFG, max_position_embeddings=64, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    sec = ModelSection(config=cfg)
    model = build_model(sec, build_config(sec))
    ids = torch.randint(0, 512, (1, 48))
    before_freq = model.model.rotary_emb.inv_freq.clone()
    before_logits = model(input_ids=ids).logits
    params = apply_stage_rope(model, RopeSection(theta=500000), seq_len=256)
    assert params == {"rope_type": "default", "rope_theta": 500000.0}
    after = model.model.rotary_emb.inv_freq
    assert after[0] == before_freq[0] and (after[1:] < before_freq[1:]).all()  # lower frequencies, higher base
    dim = 64 // 4
    assert torch.allclose(after, 1.0 / (500000.0 ** (torch.arange(0, dim, 2).float() / dim)))
    assert not torch.allclose(model(input_ids=ids).logits, before_logits)  # the live model really changed
    assert model.config.max_position_embeddings == 256
    params = apply_stage_rope(model, RopeSection(yarn={"factor": 4, "original_max_position_embeddings": 64}), 256)
    assert params["rope_type"] == "yarn" and params["rope_theta"] == 500000.0 and params["factor"] == 4
    assert model.model.rotary_emb.attention_scaling > 1.0


def _llama(**section):
    cfg = {
        "model_type": "llama",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 64,
        "max_position_embeddings": 32,
    }
    s = ModelSection(config=cfg, **section)
    torch.manual_seed(0)
    return build_model(s, build_config(s, vocab_size=64))


@pytest.mark.parametrize("every,expected", [(True, [0, 1, 2, 3]), (2, [0, 2]), (3, [0, 3])])
def test_selective_activation_checkpointing_recomputes_only_those_layers(every, expected):
    from transformers.modeling_layers import GradientCheckpointingLayer

    plain, ckpt = _llama(), _llama(gradient_checkpointing=every)
    layers = [m for m in ckpt.modules() if isinstance(m, GradientCheckpointingLayer)]
    assert [i for i, m in enumerate(layers) if m.gradient_checkpointing] == expected
    calls = [0] * len(layers)
    for i, m in enumerate(layers):
        m.mlp.register_forward_pre_hook(
            lambda *_, i=i: calls.__setitem__(i, calls[i] + 1)
        )  # pre: recompute stops early
    x = torch.randint(0, 64, (2, 16))
    for m in (plain, ckpt):
        m.train()
        m(input_ids=x, labels=x).loss.backward()
    assert [i for i, c in enumerate(calls) if c == 2] == expected  # forward run again in backward: checkpointed
    for (n, p), q in zip(plain.named_parameters(), ckpt.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6), n  # the same gradients, only recomputed


def test_kernel_and_checkpointing_switches_are_validated():
    with pytest.raises(ValueError, match="layer interval >= 1"):
        ModelSection(config={"model_type": "llama"}, gradient_checkpointing=0)
    with pytest.raises(ValueError):
        ModelSection(config={"model_type": "llama"}, kernels="triton")
    if not torch.cuda.is_available():
        with pytest.raises(RecipeError, match="model.kernels: liger needs an NVIDIA GPU"):
            _llama(kernels="liger")


@pytest.mark.slow  # compiled equals eager; the default set holds each layer to one graph (torch._dynamo.explain)
def test_compile_is_per_decoder_layer_and_keeps_the_model_plain():
    eager, compiled = _llama(), _llama(compile=True)
    assert type(compiled).__name__ == "LlamaForCausalLM"  # no OptimizedModule wrapper for Accelerate to unwrap
    layers = [m for m in compiled.model.layers]
    assert all(m._compiled_call_impl is not None for m in layers)
    x = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        assert torch.allclose(eager(input_ids=x).logits, compiled(input_ids=x).logits, atol=1e-5)


def test_a_compiled_decoder_layer_is_one_graph_on_the_training_path():
    """`torch._dynamo.explain` on one decoder layer called as the training step calls it (rows as they are, and
    per-document masks): one graph, no break. A break would split every layer's compiled forward."""
    from torch import _dynamo

    from pretrainer.model.build import decoder_layers
    from pretrainer.model.masking import forward_of, model_inputs

    model = _llama()
    layer = decoder_layers(model)[0]
    x = torch.randint(1, 64, (2, 32))
    x[:, 10] = 0  # a document boundary (EOS id 0)
    seen = {}
    for masking in (False, True):
        hook = layer.register_forward_pre_hook(lambda m, a, k: seen.update(args=a, kwargs=k), with_kwargs=True)
        inputs = model_inputs(masking, 0, model.config._attn_implementation)(x)
        with forward_of(inputs):
            model(**inputs, use_cache=False)  # as train/step.py calls it
        hook.remove()  # (not traced below)
        _dynamo.reset()
        out = _dynamo.explain(layer)(*seen["args"], **seen["kwargs"])
        assert (out.graph_count, out.graph_break_count) == (1, 0), (masking, out.break_reasons)


def test_compile_under_zero3_is_warned():
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from pretrainer.train.build import compile_warning

    def acc(kind, stage=None):
        return SimpleNamespace(
            distributed_type=kind, state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=stage))
        )

    assert "ZeRO-3" in compile_warning(True, acc(DistributedType.DEEPSPEED, 3))
    assert compile_warning(False, acc(DistributedType.DEEPSPEED, 3)) is None
    assert compile_warning(True, acc(DistributedType.DEEPSPEED, 2)) is None
    assert compile_warning(True, acc(DistributedType.NO)) is None
