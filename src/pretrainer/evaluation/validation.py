"""Forward passes without gradients: held-out loss per source, and per-sample losses of a past step's batches (for
blaming a recurring spike on its data)."""

from __future__ import annotations

import math
import time
from functools import partial

import torch
import torch.nn.functional as F

from ..data.pipeline import SourceData, StageBatches, validation_batches
from ..data.sources import used_sources
from ..model.masking import Inputs, plain_inputs
from ..observe.events import VAL_REF_SE
from ..recipe.eval_sections import ContextEvalSection
from ..recipe.schema import Recipe
from .context import bucket_name, context_verdict, long_rows, padded_share, position_buckets, position_table

AVG_SE = "val/avg_se"
"""`_losses`'s standard error of `val/avg` (internal; logged as `val/ref_se` for the reference batches)."""


class Evaluator:
    """Held-out losses: `val/<source>` and `val/avg` at the stage's (seq_len, micro batch); `val/ref` at one fixed
    (seq_len, micro batch) for the whole run, every source weighted equally; and, when asked, loss by position
    (`val_pos/<from>-<to>`) with its context verdict in `self.context`. The same fixed batches at every eval."""

    def __init__(
        self,
        accelerator,
        model,
        sources: dict[str, SourceData],
        names: list[str],
        max_batches: int,
        inputs: Inputs = plain_inputs,
        ref: tuple[int, int] | None = None,
        context: ContextEvalSection | None = None,
        context_sources: list[str] | None = None,
    ):
        """Args:
        inputs: token rows -> model inputs (document masking, when the recipe asks for it).
        ref: the (seq_len, micro batch) of `val/ref`.
        context_sources: whose validation documents loss by position reads."""
        self.acc, self.model, self.sources, self.names = accelerator, model, sources, names
        self.max_batches, self.inputs, self.ref = max_batches, inputs, ref
        self.context_section, self.context_sources = context, context_sources or names
        self._cache: dict[tuple[int, int], dict[str, list[torch.Tensor]]] = {}
        self._rows: dict[int, list] = {}
        self.context: dict | None = None
        """The latest loss-by-position table and verdict (set by a call with `context=True`)."""

    @classmethod
    def for_recipe(cls, accelerator, model, sources, recipe: Recipe, inputs: Inputs) -> Evaluator:
        ev, first = recipe.eval, recipe.plan.spans[0]
        ref_len = ev.ref_seq_len or first.seq_len
        ref_micro = max(1, first.micro_batch_size * first.seq_len // ref_len)  # the run's tokens per micro batch
        return cls(
            accelerator,
            model,
            sources,
            used_sources(recipe),
            ev.max_batches,
            inputs,
            (ref_len, ref_micro),
            ev.context if ev.context.enabled else None,
            context_sources(recipe),
        )

    @torch.no_grad()
    def __call__(self, seq_len: int, micro: int, context: bool = False) -> dict[str, float]:
        """`val/<source>`, `val/avg`, `val/ref`, `val_pos/*` (with `context`) and `eval/seconds`."""
        t0, self.context = time.perf_counter(), None
        self.model.eval()
        out = self._losses(seq_len, micro)
        if self.ref is not None:
            ref = out if self.ref == (seq_len, micro) else self._losses(*self.ref)
            out["val/ref"] = ref["val/avg"]
            out[VAL_REF_SE] = ref[AVG_SE]
        out.pop(AVG_SE, None)
        if context and self.context_section is not None:
            out.update(self._positions())
        out["eval/seconds"] = time.perf_counter() - t0
        self.model.train()
        return out

    @torch.no_grad()
    def reference(self) -> float:
        """`val/ref` alone (the merged weights' eval)."""
        self.model.eval()
        value = self._losses(*self.ref)["val/avg"]  # (its standard error is the live weights' to report)
        self.model.train()
        return value

    @torch.no_grad()
    def batch_losses(self) -> list[float]:
        """The loss of each fixed `val/ref` batch (every source's, in order), gathered over ranks: paired samples
        for comparing two sets of weights on the same held-out tokens (`critical_batch.py`)."""
        acc, model = self.acc, self.model
        flat = [b for name in self.names for b in self._batches(*self.ref)[name]]
        out = torch.zeros(len(flat), device=acc.device)
        model.eval()
        for k, real in padded_share(len(flat), acc.process_index, acc.num_processes):
            loss = model(**self.inputs(flat[k].to(acc.device)), use_cache=False).loss.float()
            if real:
                out[k] = loss
        model.train()
        return acc.reduce(out, reduction="sum").tolist()

    def _batches(self, seq_len: int, micro: int) -> dict[str, list[torch.Tensor]]:
        if (seq_len, micro) not in self._cache:
            config = getattr(self.acc.unwrap_model(self.model), "config", None)
            self._cache[(seq_len, micro)] = validation_batches(
                self.sources, self.names, seq_len, micro, self.max_batches, getattr(config, "vocab_size", None)
            )
        return self._cache[(seq_len, micro)]

    def _losses(self, seq_len: int, micro: int) -> dict[str, float]:
        """Split over ranks; every rank runs the same number of forwards (ZeRO-3 gathers parameters inside
        forward, so an uneven count would hang)."""
        acc, model = self.acc, self.model
        val = self._batches(seq_len, micro)
        out, variances = {}, []
        for name in self.names:
            batches = val[name]
            # token-weighted sums of the batches' losses and of their squares, and the batch count: the mean and
            # the standard error of the mean from the spread between batches
            total = torch.zeros(4, device=acc.device)
            for k, real in padded_share(len(batches), acc.process_index, acc.num_processes):
                mb = batches[k].to(acc.device)
                loss = model(**self.inputs(mb), use_cache=False).loss.float()
                w, n = torch.tensor([float(mb.numel() * real), float(real)], device=acc.device)
                total += torch.stack([loss * w, w, loss * loss * w, n])
            s, w, s2, n = acc.reduce(total, reduction="sum").tolist()
            mean = s / w
            out[f"val/{name}"] = mean
            variances.append(max(0.0, s2 / w - mean * mean) * n / max(n - 1, 1) / max(n, 1))
        out["val/avg"] = sum(out.values()) / len(self.names)
        out[AVG_SE] = math.sqrt(sum(variances)) / len(self.names)
        return out

    def _positions(self) -> dict[str, float]:
        """Loss by position up to the window the model advertises now (its config's max_position_embeddings)."""
        acc, sec = self.acc, self.context_section
        window = int(acc.unwrap_model(self.model).config.max_position_embeddings)
        if window not in self._rows:
            splits = {n: self.sources[n].val for n in self.context_sources}
            self._rows[window] = long_rows(splits, window, sec.max_docs)
        rows = self._rows[window]
        if not rows:
            self.context = {
                "window": window,
                "docs": 0,
                "verdict": f"unmeasured: no held-out document of {window:,} tokens or more in {self.context_sources}",
            }
            return {}
        buckets = position_buckets(window, sec.first_bucket)
        table = position_table(
            self.model,
            rows,
            buckets,
            acc.device,
            acc.process_index,
            acc.num_processes,
            partial(acc.reduce, reduction="sum"),
        )
        self.context = {"window": window, "docs": len(rows), "buckets": table, **context_verdict(table, window)}
        return {bucket_name(b["lo"], b["hi"]): b["loss"] for b in table}


def context_sources(recipe: Recipe) -> list[str]:
    """`eval.context.sources`, else the sources of stages with `long_docs`, else every used source."""
    if recipe.eval.context.sources:
        return list(recipe.eval.context.sources)
    long = {n for st in recipe.stages if st.long_docs for n, w in st.mixture.items() if w > 0}
    return [n for n in used_sources(recipe) if n in long] or used_sources(recipe)


def eval_due(recipe: Recipe, step: int, span) -> tuple[bool, bool]:
    """(evaluate now, with loss by position): every `eval.every_steps`, at stage ends (`eval.at_stage_end`) and at
    the end; loss by position in the longest-context stage(s) and at the end of the run."""
    ev, total = recipe.eval, recipe.plan.total_steps
    now = bool(ev.every_steps and step % ev.every_steps == 0) or step == total
    now = now or (ev.at_stage_end and step == span.end_step)
    longest = max(s.seq_len for s in recipe.plan.spans)
    return now, now and (step == total or span.seq_len == longest)


@torch.no_grad()
def sample_losses(
    accelerator,
    model,
    batcher: StageBatches,
    cursor: int,
    skips: list[tuple[int, int]],
    inputs: Inputs = plain_inputs,
    sequences: int | None = None,
) -> tuple[list[int], list[float]]:
    """The global sample indices of the step that started at `cursor` (of `sequences` sequences: its batch), and
    each sample's mean token loss (gathered over ranks: rank order is sample order)."""
    idx, _ = batcher.indices(cursor, skips, sequences)
    rank, world = accelerator.process_index, accelerator.num_processes
    batches, _, _ = batcher.step_batches(cursor, rank, world, skips, sequences)
    mine = []
    for mb in batches:
        x = inputs(mb.to(accelerator.device))
        labels = x.pop("labels")[:, 1:]
        logits = model(**x, use_cache=False).logits.float()
        per_tok = F.cross_entropy(logits[:, :-1].transpose(1, 2), labels, reduction="none", ignore_index=-100)
        mine.append(per_tok.sum(dim=1) / (labels != -100).sum(dim=1).clamp(min=1))
    return idx, accelerator.gather(torch.cat(mine)).tolist()
