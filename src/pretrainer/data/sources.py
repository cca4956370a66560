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


def file_digest(path: Path) -> str:
    """A fast hash of a file's bytes (BLAKE2b, about 1 GB/s per core): a copy that kept size and mtime (cp -p,
    rsync -a, tar) but changed its content gets a new key."""
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def source_key(name: str, src: SourceSection, **settings) -> str:
    """A content key for caching: the source's config, every setting that changes its arrays (`settings`, e.g. the
    validation fraction) and, for local files, each file's path and content hash."""
    spec: dict = {"name": name, "source": src.model_dump(), "settings": settings}
    if src.type in ("files", "python_stdlib"):
        try:
            spec["files"] = [(str(p), file_digest(p)) for p in resolve_files(name, src)]
        except OSError as e:
            raise DataError(f"data.sources.{name}: cannot read {e.filename}: {e.strerror}") from None
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
    datasets.logging.set_verbosity_error()  # our one-line error says it; the library's log lines before it do not
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
        if text is not None and not isinstance(text, str):
            raise DataError(
                f"data.sources.{name}.text_field: {field!r} holds {type(text).__name__} values, not text "
                f"(document {count + 1})"
            )
        if text:
            yield text
            count += 1
        if src.max_documents and count >= src.max_documents:
            return
