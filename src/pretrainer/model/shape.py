"""A decoder's size from its config dict alone: no torch, no transformers (inspect_recipe.py answers in a second).

Exact for the model types whose layout is written here (Llama-shaped decoders: attention with GQA, a gated MLP,
RMSNorms; Qwen3 adds per-head q/k norms, Qwen2 biases on q/k/v); None for any other type or a config that leaves a
shape field to its model type's default, and the caller builds the model on the meta device instead. A test
compares these counts with the built model's for every shipped recipe.
"""

from __future__ import annotations

from dataclasses import dataclass

# model_type -> (q/k norms per layer, biases on q/k/v)
LAYOUTS = {"llama": (False, False), "mistral": (False, False), "qwen2": (False, True), "qwen3": (True, False)}
REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    layer_params: int
    """Parameters of one decoder layer."""
    params: int
    non_embedding: int
    """All parameters but the input embedding and an untied LM head (`build.non_embedding_params`)."""

    @property
    def compute(self) -> Compute:
        return Compute(self.non_embedding, self.vocab * self.hidden, self.layers, self.heads * self.head_dim)


def shape_of(config: dict) -> Shape | None:
    """The shape of the decoder `config` (a recipe's `model.config` with its vocabulary), or None when not known
    here without transformers."""
    layout = LAYOUTS.get(config.get("model_type", "llama"))
    if layout is None or any(config.get(k) is None for k in REQUIRED) or "tie_word_embeddings" not in config:
        return None
    qk_norm, qkv_bias = layout
    h, i, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or h // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    attn = h * q + 2 * h * kv + q * h + (q + 2 * kv) * qkv_bias + 2 * head_dim * qk_norm
    layer = attn + 3 * h * i + 2 * h  # the gated MLP's three matrices, two RMSNorms
    embedding = config["vocab_size"] * h
    head = 0 if config["tie_word_embeddings"] else embedding
    total = layers * layer + h + embedding + head  # + the final norm
    vocab, tied = config["vocab_size"], config["tie_word_embeddings"]
    return Shape(h, i, layers, heads, kv_heads, head_dim, vocab, tied, layer, total, total - embedding - head)


@dataclass(frozen=True)
class Compute:
    """What a decoder's training FLOPs per token depend on: from a `Shape` (`Shape.compute`), or from a built
    model's config and its counted parameters (`build.compute_of`)."""

    non_embedding: int
    """Parameters without the input embedding and an untied LM head."""
    lm_head: int
    """vocab x hidden: the head's matmul, tied or not."""
    layers: int
    attention_width: int
    """Heads x head dimension."""

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: 6N (forward + backward matmuls) + 12·L·H·Q·T (attention scores and values).
        N excludes embeddings but counts the LM head, as in the PaLM appendix B convention."""
        return 6 * (self.non_embedding + self.lm_head) + 12 * self.layers * self.attention_width * seq_len
