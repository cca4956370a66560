"""Which files a source is, and its cache key (the documents themselves are read by `readers.py`)."""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sysconfig
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import DataError
from ..recipe.sections import SourceSection

if TYPE_CHECKING:
    from ..recipe.schema import Recipe


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


DIGESTS = "file_digests.json"
"""Under `data.cache_dir`: each local file's content hash with the stat identity it was taken at."""
RACY_S = 2.0
"""A hash taken less than this after the file's last change is not trusted later: a same-size edit within a coarse
timestamp's tick (1 s on some network filesystems) would keep every stat field (git's "racy" rule)."""


class DigestCache:
    """Content hashes of local files, re-hashed only when a file's stat identity changed: size, mtime, ctime and
    inode (with the path). A copy that kept size and mtime (cp -p, rsync -a, tar) is a new inode with a new ctime, and nothing
    short of the system clock sets ctime back, so an unchanged identity is unchanged content. Kept in one JSON file
    (written atomically when something new was hashed), so a restart stats every file instead of reading them all
    (1 TB: ~30 CPU-minutes of hashing per start, per rank); the main process hashes first, the other ranks read."""

    def __init__(self, path: Path | None):
        self.path, self.entries, self.dirty = path, {}, False
        if path is not None and path.exists():
            try:
                self.entries = json.loads(path.read_text())
            except (OSError, ValueError):
                self.entries = {}  # a damaged cache is only a cold one

    def digest(self, path: Path) -> str:
        st = path.stat()
        ident = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]  # not st_dev: NFS clients number it apart
        key = str(path.resolve())
        e = self.entries.get(key)
        if (
            isinstance(e, dict)
            and e.get("stat") == ident
            and e.get("hashed_at", 0) > max(st.st_mtime, st.st_ctime) + RACY_S
        ):
            return e["digest"]
        now = time.time()
        d = file_digest(path)
        self.entries[key] = {"stat": ident, "digest": d, "hashed_at": now}
        self.dirty = True
        return d

    def save(self) -> None:
        if self.path is None or not self.dirty:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
            tmp.write_text(json.dumps(self.entries))
            os.replace(tmp, self.path)
            self.dirty = False
        except OSError:
            pass  # a read-only cache directory: the next start hashes again, nothing is wrong


def source_key(name: str, src: SourceSection, cache_dir: str | Path | None = None, **settings) -> str:
    """A content key for caching: the source's config, every setting that changes its arrays (`settings`, e.g. the
    validation fraction) and, for local files, each file's path and content hash (re-hashed only when its stat
    identity changed, with `cache_dir`: `DigestCache`)."""
    spec: dict = {"name": name, "source": src.model_dump(), "settings": settings}
    if src.type in ("files", "python_stdlib"):
        cache = DigestCache(Path(cache_dir) / DIGESTS if cache_dir is not None else None)
        try:
            spec["files"] = [(str(p), cache.digest(p)) for p in resolve_files(name, src)]
        except OSError as e:
            raise DataError(f"data.sources.{name}: cannot read {e.filename}: {e.strerror}") from None
        cache.save()
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def used_sources(recipe: Recipe) -> list[str]:
    """Sources named with a positive weight in some stage's mixture, in definition order."""
    used = {n for st in recipe.stages for n, w in st.mixture.items() if w > 0}
    return [n for n in recipe.data.sources if n in used]


def key_settings(recipe: Recipe) -> dict:
    """What `source_key` needs beside the source: the settings that change its arrays, and the digest cache's home."""
    return {"validation_fraction": recipe.data.validation_fraction, "cache_dir": recipe.data.cache_dir}


def prepared_tokens(recipe: Recipe) -> dict[str, int]:
    """Training tokens of each used source that is prepared, found without loading the tokenizer (a hub tokenizer
    needs the network): the newest prepared directory with the source's content key. Unprepared sources are absent."""
    out = {}
    for name in used_sources(recipe):
        key = source_key(name, recipe.data.sources[name], **key_settings(recipe))
        found = sorted(
            Path(recipe.data.cache_dir, "tokens").glob(f"{name}-{key}-*/manifest.json"),
            key=lambda p: p.stat().st_mtime,
        )
        if found:
            out[name] = int(json.loads(found[-1].read_text())["train_tokens"])
    return out
