"""Build the Hugging Face model a recipe declares: from its config dict alone, no download."""

from __future__ import annotations

import logging
import math
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from ..errors import RecipeError, first_line
from .section import ModelSection
from .shape import Compute

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedModel

# torch and transformers are imported where a model is built, not at import: reading a recipe (check_run.py, the
# resolved recipe of a run) must not pay seconds of imports for them.


def build_config(section: ModelSection, vocab_size: int | None = None, **token_ids: int | None) -> PretrainedConfig:
    """The HF config from `model.config`, with the vocabulary sized to the tokenizer when one is given, and the
    special token ids (`token_ids`: bos/eos/pad) the tokenizer's, so an exported config agrees with its tokenizer."""
    from transformers import CONFIG_MAPPING, AutoConfig

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
    # a tokenizer without a BOS: no BOS in the config either (a model type's default, e.g. Llama's 1, would name
    # another token to generation and downstream tools)
    if "bos_token_id" in token_ids and token_ids["bos_token_id"] is None:
        cfg["bos_token_id"] = None
    try:
        with _config_logs_quiet():  # its token-id warning is superseded by the check below
            config = AutoConfig.for_model(model_type, trust_remote_code=section.trust_remote_code, **cfg)
    except ValueError as e:
        if model_type not in CONFIG_MAPPING:
            raise RecipeError(f"model.config.model_type: {e}") from None
        raise RecipeError(f"model.config: {first_line(e)}") from None
    except Exception as e:  # transformers validates fields with its own error types: all mean "this field"
        lines = [x.strip() for x in str(e).splitlines() if x.strip()]
        raise RecipeError(f"model.config: {lines[-1] if lines else type(e).__name__}") from None
    _check_token_ids(config, declared=set(section.config))
    return config


def _check_token_ids(config: PretrainedConfig, declared: set[str]) -> None:
    """Special-token ids inside the vocabulary. One the recipe set is an error naming it; one the model type brought
    as a default (gpt2's 50256 beside a 512-token tokenizer) is dropped (None), as the tokenizer has no such token."""
    vocab = getattr(config, "vocab_size", None)
    if not isinstance(vocab, int):
        return
    for name, value in list(config.to_diff_dict().items()) + [(n, getattr(config, n, None)) for n in _TOKEN_IDS]:
        if not name.endswith("_token_id") or not isinstance(value, int) or isinstance(value, bool):
            continue
        if 0 <= value < vocab:
            continue
        if name in declared:
            raise RecipeError(f"model.config: {value} is outside the vocabulary, 0 to {vocab - 1} (field '{name}')")
        setattr(config, name, None)


_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")


@contextmanager
def _config_logs_quiet():
    import transformers

    logger = transformers.utils.logging.get_logger("transformers.configuration_utils")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def build_model(section: ModelSection, config: PretrainedConfig, meta: bool = False) -> PreTrainedModel:
    """Instantiate a freshly initialised model (fp32 master weights; autocast handles mixed precision).

    Args:
        meta: build on the meta device (no memory; for counting parameters and FLOPs).
    """
    import torch
    from transformers import AutoModelForCausalLM

    kwargs = {"attn_implementation": section.attn_implementation, "trust_remote_code": section.trust_remote_code}
    try:
        if meta:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config, **kwargs)
        else:
            model = AutoModelForCausalLM.from_config(config, **kwargs)
    except (ValueError, ImportError) as e:
        raise RecipeError(f"model.attn_implementation: {e}") from None
    if section.gradient_checkpointing is not False and not meta:
        checkpoint_layers(model, 1 if section.gradient_checkpointing is True else section.gradient_checkpointing)
    if section.kernels == "liger" and not meta:
        apply_liger(model)
    if section.compile and not meta:
        compile_layers(model)
    return model


OUTPUT_PROJECTIONS = ("o_proj", "down_proj", "out_proj", "c_proj", "dense_4h_to_h", "wo", "w2", "fc2")
"""Module names of a decoder layer's output projections (attention out, MLP down) across HF model families."""


