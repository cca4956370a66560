"""Read a source's documents with `datasets`: local files, hub datasets, or the Python stdlib's own source."""

from __future__ import annotations

import glob
import hashlib
import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from ..errors import DataError
from ..sections import SourceSection

_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def stdlib_dir() -> Path:
    """The standard library directory of the running Python: text every machine with Python has."""
    return Path(sysconfig.get_paths()["stdlib"])


def resolve_files(name: str, src: SourceSection) -> list[Path]:
    """The sorted file list of a `files` or `python_stdlib` source; a pattern that matches nothing is an error."""
    root = stdlib_dir() if src.type == "python_stdlib" else Path(".")
    files: set[Path] = set()
    for pattern in src.include:
        hits = [Path(p) for p in glob.glob(str(root / pattern), recursive=True)]
        hits = [p for p in hits if p.is_file()]
        if not hits:
            raise DataError(f"data.sources.{name}.include: {pattern!r} matches no files under {root.resolve()}")
        files.update(hits)
    for pattern in src.exclude:
        files.difference_update(Path(p) for p in glob.glob(str(root / pattern), recursive=True))
    out = sorted(files)
    if not out:
        raise DataError(f"data.sources.{name}: no files left after `exclude`")
    return out


def source_key(name: str, src: SourceSection) -> str:
    """A content key for caching: the source's config plus, for local files, each file's path, size and mtime."""
    spec: dict = {"name": name, "source": src.model_dump()}
    if src.type in ("files", "python_stdlib"):
        spec["files"] = [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in resolve_files(name, src)]
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def read_documents(name: str, src: SourceSection) -> list[str]:
    """All documents of a source, in a fixed order (see `iter_documents`)."""
    docs = list(iter_documents(name, src))
    if not docs:
        raise DataError(f"data.sources.{name}: no documents with text")
    return docs


def iter_documents(name: str, src: SourceSection) -> Iterator[str]:
    """The documents of a source, in a fixed order, streamed (hub sources never sit whole in memory).

    Raises:
        DataError: the source is missing, unreadable, or lacks its text field.
    """
    import datasets

    datasets.disable_progress_bars()
    try:
        if src.type == "hub":
            ds = datasets.load_dataset(src.path, src.name, split=src.split, streaming=src.streaming)
        else:
            files = [str(p) for p in resolve_files(name, src)]
            exts = {Path(f).suffix for f in files}
            fmt = {_FORMATS.get(e, "text") for e in exts}
            if len(fmt) > 1:
                raise DataError(f"data.sources.{name}.include: mixes file formats {sorted(exts)}; use one source each")
            fmt = fmt.pop()
            kwargs = {"sample_by": "document"} if fmt == "text" else {}
            ds = datasets.load_dataset(fmt, data_files=files, split="train", **kwargs)
    except DataError:
        raise
    except Exception as e:  # datasets raises many types; the user needs the source name and the reason
        raise DataError(f"data.sources.{name}: cannot read: {type(e).__name__}: {str(e).splitlines()[0]}") from None
    field = "text" if src.type != "hub" and fmt == "text" else src.text_field
    count = 0
    for row in ds:
        if field not in row:
            raise DataError(f"data.sources.{name}.text_field: {field!r} not in the rows (fields: {sorted(row)})")
        text = row[field]
        if text:
            yield text
            count += 1
        if src.max_documents and count >= src.max_documents:
            return
