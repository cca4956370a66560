"""From recipe to batches: tokenizer, cached token arrays per source, and the micro batches of each step."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from ..errors import DataError
from ..files import OwnedLock
from ..recipe.plan import StageSpan
from ..recipe.schema import Recipe
from ..recipe.sections import StageSection
from .packing import WindowTable, long_doc_windows, plain_windows
from .prepare import in_validation, prepare_source, read_manifest
from .readers import iter_documents, source_files
from .sampler import MixtureSampler, next_indices
from .sources import key_settings, source_key, used_sources
from .tokenfiles import SplitTokens
from .tokenizer import load_tokenizer, trained_tokenizer
from .tokens import tokenizer_fingerprint


def get_tokenizer(recipe: Recipe) -> PreTrainedTokenizerBase:
    """The recipe's tokenizer; a trained one is built on first use and cached by content."""
    section = recipe.tokenizer
    if section.path is not None:
        return load_tokenizer(section, trust_remote_code=recipe.model.trust_remote_code)
    names = section.train.sources or used_sources(recipe)
    keys = {n: source_key(n, recipe.data.sources[n], **key_settings(recipe)) for n in names}

    def corpus():
        # Learn from training documents only: held-out documents stay unseen by everything.
        limit = section.train.max_documents
        count = 0
        for n in names:
            for text in split_texts(recipe, n, validation=False):
                yield text
                count += 1
                if limit and count >= limit:
                    return

    return trained_tokenizer(section, json.dumps(keys, sort_keys=True), corpus, recipe.data.cache_dir)


def split_texts(recipe: Recipe, name: str, validation: bool):
    """The text of a source's training (or held-out) documents, in file order: the split of `prepare.SplitTokenizer`.
    Streamed: a source never sits whole in memory."""
    src = recipe.data.sources[name]
    first_file = source_files(name, src).paths[0]
    for i, doc in enumerate(iter_documents(name, src)):
        first = i == 0 and doc.metadata.get("file") == first_file
        if in_validation(doc.id, first, recipe.data.validation_fraction) == validation:
            yield doc.text


@dataclass
class SourceData:
    train: SplitTokens
    val: SplitTokens
    key: str = ""
    """The prepared directory's name: the source's content key and the tokenizer's fingerprint (data identity)."""


@contextlib.contextmanager
def preparation_lock(cache_dir: str | Path, enabled: bool = True) -> Iterator[None]:
    """One preparer per `data.cache_dir` at a time (an exclusive lock on `.prepare.lock` there, released by the OS if
    the process dies): runs of a sweep started together wait for the first to train the tokenizer and tokenize,
    then read what it wrote, instead of writing the same files at once or reading them half-written."""
    if not enabled:
        yield
        return
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    lock = OwnedLock(Path(cache_dir) / ".prepare.lock")
    if not lock.try_acquire():
        print(f"data: waiting for another run (pid {lock.holder()}) preparing data in {cache_dir}", file=sys.stderr)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def source_dir(recipe: Recipe, name: str, tokenizer: PreTrainedTokenizerBase) -> Path:
    """Where a source's token files live: keyed by the source's content and the tokenizer."""
    key = source_key(name, recipe.data.sources[name], **key_settings(recipe))
    return Path(recipe.data.cache_dir) / "tokens" / f"{name}-{key}-{tokenizer_fingerprint(tokenizer)}"


def load_sources(recipe: Recipe, tokenizer: PreTrainedTokenizerBase) -> dict[str, SourceData]:
    """The token files of every used source, memory-mapped. A source `prepare_data.py` has not prepared is tokenized
    here, by the same datatrove steps in this process, only when it is small (`data.inline_max_mb`): a large one
    would keep every other rank waiting for hours, so the run stops and names the command instead."""
    out = {}
    for name in used_sources(recipe):
        base = source_dir(recipe, name, tokenizer)
        manifest = read_manifest(base)
        if manifest is None:
            check_inline(recipe, name)
            manifest = prepare_source(
                name, recipe.data.sources[name], tokenizer, base, recipe.data.validation_fraction
            )
        out[name] = SourceData(SplitTokens(base, "train", manifest), SplitTokens(base, "val", manifest), base.name)
        for split in (out[name].train, out[name].val):
            check_token_ids(split, len(tokenizer), base)
    return out


