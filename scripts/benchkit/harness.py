"""Side-by-side benchmarks on one machine, in one process: the pretrainer Trainer, a plain PyTorch loop and the HF
Trainer on the same model, data, optimizer, precision and threads, interleaved (A B C A B C ...) after a warm-up round;
plus data headroom, checkpoint stall and resume cost."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from pretrainer import checkpoint as ck
from pretrainer.data.pipeline import StageBatches
from pretrainer.model.build import build_model
from pretrainer.recipe.loading import load_recipe
from pretrainer.train.accelerator import param_groups
from pretrainer.train.trainer import Trainer

# The recipe's first stage, made long enough never to end on its own (the benchmark stops it); no evals, no
# trackers, no checkpoints except those the benchmark asks for.
BENCH_OVERRIDES = [
    "schedule.decay_stage=null",
    "schedule.warmup_steps=100",
    "eval.every_steps=0",
    "logging.report_to=[]",
    "checkpoint.every_minutes=null",
    "checkpoint.at_stage_end=false",
]


def _spread(xs: list[float]) -> dict[str, float]:
    q = statistics.quantiles(xs, n=4) if len(xs) >= 2 else [xs[0]] * 3
    return {"median": statistics.median(xs), "q1": q[0], "q3": q[2], "min": min(xs), "max": max(xs), "n": len(xs)}


class _PlainLoop:
    """What a user would write by hand: forward, backward, clip, step, zero_grad."""

    def __init__(self, trainer, batches: list[list[torch.Tensor]]):
        torch.manual_seed(trainer.recipe.run.seed)
        self.model = build_model(trainer.recipe.model, trainer.config)
        o = trainer.recipe.optimizer
        self.opt = torch.optim.AdamW(
            param_groups(self.model, o.weight_decay),
            lr=o.lr,
            betas=o.betas,
            eps=o.eps,
            fused=trainer.built.fused or None,
        )
        self.batches, self.i = batches, 0
        self.max_norm = trainer.recipe.clipping.max_grad_norm

    def step(self) -> None:
        micro = self.batches[self.i % len(self.batches)]
        self.i += 1
        for mb in micro:
            loss = self.model(input_ids=mb, labels=mb).loss / len(micro)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


class _HFTrainer:
    """transformers.Trainer on the same model and data, run in a thread that pauses every `chunk` steps."""

    def __init__(self, trainer, batches: list[list[torch.Tensor]], chunk: int, workdir: str):
        from transformers import Trainer, TrainerCallback, TrainingArguments

        rows = [{"input_ids": r, "labels": r} for micro in batches for mb in micro for r in mb]
        torch.manual_seed(trainer.recipe.run.seed)
        model = build_model(trainer.recipe.model, trainer.config)
        o, span = trainer.recipe.optimizer, trainer.spans[0]
        args = TrainingArguments(
            output_dir=workdir,
            per_device_train_batch_size=span.micro_batch_size,
            gradient_accumulation_steps=trainer.grad_accum,
            learning_rate=o.lr,
            weight_decay=o.weight_decay,
            adam_beta1=o.betas[0],
            adam_beta2=o.betas[1],
            adam_epsilon=o.eps,
            max_grad_norm=trainer.recipe.clipping.max_grad_norm,
            lr_scheduler_type="constant",
            max_steps=10**7,
            logging_steps=trainer.recipe.logging.every_steps,
            save_strategy="no",
            eval_strategy="no",
            report_to=[],
            use_cpu=not torch.cuda.is_available(),
            dataloader_num_workers=0,
            disable_tqdm=True,
            seed=trainer.recipe.run.seed,
            dataloader_drop_last=True,
            optim="adamw_torch_fused" if trainer.built.fused else "adamw_torch",
        )
        self.go, self.done = threading.Semaphore(0), threading.Semaphore(0)
        outer = self

        class Pause(TrainerCallback):
            def __init__(self):
                self.n = 0

            def on_step_end(self, args, state, control, **kw):
                self.n += 1
                if self.n % chunk == 0:
                    outer.done.release()
                    outer.go.acquire()
                    if outer.stop:
                        control.should_training_stop = True

        self.stop = False
        self.hf = Trainer(model=model, args=args, train_dataset=rows, callbacks=[Pause()])
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        self.go.acquire()
        self.hf.train()
        self.done.release()

    def chunk(self) -> None:
        if not self.thread.is_alive():
            self.thread.start()
        self.go.release()
        self.done.acquire()

    def close(self) -> None:
        self.stop = True
        self.go.release()
        self.thread.join(timeout=60)


def step_overhead(trainer, rounds: int = 8, chunk: int = 5) -> dict:
    """Median seconds per optimizer step of each framework, interleaved; the first round is warm-up."""
    span = trainer.spans[0]
    sb = StageBatches(trainer.recipe.stages[span.index], span, trainer.sources, trainer.recipe.run.seed)
    batches, cursor = [], 0
    for _ in range(32):
        micro, cursor, _ = sb.step_batches(cursor, 0, 1)
        batches.append(micro)
    ours = trainer.steps()
    plain = _PlainLoop(trainer, batches)
    workdir = tempfile.mkdtemp(prefix="hf-bench-")
    hf = _HFTrainer(trainer, batches, chunk, workdir)
    times: dict[str, list[float]] = {"pretrainer": [], "plain": [], "hf_trainer": []}
    runners = {
        "pretrainer": lambda: [next(ours) for _ in range(chunk)],
        "plain": lambda: [plain.step() for _ in range(chunk)],
        "hf_trainer": hf.chunk,
    }
    try:
        for r in range(rounds + 1):
            for name, run in runners.items():
                t0 = time.perf_counter()
                run()
                if r > 0:  # round 0 warms up every framework
                    times[name].append((time.perf_counter() - t0) / chunk)
    finally:
        hf.close()
    out = {k: _spread(v) for k, v in times.items()}
    out["ratio_vs_plain"] = out["pretrainer"]["median"] / out["plain"]["median"]
    out["ratio_vs_hf_trainer"] = out["pretrainer"]["median"] / out["hf_trainer"]["median"]
    out["tokens_per_step"] = span.tokens_per_step
    out["rounds"], out["chunk"] = rounds, chunk
    return out


def data_headroom(trainer, train_step_s: float, steps: int = 200) -> dict:
    span = trainer.spans[0]
    sb = StageBatches(trainer.recipe.stages[span.index], span, trainer.sources, trainer.recipe.run.seed)
    cursor, t0 = 0, time.perf_counter()
    for _ in range(steps):
        _, cursor, _ = sb.step_batches(cursor, 0, 1)
    delivered = steps * span.tokens_per_step / (time.perf_counter() - t0)
    consumed = span.tokens_per_step / train_step_s
    return {"delivered_tokens_per_s": delivered, "consumed_tokens_per_s": consumed, "headroom": delivered / consumed}


def checkpoint_stall(trainer, repeats: int = 5) -> dict:
    """Seconds the loop blocks for a synchronous save and for a background save (interleaved)."""
    mgr = trainer.ckpt
    sync, background = [], []
    for _ in range(repeats):
        for mode, out in ((False, sync), (True, background)):
            mgr.async_ok = mode
            t0 = time.perf_counter()
            trainer.save_checkpoint("bench")
            out.append(time.perf_counter() - t0)
            mgr.writer.wait()  # the write itself finishes off the clock
    mgr.async_ok = False
    s, b = statistics.median(sync), statistics.median(background)
    return {"sync_s": _spread(sync), "background_s": _spread(background), "ratio": b / s}


def resume_cost(recipe_path: str, overrides: list[str], trainer, repeats: int = 3) -> dict:
    """Launch-to-first-resumed-step wall time with the data cursor at sample 100 versus 10^9."""
    base = ck.list_checkpoints(trainer.ckpt.root)[-1].path
    results: dict[str, list[float]] = {"100": [], "1000000000": []}
    root = Path(tempfile.mkdtemp(prefix="resume-bench-"))
    paths = {}
    for cursor in results:
        d = root / f"cursor_{cursor}"
        shutil.copytree(base, d)
        meta = json.loads((d / ck.META).read_text())
        meta["cursor"] = int(cursor)
        (d / ck.META).write_text(json.dumps(meta))
        (d / ck.MANIFEST).unlink()
        ck.write_manifest(d)
        paths[cursor] = (d, meta["step"])
    script = Path(__file__).resolve().parents[1] / "run_recipe.py"
    for _ in range(repeats):
        for cursor, (d, step) in paths.items():
            env = {**os.environ, "PRETRAINER_KILL_AT": f"step:{step + 1}"}
            cmd = [
                sys.executable,
                str(script),
                recipe_path,
                "--resume",
                str(d),
                "--output-dir",
                str(root / "out"),
                *[a for o in overrides for a in ("--set", o)],
            ]
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode != -9:
                raise RuntimeError(f"resume benchmark run failed: {proc.stderr[-2000:]}")
            results[cursor].append(time.perf_counter() - t0)
    out = {k: _spread(v) for k, v in results.items()}
    out["ratio"] = out["1000000000"]["median"] / out["100"]["median"]
    return out


def bench_overrides(recipe_path: str) -> list[str]:
    first = load_recipe(recipe_path).stages[0]
    stage = {"name": first.name, "steps": 100000, "seq_len": first.seq_len, "mixture": first.mixture}
    return [f"stages=[{json.dumps(stage)}]", *BENCH_OVERRIDES]


def run_all(recipe_path: str, rounds: int, chunk: int, threads: int, output_dir: str, extra: list[str] = ()) -> dict:
    """`extra`: the command line's `--set` overrides, applied after the benchmark's own."""
    torch.set_num_threads(threads)
    overrides = [*bench_overrides(recipe_path), *extra]
    recipe = load_recipe(recipe_path, overrides)
    trainer = Trainer(recipe, output_dir=output_dir, overwrite=True)
    overhead = step_overhead(trainer, rounds, chunk)
    result = {
        "recipe": recipe_path,
        "overrides": overrides,
        "micro_batch_size": trainer.spans[0].micro_batch_size,
        "seq_len": trainer.spans[0].seq_len,
        "grad_accum": trainer.grad_accum,
        "threads": threads,
        "params": trainer.n_params,
        "step_time": overhead,
        "data": data_headroom(trainer, overhead["pretrainer"]["median"]),
        "checkpoint_stall": checkpoint_stall(trainer),
    }
    result["resume"] = resume_cost(recipe_path, overrides, trainer)
    return result
