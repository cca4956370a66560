"""Preparation at three data sizes: wall time, tokens/s per worker and peak memory (all processes) per size.

python scripts/bench_prepare.py --sizes-mb 25,50,200 --workers 2 --out /tmp/bench_prepare

Synthetic jsonl (Zipf-distributed words, ~2 KB documents, 12.5 MB per file) is tokenized by `prepare_source` on
datatrove's local executor, one task per file, in a fresh subprocess per size. Peak memory is the largest sum of
RSS over the preparing process and all its children, sampled every 50 ms: it must stay flat as the data grows.

    python scripts/bench_prepare.py --huge-mb 1,8,64 --out /tmp/bench_prepare

One document of each size (words and line breaks, one jsonl line), prepared in-process as the trainer does; peak
memory with the pieces (`PIECE_CHARS`) and, with `--whole`, as it was before them (the whole text in one encode).

    python scripts/bench_prepare.py --keys-mb 64,256,1024 --out /tmp/bench_prepare

A source's content key at each size of raw files (8 MB each, written more than `RACY_S` before): without the digest
cache (every file read, as every start on every rank did), with a cold cache (read once and recorded), and warm
(a restart: one stat per file).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

FILE_MB = 12.5


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-mb", default="25,50,200", help="comma-separated sizes of text, in MB")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--out", default="/tmp/bench_prepare", help="work folder (data, tokenizer, token files)")
    p.add_argument("--huge-mb", help="comma-separated sizes of ONE document, in MB (instead of --sizes-mb)")
    p.add_argument("--whole", action="store_true", help="with --huge-mb: also tokenize each document whole")
    p.add_argument("--keys-mb", help="comma-separated sizes of raw files, in MB: the content key's cost")
    p.add_argument("--child", nargs=2, metavar=("DATA_DIR", "OUT_DIR"), help=argparse.SUPPRESS)
    p.add_argument("--child-huge", nargs=3, metavar=("DATA_DIR", "OUT_DIR", "MODE"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def make_huge(folder: Path, mb: float, seed: int = 0) -> None:
    """One jsonl line: a document of `mb` MB of Zipf words, a line break every ~12 words; plus a small first one
    (which trains the tokenizer)."""
    import numpy as np

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    words = np.array([f"w{i:x}" for i in range(20_000)])
    p = 1.0 / np.arange(1, len(words) + 1)
    p /= p.sum()
    drawn = rng.choice(words, size=int(mb * 2**20 / 5.5), p=p)
    lines = [" ".join(drawn[i : i + 12]) for i in range(0, len(drawn), 12)]
    with open(folder / "0000.jsonl", "w") as out:
        out.write(json.dumps({"id": "small", "text": " ".join(drawn[:20_000])}) + "\n")
        out.write(json.dumps({"id": "huge", "text": "\n".join(lines)}) + "\n")


def child_huge(data_dir: str, out_dir: str, mode: str) -> None:
    from pretrainer.data import prepare
    from pretrainer.recipe.sections import SourceSection

    if mode == "whole":
        prepare.PIECE_CHARS = 1 << 40  # the path before pieces: every document in one encode call
    src = SourceSection(type="files", include=[f"{data_dir}/*.jsonl"], text_field="text")
    t0 = time.perf_counter()
    m = prepare.prepare_source("bench", src, tokenizer(Path(data_dir), lines=1), Path(out_dir), 0.0)
    print(json.dumps({"tokens": m["tokens"], "seconds": time.perf_counter() - t0}))


def huge(args) -> int:
    rows = []
    for mb in [float(s) for s in args.huge_mb.split(",")]:
        data = Path(args.out) / f"huge-{mb:g}"
        if not data.exists():
            make_huge(data, mb)
        for mode in ("pieces", "whole") if args.whole else ("pieces",):
            out = Path(args.out) / f"huge-tokens-{mb:g}-{mode}"
            subprocess.run(["rm", "-rf", str(out)], check=True)
            cmd = [sys.executable, __file__, "--child-huge", str(data), str(out), mode]
            r, peak = measured(cmd, f"one {mb:g} MB document ({mode})")
            doc_mb = (data / "0000.jsonl").stat().st_size / 2**20
            rows.append(
                {
                    "doc_mb": round(doc_mb, 1),
                    "mode": mode,
                    "tokens": r["tokens"],
                    "seconds": round(r["seconds"], 2),
                    "peak_rss_mb": round(peak[0] / 2**20),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    return 0


def make_data(folder: Path, mb: float, seed: int = 0) -> None:
    """`mb` megabytes of jsonl documents, in files of FILE_MB."""
    import numpy as np

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    words = np.array([f"w{i:x}" for i in range(20_000)])
    p = 1.0 / np.arange(1, len(words) + 1)
    p /= p.sum()
    n_files = max(1, round(mb / FILE_MB))
    for f in range(n_files):
        path, size = folder / f"{f:04d}.jsonl", 0
        with open(path, "w") as out:
            while size < FILE_MB * 2**20:
                doc = " ".join(rng.choice(words, size=int(rng.integers(200, 600)), p=p))
                size += out.write(json.dumps({"id": f"{f}-{size}", "text": doc}) + "\n")


def tokenizer(out: Path, lines: int | None = None):
    """A small BPE learnt from the first data file, or its first `lines` (the benchmark measures preparation, not
    tokenizer training)."""
    import itertools

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(
        (json.loads(line)["text"] for line in itertools.islice(open(sorted(out.glob("*.jsonl"))[0]), lines)),
        trainers.BpeTrainer(vocab_size=8192, special_tokens=["<eos>"]),
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def child(data_dir: str, out_dir: str, workers: int) -> None:
    from pretrainer.data.prepare import prepare_source
    from pretrainer.recipe.sections import SourceSection

    src = SourceSection(type="files", include=[f"{data_dir}/*.jsonl"], text_field="text")
    t0 = time.perf_counter()
    m = prepare_source(
        "bench", src, tokenizer(Path(data_dir)), Path(out_dir), 0.001, executor="local", workers=workers
    )
    print(
        json.dumps(
            {"tokens": m["tokens"], "docs": m["docs"], "files": m["files"], "seconds": time.perf_counter() - t0}
        )
    )


def peak_rss(proc: subprocess.Popen) -> list[int]:
    """Sample the RSS of `proc` and its descendants until it exits; returns [peak bytes]."""
    import psutil

    peak = [0]

    def watch():
        root = psutil.Process(proc.pid)
        while proc.poll() is None:
            try:
                total = sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
                peak[0] = max(peak[0], total)
            except psutil.Error:
                pass
            time.sleep(0.05)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return peak


def measured(cmd: list[str], what: str) -> tuple[dict, list[int]]:
    """Run a child preparation: its last JSON line and [peak RSS bytes of it and its descendants]."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    peak = peak_rss(proc)
    stdout, _ = proc.communicate()
    if proc.returncode:
        raise SystemExit(f"preparation of {what} failed (exit {proc.returncode})")
    return json.loads(stdout.strip().splitlines()[-1]), peak