ID_SAMPLES = 64
"""Windows of 1,024 tokens read per split at start to check token ids against the vocabulary (evenly spaced, the
first and last included): 64K tokens, milliseconds, whatever the source's size."""


def check_token_ids(split: SplitTokens, vocab: int, source_dir: Path) -> None:
    """Token ids beyond the tokenizer's vocabulary (a corrupted or foreign token file) are one line at start; an
    embedding lookup would otherwise fail mid-run, or on some backends read garbage."""
    n = len(split.tokens)
    if n == 0:
        return
    for start in np.linspace(0, max(0, n - 1024), ID_SAMPLES).astype(np.int64):
        window = split.tokens[int(start) : int(start) + 1024]
        if window.size and int(window.max()) >= vocab:
            raise DataError(
                f"{source_dir}: token id {int(window.max())} near token {int(start)} is beyond the tokenizer's "
                f"{vocab} ids: a corrupted or foreign token file; prepare it again"
            )


def check_inline(recipe: Recipe, name: str) -> None:
    """Refuse to tokenize a hub source, or local files over `data.inline_max_mb`, inside the training run."""
    src, limit = recipe.data.sources[name], recipe.data.inline_max_mb
    how = "run `python scripts/prepare_data.py RECIPE` (same --set overrides) first"
    if src.type == "hub":
        raise DataError(f"data.sources.{name}: hub dataset {src.path!r} is not prepared; {how}")
    if src.max_documents:
        return  # bounded by its document count
    files = source_files(name, src)
    size = sum(os.path.getsize(os.path.join(files.folder, p)) for p in files.paths) / 2**20
    if size > limit:
        raise DataError(
            f"data.sources.{name}: not prepared, and {size:,.0f} MB is too much to tokenize inside the "
            f"training run (data.inline_max_mb: {limit:g}); {how}"
        )


class Drawn(NamedTuple):
    """One optimizer step's draw for one rank."""

    batches: list[torch.Tensor]
    """Micro batches of shape [micro_batch_size, seq_len]."""
    cursor: int
    """The stage's next global sample index after the step."""
    samples: tuple[int, int]
    """The (first, last) global sample indices the whole step consumed (every rank's)."""


