"""The recipe as a whole: its sections, the checks that span sections, and the run plan derived once from them."""

from __future__ import annotations

from pydantic import Field, PrivateAttr, model_validator

from ..model.section import ModelSection
from ..strict import Section
from .averaging import AveragingSection
from .eval_sections import EvalSection
from .plan import RunPlan, build_plan
from .sections import (
    BatchSection,
    CheckpointSection,
    ClippingSection,
    DataSection,
    DebugSection,
    LoggingSection,
    OptimizerSection,
    PrecisionSection,
    PublishSection,
    RunSection,
    ScheduleSection,
    SpikesSection,
    StageSection,
    TokenizerSection,
)
from .stability import StabilitySection


class Recipe(Section):
    """A whole recipe: one typed section per YAML section."""

    run: RunSection = Field(default_factory=RunSection)
    model: ModelSection
    tokenizer: TokenizerSection
    data: DataSection
    batch: BatchSection
    optimizer: OptimizerSection
    schedule: ScheduleSection = Field(default_factory=ScheduleSection)
    stages: list[StageSection]
    precision: PrecisionSection = Field(default_factory=PrecisionSection)
    clipping: ClippingSection = Field(default_factory=ClippingSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    spikes: SpikesSection = Field(default_factory=SpikesSection)
    stability: StabilitySection = Field(default_factory=StabilitySection)
    averaging: AveragingSection = Field(default_factory=AveragingSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    logging: LoggingSection = Field(default_factory=LoggingSection)
    publish: PublishSection = Field(default_factory=PublishSection)
    debug: DebugSection = Field(default_factory=DebugSection)
    _plan: RunPlan = PrivateAttr()

    @model_validator(mode="after")
    def _cross_checks(self) -> Recipe:
        if not self.stages:
            raise ValueError("stages: define at least one stage")
        names = [s.name for s in self.stages]
        if len(set(names)) != len(names):
            raise ValueError(f"stages: stage names must be unique, got {names}")
        for i, stage in enumerate(self.stages):
            for src in stage.mixture:
                if src not in self.data.sources:
                    raise ValueError(
                        f"stages.{i}.mixture: source {src!r} of stage {stage.name!r} is not defined in data.sources "
                        f"(defined: {sorted(self.data.sources)})"
                    )
            if self.batch.global_batch_tokens % stage.seq_len:
                raise ValueError(
                    f"stages.{i}.seq_len: batch.global_batch_tokens={self.batch.global_batch_tokens} is not a "
                    f"multiple of seq_len={stage.seq_len} (stage {stage.name!r})"
                )
            micro_tokens = self.batch.micro_batch_size * self.stages[0].seq_len
            if micro_tokens % stage.seq_len:
                raise ValueError(
                    f"stages.{i}.seq_len: tokens per micro batch ({micro_tokens}) is not a multiple of "
                    f"seq_len={stage.seq_len} (stage {stage.name!r})"
                )
        micro_tokens = self.batch.micro_batch_size * self.stages[0].seq_len
        if self.batch.global_batch_tokens % micro_tokens:
            raise ValueError(
                f"batch.global_batch_tokens: {self.batch.global_batch_tokens} is not a multiple of the tokens per "
                f"micro batch ({self.batch.micro_batch_size} x {self.stages[0].seq_len} = {micro_tokens})"
            )
        if self.schedule.decay_stage is not None:
            if self.schedule.type != "wsd":
                raise ValueError("schedule.decay_stage: only a WSD schedule has a decay to pin to a stage")
            if self.schedule.decay_stage not in names:
                raise ValueError(
                    f"schedule.decay_stage: no stage named {self.schedule.decay_stage!r} (stages: {names})"
                )
        scaling = self.batch.lr_scaling
        if scaling is None and self.batch.schedule is not None and self.optimizer.type == "muon":
            raise ValueError(
                "batch.lr_scaling: name how Muon's LR follows a batch change (`sqrt`, `linear` or `none`): no "
                "published rule covers Muon mid-run (AdamW's default is `sqrt`)"
            )
        plan = build_plan(self.batch, self.stages, self.schedule, self.clipping, scaling or "sqrt")
        warm = self.schedule.warmup_steps
        if warm >= plan.total_steps:
            raise ValueError(f"schedule.warmup_steps: {warm} is not below the run's {plan.total_steps} steps")
        if plan.decay_start is not None and warm > plan.decay_start:
            into = (
                f"the decay stage {self.schedule.decay_stage!r}, which starts at step {plan.decay_start}"
                if self.schedule.decay_stage
                else f"the WSD decay, which starts at step {plan.decay_start} of {plan.total_steps}"
            )
            raise ValueError(f"schedule.warmup_steps: warmup ({warm}) runs into {into}")
        for src in self.eval.context.sources or []:
            if src not in self.data.sources:
                raise ValueError(f"eval.context.sources: {src!r} is not defined in data.sources")
        if self.tokenizer.train and self.tokenizer.train.sources:
            for src in self.tokenizer.train.sources:
                if src not in self.data.sources:
                    raise ValueError(f"tokenizer.train.sources: {src!r} is not defined in data.sources")
        self._plan = plan
        if self.stability.z_loss > 0 and self.model.kernels == "liger":
            raise ValueError(
                "stability.z_loss: not with model.kernels: liger (liger's fused loss replaces the model's loss "
                "function; its lse_square_scale is not wired yet): use kernels: none, or z_loss: 0"
            )
        if self.averaging.method == "window" and self.averaging.window.every is None:
            cadence = self.eval.every_steps
            if not cadence:
                raise ValueError(
                    "averaging.window.every: needed when eval.every_steps is 0 (no eval cadence to merge at)"
                )
            if self.averaging.window.steps > cadence:
                raise ValueError(
                    f"averaging.window.steps: {self.averaging.window.steps} is more than the {cadence} steps between "
                    "merges (eval.every_steps)"
                )
        return self

    @property
    def plan(self) -> RunPlan:
        """Stage spans, total steps, decay window, clipping: derived once, when the recipe was validated."""
        return self._plan

    @property
    def output_dir(self) -> str:
        return self.run.output_dir or f"runs/{self.run.name}"
