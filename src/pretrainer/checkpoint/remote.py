"""A copy of each verified checkpoint at `checkpoint.remote`, any fsspec URL (s3://, gs://, file://, a mounted
path), uploaded in the background by the main process; retention there follows the local rules; `--resume auto`
copies the newest remote checkpoint that verifies when the local directory has none (a replaced node).

Each run has its own directory there, `<remote>/<run_id>/step_N/`, and `<remote>/owner-<dir name>` names the run that
last started in a run directory of that name (`--output-dir`'s last component): a replaced node, whose directory is
empty, continues that run; another run's copies are never fetched, pruned or overwritten (checkpoint/identity.py).

Object stores have no atomic rename, so the remote protocol is "manifest last": a checkpoint's files are uploaded
first, its `manifest.json` after them; a remote directory without one is an unfinished upload, never fetched, and
removed by retention. A fetched checkpoint is verified (sizes and hashes) before anything resumes from it.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
from pathlib import Path

from tqdm.auto import tqdm

from ..errors import PretrainerError, first_line
from ..observe import events as ev
from . import format as ck


def _fs(url: str):
    import fsspec

    try:
        fs, root = fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as e:  # an unknown protocol, or its package (s3fs, gcsfs) not installed
        raise PretrainerError(f"checkpoint.remote: {url}: {first_line(e)}") from None
    return fs, root.rstrip("/")


def check_remote(url: str) -> None:
    """A remote whose protocol is unknown, or whose package is missing, is a recipe error (one line, at start)."""
    _fs(url)


def owner_file(run_dir: str | Path) -> str:
    """The file on the remote naming the run that last started in a run directory of this name (`owner-<name>`): a
    replaced node runs the same command with the same `--output-dir`, so it finds its run there; a branch or another
    run sharing the remote under another directory name has its own."""
    return "owner-" + re.sub(r"[^A-Za-z0-9._-]", "_", Path(run_dir).resolve().name or "run")


def run_url(url: str, run_id: str) -> str:
    """The run's own directory on the remote."""
    return f"{url.rstrip('/')}/{run_id}"


def remote_owner(url: str, run_dir: str | Path) -> str | None:
    """The id of the run that last started in a directory of `run_dir`'s name with this remote (None: none has).

    Raises:
        PretrainerError: the remote cannot be read at all (a replaced node must not start a new run unknowingly)."""
    fs, root = _fs(url)
    try:
        return _read_owner(fs, f"{root}/{owner_file(run_dir)}")
    except (OSError, UnicodeDecodeError) as e:
        raise PretrainerError(f"--resume auto: checkpoint.remote {url} cannot be read: {first_line(e)}") from None


def _read_owner(fs, path: str) -> str | None:
    try:
        return fs.cat_file(path).decode().strip() or None
    except FileNotFoundError:
        return None


def claim(url: str, run_dir: str | Path, run_id: str) -> str | None:
    """Name this run the owner of `run_dir`'s name on the remote; the previous owner (None: none). A failure is the
    caller's to report: the run's copies still go to its own directory."""
    fs, root = _fs(url)
    path = f"{root}/{owner_file(run_dir)}"
    if (before := _read_owner(fs, path)) != run_id:
        fs.makedirs(root, exist_ok=True)
        fs.pipe_file(path, run_id.encode())
    return before


def _remote_candidates(fs, root: str) -> tuple[list[ck.Candidate], list[str]]:
    """Finished remote checkpoints, oldest first, and unfinished ones (no manifest)."""
    done, unfinished = [], []
    try:
        dirs = [d for d in fs.ls(root, detail=False) if fs.isdir(d)]
    except FileNotFoundError:
        return [], []
    for d in dirs:
        name = d.rstrip("/").rsplit("/", 1)[-1]
        if not fs.exists(f"{d}/{ck.MANIFEST}"):
            unfinished.append(d)
            continue
        try:
            meta = json.loads(fs.cat_file(f"{d}/{ck.META}"))
        except (OSError, ValueError):
            continue
        if isinstance(meta, dict) and not ck.meta_problem(meta):
            done.append(ck.Candidate(Path(name), meta))
    return sorted(done, key=lambda c: (c.meta["step"], c.meta.get("saved_at", 0))), unfinished


