"""The training loop, composed of small stateful parts; the same loop on one CPU process and on many nodes.
`steps()`: enter the step's stage, take one step, then re-read what a rollback restored or do the periodic work."""

from __future__ import annotations

import os
import time
from functools import partial
from pathlib import Path

import torch
from accelerate.utils import DistributedType, set_seed
from tqdm.auto import tqdm

from .checkpoint import CheckpointManager, Restored
from .console import announce, end_block, start_block
from .data.pipeline import StageBatches, get_tokenizer, load_sources
from .downstream import Downstream
from .engine import StepRunner, configure_deepspeed, make_accelerator, param_groups
from .evaluation import Evaluator, eval_due, sample_losses
from .export import save_final
from .faults import StepFaults, kill_point
from .gns import NoiseScale
from .health import HealthMonitor
from .lint import lint
from .masking import model_inputs
from .meters import LossStats, StepWindow, mfu, peak_tflops, train_record
from .model import StageRope, build_config, build_model, count_params, flops_per_token, non_embedding_params
from .preemption import Preempted, PreemptFlag
from .recipe import flatten, recipe_dict, recipe_hash
from .recovery import SpikeHandler, resume_run
from .rundir import RunDir
from .schedules import LRController, lr_lambda
from .sections import Recipe
from .state import RunState
from .tracking import RunLog, alert, quiet_known_noise
from .wandb_history import init_trackers


