"""What a recipe will do, answered without training: parameters, stages, LR at steps, FLOPs per token."""

from __future__ import annotations

from typing import Any

from ..data.tokenizer import load_tokenizer
from ..model import build
from ..model.shape import Shape, shape_of
from ..recipe import sharding
from ..recipe.lint import drawn_tokens, lint
from ..recipe.schedules import lr_lambda
from ..recipe.schema import Recipe
from ..runtime import fp8_capable

# torch, transformers and tokenizers are imported only where a recipe needs them (a hub tokenizer without a declared
# vocabulary, a model type `model.shape` does not know, an fp8 recipe's hardware check): inspect_recipe.py answers
# the shipped recipes in about a second.


def vocab_size_for(recipe: Recipe) -> int | None:
    """The vocabulary size without downloading or training anything, when the recipe tells it."""
    if "vocab_size" in recipe.model.config:
        return None  # the config's own value stands
    if recipe.tokenizer.train is not None:
        return recipe.tokenizer.train.vocab_size
    # a hub id: this needs the network (or the HF cache)
    return len(load_tokenizer(recipe.tokenizer, recipe.model.trust_remote_code))


def model_shape(recipe: Recipe) -> tuple[Shape | None, int, int, object]:
    """(shape or None, parameters, non-embedding parameters, FLOPs-per-token function of seq_len): from the config
    dict when `model.shape` knows the type, else from the model built on the meta device."""
    vocab = vocab_size_for(recipe)
    cfg = dict(recipe.model.config)
    if vocab is not None:
        cfg.setdefault("vocab_size", vocab)
    if (shape := shape_of(cfg)) is not None:
        return shape, shape.params, shape.non_embedding, shape.compute.flops_per_token
    config = build.build_config(recipe.model, vocab_size=vocab)
    model = build.build_model(recipe.model, config, meta=True)
    n_non_emb = build.non_embedding_params(model)
    return None, build.count_params(model), n_non_emb, build.compute_of(config, n_non_emb).flops_per_token


def fp8_check(recipe: Recipe) -> bool | None:
    """Whether this machine has fp8 tensor cores, asked only of an fp8 recipe (the only one it matters to)."""
    if recipe.precision.mixed != "fp8":
        return None
    return fp8_capable()


def summarize(
    recipe: Recipe, lr_steps: list[int] | None = None, available: dict[str, int] | None = None
) -> dict[str, Any]:
    """A JSON-ready summary of the resolved recipe. The model is built on the meta device (no memory).

    Args:
        available: training tokens per prepared source; the others show as unknown (None).
    """
    available = available or {}
    drawn = drawn_tokens(recipe)
    shape, params, n_non_emb, fpt_at = model_shape(recipe)
    fn = lr_lambda(recipe)
    peak = recipe.optimizer.lr
    stages = []
    total_flops = 0
    for s in recipe.plan.spans:
        st = recipe.stages[s.index]
        fpt = fpt_at(s.seq_len)
        total_flops += fpt * s.tokens
        stages.append(
            {
                "name": s.name,
                "start_step": s.start_step,
                "steps": s.steps,
                "tokens": s.tokens,
                "seq_len": s.seq_len,
                "sequences_per_step": s.sequences_per_step,
                "micro_batch_size": s.micro_batch_size,
                "mixture": recipe.stages[s.index].mixture,
                "rope": st.rope.model_dump(exclude_none=True) if st.rope else None,
                "long_docs": st.long_docs.model_dump() if st.long_docs else None,
                "lr_start": peak * fn(s.start_step),
                "lr_end": peak * fn(s.end_step - 1),
                "flops_per_token": fpt,
                "sources": {n: {"drawn": d, "available": available.get(n)} for n, d in drawn[s.index].items()},
            }
        )
    return {
        "params": params,
        "non_embedding_params": n_non_emb,
        "total_steps": recipe.plan.total_steps,
        "total_tokens": sum(s["tokens"] for s in stages),
        "total_flops": total_flops,
        "stages": stages,
        "batches": [
            {
                "start_step": b.start_step,
                "start_tokens": b.start_tokens,
                "global_batch_tokens": b.tokens_per_step,
                "lr_factor": recipe.plan.lr_scale(b.start_step),
            }
            for b in recipe.plan.batches
        ],
        "lr_at": {str(k): peak * fn(k) for k in lr_steps or []},
        "findings": [f.to_dict() for f in lint(recipe, available, fp8_check(recipe))],
    }


