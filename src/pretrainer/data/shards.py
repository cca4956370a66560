"""Tokenize a source into memory-mapped token files, in shards of documents, in parallel, resumably.

Layout under `data.cache_dir/tokens/<source>-<source key>-<tokenizer>/`:

    shards/shard_00000/{tokens.npy, doc_offsets.npy, meta.json}   one per `shard_docs` documents, atomic
    train/{tokens.npy, doc_offsets.npy, meta.json}                 the merged training split (memory-mapped)
    val/  {tokens.npy, doc_offsets.npy, meta.json}                 held-out documents
    manifest.json                                                  written last: shards, tokens, dtype, timing

The trainer's on-the-fly path runs the same code with one worker, so both paths give identical arrays.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from ..errors import DataError
from .tokens import TokenArrays, load_arrays, save_arrays, split, tokenize

_WORKER_TOKENIZER: PreTrainedTokenizerBase | None = None


def _init_worker(tokenizer: PreTrainedTokenizerBase) -> None:
    global _WORKER_TOKENIZER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER_TOKENIZER = tokenizer


def _tokenize_shard(args: tuple[list[str], str]) -> tuple[str, int, int]:
    docs, out = args
    arr = tokenize(docs, _WORKER_TOKENIZER)
    save_arrays(arr, Path(out), {"docs": arr.n_docs, "tokens": len(arr.tokens)})
    return out, arr.n_docs, len(arr.tokens)


def _chunks(docs: Iterable[str], size: int) -> Iterator[list[str]]:
    it = iter(docs)
    while chunk := list(itertools.islice(it, size)):
        yield chunk


def _tokenize_shards(
    name, docs, tokenizer, shard_root: Path, workers: int, shard_docs: int, progress: bool
) -> list[str]:
    """Tokenize `docs` in chunks of `shard_docs` into shard directories; returns their paths (finished ones from an
    earlier run are reused)."""
    shard_root.mkdir(parents=True, exist_ok=True)
    jobs, done = [], []
    for i, chunk in enumerate(_chunks(docs, shard_docs)):
        path = shard_root / f"shard_{i:05d}"
        if (path / "meta.json").exists():
            done.append(str(path))  # resumed: this shard was finished by an earlier run
        else:
            jobs.append((chunk, str(path)))
    bar = tqdm(total=len(jobs) + len(done), initial=len(done), desc=f"tokenize {name}", disable=not progress)
    if workers > 1 and len(jobs) > 1:
        with ProcessPoolExecutor(workers, initializer=_init_worker, initargs=(tokenizer,)) as pool:
            for out, *_ in pool.map(_tokenize_shard, jobs):
                done.append(out)
                bar.update(1)
    else:
        _init_worker(tokenizer)
        for job in jobs:
            done.append(_tokenize_shard(job)[0])
            bar.update(1)
    bar.close()
    return done


def prepare_source(
    name: str,
    docs: Iterable[str],
    tokenizer: PreTrainedTokenizerBase,
    out_dir: Path,
    validation_fraction: float,
    workers: int = 1,
    shard_docs: int = 2000,
    progress: bool = False,
) -> dict:
    """Tokenize `docs` into `out_dir` (see the module docstring); finished shards are kept and reused.

    Returns:
        The manifest (also written to `out_dir/manifest.json`).
    """
    out_dir = Path(out_dir)
    if (out_dir / "manifest.json").exists():
        return json.loads((out_dir / "manifest.json").read_text())
    t0 = time.perf_counter()
    done = _tokenize_shards(name, docs, tokenizer, out_dir / "shards", workers, shard_docs, progress)
    if not done:
        raise DataError(f"data.sources.{name}: no documents with text")
    shards = [load_arrays(Path(p)) for p in sorted(done)]
    merged = _concat(shards)
    if merged.n_docs < 2:
        raise DataError(f"data.sources.{name}: needs at least 2 documents, one of them held out for validation")
    train, val = split(merged, validation_fraction)
    meta = {"source": name, "dtype": str(merged.tokens.dtype)}
    for part, arr in (("train", train), ("val", val)):
        shutil.rmtree(out_dir / part, ignore_errors=True)
        save_arrays(arr, out_dir / part, {**meta, "split": part, "docs": arr.n_docs, "tokens": len(arr.tokens)})
    seconds = time.perf_counter() - t0
    manifest = {
        **meta,
        "shards": len(shards),
        "docs": merged.n_docs,
        "tokens": len(merged.tokens),
        "train_tokens": len(train.tokens),
        "val_tokens": len(val.tokens),
        "seconds": round(seconds, 3),
        "tokens_per_s": round(len(merged.tokens) / max(seconds, 1e-9)),
    }
    tmp = out_dir / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=1))
    tmp.rename(out_dir / "manifest.json")  # last: a directory without a manifest is unfinished
    return manifest


def _concat(parts: list[TokenArrays]) -> TokenArrays:
    tokens = np.concatenate([np.asarray(p.tokens) for p in parts])
    offsets, base = [np.zeros(1, dtype=np.int64)], 0
    for p in parts:
        offsets.append(np.asarray(p.doc_offsets[1:], dtype=np.int64) + base)
        base += len(p.tokens)
    return TokenArrays(tokens, np.concatenate(offsets))
