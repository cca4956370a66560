"""The training loop: stages, gradient accumulation, clipping, eval, logging, final export.

Everything distributed comes from Accelerate (DDP, DeepSpeed ZeRO, FSDP); the same loop runs on one CPU process and
on many nodes. The host synchronises with the device only on logging and eval steps.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
from collections import deque
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, InitProcessGroupKwargs, set_seed
from tqdm.auto import tqdm

from .data.pipeline import StageBatches, get_tokenizer, load_sources, used_sources, validation_batches
from .errors import PretrainerError
from .gns import NoiseScale
from .health import report
from .lint import lint
from .model import apply_stage_rope, build_config, build_model, count_params, set_rope
from .recipe import dump_recipe, flatten, recipe_dict
from .recovery import SpikeHandler
from .runstate import CheckpointManager, Preempted, RunState, _PreemptFlag, _Window, debug_kill_point
from .schedules import LRController, lr_lambda
from .sections import Recipe
from .stages import grad_accum_steps, stage_at, stage_spans, total_steps
from .tracking import RunLog, tracker_setup


def make_accelerator(recipe: Recipe, output_dir: Path, grad_accum: int) -> Accelerator:
    kwargs = []
    if not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # Without this every CPU rank would believe it is rank 0 of 1 (the default backend is nccl).
        kwargs.append(InitProcessGroupKwargs(backend="gloo"))
    try:
        return Accelerator(
            mixed_precision=recipe.precision.mixed,
            gradient_accumulation_steps=grad_accum,
            log_with=tracker_setup(recipe.logging.report_to, output_dir) or None,
            project_dir=str(output_dir),
            kwargs_handlers=kwargs,
        )
    except (ValueError, ImportError) as e:
        raise PretrainerError(f"precision.mixed: {recipe.precision.mixed!r} is not usable here: {e}") from None


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only: norms' gains and biases keep their scale."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class Trainer:
    """Runs a recipe. `Trainer(recipe).train()` is the whole program."""

    def __init__(
        self,
        recipe: Recipe,
        output_dir: str | Path | None = None,
        overwrite: bool = False,
        resume: str = "none",
        allow_recipe_change: bool = False,
    ):
        self.recipe = recipe
        self.output_dir = Path(output_dir or recipe.output_dir)
        self.resume_spec, self.allow_recipe_change = resume, allow_recipe_change
        if (self.output_dir / "metrics.jsonl").exists() and resume == "none":
            if not overwrite:
                raise PretrainerError(
                    f"{self.output_dir}: already holds a run (metrics.jsonl); continue it with --resume auto, choose "
                    f"another --output-dir, or pass --overwrite to start over"
                )
            if int(os.environ.get("RANK", "0")) == 0:
                for name in ("metrics.jsonl", "events.jsonl"):
                    (self.output_dir / name).unlink(missing_ok=True)
                shutil.rmtree(self.output_dir / "checkpoints", ignore_errors=True)
        self.spans = stage_spans(recipe)
        self.total_steps = total_steps(recipe)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        try:
            self.grad_accum = grad_accum_steps(recipe, world)
        except ValueError as e:
            raise PretrainerError(str(e)) from None
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.accelerator = make_accelerator(recipe, self.output_dir, self.grad_accum)
        acc = self.accelerator
        if acc.num_processes != world:
            raise PretrainerError(f"expected {world} processes from WORLD_SIZE, Accelerate sees {acc.num_processes}")
        self.log = RunLog(self.output_dir, acc, enabled=acc.is_main_process)
        if acc.is_main_process:
            dump_recipe(recipe, self.output_dir / "recipe.resolved.yaml")
            for f in lint(recipe):
                print(f"warning: {f}", file=sys.stderr)

        with acc.main_process_first():
            self.tokenizer = get_tokenizer(recipe)
            self.sources = load_sources(recipe, self.tokenizer)

        set_seed(recipe.run.seed)  # the same initial weights on every rank and every run
        self.config = build_config(
            recipe.model,
            vocab_size=len(self.tokenizer),
            eos_token_id=self.tokenizer.eos_token_id,
            pad_token_id=self.tokenizer.pad_token_id,
        )
        model = build_model(recipe.model, self.config)
        self.base_rope = (dict(self.config.rope_parameters or {}), self.config.max_position_embeddings)
        self.n_params = count_params(model)
        opt = recipe.optimizer
        # Fused AdamW (one kernel for all parameters) exists for CUDA and CPU; it is what the HF Trainer uses too.
        fused = opt.fused if opt.fused is not None else True
        self.fused = fused
        optimizer = torch.optim.AdamW(
            param_groups(model, opt.weight_decay), lr=opt.lr, betas=opt.betas, eps=opt.eps, fused=fused or None
        )
        if recipe.model.compile:
            model = torch.compile(model)
        self._configure_deepspeed()
        self.model, self.optimizer = acc.prepare(model, optimizer)
        # Not registered with Accelerate: the LR is a function of the step, which meta.json holds.
        self.scheduler = LRController(self.optimizer, lr_lambda(recipe), opt.lr)
        self.max_norm = recipe.clipping.max_grad_norm or math.inf
        self.recent_losses: deque[float] = deque(maxlen=256)
        self.state = RunState()
        self.ckpt = CheckpointManager(self)
        self.spikes = SpikeHandler(self) if recipe.spikes.enabled else None
        self._batchers: dict[int, StageBatches] = {}
        self._val_cache: dict[tuple[int, int], dict[str, list[torch.Tensor]]] = {}
        # The noise scale needs one micro batch's own gradient: not available when DeepSpeed/FSDP shard gradients,
        # nor when a step is a single micro batch on a single process.
        plain = acc.distributed_type not in (DistributedType.DEEPSPEED, DistributedType.FSDP)
        self.gns = NoiseScale() if plain and self.grad_accum > 1 else None
        self._gns_small_sq: torch.Tensor | None = None
        self._fired: set[str] = set()  # fault injections fire once per process

    def _configure_deepspeed(self) -> None:
        """The recipe, not the launcher config, decides micro batch, accumulation and clipping."""
        acc = self.accelerator
        if acc.distributed_type != DistributedType.DEEPSPEED:
            return
        ds = acc.state.deepspeed_plugin.deepspeed_config
        ds["train_micro_batch_size_per_gpu"] = self.spans[0].micro_batch_size
        ds["gradient_accumulation_steps"] = self.grad_accum
        ds["train_batch_size"] = self.spans[0].micro_batch_size * self.grad_accum * acc.num_processes
        ds["gradient_clipping"] = self.recipe.clipping.max_grad_norm or 0.0

    def batches_for(self, stage: int) -> StageBatches:
        if stage not in self._batchers:
            vocab = self.config.vocab_size
            self._batchers[stage] = StageBatches(self.recipe, self.spans[stage], self.sources, vocab)
        return self._batchers[stage]

    def alert(self, title: str, text: str) -> None:
        """A W&B alert when W&B is online; always a line above the progress bar (events.jsonl has the record)."""
        if self.accelerator.is_main_process:
            tqdm.write(f"[{title}] {text}", file=sys.stderr)
            if "wandb" in self.recipe.logging.report_to and os.environ.get("WANDB_MODE") not in (
                "offline",
                "disabled",
            ):
                try:
                    self.accelerator.get_tracker("wandb", unwrap=True).alert(title=title, text=text)
                except Exception:  # an alert must never take the run down
                    pass

    def _inject(self, kind: str, at: int | None, step: int) -> bool:
        if at is not None and step == at and kind not in self._fired:
            self._fired.add(kind)
            self.log.event("inject", step, what=kind)
            return True
        return False

    def enter_stage(self, prev: int, index: int) -> dict:
        """Apply the RoPE changes of stages prev+1..index to the live model (all earlier ones when resuming into a
        later stage), so `final/config.json` carries the RoPE the model was trained with. Returns rope_parameters."""
        unwrapped = self.accelerator.unwrap_model(self.model)
        if prev > index:  # rolled back into an earlier stage: rebuild RoPE from the recipe's own
            set_rope(unwrapped, self.base_rope[0], self.base_rope[1])
            prev = -1
        for k in range(prev + 1, index + 1):
            stage = self.recipe.stages[k]
            if stage.rope is not None:
                apply_stage_rope(unwrapped, stage.rope, stage.seq_len)
        return dict(unwrapped.config.rope_parameters or {})

    # ------------------------------------------------------------------ one optimizer step

    def _observe(self, loss: torch.Tensor, grad_norm: torch.Tensor | None) -> tuple[float, float | None]:
        """The step's mean loss over ranks and its gradient norm on the host: one transfer for both."""
        gn = grad_norm.float() if grad_norm is not None else torch.zeros((), device=loss.device)
        loss_v, gn_v = self.accelerator.reduce(torch.stack([loss, gn]), reduction="mean").tolist()
        return loss_v, (gn_v if grad_norm is not None else None)

    def train_step(
        self, batches: list[torch.Tensor], step: int = 0, measure_gns: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None, tuple[float, float | None] | None]:
        """Forward/backward over this rank's micro batches, then one clipped optimizer step.

        Returns:
            (mean loss on this rank, pre-clip global gradient norm) as device tensors, and, when spike handling is on,
            the host values of both (the step's only host sync; the NaN guard needs them before the update).
        """
        acc, model = self.accelerator, self.model
        model.train()
        inject = self.recipe.debug.inject
        if self._inject("corrupt_optimizer", inject.corrupt_optimizer_step, step):
            for state in self.optimizer.state.values():
                if "exp_avg" in state:
                    state["exp_avg"].mul_(1e4)
        nan = self._inject("nan", inject.nan_step, step)
        loss_sum = torch.zeros((), device=acc.device)
        grad_norm, observed = None, None
        for k, mb in enumerate(batches):
            mb = mb.to(acc.device, non_blocking=True)
            with acc.accumulate(model):
                out = model(input_ids=mb, labels=mb, use_cache=False)
                loss = out.loss * float("nan") if nan else out.loss
                acc.backward(loss)
                loss_sum += loss.detach().float()
                if measure_gns and k == 0:
                    # One micro batch's own gradient (still local, unsynced): Accelerate scaled it by 1/accumulation.
                    norms = [p.grad.detach().float().norm() for p in model.parameters() if p.grad is not None]
                    self._gns_small_sq = (torch.stack(norms).norm() * len(batches)) ** 2
                if acc.sync_gradients:
                    grad_norm = acc.clip_grad_norm_(model.parameters(), self.max_norm)
                    if grad_norm is not None and not torch.is_tensor(grad_norm):  # DeepSpeed reports a float
                        grad_norm = torch.tensor(float(grad_norm), device=acc.device)
                    if self.spikes is not None:
                        observed = self._observe(loss_sum / len(batches), grad_norm)
                    # The NaN guard: a non-finite loss or gradient never reaches the optimizer.
                    if observed is None or all(math.isfinite(v) for v in observed if v is not None):
                        self.optimizer.step()
                    else:
                        self.log.event("skipped_update", step, loss=observed[0], grad_norm=observed[1])
                    self.scheduler.step()
                    self.optimizer.zero_grad(set_to_none=True)
        if grad_norm is None and acc.distributed_type == DistributedType.DEEPSPEED:
            # DeepSpeed clips inside its own step and reports the pre-clip norm afterwards.
            norm = model.get_global_grad_norm()
            grad_norm = torch.as_tensor(norm if norm is not None else float("nan"), device=acc.device)
        loss = loss_sum / len(batches)
        if self.spikes is not None and observed is None:  # DeepSpeed: its engine has already stepped
            observed = self._observe(loss, grad_norm)
        return loss, grad_norm, observed

    # ------------------------------------------------------------------ evaluation

    @torch.no_grad()
    def evaluate(self, seq_len: int, micro: int) -> dict[str, float]:
        """Mean held-out loss per source, split over ranks; every rank runs the same number of forwards (ZeRO-3
        gathers parameters inside forward, so an uneven count would hang)."""
        acc, model = self.accelerator, self.model
        model.eval()
        names = used_sources(self.recipe)
        if (seq_len, micro) not in self._val_cache:  # the same held-out batches at every eval of a stage
            self._val_cache[(seq_len, micro)] = validation_batches(
                self.sources, names, seq_len, micro, self.recipe.eval.max_batches
            )
        val = self._val_cache[(seq_len, micro)]
        out = {}
        for name in names:
            batches = val[name]
            per_rank = math.ceil(len(batches) / acc.num_processes)
            total = torch.zeros(2, device=acc.device)
            for j in range(per_rank):
                k = j * acc.num_processes + acc.process_index
                real = k < len(batches)
                mb = batches[k if real else 0].to(acc.device)
                loss = model(input_ids=mb, labels=mb, use_cache=False).loss.float()
                total += torch.stack([loss * mb.numel() * real, torch.tensor(mb.numel() * real, device=acc.device)])
            total = acc.reduce(total, reduction="sum")
            out[f"val/{name}"] = (total[0] / total[1]).item()
        out["val/avg"] = sum(out.values()) / len(names)
        model.train()
        return out

    # ------------------------------------------------------------------ the run

    def train(self) -> dict[str, float]:
        """Train through every stage (resuming if asked), checkpointing and evaluating, then export `final/`.

        Returns:
            The last logged metrics.

        Raises:
            Preempted: SIGTERM/SIGINT arrived; a checkpoint was saved first.
        """
        for _ in self.steps():
            pass
        self.save_final()
        self.log.event("run_end", self.state.step, tokens=self.state.tokens)
        self.accelerator.end_training()
        return self.last

    def steps(self):
        """The loop as a generator: set up (or resume), then yield the step number after every optimizer step, with
        its logging, evaluation and checkpointing done. `train()` drains it; benchmarks interleave it."""
        acc, recipe = self.accelerator, self.recipe
        acc.init_trackers(
            recipe.logging.project,
            config=flatten(recipe_dict(recipe)),
            init_kwargs={"wandb": {"name": recipe.run.name, "dir": str(self.output_dir)}},
        )
        st = self.state = RunState()
        resumed = self.ckpt.resume(self.resume_spec, self.allow_recipe_change)
        if not resumed:
            self.log.event("run_start", 0, params=self.n_params, total_steps=self.total_steps, world=acc.num_processes)
            if findings := lint(recipe):
                self.log.event("lint", 0, findings=[f.to_dict() for f in findings])
        span, batcher = None, None
        last: dict[str, float] = {}
        self.last = last
        bar = tqdm(total=self.total_steps, initial=st.step, disable=not acc.is_local_main_process, desc="train")
        log_every, eval_every = recipe.logging.every_steps, recipe.eval.every_steps
        if eval_every and not resumed:
            # The baseline at initialisation: every later validation loss is read against it.
            first = self.spans[0]
            self.log.metrics(
                0, {"tokens": 0, "stage": first.name, **self.evaluate(first.seq_len, first.micro_batch_size)}
            )
        self.preempt = _PreemptFlag()
        window = _Window(acc.device)
        if self.spikes and not resumed:
            self.spikes.detector.start_grace(recipe.schedule.warmup_steps)
        self.ckpt.mark_clock()
        while st.step < self.total_steps:
            if span is None or st.step >= span.end_step:
                prev = span.index if span is not None else st.applied_stage
                span = stage_at(self.spans, st.step)
                batcher = self.batches_for(span.index)
                if span.index != st.stage_index:
                    st.stage_index, st.cursor = span.index, 0
                rope = self.enter_stage(prev, span.index)
                st.applied_stage = span.index
                if not (resumed and prev == span.index):
                    if self.spikes and span.index > 0 and st.step == span.start_step:
                        self.spikes.detector.start_grace(st.step)
                    self.log.event(
                        "stage_start", st.step, stage=span.name, seq_len=span.seq_len, tokens=span.tokens, rope=rope,
                        mixture=recipe.stages[span.index].mixture,
                        long_docs={n: t.n_long for n, t in batcher.tables.items() if t.n_long},
                    )  # fmt: skip
            lr = self.scheduler.get_last_lr()[0]
            skips = st.skips_for(span.index)
            cursor_before = st.cursor
            batches, st.cursor, consumed = batcher.step_batches(st.cursor, acc.process_index, acc.num_processes, skips)
            gns_now = self.gns is not None and (st.step + 1) % log_every == 0
            loss, grad_norm, observed = self.train_step(batches, st.step + 1, measure_gns=gns_now)
            tokens_before = st.tokens
            st.step += 1
            st.tokens += span.tokens_per_step
            window.add(st.step, loss, span.tokens_per_step)
            debug_kill_point(f"step:{st.step}")
            if self.spikes:
                self.spikes.record(st.step, span.index, cursor_before)
                if self.spikes.after_step(st.step, *observed):
                    window = _Window(acc.device)  # the rolled-back steps' losses are not this timeline's
                    bar.n = st.step
                    bar.refresh()
                    span, resumed = None, True
                    continue
            bar.update(1)
            log_now = st.step % log_every == 0 or st.step == self.total_steps
            reason = self.ckpt.due(tokens_before, st.tokens, st.step == span.end_step, log_now)
            if self.preempt.check(acc, log_now):
                reason = "preempt"
            if log_now or reason:
                last = self._log_window(window, span, lr, grad_norm, batcher)
                bar.set_postfix(loss=f"{last['loss']:.3f}", lr=f"{lr:.2e}", tok_s=f"{last['tokens_per_s']:.0f}")
            if (eval_every and st.step % eval_every == 0) or st.step == self.total_steps:
                vals = self.evaluate(span.seq_len, span.micro_batch_size)
                self.log.metrics(st.step, {"tokens": st.tokens, "stage": span.name, **vals})
                last.update(vals)
                if acc.is_main_process:  # the same check as check_run.py, on what is logged so far
                    health = report(self.output_dir, verify_checkpoint=False)
                    self.log.event("health", st.step, verdict=health["verdict"], reasons=health["reasons"])
                window.reset_clock()  # eval time is not training throughput
            if reason or st.step == self.total_steps:
                self.ckpt.save(reason or "end")
                window.reset_clock()
            if reason == "preempt":
                self.ckpt.finish()
                bar.close()
                raise Preempted(f"preempted at step {st.step}: checkpoint saved; continue with --resume auto")
            self.last = last
            yield st.step
        bar.close()
        self.ckpt.finish()

    def _log_window(self, window: _Window, span, lr: float, grad_norm, batcher) -> dict:
        """One metrics line: the window's mean loss plus every step's loss (one host sync for all of them)."""
        acc, st = self.accelerator, self.state
        steps, losses = window.flush(acc)
        self.recent_losses.extend(losses)
        record = {
            "tokens": st.tokens,
            "stage": span.name,
            "loss": sum(losses) / len(losses),
            "lr": lr,
            "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "tokens_per_s": window.tokens_per_s(),
            "step_losses": [[s, v] for s, v in zip(steps, losses)],
            **{f"data/repeats/{n}": c for n, c in batcher.repeats.items()},
        }
        if self.gns is not None and self._gns_small_sq is not None and grad_norm is not None:
            b_small = span.micro_batch_size * span.seq_len
            small_sq = acc.reduce(self._gns_small_sq, reduction="mean").item()
            value = self.gns.update(b_small, span.tokens_per_step, small_sq, float(grad_norm) ** 2)
            self._gns_small_sq = None
            if value is not None:
                record["gns/b_simple"] = value
        self.log.metrics(st.step, record)
        return record

    def save_final(self) -> Path:
        """`final/`: save_pretrained model (safetensors) + tokenizer, loadable by AutoModelForCausalLM."""
        acc = self.accelerator
        final = self.output_dir / "final"
        acc.wait_for_everyone()
        state = acc.get_state_dict(self.model)  # gathers ZeRO-3 / FSDP shards onto the main process
        unwrapped = acc.unwrap_model(self.model)
        unwrapped.save_pretrained(final, state_dict=state, is_main_process=acc.is_main_process, save_function=acc.save)
        if acc.is_main_process:
            self.tokenizer.save_pretrained(final)
        acc.wait_for_everyone()
        return final
