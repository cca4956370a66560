"""Typed recipe sections: one class per YAML section, strict (unknown keys are errors).

Each component receives only its own section. Field docstrings are the reference for recipe authors.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from ..strict import Section


class RunSection(Section):
    """What the run is called, where it writes, and its seed."""

    name: str = "run"
    """Run name, shown in trackers and used for the default output directory."""
    output_dir: str | None = None
    """Where metrics, checkpoints and the final model go. Default: runs/<name>."""
    seed: int = 1234
    """Seeds model init, data order and dropout."""


class TokenizerTrainSection(Section):
    """A byte-level BPE trained on the recipe's training documents, cached by content."""

    vocab_size: int = Field(default=4096, ge=256)
    """Vocabulary size, special tokens included."""
    sources: list[str] | None = None
    """Sources whose training documents the tokenizer learns from. Default: all sources."""
    max_documents: int | None = Field(default=None, ge=1)
    """Train on at most this many documents (None: all of them)."""


class TokenizerSection(Section):
    """The tokenizer: a hub id or local directory, or one trained on the recipe's own data."""

    path: str | None = None
    """A hub id or a local directory with a tokenizer."""
    train: TokenizerTrainSection | None = None
    """Train a byte-level BPE on the recipe's own data (cached under data.cache_dir)."""

    @model_validator(mode="after")
    def _one_of(self) -> TokenizerSection:
        if (self.path is None) == (self.train is None):
            raise ValueError("set exactly one of `path` or `train`")
        return self


class SourceSection(Section):
    """One named data source: where its documents come from and how good they are."""

    type: Literal["python_stdlib", "files", "hub"]
    """`python_stdlib`: the stdlib's own source files; `files`: local text/jsonl/parquet; `hub`: a hub dataset id."""
    include: list[str] = Field(default_factory=list)
    """Glob patterns. For `python_stdlib` relative to the stdlib directory; for `files` relative to the working dir."""
    exclude: list[str] = Field(default_factory=list)
    """Glob patterns removed from what `include` matched."""
    path: str | None = None
    """`hub`: the dataset id."""
    name: str | None = None
    """`hub`: the dataset config name."""
    split: str = "train"
    """`hub`: the dataset split to read."""
    text_field: str = "text"
    """The field holding each document's text (jsonl, parquet, hub)."""
    streaming: bool = True
    """`hub`: stream the dataset instead of downloading it whole first."""
    max_documents: int | None = Field(default=None, ge=1)
    """Read at most this many documents (in file order)."""
    quality: Literal["low", "medium", "high"] = "medium"
    """How good the source is. An anneal (the `schedule.decay_stage`) should shift weight toward `high` sources."""

    @model_validator(mode="after")
    def _fields_for_type(self) -> SourceSection:
        if self.type in ("python_stdlib", "files") and not self.include:
            raise ValueError(f"`include` (glob patterns) is required for type {self.type}")
        if self.type == "hub" and not self.path:
            raise ValueError("`path` (the dataset id) is required for type hub")
        return self


class DataSection(Section):
    """The named sources, their validation split, and where prepared tokens are cached."""

    sources: dict[str, SourceSection]
    validation_fraction: float = Field(default=0.02, gt=0, lt=0.5)
    """Fraction of each source's documents held out for validation (at least one document)."""
    cache_dir: str = ".cache/pretrainer"
    """Tokenized data and trained tokenizers are cached here, keyed by content."""
    document_masking: bool = False
    """Attention and positions per packed document (`masking.py`: flash attention without a mask, sdpa with one)."""
    inline_max_mb: float = Field(default=512, ge=0)
    """A local source not prepared by `prepare_data.py` is tokenized inside the run only up to this size."""

    @field_validator("sources")
    @classmethod
    def _non_empty(cls, v: dict[str, SourceSection]) -> dict[str, SourceSection]:
        if not v:
            raise ValueError("define at least one source")
        return v


class BatchChange(Section):
    """One entry of `batch.schedule`: from this many tokens on, this global batch."""

    from_tokens: int = Field(ge=0)
    """The batch changes at the first optimizer step that starts at or after this many tokens."""
    global_batch_tokens: int = Field(ge=1)
    """Tokens per optimizer step from then on: an integer multiple of the schedule's first size (the micro batch
    stays fixed; gradient accumulation grows)."""


