"""The recipe linter: the classic recipe mistakes, each with a stable id, a message and the fix.

Run by `inspect_recipe.py` (`--strict` turns findings into errors) and at the start of every training run (warnings).
`checkpoint.keep_last < 2` is not here: the recipe schema rejects it outright.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .schedules import lr_lambda
from .schema import Recipe
from .stability import prevention


@dataclass(frozen=True)
class Finding:
    id: str
    field: str
    message: str
    fix: str

    def __str__(self) -> str:
        return f"{self.id} {self.field}: {self.message} Fix: {self.fix}"

    def to_dict(self) -> dict:
        return asdict(self)


ANNEAL_NAMES = ("anneal", "cooldown", "cool_down", "decay")


def _hq_share(recipe: Recipe, mixture: dict[str, float]) -> float:
    high = {n for n, s in recipe.data.sources.items() if s.quality == "high"}
    return sum(w for n, w in mixture.items() if n in high) / sum(mixture.values())


def _schedule_rules(recipe: Recipe) -> list[Finding]:
    """Warmup length and clipping."""
    out: list[Finding] = []
    plan, sched = recipe.plan, recipe.schedule
    total = round(plan.clock(plan.total_steps))  # in steps of the first batch size, as warmup counts them
    warm = sched.warmup_steps
    if warm < min(1000, 0.01 * total):
        out.append(
            Finding(
                "PT001",
                "schedule.warmup_steps",
                f"{warm} warmup steps for a {total}-step run: Adam's moments are not yet estimated and early updates "
                "are large, the classic cause of early loss spikes.",
                f"use about 1-5% of the run (e.g. {max(1, round(0.02 * total))}), up to ~2,000 steps for large runs.",
            )
        )
    if warm > 0.1 * total:
        out.append(
            Finding(
                "PT002",
                "schedule.warmup_steps",
                f"warmup is {warm / total:.0%} of the run: those tokens are trained at a tiny learning rate.",
                f"keep warmup under ~5% of the run (e.g. {max(1, round(0.03 * total))}).",
            )
        )
    if plan.max_grad_norm is None:
        out.append(
            Finding(
                "PT004",
                "clipping.max_grad_norm",
                "gradient clipping is disabled: one bad batch can take an arbitrarily large step.",
                "set clipping.max_grad_norm: 1.0.",
            )
        )

    return out


def _context_rules(recipe: Recipe) -> list[Finding]:
    """The advertised context against the trained one, and RoPE changes for longer stages."""
    out: list[Finding] = []
    spans = recipe.plan.spans
    # context: the model's advertised window versus what it is trained at
    ctx_cfg = recipe.model.config.get("max_position_embeddings")
    longest = max(s.seq_len for s in spans)
    if ctx_cfg and ctx_cfg > longest:
        out.append(
            Finding(
                "PT005",
                "model.config.max_position_embeddings",
                f"the model advertises {ctx_cfg} positions but no stage trains beyond {longest}: positions past "
                f"{longest} are untrained and the exported config overstates the usable context.",
                f"set max_position_embeddings: {longest}, or add a long-context stage at {ctx_cfg}.",
            )
        )
    base_ctx = spans[0].seq_len
    rope_changed = False
    for i, st in enumerate(recipe.stages):
        rope_changed = rope_changed or st.rope is not None
        if st.seq_len > base_ctx and not rope_changed:
            out.append(
                Finding(
                    "PT006",
                    f"stages.{i}.rope",
                    f"stage {st.name!r} trains at {st.seq_len} tokens ({st.seq_len // base_ctx}x the first stage) "
                    "without a RoPE change: the rotary frequencies were fitted to the short context.",
                    "raise the base (rope: {theta: 500000}) or add YaRN scaling in this stage.",
                )
            )
    if longest > base_ctx and not recipe.eval.context.enabled:
        out.append(
            Finding(
                "PT016",
                "eval.context.enabled",
                f"the run trains up to {longest} tokens but loss by position is off: nothing measures whether the "
                "long-context stage earned the window the model will advertise.",
                "set eval.context.enabled: true (the default).",
            )
        )
    return out


def _decay_rules(recipe: Recipe) -> list[Finding]:
    """The WSD decay's length and the anneal stage."""
    out: list[Finding] = []
    plan, sched, fn = recipe.plan, recipe.schedule, lr_lambda(recipe)
    spans, total = plan.spans, plan.total_steps
    if plan.decay_steps is not None:  # its share of the run's tokens (of its steps, for a constant batch)
        decay = plan.decay_steps
        share = (plan.clock(plan.decay_start + decay) - plan.clock(plan.decay_start)) / plan.clock(total)
        if share < 0.05:
            out.append(
                Finding(
                    "PT007",
                    "schedule.decay_fraction" if not sched.decay_stage else "schedule.decay_stage",
                    f"the WSD decay is {decay} steps, {share:.1%} of the run; decays much shorter than ~10% "
                    "leave loss on the table.",
                    "decay over ~10-20% of the run.",
                )
            )

    for i, (st, span) in enumerate(zip(recipe.stages, spans)):
        is_anneal = st.name.lower().startswith(ANNEAL_NAMES) or st.name == sched.decay_stage
        if is_anneal and fn(span.end_step - 1) > 0.5:
            out.append(
                Finding(
                    "PT008",
                    f"stages.{i}",
                    f"anneal stage {st.name!r} ends at {fn(span.end_step - 1):.0%} of the peak LR: an anneal needs a "
                    "falling learning rate to pay off.",
                    f"with WSD set schedule.decay_stage: {st.name}; with cosine, end the run on this stage.",
                )
            )
        if is_anneal and i > 0 and _hq_share(recipe, st.mixture) <= _hq_share(recipe, recipe.stages[0].mixture):
            out.append(
                Finding(
                    "PT013",
                    f"stages.{i}.mixture",
                    f"anneal stage {st.name!r} gives the `quality: high` sources no more weight than the first stage.",
                    "shift the anneal's mixture toward the highest-quality sources (and mark them quality: high).",
                )
            )
        weight = sum(st.mixture.values())
        if abs(weight - 1.0) > 1e-6:
            out.append(
                Finding(
                    "PT009",
                    f"stages.{i}.mixture",
                    f"weights of stage {st.name!r} sum to {weight:g}; they are normalized, which may not be what you meant.",
                    "make the weights sum to 1.",
                )
            )

    return out


