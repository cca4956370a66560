"""The recipe's optimizer: AdamW, or Muon for the hidden matrices with AdamW for the rest (torch's own Muon and
AdamW, composed into one optimizer so Accelerate, the LR schedule and checkpoints see one object).

Which parameters go where (Muon's authors and every framework that ships it agree): 2-D weight matrices inside the
decoder layers go to Muon; the embeddings, the LM head (tied or not), norms' gains and biases go to AdamW. Muon
orthogonalises a matrix's update, which means nothing for a vector and harms the embedding and the head, whose rows
are looked up or read out one token at a time.

One schedule serves both: with `adjust_lr: match_rms_adamw` (Moonshot's adjustment, torch's `adjust_lr_fn`), Muon
scales each matrix's LR by 0.2 sqrt(max(A, B)) so its update RMS matches AdamW's, and the AdamW peak LR is reused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import PretrainerError
from ..recipe.sections import OptimizerSection
from .accelerator import param_groups


@dataclass(frozen=True)
class Assignment:
    """Which parameters went where: names per optimizer, for the start of the run and the lint."""

    muon: list[str]
    adamw: list[str]

    def summary(self, model: torch.nn.Module) -> dict:
        sizes = dict(model.named_parameters())
        return {
            "muon": {"tensors": len(self.muon), "params": sum(sizes[n].numel() for n in self.muon)},
            "adamw": {"tensors": len(self.adamw), "params": sum(sizes[n].numel() for n in self.adamw)},
            "adamw_names": self.adamw[:12],
        }


def split_for_muon(model: torch.nn.Module) -> Assignment:
    """Hidden 2-D matrices to Muon; embeddings, the head, norms and biases to AdamW."""
    special = set()
    for layer in (model.get_input_embeddings(), model.get_output_embeddings()):
        if layer is not None:
            special |= {id(p) for p in layer.parameters()}
    muon, adamw = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (muon if p.ndim == 2 and id(p) not in special else adamw).append(name)
    return Assignment(muon, adamw)


class MuonAdamW(torch.optim.Optimizer):
    """One optimizer over two kinds of groups (`use_muon` true or false), stepping torch's Muon on the first and
    torch's AdamW on the second. The inner optimizers share this object's param groups and state, so the LR
    controller, Accelerate's wrapper and `state_dict()` see one optimizer."""

    def __init__(self, muon_groups: list[dict], adamw_groups: list[dict], muon_kw: dict, adamw_kw: dict):
        for g in muon_groups:
            g["use_muon"] = True
        for g in adamw_groups:
            g["use_muon"] = False
        super().__init__([*muon_groups, *adamw_groups], {"lr": muon_kw["lr"]})
        self._inner = (torch.optim.Muon(muon_groups, **muon_kw), torch.optim.AdamW(adamw_groups, **adamw_kw))
        self._link()

    def _link(self) -> None:
        for inner, use_muon in zip(self._inner, (True, False)):
            groups = [g for g in self.param_groups if g["use_muon"] is use_muon]
            for g, defaults in zip(groups, inner.param_groups):
                for k, v in defaults.items():
                    g.setdefault(k, v)
            inner.param_groups = groups
            inner.state = self.state

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._link()  # the base class built new group dicts and a new state: point the inner optimizers at them

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for inner in self._inner:
            if inner.param_groups:
                inner.step()
        return loss


def build_optimizer(
    model: torch.nn.Module, section: OptimizerSection
) -> tuple[torch.optim.Optimizer, bool, Assignment]:
    """(optimizer, fused AdamW or not, which parameters went where)."""
    # Fused AdamW (one kernel for all parameters) exists for CUDA and CPU; it is what the HF Trainer uses too.
    fused = section.fused if section.fused is not None else True
    adam_kw = dict(lr=section.lr, betas=section.betas, eps=section.eps, fused=fused or None)
    if section.type == "adamw":
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        return torch.optim.AdamW(param_groups(model, section.weight_decay), **adam_kw), fused, Assignment([], names)
    m = section.muon
    assign = split_for_muon(model)
    if not assign.muon:
        raise PretrainerError("optimizer.type: muon, but the model has no hidden 2-D matrix to put on Muon")
    params = dict(model.named_parameters())
    muon_groups = [{"params": [params[n] for n in assign.muon], "weight_decay": m.weight_decay}]
    rest = [params[n] for n in assign.adamw]
    adamw_groups = [
        {"params": [p for p in rest if p.ndim >= 2], "weight_decay": section.weight_decay},
        {"params": [p for p in rest if p.ndim < 2], "weight_decay": 0.0},
    ]
    muon_kw = dict(
        lr=section.lr,
        weight_decay=m.weight_decay,
        momentum=m.momentum,
        nesterov=m.nesterov,
        ns_steps=m.ns_steps,
        adjust_lr_fn=m.adjust_lr,
    )
    adamw_groups = [g for g in adamw_groups if g["params"]]
    return MuonAdamW(muon_groups, adamw_groups, muon_kw, adam_kw), fused, assign