def scale_output_init(model: PreTrainedModel, std: float) -> int:
    """`stability.init: scaled`: re-draw each decoder layer's output-projection weights with std / sqrt(2 x layers)
    (GPT-2's and Megatron's depth-scaled init: the residual stream's variance then stays flat in depth). Returns how
    many weights were re-drawn; a model with none of the known projection names is refused."""
    import torch

    layers = decoder_layers(model)
    scaled = std / math.sqrt(2 * max(1, len(layers)))
    weights = [
        m.weight
        for layer in layers
        for name, m in layer.named_modules()
        if name.rsplit(".", 1)[-1] in OUTPUT_PROJECTIONS and isinstance(getattr(m, "weight", None), torch.Tensor)
    ]
    if not weights:
        raise RecipeError(
            f"stability.init: scaled found no output projections ({', '.join(OUTPUT_PROJECTIONS)}) in the decoder "
            f"layers of model type {model.config.model_type!r}; use init: hf"
        )
    with torch.no_grad():
        for w in weights:
            w.normal_(0.0, scaled)
    return len(weights)


def checkpoint_layers(model: PreTrainedModel, every: int) -> list[int]:
    """Activation checkpointing on decoder layers 0, every, 2*every, ...; returns their indices."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    layers = decoder_layers(model)
    for i, layer in enumerate(layers):
        layer.gradient_checkpointing = i % every == 0  # HF enabled all; the others keep their activations
    return [i for i, layer in enumerate(layers) if layer.gradient_checkpointing]


def decoder_layers(model: PreTrainedModel) -> list[torch.nn.Module]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def compile_layers(model: PreTrainedModel) -> int:
    """torch.compile each decoder layer in place (as torchtitan does): one graph reused by every layer, so compile
    time does not grow with depth, and the model stays a plain module for Accelerate, DeepSpeed and FSDP."""
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile()
    return len(layers)


def apply_liger(model: PreTrainedModel) -> None:
    """liger-kernel's fused kernels for this model type, as the HF Trainer's `use_liger_kernel` applies them."""
    import torch

    if not torch.cuda.is_available():
        raise RecipeError("model.kernels: liger needs an NVIDIA GPU (its kernels are Triton); this machine has none")
    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
    except ImportError:
        raise RecipeError("model.kernels: liger needs liger-kernel (pip install liger-kernel)") from None
    _apply_liger_kernel_to_instance(model=model)


def count_params(model: torch.nn.Module, trainable_only: bool = False) -> int:
    """Parameters, tied weights counted once (model.parameters() de-duplicates shared tensors)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def non_embedding_params(model: PreTrainedModel) -> int:
    emb = model.get_input_embeddings().weight.numel()
    out = model.get_output_embeddings()
    untied = out is not None and out.weight is not model.get_input_embeddings().weight
    return count_params(model) - emb - (out.weight.numel() if untied else 0)


def compute_of(config: PretrainedConfig, n_params_non_embedding: int) -> Compute:
    """What the built model's FLOPs per token depend on (`Compute.flops_per_token`), for any model type."""
    n_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
    lm_head = config.vocab_size * config.hidden_size
    return Compute(n_params_non_embedding, lm_head, config.num_hidden_layers, n_heads * head_dim)


def rope_parameters(config: PretrainedConfig, rope) -> dict[str, Any]:
    """The config's `rope_parameters` after a stage's RoPE change (theta and/or YaRN)."""
    current = dict(getattr(config, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0})
    new = {"rope_type": current.get("rope_type", "default"), "rope_theta": current.get("rope_theta", 10000.0)}
    if current.get("rope_type", "default") != "default":
        new.update(current)  # keep an earlier scaling unless this stage sets one
    if rope.theta is not None:
        new["rope_theta"] = float(rope.theta)
    if rope.yarn is not None:
        new.update({"rope_type": "yarn", **{k: v for k, v in rope.yarn.model_dump().items() if v is not None}})
    return new


