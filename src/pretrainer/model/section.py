"""The model's section of a recipe: a Hugging Face config and how the model is built from it. It lives with the model,
so building a model needs no recipe (`recipe/schema.py` puts it in the `Recipe`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from ..strict import Section


class ModelSection(Section):
    """The model: a Hugging Face config (no weights are downloaded), its init, attention and kernels."""

    config: dict[str, Any]
    """A Hugging Face config dict; `model_type` picks the architecture (any type transformers knows)."""
    init_std: float | None = Field(default=0.02, gt=0)
    """Std of the normal init of linear and embedding weights (sets `initializer_range`)."""
    attn_implementation: str = "sdpa"
    """`sdpa` (default), `eager`, or `flash_attention_2` where installed."""
    gradient_checkpointing: bool | int = False
    """Recompute activations in backward: `true` for every decoder layer, k for layers 0, k, 2k, ... (selective)."""
    kernels: Literal["none", "liger"] = "none"
    """`liger`: liger-kernel's fused RMSNorm, RoPE, SwiGLU, linear cross-entropy (NVIDIA GPU and liger-kernel)."""
    compile: bool = False
    """torch.compile each decoder layer (on in the GPU recipes; minutes of compile time on a CPU). One graph per layer,
    no graph break, with and without document masking (`torch._dynamo.explain`, tests/test_model.py); under DeepSpeed
    ZeRO-3 its parameter hooks break the layer's graph, and the run warns at start."""
    trust_remote_code: bool = False
    """Only needed for hub model types that transformers does not ship; off unless asked for."""

    @field_validator("gradient_checkpointing")
    @classmethod
    def _every_k(cls, v: bool | int) -> bool | int:
        if not isinstance(v, bool) and v < 1:
            raise ValueError(f"must be true, false or a layer interval >= 1 (got {v})")
        return v

    @field_validator("config")
    @classmethod
    def _has_model_type(cls, v: dict[str, Any]) -> dict[str, Any]:
        if "model_type" not in v:
            raise ValueError("must contain `model_type` (for example `llama`)")
        return v
