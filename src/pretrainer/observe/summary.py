"""What a recipe will do, answered without training: parameters, stages, LR at steps, FLOPs per token."""

from __future__ import annotations

from typing import Any

from ..data.tokenizer import load_tokenizer
from ..model.build import build_config, build_model, count_params, flops_per_token, non_embedding_params
from ..recipe.lint import drawn_tokens, lint
from ..recipe.schedules import lr_lambda
from ..recipe.schema import Recipe
from ..train.accelerator import fp8_capable


def vocab_size_for(recipe: Recipe) -> int | None:
    """The vocabulary size without downloading or training anything, when the recipe tells it."""
    if "vocab_size" in recipe.model.config:
        return None  # the config's own value stands
    if recipe.tokenizer.train is not None:
        return recipe.tokenizer.train.vocab_size
    # a hub id: this needs the network (or the HF cache)
    return len(load_tokenizer(recipe.tokenizer, recipe.model.trust_remote_code))


def summarize(
    recipe: Recipe, lr_steps: list[int] | None = None, available: dict[str, int] | None = None
) -> dict[str, Any]:
    """A JSON-ready summary of the resolved recipe. The model is built on the meta device (no memory).

    Args:
        available: training tokens per prepared source; the others show as unknown (None).
    """
    available = available or {}
    drawn = drawn_tokens(recipe)
    config = build_config(recipe.model, vocab_size=vocab_size_for(recipe))
    model = build_model(recipe.model, config, meta=True)
    params = count_params(model)
    n_non_emb = non_embedding_params(model)
    fn = lr_lambda(recipe)
    peak = recipe.optimizer.lr
    stages = []
    total_flops = 0
    for s in recipe.plan.spans:
        st = recipe.stages[s.index]
        fpt = flops_per_token(config, n_non_emb, s.seq_len)
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
        "lr_at": {str(k): peak * fn(k) for k in lr_steps or []},
        "findings": [f.to_dict() for f in lint(recipe, available, fp8_capable())],
    }


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
    if info["lr_at"]:
        lines.append("")
        lines += [f"lr at step {k:>10}: {v:.6e}" for k, v in info["lr_at"].items()]
    return "\n".join(lines)


def estimate_wall_time(total_flops: float, gpus: int, mfu: float, peak_tflops: float) -> dict[str, float]:
    """Wall time at a given model-FLOPs utilization: FLOPs / (GPUs x MFU x peak)."""
    seconds = total_flops / (gpus * mfu * peak_tflops * 1e12)
    return {"gpus": gpus, "mfu": mfu, "peak_tflops": peak_tflops, "seconds": seconds, "days": seconds / 86400}
