"""datatrove readers for a recipe's sources: one document stream per input file, with a stable document id.

A source is read as a list of files under one folder (local, `hf://`, or any fsspec URL), so datatrove's executors
can hand files to tasks and a preparation can resume file by file:

- `files` and `python_stdlib` sources: the files their globs match, under their common folder or the stdlib.
- `hub` sources: the data files the dataset's config lists (parquet or jsonl on the hub, read as `hf://` paths), so
  a hub dataset is prepared exactly like a local one. A dataset without data files (a loading script) is streamed
  through datatrove's `HuggingFaceDatasetReader` in one task.

Our readers differ from datatrove's stock ones in one way: bad input is an error naming the source, file and line,
not a warning and a skipped line (a silently shorter dataset is worse than a stopped preparation).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from datatrove.pipeline.readers import CSVReader, ParquetReader
from datatrove.pipeline.readers.base import BaseDiskReader

from ..errors import DataError, first_line
from ..recipe.sections import SourceSection
from .sources import resolve_files, stdlib_dir

_FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".csv": "csv"}


@dataclass(frozen=True)
class SourceFiles:
    """The input files of a source: `folder` (a local path or fsspec URL) and paths relative to it, sorted."""

    folder: str
    paths: list[str]
    fmt: str
    """`jsonl`, `parquet`, `csv`, or `text` (each file is one document)."""


def source_files(name: str, src: SourceSection) -> SourceFiles:
    """The sorted input files of a source (see the module docstring)."""
    if src.type == "hub":
        return _hub_files(name, src)
    files = resolve_files(name, src)
    # The folder that holds them all (globs may be absolute, or climb out of the working directory).
    root = (
        stdlib_dir() if src.type == "python_stdlib" else Path(os.path.commonpath([p.resolve().parent for p in files]))
    )
    paths = [os.path.relpath(p.resolve(), root) for p in files]
    exts = {p.suffix for p in files}
    fmts = {_FORMATS.get(e, "text") for e in exts}
    if len(fmts) > 1:
        raise DataError(f"data.sources.{name}.include: mixes file formats {sorted(exts)}; use one source each")
    return SourceFiles(str(root), paths, fmts.pop())


def _hub_files(name: str, src: SourceSection) -> SourceFiles:
    """The data files of a hub dataset's config and split, as `hf://` paths (needs the network or the HF cache)."""
    import datasets

    try:
        builder = datasets.load_dataset_builder(src.path, src.name)
    except Exception as e:  # offline, a wrong id or config: the user needs the source name and the reason
        raise DataError(f"data.sources.{name}: cannot resolve hub dataset {src.path!r}: {first_line(e)}") from None
    files = (builder.config.data_files or {}).get(src.split)
    if not files:
        return SourceFiles(f"hf://datasets/{src.path}", ["stream"], "hub-stream")  # one task reads it all
    files = sorted(str(f) for f in files)
    scheme, _, _ = files[0].rpartition("://")
    bare = [f.split("://", 1)[-1] for f in files]  # commonpath would fold "hf://" into "hf:/"
    common = os.path.commonpath(bare) if len(bare) > 1 else os.path.dirname(bare[0])
    folder = f"{scheme}://{common}" if scheme else common
    exts = {_FORMATS.get(Path(f.split("?")[0]).suffix, "") for f in files}
    if len(exts) != 1 or "" in exts or "csv" in exts:
        raise DataError(f"data.sources.{name}: hub data files of types {sorted(exts)}; expected parquet or jsonl")
    return SourceFiles(folder, [b[len(common) :].lstrip("/") for b in bare], exts.pop())


def _checked_adapter(source: str):
    """A datatrove adapter that keeps the dataset's own `id` (else file/line) and rejects non-text values."""

    def adapter(self, data: dict, path: str, id_in_file: int | str) -> dict:
        if self.text_key not in data:
            raise DataError(
                f"data.sources.{source}.text_field: {self.text_key!r} not in the rows of {path} "
                f"(fields: {sorted(data)})"
            )
        text = data.pop(self.text_key)
        if text is not None and not isinstance(text, str):
            raise DataError(
                f"data.sources.{source}.text_field: {self.text_key!r} holds {type(text).__name__} values, not text "
                f"({path}, document {int(id_in_file) + 1 if str(id_in_file).isdigit() else id_in_file})"
            )
        doc_id = data.get(self.id_key)
        return {
            "text": text or "",
            "id": str(doc_id) if doc_id is not None else f"{path}/{id_in_file}",
            "metadata": {"file": path},
        }

    return adapter