class BatchSection(Section):
    """The global batch in tokens (one size, or a schedule in tokens) and the micro batch per device."""

    micro_batch_size: int = Field(ge=1)
    """Sequences per device per forward pass, at the first stage's seq_len. Tokens per micro batch stay fixed
    across stages, so a stage at 4x the context runs 1/4 the sequences per micro batch."""
    global_batch_tokens: int | None = Field(default=None, ge=1)
    """Tokens per optimizer step over all devices, for the whole run (or the first entry of `schedule`)."""
    schedule: list[BatchChange] | None = None
    """A batch that grows with the critical batch: `[{from_tokens: 0, global_batch_tokens: B0}, {from_tokens: T1,
    global_batch_tokens: B1}, ...]`, the first from token 0, each size an integer multiple of B0. The LR schedule is
    a function of tokens (steps at B0), so a change moves no stage boundary or decay given in tokens;
    `scripts/critical_batch.py` measures where the critical batch is."""
    lr_scaling: Literal["sqrt", "linear", "none"] | None = None
    """How the LR follows the batch: LR x (B / B0)^p with p = 1/2 (`sqrt`), 1 (`linear`) or 0 (`none`). Default
    `sqrt` for AdamW (Malladi et al. 2022's square-root rule, as OLMo-core and Merrill et al. 2025 run it); Muon has
    no published rule for a batch change mid-run, so a Muon recipe with a schedule must name one."""
    critical_batch_tokens: int | None = Field(default=None, ge=1)
    """The critical batch size when known (`scripts/critical_batch.py`, or the `gns/b_simple` a previous run logged,
    a lower bound); the linter warns when the global batch is far above it."""

    @model_validator(mode="before")
    @classmethod
    def _first_size(cls, data: Any) -> Any:
        # the schedule's first size is the run's `global_batch_tokens` (what a constant-batch reader reads)
        if isinstance(data, dict) and data.get("global_batch_tokens") is None:
            sched = data.get("schedule")
            first = (
                sched[0].get("global_batch_tokens")
                if isinstance(sched, list) and sched and isinstance(sched[0], dict)
                else None
            )
            # only a valid size: an invalid one is the schedule's error alone, not also a field the user never gave
            if isinstance(first, int) and not isinstance(first, bool) and first >= 1:
                return {**data, "global_batch_tokens": first}
        return data

    @model_validator(mode="after")
    def _one_size_or_a_schedule(self) -> BatchSection:
        sched = self.schedule
        if sched is None:
            if self.global_batch_tokens is None:
                raise ValueError("set `global_batch_tokens` (or a `schedule` of sizes)")
            return self
        if not sched:
            raise ValueError("schedule: give at least one entry, the first `from_tokens: 0`")
        first = sched[0].global_batch_tokens
        if self.global_batch_tokens is None:  # a first size `_first_size` left to this check (given as text)
            self.global_batch_tokens = first
        if sched[0].from_tokens != 0:
            raise ValueError(f"schedule.0.from_tokens: the first size starts at 0, not {sched[0].from_tokens}")
        if self.global_batch_tokens not in (None, first):
            raise ValueError(
                f"global_batch_tokens: {self.global_batch_tokens} differs from the schedule's first size {first}; "
                "give one of them"
            )
        for i, (a, b) in enumerate(zip(sched, sched[1:]), start=1):
            if b.from_tokens <= a.from_tokens:
                raise ValueError(f"schedule.{i}.from_tokens: {b.from_tokens} is not after {a.from_tokens}")
            if b.global_batch_tokens % first:
                raise ValueError(
                    f"schedule.{i}.global_batch_tokens: {b.global_batch_tokens} is not an integer multiple of the "
                    f"first size {first} (the micro batch is fixed; only the accumulation grows)"
                )
        return self

    @property
    def sizes(self) -> list[tuple[int, int]]:
        """(from_tokens, global_batch_tokens) for the whole run: one entry for a constant batch."""
        if self.schedule is None:
            return [(0, self.global_batch_tokens)]
        return [(c.from_tokens, c.global_batch_tokens) for c in self.schedule]


