"""The benchmark's environment and its Markdown table (docs/BENCHMARKS.md)."""

from __future__ import annotations

import datetime
import os
import platform
from pathlib import Path


def environment() -> dict:
    import accelerate
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "date": datetime.date.today().isoformat(),
        "machine": f"{cpu}, {os.cpu_count()} cores",
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "accelerate": accelerate.__version__,
    }


def machine_speed(repeats: int = 7) -> dict:
    """A reference for reading tables across days: a fixed fp32 matmul (1024^3, GFLOP/s) and a fixed 64 MiB copy
    (GB/s, read + write), median of `repeats`, on the threads the benchmark uses. A table whose step times moved by
    as much as these did measured the machine, not the code."""
    import time

    import torch

    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    src, dst = torch.empty(16 * 2**20), torch.empty(16 * 2**20)
    src.fill_(1.0)
    dst.copy_(src)
    mm, cp = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        mm.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        dst.copy_(src)
        cp.append(time.perf_counter() - t0)
    mm.sort()
    cp.sort()
    return {
        "matmul_gflops": round(2 * 1024**3 / mm[len(mm) // 2] / 1e9, 2),
        "memcpy_gb_s": round(2 * src.numel() * 4 / cp[len(cp) // 2] / 1e9, 2),
    }


def speed_line(r: dict) -> str:
    """The machine-speed reference as one sentence (measured before and after the benchmark, in its process)."""
    ms = r.get("machine_speed")
    if not ms:
        return ""
    b, a = ms["before"], ms["after"]
    return (
        f"Machine speed (scripts/benchkit/report.py `machine_speed`): fp32 matmul {b['matmul_gflops']:.1f} / "
        f"{a['matmul_gflops']:.1f} GFLOP/s, memcpy {b['memcpy_gb_s']:.1f} / {a['memcpy_gb_s']:.1f} GB/s (before / "
        "after the rounds). Compare step times across days only in proportion to these."
    )


def write_markdown(r: dict, path: str | Path, notes: str = "") -> None:
    env, st, data, ck, rs = r["environment"], r["step_time"], r["data"], r["checkpoint_stall"], r["resume"]

    def ms(d):
        return f"{d['median'] * 1e3:.1f} ms (IQR {d['q1'] * 1e3:.1f}–{d['q3'] * 1e3:.1f})"

    goal = lambda ok: "met" if ok else "**missed**"  # noqa: E731
    lines = [
        "# Benchmarks",
        "",
        f"Command: `{r['command'].strip()}` (also `make bench`). Date: {env['date']}. Machine: {env['machine']}"
        f"{', GPU ' + env['gpu'] if env['gpu'] else ', no GPU'}. Python {env['python']}, torch {env['torch']}, "
        f"transformers {env['transformers']}, accelerate {env['accelerate']}. Threads: {r['threads']}. "
        f"Raw numbers: [benchmarks.json](benchmarks.json). {speed_line(r)}",
        "",
        f"Model: the recipe's Llama ({r['params']:,} parameters), fp32, AdamW, clipping at 1.0, "
        f"{st['tokens_per_step']:,} tokens per optimizer step ({r['grad_accum']} micro batches of "
        f"{r['micro_batch_size']} x {r['seq_len']}). "
        f"{st['rounds']} rounds of {st['chunk']} steps per framework, interleaved, after a warm-up round.",
        "",
        "| measurement | result | goal | |",
        "|---|---|---|---|",
        f"| step time, pretrainer Trainer | {ms(st['pretrainer'])} | | |",
        f"| step time, plain PyTorch loop | {ms(st['plain'])} | | |",
        f"| step time, HF Trainer | {ms(st['hf_trainer'])} | | |",
        f"| pretrainer / plain loop | {st['ratio_vs_plain']:.3f}x | <= 1.03x | {goal(st['ratio_vs_plain'] <= 1.03)} |",
        f"| pretrainer / HF Trainer | {st['ratio_vs_hf_trainer']:.3f}x | <= 1.00x | "
        f"{goal(st['ratio_vs_hf_trainer'] <= 1.0)} |",
        f"| data delivered / consumed | {data['delivered_tokens_per_s']:,.0f} / {data['consumed_tokens_per_s']:,.0f} "
        f"tokens/s = {data['headroom']:,.0f}x | >= 100x | {goal(data['headroom'] >= 100)} |",
        f"| checkpoint stall, sync / background | {ms(ck['sync_s'])} / {ms(ck['background_s'])} = "
        f"{ck['ratio']:.1%} | <= 10% | {goal(ck['ratio'] <= 0.10)} |",
        f"| launch to first resumed step, cursor 100 / 10^9 | {rs['100']['median']:.2f} s / "
        f"{rs['1000000000']['median']:.2f} s = {rs['ratio']:.3f}x | <= 1.1x | {goal(rs['ratio'] <= 1.1)} |",
        "",
    ]
    old = Path(path).read_text() if Path(path).exists() else ""
    if notes:
        lines += [notes, ""]
    elif "\n## " in old:  # the generated table is replaced; every section after it (written by hand) is kept
        lines += [old[old.index("\n## ") + 1 :]]
    Path(path).write_text("\n".join(lines))