class Trainer:
    """Runs a recipe. `Trainer(recipe).train()` is the whole program."""

    def __init__(self, recipe: Recipe, output_dir: str | Path | None = None, overwrite: bool = False,
                 resume: str = "none", allow_recipe_change: bool = False, deep_verify: bool = False):  # fmt: skip
        self.recipe, self.plan, self.deep_verify = recipe, recipe.plan, deep_verify
        self.output_dir = Path(output_dir or recipe.output_dir)
        self.resume_spec, self.allow_recipe_change = resume, allow_recipe_change
        self.rundir = RunDir(self.output_dir, resume, overwrite)
        self.preempt = PreemptFlag()  # before any long work: a SIGTERM from here on ends the run with exit 75
        with self.rundir.released_after(always=False):
            self._setup()

    def _setup(self) -> None:
        recipe = self.recipe
        self.spans, self.total_steps = list(self.plan.spans), self.plan.total_steps
        self.grad_accum = self.plan.grad_accum(int(os.environ.get("WORLD_SIZE", "1")))
        self.accelerator = acc = make_accelerator(recipe, self.output_dir, self.grad_accum)
        quiet_known_noise()
        with acc.main_process_first():
            self.tokenizer = get_tokenizer(recipe)
            self.sources = load_sources(recipe, self.tokenizer)
        self.available = {n: len(s.train.tokens) for n, s in self.sources.items()}  # for the linter's PT014
        self._build_model()
        self.rundir.clear_old_run()  # --overwrite: only now, with everything of the new run known good
        acc.wait_for_everyone()
        self.log = RunLog(self.output_dir, acc, enabled=acc.is_main_process)
        if acc.is_main_process:
            announce(recipe, self.output_dir, self.available)
        self._build_parts()

    def _build_model(self) -> None:
        recipe, acc, tok = self.recipe, self.accelerator, self.tokenizer
        set_seed(recipe.run.seed)  # the same initial weights on every rank and every run
        self.config = build_config(recipe.model, vocab_size=len(tok), eos_token_id=tok.eos_token_id,
                                   pad_token_id=tok.pad_token_id)  # fmt: skip
        model = build_model(recipe.model, self.config)
        self.n_params, self.n_non_emb = count_params(model), non_embedding_params(model)
        self.peak = peak_tflops(recipe.logging.peak_tflops)
        opt = recipe.optimizer
        # Fused AdamW (one kernel for all parameters) exists for CUDA and CPU; it is what the HF Trainer uses too.
        self.fused = opt.fused if opt.fused is not None else True
        optimizer = torch.optim.AdamW(param_groups(model, opt.weight_decay), lr=opt.lr, betas=opt.betas, eps=opt.eps,
                                      fused=self.fused or None)  # fmt: skip
        configure_deepspeed(acc, self.plan, self.grad_accum)
        self.model, self.optimizer = acc.prepare(model, optimizer)
        # Not registered with Accelerate: the LR is a function of the step, which meta.json holds.
        self.scheduler = LRController(self.optimizer, lr_lambda(recipe), opt.lr)
        self.rope = StageRope(acc.unwrap_model(self.model), recipe.stages)

    def _build_parts(self) -> None:
        recipe, acc = self.recipe, self.accelerator
        self.state, self.loss_stats = RunState(), LossStats()
        attn = acc.unwrap_model(self.model).config._attn_implementation
        self.inputs = model_inputs(recipe.data.document_masking, self.tokenizer.eos_token_id, attn)
        # The noise scale needs one micro batch's own gradient: not available when DeepSpeed/FSDP shard gradients,
        # nor when a step is a single micro batch on a single process.
        plain = acc.distributed_type not in (DistributedType.DEEPSPEED, DistributedType.FSDP)
        self.gns = NoiseScale() if plain and self.grad_accum > 1 else None
        parts = {"lr": self.scheduler, "loss_stats": self.loss_stats, **({"gns": self.gns} if self.gns else {})}
        self.ckpt = CheckpointManager(
            acc, recipe.checkpoint, self.output_dir / "checkpoints", model=self.model, optimizer=self.optimizer,
            state=self.state, parts=parts, recipe=recipe_dict(recipe), recipe_hash=recipe_hash(recipe),
            stage_names=[s.name for s in self.spans], log=self.log,
            extra_files={"tokenizer": self.tokenizer.save_pretrained},
        )  # fmt: skip
        self.ckpt.deep_verify = self.deep_verify
        self.spikes = None
        if recipe.spikes.enabled:

            def losses(stage, cursor, skips):  # a past step's per-sample losses, for blame
                return sample_losses(acc, self.model, self.batches_for(stage), cursor, skips, self.inputs)

            self.spikes = SpikeHandler(recipe.spikes, self.state, self.ckpt, losses, self.log,
                                       partial(alert, acc, recipe.logging.report_to), self.output_dir,
                                       acc.is_main_process)  # fmt: skip
            parts["spikes"] = self.spikes  # the manager holds `parts`: the handler is saved with the rest
        self.evaluate = Evaluator.for_recipe(acc, self.model, self.sources, recipe, self.inputs)
        self.downstream = Downstream(acc, self.model, self.tokenizer, recipe.eval.lm_eval, self.total_steps)
        faults = StepFaults(recipe.debug.inject, self.log)
        self.runner = StepRunner(acc, self.model, self.optimizer, self.scheduler, self.plan.max_grad_norm, faults,
                                 self.log, guard=self.spikes is not None, inputs=self.inputs)  # fmt: skip
        self.health = HealthMonitor(self.output_dir) if acc.is_main_process else None
        if self.health is not None:
            self.log.observers.append(self.health)
        self._batchers: dict[int, StageBatches] = {}
        self.applied_stage = -1  # stages whose RoPE changes are in the live model
        self.span, self.batcher, self.last = None, None, {}

    # ------------------------------------------------------------------ collaborators

    def batches_for(self, stage: int) -> StageBatches:
        if stage not in self._batchers:
            self._batchers[stage] = StageBatches(self.recipe, self.spans[stage], self.sources, self.config.vocab_size)
        return self._batchers[stage]

    # ------------------------------------------------------------------ the run

    def train(self) -> dict[str, float]:
        """Train through every stage (resuming if asked), checkpointing and evaluating, then export `final/`.
        Returns the last logged metrics; raises Preempted (after a checkpoint) on SIGTERM/SIGINT."""
        with self.rundir.released_after():
            for _ in self.steps():
                pass
            self.save_final()
            self.log.event("run_end", self.state.step, tokens=self.state.tokens)
        self.accelerator.end_training()
        if self.health is not None:
            print(end_block(self.output_dir, self.health.val, self.log.counts, self.recipe.logging.report_to,
                            self.health.context))  # fmt: skip
        return self.last

    def steps(self):
        """The loop as a generator: set up (or resume), then yield the step number after every optimizer step, with
        its logging, evaluation and checkpointing done. `train()` drains it; benchmarks interleave it."""
        self._start()
        while self.state.step < self.total_steps:
            self._enter_stage()
            restored = self._one_step()
            if restored is not None:
                self._after_rollback()
                continue
            self._periodic()
            yield self.state.step
        self.bar.close()
        self.ckpt.finish()

    def _start(self) -> None:
        acc, recipe = self.accelerator, self.recipe
        init_trackers(acc, recipe, self.output_dir, self.log, config=flatten(recipe_dict(recipe)))
        restored = resume_run(self.ckpt, self.spikes, self.state, self.log, self.output_dir, self.resume_spec,
                              self.allow_recipe_change, acc.is_main_process)  # fmt: skip
        if acc.is_main_process:
            print(start_block(recipe, self.n_params, acc.num_processes, recipe.logging.report_to, self.output_dir,
                              str(restored.path) if restored else None), flush=True)  # fmt: skip
        if restored is None:
            self.log.event("run_start", 0, params=self.n_params, total_steps=self.total_steps, world=acc.num_processes)
            if findings := lint(recipe, self.available):
                self.log.event("lint", 0, findings=[f.to_dict() for f in findings])
        self.bar = tqdm(total=self.total_steps, initial=self.state.step, disable=not acc.is_local_main_process,
                        desc="train")  # fmt: skip
        if recipe.eval.every_steps and restored is None:
            # The baseline at initialisation: every later validation loss is read against it.
            first = self.spans[0]
            vals = {**self.evaluate(first.seq_len, first.micro_batch_size), **self.downstream(0)}
            self.log.metrics(0, {"tokens": 0, "stage": first.name, **vals})
        if self.preempt.check(acc, log_step=True):  # stopped before training began: the last checkpoint stands
            raise Preempted("preempted before the first step; nothing new to save; continue with --resume auto")
        self.window = StepWindow()
        if self.spikes and restored is None:
            self.spikes.start_grace(recipe.schedule.warmup_steps)
        self.ckpt.mark_clock()

    def _enter_stage(self) -> None:
        """At a stage boundary (or after a resume or rollback): pick the stage, its batches and its RoPE."""
        st = self.state
        if self.span is not None and st.step < self.span.end_step:
            return
        prev = self.span.index if self.span is not None else self.applied_stage
        span = self.span = self.plan.stage_at(st.step)
        self.batcher = self.batches_for(span.index)
        if span.index != st.stage_index:
            st.stage_index, st.cursor = span.index, 0
        rope = self.rope.enter(prev, span.index)  # RoPE as trained, into final/config.json
        self.applied_stage = span.index
        if prev == span.index:  # back in the stage we were in (a rollback): nothing new starts
            return
        if self.spikes and span.index > 0 and st.step == span.start_step:
            self.spikes.start_grace(st.step)
        self.log.event(
            "stage_start", st.step, stage=span.name, seq_len=span.seq_len, tokens=span.tokens, rope=rope,
            mixture=self.recipe.stages[span.index].mixture,
            long_docs={n: t.n_long for n, t in self.batcher.tables.items() if t.n_long},
        )  # fmt: skip

    def _one_step(self) -> Restored | None:
        """One optimizer step and the spike handler's verdict on it; returns what a rollback restored, if any."""
        st, span, acc = self.state, self.span, self.accelerator
        self.lr = self.scheduler.get_last_lr()[0]
        cursor, t0 = st.cursor, time.perf_counter()
        batches, st.cursor, _ = self.batcher.step_batches(cursor, acc.process_index, acc.num_processes,
                                                          st.skips_for(span.index))  # fmt: skip
        self.window.data_s += time.perf_counter() - t0  # host time building the step's batches: the data wait
        gns_now = self.gns is not None and (st.step + 1) % self.recipe.logging.every_steps == 0
        self.result = self.runner(batches, st.step + 1, measure_gns=gns_now)
        self.tokens_before = st.tokens
        st.step += 1
        st.tokens += span.tokens_per_step
        self.window.add(st.step, self.result.loss, span.tokens_per_step)
        kill_point(f"step:{st.step}")
        if self.spikes is None:
            return None
        self.spikes.record(st.step, span.index, cursor)
        return self.spikes.after_step(st.step, *self.result.observed)

    def _after_rollback(self) -> None:
        self.window = StepWindow()  # the rolled-back steps' losses are not this timeline's
        self.bar.n, self.span = self.state.step, None  # re-enter the stage the restored step is in
        self.bar.refresh()

    def _periodic(self) -> None:
        """After a step: log, evaluate, checkpoint, and stop cleanly on preemption."""
        st, span, acc = self.state, self.span, self.accelerator
        self.bar.update(1)
        log_now = st.step % self.recipe.logging.every_steps == 0 or st.step == self.total_steps
        reason = self.ckpt.due(self.tokens_before, st.tokens, st.step == span.end_step, log_now)
        if self.preempt.check(acc, log_now):
            reason = "preempt"
        if log_now or reason:
            self.last = self._log_train()
            self.bar.set_postfix(loss=f"{self.last['loss']:.3f}", lr=f"{self.lr:.2e}",
                                 tok_s=f"{self.last['tokens_per_s']:.0f}")  # fmt: skip
        now, context = eval_due(self.recipe, st.step, span)
        if now:
            self._eval(context)
        if reason or st.step == self.total_steps:
            self.ckpt.save(reason or "end")
            self.window.reset_clock()
        if reason == "preempt":
            self.ckpt.finish()
            self.bar.close()
            raise Preempted(f"preempted at step {st.step}: checkpoint saved; continue with --resume auto")

    def _log_train(self) -> dict:
        """One metrics line (one host sync for all of the window's losses): loss, LR, grad norm, throughput, MFU,
        memory, data wait, checkpoint blocking."""
        st, span, grad_norm = self.state, self.span, self.result.grad_norm
        steps, losses = self.window.flush(self.accelerator)
        self.loss_stats.extend(losses)
        record = train_record(
            steps, losses, self.window, tokens=st.tokens, stage=span.name, lr=self.lr,
            grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
            **{f"data/repeats/{n}": c for n, c in self.batcher.repeats.items()},
            **({"ckpt/blocked_s": self.ckpt.take_blocked()} if self.ckpt.blocked_s else {}),
        )  # fmt: skip
        if self.peak is not None:  # model FLOPs per device-second over the device's peak
            fpt = flops_per_token(self.config, self.n_non_emb, span.seq_len)
            record["mfu"] = mfu(record["tokens_per_s"], fpt, self.accelerator.num_processes, self.peak)
        if self.gns is not None and (value := self.runner.noise_scale(self.gns, span, grad_norm)) is not None:
            record["gns/b_simple"] = value
        self.log.metrics(st.step, record)
        return record

    def _eval(self, context: bool) -> None:  # held-out losses (+ loss by position) and downstream scores
        st, span = self.state, self.span
        vals = {**self.evaluate(span.seq_len, span.micro_batch_size, context), **self.downstream(st.step)}
        self.log.metrics(st.step, {"tokens": st.tokens, "stage": span.name, **vals})
        if self.evaluate.context is not None:
            self.log.event("context", st.step, **self.evaluate.context)
        self.last.update(vals)
        if self.health is not None:  # the same verdict as check_run.py, on what is logged so far
            verdict, reasons = self.health.verdict()
            self.log.event("health", st.step, verdict=verdict, reasons=reasons)
        self.window.reset_clock()  # eval time is not training throughput

    def save_final(self) -> Path:  # `final/`: save_pretrained model + tokenizer
        return save_final(self.accelerator, self.model, self.tokenizer, self.output_dir / "final")
