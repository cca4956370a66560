"""Downstream scores through lm-evaluation-harness: its `HFLM` on a live or loaded model, results as flat metrics.

In the training loop the model is scored in the main process: the unwrapped module itself when every rank holds
whole weights (one process, DDP, ZeRO-1/2), or a copy gathered onto the main process when ZeRO-3 or FSDP shard them
(O(parameters) host memory there, for the eval's duration; for models too large for that, score checkpoints with
`scripts/eval_checkpoint.py` in a separate process). Other ranks wait. lm-eval seeds Python, NumPy and torch for its
own reproducibility; the training RNG states are put back afterwards, so an eval never changes what training draws.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from pathlib import Path
from unittest import mock

import torch
from accelerate.utils import DistributedType, broadcast_object_list
from tqdm.auto import tqdm

from ..errors import RecipeError
from ..recipe.eval_sections import LmEvalSection
from ..runtime import rng_kept


def require_lm_eval() -> None:
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise RecipeError("eval.lm_eval: lm-evaluation-harness is not installed; pip install -e .[eval]") from None


def copy_holding(model: torch.nn.Module, state: dict[str, torch.Tensor], device) -> torch.nn.Module:
    """A fresh instance of `model`'s class holding `state`, built in the state's float dtype.

    As `from_pretrained(torch_dtype=...)` does: a bf16 gather (DeepSpeed ZeRO-3 under bf16) makes a bf16 copy, not
    an fp32 one twice its size. The class itself, not `from_config`: transformers would build it inside
    `deepspeed.zero.Init`, whose partitioning is a collective the other ranks are not in.
    """
    dtype = next((t.dtype for t in state.values() if t.is_floating_point()), torch.get_default_dtype())
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            copy = type(model)(model.config)
    finally:
        torch.set_default_dtype(previous)
    copy.load_state_dict(state, strict=False)
    copy.tie_weights()
    return copy


@contextlib.contextmanager
def quiet_bars():
    """lm-eval's progress bars off (they would interleave with the training bar); its modules import `tqdm` by
    name, so the name is what is replaced, for the duration only."""
    from lm_eval.api import model as api_model
    from lm_eval.api import task as api_task
    from lm_eval.models import huggingface

    def silent(*args, **kwargs):  # lm-eval passes its own `disable=`: overrule it
        return tqdm(*args, **{**kwargs, "disable": True})

    with contextlib.ExitStack() as stack:
        for module in (api_model, api_task, huggingface):
            stack.enter_context(mock.patch.object(module, "tqdm", silent))
        yield


def flat_results(results: dict) -> dict[str, float]:
    """lm-eval's `results` -> {"eval/<task>/<metric>": value}; the filter is kept in the name unless it is "none"."""
    out = {}
    for task, metrics in results.get("results", {}).items():
        for key, value in metrics.items():
            if key == "alias" or not isinstance(value, int | float) or "," not in key:
                continue
            metric, filt = key.split(",", 1)
            name = metric if filt == "none" else f"{metric}_{filt}"
            out[f"eval/{task}/{name}"] = float(value)
    return out


def lm_eval_scores(
    model,
    tokenizer,
    tasks: list[str],
    limit: int | None = None,
    num_fewshot: int | None = None,
    include_path: str | None = None,
    batch_size: int = 8,
    manager=None,
) -> dict[str, float]:
    """Score a `PreTrainedModel` (already on its device) on lm-eval tasks, in this process.

    Args:
        manager: a `task_manager(tasks, include_path)` built earlier (indexing lm-eval's tasks takes ~6 s), or None.
    """
    require_lm_eval()
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    for name in ("lm-eval", "lm_eval"):
        logging.getLogger(name).setLevel(logging.ERROR)
    was_training = model.training
    model.eval()
    try:
        with rng_kept(), quiet_bars(), torch.no_grad():
            lm = HFLM(
                pretrained=model,
                tokenizer=tokenizer,
                batch_size=batch_size,
                max_length=model.config.max_position_embeddings,
            )
            manager = manager or task_manager(tasks, include_path)
            res = simple_evaluate(
                model=lm,
                tasks=list(tasks),
                num_fewshot=num_fewshot,
                limit=limit,
                task_manager=manager,
                bootstrap_iters=0,
                log_samples=False,
                verbosity="ERROR",
            )
    finally:
        model.train(was_training)
    return flat_results(res)


def task_manager(tasks: list[str], include_path: str | None):
    """lm-eval's task index (built-in tasks plus `include_path`), with every asked-for task known to it."""
    require_lm_eval()
    from lm_eval.tasks import TaskManager

    if include_path is not None and not Path(include_path).is_dir():
        raise RecipeError(f"eval.lm_eval.include_path: {include_path!r} is not a directory")
    manager = TaskManager(include_path=include_path)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        where = f" (local tasks from {include_path})" if include_path else ""
        raise RecipeError(f"eval.lm_eval.tasks: unknown task(s) {unknown}{where}")
    return manager


class Downstream:
    """`eval.lm_eval` in the training loop: when it is due, and the scores of the live model."""

    def __init__(self, accelerator, model, tokenizer, section: LmEvalSection | None, total_steps: int):
        self.acc, self.model, self.tokenizer, self.section, self.total = (
            accelerator,
            model,
            tokenizer,
            section,
            total_steps,
        )
        # on every rank, before training: an unknown task fails fast; kept for every scoring (indexing takes ~6 s)
        self.manager = task_manager(section.tasks, section.include_path) if section is not None else None

    def due(self, step: int) -> bool:
        s = self.section
        if s is None:
            return False
        return (step == 0 and s.at_start) or step == self.total or bool(s.every_steps and step % s.every_steps == 0)

    def _scored_model(self):
        """The model lm-eval sees on the main process (None elsewhere); every rank must call this (a gather)."""
        acc = self.acc
        unwrapped = acc.unwrap_model(self.model)
        sharded = acc.distributed_type == DistributedType.FSDP or (
            acc.distributed_type == DistributedType.DEEPSPEED and acc.state.deepspeed_plugin.zero_stage == 3
        )
        if not sharded:
            return unwrapped if acc.is_main_process else None
        state = acc.get_state_dict(self.model)  # all ranks take part; the full weights land on the main process
        if not acc.is_main_process:
            return None
        return copy_holding(unwrapped, state, acc.device)

    def __call__(self, step: int) -> dict[str, float]:
        if not self.due(step):
            return {}
        s, acc, t0 = self.section, self.acc, time.perf_counter()
        model = self._scored_model()
        scores = [None]
        if acc.is_main_process:
            scores[0] = lm_eval_scores(
                model, self.tokenizer, s.tasks, s.limit, s.num_fewshot, s.include_path, s.batch_size, self.manager
            )
        if acc.num_processes > 1:
            broadcast_object_list(scores, from_process=0)
        acc.wait_for_everyone()
        out = {k: v for k, v in (scores[0] or {}).items() if math.isfinite(v)}
        return {**out, "eval/lm_eval_seconds": time.perf_counter() - t0}
