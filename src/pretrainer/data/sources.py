"""Which files a source is, and its cache key (the documents themselves are read by `readers.py`)."""

from __future__ import annotations

import glob
import hashlib
import json
import sysconfig
from pathlib import Path

from ..errors import DataError
from ..recipe.sections import SourceSection


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
