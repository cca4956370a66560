"""The `stability` recipe section: prevention (z-loss, the init preset), absorption of a bad step in place
(skip-step), and the leading indicators logged per decoder layer. QK-norm and logit soft-capping are properties of
the model type (`model.config.model_type`), not settings here: see docs/STABILITY.md for the types that have them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from ..strict import Section

QK_NORM_TYPES = frozenset({"olmo2", "olmo3", "olmoe", "qwen3", "qwen3_moe", "gemma3_text"})
"""Hugging Face model types whose attention normalises q and k (RMSNorm) before the dot product."""
QK_NORM_FLAGS = ("qk_layernorm", "use_qk_norm")
"""Config flags that turn QK-norm on in other types (persimmon and chameleon; cohere)."""
SOFTCAP_FLAGS = ("attn_logit_softcapping", "final_logit_softcapping")
"""Config fields of logit soft-capping (gemma2; gemma3's final logits)."""


def prevention(config: dict[str, Any]) -> list[str]:
    """What a model config (the recipe's `model.config`) does against logit growth: `qk_norm`, `softcap`."""
    out = []
    if config.get("model_type") in QK_NORM_TYPES or any(config.get(f) for f in QK_NORM_FLAGS):
        out.append("qk_norm")
    if any(config.get(f) for f in SOFTCAP_FLAGS):
        out.append("softcap")
    return out


class SkipStepSection(Section):
    """Tier 1 of the ladder: an outlier step's update is not applied (weights and optimizer moments untouched)."""

    enabled: bool = True
    """Skip an update whose loss or pre-clip gradient norm is an outlier against the recent steps. Decided on the host
    from the values the NaN guard already reads (no extra sync), identically on every rank. A non-finite step is
    never applied, with this on or off."""
    sigmas: float = Field(default=6.0, gt=0)
    """Outlier: above the mean of the history plus this many standard deviations (OLMo 3's 6)."""
    grad_norm_ratio: float = Field(default=3.0, ge=1)
    """A gradient-norm outlier must also be at least this multiple of the mean. A healthy small-batch step's norm has
    a heavy right tail (up to 2.3x the mean and 11 sd in a 2,000-step run at 256 tokens per step; docs/STABILITY.md),
    which 6 sd alone would skip; the incidents measured sit at 5.4x (poisoned data) to 1,000x, and an update whose
    norm exceeds `max_grad_norm` is bounded by clipping anyway."""
    window: int = Field(default=128, ge=8)
    """Steps of history (OLMo 3's 128). Skipped steps enter it too, so a lasting level shift is accepted after a
    few steps instead of being skipped for ever (and the spike rule decides about it)."""
    min_history: int = Field(default=64, ge=2)
    """Steps of the current stage seen before any step is judged (OLMo 3: half the window)."""


class StabilitySection(Section):
    """Prevention, in-step absorption and leading indicators; the rollback (`spikes`) is the last resort."""

    skip_step: SkipStepSection = Field(default_factory=SkipStepSection)
    z_loss: float = Field(default=0.0, ge=0)
    """Coefficient of the z-loss, coef * mean(logsumexp(logits)^2), added to the training loss (PaLM, OLMo 3 use
    1e-4 / 1e-5). Computed chunk by chunk from the model's logits, so no full fp32 copy of them is made. Logged as
    `loss/z`; `loss` stays the cross-entropy. 0: off (the model's own loss, as before)."""
    layer_stats: bool = True
    """At logging steps, per decoder layer: gradient norm, update size (applied update RMS over parameter RMS, on a
    fixed sample of each matrix's entries) and parameter norm, and the attention-logit bound; summarised as
    `layers/*`, the full vectors in layers.jsonl, and the layers that moved first attached to spike events."""
    init: Literal["hf", "scaled"] = "hf"
    """`hf`: the model type's own init. `scaled`: also divide the init std of each layer's output projections
    (attention out, MLP down) by sqrt(2 x layers), GPT-2's / Megatron's depth-scaled init."""