def rotary_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if hasattr(m, "inv_freq") and hasattr(m, "config")]


def apply_stage_rope(model: PreTrainedModel, rope, seq_len: int) -> dict[str, Any]:
    """Change RoPE on the live model: update the config, recompute every rotary module's buffers in place.

    The config travels into `final/config.json`, so the exported model uses the RoPE it was trained with.

    Returns:
        The new `rope_parameters`.
    """
    params = rope_parameters(model.config, rope)
    set_rope(model, params, max(model.config.max_position_embeddings, seq_len))
    return params


def set_rope(model: PreTrainedModel, params: dict[str, Any], max_positions: int) -> None:
    """Set `rope_parameters` and recompute every rotary module's buffers in place."""
    config = model.config
    config.rope_parameters = dict(params)
    config.max_position_embeddings = max_positions
    mods = rotary_modules(model)
    if not mods:
        raise RecipeError(f"stages.rope: model type {config.model_type!r} has no rotary embedding to change")
    for m in mods:
        m.config.rope_parameters = params  # the module may hold its own (text) sub-config
        fresh = type(m)(config=m.config)
        m.inv_freq.copy_(fresh.inv_freq.to(m.inv_freq.device))
        if hasattr(m, "original_inv_freq"):
            m.original_inv_freq.copy_(fresh.original_inv_freq.to(m.original_inv_freq.device))
        m.attention_scaling = fresh.attention_scaling
        m.rope_type = fresh.rope_type
        m.max_seq_len_cached = m.original_max_seq_len = config.max_position_embeddings


class StageRope:
    """The RoPE of the live model as the stages so far have set it."""

    def __init__(self, model: PreTrainedModel, stages):
        self.model, self.stages = model, stages
        cfg = model.config  # a model without RoPE (gpt2's learned positions) has neither field: nothing to change
        self.base = (dict(getattr(cfg, "rope_parameters", None) or {}), getattr(cfg, "max_position_embeddings", None))

    def enter(self, prev: int, index: int) -> dict[str, Any]:
        """Apply the RoPE changes of stages prev+1..index (all earlier ones when resuming into a later stage), so
        `final/config.json` carries the RoPE the model was trained with. Returns the new `rope_parameters`."""
        if prev > index:  # rolled back into an earlier stage: rebuild RoPE from the recipe's own
            set_rope(self.model, self.base[0], self.base[1])
            prev = -1
        for k in range(prev + 1, index + 1):
            stage = self.stages[k]
            if stage.rope is not None:
                apply_stage_rope(self.model, stage.rope, stage.seq_len)
        return dict(getattr(self.model.config, "rope_parameters", None) or {})


LEARNED_POSITIONS = frozenset({"gpt2", "gpt_bigcode", "gpt_neo", "opt", "biogpt"})
"""Model types with a learned position table: a sequence longer than the table indexes past its end."""


def check_model_config(section: ModelSection, vocab_size: int | None, longest_seq: int = 0) -> None:
    """Build the declared model on the meta device (no memory, no download): a wrongly typed `model.config` field,
    or a stage longer than a learned position table, fails here, as one line, before any data or tokenizer work.

    Raises:
        RecipeError: naming `model.config` and what transformers said.
    """
    try:
        config = build_config(section, vocab_size=vocab_size)
        positions = getattr(config, "max_position_embeddings", None)
        if config.model_type in LEARNED_POSITIONS and positions is not None and longest_seq > positions:
            raise RecipeError(
                f"model.config: a {config.model_type} model learns {positions} positions (field "
                f"'max_position_embeddings'; n_positions in gpt2), but a stage trains at seq_len {longest_seq}: raise "
                f"it to {longest_seq} or more"
            )
        build_model(section, config, meta=True)
    except RecipeError:
        raise
    except Exception as e:  # whatever transformers or torch raise on a field's value, it is the recipe's field
        raise RecipeError(
            f"model.config: the model cannot be built from it: {type(e).__name__}: {first_line(e)}"
        ) from None
