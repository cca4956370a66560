"""The training loop, composed of small stateful parts; the same loop on one CPU process and on many nodes.
`steps()`: enter the step's stage, take one step, then re-read what a rollback restored or do the periodic work."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import NamedTuple

from accelerate.utils import DistributedType

from ..analysis.outlook import Forecaster
from ..analysis.verdicts import HealthMonitor
from ..checkpoint import NOTHING, CheckpointManager, Restored, read_meta
from ..checkpoint.export import save_final
from ..data.pipeline import StageBatches, get_tokenizer, load_sources, preparation_lock
from ..evaluation.downstream import Downstream
from ..evaluation.validation import Evaluator, eval_due, sample_losses
from ..faults import kill_point
from ..model.build import compute_of
from ..model.masking import model_inputs
from ..noise import quiet_bars_in_files, quiet_library_noise
from ..observe import events as ev
from ..observe.meters import LossStats, StepWindow, mfu, peak_tflops, train_record
from ..observe.steprecord import StepRecorder
from ..observe.tracking import RunLog, alert
from ..observe.wandb_history import init_trackers
from ..recipe.lint import lint
from ..recipe.loading import flatten, recipe_dict, recipe_hash
from ..recipe.schema import Recipe
from ..runtime import fp8_capable
from ..stability.decisions import Abort, Decision, Ok, Rollback, StepAt, StepReport
from ..stability.recovery import SpikeAbort, SpikeHandler, read_ledger, write_ledger
from ..stability.skip_step import SkipStep
from .accelerator import launch_findings, make_accelerator
from .averaging import WeightAverage
from .build import build
from .console import Progress, announce, end_block, start_block
from .evals import EvalRound
from .hooks import FaultHook, LayerHook, NoiseHook, ProbeHook, StepHook, ZLossHook
from .inject import StepFaults, stage_batches, wants_step_faults
from .measures.layers import layer_stats_for
from .measures.noise_scale import noise_scale_for
from .measures.probe import OptimizerProbe
from .preemption import Preempted, PreemptFlag
from .resume import check_resumable, choose_checkpoint, continue_plan, likely_checkpoint, record_changes
from .rundir import RunDir
from .saving import SaveClock
from .startup import run_identity
from .state import Parts, RunState
from .step import StepOutcome, StepRunner


class Stepped(NamedTuple):
    """One step as the loop holds it: the step's own outcome (device values, for the metrics row) and what the
    parts read of it."""

    outcome: StepOutcome
    report: StepReport


class Trainer:
    """Runs a recipe. `Trainer(recipe).train()` is the whole program."""

    def __init__(
        self,
        recipe: Recipe,
        output_dir: str | Path | None = None,
        overwrite: bool = False,
        resume: str = "none",
        allow_recipe_change: bool | tuple[str, ...] = False,
        allow_data_change: bool = False,
        deep_verify: bool = False,
        branch: bool = False,
        job_type: str | None = None,
    ):
        """Args:
        branch: `resume` is the checkpoint of another run this one starts from (a branch decay, a batch branch):
            its output directory must be a new run's (`rundir.check_new_run_target`).
        job_type: the trackers' job type (`train`, `branch`, `critical-batch`); default `branch` for a branch."""
        self.job_type = job_type or ("branch" if branch else "train")
        self.progress_total: int | None = None
        """Where the progress line counts to (a batch branch stops early: its own last step), and its label."""
        self.progress_label = "train"
        self.output_dir = Path(output_dir or recipe.output_dir)
        # before anything is built: a resume under another batch plan continues from the checkpoint's tokens
        self.likely = likely_checkpoint(self.output_dir, resume)  # read once: the plan and the early checks use it
        recipe = continue_plan(recipe, self.likely, allow_recipe_change)
        self.recipe = recipe
        self.plan = recipe.plan
        self.deep_verify = deep_verify
        self.recipe_plain = recipe_dict(recipe)
        self.recipe_hash = recipe_hash(recipe)
        self.resume_spec = resume
        self.allow_recipe_change = allow_recipe_change
        self.allow_data_change = allow_data_change
        self.rundir = RunDir(self.output_dir, resume, overwrite, old_dirs=(recipe.logging.project,), branch=branch)
        self.preempt = PreemptFlag()  # before any long work: a SIGTERM from here on ends the run with exit 75
        with self.rundir.released_after(always=False):
            self._setup()

    def _setup(self) -> None:
        recipe = self.recipe
        self.spans = list(self.plan.spans)
        self.total_steps = self.plan.total_steps
        self.grad_accum = self.plan.grad_accum(int(os.environ.get("WORLD_SIZE", "1")))
        self.accelerator = acc = make_accelerator(recipe, self.output_dir, self.grad_accum)
        quiet_library_noise()
        quiet_bars_in_files()
        with acc.main_process_first(), preparation_lock(recipe.data.cache_dir, acc.is_main_process):
            self.tokenizer = get_tokenizer(recipe)
            self.sources = load_sources(recipe, self.tokenizer)
        available = {n: len(s.train.tokens) for n, s in self.sources.items()}  # for the linter's PT014
        self.data_keys = {n: s.key for n, s in self.sources.items()}  # data identity, in every checkpoint
        if self.likely is not None:
            self._resumable(*self.likely)  # a refusal before anything of the run is written (or built)
        recipe_findings = lint(recipe, available, fp8_capable())
        launch_found = launch_findings(recipe, acc, len(self.tokenizer))
        self.findings = recipe_findings + launch_found
        self._build_model()
        self.rundir.clear_old_run()  # --overwrite: only now, with everything of the new run known good
        acc.wait_for_everyone()
        self.log = RunLog(self.output_dir, acc, enabled=acc.is_main_process)
        self.identity = run_identity(acc, self.output_dir, self.resume_spec, recipe.checkpoint.remote, self.log)
        if acc.is_main_process:
            # a branch continues its parent as trained: the recipe's findings were the parent's to act on
            if self.job_type == "train":
                announce(recipe, self.output_dir, self.findings)
            else:
                announce(recipe, self.output_dir, launch_found, inherited=recipe_findings)
        self._build_parts()

    def _build_model(self) -> None:
        self.built = build(self.recipe, self.accelerator, self.tokenizer, self.plan, self.grad_accum)
        self.model = self.built.model
        self.optimizer = self.built.optimizer
        self.scheduler = self.built.scheduler
        self.config = self.built.config
        self.rope = self.built.rope
        self.n_params = self.built.n_params
        self.n_non_emb = self.built.n_non_emb
        self.peak = peak_tflops(self.recipe.logging.peak_tflops)

    def _build_parts(self) -> None:
        recipe, acc = self.recipe, self.accelerator
        self.state = RunState()
        self.loss_stats = LossStats()
        attn = acc.unwrap_model(self.model).config._attn_implementation
        self.inputs = model_inputs(recipe.data.document_masking, self.tokenizer.eos_token_id, attn)
        self.gns = noise_scale_for(recipe, acc, self.model, self.plan)
        self.average = WeightAverage.for_section(
            recipe.averaging, acc, self.model, recipe.schedule.warmup_steps, recipe.eval.every_steps
        )
        self.ckpt = CheckpointManager(
            acc,
            recipe.checkpoint,
            self.output_dir / "checkpoints",
            model=self.model,
            optimizer=self.optimizer,
            log=self.log,
            extra_files={"tokenizer": self.tokenizer.save_pretrained},
            sidecars={"averaging": self.average} if self.average is not None else None,
            deep_verify=self.deep_verify,
            identity=self.identity,
        )
        self.save_clock = SaveClock(recipe.checkpoint, acc)
        self.layer_stats = layer_stats_for(recipe, acc, self.model)
        self.spikes = self._spike_handler() if recipe.spikes.enabled else None
        # the guard (one host read of loss and grad norm before each update) serves the spike rule and skip-step
        self.guard = recipe.spikes.enabled or recipe.stability.skip_step.enabled
        self.skip = SkipStep(recipe.stability.skip_step, self.log) if self.guard else None
        self.parts = Parts()  # told of each moment in this order: skip-step's event of a step before a spike's
        self.parts.register_state({"lr": self.scheduler, "loss_stats": self.loss_stats, "gns": self.gns})
        self.parts.register_all({"skip_step": self.skip, "spikes": self.spikes, "averaging": self.average})
        self.runner = StepRunner(
            acc,
            self.model,
            self.optimizer,
            self.scheduler,
            self.plan.max_grad_norm,
            guard=self.guard,
            inputs=self.inputs,
            skip=self.skip,
            hooks=self._step_hooks(),
        )
        self.record = StepRecorder(self.output_dir, acc.is_main_process)
        self.health = HealthMonitor(self.output_dir) if acc.is_main_process else None
        if self.health is not None:
            self.log.reader = self.health
        self.evals = EvalRound(
            evaluate=Evaluator.for_recipe(acc, self.model, self.sources, recipe, self.inputs),
            downstream=Downstream(acc, self.model, self.tokenizer, recipe.eval.lm_eval, self.total_steps),
            forecaster=Forecaster.for_recipe(recipe),
            log=self.log,
            health=self.health,
            average=self.average,
        )
        self.parts.register_state({"forecast": self.evals.forecaster})
        self._batchers: dict[int, StageBatches] = {}
        self.applied_stage = -1  # stages whose RoPE changes are in the live model
        self.span = None
        self.batcher = None
        self.phase = None  # the batch phase whose size the accelerator (and DeepSpeed's engine) is set to
        self.last = {}
        self.progress: Progress | None = None

    def _step_hooks(self) -> list[StepHook]:
        """The optional work around each step that the recipe turned on, in the order the step calls it."""
        recipe, acc = self.recipe, self.accelerator
        hooks: list[StepHook] = []
        if wants_step_faults(recipe.debug.inject):
            faults = StepFaults(recipe.debug.inject, self.log)
            hooks.append(FaultHook(faults, self.optimizer, acc.process_index, acc.num_processes))
        if self.gns is not None:
            hooks.append(NoiseHook(self.gns, self.model))
        if self.layer_stats is not None:
            hooks.append(LayerHook(self.layer_stats))
        if self.built.assignment.muon:
            hooks.append(
                ProbeHook(
                    OptimizerProbe(
                        self.optimizer, recipe.logging.every_steps, True, self.built.probed, self.built.probe_gather
                    )
                )
            )
        if self.built.zloss is not None:
            hooks.append(ZLossHook(self.built.zloss, acc.device))
        return hooks

    def _spike_handler(self) -> SpikeHandler:
        alerts = partial(alert, self.accelerator, self.recipe.logging.report_to)
        leads = self.layer_stats.leaders if self.layer_stats is not None else None
        handler = SpikeHandler(self.recipe.spikes, self.ckpt.newest_good, self.log, alerts, leads)
        handler.start_grace(self.recipe.schedule.warmup_steps)  # a resume replaces it with the checkpoint's
        return handler

    # ------------------------------------------------------------------ collaborators

    def batches_for(self, stage: int) -> StageBatches:
        if stage not in self._batchers:
            self._batchers[stage] = stage_batches(
                self.recipe.stages[stage],
                self.spans[stage],
                self.sources,
                self.recipe.run.seed,
                self.config.vocab_size,
                self.recipe.debug.inject,
            )
        return self._batchers[stage]

    # ------------------------------------------------------------------ the run

    def train(self, after: Callable[[Path, RunLog, int], None] | None = None) -> dict[str, float]:
        """Train through every stage (resuming if asked), checkpointing and evaluating, then export `final/`.
        Returns the last logged metrics; raises Preempted (after a checkpoint) on SIGTERM/SIGINT.

        Args:
            after: called on the main process with (run directory, run log, last step) once `final/` is saved,
                while the run directory is still held: the script's publishing (`publishing.hub.publish_run`).
        """
        with self.rundir.released_after():
            for _ in self.steps():
                pass
            self.save_final()
            self.log.event(ev.RUN_END, self.state.step, tokens=self.state.tokens)
            if after is not None and self.accelerator.is_main_process:
                after(self.output_dir, self.log, self.state.step)
        self.accelerator.end_training()
        if self.health is not None:
            h, trackers = self.health, self.recipe.logging.report_to
            print(end_block(self.output_dir, h.val, self.log.counts, trackers, h.context, h.downstream))
        return self.last

    def steps(self):
        """The loop as a generator: set up (or resume), then yield the step number after every optimizer step, with
        its logging, evaluation and checkpointing done. `train()` drains it; benchmarks interleave it."""
        try:
            self._start()
            while self.state.step < self.total_steps:
                self._enter_stage()
                self._enter_batch()
                stepped = self._one_step()
                if isinstance(decision := self._decide(stepped.report), Ok):
                    self._periodic(stepped.outcome)
                    yield self.state.step
                else:
                    self._act(decision)
        finally:  # however the loop ends, the bar ends its line: an `error:` after it starts a line of its own
            if self.progress is not None:
                self.progress.close()
            self.record.close()  # the steps judged since the last write (a crash loses only the unflushed ones)
        self.ckpt.finish()

    def _start(self) -> None:
        acc, recipe = self.accelerator, self.recipe
        init_trackers(acc, recipe, self.output_dir, self.log, flatten(self.recipe_plain), self.job_type)
        restored = self._resume()
        if acc.is_main_process and self.job_type != "critical-batch":  # a batch branch: critical_batch.py says it
            resumed, trackers = str(restored.path) if restored else None, recipe.logging.report_to
            print(
                start_block(recipe, self.n_params, acc.num_processes, trackers, self.output_dir, resumed), flush=True
            )
        if restored is None:
            self.log.event(
                ev.RUN_START, 0, params=self.n_params, total_steps=self.total_steps, world=acc.num_processes
            )
            self.log.event(
                ev.OPTIMIZER,
                0,
                type=recipe.optimizer.type,
                **self.built.assignment.summary(acc.unwrap_model(self.model)),
            )
            if self.findings:
                self.log.event(ev.LINT, 0, findings=[f.to_dict() for f in self.findings])
        total = self.progress_total or self.total_steps
        self.progress = Progress(total, self.state.step, acc.is_main_process, label=self.progress_label)
        if recipe.eval.every_steps and restored is None:
            # The baseline at initialisation: every later validation loss is read against it.
            first = self.spans[0]
            self.progress.note(self._eval_note(0))
            vals = self.evals.baseline(first)
            self.log.metrics(0, {"tokens": 0, "stage": first.name, **vals})
            self.progress.evaluated(0, vals)
        if self.preempt.check(acc, log_step=True):  # stopped before training began: the last checkpoint stands
            raise Preempted(
                "preempted before the first step: nothing new to save; requeue or run again with --resume auto"
            )
        self.window = StepWindow()
        self.save_clock.mark()

    def _eval_note(self, step: int) -> str:
        lm = self.recipe.eval.lm_eval
        what = "held-out losses" + (f" and lm-eval ({', '.join(lm.tasks)})" if self.evals.downstream.due(step) else "")
        return f"evaluating at step {step:,}: {what}" + (
            " (the baseline every later eval is read against)" * (step == 0)
        )

    def _enter_stage(self) -> None:
        """At a stage boundary (or after a resume or rollback): pick the stage, its batches and its RoPE."""
        st = self.state
        if self.span is not None and st.step < self.span.end_step:
            return
        prev = self.span.index if self.span is not None else self.applied_stage
        span = self.span = self.plan.stage_at(st.step)
        self.batcher = self.batches_for(span.index)
        if span.index != st.stage_index:
            st.stage_index = span.index
            st.cursor = 0
        rope = self.rope.enter(prev, span.index)  # RoPE as trained, into final/config.json
        self.applied_stage = span.index
        if prev == span.index:  # back in the stage we were in (a rollback): nothing new starts
            return
        if span.index > 0 and st.step == span.start_step:
            self.parts.stage_start(st.step, st.tokens)
        self.log.event(
            ev.STAGE_START,
            st.step,
            stage=span.name,
            seq_len=span.seq_len,
            tokens=span.tokens,
            rope=rope,
            mixture=self.recipe.stages[span.index].mixture,
            long_docs={n: t.n_long for n, t in self.batcher.tables.items() if t.n_long},
        )

    def _enter_batch(self) -> None:
        """At a batch change (or after a resume or rollback): set the accumulation of this step's batch phase in
        Accelerate (and DeepSpeed's engine); a change met live restarts the spike rule's grace, like a stage."""
        st, acc = self.state, self.accelerator
        phase = self.plan.batch_at(st.step)
        if phase == self.phase:
            return
        self.phase = phase
        accum = self.plan.grad_accum(acc.num_processes, st.step)
        if accum != acc.gradient_accumulation_steps:
            acc.gradient_accumulation_steps = accum
            acc.step = 0  # Accelerate's micro-batch count: every step boundary is a multiple of the old accumulation
            if acc.distributed_type == DistributedType.DEEPSPEED:  # its loss scaling and boundary follow its config
                self.model.set_train_batch_size(
                    self.model.train_micro_batch_size_per_gpu() * accum * acc.num_processes
                )
        if st.step != phase.start_step or st.step == 0:
            return
        self.parts.batch_change(st.step)
        self.log.event(
            ev.BATCH_CHANGE,
            st.step,
            global_batch_tokens=phase.tokens_per_step,
            grad_accum=accum,
            lr_factor=self.plan.lr_scale(st.step),
            tokens=st.tokens,
        )

    def _one_step(self) -> Stepped:
        """One optimizer step on the stage's next batches; the run state moves on by one step."""
        st, span, acc = self.state, self.span, self.accelerator
        self.lr = self.scheduler.get_last_lr()[0]
        size = self.phase.tokens_per_step
        cursor, t0 = st.cursor, time.perf_counter()
        skips = st.skips_for(span.index)
        drawn = self.batcher.step_batches(cursor, acc.process_index, acc.num_processes, skips, size // span.seq_len)
        st.cursor = drawn.cursor
        self.window.data_s += time.perf_counter() - t0  # host time building the step's batches: the data wait
        outcome = self.runner(drawn.batches, st.step + 1)
        self.tokens_before = st.tokens
        st.step += 1
        st.tokens += size
        self.window.add(st.step, outcome.loss, size)
        observed = outcome.observed
        self.record.observe(st.step, self._epoch(), observed, outcome.applied, span.index, st.tokens)
        kill_point(f"step:{st.step}")
        report = StepReport(st.step, span.index, cursor, st.tokens, size, observed, outcome.applied, outcome.skipped)
        return Stepped(outcome, report)

    def _decide(self, report: StepReport) -> Decision:
        """What the parts make of the step, in registration order: skip-step counts an update it held back (it
        judged inside the step: it must, before the update), the spike handler records and judges the step (a
        rollback or a stop), the weight average takes an applied update before an eval reads it."""
        return self.parts.after_step(report)

    def _act(self, decision: Decision) -> None:
        """The one place where a decision changes the run: stop, or roll back."""
        if isinstance(decision, Abort):
            raise SpikeAbort(decision.message, decision.exit_code)
        self._roll_back(decision)

    def _roll_back(self, rollback: Rollback) -> None:
        """A rollback, in its one order: keep the rolled-back steps' record, restore the target (weights,
        optimizer, RNG; the run's position; each part, the spike handler its detector only), measure the spike's
        samples under the restored weights and skip those the handler blames, write the ledger, replay."""
        st, acc = self.state, self.accelerator
        steps, losses = self.window.flush(acc)  # the rolled-back steps stay in the record, under this epoch
        self.record.losses(steps, losses)
        self.record.flush()
        restored = self.ckpt.load(rollback.target)
        tokens_before = st.tokens
        st.rewind(restored.meta)
        self.parts.load_state_dict(restored.meta, restored.path, rollback=True)
        self.log.event(
            ev.ROLLBACK,
            rollback.step,
            to_step=st.step,
            path=str(rollback.target),
            replayed=rollback.step - st.step,
            tokens=tokens_before - st.tokens,
            evidence=rollback.evidence,
        )
        alert(acc, self.recipe.logging.report_to, "Rollback", f"step {rollback.step} -> {st.step} ({rollback.target})")
        if rollback.blame is not None:  # measured under the restored, pre-spike weights; skipped before the replay
            measured = {at.step: self._sample_losses(at) for at in rollback.blame.steps}
            for stage, first, last in self.spikes.blame(rollback.blame, measured):
                st.add_skip(stage, first, last)
        if acc.is_main_process:  # the ledger (and the open episode) on disk before the replay starts
            write_ledger(self.output_dir, st.skips, self.spikes.state_dict())
        self.window = StepWindow()  # the rolled-back steps' losses are not this timeline's
        self.span = self.phase = None  # re-enter the stage and batch phase the restored step is in
        self.progress.step(st.step)

    def _sample_losses(self, at: StepAt) -> tuple[list[int], list[float]]:
        """A past step's global sample indices and per-sample losses under the live weights, its batches rebuilt
        from its stage and cursor (forward passes only: no state changes)."""
        sequences = self.plan.batch_at(at.step - 1).tokens_per_step // self.spans[at.stage].seq_len
        batches, skips = self.batches_for(at.stage), self.state.skips_for(at.stage)
        return sample_losses(self.accelerator, self.model, batches, at.cursor, skips, self.inputs, sequences)

    def _resume(self) -> Restored | None:
        """`--resume`: choose the checkpoint (resume policy), load it, hand its meta to the run state and the parts,
        then merge the run directory's skip ledger, which may be newer than the checkpoint."""
        acc, ledger = self.accelerator, read_ledger(self.output_dir)
        path = choose_checkpoint(self.ckpt, self.resume_spec, ledger)
        if path is None:
            return None
        meta = read_meta(path)
        record_changes(meta, self._resumable(path, meta), self.log, self.output_dir, acc.is_main_process)
        restored = self.ckpt.load(path)
        st = self.state
        st.load_state_dict(restored.meta)
        self.parts.load_state_dict(restored.meta, restored.path)
        if ledger:
            st.merge_skips(ledger["skips"])
            if self.spikes is not None:
                self.spikes.merge_ledger(ledger)
        stage = restored.meta["stage"]
        self.log.event(
            ev.RESUME, st.step, path=str(path), tokens=st.tokens, stage=stage, cursor=st.cursor, skips=st.skips
        )
        if acc.is_main_process:
            print(f"resume: from {path} at step {st.step}", flush=True)
        return restored

    def _resumable(self, path: Path, meta: dict) -> tuple:
        """The reasons this run cannot continue the checkpoint, refused in one line; else the changes to record."""
        allow = (self.allow_recipe_change, self.allow_data_change)
        return check_resumable(path, meta, self.recipe, self.recipe_plain, self.data_keys, allow)

    def _periodic(self, outcome: StepOutcome) -> None:
        """After a step: log, evaluate, checkpoint, and stop cleanly on preemption."""
        st, span, acc = self.state, self.span, self.accelerator
        self.progress.step(st.step)
        log_now = st.step % self.recipe.logging.every_steps == 0 or st.step == self.total_steps
        reason = self.save_clock.due(self.tokens_before, st.tokens, st.step == span.end_step, log_now)
        if self.preempt.check(acc, log_now):
            reason = "preempt"
        if log_now or reason:
            self.last = self._log_train(outcome)
            self.progress.logged(st.step, self.last, self.lr)
        now, context = eval_due(self.recipe, st.step, span)
        if now:  # held-out losses, merged weights, downstream, forecast, verdict
            if self.evals.downstream.due(st.step):  # minutes of quiet otherwise
                self.progress.note(self._eval_note(st.step))
            vals = self.evals(st.step, st.tokens, span, context)
            self.last.update(vals)
            self.progress.evaluated(st.step, vals)
            self.window.reset_clock()  # eval time is not training throughput
        if reason or st.step == self.total_steps:
            self.save_checkpoint(reason or "end")
            self.window.reset_clock()
        if reason == "preempt":
            self.ckpt.finish()
            raise Preempted(f"preempted at step {st.step}: checkpoint saved; requeue or run again with --resume auto")

    def save_checkpoint(self, reason: str) -> None:
        """A checkpoint of everything exact resume needs: the run state at the top of meta.json, each part under its
        name, the recipe; the open spike episode's target kept from pruning."""
        st = self.state
        meta = {
            **st.state_dict(),
            **self.parts.state_dict(),
            "stage": self.spans[st.stage_index].name,
            "reason": reason,
            "recipe_hash": self.recipe_hash,
            "data": self.data_keys,
            # the batch sizes that trained it: a resume under another plan continues from here (`continue_plan`)
            "batches": [
                [b.start_step, b.start_tokens, b.tokens_per_step] for b in self.plan.batches if b.start_step < st.step
            ],
            "recipe": self.recipe_plain,
        }
        self.ckpt.save(meta, protected=self.spikes.protected() if self.spikes else NOTHING)
        self.record.flush()
        self.save_clock.mark()

    def _epoch(self) -> int:
        """The record's epoch: the rollbacks and resumes so far (each one restarts the timeline from a checkpoint)."""
        return self.log.counts[ev.ROLLBACK] + self.log.counts[ev.RESUME]

    def _log_train(self, outcome: StepOutcome) -> dict:
        """One metrics line (one host sync for all of the window's losses): loss, LR, grad norm, throughput, MFU,
        memory, data wait, checkpoint blocking."""
        st, span = self.state, self.span
        grad_norm = outcome.grad_norm
        steps, losses = self.window.flush(self.accelerator)
        self.loss_stats.extend(losses)
        record = train_record(
            steps,
            losses,
            self.window,
            tokens=st.tokens,
            stage=span.name,
            batch_tokens=self.phase.tokens_per_step,
            lr=self.lr,
            grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
            **{f"data/repeats/{n}": c for n, c in self.batcher.repeats.items()},
            **({"ckpt/blocked_s": self.ckpt.take_blocked()} if self.ckpt.blocked_s else {}),
            **({ev.TOKENS_LOST: self.skip.tokens_lost} if self.skip is not None else {}),
        )
        if self.peak is not None:  # model FLOPs per device-second over the device's peak
            fpt = compute_of(self.config, self.n_non_emb).flops_per_token(span.seq_len)
            record["mfu"] = mfu(record["tokens_per_s"], fpt, self.accelerator.num_processes, self.peak)
        if self.gns is not None:
            small = span.micro_batch_size * span.seq_len
            big = self.phase.tokens_per_step
            if big > small and (value := self.gns.estimate(self.accelerator, small, big, grad_norm)) is not None:
                record["gns/b_simple"] = value
        extra, layer_vectors = self.runner.take_metrics(st.step)
        record.update(extra)
        self.log.metrics(st.step, record)
        self.record.losses(steps, losses, record)
        if layer_vectors is not None:
            self.log.side("layers.jsonl", {"step": st.step, **layer_vectors})
        return record

    def save_final(self) -> Path:
        """The run's models at its end: `final/` (save_pretrained model and tokenizer, loadable by
        AutoModelForCausalLM.from_pretrained) and, with averaging on, `merged/` beside it with the averaged weights;
        each with its provenance (run id, step, tokens). Returns `final/`."""
        st = self.state
        record = {"run_id": self.identity.run_id, "step": st.step, "tokens": st.tokens, "from": "the live run"}
        acc, out = self.accelerator, self.output_dir
        if self.average is not None:
            merged = {**record, "merged": True}
            self.average.with_merged(lambda: save_final(acc, self.model, self.tokenizer, out / "merged", merged))
        return save_final(acc, self.model, self.tokenizer, out / "final", record)
