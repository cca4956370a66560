"""Tokenize a source into token files on datatrove: streamed, one output per input file, resumable, no merge.

Layout under `data.cache_dir/tokens/<source>-<source key>-<tokenizer>/`:

    tokenizer.json                       the tokenizer the files were made with (the workers load it)
    files/00000/{train.ds, train.ds.index, val.ds, val.ds.index, done.json}    one per input file, atomic
    logs/<attempt>/                      datatrove's logs and stats
    manifest.json                        written last: per-file and total tokens and documents, dtype, timing

`*.ds` are datatrove's token files (little-endian uint16/uint32, EOS after every document) and `*.ds.index` the
document ends (uint64). The trainer memory-maps them as they are (`tokenfiles.py`).

Memory per worker is O(batch of documents + the document ends of one file), whatever the source's size: documents
stream from datatrove's reader through the tokenizer to disk. A batch holds at most `BATCH_CHARS` of text, and a
document longer than `PIECE_CHARS` is tokenized piece by piece (`text_pieces`), so one huge document costs its own
text plus one piece's encoding, not ~190x its size (a tokenizer's encoding keeps tokens, offsets and masks). Output is named by the input file's position in the
sorted file list, and a document is held out for validation by a hash of its id, so the tokens and the split do not
depend on how many tasks ran or in which order they finished.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from datatrove.io import get_shard_from_paths_file
from datatrove.utils.tokenization import PipelineStepWithTokenizer

from ..errors import DataError
from ..faults import kill_point
from ..files import atomic_write_json
from ..recipe.sections import SourceSection
from .readers import SourceFiles, make_reader, read_errors, source_files
from .tokens import token_dtype

if TYPE_CHECKING:  # annotations only: the workers unpickle this module's step and need neither torch nor transformers
    from transformers import PreTrainedTokenizerBase

MANIFEST = "manifest.json"
PIECE_CHARS = 1 << 18
"""Longest text handed to the tokenizer at once (characters). Measured on a 6.4 MB document: 256 Ki-character pieces
peak at +84 MB, 1 Mi at +318 MB (bench_prepare.py --huge-mb)."""
BATCH_CHARS = 8 << 20
"""Most text per batch of documents encoded together (characters)."""


def text_pieces(text: str, limit: int = PIECE_CHARS):
    """`text` in pieces of at most `limit` characters, each cut where a run of whitespace starts (a line break
    first, else a space or tab; a text without whitespace where the limit falls). A byte-level BPE tokenizer's
    pre-tokenizer (GPT-2's pattern) splits there too, whitespace run and all, so the pieces' tokens are the whole
    text's (tested); a text within `limit` is one piece."""
    start = 0
    while len(text) - start > limit:
        end = start + limit
        cut = next((c for c in (_run_start(text, start, end, ws) for ws in "\n \t") if c is not None), end)
        yield text[start:cut]
        start = cut
    yield text[start:]


def _run_start(text: str, start: int, end: int, ws: str) -> int | None:
    """The last i in (start, end] with text[i] == ws and text[i - 1] not whitespace."""
    i = text.rfind(ws, start + 1, end + 1)
    while i > start and text[i - 1].isspace():
        i = text.rfind(ws, start + 1, i)
    return i if i > start else None


def text_batches(docs, count: int = 1000, chars: int = BATCH_CHARS):
    """Documents in batches of at most `count`, and at most `chars` of text unless one document alone is longer."""
    batch, size = [], 0
    for d in docs:
        if batch and (len(batch) == count or size + len(d.text) > chars):
            yield batch
            batch, size = [], 0
        batch.append(d)
        size += len(d.text)
    if batch:
        yield batch


def held_out(doc_id: str, fraction: float) -> bool:
    """Whether a document belongs to the validation split: a hash of its id, the same on every machine."""
    h = int.from_bytes(hashlib.blake2b(doc_id.encode(), digest_size=8).digest(), "little")
    return h < fraction * 2**64


def in_validation(doc_id: str, first_of_source: bool, fraction: float) -> bool:
    """The split rule, for the token files and the tokenizer's corpus alike: held out by `held_out`, and the
    source's first document always (so even a tiny source has a validation set)."""
    return first_of_source or held_out(doc_id, fraction)


class FileWriter:
    """The train and validation token files of one input file, written into a temporary directory and renamed."""

    def __init__(self, files_dir: Path, index: int, dtype: np.dtype):
        from datatrove.pipeline.tokens.tokenizer import TokenizedFile

        self.final = files_dir / f"{index:05d}"
        self.tmp = files_dir / f"{index:05d}.tmp{os.getpid()}"
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True)
        self.dtype, self.index = dtype, index
        self.parts = {s: TokenizedFile(str(self.tmp), f"{s}.ds", token_size=dtype.itemsize) for s in ("train", "val")}
        self.docs = {"train": 0, "val": 0}

    def add(self, ids: list[int], split: str, end: bool = True) -> None:
        """A document's tokens; `end=False`: a piece of one, more to come (no document end is recorded)."""
        self.parts[split].write_bytes(np.asarray(ids, dtype=self.dtype).tobytes(), doc_ends=None if end else [])
        self.docs[split] += end

    def finish(self, path: str) -> None:
        counts = {"file": path}
        for split, f in self.parts.items():
            f.close()
            counts[f"{split}_docs"], counts[f"{split}_tokens"] = self.docs[split], len(f)
        (self.tmp / "done.json").write_text(json.dumps(counts))
        shutil.rmtree(self.final, ignore_errors=True)
        self.tmp.rename(self.final)
        kill_point("prepare_file")  # drills: PRETRAINER_KILL_AT=prepare_file#3 dies after the third file


