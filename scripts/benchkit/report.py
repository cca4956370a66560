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
        f"Raw numbers: [benchmarks.json](benchmarks.json).",
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
    notes_file = Path(path).with_name("benchmark_notes.md")
    old = Path(path).read_text() if Path(path).exists() else ""
    if notes:
        lines += [notes, ""]
    elif "\n## " in old:  # the generated table is replaced; every section after it (written by hand) is kept
        lines += [old[old.index("\n## ") + 1 :]]
    elif notes_file.exists():  # the analysis of the last measured run, kept by hand
        lines += [notes_file.read_text()]
    Path(path).write_text("\n".join(lines))
