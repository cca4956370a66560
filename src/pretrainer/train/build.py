"""What the loop trains, built from the recipe: the model (from its config, the same initial weights on every rank),
the optimizer, both prepared by Accelerate, and the LR controller."""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass

import torch
from accelerate.utils import DistributedType, set_seed

from ..errors import PretrainerError
from ..model.build import (
    StageRope,
    build_config,
    build_model,
    count_params,
    non_embedding_params,
    scale_output_init,
)
from ..model.losses import ZLossLM, install_z_loss
from ..recipe.plan import RunPlan
from ..recipe.schedules import lr_lambda
from ..recipe.schema import Recipe
from .accelerator import configure_deepspeed, weights_from_the_seed
from .engines.deepspeed_muon import GradientFirst, build_deepspeed_muon, gathered, probe_items
from .optim import Assignment, build_optimizer


@dataclass
class Built:
    model: torch.nn.Module
    """As Accelerate prepared it (DDP, DeepSpeed engine or FSDP module; the plain module on one process)."""
    optimizer: torch.optim.Optimizer
    scheduler: RunLR
    config: object
    """The model's Hugging Face config (RoPE as the current stage set it)."""
    rope: StageRope
    n_params: int
    n_non_emb: int
    fused: bool
    assignment: Assignment
    """Which parameters each optimizer steps (all on AdamW unless `optimizer.type: muon`)."""
    zloss: ZLossLM | None = None
    """The model's z-loss (`stability.z_loss` > 0), for logging `loss/z`."""
    probed: list | None = None
    """(parameter, optimizer group) pairs Muon's probe samples where the optimizer holds flat partitions (DeepSpeed);
    None: the optimizer's own groups."""
    probe_gather: object = None
    """A context over parameters that makes them whole for the probe (ZeRO-3), or None."""


def build(recipe: Recipe, accelerator, tokenizer, plan: RunPlan, grad_accum: int) -> Built:
    refuse_muon(recipe, accelerator)  # before building anything
    set_seed(recipe.run.seed)  # the same initial weights on every rank and every run
    tok = tokenizer
    config = build_config(
        recipe.model,
        vocab_size=len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    with weights_from_the_seed(accelerator):
        model = build_model(recipe.model, config)
    if recipe.stability.init == "scaled":  # before any sharding: every rank draws the same weights from the seed
        scale_output_init(model, config.initializer_range)
    zloss = install_z_loss(model, recipe.stability.z_loss)
    n_params, n_non_emb = count_params(model), non_embedding_params(model)
    opt = recipe.optimizer
    stage = zero_stage(accelerator)
    if opt.type == "muon" and stage is not None:
        optimizer, fused, assignment = build_deepspeed_muon(model, opt, stage)
    else:
        optimizer, fused, assignment = build_optimizer(model, opt)
    if (why := compile_warning(recipe.model.compile, accelerator)) and accelerator.is_main_process:
        print(f"warning: {why}", file=sys.stderr, flush=True)
    configure_deepspeed(accelerator, plan, grad_accum, getattr(config, "hidden_size", None), opt.type == "muon")
    model, optimizer = accelerator.prepare(model, optimizer)
    probed = probe_gather = None
    if opt.type == "muon" and stage is not None:
        GradientFirst(model.optimizer, stage)  # before skip-step's gate wraps the same norm (it then reads this one)
        probed, probe_gather = probe_items(model, stage), gathered(stage)
    # Built on the prepared optimizer (whose param groups DeepSpeed and FSDP may have rebuilt); not registered with
    # Accelerate: the LR is a function of the step, which meta.json holds.
    scheduler = RunLR(optimizer, lr_lambda(recipe))
    rope = StageRope(accelerator.unwrap_model(model), recipe.stages)
    return Built(
        model, optimizer, scheduler, config, rope, n_params, n_non_emb, fused, assignment, zloss, probed, probe_gather
    )


def refuse_muon(recipe: Recipe, accelerator) -> None:
    """Muon needs whole matrices: refused, in one line, where the backend shards them and nothing gathers them."""
    if recipe.optimizer.type == "muon" and accelerator.distributed_type == DistributedType.FSDP:
        raise PretrainerError(
            f"optimizer.type: muon is refused under {accelerator.distributed_type.value}: it shards parameters into "
            "row shards, so a Muon step on them would not orthogonalise whole matrices (no owner-rank gather is "
            "built); launch with DeepSpeed ZeRO (accelerate_configs/zero1.yaml), DDP "
            "(accelerate_configs/ddp.yaml) or one process"
        )
    stage = zero_stage(accelerator)
    if recipe.optimizer.type == "muon" and stage == 0:
        raise PretrainerError(
            "optimizer.type: muon under DeepSpeed ZeRO-0 is refused: nothing there orthogonalises (DeepSpeed's "
            "Muon at stage 0 trained plain SGD, its issue 8441); launch with ZeRO-1/2/3 (accelerate_configs/zero1.yaml)"
        )


def zero_stage(accelerator) -> int | None:
    """The DeepSpeed ZeRO stage of this launch (None when not under DeepSpeed)."""
    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        return None
    return int(accelerator.state.deepspeed_plugin.zero_stage)


class RunLR(torch.optim.lr_scheduler.LambdaLR):
    """torch's LambdaLR over the run's global optimizer step (what torchtitan wraps): each param group's LR is its
    own initial LR times the schedule's multiplier. Only the step is checkpointed (`{"step": N}`, as before this
    class): the LR is a function of it, recomputed on load."""

    def step(self) -> None:
        if self._step_count != 1:
            super().step()
            return
        # torch warns when the first scheduler step comes before an optimizer step: here that is a first update
        # held back by skip-step, or one DeepSpeed's engine took inside backward. Neither skips a schedule value.
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message=r"Detected call of `lr_scheduler.step\(\)`", category=UserWarning
            )
            super().step()

    @property
    def step_count(self) -> int:
        """Optimizer steps taken (the schedule's position)."""
        return self.last_epoch

    def state_dict(self) -> dict:
        return {"step": self.last_epoch}

    def load_state_dict(self, state: dict) -> None:
        self.last_epoch = int(state["step"])
        self._step_count = self.last_epoch + 1
        self._last_lr = [base * fn(self.last_epoch) for base, fn in zip(self.base_lrs, self.lr_lambdas)]
        for group, lr in zip(self.optimizer.param_groups, self._last_lr):
            group["lr"] = lr


def compile_warning(compile_: bool, accelerator) -> str | None:
    """Why `model.compile` will not give one graph per decoder layer under this launch (None: it will)."""
    if not compile_ or accelerator.distributed_type != DistributedType.DEEPSPEED:
        return None
    if accelerator.state.deepspeed_plugin.zero_stage != 3:
        return None
    return (
        "model.compile under DeepSpeed ZeRO-3: its hooks gather each module's parameters inside the layer's forward, "
        "which breaks the compiled layer into many graphs (little gain, recompiles); ZeRO-1/2 or FSDP2 keep one "
        "graph per layer, or set model.compile: false"
    )