class SplitTokenizer(PipelineStepWithTokenizer):
    """A datatrove step: tokenize each document (no special tokens, then EOS) into its input file's train or
    validation token file. One task's files are written one after another, in the order the reader yields them."""

    name = "split tokenizer"
    type = "🔢 - TOKENIZER"

    def __init__(self, out_dir: str, files: SourceFiles, paths_file: str, fraction: float, eos_id: int, vocab: int):
        super().__init__(str(Path(out_dir) / "tokenizer.json"))
        self.out_dir, self.paths_file, self.fraction = out_dir, paths_file, fraction
        self.index = {p: i for i, p in enumerate(files.paths)}
        self.eos_id, self.dtype = eos_id, token_dtype(vocab)

    def write_piece(self, writer: FileWriter, piece: str, split: str) -> int:
        """Encode and write one piece of a document; returns its token count. A function of its own on purpose: the
        piece's list of ids must be freed before the next piece is encoded. Kept alive across that encode, the
        tokenizer's large buffers land above it on the heap, which then cannot shrink: memory grew ~110 MB per
        1 Mi-character piece (measured), the very growth pieces exist to prevent."""
        ids = self.tokenizer.encode(piece, add_special_tokens=False).ids
        writer.add(ids, split, end=False)
        return len(ids)

    def run(self, data, rank: int = 0, world_size: int = 1):
        files_dir = Path(self.out_dir) / "files"
        mine = list(get_shard_from_paths_file(self.paths_file, rank, world_size))
        writer, current, finished = None, None, set()  # input file indices
        for batch in text_batches(data):
            short = [d.text for d in batch if len(d.text) <= PIECE_CHARS]
            encoded = iter(self.tokenizer.encode_batch(short, add_special_tokens=False))
            for doc in batch:
                path = doc.metadata.get("file", "")
                if path != current:
                    if writer is not None:
                        writer.finish(current)
                        finished.add(writer.index)
                    writer, current = FileWriter(files_dir, self.index.get(path, 0), self.dtype), path
                first = writer.index == 0 and sum(writer.docs.values()) == 0
                split = "val" if in_validation(doc.id, first, self.fraction) else "train"
                if len(doc.text) <= PIECE_CHARS:
                    ids = next(encoded).ids
                    writer.add(ids + [self.eos_id], split)
                    self.stat_update("tokens", value=len(ids) + 1)
                    continue
                for piece in text_pieces(doc.text):  # one huge document: bounded memory, the same tokens
                    self.stat_update("tokens", value=self.write_piece(writer, piece, split))
                writer.add([self.eos_id], split)
                self.stat_update("tokens", value=1)
        if writer is not None:
            writer.finish(current)
            finished.add(writer.index)
        for path in mine:  # files without any document (empty, or after `max_documents`) are finished too
            if self.index.get(path, 0) not in finished:
                FileWriter(files_dir, self.index.get(path, 0), self.dtype).finish(path)


def file_done(out_dir: Path, index: int) -> dict | None:
    f = Path(out_dir) / "files" / f"{index:05d}" / "done.json"
    return json.loads(f.read_text()) if f.exists() else None


def read_manifest(out_dir: Path) -> dict | None:
    f = Path(out_dir) / MANIFEST
    return json.loads(f.read_text()) if f.exists() else None