def sharding_summary(recipe: Recipe, gpus: int, gpu_gib: float, launch: str | None) -> dict[str, Any]:
    """Each sharding option's memory per GPU and communication per step on `gpus` GPUs of `gpu_gib` GiB, the best
    (fewest bytes moved among those that fit), and the linter's findings on `launch` (none when not given)."""
    shape, *_ = model_shape(recipe)
    if shape is None:
        return {"options": [], "best": None, "findings": [], "note": "model type not modelled (model.shape)"}
    capacity = int(gpu_gib * 2**30)
    options = sharding.footprints(recipe, shape, gpus)
    top = sharding.best(options, capacity)
    found = sharding.sharding_findings(options, launch, gpus, capacity) if launch else []
    return {
        "gpus": gpus,
        "gpu_gib": gpu_gib,
        "options": [f.to_dict() for f in options],
        "best": top.option if top else None,
        "launch": sharding.LAUNCH[top.option] if top else None,
        "findings": [f.to_dict() for f in found],
    }


HEADS = {
    "weights": "weights",
    "gathered": "gathered",
    "grads": "grads",
    "optimizer": "optim",
    "averaging": "avg",
    "buffers": "buffers",
    "activations": "activ",
    "total": "total",
    "comm": "comm",
}


def _format_sharding(sh: dict[str, Any]) -> list[str]:
    if not sh["options"]:
        return [f"sharding        {sh['note']}"]
    gib = 2**30
    lines = [
        f"per GPU on {sh['gpus']} GPUs of {sh['gpu_gib']:g} GiB (GiB; comm: collectives' bytes per GPU per step):",
        "  " + f"{'option':<8}" + "".join(f"{h:>9}" for h in HEADS.values()),
    ]
    for f in sh["options"]:
        mark = "  <- best" if f["option"] == sh["best"] else ""
        lines.append(f"  {f['option']:<8}" + "".join(f"{f[k] / gib:>9.1f}" for k in HEADS) + mark)
    best = f"launch with {sh['launch']}" if sh["best"] else "none fits: add GPUs or recompute activations"
    lines.append(f"  best: {best}")
    return lines


def format_summary(info: dict[str, Any]) -> str:
    lines = [
        f"parameters      {info['params']:,} ({info['non_embedding_params']:,} non-embedding)",
        f"total steps     {info['total_steps']:,}",
        f"total tokens    {info['total_tokens']:,}",
        f"total FLOPs     {info['total_flops']:.3e}",
        "FLOPs/token     " + ", ".join(f"{s['name']}: {s['flops_per_token']:.3e}" for s in info["stages"]),
        "",
        f"{'stage':<12}{'start':>10}{'steps':>10}{'tokens':>18}{'seq_len':>9}{'seqs/step':>11}{'lr start':>11}"
        f"{'lr end':>11}  mixture",
    ]
    for s in info["stages"]:
        mix = ", ".join(f"{k}={v:g}" for k, v in s["mixture"].items())
        if s["rope"]:
            mix += f"  rope={s['rope']}"
        if s["long_docs"]:
            mix += f"  long_docs={s['long_docs']}"
        lines.append(
            f"{s['name']:<12}{s['start_step']:>10,}{s['steps']:>10,}{s['tokens']:>18,}{s['seq_len']:>9}"
            f"{s['sequences_per_step']:>11}{s['lr_start']:>11.3e}{s['lr_end']:>11.3e}  {mix}"
        )
    if len(info["batches"]) > 1:
        lines += ["", "batch schedule (seqs/step above: at each stage's first step):"]
        for b in info["batches"]:
            lines.append(
                f"  from step {b['start_step']:>10,} ({b['start_tokens']:>16,} tokens): "
                f"{b['global_batch_tokens']:>12,} tokens per step, LR x {b['lr_factor']:.3f}"
            )
    lines += ["", "tokens drawn per stage and source, against the source's prepared training tokens:"]
    for s in info["stages"]:
        for n, d in s["sources"].items():
            have = d["available"]
            of = f"{have:>18,}  {d['drawn'] / have:5.2f}x" if have else f"{'unknown':>18}  (not prepared)"
            lines.append(f"  {s['name']:<10}{n:<14}{d['drawn']:>18,} of {of}")
    for f in info["findings"]:
        lines.append(f"warning: {f['id']} {f['field']}: {f['message']} Fix: {f['fix']}")
    if info.get("wall_time"):
        w = info["wall_time"]
        lines.append(
            f"est. wall time  {w['days']:.2f} days on {w['gpus']} GPUs at {w['mfu']:.0%} MFU of "
            f"{w['peak_tflops']:g} TFLOP/s"
        )
    if info.get("sharding"):
        lines += _format_sharding(info["sharding"])
    if info["lr_at"]:
        lines.append("")
        lines += [f"lr at step {k:>10}: {v:.6e}" for k, v in info["lr_at"].items()]
    return "\n".join(lines)


def estimate_wall_time(total_flops: float, gpus: int, mfu: float, peak_tflops: float) -> dict[str, float]:
    """Wall time at a given model-FLOPs utilization: FLOPs / (GPUs x MFU x peak)."""
    seconds = total_flops / (gpus * mfu * peak_tflops * 1e12)
    return {"gpus": gpus, "mfu": mfu, "peak_tflops": peak_tflops, "seconds": seconds, "days": seconds / 86400}