class MuonSection(Section):
    """Muon's settings (torch.optim.Muon) for the hidden matrices when `optimizer.type: muon`."""

    momentum: float = Field(default=0.95, ge=0, lt=1)
    """Momentum of the orthogonalised update."""
    nesterov: bool = True
    """Nesterov momentum (as Muon's authors run it)."""
    ns_steps: int = Field(default=5, ge=1)
    """Newton-Schulz iterations that orthogonalise the update."""
    adjust_lr: Literal["match_rms_adamw", "original"] = "match_rms_adamw"
    """`match_rms_adamw`: each matrix's LR x 0.2 sqrt(max(A, B)), so its update RMS matches AdamW's and
    `optimizer.lr` (an AdamW LR) and its schedule serve both groups. `original`: sqrt(max(1, A/B)) (Keller Jordan's),
    which needs a Muon-sized LR (~0.02), not an AdamW one (lint PT018)."""
    weight_decay: float = Field(default=0.1, ge=0)
    """Decoupled weight decay of the Muon matrices."""


class OptimizerSection(Section):
    """The optimizer; the LR is the peak of the schedule."""

    type: Literal["adamw", "muon"] = "adamw"
    """`adamw`, or `muon`: Muon for the hidden 2-D matrices, AdamW for embeddings, head, norms and biases (one
    schedule over both; the split is printed and logged at the start)."""
    lr: float = Field(gt=0)
    """Peak learning rate."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW's (beta1, beta2)."""
    eps: float = Field(default=1e-8, gt=0)
    """AdamW's epsilon."""
    weight_decay: float = Field(default=0.1, ge=0)
    """AdamW's, applied to matrices only; norms, biases and embeddings-free 1-D params get none."""
    fused: bool | None = None
    """Fused AdamW kernel (CUDA and CPU). Default: on."""
    muon: MuonSection = Field(default_factory=MuonSection)


class ScheduleSection(Section):
    """One LR schedule over the whole run, indexed by the optimizer step: warmup, then cosine or WSD."""

    type: Literal["cosine", "wsd"] = "cosine"
    """`cosine` (transformers' cosine to `min_lr_ratio`) or `wsd` (warmup, stable, decay)."""
    warmup_steps: int = Field(default=0, ge=0)
    """Linear warmup from ~0 to the peak LR, in optimizer steps."""
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1)
    """Final LR as a fraction of the peak."""
    decay_fraction: float = Field(default=0.1, gt=0, le=1)
    """WSD: fraction of all steps spent decaying, at the end of the run."""
    decay_shape: Literal["linear", "cosine", "1-sqrt"] = "1-sqrt"
    """WSD: shape of the decay."""
    decay_stage: str | None = None
    """WSD: pin the decay to this stage (typically the anneal) instead of `decay_fraction`."""


class YarnSection(Section):
    """YaRN RoPE scaling (Peng et al. 2023) applied at a stage start."""

    factor: float = Field(gt=1)
    """The context extension factor."""
    original_max_position_embeddings: int = Field(ge=1)
    """The context the model was trained at before this stage."""
    beta_fast: float | None = None
    """YaRN's beta_fast (None: transformers' default)."""
    beta_slow: float | None = None
    """YaRN's beta_slow (None: transformers' default)."""


class RopeSection(Section):
    """RoPE change applied to the live model at the start of a stage (and kept for the rest of the run)."""

    theta: float | None = Field(default=None, gt=0)
    """New RoPE base, e.g. 500000 for a long-context stage."""
    yarn: YarnSection | None = None
    """YaRN scaling (Peng et al. 2023) on top of the current base."""

    @model_validator(mode="after")
    def _something(self) -> RopeSection:
        if self.theta is None and self.yarn is None:
            raise ValueError("set `theta`, `yarn`, or both")
        return self


class LongDocsSection(Section):
    """Long-document upweighting for a long-context stage."""

    min_tokens: int = Field(ge=1)
    """Documents of at least this many tokens count as long."""
    upweight: int = Field(default=4, ge=1)
    """Sequences from long documents are sampled this many times more often."""


MIXTURE_BLOCK = 4096
"""The mixture sampler deals sources out in blocks of this many samples (data/sampler.py): a source's share of a
stage is a whole number of slots per block, so a weight below one slot cannot be drawn."""