def _operations_rules(recipe: Recipe) -> list[Finding]:
    """Evaluation and checkpoint cadence."""
    out: list[Finding] = []
    plan = recipe.plan
    total, total_tokens = plan.total_steps, plan.total_tokens
    if recipe.eval.every_steps == 0:
        out.append(
            Finding(
                "PT010",
                "eval.every_steps",
                "periodic evaluation is disabled: overfitting and divergence show in validation loss first.",
                f"evaluate every ~1-5% of the run (e.g. every_steps: {max(1, total // 50)}).",
            )
        )

    lm, every = recipe.eval.lm_eval, recipe.eval.every_steps
    if lm is not None and every and lm.every_steps % every:  # (every == 0: PT010 already says evals are off)
        near = every * max(1, round(lm.every_steps / every))
        out.append(
            Finding(
                "PT017",
                "eval.lm_eval.every_steps",
                f"downstream scores are taken at evals only, and every {lm.every_steps} steps is not a multiple of "
                f"eval.every_steps ({every}): they would come at the common multiples and at the end only.",
                f"use a multiple of {every} (e.g. {near}).",
            )
        )
    ck = recipe.checkpoint
    if ck.every_minutes is not None and ck.every_minutes > 60:
        out.append(
            Finding(
                "PT011",
                "checkpoint.every_minutes",
                f"a checkpoint every {ck.every_minutes:g} minutes: a crash loses up to that much compute.",
                "save at least hourly (every_minutes: 30).",
            )
        )
    if ck.every_tokens is not None and ck.every_tokens > total_tokens:
        out.append(
            Finding(
                "PT011",
                "checkpoint.every_tokens",
                f"every_tokens ({ck.every_tokens:,}) is larger than the whole run ({total_tokens:,} tokens).",
                "pick an interval a few percent of the run.",
            )
        )
    if ck.every_minutes is None and ck.every_tokens is None:
        out.append(
            Finding(
                "PT011",
                "checkpoint",
                "no time or token trigger: checkpoints only at stage ends.",
                "set checkpoint.every_minutes: 30.",
            )
        )
    return out