class Uploader:
    """One background thread; while an upload runs, only the newest waiting checkpoint is kept (a slow link falls
    behind by skipping, never by stalling the run or queueing without bound)."""

    def __init__(self, url: str, section, log):
        """Args:
        url: the run's own directory on the remote (`run_url`)."""
        self.url, self.section, self.log = url, section, log
        self.cv = threading.Condition()
        self.pending: Path | None = None
        self.busy = False
        self.errors: list[str] = []
        self.failures, self.warned_at = 0, None
        self.thread = threading.Thread(target=self._loop, name="checkpoint-upload", daemon=True)
        self.thread.start()

    WARN_EVERY_S = 600.0
    """A failing remote is said on the console at its first failure, then at most once per this many seconds."""

    def _warn(self, path: Path, error: str) -> None:
        self.failures += 1
        now = time.monotonic()
        if self.warned_at is not None and now - self.warned_at < self.WARN_EVERY_S:
            return
        self.warned_at = now
        tqdm.write(  # above an open progress bar, after a newline: a line of its own in a log file too
            f"\nwarning: remote copy of {path.name} to {self.url} failed ({self.failures} so far; the local "
            f"checkpoints stand): {error.splitlines()[0][:300]}",
            file=sys.stderr,
        )

    def submit(self, path: Path) -> None:
        with self.cv:
            if self.pending is not None:
                self.log.event(ev.REMOTE_SKIP, 0, path=str(self.pending), reason="a newer checkpoint is waiting")
            self.pending = path
            self.cv.notify_all()

    def wait(self) -> None:
        """Until nothing is waiting or uploading (the end of a run)."""
        with self.cv:
            self.cv.wait_for(lambda: self.pending is None and not self.busy)

    def _loop(self) -> None:
        while True:
            with self.cv:
                self.cv.wait_for(lambda: self.pending is not None)
                path, self.pending, self.busy = self.pending, None, True
            try:
                n = upload(path, self.url)
                self.log.event(ev.REMOTE_UPLOAD, 0, path=str(path), url=self.url, bytes=n)
                for gone in prune_remote(self.url, self.section):
                    self.log.event(ev.REMOTE_PRUNE, 0, path=gone)
            except Exception as e:  # a failed upload must not kill the run; the local checkpoint stands
                error = f"{type(e).__name__}: {e}"
                self.log.event(ev.REMOTE_FAILED, 0, path=str(path), error=error)
                self._warn(path, error)
            finally:
                with self.cv:
                    self.busy = False
                    self.cv.notify_all()


def upload(path: Path, url: str) -> int:
    """Copy one local checkpoint to `url/<name>/`, the manifest last. Returns the bytes copied."""
    fs, root = _fs(url)
    dst = f"{root}/{path.name}"
    files = sorted(ck.list_files(path))  # the manifest is not listed: it goes last
    n = 0
    for rel in [*files, ck.MANIFEST]:
        target = f"{dst}/{rel}"
        fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
        fs.put_file(str(path / rel), target)
        n += (path / rel).stat().st_size
    return n


def prune_remote(url: str, section) -> list[str]:
    """Remote retention: the local rules (newest `keep_last`, milestones), and unfinished uploads but the newest."""
    fs, root = _fs(url)
    cands, unfinished = _remote_candidates(fs, root)
    keep = ck.to_keep(cands, section.keep_last, section.keep_every_tokens, ck.NOTHING)
    gone = [f"{root}/{c.path.name}" for c in cands if c.path not in keep]
    newest = cands[-1].meta["step"] if cands else -1
    gone += [d for d in unfinished if _step(d) is not None and _step(d) < newest]  # a newer one finished since
    for d in gone:
        fs.rm(d, recursive=True)
    return gone


def _step(d: str) -> int | None:
    name = d.rstrip("/").rsplit("/", 1)[-1]
    return int(name[5:]) if name.startswith("step_") and name[5:].isdigit() else None


def fetch_newest(url: str, root: Path, log, run_id: str | None = None) -> str | None:
    """Copy the newest remote checkpoint of `url` (a run's directory) that verifies and is `run_id`'s into `root`
    (atomically, as a save would); its name, or None.

    Raises:
        PretrainerError: the remote cannot be read (a replaced node must not start from scratch unknowingly)."""
    fs, rroot = _fs(url)
    try:
        cands, _ = _remote_candidates(fs, rroot)
    except OSError as e:
        raise PretrainerError(f"--resume auto: checkpoint.remote {url} cannot be listed: {first_line(e)}") from None
    for c in reversed(cands):
        name, src = c.path.name, f"{rroot}/{c.path.name}"
        if run_id is not None and c.meta.get("run_id") not in (None, run_id):
            log.event(ev.REMOTE_SKIP, 0, path=src, reason=f"a checkpoint of run {c.meta['run_id']}")
            continue
        tmp = Path(root) / f"{ck.TMP_PREFIX}{name}"
        ck.remove_dir(tmp) if tmp.exists() else None
        for f in fs.find(src):
            rel = f[len(src) + 1 :]  # fsspec lists paths without the protocol, as url_to_fs gave the root
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            fs.get_file(f, str(tmp / rel))
        if problems := ck.verify(tmp):
            log.event(ev.REMOTE_SKIP, 0, path=src, reason="; ".join(problems[:3]))
            ck.remove_dir(tmp)
            continue
        final = Path(root) / name
        if final.exists():
            ck.remove_dir(final)
        tmp.rename(final)
        log.event(ev.REMOTE_FETCH, 0, path=src, to=str(final))
        return name
    return None
