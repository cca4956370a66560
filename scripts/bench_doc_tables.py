"""Memory of the long-document window table per rank, as a function of the documents in a source (numbers for
docs/BENCHMARKS.md, not a timed test): synthetic prepared sources of 1M, 4M and 16M documents (~100 tokens each, 1 in
200 of 4,096 or more; token files sparse, index files real), the stage's window table built in a fresh process: the
peak of the heap it allocates (tracemalloc, which sees numpy's arrays), against the table of every document's offset
the trainer used to build first.

    python scripts/bench_doc_tables.py --docs 1000000,4000000,16000000 --out /tmp/bench_doc_tables
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

PER_FILE = 1_000_000
SEQ_LEN, MIN_TOKENS, UPWEIGHT = 4096, 4096, 3


def make_source(out: Path, docs: int, seed: int = 0) -> dict:
    """files/NNNNN/train.ds (sparse) and its .index; the manifest SplitTokens reads."""
    rng = np.random.default_rng(seed)
    shutil.rmtree(out, ignore_errors=True)
    per_file, total_docs, total_tokens = [], 0, 0
    for i in range(-(-docs // PER_FILE)):
        n = min(PER_FILE, docs - total_docs)
        lengths = rng.geometric(1 / 100, n).astype(np.int64)
        long = rng.random(n) < 1 / 200
        lengths[long] += MIN_TOKENS
        d = out / "files" / f"{i:05d}"
        d.mkdir(parents=True)
        np.cumsum(lengths).astype("<u8").tofile(d / "train.ds.index")
        tokens = int(lengths.sum())
        with open(d / "train.ds", "wb") as f:
            f.truncate(2 * tokens)  # sparse: the table is built from the index and the sizes
        per_file.append({"train_tokens": tokens, "train_docs": n})
        total_docs, total_tokens = total_docs + n, total_tokens + tokens
    return {
        "files": len(per_file),
        "dtype": "uint16",
        "train_docs": total_docs,
        "train_tokens": total_tokens,
        "per_file": per_file,
    }


def child(source: Path, mode: str) -> None:
    from pretrainer.data.packing import long_doc_windows
    from pretrainer.data.tokenfiles import SplitTokens
    from pretrainer.data.tokens import TokenArrays

    manifest = json.loads((source / "manifest.json").read_text())
    split = SplitTokens(source, "train", manifest)
    tracemalloc.start()  # numpy's allocations are traced: the heap the table costs, not the mapped files
    t0 = time.perf_counter()
    if mode == "all_offsets":  # what the trainer did before: every document's offset, then the table
        arr = TokenArrays(split.tokens, split.doc_offsets)  # (tokens stay memory-mapped)
        table = long_doc_windows(arr, SEQ_LEN, MIN_TOKENS, UPWEIGHT)
    else:
        table = long_doc_windows(split, SEQ_LEN, MIN_TOKENS, UPWEIGHT)
    seconds = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    out = {"windows": table.size, "long": table.n_long, "seconds": round(seconds, 2), "mb": peak / 2**20}
    print(json.dumps(out))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--docs", default="1000000,4000000,16000000")
    p.add_argument("--out", type=Path, default=Path("/tmp/bench_doc_tables"))
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        child(Path(a.child[0]), a.child[1])
        return 0
    print(
        "| documents | index files | windows | table of every offset: peak MB, s | long documents only: peak MB, s |"
    )
    print("|---|---|---|---|---|")
    for docs in (int(x) for x in a.docs.split(",")):
        src = a.out / f"docs_{docs}"
        manifest = make_source(src, docs)
        (src / "manifest.json").write_text(json.dumps(manifest))
        res = {}
        for mode in ("all_offsets", "long_docs"):
            cp = subprocess.run([sys.executable, __file__, "--child", str(src), mode], capture_output=True, text=True)
            if cp.returncode:
                print(cp.stderr, file=sys.stderr)
                return 1
            res[mode] = json.loads(cp.stdout)
        if res["all_offsets"]["windows"] != res["long_docs"]["windows"]:
            print("the two tables differ", file=sys.stderr)
            return 1
        o, n = res["all_offsets"], res["long_docs"]
        idx_mb = sum(f.stat().st_size for f in src.rglob("*.index")) / 2**20
        print(
            f"| {docs:,} | {idx_mb:.0f} MB | {n['windows']:,} | {o['mb']:.0f} MB, {o['seconds']} s | "
            f"{n['mb']:.0f} MB, {n['seconds']} s |",
            flush=True,
        )
        shutil.rmtree(src)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
