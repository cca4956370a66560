"""Proof that the optimizer named in the recipe is the one running: on logging steps, the update RMS of a few
sampled tensors per group kind, and for one sampled Muon matrix how orthogonal its applied update is.

Muon replaces a matrix's update by (approximately) the nearest semi-orthogonal matrix: Newton-Schulz pushes every
singular value of the momentum towards 1 (Keller Jordan's quintic leaves them within roughly 0.7-1.2). An Adam or
SGD update keeps the gradient's spectrum, which spans orders of magnitude. The check takes the applied update of
the sampled matrix, removes the decoupled weight decay (-lr * wd * W), and measures the spread of its singular
values: `ortho_err` = sd / mean. A value above `MAX_ORTHO_ERR` on a Muon matrix means the update was not
orthogonalised (a silent fallback, like DeepSpeed's Muon at ZeRO stage 0 that trained as SGD), and the run stops.

Cost: only on logging steps; a copy of the sampled tensors before the step, one SVD of one matrix, one host read.
"""

from __future__ import annotations

import contextlib

import torch

from ...errors import PretrainerError
from ...runtime import innermost_optimizer

MAX_ORTHO_ERR = 0.5
SAMPLES = 4


class OptimizerProbe:
    def __init__(self, optimizer, every_steps: int, expect_muon: bool, items: list | None = None, gather=None):
        """items: (parameter, optimizer group) pairs to sample from, where the optimizer's own parameters are flat
        partitions (DeepSpeed: the module's matrices, ds_muon.probe_items); default the optimizer's groups.
        gather: a context over a list of parameters that makes them whole (ZeRO-3), on every rank."""
        self.every, self.expect_muon, self.gather = every_steps, expect_muon, gather
        if items is None:
            items = [(p, g) for g in innermost_optimizer(optimizer).param_groups for p in g["params"]]
        self.kinds: dict[str, list[tuple[torch.Tensor, dict]]] = {}
        for p, g in items:
            self.kinds.setdefault("muon" if g.get("use_muon") else "adamw", []).append((p, g))
        for kind, items in self.kinds.items():  # a few tensors spread over the model, the largest kind first
            step = max(1, len(items) // SAMPLES)
            self.kinds[kind] = items[::step][:SAMPLES]
        self._before: dict[str, list[torch.Tensor]] | None = None
        self.metrics: dict[str, float] = {}

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def _whole(self):
        params = [p for items in self.kinds.values() for p, _ in items]
        return self.gather(params) if self.gather is not None else contextlib.nullcontext()

    def before(self) -> None:
        with self._whole():
            self._before = {k: [p.detach().clone() for p, _ in items] for k, items in self.kinds.items()}

    @torch.no_grad()
    def after(self, step: int) -> None:
        """Measure the update just applied; raises PretrainerError when Muon's sampled update is not orthogonal."""
        if self._before is None:
            return
        with self._whole():
            self._measure()
        err = self.metrics.get("optim/muon/ortho_err")
        if self.expect_muon and (err is None or not err <= MAX_ORTHO_ERR):
            raise PretrainerError(
                f"optimizer.type: muon, but the update applied at step {step} to a Muon matrix is not orthogonalised "
                f"(singular-value spread {err} > {MAX_ORTHO_ERR}): the optimizer running is not Muon"
            )

    def _measure(self) -> None:
        out = {}
        for kind, items in self.kinds.items():
            sq, n = torch.zeros((), device=items[0][0].device), 0
            for (p, g), w0 in zip(items, self._before[kind]):
                delta = p.detach().float() - w0.float()
                sq += delta.pow(2).sum()
                n += delta.numel()
                if kind == "muon" and f"optim/{kind}/ortho_err" not in out:
                    # the update itself: remove the decoupled weight decay that Muon applied first
                    update = delta + g["lr"] * g["weight_decay"] * w0.float()
                    s = torch.linalg.svdvals(update)
                    out[f"optim/{kind}/ortho_err"] = s.std() / s.mean().clamp_min(1e-30)
            out[f"optim/{kind}/update_rms"] = (sq / max(n, 1)).sqrt()
        self._before = None
        keys = list(out)
        values = torch.stack([torch.as_tensor(out[k], dtype=torch.float32) for k in keys]).tolist()
        self.metrics = dict(zip(keys, values))

    def take(self) -> dict[str, float]:
        out, self.metrics = self.metrics, {}
        return out
