"""Freeze the held-out Python tasks' documents from this repository's own code, which no recipe trains on (the tiny
recipe reads the Python standard library). Run once; the jsonl files are committed, so scores stay comparable.

    python eval_tasks/heldout_python/build.py            # rewrites the committed files: scores change with them
    python eval_tasks/heldout_python/build.py --out /tmp/x
"""

import argparse
import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
DOC_CHARS = 1500
DOCS = 96
QUESTIONS = 96


def chunks(text: str) -> list[str]:
    """~DOC_CHARS-character pieces cut at line ends."""
    out, cur = [], []
    for line in text.splitlines(keepends=True):
        cur.append(line)
        if sum(map(len, cur)) >= DOC_CHARS:
            out.append("".join(cur))
            cur = []
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=HERE, help="where text.jsonl and next_line.jsonl go")
    out = p.parse_args(argv).out
    out.mkdir(parents=True, exist_ok=True)
    files = sorted(p for d in ("src/pretrainer", "scripts", "tests") for p in (ROOT / d).rglob("*.py"))
    pieces = [c for p in files for c in chunks(p.read_text())]
    rng = random.Random(0)
    rng.shuffle(pieces)
    with open(out / "text.jsonl", "w") as f:
        for c in pieces[:DOCS]:
            f.write(json.dumps({"text": c}) + "\n")
    # next line: 8 lines of context, the true next line among 4 (3 lines from other pieces of similar length)
    rest = pieces[DOCS:]
    pool = [ln for c in rest for ln in c.splitlines() if len(ln.strip()) >= 16]
    with open(out / "next_line.jsonl", "w") as f:
        n = 0
        for c in rest:
            lines = c.splitlines()
            cand = [i for i in range(8, len(lines)) if len(lines[i].strip()) >= 16]
            if not cand or n >= QUESTIONS:
                continue
            i = rng.choice(cand)
            gold = lines[i]
            near = (ln for ln in rng.sample(pool, 40) if ln != gold and abs(len(ln) - len(gold)) < 20)
            others = list(dict.fromkeys(near))[:3]  # distinct: the code repeats lines (`out = tmp_path / "run"`)
            if len(others) < 3:
                continue
            choices = others + [gold]
            rng.shuffle(choices)
            f.write(json.dumps({"context": "\n".join(lines[i - 8 : i]) + "\n", "choices": choices,
                                "gold": choices.index(gold)}) + "\n")  # fmt: skip
            n += 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