def keys(args) -> int:
    import os

    from pretrainer.data import sources
    from pretrainer.recipe.sections import SourceSection

    print("| raw files | files | no cache | cold cache | warm cache (a restart) |")
    print("|---|---|---|---|---|")
    for mb in [int(x) for x in args.keys_mb.split(",")]:
        data = Path(args.out) / f"raw-{mb}"
        subprocess.run(["rm", "-rf", str(data)], check=True)
        data.mkdir(parents=True)
        for i in range(max(1, mb // 8)):
            (data / f"f{i:05d}.txt").write_bytes(os.urandom(8 << 20))
        time.sleep(sources.RACY_S + 0.5)  # older than the racy window, as a source is at a restart
        src, cache = SourceSection(type="files", include=[str(data / "*.txt")]), data / "cache"
        times = {}
        for label, cache_dir in (("none", None), ("cold", cache), ("warm", cache)):
            t0 = time.perf_counter()
            sources.source_key("raw", src, cache_dir=cache_dir, validation_fraction=0.02)
            times[label] = time.perf_counter() - t0
        n = len(list(data.glob("*.txt")))
        print(f"| {mb} MB | {n} | {times['none']:.3f} s | {times['cold']:.3f} s | {times['warm']:.4f} s |", flush=True)
        subprocess.run(["rm", "-rf", str(data)], check=True)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        child(*args.child, args.workers)
        return 0
    if args.child_huge:
        child_huge(*args.child_huge)
        return 0
    if args.huge_mb:
        return huge(args)
    if args.keys_mb:
        return keys(args)
    rows = []
    for mb in [float(s) for s in args.sizes_mb.split(",")]:
        data, out = Path(args.out) / f"data-{mb:g}", Path(args.out) / f"tokens-{mb:g}"
        if not data.exists():
            make_data(data, mb)
        subprocess.run(["rm", "-rf", str(out)], check=True)
        cmd = [sys.executable, __file__, "--workers", str(args.workers), "--child", str(data), str(out)]
        r, peak = measured(cmd, f"{mb:g} MB")
        text_mb = sum(p.stat().st_size for p in data.glob("*.jsonl")) / 2**20
        rows.append(
            {
                "text_mb": round(text_mb, 1),
                "files": r["files"],
                "docs": r["docs"],
                "tokens": r["tokens"],
                "seconds": round(r["seconds"], 2),
                "tokens_per_s": round(r["tokens"] / r["seconds"]),
                "tokens_per_s_per_worker": round(r["tokens"] / r["seconds"] / args.workers),
                "peak_rss_mb": round(peak[0] / 2**20),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    growth = rows[-1]["peak_rss_mb"] / rows[0]["peak_rss_mb"] - 1
    print(
        json.dumps(
            {
                "workers": args.workers,
                "size_ratio": round(rows[-1]["text_mb"] / rows[0]["text_mb"], 1),
                "peak_rss_growth": round(growth, 3),
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
