"""The recipe's tokenizer: a hub id or local path, or a byte-level BPE trained once on the recipe's own data."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import RecipeError, first_line
from ..recipe.sections import TokenizerSection

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

# tokenizers and transformers are imported where a tokenizer is loaded or trained: asking a recipe's vocabulary size
# (inspect_recipe.py) must not pay for them.

EOS = "<|endoftext|>"
PAD = "<|pad|>"


def load_tokenizer(section: TokenizerSection, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """Load a tokenizer from a hub id or a local directory."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(section.path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise RecipeError(f"tokenizer.path: cannot load {section.path!r}: {first_line(e)}") from None
    if tok.eos_token_id is None:
        raise RecipeError(f"tokenizer.path: {section.path!r} has no EOS token, needed between packed documents")
    return tok


def train_bpe(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE (GPT-2 style pre-tokenizer) with an EOS and a PAD token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=PAD)


def trained_tokenizer(
    section: TokenizerSection, corpus_key: str, corpus: Callable[[], Iterable[str]], cache_dir: str | Path
) -> PreTrainedTokenizerFast:
    """Train once and cache under `cache_dir/tokenizers/<hash>`; later runs (and other processes) load the cache.

    Args:
        corpus_key: identifies the training documents (part of the cache key).
        corpus: yields the training documents; only called on a cache miss.
    """
    from transformers import PreTrainedTokenizerFast

    spec = json.dumps({"train": section.train.model_dump(), "corpus": corpus_key}, sort_keys=True)
    key = hashlib.sha256(spec.encode()).hexdigest()[:16]
    out = Path(cache_dir) / "tokenizers" / key
    if (out / "tokenizer.json").exists():
        return PreTrainedTokenizerFast.from_pretrained(out)
    tok = train_bpe(corpus(), section.train.vocab_size)
    # Write beside and rename, so a reader never sees a half-written tokenizer.
    tmp = out.with_name(f"{key}.tmp{os.getpid()}")
    tok.save_pretrained(tmp)
    try:
        tmp.rename(out)
    except OSError:  # another process got there first
        shutil.rmtree(tmp, ignore_errors=True)
    return PreTrainedTokenizerFast.from_pretrained(out)