def _batch_rules(recipe: Recipe) -> list[Finding]:
    """The batch against the critical batch: a constant batch far above it, a schedule that grows past it."""
    out: list[Finding] = []
    crit = recipe.batch.critical_batch_tokens
    if crit and recipe.batch.global_batch_tokens > 4 * crit:
        out.append(
            Finding(
                "PT012",
                "batch.global_batch_tokens",
                f"the global batch ({recipe.batch.global_batch_tokens:,} tokens) is "
                f"{recipe.batch.global_batch_tokens / crit:.1f}x the estimated critical batch ({crit:,}): beyond it, "
                "doubling the batch buys little and costs compute.",
                f"lower the global batch toward ~{crit:,} tokens (or raise it only as the noise scale grows).",
            )
        )
    sched = recipe.batch.schedule or []
    over = [(i, c) for i, c in enumerate(sched) if i > 0 and crit and c.global_batch_tokens > crit]
    if over:
        i, c = over[0]
        out.append(
            Finding(
                "PT022",
                f"batch.schedule.{i}.global_batch_tokens",
                f"the schedule grows the batch to {c.global_batch_tokens:,} tokens, above the measured critical batch "
                f"({crit:,}, batch.critical_batch_tokens): past it, a bigger batch trains no faster per token.",
                "grow the batch only once scripts/critical_batch.py measures the critical batch above the new size.",
            )
        )
    return out


def drawn_tokens(recipe: Recipe) -> list[dict[str, int]]:
    """Per stage, the training tokens each source contributes (the stage's tokens split by its mixture weights)."""
    out = []
    for st, span in zip(recipe.stages, recipe.plan.spans):
        total = sum(w for w in st.mixture.values() if w > 0)
        out.append({n: round(span.tokens * w / total) for n, w in st.mixture.items() if w > 0})
    return out


def _repetition_rules(recipe: Recipe, available: dict[str, int]) -> list[Finding]:
    """A source drawn more than once over: repeated tokens are worth less than fresh ones and invite memorisation.

    Each stage samples its mixture afresh, so a stage that alone exceeds a source repeats it within the stage; the
    run as a whole can also repeat a source that no single stage exhausts.
    """
    out: list[Finding] = []
    drawn = drawn_tokens(recipe)
    run_total: dict[str, int] = {}
    flagged: set[str] = set()
    fix = "use a larger dataset (or another source) for it, lower its weight, or train the stage on fewer tokens."
    for i, (st, per_source) in enumerate(zip(recipe.stages, drawn)):
        for name, d in per_source.items():
            run_total[name] = run_total.get(name, 0) + d
            have = available.get(name)
            if have and d > have:
                flagged.add(name)
                out.append(
                    Finding(
                        "PT014",
                        f"stages.{i}.mixture.{name}",
                        f"stage {st.name!r} draws {d:,} tokens from {name!r}, {d / have:.1f}x its {have:,} prepared "
                        "training tokens: every document is seen that many times.",
                        fix,
                    )
                )
    for name, d in run_total.items():
        have = available.get(name)
        if have and d > have and name not in flagged:
            out.append(
                Finding(
                    "PT014",
                    f"data.sources.{name}",
                    f"the stages together draw {d:,} tokens from {name!r}, {d / have:.1f}x its {have:,} prepared "
                    "training tokens.",
                    fix,
                )
            )
    return out


