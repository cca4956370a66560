"""The checkpoint store: atomic saves (synchronous or in the background), verification, listing, retention and
loading. Storage only: it is told what to save (the meta the loop built) and what to keep (protected names); it
decides nothing about when to save, which checkpoint a run should resume from, or whether a recipe may continue.

`meta.json` holds what the loop gave (the run state at the top level, each part's `state_dict()` under its name, the
resolved recipe and its hash) plus what the store itself knows of the state: whether it was finite, the world size,
the model config as saved.
"""

from __future__ import annotations

import errno
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from accelerate.utils import DistributedType, broadcast_object_list

from ..errors import PretrainerError, first_line
from ..observe import events as ev
from ..recipe.sections import CheckpointSection
from . import commit, integrity
from . import format as ck
from .commit import Group
from .dcp import DcpCheckpointer
from .format import NOTHING, Protected
from .identity import Identity, foreign
from .loading import load_state
from .remote import Uploader, check_remote, fetch_newest, run_url
from .safe_load import weights_only
from .writer import BackgroundWriter, Snapshot


def _why(e: Exception) -> str:
    """One line for a failed write; a full disk reads the same whichever library hit it."""
    if getattr(e, "errno", None) == errno.ENOSPC or "No space left" in str(e):
        return "No space left on device"
    return getattr(e, "strerror", None) or first_line(e)


class Sidecar(Protocol):
    """State a rank holds beside the model and optimizer, in files of its own under the checkpoint. The store only
    writes it; reading it back is the loop's business (the part's `load_files`, in `Parts.load_state_dict`)."""

    def save(self, directory: Path) -> None: ...

    def snapshot(self, directory: Path) -> Callable[[], None]:
        """A copy taken now, written by the returned function (in the background writer)."""
        ...


@dataclass(frozen=True)
class Restored:
    """What a load put back in place (model, optimizer, RNG), and the meta for the loop to hand to the parts."""

    path: Path
    step: int
    meta: dict