class StageBatches:
    """The batches of one stage: global sample indices -> packed sequences, split over ranks and micro batches."""

    def __init__(
        self, stage: StageSection, span: StageSpan, sources: dict[str, SourceData], seed: int, vocab: int | None = None
    ):
        """Args:
        vocab: the model's vocabulary size: a token id at or beyond it stops the run with one line naming its file
            (the check at start samples the files; an embedding lookup would fail, on a GPU with a device assert)."""
        self.span, self.vocab = span, vocab
        self.tables: dict[str, WindowTable] = {}
        for name, w in stage.mixture.items():
            if w <= 0:
                continue
            arr = sources[name].train
            if stage.long_docs is not None:
                ld = stage.long_docs
                table = long_doc_windows(arr, span.seq_len, ld.min_tokens, ld.upweight)
            else:
                table = plain_windows(arr, span.seq_len)
            if table.size == 0:
                raise DataError(
                    f"data.sources.{name}: {len(arr.tokens)} training tokens, fewer than one "
                    f"sequence of seq_len {span.seq_len} (stage {span.name!r})"
                )
            self.tables[name] = table
        self.sources = sources
        sizes = {n: t.size for n, t in self.tables.items()}
        self.sampler = MixtureSampler(stage.mixture, sizes, seed=seed, stage=span.index)
        self.repeats = dict.fromkeys(self.tables, 0)
        """Draws per source that came after the source was exhausted once (repeated data)."""

    def rows_for(self, indices: list[int]) -> list[np.ndarray]:
        """The token windows of these global sample indices (views into the memory-mapped token files)."""
        rows = []
        for i in indices:
            d = self.sampler(i)
            start = self.tables[d.source].start(d.sample)
            rows.append(self.sources[d.source].train.tokens[start : start + self.span.seq_len])
            if d.epoch:
                self.repeats[d.source] += 1
        return rows

    def indices(
        self, cursor: int, skips: list[tuple[int, int]], sequences: int | None = None
    ) -> tuple[list[int], int]:
        """The global sample indices of the step starting at `cursor`, and the next cursor. `sequences`: the step's
        global batch in sequences (default: the stage's first)."""
        return next_indices(cursor, sequences or self.span.sequences_per_step, skips)

    def step_batches(
        self,
        cursor: int,
        rank: int,
        world: int,
        skips: list[tuple[int, int]] | None = None,
        sequences: int | None = None,
    ) -> Drawn:
        """The micro batches this rank trains on for one optimizer step.

        Args:
            cursor: the stage's next global sample index.
            skips: this stage's skipped (first, last) sample ranges.
            sequences: the step's global batch in sequences (a batch schedule changes it; default: the stage's
                first). The stream of samples is the same at any size: a bigger batch takes the next ones sooner.

        Returns:
            the rank's micro batches, the new cursor, and the samples the whole step consumed.
        """
        idx, new_cursor = self.indices(cursor, skips or [], sequences)
        per_rank = len(idx) // world
        mine = idx[rank * per_rank : (rank + 1) * per_rank]
        rows = self.rows_for(mine)
        mb = self.span.micro_batch_size
        stacked = [np.stack(rows[j : j + mb]) for j in range(0, len(rows), mb)]
        if self.vocab is not None and max(int(x.max()) for x in stacked) >= self.vocab:  # numpy, before any tensor
            self._foreign_id(mine, rows)
        return Drawn([torch.from_numpy(x.astype(np.int64)) for x in stacked], new_cursor, (idx[0], idx[-1]))

    def _foreign_id(self, indices: list[int], rows: list[np.ndarray]) -> None:
        for i, row in zip(indices, rows, strict=True):
            if row.size and int(row.max()) >= self.vocab:
                d = self.sampler(i)
                at = self.tables[d.source].start(d.sample) + int(np.argmax(row >= self.vocab))
                path, pos = self.sources[d.source].train.tokens.file_of(at)
                raise DataError(
                    f"{path}: token id {int(row.max())} at token {pos} (data.sources.{d.source}, training sample {i}) "
                    f"is beyond the model's {self.vocab} ids: a corrupted or foreign token file; prepare it again"
                )


def validation_batches(
    sources: dict[str, SourceData],
    names: list[str],
    seq_len: int,
    micro: int,
    max_batches: int,
    vocab: int | None = None,
) -> dict[str, list[torch.Tensor]]:
    """Fixed held-out micro batches per source (the first windows of its validation documents).

    Args:
        vocab: the model's vocabulary size: a token id at or beyond it is one line naming its file and position
            (checked once, on the numpy rows: the batches are the same at every eval)."""
    out = {}
    for name in names:
        val = sources[name].val
        n = min(val.num_windows(seq_len), micro * max_batches)
        if n == 0:
            # A short validation split still gets evaluated, on one shorter sequence.
            rows = [np.asarray(val.tokens[: max(2, len(val.tokens))])]
        else:
            rows = [val.window(j, seq_len) for j in range(n)]
        if vocab is not None:
            _check_rows(name, val, rows, seq_len, vocab)
        out[name] = [
            torch.from_numpy(np.stack(rows[j : j + micro]).astype(np.int64)) for j in range(0, len(rows), micro)
        ]
    return out


def _check_rows(name: str, val, rows: list[np.ndarray], seq_len: int, vocab: int) -> None:
    for j, row in enumerate(rows):
        if row.size and int(row.max()) >= vocab:
            at = j * seq_len + int(np.argmax(row >= vocab))
            where, pos = val.tokens.file_of(at) if hasattr(val.tokens, "file_of") else (f"data.sources.{name}", at)
            raise DataError(
                f"{where}: token id {int(row.max())} at token {pos} (data.sources.{name}, validation) is beyond the "
                f"model's {vocab} ids: a corrupted or foreign token file; prepare it again"
            )
