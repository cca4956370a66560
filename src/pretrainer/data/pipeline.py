"""From recipe to batches: tokenizer, cached token arrays per source, and the micro batches of each step."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from ..errors import DataError
from ..sections import Recipe
from ..stages import StageSpan
from ..tokenizer import load_tokenizer, trained_tokenizer
from .sampler import MixtureSampler, next_indices
from .sources import read_documents, source_key
from .tokens import TokenArrays, load_arrays, save_arrays, split, tokenize, tokenizer_fingerprint, validation_mask


def used_sources(recipe: Recipe) -> list[str]:
    """Sources named with a positive weight in some stage's mixture, in definition order."""
    used = {n for st in recipe.stages for n, w in st.mixture.items() if w > 0}
    return [n for n in recipe.data.sources if n in used]


def get_tokenizer(recipe: Recipe) -> PreTrainedTokenizerBase:
    """The recipe's tokenizer; a trained one is built on first use and cached by content."""
    section = recipe.tokenizer
    if section.path is not None:
        return load_tokenizer(section, trust_remote_code=recipe.model.trust_remote_code)
    names = section.train.sources or used_sources(recipe)
    keys = {n: source_key(n, recipe.data.sources[n]) for n in names}

    def corpus():
        # Learn from training documents only: held-out documents stay unseen by everything.
        limit = section.train.max_documents
        count = 0
        for n in names:
            docs = read_documents(n, recipe.data.sources[n])
            mask = validation_mask(len(docs), recipe.data.validation_fraction)
            for doc, held_out in zip(docs, mask):
                if not held_out:
                    yield doc
                    count += 1
                    if limit and count >= limit:
                        return

    return trained_tokenizer(section, json.dumps(keys, sort_keys=True), corpus, recipe.data.cache_dir)


@dataclass
class SourceData:
    train: TokenArrays
    val: TokenArrays


def load_sources(recipe: Recipe, tokenizer: PreTrainedTokenizerBase) -> dict[str, SourceData]:
    """Token arrays of every used source, tokenized on first use and memory-mapped from the cache after."""
    fp = tokenizer_fingerprint(tokenizer)
    out = {}
    for name in used_sources(recipe):
        src = recipe.data.sources[name]
        base = Path(recipe.data.cache_dir) / "tokens" / f"{name}-{source_key(name, src)}-{fp}"
        train, val = load_arrays(base / "train"), load_arrays(base / "val")
        if train is None or val is None:
            arrays = tokenize(read_documents(name, src), tokenizer)
            if arrays.n_docs < 2:
                raise DataError(
                    f"data.sources.{name}: needs at least 2 documents, one of them held out for validation"
                )
            train, val = split(arrays, recipe.data.validation_fraction)
            meta = {"source": name, "tokenizer": fp, "vocab_size": len(tokenizer)}
            save_arrays(train, base / "train", {**meta, "split": "train", "tokens": len(train.tokens)})
            save_arrays(val, base / "val", {**meta, "split": "val", "tokens": len(val.tokens)})
            train, val = load_arrays(base / "train"), load_arrays(base / "val")
        out[name] = SourceData(train, val)
    return out


class StageBatches:
    """The batches of one stage: global sample indices -> packed sequences, split over ranks and micro batches."""

    def __init__(self, recipe: Recipe, span: StageSpan, sources: dict[str, SourceData]):
        self.span = span
        stage = recipe.stages[span.index]
        sizes = {}
        for name, w in stage.mixture.items():
            if w <= 0:
                continue
            sizes[name] = sources[name].train.num_windows(span.seq_len)
            if sizes[name] == 0:
                raise DataError(
                    f"data.sources.{name}: {len(sources[name].train.tokens)} training tokens, fewer than one "
                    f"sequence of seq_len {span.seq_len} (stage {span.name!r})"
                )
        self.sources = sources
        self.sampler = MixtureSampler(stage.mixture, sizes, seed=recipe.run.seed, stage=span.index)

    def step_batches(
        self, cursor: int, rank: int, world: int, skips: list[tuple[int, int]] | None = None
    ) -> tuple[list[torch.Tensor], int, tuple[int, int]]:
        """The micro batches this rank trains on for one optimizer step.

        Args:
            cursor: the stage's next global sample index.
            skips: this stage's skipped (first, last) sample ranges.

        Returns:
            (micro batches of shape [micro_batch_size, seq_len], the new cursor, the (first, last) global sample
            indices that the whole step consumed).
        """
        idx, new_cursor = next_indices(cursor, self.span.sequences_per_step, skips or [])
        per_rank = len(idx) // world
        mine = idx[rank * per_rank : (rank + 1) * per_rank]
        rows = []
        for i in mine:
            d = self.sampler(i)
            rows.append(self.sources[d.source].train.window(d.sample, self.span.seq_len))
        mb = self.span.micro_batch_size
        batches = [torch.from_numpy(np.stack(rows[j : j + mb]).astype(np.int64)) for j in range(0, len(rows), mb)]
        return batches, new_cursor, (idx[0], idx[-1])


def validation_batches(
    sources: dict[str, SourceData], names: list[str], seq_len: int, micro: int, max_batches: int
) -> dict[str, list[torch.Tensor]]:
    """Fixed held-out micro batches per source (the first windows of its validation documents)."""
    out = {}
    for name in names:
        val = sources[name].val
        n = min(val.num_windows(seq_len), micro * max_batches)
        if n == 0:
            # A short validation split still gets evaluated, on one shorter sequence.
            rows = [np.asarray(val.tokens[: max(2, len(val.tokens))])]
        else:
            rows = [val.window(j, seq_len) for j in range(n)]
        out[name] = [
            torch.from_numpy(np.stack(rows[j : j + micro]).astype(np.int64)) for j in range(0, len(rows), micro)
        ]
    return out
