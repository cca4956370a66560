"""What the loop trains, built from the recipe: the model (from its config, the same initial weights on every rank),
the optimizer, both prepared by Accelerate, and the LR controller."""

from __future__ import annotations

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
from ..recipe.schedules import LRController, lr_lambda
from ..recipe.schema import Recipe
from .accelerator import configure_deepspeed
from .optim import Assignment, build_optimizer


@dataclass
class Built:
    model: torch.nn.Module
    """As Accelerate prepared it (DDP, DeepSpeed engine or FSDP module; the plain module on one process)."""
    optimizer: torch.optim.Optimizer
    scheduler: LRController
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


def build(recipe: Recipe, accelerator, tokenizer, plan: RunPlan, grad_accum: int) -> Built:
    set_seed(recipe.run.seed)  # the same initial weights on every rank and every run
    tok = tokenizer
    config = build_config(
        recipe.model, vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    model = build_model(recipe.model, config)
    if recipe.stability.init == "scaled":  # before any sharding: every rank draws the same weights from the seed
        scale_output_init(model, config.initializer_range)
    zloss = install_z_loss(model, recipe.stability.z_loss)
    n_params, n_non_emb = count_params(model), non_embedding_params(model)
    opt = recipe.optimizer
    if opt.type == "muon" and accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP):
        raise PretrainerError(
            f"optimizer.type: muon is refused under {accelerator.distributed_type.value}: it shards parameters into "
            "flat partitions (DeepSpeed) or row shards (FSDP), so a Muon step on them would not orthogonalise whole "
            "matrices (the failure of DeepSpeed's Muon at ZeRO stage 0, issue 8441); launch with DDP "
            "(accelerate_configs/ddp.yaml) or one process"
        )
    optimizer, fused, assignment = build_optimizer(model, opt)
    configure_deepspeed(accelerator, plan, grad_accum)
    model, optimizer = accelerator.prepare(model, optimizer)
    # Not registered with Accelerate: the LR is a function of the step, which meta.json holds.
    scheduler = LRController(optimizer, lr_lambda(recipe), opt.lr)
    rope = StageRope(accelerator.unwrap_model(model), recipe.stages)
    return Built(model, optimizer, scheduler, config, rope, n_params, n_non_emb, fused, assignment, zloss)
