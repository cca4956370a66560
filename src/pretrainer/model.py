"""Build the Hugging Face model a recipe declares: from its config dict alone, no download."""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from .errors import RecipeError
from .sections import ModelSection


def build_config(section: ModelSection, vocab_size: int | None = None, **token_ids: int | None) -> PretrainedConfig:
    """The HF config from `model.config`, with the vocabulary sized to the tokenizer when one is given."""
    cfg: dict[str, Any] = dict(section.config)
    model_type = cfg.pop("model_type")
    if vocab_size is not None:
        declared = cfg.get("vocab_size")
        if declared is not None and declared < vocab_size:
            raise RecipeError(
                f"model.config.vocab_size: {declared} is smaller than the tokenizer's vocabulary ({vocab_size})"
            )
        cfg.setdefault("vocab_size", vocab_size)
    if section.init_std is not None:
        cfg["initializer_range"] = section.init_std
    cfg.update({k: v for k, v in token_ids.items() if v is not None})
    try:
        return AutoConfig.for_model(model_type, trust_remote_code=section.trust_remote_code, **cfg)
    except ValueError as e:
        raise RecipeError(f"model.config.model_type: {e}") from None


def build_model(section: ModelSection, config: PretrainedConfig, meta: bool = False) -> PreTrainedModel:
    """Instantiate a freshly initialised model (fp32 master weights; autocast handles mixed precision).

    Args:
        meta: build on the meta device (no memory; for counting parameters and FLOPs).
    """
    kwargs = {"attn_implementation": section.attn_implementation, "trust_remote_code": section.trust_remote_code}
    try:
        if meta:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config, **kwargs)
        else:
            model = AutoModelForCausalLM.from_config(config, **kwargs)
    except (ValueError, ImportError) as e:
        raise RecipeError(f"model.attn_implementation: {e}") from None
    if section.gradient_checkpointing and not meta:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    return model


def count_params(model: torch.nn.Module, trainable_only: bool = False) -> int:
    """Parameters, tied weights counted once (model.parameters() de-duplicates shared tensors)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def non_embedding_params(model: PreTrainedModel) -> int:
    emb = model.get_input_embeddings().weight.numel()
    out = model.get_output_embeddings()
    untied = out is not None and out.weight is not model.get_input_embeddings().weight
    return count_params(model) - emb - (out.weight.numel() if untied else 0)


def flops_per_token(config: PretrainedConfig, n_params_non_embedding: int, seq_len: int) -> int:
    """Training FLOPs per token: 6N (forward + backward matmuls) + 12·L·H·Q·T (attention scores and values).

    N excludes embeddings but counts the LM head, as in the PaLM appendix B convention.
    """
    n_layers = config.num_hidden_layers
    n_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
    lm_head = config.vocab_size * config.hidden_size
    return 6 * (n_params_non_embedding + lm_head) + 12 * n_layers * n_heads * head_dim * seq_len
