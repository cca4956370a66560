"""The run's own state and its life across processes: what a checkpoint holds beyond Accelerate's state, saving
(sync or in the background), resuming, preemption."""

from __future__ import annotations

import json
import os
import signal
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import yaml
from accelerate.utils import DistributedType

from . import checkpoint as ck
from .errors import PretrainerError
from .recipe import flatten, recipe_dict, recipe_hash
from .recovery import read_ledger

if TYPE_CHECKING:
    from .trainer import Trainer

PREEMPTED_EXIT = 75  # EX_TEMPFAIL: "try again" -- resume with --resume auto


class Preempted(PretrainerError):
    exit_code = PREEMPTED_EXIT


@dataclass
class RunState:
    """Everything besides model/optimizer/RNG that exact resume needs. Saved in meta.json."""

    step: int = 0
    tokens: int = 0
    stage_index: int = 0
    cursor: int = 0
    """The stage's next global sample index (the sampler maps it to data in O(1))."""
    skips: list[list[int]] = field(default_factory=list)
    """The skip ledger: [stage, first_sample, last_sample] ranges excluded from training."""
    train_seconds: float = 0.0
    applied_stage: int = -1
    """Stages whose RoPE changes are in the model (not saved: re-applied on resume)."""

    def skips_for(self, stage: int) -> list[tuple[int, int]]:
        return [(a, b) for s, a, b in self.skips if s == stage]

    def to_meta(self) -> dict:
        d = asdict(self)
        d.pop("applied_stage")
        return d


class _Window:
    """Per-step losses kept on the device between logging steps (no host sync), flushed with one transfer."""

    def __init__(self, device):
        self.device = device
        self.steps: list[int] = []
        self.losses: list[torch.Tensor] = []
        self.tokens = 0
        self.t0 = time.perf_counter()

    def add(self, step: int, loss: torch.Tensor, tokens: int) -> None:
        self.steps.append(step)
        self.losses.append(loss)
        self.tokens += tokens

    def flush(self, accelerator) -> tuple[list[int], list[float]]:
        values = accelerator.reduce(torch.stack(self.losses), reduction="mean").tolist()
        steps = self.steps
        self.steps, self.losses = [], []
        return steps, values

    def tokens_per_s(self) -> float:
        dt = time.perf_counter() - self.t0
        rate = self.tokens / dt if dt > 0 else float("nan")
        self.tokens, self.t0 = 0, time.perf_counter()
        return rate

    def reset_clock(self) -> None:
        self.tokens, self.t0 = 0, time.perf_counter()


class _PreemptFlag:
    """SIGTERM/SIGINT set a flag; the loop saves and exits at the next step boundary that all ranks agree on."""

    def __init__(self):
        self.flag = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                signal.signal(sig, self._handler)
            except ValueError:  # not the main thread (e.g. under some test runners)
                pass

    def _handler(self, signum, frame) -> None:
        self.flag = True

    def check(self, accelerator, log_step: bool) -> bool:
        if accelerator.num_processes == 1:
            return self.flag
        if not log_step:  # agreeing costs a collective: only on logging steps
            return False
        t = torch.tensor([float(self.flag)], device=accelerator.device)
        return bool(accelerator.reduce(t, reduction="sum").item() > 0)


# Settings that do not change what is trained: free to change on resume.
_BENIGN = ("checkpoint.", "logging.", "eval.", "run.name", "run.output_dir", "data.cache_dir")


def recipe_diff(old: dict, new: dict) -> list[str]:
    """Differences that change the training itself (cadence of checkpoints, logs and evals excluded)."""
    a, b = flatten(old), flatten(new)
    keys = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k) and not k.startswith(_BENIGN)]
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in keys]