def not_utf8(data: bytes, e: UnicodeDecodeError) -> str:
    """What is wrong with a line, for the error naming its file and line."""
    return f"is not UTF-8 (byte {data[e.start : e.start + 1]!r} at offset {e.start}; Latin-1 or binary?): re-encode it"


class StrictJsonlReader(BaseDiskReader):
    """One document per line; a line that is not JSON stops the read with its file and line number."""

    name = "jsonl (strict)"

    def read_file(self, filepath: str):
        with self.data_folder.open(filepath, "rb", compression="infer") as f:  # bytes: decoded per line, below
            for li, raw in enumerate(f):
                try:
                    row = json.loads(raw.decode("utf-8"))
                except UnicodeDecodeError as e:
                    raise DataError(f"{self.source}: {filepath}: line {li + 1} {not_utf8(raw, e)}") from None
                except json.JSONDecodeError as e:
                    raise DataError(f"{self.source}: {filepath}: line {li + 1} is not JSON ({e})") from None
                if not isinstance(row, dict):
                    raise DataError(f"{self.source}: {filepath}: line {li + 1} is {type(row).__name__}, not an object")
                if doc := self.get_document_from_dict(row, filepath, li):
                    yield doc


class WholeFileReader(BaseDiskReader):
    """Each file is one document (source code, plain text)."""

    name = "whole file"

    def read_file(self, filepath: str):
        with self.data_folder.open(filepath, "rb") as f:
            data = f.read()
        if b"\x00" in data:  # a binary file among the text: training on it would teach noise
            raise DataError(f"{self.source}: {filepath}: is binary (a NUL byte at offset {data.index(0)}), not text")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            line = data.count(b"\n", 0, e.start) + 1
            raise DataError(f"{self.source}: {filepath}: line {line} {not_utf8(data, e)}") from None
        if doc := self.get_document_from_dict({"text": text}, filepath, 0):
            yield doc


def make_reader(name: str, src: SourceSection, files: SourceFiles, paths_file: str, limit: int = -1):
    """The datatrove reader of a source over the files listed in `paths_file` (relative to `files.folder`)."""
    if files.fmt == "hub-stream":
        from datatrove.pipeline.readers import HuggingFaceDatasetReader

        return HuggingFaceDatasetReader(
            src.path,
            {"name": src.name, "split": src.split},
            streaming=True,
            text_key=src.text_field,
            limit=limit,
            adapter=_checked_adapter(name),
        )
    cls = {"jsonl": StrictJsonlReader, "parquet": ParquetReader, "csv": CSVReader, "text": WholeFileReader}[files.fmt]
    text_key = "text" if files.fmt == "text" else src.text_field
    reader = cls(files.folder, paths_file=paths_file, limit=limit, text_key=text_key, adapter=_checked_adapter(name))
    reader.source = f"data.sources.{name}"
    return reader


@contextlib.contextmanager
def read_errors(name: str) -> Iterator[None]:
    """Turn a library's read error (broken parquet, bad gzip, ...) into our one-line error naming the source."""
    try:
        yield
    except DataError:
        raise
    except Exception as e:  # pyarrow, fsspec and datasets raise many types
        raise DataError(f"data.sources.{name}: cannot read: {type(e).__name__}: {first_line(e)}") from None


def iter_documents(name: str, src: SourceSection, paths_file: str | None = None) -> Iterator:
    """All documents (datatrove `Document`s) of a source in file order, read in this process."""
    import tempfile

    from datatrove.utils.logging import logger

    logger.disable("datatrove")  # read in-process: datatrove's per-file log lines are noise here
    files = source_files(name, src)
    with tempfile.TemporaryDirectory() as tmp:
        if paths_file is None:
            paths_file = os.path.join(tmp, "paths.txt")
            Path(paths_file).write_text("".join(p + "\n" for p in files.paths))
        reader = make_reader(name, src, files, paths_file, limit=src.max_documents or -1)
        with read_errors(name):
            yield from reader.run(None, 0, 1)


def read_documents(name: str, src: SourceSection) -> list[str]:
    """The texts of a source, in file order (small sources and tests; preparation streams instead)."""
    docs = [d.text for d in iter_documents(name, src)]
    if not docs:
        raise DataError(f"data.sources.{name}: no documents with text")
    return docs