class StageSection(Section):
    """One stage of the run: its length, context, mixture, and RoPE change."""

    name: str
    """Unique name, used in logs, events and `schedule.decay_stage`."""
    steps: int | None = Field(default=None, ge=1)
    """Length of the stage in optimizer steps (or give `tokens`)."""
    tokens: int | None = Field(default=None, ge=1)
    """Length of the stage, in optimizer steps or in tokens (rounded up to whole steps)."""
    seq_len: int = Field(ge=8)
    """Context length of the stage's sequences."""
    mixture: dict[str, float]
    """Source name -> sampling weight (normalized to sum to 1, with a warning when they don't)."""
    rope: RopeSection | None = None
    long_docs: LongDocsSection | None = None

    @model_validator(mode="after")
    def _length(self) -> StageSection:
        if (self.steps is None) == (self.tokens is None):
            raise ValueError("set exactly one of `steps` or `tokens`")
        if not self.mixture:
            raise ValueError("`mixture` needs at least one source")
        if any(not math.isfinite(w) or w < 0 for w in self.mixture.values()) or sum(self.mixture.values()) <= 0:
            raise ValueError("mixture weights must be finite, >= 0 and not all zero")
        total = sum(self.mixture.values())
        for source, w in self.mixture.items():  # every stage at load, not only the one about to start
            if 0 < w / total < 1 / MIXTURE_BLOCK:
                raise ValueError(
                    f"mixture weight of {source!r} is {w / total:.3g} of the stage, below the sampler's resolution "
                    f"(1/{MIXTURE_BLOCK} of the samples); raise it or drop the source"
                )
        return self


class PrecisionSection(Section):
    """Mixed precision through Accelerate."""

    mixed: Literal["no", "bf16", "fp16", "fp8"] = "bf16"
    """`fp8` needs Hopper-class GPUs and an Accelerate fp8 backend (TransformerEngine, torchao or MS-AMP)."""

    @field_validator("mixed", mode="before")
    @classmethod
    def _yaml_no(cls, v: Any) -> Any:
        # YAML 1.1 reads a bare `no` as false; that is what the author meant.
        return "no" if v is False else v


class ClippingSection(Section):
    """Gradient clipping by global norm."""

    max_grad_norm: float | None = Field(default=1.0, ge=0)
    """Clip the global gradient norm to this; null or 0 disables clipping (the norm is still logged)."""


class CheckpointSection(Section):
    """When checkpoints are saved, how many are kept, and where they are copied."""

    model_config = ConfigDict(
        extra="forbid",
        validate_assignment=True,
        populate_by_name=True,
        serialize_by_alias=True,
        use_attribute_docstrings=True,
    )

    every_minutes: float | None = Field(default=30.0, gt=0)
    """Save when this much wall clock has passed since the last save (checked on logging steps)."""
    every_tokens: int | None = Field(default=None, ge=1)
    """Save each time the token count crosses a multiple of this. Whichever trigger comes first wins."""
    at_stage_end: bool = True
    """Save at the last step of every stage."""
    keep_last: int = 3
    """Newest checkpoints kept. At least 2: with one, a save that dies half-way or a spike just after it leaves
    nothing good to go back to."""
    keep_every_tokens: int | None = Field(default=None, ge=1)
    """Also keep the first checkpoint past each multiple of this many tokens (milestones, never pruned)."""
    async_: bool = Field(default=False, alias="async")
    """Write in the background, blocking only for the copy to host memory (single process/DDP: a snapshot on the main
    process; FSDP: DCP's staging on every rank). DeepSpeed saves synchronously (README, "Background saves")."""
    remote: str | None = None
    """fsspec URL (s3://bucket/run, file:///mnt/backup) each verified checkpoint is copied to (into
    `<remote>/<run_id>/`), in the background, with the same retention; `--resume auto` falls back to the run that last
    started in a directory of the same name (`<remote>/owner-<dir name>`) when no local checkpoint is valid."""

    @field_validator("keep_last")
    @classmethod
    def _at_least_two(cls, v: int) -> int:
        if v < 2:
            raise ValueError(
                f"must be >= 2 (got {v}): with a single checkpoint, a save that dies half-way or a loss spike right "
                "after it leaves nothing good to resume or roll back to"
            )
        return v


