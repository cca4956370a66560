import json
import os

import numpy as np
import pytest
from conftest import FIXTURES

from pretrainer.data.packing import long_doc_windows, plain_windows
from pretrainer.data.pipeline import SourceData, StageBatches, get_tokenizer, source_dir
from pretrainer.data.shards import prepare_source
from pretrainer.data.sources import read_documents
from pretrainer.data.tokens import TokenArrays, load_arrays
from pretrainer.recipe import load_recipe
from pretrainer.stages import stage_spans


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    cache = tmp_path_factory.mktemp("shards")
    recipe = load_recipe(FIXTURES / "micro3.yaml", [f"data.cache_dir={cache}"])
    tok = get_tokenizer(recipe)
    docs = read_documents("stdlib", recipe.data.sources["stdlib"])
    return recipe, tok, docs, cache


def test_parallel_shards_equal_on_the_fly(setup, tmp_path):
    recipe, tok, docs, _ = setup
    a = prepare_source("stdlib", docs, tok, tmp_path / "a", 0.05, workers=1, shard_docs=10**6)
    b = prepare_source("stdlib", iter(docs), tok, tmp_path / "b", 0.05, workers=2, shard_docs=7)
    assert a["shards"] == 1 and b["shards"] == -(-len(docs) // 7)
    assert a["tokens"] == b["tokens"] and a["tokens_per_s"] > 0
    for part in ("train", "val"):
        x, y = load_arrays(tmp_path / "a" / part), load_arrays(tmp_path / "b" / part)
        assert np.array_equal(x.tokens, y.tokens) and np.array_equal(x.doc_offsets, y.doc_offsets)
        assert x.tokens.dtype == np.uint16  # vocabulary of 512 fits

    # identical batches from either path
    spans = stage_spans(recipe)
    src = {n: SourceData(load_arrays(tmp_path / d / "train"), load_arrays(tmp_path / d / "val")) for n, d in
           [("stdlib", "a"), ("curated", "a")]}  # fmt: skip
    src_b = {n: SourceData(load_arrays(tmp_path / "b" / "train"), src[n].val) for n in src}
    for span in spans[:2]:
        ba, _, _ = StageBatches(recipe, span, src).step_batches(5, 0, 1)
        bb, _, _ = StageBatches(recipe, span, src_b).step_batches(5, 0, 1)
        assert all((x == y).all() for x, y in zip(ba, bb))


def test_resumable_and_idempotent(setup, tmp_path):
    _, tok, docs, _ = setup
    out = tmp_path / "p"
    first = prepare_source("stdlib", docs, tok, out, 0.05, workers=1, shard_docs=5)
    # simulate an interruption: the manifest and one shard were never finished
    (out / "manifest.json").unlink()
    victim = sorted((out / "shards").iterdir())[2]
    for f in victim.iterdir():
        f.unlink()
    victim.rmdir()
    kept = sorted((out / "shards").iterdir())[0] / "tokens.npy"
    mtime = os.stat(kept).st_mtime_ns
    again = prepare_source("stdlib", docs, tok, out, 0.05, workers=1, shard_docs=5)
    assert os.stat(kept).st_mtime_ns == mtime  # finished shards are kept
    assert {k: v for k, v in again.items() if k not in ("seconds", "tokens_per_s")} == {
        k: v for k, v in first.items() if k not in ("seconds", "tokens_per_s")
    }
    # idempotent: with a manifest nothing is redone
    assert prepare_source("stdlib", docs, tok, out, 0.05) == json.loads((out / "manifest.json").read_text())


def test_prepare_data_script_then_trainer_cache(setup, tmp_path):
    import prepare_data

    recipe, tok, _, cache = setup
    assert (
        prepare_data.main([str(FIXTURES / "micro3.yaml"), "--set", f"data.cache_dir={cache}", "--workers", "2"]) == 0
    )
    for name in ("stdlib", "curated"):
        assert (source_dir(recipe, name, tok) / "manifest.json").exists()


def test_long_documents_contiguous_and_upweighted():
    # docs of length 10, 40 (long), 5, 30 (long), 12
    lengths = [10, 40, 5, 30, 12]
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    arr = TokenArrays(np.arange(offsets[-1], dtype=np.uint16), offsets)
    plain = plain_windows(arr, 32)
    t = long_doc_windows(arr, seq_len=32, min_tokens=25, upweight=3)
    assert plain.size == 97 // 32
    starts = [t.start(j) for j in range(t.size)]
    assert 10 in starts and 55 in starts  # each long document starts a window
    # the 30-token document fits in one sequence and is not cut
    assert any(s <= 55 and 55 + 30 <= s + 32 for s in starts)
    assert t.n_long == 3  # 40 tokens -> 2 windows, 30 tokens -> 1
    assert sum(1 for s in starts if s in (10, 42, 55)) == 3 * 3  # upweighted 3x


def test_bench_data_script(setup, capsys):
    import bench_data

    _, _, _, cache = setup
    args = [str(FIXTURES / "micro3.yaml"), "--set", f"data.cache_dir={cache}", "--steps", "5", "--start", "1000000000"]
    assert bench_data.main(args) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [r["stage"] for r in rows] == ["main", "long", "anneal"]
    assert all(r["tokens"] == 5 * 1024 and r["tokens_per_s"] > 0 for r in rows)