class CheckpointManager:
    def __init__(
        self,
        accelerator,
        section: CheckpointSection,
        root: Path,
        *,
        model,
        optimizer,
        log,
        extra_files: dict[str, Callable[[Path], None]] | None = None,
        sidecars: dict[str, Sidecar] | None = None,
        deep_verify: bool = False,
        identity: Identity | None = None,
    ):
        """Args:
        extra_files: sub-directory name -> writer, called at each save (e.g. the tokenizer).
        sidecars: sub-directory name -> per-rank state saved with the model (the averaged weights); the loop reads
            it back through the part that owns it.
        deep_verify: also scan the files for NaN/Inf when choosing a checkpoint (`--verify deep`).
        identity: the run's (checkpoint/identity.py): saved in every meta; another run's checkpoints are passed over
            by `--resume auto`; the remote copies go to the run's own directory there."""
        self.acc, self.section, self.root = accelerator, section, Path(root)
        self.model, self.optimizer = model, optimizer
        self.log, self.extra_files, self.deep_verify = log, extra_files or {}, deep_verify
        self.sidecars = sidecars or {}
        self.writer = BackgroundWriter()
        self.blocked_s = 0.0
        """Seconds the loop was blocked by saves since `take_blocked()` was last called."""
        self._pool: dict = {}  # snapshot buffers, reused between background saves
        self._config: tuple[object, int, dict] | None = None
        self.last_blocked = 0.0
        self._pending: integrity.PendingFinite | None = None
        kind = accelerator.distributed_type
        self.async_ok = section.async_ and kind not in (DistributedType.DEEPSPEED, DistributedType.FSDP)
        self.dcp = DcpCheckpointer() if kind == DistributedType.FSDP else None
        """FSDP saves and loads through DCP: sharded, asynchronous when asked, resharded on load."""
        if section.remote:
            check_remote(section.remote)  # every rank: a protocol nobody can write is one line at start
        self.identity = identity
        self.remote_url = section.remote and (run_url(section.remote, identity.run_id) if identity else section.remote)
        self.remote = (
            Uploader(self.remote_url, section, log) if section.remote and accelerator.is_main_process else None
        )
        """The background copy of each verified checkpoint to `checkpoint.remote` (main process)."""

    def take_blocked(self) -> float:
        out, self.blocked_s = self.blocked_s, 0.0
        return out

    # ------------------------------------------------------------------ save

    def _meta(self, meta: dict) -> dict:
        return {
            **meta,
            "run_id": self.identity.run_id if self.identity else None,
            "saved_at": time.time(),
            "world_size": self.acc.num_processes,
            "model_config": self._model_config(),
            "state_finite": self._finite_at_save(),
        }

    def _finite_at_save(self) -> bool | None:
        """The save's NaN/Inf check. In the background (one process, DDP): None here; the main process's writer
        checks its host copy off the loop, and under DDP also reads the other ranks' live check, summed by an
        all-reduce nobody waits for on the loop (`integrity.PendingFinite`: a replica that went bad alone is seen
        only on its own rank). FSDP in the background: every rank checks its shards on the device the same way, and
        each rank's commit thread reads the sum before writing meta.json. DeepSpeed and synchronous saves: the live
        state, on the loop."""
        if self.dcp is not None and self.section.async_:  # FSDP: every rank's shards, read by the commit thread
            self._pending = integrity.PendingFinite(self.model, self.optimizer, self.acc.device, main=False)
            return None
        if not self.async_ok:
            return self._state_finite()
        if self.acc.num_processes > 1:
            self._pending = integrity.PendingFinite(
                self.model, self.optimizer, self.acc.device, self.acc.is_main_process
            )
        return None

    def _state_finite(self) -> bool:
        """Weights and optimizer state finite on every rank: one fused reduction per rank, one all-reduce."""
        bad = 1.0 - integrity.state_finite(self.model, self.optimizer).to(self.acc.device)
        if self.acc.num_processes > 1:
            bad = self.acc.reduce(bad, reduction="sum")
        return bool(bad.item() == 0)

    def _model_config(self) -> dict:
        """The model config as saved (RoPE as trained); re-serialised only when a stage changed RoPE."""
        cfg = self.acc.unwrap_model(self.model).config
        key = (getattr(cfg, "rope_parameters", None), getattr(cfg, "max_position_embeddings", None))
        if self._config is None or self._config[0] is not key[0] or self._config[1] != key[1]:
            self._config = (key[0], key[1], cfg.to_dict())
        return self._config[2]

    def save(self, meta: dict, protected: Protected = NOTHING) -> Path:
        """Write a checkpoint of the live model and optimizer atomically: state into `.tmp-step_N/`, then meta, extra
        files, manifest (last), rename; then prune, keeping `protected` names.

        Single process and DDP: Accelerate's files, in the background from a CPU snapshot on the main process when
        `async`. FSDP: DCP shards from every rank, in the background when `async`. DeepSpeed: its engine's
        synchronous save. In every case each rank hashes its own files for the manifest.

        Args:
            meta: what the loop saves with the state; needs `step`, `tokens` and `reason`.
            protected: what pruning must keep (an open spike episode's rollback target, an open suspicion's
                candidate). Read at the save; a later episode cannot be missed by a background write's prune,
                because choosing a target (`newest_good`) and loading (`load`) join the write first.

        Raises:
            ck.CheckpointError: the write failed; earlier checkpoints are intact and the partial one is removed.
        """
        acc = self.acc
        name = f"step_{meta['step']:08d}"
        tmp, final = self.root / f"{ck.TMP_PREFIX}{name}", self.root / name
        t0, staged = time.perf_counter(), threading.Event()
        self._wait()  # never two writes at once
        meta = self._meta(meta)
        if acc.is_main_process:
            self.root.mkdir(parents=True, exist_ok=True)
            ck.remove_dir(tmp) if tmp.exists() else None
        # In the background only the main process writes: no barrier there, so its snapshot overlaps the other ranks'
        # finite check. Otherwise every rank writes into the directory, which must exist first.
        if not self.async_ok:
            acc.wait_for_everyone()
            try:  # every rank its own files, before the engine's (which are slower to write)
                for sub, sidecar in self.sidecars.items():
                    sidecar.save(tmp / sub)
            except Exception as e:
                self._fail(tmp, meta["step"], e)
        if self.dcp is not None:
            others = self._pending
            try:
                self.dcp.save(
                    self.model,
                    self.optimizer,
                    tmp,
                    lambda g: self._commit(
                        g, tmp, final, meta, t0, staged if self.section.async_ else None, protected, others
                    ),
                    async_=self.section.async_,
                )
            except Exception as e:
                self._fail(tmp, meta["step"], e)
        elif self.async_ok:
            if acc.is_main_process:  # only the main process writes, so only it needs a copy
                snap = Snapshot(acc, self.model, self.optimizer, self._pool)
                self._pool = snap.pool
                sides = [sidecar.snapshot(tmp / sub) for sub, sidecar in self.sidecars.items()]
                others = self._pending
                self.writer.submit(lambda: self._write(snap, sides, tmp, final, meta, t0, staged, protected, others))
        else:
            try:
                acc.save_state(str(tmp), safe_serialization=True)
            except Exception as e:  # torch and safetensors raise RuntimeError-like errors on a full disk, not OSError
                self._fail(tmp, meta["step"], e)
            acc.wait_for_everyone()
            self._commit(Group(), tmp, final, meta, t0, None, protected)
            acc.wait_for_everyone()
        self.last_blocked = time.perf_counter() - t0
        self.blocked_s += self.last_blocked
        staged.set()
        return final

    def _wait(self) -> None:
        self.writer.wait()
        if self.dcp is not None:
            self.dcp.wait()
        if self._pending is not None:  # the other ranks' side of the last save's finite check
            self._pending.join()
            self._pending = None

    def _write(
        self, snap: Snapshot, sides, tmp: Path, final: Path, meta: dict, t0: float, staged, protected, others=None
    ) -> None:
        try:
            tmp.mkdir(parents=True, exist_ok=True)
            if meta["state_finite"] is None:
                meta["state_finite"] = snap.finite() and (others is None or others.ok())
            snap.write(tmp, 0)
            for write in sides:
                write()
        except Exception as e:
            self._fail(tmp, meta["step"], e)
        self._commit(Group(alone=True), tmp, final, meta, t0, staged, protected)  # the main process alone wrote it

    def _fail(self, tmp: Path, step: int, e: Exception):
        name = tmp.name.removeprefix(ck.TMP_PREFIX)
        if self.acc.is_main_process:
            ck.remove_dir(tmp)
        self.log.event(ev.CHECKPOINT_FAILED, step, name=name, error=str(e))
        raise ck.CheckpointError(
            f"checkpoint {name} could not be written ({_why(e)}); earlier checkpoints in {self.root} are intact"
        ) from None

    def _commit(
        self,
        group: Group,
        tmp: Path,
        final: Path,
        meta: dict,
        t0: float,
        staged: threading.Event | None,
        protected: Protected,
        others: integrity.PendingFinite | None = None,
    ):
        """Meta, extra files, per-rank hashes, manifest (last), rename; then the event and retention (rank 0).

        Args:
            group: the ranks that wrote it (one process: the main process's background writer).
            staged: set once the loop is free again (`last_blocked` known); None: the loop waited for all of it.
            others: the ranks' finite check still in flight (FSDP in the background), read here, off the loop."""
        if meta["state_finite"] is None and others is not None:
            meta["state_finite"] = others.ok()
        try:
            nbytes = commit.commit(group, tmp, final, meta, self.extra_files)
        except Exception as e:
            self._fail(tmp, meta["step"], e)
        if not self.acc.is_main_process:
            return
        total = time.perf_counter() - t0
        if staged is not None:
            staged.wait()
        self.log.event(
            ev.CHECKPOINT,
            meta["step"],
            path=str(final),
            reason=meta["reason"],
            tokens=meta["tokens"],
            blocked_s=round(total if staged is None else self.last_blocked, 4),
            total_s=round(total, 4),
            bytes=nbytes,
            state_finite=meta["state_finite"],
        )
        self.prune(meta["step"], protected)
        if self.remote is not None:
            self.remote.submit(final)

    def finish(self) -> None:
        """Wait for a background write, then verify it: the run never exits before its last save is good."""
        self._wait()
        if self.remote is not None:
            self.remote.wait()
        self.acc.wait_for_everyone()
        cands = ck.list_checkpoints(self.root)
        if cands and (problems := self.verify(cands[-1].path)):
            raise ck.CheckpointError(f"{cands[-1].path}: the last checkpoint does not verify: {problems[:3]}")

    def prune(self, step: int, protected: Protected = NOTHING) -> None:
        """Keep the newest `keep_last`, milestones, `protected` ones, and always the newest that verifies."""
        cands = ck.list_checkpoints(self.root)
        keep = ck.to_keep(cands, self.section.keep_last, self.section.keep_every_tokens, protected)
        for c in reversed(cands):  # the newest that passes the (cheap) manifest check is never pruned
            if not ck.verify(c.path, hashes=False):
                keep.add(c.path)
                break
        for c in cands:
            if c.path not in keep:
                err = ck.remove_dir(c.path)
                kind = ev.PRUNE_FAILED if err else ev.PRUNE
                self.log.event(kind, step, path=str(c.path), **({"error": err} if err else {}))

    # ------------------------------------------------------------------ verify, list, find, load

    def verify(self, path: Path) -> list[str]:
        """The same answer on every rank; each rank hashes its share (deep: rank 0 also scans the files)."""
        return commit.verify_shares(Group(), Path(path), scan=self.deep_verify)

    def newest_good(self, max_step: int) -> Path | None:
        """The newest checkpoint saved at or before `max_step` that verifies and recorded only finite losses.

        Joins a background write first: its commit prunes with what was protected when it was handed over, so a
        target chosen while it runs could be removed under the episode that chose it. After the join, the choice
        sees what a synchronous save would have left, and the episode protects it in every later save."""
        self._wait()
        cand, _ = ck.newest_valid(self.root, max_step=max_step, finite_losses=True, check=self.verify)
        return cand.path if cand else None

    def clean_incomplete(self) -> None:
        """Saves that died are never resumed from; the main process removes them."""
        if self.acc.is_main_process:
            for d in ck.incomplete_dirs(self.root):
                err = ck.remove_dir(d)
                self.log.event(ev.CLEANUP_INCOMPLETE, 0, path=str(d), error=err)
        self.acc.wait_for_everyone()

    def find(self, spec: str) -> Path | None:
        """The checkpoint `spec` names: `auto` (the newest that verifies, locally, else at `checkpoint.remote`;
        None when there is none) or a path."""
        if spec != "auto":
            path = Path(spec)
            if problems := self.verify(path):
                raise PretrainerError(f"--resume {spec}: not a valid checkpoint: {'; '.join(problems[:3])}")
            return path
        cand, skipped = ck.newest_valid(self.root, check=self._own)
        for path, why in skipped:
            self.log.event(ev.RESUME_SKIP, 0, path=str(path), reason=why)
            if self.acc.is_main_process:
                print(f"resume: skipping {path}: {why}", flush=True)
        if cand is None and self.section.remote:
            cand = self._from_remote()
        if cand is None and self.acc.is_main_process:
            print("resume: no valid checkpoint, starting from scratch", flush=True)
        return cand.path if cand else None

    def _own(self, path: Path) -> list[str]:
        """`verify`'s problems, or that the checkpoint is another run's."""
        if problems := self.verify(path):
            return problems
        why = foreign(ck.read_meta(path), self.identity) if self.identity else None
        return [why] if why else []

    def _from_remote(self) -> ck.Candidate | None:
        """A replaced node: the newest remote checkpoint that verifies, copied into the local directory."""
        got, error = None, None
        if self.acc.is_main_process:
            try:
                got = fetch_newest(self.remote_url, self.root, self.log, self.identity and self.identity.run_id)
            except PretrainerError as e:
                error = str(e)
        if self.acc.num_processes > 1:  # the main process's verdict on every rank, so all stop alike
            error = broadcast_object_list([error])[0]
        if error:
            raise PretrainerError(error)
        self.acc.wait_for_everyone()
        cand, _ = ck.newest_valid(self.root, check=self._own)
        if cand is not None and self.acc.is_main_process:
            print(f"resume: copied {got} from {self.remote_url}", flush=True)
        return cand

    def load(self, path: Path) -> Restored:
        """Load model, optimizer and RNG from a checkpoint (resume and rollback), whatever number of processes saved
        it; the meta and path are returned for the loop to hand to the run state and the parts (a part with files of
        its own in the checkpoint reads them itself). Never while a background write runs: it is joined first."""
        self._wait()
        meta = ck.read_meta(path)
        try:
            with weights_only(str(path)):
                load_state(
                    self.acc,
                    self.model,
                    self.optimizer,
                    Path(path),
                    meta,
                    self.dcp,
                    self.log,
                    self.root.parent / "universal",
                )
        except RuntimeError as e:  # a model of another shape: one line, not the state dict's traceback
            lines = [x.strip() for x in str(e).splitlines() if "size mismatch" in x or "Missing key" in x]
            raise PretrainerError(
                f"--resume {path}: the checkpoint does not fit this recipe's model: {(lines or [str(e)[:200]])[0]}"
            ) from None
        return Restored(Path(path), meta["step"], meta)