class CheckpointManager:
    """Saves, prunes and restores checkpoints of one Trainer."""

    def __init__(self, trainer: Trainer):
        self.t = trainer
        self.section = trainer.recipe.checkpoint
        self.root = trainer.output_dir / "checkpoints"
        self.writer = ck.BackgroundWriter()
        self.protected: set[str] = set()
        """Checkpoint names that pruning must keep (the spike handler's rollback target)."""
        self.last_save = time.monotonic()
        self._pool: dict = {}  # snapshot buffers, reused between background saves
        # The recipe cannot change within a process: serialize it once, not at every save.
        self._recipe = recipe_dict(trainer.recipe)
        self._recipe_hash = recipe_hash(trainer.recipe)
        self._model_config: tuple[int, dict] | None = None
        acc = trainer.accelerator
        self.async_ok = self.section.async_ and acc.distributed_type not in (
            DistributedType.DEEPSPEED,
            DistributedType.FSDP,
        )

    # ------------------------------------------------------------------ when

    def mark_clock(self) -> None:
        self.last_save = time.monotonic()

    def due(self, tokens_before: int, tokens_now: int, stage_end: bool, log_step: bool) -> str | None:
        """Token and stage-end triggers every step; the clock only on logging steps, decided by the main process and
        broadcast (ranks' clocks differ; all must save together)."""
        s = self.section
        if stage_end and s.at_stage_end:
            return "stage_end"
        reason = ck.due(s.every_tokens, None, tokens_before, tokens_now, 0)
        if reason or not log_step or s.every_minutes is None:
            return reason
        late = (time.monotonic() - self.last_save) / 60 >= s.every_minutes
        acc = self.t.accelerator
        if acc.num_processes > 1:
            from accelerate.utils import broadcast

            late = bool(broadcast(torch.tensor([float(late)], device=acc.device), from_process=0).item())
        return "time" if late else None

    # ------------------------------------------------------------------ save

    def _meta(self, reason: str) -> dict:
        t, st = self.t, self.t.state
        losses = list(t.recent_losses)
        finite = [x for x in losses if x == x and abs(x) != float("inf")]
        return {
            **st.to_meta(),
            "stage": t.spans[st.stage_index].name,
            "reason": reason,
            "saved_at": time.time(),
            "world_size": t.accelerator.num_processes,
            "recipe_hash": self._recipe_hash,
            "recipe": self._recipe,
            "model_config": self._config_dict(),
            "loss_stats": {
                "n": len(losses),
                "finite": len(finite) == len(losses),
                "median": statistics.median(finite) if finite else None,
                "last": losses[-1] if losses else None,
                "min": min(finite) if finite else None,
                "max": max(finite) if finite else None,
            },
            "spikes": t.spikes.state_dict() if t.spikes else None,
            "gns": t.gns.state_dict() if t.gns else None,
        }

    def _config_dict(self) -> dict:
        """The model config as saved; it changes only when a stage changes RoPE."""
        st = self.t.state.applied_stage
        if self._model_config is None or self._model_config[0] != st:
            self._model_config = (st, self.t.accelerator.unwrap_model(self.t.model).config.to_dict())
        return self._model_config[1]

    def save(self, reason: str) -> Path:
        """Write a checkpoint atomically: state into `.tmp-step_N/`, then meta, tokenizer, manifest (last), rename.

        Raises:
            ck.CheckpointError: the write failed; earlier checkpoints are intact and the partial one is removed.
        """
        t, acc = self.t, self.t.accelerator
        name = f"step_{t.state.step:08d}"
        tmp, final = self.root / f"{ck.TMP_PREFIX}{name}", self.root / name
        t0 = time.perf_counter()
        self.writer.wait()  # never two writes at once
        meta = self._meta(reason)
        if acc.is_main_process:
            self.root.mkdir(parents=True, exist_ok=True)
            ck.remove_dir(tmp) if tmp.exists() else None
        acc.wait_for_everyone()
        if self.async_ok:
            snap = ck.Snapshot(acc, t.model, t.optimizer, self._pool)
            self._pool = snap.pool
            blocked = time.perf_counter() - t0
            if acc.is_main_process:
                self.writer.submit(lambda: self._write(snap, tmp, final, meta, reason, blocked, t0))
            self.mark_clock()
            return final
        try:
            acc.save_state(str(tmp), safe_serialization=True)
        except OSError as e:
            self._fail(tmp, name, e)
        acc.wait_for_everyone()
        if acc.is_main_process:
            self._finish_write(tmp, final, meta, reason, None, t0)
        acc.wait_for_everyone()
        self.mark_clock()
        return final

    def _write(self, snap: ck.Snapshot, tmp: Path, final: Path, meta: dict, reason: str, blocked: float, t0) -> None:
        try:
            tmp.mkdir(parents=True, exist_ok=True)
            snap.write(tmp, 0)
        except OSError as e:
            self._fail(tmp, final.name, e)
        self._finish_write(tmp, final, meta, reason, blocked, t0)

    def _fail(self, tmp: Path, name: str, e: OSError):
        if self.t.accelerator.is_main_process:
            ck.remove_dir(tmp)
        self.t.log.event("checkpoint_failed", self.t.state.step, name=name, error=str(e))
        raise ck.CheckpointError(
            f"checkpoint {name} could not be written ({e.strerror or e}); earlier checkpoints in {self.root} are intact"
        ) from None

    def _finish_write(self, tmp: Path, final: Path, meta: dict, reason: str, blocked: float | None, t0: float) -> None:
        """Meta, tokenizer, manifest (last), rename. `blocked`: seconds the loop waited (None: all of it)."""
        try:
            (tmp / ck.META).write_text(json.dumps(meta, indent=1))
            self.t.tokenizer.save_pretrained(tmp / "tokenizer")
            debug_kill_point("after_state")
            ck.write_manifest(tmp)
            if final.exists():  # the same step again (a replay after rollback): the new one replaces it
                ck.remove_dir(final)
            tmp.rename(final)
            ck.fsync_dir(self.root)
        except OSError as e:
            self._fail(tmp, final.name, e)
        self.t.log.event(
            "checkpoint", meta["step"], path=str(final), reason=reason, tokens=meta["tokens"],
            blocked_s=round(time.perf_counter() - t0 if blocked is None else blocked, 4),
            total_s=round(time.perf_counter() - t0, 4),
            bytes=sum(f.stat().st_size for f in final.rglob("*") if f.is_file()),
        )  # fmt: skip
        self.prune()

    def finish(self) -> None:
        """Wait for a background write, then verify it: the run never exits before its last save is good."""
        self.writer.wait()
        acc = self.t.accelerator
        acc.wait_for_everyone()
        if acc.is_main_process:
            cands = ck.list_checkpoints(self.root)
            if cands and (problems := ck.verify(cands[-1].path)):
                raise ck.CheckpointError(f"{cands[-1].path}: the last checkpoint does not verify: {problems[:3]}")

    def prune(self) -> None:
        """Keep the newest `keep_last`, milestones, protected ones, and always the newest that verifies."""
        cands = ck.list_checkpoints(self.root)
        keep = ck.to_keep(cands, self.section.keep_last, self.section.keep_every_tokens, self.protected)
        for c in reversed(cands):  # the newest that passes the (cheap) manifest check is never pruned
            if not ck.verify(c.path, deep=False):
                keep.add(c.path)
                break
        for c in cands:
            if c.path not in keep:
                err = ck.remove_dir(c.path)
                if err:
                    self.t.log.event("prune_failed", self.t.state.step, path=str(c.path), error=err)
                else:
                    self.t.log.event("prune", self.t.state.step, path=str(c.path))

    # ------------------------------------------------------------------ resume

    def resume(self, spec: str, allow_recipe_change: bool) -> bool:
        """Restore from `spec` (`none`, `auto` or a checkpoint path). Returns True when resumed."""
        t, acc = self.t, self.t.accelerator
        if acc.is_main_process:
            for d in ck.incomplete_dirs(self.root):  # a save that died: never resumed from, cleaned up
                err = ck.remove_dir(d)
                t.log.event("cleanup_incomplete", 0, path=str(d), error=err)
        acc.wait_for_everyone()
        if spec == "none":
            return False
        if spec == "auto":
            cand, skipped = ck.newest_valid(self.root)
            for path, why in skipped:
                t.log.event("resume_skip", 0, path=str(path), reason=why)
                if acc.is_main_process:
                    print(f"resume: skipping {path}: {why}", flush=True)
            if cand is None:
                if acc.is_main_process:
                    print("resume: no valid checkpoint, starting from scratch", flush=True)
                return False
            path = cand.path
            ledger = read_ledger(t.output_dir)
            pend = (ledger or {}).get("pending")
            if pend and cand.meta["step"] > pend["onset"] - 2 and not ck.verify(Path(pend["target"])):
                # killed during a replay: the newest checkpoint may hold the spike; go back to the episode's target
                path = Path(pend["target"])
        else:
            path = Path(spec)
            if problems := ck.verify(path):
                raise PretrainerError(f"--resume {spec}: not a valid checkpoint: {'; '.join(problems[:3])}")
        meta = ck.read_meta(path)
        self._check_recipe(meta, allow_recipe_change, path)
        if meta["world_size"] != acc.num_processes and acc.distributed_type == DistributedType.DEEPSPEED:
            raise PretrainerError(
                f"--resume {path}: saved by {meta['world_size']} DeepSpeed processes, now {acc.num_processes}"
            )
        self.restore(path)
        t.state.applied_stage = -1  # the fresh model has no stage RoPE yet; entering the stage applies all up to it
        ledger = read_ledger(t.output_dir)
        if ledger:  # the run directory's ledger may be newer than the checkpoint (killed during a replay)
            t.state.skips = sorted([list(x) for x in {tuple(x) for x in t.state.skips + ledger["skips"]}])
            if t.spikes:
                t.spikes.pending = ledger.get("pending")
                t.spikes.rollback_steps = sorted(set(t.spikes.rollback_steps) | set(ledger.get("rollbacks", [])))
        t.log.event("resume", t.state.step, path=str(path), tokens=t.state.tokens, stage=meta["stage"],
                    cursor=t.state.cursor, skips=t.state.skips)  # fmt: skip
        if acc.is_main_process:
            print(f"resume: from {path} at step {t.state.step}", flush=True)
        return True

    def restore(self, path: Path) -> dict:
        """Load model/optimizer/RNG and the run state of a checkpoint (used by resume and by rollback)."""
        t = self.t
        meta = ck.read_meta(path)
        t.accelerator.load_state(str(path))
        st = t.state
        for k in ("step", "tokens", "stage_index", "cursor", "train_seconds"):
            setattr(st, k, meta[k])
        st.skips = [list(x) for x in meta["skips"]]
        t.scheduler.load_state_dict({"step": st.step})
        if t.spikes and meta.get("spikes"):
            t.spikes.load_state_dict(meta["spikes"])
        if t.gns and meta.get("gns"):
            t.gns.load_state_dict(meta["gns"])
        return meta

    def _check_recipe(self, meta: dict, allow: bool, path: Path) -> None:
        t = self.t
        diffs = recipe_diff(meta["recipe"], recipe_dict(t.recipe))
        if not diffs:
            return
        if not allow:
            raise PretrainerError(
                f"--resume {path}: the recipe changed since this checkpoint; pass --allow-recipe-change to accept:\n  "
                + "\n  ".join(diffs)
            )
        t.log.event("recipe_change", meta["step"], differences=diffs)
        if t.accelerator.is_main_process:
            (t.output_dir / f"recipe.step_{meta['step']:08d}.yaml").write_text(yaml.safe_dump(meta["recipe"]))


_KILL_SEEN: dict[str, int] = {}


def debug_kill_point(where: str) -> None:
    """Fault injection for tests: PRETRAINER_KILL_AT=after_state SIGKILLs the process mid-save; `step:29` after step
    29; `step:29#2` the second time step 29 completes (in a replay after a rollback)."""
    want = os.environ.get("PRETRAINER_KILL_AT")
    if not want:
        return
    point, _, nth = want.partition("#")
    if point == where:
        _KILL_SEEN[where] = _KILL_SEEN.get(where, 0) + 1
        if _KILL_SEEN[where] >= int(nth or 1):
            os.kill(os.getpid(), signal.SIGKILL)
