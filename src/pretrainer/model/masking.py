"""Document masking for packed rows: attention stays inside each document and positions restart at each one.

A packed row is documents joined by EOS (each document ends with one). With `data.document_masking: true` a token
attends only to earlier tokens of its own document, its position id counts from its document's start, and the
first token of a document is not a target (nothing before it in the row may predict it): each document trains
exactly as if it were fed alone (tests/test_masking.py checks the losses against that).

How the mask reaches attention depends on the implementation: flash attention gets the per-document `position_ids`
alone (transformers' packed-sequence path: no mask, no padding, O(T) memory); sdpa a boolean [B, 1, T, T] mask;
eager an additive float one. The last two cost B*T^2 bytes (bool) or 4 bytes per entry (eager), per micro batch:
use flash attention on GPUs.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial

import torch
from transformers import masking_utils

Inputs = Callable[[torch.Tensor], dict[str, torch.Tensor]]
"""Token rows [B, T] -> the model's keyword arguments."""

FLASH = ("flash_attention_2", "flash_attention_3", "kernels-community/flash-attn", "kernels-community/flash-attn3")


def document_inputs(ids: torch.Tensor, eos_id: int, attn_implementation: str) -> dict[str, torch.Tensor]:
    """Model inputs for rows `ids` [B, T] with attention and positions confined to documents."""
    eos = ids == eos_id
    first = torch.ones_like(eos)
    first[:, 1:] = eos[:, :-1]  # a document starts after an EOS (and at the row's start)
    pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    start = torch.where(first, pos, torch.zeros_like(pos)).cummax(dim=1).values
    labels = ids.masked_fill(first, -100)
    out = {"input_ids": ids, "labels": labels, "position_ids": pos - start}
    if attn_implementation in FLASH:
        return out
    doc = first.long().cumsum(dim=1)
    T = ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril()
    mask = ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]
    if attn_implementation != "sdpa":  # eager and others add the mask to the scores
        mask = torch.zeros(mask.shape, device=ids.device).masked_fill(~mask, torch.finfo(torch.float32).min)
    out["attention_mask"] = mask
    return out


def plain_inputs(ids: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"input_ids": ids, "labels": ids}


def model_inputs(document_masking: bool, eos_id: int, attn_implementation: str | None) -> Inputs:
    """The recipe's choice: per-document inputs, or the rows as they are."""
    if not document_masking:
        return plain_inputs
    return partial(document_inputs, eos_id=eos_id, attn_implementation=attn_implementation or "sdpa")


# transformers checks every forward's position ids for packed sequences (`find_packed_sequence_indices`), reading
# them on the host: one device sync per micro batch. Rows fed without position ids are not packed by construction
# (the model numbers them 0..T-1), so for those the check is skipped; with per-document position ids (document
# masking on flash attention) it runs as before.
_UNPACKED = contextvars.ContextVar("pretrainer_unpacked_rows", default=False)
_find_packed = masking_utils.find_packed_sequence_indices


def _find_packed_unless_unpacked(position_ids: torch.Tensor) -> torch.Tensor | None:
    return None if _UNPACKED.get() else _find_packed(position_ids)


@contextmanager
def forward_of(inputs: dict[str, torch.Tensor]) -> Iterator[None]:
    """Around a forward pass of `inputs`: no packed-sequence check (and no host sync) when they carry no position
    ids. Installs the check's wrapper once (it defers to transformers' own outside this context)."""
    masking_utils.find_packed_sequence_indices = _find_packed_unless_unpacked
    token = _UNPACKED.set("position_ids" not in inputs)
    try:
        yield
    finally:
        _UNPACKED.reset(token)