def prepare_source(
    name: str,
    src: SourceSection,
    tokenizer: PreTrainedTokenizerBase,
    out_dir: Path,
    validation_fraction: float,
    executor: str = "inline",
    tasks: int | None = None,
    workers: int = 1,
    slurm: dict | None = None,
) -> dict | None:
    """Tokenize a source into `out_dir` (see the module docstring), skipping input files finished earlier.

    Args:
        executor: `inline` (this process, no pool: the trainer's path for small sources), `local` (datatrove's
            LocalPipelineExecutor, `workers` processes) or `slurm` (datatrove's SlurmPipelineExecutor; `slurm`
            holds its settings, e.g. partition and time). `tasks` defaults to one per input file.

    Returns:
        The manifest, or None when the work was submitted to Slurm and is not finished yet.
    """
    out_dir = Path(out_dir)
    if manifest := read_manifest(out_dir):
        return manifest
    t0 = time.perf_counter()
    files = source_files(name, src)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.backend_tokenizer.save(str(out_dir / "tokenizer.json"))
    if src.max_documents:  # a global limit in file order is one sequential read: redo it whole (it is small)
        shutil.rmtree(out_dir / "files", ignore_errors=True)
    todo = [p for i, p in enumerate(files.paths) if file_done(out_dir, i) is None]
    if todo:
        attempt = out_dir / "logs" / time.strftime("%Y%m%d-%H%M%S")
        attempt.mkdir(parents=True, exist_ok=True)
        paths_file = str(attempt / "paths.txt")
        Path(paths_file).write_text("".join(p + "\n" for p in todo))
        one_task = src.max_documents or files.fmt == "hub-stream"
        n_tasks = 1 if one_task else max(1, min(tasks or len(todo), len(todo)))
        reader = make_reader(name, src, files, paths_file, limit=src.max_documents or -1)
        step = SplitTokenizer(
            str(out_dir), files, paths_file, validation_fraction, tokenizer.eos_token_id, len(tokenizer)
        )
        if not _run([reader, step], executor, n_tasks, workers, attempt, slurm, name):
            return None
    return _write_manifest(name, files, out_dir, tokenizer, time.perf_counter() - t0)


def _run(pipeline: list, executor: str, tasks: int, workers: int, logs: Path, slurm: dict | None, name: str) -> bool:
    """Run the pipeline; False when it was only submitted (Slurm)."""
    if executor == "inline":
        from datatrove.utils.logging import logger

        logger.disable("datatrove")
        with read_errors(name):
            for rank in range(tasks):
                data = None
                for step in pipeline:
                    data = step.run(data, rank, tasks)
                if data is not None:
                    deque(data, maxlen=0)
        return True
    if executor == "local":
        from datatrove.executor import LocalPipelineExecutor

        with read_errors(name):
            LocalPipelineExecutor(pipeline, tasks=tasks, workers=min(workers, tasks), logging_dir=str(logs)).run()
        return True
    if executor == "slurm":
        from datatrove.executor import SlurmPipelineExecutor

        settings = {"time": "12:00:00", "job_name": f"prepare-{name}", **(slurm or {})}
        if "partition" not in settings:
            raise DataError("--slurm: partition=NAME is required with --executor slurm")
        try:
            executor = SlurmPipelineExecutor(pipeline, tasks=tasks, workers=workers, logging_dir=str(logs), **settings)
        except TypeError as e:  # an unknown setting: name it, with where the valid ones are listed
            raise DataError(f"--slurm: {e} (see datatrove's SlurmPipelineExecutor for the settings)") from None
        executor.run()
        return False
    raise DataError(f"--executor: {executor!r} is not one of inline, local, slurm")


def _write_manifest(name: str, files: SourceFiles, out_dir: Path, tokenizer, seconds: float) -> dict | None:
    per_file = [file_done(out_dir, i) for i in range(len(files.paths))]
    if any(f is None for f in per_file):
        return None  # some task did not finish (Slurm still running, or a task failed): rerun to complete
    totals = {k: sum(f[k] for f in per_file) for k in ("train_docs", "train_tokens", "val_docs", "val_tokens")}
    if totals["train_docs"] + totals["val_docs"] == 0:
        raise DataError(f"data.sources.{name}: no documents with text")
    if totals["train_docs"] == 0 or totals["val_docs"] == 0:
        raise DataError(f"data.sources.{name}: needs at least 2 documents, one of them held out for validation")
    manifest = {
        "source": name,
        "dtype": str(token_dtype(len(tokenizer))),
        "files": len(per_file),
        "docs": totals["train_docs"] + totals["val_docs"],
        "tokens": totals["train_tokens"] + totals["val_tokens"],
        **totals,
        "seconds": round(seconds, 3),
        "per_file": per_file,
    }
    atomic_write_json(out_dir / MANIFEST, manifest)  # last: a directory without a manifest is unfinished
    return manifest