def _hardware_rules(recipe: Recipe, fp8_capable: bool | None) -> list[Finding]:
    if recipe.precision.mixed == "fp8" and fp8_capable is False:
        return [
            Finding(
                "PT015",
                "precision.mixed",
                "fp8 is asked for, but this machine has no GPU with fp8 tensor cores (compute capability 8.9+: Ada, "
                "Hopper, Blackwell): the run will stop at start.",
                "use bf16 here; keep fp8 for the GPUs that have it.",
            )
        ]
    return []


def _optimizer_rules(recipe: Recipe) -> list[Finding]:
    """Muon's classic mistake: an AdamW-sized LR with Keller Jordan's adjustment, which expects a Muon-sized one
    (~0.02). (Muon on the embeddings or the head cannot happen here: the split is by role, optim.py.)"""
    opt = recipe.optimizer
    if opt.type == "muon" and opt.muon.adjust_lr == "original" and opt.lr < 5e-3:
        return [
            Finding(
                "PT018",
                "optimizer.muon.adjust_lr",
                f"Muon with adjust_lr: original and lr {opt.lr:g}, an AdamW-sized LR: the original adjustment "
                "(sqrt(max(1, A/B))) does not match AdamW's update RMS, so the hidden matrices barely move.",
                "use adjust_lr: match_rms_adamw (the AdamW LR and schedule then serve both), or a Muon LR (~0.02).",
            )
        ]
    return []


def approx_params(config: dict) -> int:
    """Parameters of a Llama-shaped decoder from its config dict (attention with GQA, a gated MLP, the embeddings
    once or twice): the size the lint judges by, without building the model."""
    h, layers = config.get("hidden_size", 4096), config.get("num_hidden_layers", 32)
    heads = config.get("num_attention_heads", 32)
    head_dim = config.get("head_dim") or h // heads
    kv = config.get("num_key_value_heads", heads) * head_dim
    attn = h * heads * head_dim * 2 + 2 * h * kv
    mlp = 3 * h * config.get("intermediate_size", 4 * h)
    emb = config.get("vocab_size", 32000) * h * (1 if config.get("tie_word_embeddings", False) else 2)
    return layers * (attn + mlp) + emb


def _stability_rules(recipe: Recipe) -> list[Finding]:
    """A low-precision run of 1B+ parameters with nothing against logit growth (OLMo 2's and 3's lesson: QK-norm and
    z-loss are what kept their bf16 runs free of the loss spikes their predecessors had)."""
    cfg = recipe.model.config
    if recipe.precision.mixed not in ("bf16", "fp8") or prevention(cfg) or recipe.stability.z_loss > 0:
        return []
    n = approx_params(cfg)
    if n < 1e9:
        return []
    return [
        Finding(
            "PT019",
            "stability.z_loss",
            f"a {recipe.precision.mixed} run of ~{n / 1e9:.1f}B parameters with neither QK-norm (model type "
            f"{cfg.get('model_type', 'llama')!r}) nor a z-loss: nothing holds back the attention and output logits "
            "from growing into loss spikes.",
            "set stability.z_loss: 1.0e-5 (OLMo 3), or use a model type with QK-norm (recipes/1b_wsd_stable.yaml: "
            "qwen3).",
        )
    ]


def lint(recipe: Recipe, available: dict[str, int] | None = None, fp8_capable: bool | None = None) -> list[Finding]:
    """All findings for a recipe; an empty list is a clean bill.

    Args:
        available: training tokens per prepared source (the manifests'); sources not in it are not judged for
            repetition (their size is unknown until they are prepared).
        fp8_capable: whether the machine that runs it has fp8 tensor cores (None: unknown, not judged).
    """
    rules = (_schedule_rules, _context_rules, _decay_rules, _operations_rules, _batch_rules, _optimizer_rules)
    return [
        *(f for rule in (*rules, _stability_rules) for f in rule(recipe)),
        *_repetition_rules(recipe, available or {}),
        *_hardware_rules(recipe, fp8_capable),
    ]