class SpikesSection(Section):
    """Loss-spike detection against the trend, and recovery by rollback and data skips."""

    enabled: bool = True
    """Detect spikes and recover by rollback. Costs one host sync per step (the NaN guard reads two scalars)."""
    window: int = Field(default=100, ge=5)
    """Healthy steps the trend is fitted on."""
    threshold: float = Field(default=3.5, gt=0)
    """Mean z-score over `persistence` steps in a row that makes a spike; z is a loss's residual from the fitted
    trend in robust sd of the noise around it (1.4826 x the median absolute residual). Each of those steps is above
    threshold / 2."""
    persistence: int = Field(default=3, ge=1)
    """Suspect steps in a row that make a spike (NaN/inf: one step)."""
    min_history: int = Field(default=20, ge=3)
    """Steps of the current stage after its grace needed before the trend is judged."""
    grace_steps: int = Field(default=20, ge=0)
    """No judgement this many steps after warmup and after each stage start; the trend is then fitted on the steps
    after it alone (a run's or a stage's first steps are a transient its quadratic cannot follow)."""
    max_rollbacks: int = Field(default=5, ge=1)
    """Rollbacks allowed within `rollback_window` steps."""
    rollback_window: int = Field(default=1000, ge=1)
    """At most `max_rollbacks` rollbacks within this many steps; past it the run stops (exit code 76)."""
    skip_margin: int = Field(default=0, ge=0)
    """Samples skipped on each side of the samples blamed for a recurring spike."""
    confirm_steps: int = Field(default=5, ge=1)
    """Steps past the spike's end that a replay must stay healthy for the spike to count as transient."""


class GradScaleFault(Section):
    """`debug.inject.grad_scale`: one step's gradients multiplied by `factor`."""

    step: int = Field(ge=1)
    """The optimizer step whose gradients are scaled (once per process)."""
    factor: float = Field(gt=0)
    """What they are multiplied by (1000: a gradient three orders of magnitude off)."""


class InjectSection(Section):
    """Fault injection for drills and tests (each fires once per process unless said otherwise)."""

    poison_samples: tuple[int, int, int] | None = None
    """(stage, first, last): replace those samples' tokens by random ones, every time they are drawn."""
    corrupt_optimizer_step: int | None = None
    """Before this optimizer step, scale Adam's first moment by 1e4 (once per process: a transient)."""
    nan_step: int | None = None
    """Make this step's loss NaN (once per process)."""
    nan_state_step: int | None = None
    """After this step's update, put a NaN into the last rank's optimizer state (its own shard under ZeRO/FSDP),
    where no loss shows it yet: the live check at the next save must flag that checkpoint (once per process)."""
    grad_scale: GradScaleFault | None = None
    """Multiply one step's gradients by a factor (every micro batch's, on every backend): a one-step gradient
    fault, which skip-step should absorb in place."""
    lr_drift: tuple[int, float] | None = None
    """(start step, rate): from that step on, the LR is multiplied by 1 + rate * (step - start): a slow drift that
    neither the spike rule nor the trend verdicts see at first (a test of the forecast's off-track verdict)."""


class DebugSection(Section):
    """Fault injection for tests and drills. Off by default; never set it in a real run."""

    inject: InjectSection = Field(default_factory=InjectSection)


class LoggingSection(Section):
    """Logging cadence, trackers, and the peak used for MFU."""

    every_steps: int = Field(default=10, ge=1)
    """Optimizer steps per metrics row (one host read of the window's losses)."""
    report_to: list[Literal["wandb", "tensorboard"]] = Field(default_factory=lambda: ["wandb", "tensorboard"])
    """Trackers besides metrics.jsonl. W&B runs offline when no API key is configured."""
    project: str = "pretrainer"
    """W&B project / TensorBoard sub-directory."""
    peak_tflops: float | None = Field(default=None, gt=0)
    """Peak TFLOP/s of one device for MFU; default: a table of known GPUs (H100/H200 989 dense bf16), none on CPU."""


class PublishSection(Section):
    """Upload the finished model to the Hugging Face Hub (off by default: nothing leaves the machine unless asked)."""

    repo: str | None = Field(default=None, pattern=r"^[\w.-]+/[\w.-]+$")
    """`user/name` of the Hub repo that `final/` is uploaded to when the run ends, with a model card written from the
    run (recipe, tokens, final val/ref, lm-eval scores, incidents); the token is huggingface_hub's (`HF_TOKEN` or
    `huggingface-cli login`). None: no upload (`export_checkpoint.py --push-to-hub` does it for any checkpoint)."""
    private: bool = True
    """Create the repo private."""
    merged: bool = False
    """Also upload `merged/` (the averaged weights, with `averaging` on) to `<repo>-merged`."""
