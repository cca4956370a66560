"""What the loop trains, built from the recipe: the model (from its config, the same initial weights on every rank),
the optimizer, both prepared by Accelerate, and the LR controller."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from accelerate.utils import set_seed

from ..model.build import StageRope, build_config, build_model, count_params, non_embedding_params
from ..recipe.plan import RunPlan
from ..recipe.schedules import LRController, lr_lambda
from ..recipe.schema import Recipe
from .accelerator import configure_deepspeed, param_groups


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


def build(recipe: Recipe, accelerator, tokenizer, plan: RunPlan, grad_accum: int) -> Built:
    set_seed(recipe.run.seed)  # the same initial weights on every rank and every run
    tok = tokenizer
    config = build_config(
        recipe.model, vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    model = build_model(recipe.model, config)
    n_params, n_non_emb = count_params(model), non_embedding_params(model)
    opt = recipe.optimizer
    # Fused AdamW (one kernel for all parameters) exists for CUDA and CPU; it is what the HF Trainer uses too.
    fused = opt.fused if opt.fused is not None else True
    optimizer = torch.optim.AdamW(
        param_groups(model, opt.weight_decay), lr=opt.lr, betas=opt.betas, eps=opt.eps, fused=fused or None
    )
    configure_deepspeed(accelerator, plan, grad_accum)
    model, optimizer = accelerator.prepare(model, optimizer)
    # Not registered with Accelerate: the LR is a function of the step, which meta.json holds.
    scheduler = LRController(optimizer, lr_lambda(recipe), opt.lr)
    rope = StageRope(accelerator.unwrap_model(model), recipe.stages)
    return Built(model, optimizer, scheduler, config, rope, n_params, n_non_emb, fused)
