"""Per-GPU memory and communication of each way to shard a recipe's model, from its shape alone.

The five launches in `accelerate_configs/`: DDP (Accelerate's autocast keeps fp32 weights and gradients, one
all-reduce per optimizer step), DeepSpeed ZeRO-1/2/3 (bf16 weights, an fp32 master copy and the moments sharded;
ZeRO-2 also the gradients, ZeRO-3 also the weights) and FSDP2 (fp32 shards, bf16 gathers). Communication is counted
as the bytes of the buffers handed to collectives per GPU per optimizer step (an all-reduce twice: a reduce-scatter
and an all-gather; an all-gather its output; a reduce-scatter its input); on the wire, ring algorithms move
(W-1)/W of that. Each term is what `tests/fixtures/probe_step.py` measured under these launches on CPU processes
(`scripts/bench_sharding.py`, docs/BENCHMARKS.md):

- DDP all-reduces the gradients once per step (Accelerate's `accumulate` skips the sync on the other micro batches);
  its gradient buckets are a second copy of the gradients (`gradient_as_bucket_view` is off).
- ZeRO-1 reduces each gradient bucket to the rank that owns it, once per step, and all-gathers the updated weights;
  ZeRO-2 reduces at every micro batch (the price of sharding the gradients). Gradients are freed after the step.
  DeepSpeed's default all-reduces the buckets instead (`use_multi_rank_bucket_allreduce`), twice the bytes for the
  same result on the owner: the trainer turns it off (`zero_reduction`; measured, docs/BENCHMARKS.md).
- ZeRO-3 gathers the weights at every micro batch's forward and reduce-scatters the gradients at every backward; a
  layer's weights are gathered again in backward only when more than `stage3_max_reuse_distance` (DeepSpeed's 1e9
  elements) were fetched since its forward. Up to `stage3_max_live_parameters` (1e9) stay gathered, and its reduce
  bucket is allocated whole: hidden x hidden elements, as the trainer sizes it (`zero_buffer_sizes`; DeepSpeed's
  own default, 5e8 elements, was a 2 GB buffer on the CPU probe whatever the model).
- FSDP2 (reshard after forward) gathers each layer in forward and again in backward at every micro batch; with
  accumulation the gradients are reduced at the last micro batch, the others accumulate unsharded bf16 gradients.

Activations (the same for every option) per token and decoder layer: 32·h + 8·i bytes in bf16 with SDPA (measured
on Llama layers of three widths, tests/test_sharding.py), the layer input alone when it is recomputed, and 6 bytes
per vocabulary entry for the logits (bf16, and their fp32 upcast in the loss; none with Liger's fused loss).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..model.shape import Shape
from .lint import Finding
from .schema import Recipe

OPTIONS = ("ddp", "zero1", "zero2", "zero3", "fsdp2")
LAUNCH = {
    "ddp": "accelerate_configs/ddp.yaml",
    "zero1": "accelerate_configs/zero1.yaml",
    "zero2": "accelerate_configs/zero2.yaml",
    "zero3": "accelerate_configs/zero3.yaml",
    "fsdp2": "accelerate_configs/fsdp.yaml",
}
DS_MAX_LIVE = DS_MAX_REUSE = 10**9


def zero_buffer_sizes(hidden: int, stage: int) -> dict[str, int]:
    """ZeRO's bucket and prefetch sizes from the model's hidden size, as the Hugging Face Trainer's "auto" values:
    the reduce bucket one hidden x hidden matrix (DeepSpeed's default, 5e8 elements, is a ~1-2 GB buffer whatever
    the model); under ZeRO-3 the prefetch 0.9 of that, and parameters under 10 x hidden elements (norms, biases)
    kept whole on every rank instead of gathered at each use."""
    sizes = {"reduce_bucket_size": hidden * hidden}
    if stage == 3:
        sizes["stage3_prefetch_bucket_size"] = int(0.9 * hidden * hidden)
        sizes["stage3_param_persistence_threshold"] = 10 * hidden
    return sizes


def zero_reduction(stage: int) -> dict[str, bool]:
    """How ZeRO-1/2 reduce the gradients: each bucket to its owner (`reduce`, the gradient's bytes once) rather than
    to every rank (DeepSpeed's default `use_multi_rank_bucket_allreduce`, an all-reduce: twice the bytes, and every
    rank but the owner drops what it received). Measured on two CPU processes (`tests/fixtures/probe_step.py`, width
    512, fp32): ZeRO-1 26.8 -> 17.8 MB per step, ZeRO-2 44.6 -> 26.8 MB. A matrix that Muon needs whole on two
    ranks is still all-reduced (DeepSpeed decides that per parameter). Nothing for ZeRO-3 (its own reduce-scatter)."""
    return {"reduce_scatter": True, "use_multi_rank_bucket_allreduce": False} if stage in (1, 2) else {}


HEADROOM = 0.9
"""The share of a GPU's memory a plan may fill (the allocator's fragmentation, NCCL's buffers, the CUDA context)."""


@dataclass(frozen=True)
class Footprint:
    """Bytes per GPU at the step's peak (`total`), and the collectives' bytes per GPU per optimizer step."""

    option: str
    weights: int
    """The weights a GPU holds between steps (its shard, or all of them)."""
    gathered: int
    """Weights gathered for compute at the peak (ZeRO-3, FSDP2)."""
    grads: int
    """Gradients at the peak (freed after the step)."""
    optimizer: int
    """What the optimizer holds between steps: moments, DeepSpeed's fp32 master copy (and ZeRO-3's fp32 gradient
    partition, which it keeps)."""
    averaging: int
    buffers: int
    """Communication buffers that stay allocated (DDP's buckets, ZeRO-3's reduce bucket)."""
    activations: int
    comm: int

    @property
    def total(self) -> int:
        return self.resident + self.gathered + self.grads + self.activations

    @property
    def resident(self) -> int:
        """What stays between steps (what the probe measures after a step)."""
        return self.weights + self.optimizer + self.averaging + self.buffers

    def to_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


def activation_bytes(shape: Shape, tokens: int, checkpointing: bool | int, fused_loss: bool) -> int:
    """Saved activations of one micro batch of `tokens` tokens (bf16, SDPA)."""
    per_layer = 32 * shape.hidden + 8 * shape.intermediate
    if checkpointing is False or checkpointing == 0:
        recomputed = 0
    else:
        every = 1 if checkpointing is True else int(checkpointing)
        recomputed = len(range(0, shape.layers, every))
    kept = (shape.layers - recomputed) * per_layer + recomputed * 2 * shape.hidden
    # one recomputed layer's activations are live at a time in backward
    live = per_layer if recomputed else 0
    logits = 0 if fused_loss else 6 * shape.vocab
    return tokens * (kept + live + logits)


def _regathered(shape: Shape) -> int:
    """Elements ZeRO-3 gathers again in backward: the layers whose forward lies more than DeepSpeed's reuse
    distance before their backward (the layers after them twice, and the LM head, are fetched in between)."""
    head = shape.vocab * shape.hidden
    far = [i for i in range(shape.layers) if 2 * (shape.layers - 1 - i) * shape.layer_params + head > DS_MAX_REUSE]
    return len(far) * shape.layer_params


def footprint(
    option: str,
    shape: Shape,
    gpus: int,
    grad_accum: int,
    micro_tokens: int,
    *,
    bf16: bool = True,
    moments: float = 8.0,
    averaging_copies: int = 0,
    checkpointing: bool | int = False,
    fused_loss: bool = False,
) -> Footprint:
    """Args:
    moments: optimizer state bytes per parameter (AdamW 8; Muon 4 on the matrices it takes).
    averaging_copies: fp32 copies `averaging` keeps (ema 1, window 2).
    """
    p, w, g = shape.params, gpus, grad_accum
    lp = 2 if bf16 else 4  # DeepSpeed's and FSDP2's compute copy
    act = activation_bytes(shape, micro_tokens, checkpointing, fused_loss)
    avg = 4 * averaging_copies * p
    if option == "ddp":
        autocast = 2 * p if bf16 else 0  # autocast's bf16 copies of the weights, saved for backward
        return Footprint(option, 4 * p, 0, 4 * p, int(moments * p), avg, 4 * p, act + autocast, 2 * 4 * p)
    if option in ("zero1", "zero2"):
        state = int((4 + moments) * p / w)  # fp32 master + moments
        grads = (lp * p if option == "zero1" else lp * p // w) + 4 * p // w  # + the fp32 partition in the step
        reductions = 1 if option == "zero1" else g  # each a reduce to the owners (zero_reduction): the bytes once
        return Footprint(option, lp * p, 0, grads, state, avg, 0, act, reductions * lp * p + lp * p)
    if option == "zero3":
        state = int((4 + 4 + moments) * p / w)
        live = lp * min(p, DS_MAX_LIVE)
        comm = g * (lp * p + lp * _regathered(shape) + lp * p)
        bucket = lp * zero_buffer_sizes(shape.hidden, 3)["reduce_bucket_size"]
        return Footprint(option, lp * p // w, live, lp * p // w, state, avg // w, bucket, act, comm)
    if option == "fsdp2":
        gathered = 2 * lp * shape.layer_params  # the layer running and the one prefetched
        unsharded = lp * p if g > 1 else 0  # accumulated without reduction until the last micro batch
        grads = 4 * p // w + unsharded
        comm = g * 2 * lp * p + lp * p
        return Footprint(option, 4 * p // w, gathered, grads, int(moments * p / w), avg // w, 0, act, comm)
    raise ValueError(f"unknown sharding {option!r}; one of {', '.join(OPTIONS)}")


def footprints(recipe: Recipe, shape: Shape, gpus: int) -> list[Footprint]:
    """Every option for `recipe` on `gpus` GPUs (the plan's micro batch and accumulation at that count).

    Raises:
        RecipeError: the global batch does not divide over `gpus`.
    """
    opt = recipe.optimizer
    moments = 8.0
    if opt.type == "muon":  # one momentum buffer for the hidden matrices, AdamW's two moments for the rest
        matrices = (
            shape.params
            - shape.vocab * shape.hidden * (1 if shape.tied else 2)
            - shape.hidden * (2 * shape.layers + 1)
        )
        moments = (4 * matrices + 8 * (shape.params - matrices)) / shape.params
    copies = {"none": 0, "ema": 1, "window": 2}[recipe.averaging.method]
    kw = dict(
        bf16=recipe.precision.mixed != "no",
        moments=moments,
        averaging_copies=copies,
        checkpointing=recipe.model.gradient_checkpointing,
        fused_loss=recipe.model.kernels == "liger",
    )
    accum = recipe.plan.grad_accum(gpus)
    return [footprint(o, shape, gpus, accum, recipe.plan.micro_tokens, **kw) for o in OPTIONS]


def best(options: list[Footprint], capacity: int) -> Footprint | None:
    """The option that moves the fewest bytes among those that fit `capacity` with headroom (the one that shards
    least on a tie); None when none fits."""
    fits = [f for f in options if f.total <= HEADROOM * capacity]
    return min(fits, key=lambda f: (f.comm, OPTIONS.index(f.option))) if fits else None


def sharding_findings(options: list[Footprint], option: str, gpus: int, capacity: int) -> list[Finding]:
    """The launch's sharding judged against the others: it does not fit, or another fits and moves less."""
    gib = 2**30
    mine = next(f for f in options if f.option == option)
    top = best(options, capacity)
    where = f"{gpus} GPUs of {capacity / gib:.0f} GiB"
    if mine.total > HEADROOM * capacity:
        fix = (
            f"launch with {LAUNCH[top.option]} ({top.total / gib:.1f} GiB per GPU)"
            if top
            else "add GPUs, recompute activations (model.gradient_checkpointing) or lower batch.micro_batch_size"
        )
        return [
            Finding(
                "PT020",
                "launch",
                f"{option} on {where} needs ~{mine.total / gib:.1f} GiB per GPU (weights {mine.weights / gib:.1f}, "
                f"optimizer {mine.optimizer / gib:.1f}, activations {mine.activations / gib:.1f}): it will not fit.",
                fix + ".",
            )
        ]
    if top is not None and top.option != option and mine.comm > 1.5 * top.comm:
        return [
            Finding(
                "PT021",
                "launch",
                f"{option} on {where} shards more than the model needs: it moves {mine.comm / gib:.1f} GiB per GPU per "
                f"step through collectives, {top.option} fits ({top.total / gib:.1f} GiB per GPU) and moves "
                f"{top.comm / gib:.1f} GiB.",
                f"launch with {LAUNCH[top.option]}.",
            )
        ]
    return []
