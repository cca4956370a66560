"""Checkpoint cost at three model sizes, 2 processes (FSDP2 `fully_shard` on gloo, saved through pretrainer's DCP
path): how long a save blocks the loop (sync vs async), how long the per-rank hashing and verification take, and what
the old single-process sha256 pass over the whole checkpoint cost.

    python scripts/bench_checkpoint.py --sizes 192x2,512x6,1024x8 --out /tmp/bench_ckpt
    python scripts/bench_checkpoint.py --single --sizes 192x2,512x6,1024x8     # one process, the trainer's manager
    DS_ACCELERATOR=cpu python scripts/bench_checkpoint.py --deepspeed zero1.yaml --sizes 256x4,512x8,1024x8

Each size runs in its own `torchrun --nproc_per_node 2`; one optimizer step first, so the Adam moments exist.
`--single`: one process per size through `CheckpointManager` itself (what `run_recipe.py` does with
`checkpoint.async: true` or false): how long `save()` blocks the loop, synchronous and in the background (median of
3 saves after a first that allocates the snapshot buffers), and the live NaN/Inf check alone, which the background
save used to run on the loop before its snapshot.
`--deepspeed CONFIG`: the trainer itself under `accelerate launch --config_file accelerate_configs/CONFIG` on 2
processes (the micro recipe at each width x depth, fp32, 4 steps, a checkpoint every 2): DeepSpeed saves are
synchronous, so the loop waits for the whole save; the checkpoint events' `blocked_s` and bytes, against a step.
`--ddp`: the same under DDP (`torchrun`, 2 processes), with `checkpoint.async` false and then true: the main process
snapshots and writes, the NaN/Inf check runs in its writer thread and on the other rank's device, read off the loop.

    python scripts/bench_checkpoint.py --ddp --sizes 256x4,512x8,1024x8
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="192x2,512x6,1024x8", help="HIDDENxLAYERS,... (Llama, vocab 32000)")
    p.add_argument("--out", type=Path, default=Path("/tmp/bench_ckpt"))
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--single", action="store_true", help="one process, the trainer's CheckpointManager")
    p.add_argument("--deepspeed", metavar="CONFIG", help="the trainer under accelerate_configs/CONFIG, 2 processes")
    p.add_argument("--ddp", action="store_true", help="the trainer under DDP (torchrun), 2 processes, sync and async")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--hidden", type=int, help=argparse.SUPPRESS)
    p.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def llama(args):
    """The benchmark's model: a Llama of `--hidden` x `--layers` with a 32,000 vocabulary, seeded."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    h = args.hidden
    cfg = LlamaConfig(
        vocab_size=32000,
        hidden_size=h,
        intermediate_size=h * 2,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, h // 64),
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(cfg)


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from pretrainer.checkpoint import commit, integrity
    from pretrainer.checkpoint import format as ck
    from pretrainer.checkpoint.dcp import DcpCheckpointer

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = llama(args)
    n_params = sum(p.numel() for p in model.parameters())
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, 32000, (2, 64))
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    saver, root, out = DcpCheckpointer(), args.out / "checkpoints", {}
    t0 = time.perf_counter()
    finite = integrity.state_finite(model, opt)  # the live NaN/Inf check every save runs first
    dist.all_reduce(finite)
    out["finite_s"] = time.perf_counter() - t0
    for mode in ("sync", "async_first", "async"):  # the first async save allocates the staging buffers
        name = f"step_{mode}"
        tmp, final = root / f"{ck.TMP_PREFIX}{name}", root / name
        meta = {"step": 1, "tokens": 0, "stage_index": 0, "cursor": 0, "skips": [], "recipe": {}, "world_size": world}
        dist.barrier()
        t0 = time.perf_counter()
        saver.save(
            model, opt, tmp, lambda g, t=tmp, f=final, m=meta: commit.commit(g, t, f, m, {}), async_=mode != "sync"
        )
        out[f"{mode}_blocked_s"] = time.perf_counter() - t0
        saver.wait()
        out[f"{mode}_total_s"] = time.perf_counter() - t0
        dist.barrier()
    path = root / "step_async"
    t0 = time.perf_counter()
    assert commit.verify_shares(saver.group, path) == []
    out["verify_world_s"] = time.perf_counter() - t0
    dist.barrier()
    if rank == 0:
        t0 = time.perf_counter()
        assert ck.verify(path) == []  # one process hashing everything (xxh3)
        out["verify_one_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        for f in sorted(ck.list_files(path)):
            integrity.file_hash(path / f, "sha256")  # what every save used to cost on the main process alone
        out["sha256_one_s"] = time.perf_counter() - t0
        out["bytes"] = sum(ck.list_files(path).values())
        out["params"] = n_params
        (args.out / "result.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def single_worker(args) -> None:
    import statistics
    from types import SimpleNamespace

    import torch
    from accelerate import Accelerator

    from pretrainer.checkpoint import CheckpointManager, integrity
    from pretrainer.recipe.sections import CheckpointSection

    acc = Accelerator(cpu=True)
    model = llama(args)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = acc.prepare(model, opt)
    x = torch.randint(0, 32000, (2, 64))
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    log = SimpleNamespace(event=lambda *a, **k: None)
    out = {"params": sum(p.numel() for p in model.parameters())}
    t0 = time.perf_counter()
    integrity.state_finite(model, opt).item()
    out["live_check_s"] = time.perf_counter() - t0
    for mode in ("sync", "async"):
        section = CheckpointSection(keep_last=2, every_minutes=None, **{"async": mode == "async"})
        mgr = CheckpointManager(acc, section, args.out / mode, model=model, optimizer=opt, log=log)
        blocked = []
        for step in range(1, 5):
            mgr.save({"step": step, "tokens": step, "reason": "bench", "recipe": {}})
            blocked.append(mgr.last_blocked)
            mgr.finish()  # the write done before the next save, as minutes of training between saves would
        out[f"{mode}_blocked_s"] = statistics.median(blocked[1:])  # the first allocates the snapshot buffers
        out[f"{mode}_first_s"] = blocked[0]
    last = sorted((args.out / "sync").glob("step_*"))[-1]
    out["bytes"] = sum(f.stat().st_size for f in last.rglob("*") if f.is_file())
    (args.out / "result.json").write_text(json.dumps(out))


def single(args) -> int:
    rows = []
    for spec in args.sizes.split(","):
        hidden, layers = (int(v) for v in spec.split("x"))
        d = args.out / f"single_{spec}"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        cmd = [sys.executable, __file__, "--worker", "--single", "--hidden", str(hidden), "--layers", str(layers)]
        subprocess.run([*cmd, "--out", str(d)], check=True)
        r = json.loads((d / "result.json").read_text())
        rows.append((spec, r))
        print(json.dumps({"size": spec, **r}), flush=True)
        shutil.rmtree(d, ignore_errors=True)
    print("\n| model | params | checkpoint | sync save blocks | background save blocks | ratio | live check (moved) |")
    print("|---|---|---|---|---|---|---|")
    for spec, r in rows:
        ratio = r["async_blocked_s"] / r["sync_blocked_s"]
        print(
            f"| {spec} | {r['params'] / 1e6:.0f}M | {r['bytes'] / 1e9:.2f} GB | {r['sync_blocked_s']:.3f} s | "
            f"{r['async_blocked_s']:.3f} s | {ratio:.1%} | {r['live_check_s']:.3f} s |"
        )
    return 0


def trainer_saves(args, d: Path, head: list[str], hidden: int, layers: int, extra: dict) -> tuple[float, float, str]:
    """The trainer on 2 processes at one size: (median blocked seconds, checkpoint GB, median step time), and with
    `extra` naming `logging.every_steps: 1` also the median extra time of the step after a save (`trainer_saves.after`:
    what a rank that is still busy with the save costs the main process at the next step's all-reduce)."""
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    sets = {
        "data.cache_dir": args.out / "cache",
        "model.config.hidden_size": hidden,
        "model.config.intermediate_size": 4 * hidden,
        "model.config.num_hidden_layers": layers,
        "stages.0.steps": 6,
        "checkpoint.every_tokens": 2048,
        "checkpoint.every_minutes": "null",
        "eval.every_steps": 0,
        "precision.mixed": "no",
        **extra,
    }
    cmd = [sys.executable, *head, "scripts/run_recipe.py", "tests/fixtures/micro.yaml", "--output-dir", str(d)]
    cmd += ["--overwrite", *(x for k, v in sets.items() for x in ("--set", f"{k}={v}"))]
    subprocess.run(cmd, check=True, env=env, cwd=root, capture_output=True)
    events = [json.loads(x) for x in (d / "events.jsonl").read_text().splitlines()]
    saves = [e for e in events if e["event"] == "checkpoint"]
    metrics = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    step_s = sorted(m["step_time_s"] for m in metrics if "step_time_s" in m)
    blocked = sorted(e["blocked_s"] for e in saves)
    times = {m["step"]: m["step_time_s"] for m in metrics if "step_time_s" in m}
    after = {e["step"] + 1 for e in saves} & times.keys()
    base = sorted(t for k, t in times.items() if k > 1 and k not in after)
    extra_s = sorted(times[k] - base[len(base) // 2] for k in after) if after and base else [float("nan")]
    trainer_saves.after = extra_s[len(extra_s) // 2]
    shutil.rmtree(d, ignore_errors=True)
    step = f"{step_s[len(step_s) // 2]:.2f} s" if step_s else "n/a"
    return blocked[len(blocked) // 2], saves[-1]["bytes"] / 1e9, step


def deepspeed(args) -> int:
    head = ["-m", "accelerate.commands.launch", "--config_file", f"accelerate_configs/{args.deepspeed}"]
    head += ["--num_processes", "2", "--mixed_precision", "no"]
    print("| model | params | checkpoint | save blocks the loop (median) | per GB | one step |")
    print("|---|---|---|---|---|---|")
    for spec in args.sizes.split(","):
        hidden, layers = (int(v) for v in spec.split("x"))
        med, gb, step = trainer_saves(args, args.out / f"ds_{spec}", head, hidden, layers, {})
        params = hidden * hidden * 15 * layers
        print(f"| {spec} | ~{params / 1e6:.0f}M | {gb:.2f} GB | {med:.2f} s | {med / gb:.2f} s | {step} |")
    return 0


def ddp(args) -> int:
    """DDP on 2 processes through the trainer: the save's loop stall, synchronous and in the background. Rank 0's
    `blocked_s` is not the whole stall under DDP: the next step's all-reduce waits for every rank, so the extra time
    of the step after a save is added (12 steps, a save every 4, a metrics row every step)."""
    head = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    every = {"logging.every_steps": 1, "stages.0.steps": 12, "checkpoint.every_tokens": 4096}
    print("| model | params | checkpoint | sync save: blocks + next step | background: blocks + next step | ratio |")
    print("|---|---|---|---|---|---|")
    for spec in args.sizes.split(","):
        hidden, layers = (int(v) for v in spec.split("x"))
        d = args.out / f"ddp_{spec}"
        sync, gb, _ = trainer_saves(args, d, head, hidden, layers, {**every, "checkpoint.async": False})
        sync_after = trainer_saves.after
        bg, _, _ = trainer_saves(args, d, head, hidden, layers, {**every, "checkpoint.async": True})
        bg_after = trainer_saves.after
        params = hidden * hidden * 15 * layers
        total_sync, total_bg = sync + max(sync_after, 0.0), bg + max(bg_after, 0.0)
        print(
            f"| {spec} | ~{params / 1e6:.0f}M | {gb:.2f} GB | {sync:.3f} + {sync_after:.3f} s | {bg:.3f} + "
            f"{bg_after:.3f} s | {total_bg / total_sync:.1%} |",
            flush=True,
        )
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.deepspeed:
        return deepspeed(args)
    if args.ddp:
        return ddp(args)
    if args.worker:
        single_worker(args) if args.single else worker(args)
        return 0
    if args.single:
        return single(args)
    rows = []
    for spec in args.sizes.split(","):
        hidden, layers = (int(v) for v in spec.split("x"))
        d = args.out / spec
        shutil.rmtree(d, ignore_errors=True)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(args.procs),
            __file__,
            "--worker",
            "--hidden",
            str(hidden),
            "--layers",
            str(layers),
            "--out",
            str(d),
        ]
        subprocess.run(cmd, check=True, env=env)
        r = json.loads((d / "result.json").read_text())
        gb = r["bytes"] / 1e9
        rows.append((spec, r))
        print(json.dumps({"size": spec, **r}), flush=True)
        shutil.rmtree(d / "checkpoints", ignore_errors=True)
    print(
        f"\n| model | params | checkpoint | sync save | async blocks (first save) | async/sync | verify, {args.procs} ranks | "
        "verify, 1 process | sha256, 1 process (old) | live finite check |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for spec, r in rows:
        gb = r["bytes"] / 1e9
        print(
            f"| {spec} | {r['params'] / 1e6:.0f}M | {gb:.2f} GB | {r['sync_total_s']:.2f} s ({r['sync_total_s'] / gb:.2f} s/GB) "
            f"| {r['async_blocked_s']:.3f} s ({r['async_first_blocked_s']:.3f} s) "
            f"| {r['async_blocked_s'] / r['sync_total_s']:.1%} "
            f"| {r['verify_world_s']:.3f} s ({r['verify_world_s'] / gb:.3f} s/GB) "
            f"| {r['verify_one_s']:.3f} s | {r['sha256_one_s']:.2f} s | {r['finite_s'] * 1e3:.1f} ms |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
