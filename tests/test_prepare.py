import contextlib
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
from conftest import FIXTURES, ROOT, write

from pretrainer.data.packing import long_doc_windows, plain_windows
from pretrainer.data.pipeline import SourceData, StageBatches, get_tokenizer, load_sources, source_dir
from pretrainer.data.prepare import held_out, prepare_source, read_manifest
from pretrainer.data.readers import source_files
from pretrainer.data.tokenfiles import SplitTokens, TokenFiles
from pretrainer.data.tokens import TokenArrays
from pretrainer.errors import DataError
from pretrainer.recipe.loading import load_recipe
from pretrainer.recipe.sections import SourceSection
from pretrainer.recipe.stages import stage_spans


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    cache = tmp_path_factory.mktemp("prepare")
    recipe = load_recipe(FIXTURES / "micro3.yaml", [f"data.cache_dir={cache}"])
    return recipe, get_tokenizer(recipe), cache


def _prepare(recipe, tok, out, **kw) -> dict:
    return prepare_source("stdlib", recipe.data.sources["stdlib"], tok, out, 0.05, **kw)


def _splits(out, manifest) -> dict:
    return {s: SplitTokens(out, s, manifest) for s in ("train", "val")}


def test_engine_equals_inline_and_tasks_do_not_matter(setup, tmp_path, monkeypatch):
    recipe, tok, _ = setup
    a = _prepare(recipe, tok, tmp_path / "a")  # the trainer's in-process path: one task
    b = _prepare(recipe, tok, tmp_path / "b", executor="local", tasks=4, workers=2)  # datatrove's local executor
    c = _prepare(recipe, tok, tmp_path / "c", executor="local", workers=2)  # one task per input file
    assert a["files"] == len(source_files("stdlib", recipe.data.sources["stdlib"]).paths) > 4
    drop = ("seconds",)
    assert {k: v for k, v in a.items() if k not in drop} == {k: v for k, v in b.items() if k not in drop}
    assert {k: v for k, v in a.items() if k not in drop} == {k: v for k, v in c.items() if k not in drop}
    assert a["val_docs"] >= 1 and a["train_docs"] > a["val_docs"]
    sa, sb = _splits(tmp_path / "a", a), _splits(tmp_path / "b", b)
    monkeypatch.setattr("pretrainer.data.tokenfiles.INDEX_CHUNK", 3)  # chunk edges inside every file's index
    for split in sa.values():  # long documents read file by file, chunk by chunk = from the whole table
        whole = TokenArrays(split.tokens[:], split.doc_offsets)
        for k in (1, 50, 400, 10**9):
            assert np.array_equal(split.long_docs(k), whole.long_docs(k)), k
        a_t, b_t = long_doc_windows(split, 64, 50, 3), long_doc_windows(whole, 64, 50, 3)
        assert np.array_equal(a_t.starts, b_t.starts) and a_t.n_long == b_t.n_long > 0
    for part in ("train", "val"):
        x, y = sa[part], sb[part]
        assert np.array_equal(x.tokens[:], y.tokens[:]) and np.array_equal(x.doc_offsets, y.doc_offsets)
        assert x.tokens.dtype == np.uint16  # vocabulary of 512 fits
        ends = x.doc_offsets[1:] - 1
        assert (x.tokens[:][ends] == tok.eos_token_id).all()  # EOS closes every document
    # identical batches from either path, in a plain and in a long-document stage
    src_a = {n: SourceData(sa["train"], sa["val"]) for n in ("stdlib", "curated")}
    src_b = {n: SourceData(sb["train"], sb["val"]) for n in ("stdlib", "curated")}
    for span in stage_spans(recipe)[:2]:
        ba, _, _ = StageBatches(recipe.stages[span.index], span, src_a, recipe.run.seed).step_batches(5, 0, 1)
        bb, _, _ = StageBatches(recipe.stages[span.index], span, src_b, recipe.run.seed).step_batches(5, 0, 1)
        assert all((x == y).all() for x, y in zip(ba, bb))


def test_token_files_slice_across_files(tmp_path):
    parts = [np.arange(a, b, dtype=np.uint16) for a, b in ((0, 5), (5, 5), (5, 12), (12, 13))]
    paths = []
    for i, p in enumerate(parts):
        paths.append(tmp_path / f"{i}.ds")
        p.tofile(paths[-1])
    t = TokenFiles(paths, np.uint16)
    whole = np.arange(13, dtype=np.uint16)
    assert len(t) == 13
    for lo, hi in ((0, 13), (3, 7), (4, 5), (5, 12), (11, 13), (12, 20), (7, 7)):
        assert np.array_equal(t[lo:hi], whole[lo:hi]), (lo, hi)


def test_validation_split_is_by_document_id():
    ids = [f"doc-{i}" for i in range(20_000)]
    share = sum(held_out(i, 0.05) for i in ids) / len(ids)
    assert 0.045 < share < 0.055
    assert [held_out(i, 0.05) for i in ids[:100]] == [held_out(i, 0.05) for i in ids[:100]]  # deterministic
    assert not any(held_out(i, 0.0) for i in ids[:100])


@pytest.mark.slow  # a variation; the default set keeps a representative
def test_killed_preparation_resumes_file_by_file(setup, tmp_path):
    recipe, tok, cache = setup
    args = [
        sys.executable,
        str(ROOT / "scripts" / "prepare_data.py"),
        str(FIXTURES / "micro3.yaml"),
        "--set",
        f"data.cache_dir={tmp_path / 'c'}",
        "--workers",
        "1",
    ]
    env = {**os.environ, "PRETRAINER_KILL_AT": "prepare_file#3"}
    # As a scheduler kills a job: the whole process group (datatrove's manager process would outlive its parent).
    with open(tmp_path / "killed.log", "w") as log:
        killed = subprocess.Popen(args, env=env, stdout=log, stderr=log, cwd=ROOT, start_new_session=True)
        code = killed.wait(timeout=300)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(killed.pid, signal.SIGKILL)
    assert code == -9, (tmp_path / "killed.log").read_text()[-2000:]
    r = load_recipe(FIXTURES / "micro3.yaml", [f"data.cache_dir={tmp_path / 'c'}"])
    out = source_dir(r, "stdlib", tok)
    assert read_manifest(out) is None  # unfinished
    done = sorted((out / "files").glob("*/done.json"))
    assert len(done) == 3
    mtimes = {p: p.stat().st_mtime_ns for p in done}
    again = subprocess.run(args, capture_output=True, text=True, cwd=ROOT)
    assert again.returncode == 0, again.stderr[-2000:]
    assert all(p.stat().st_mtime_ns == t for p, t in mtimes.items())  # finished files are not redone
    fresh = _prepare(recipe, tok, tmp_path / "fresh")
    resumed = read_manifest(out)
    assert {k: v for k, v in resumed.items() if k != "seconds"} == {k: v for k, v in fresh.items() if k != "seconds"}
    assert np.array_equal(
        SplitTokens(out, "train", resumed).tokens[:], _splits(tmp_path / "fresh", fresh)["train"].tokens[:]
    )
    # idempotent: a finished source is skipped, nothing is rewritten
    before = (out / "manifest.json").stat().st_mtime_ns
    assert subprocess.run(args, capture_output=True, cwd=ROOT).returncode == 0
    assert (out / "manifest.json").stat().st_mtime_ns == before


def test_large_or_hub_source_is_not_tokenized_inside_the_run(setup, tmp_path):
    _, tok, _ = setup
    r = load_recipe(FIXTURES / "micro3.yaml", [f"data.cache_dir={tmp_path}", "data.inline_max_mb=0.01"])
    with pytest.raises(DataError, match=r"data.sources.stdlib: not prepared, and .* MB is too much .*prepare_data.py"):
        load_sources(r, tok)
    hub = load_recipe(
        FIXTURES / "micro3.yaml", [f"data.cache_dir={tmp_path}", "data.sources.stdlib={type: hub, path: org/big}"]
    )
    with pytest.raises(DataError, match=r"hub dataset 'org/big' is not prepared; run `python scripts/prepare_data.py"):
        load_sources(hub, tok)


def test_hub_source_resolves_to_its_data_files(monkeypatch):
    import datasets

    files = [f"hf://datasets/org/web@abc/sample/100BT/{i:03d}_00000.parquet" for i in (2, 0, 1)]

    class Builder:
        class config:
            data_files = {"train": files}

    monkeypatch.setattr(datasets, "load_dataset_builder", lambda path, name: Builder)
    got = source_files("web", SourceSection(type="hub", path="org/web", name="sample-100BT"))
    assert got.folder == "hf://datasets/org/web@abc/sample/100BT" and got.fmt == "parquet"
    assert got.paths == ["000_00000.parquet", "001_00000.parquet", "002_00000.parquet"]


def test_broken_jsonl_line_is_one_error_naming_file_and_line(tmp_path):
    from pretrainer.data.readers import read_documents

    write(tmp_path / "a.jsonl", '{"text": "fine"}\n{"text": "cut off\n')
    with pytest.raises(DataError, match=r"data.sources.j: .*a.jsonl: line 2 is not JSON"):
        read_documents("j", SourceSection(type="files", include=[str(tmp_path / "a.jsonl")]))


def test_prepare_data_script_then_trainer_cache(setup):
    import prepare_data

    recipe, tok, cache = setup
    assert (
        prepare_data.main([str(FIXTURES / "micro3.yaml"), "--set", f"data.cache_dir={cache}", "--workers", "2"]) == 0
    )
    for name in ("stdlib", "curated"):
        assert read_manifest(source_dir(recipe, name, tok)) is not None


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

    _, _, cache = setup
    args = [str(FIXTURES / "micro3.yaml"), "--set", f"data.cache_dir={cache}", "--steps", "5", "--start", "1000000000"]
    assert bench_data.main(args) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [r["stage"] for r in rows] == ["main", "long", "anneal"]
    assert all(r["tokens"] == 5 * 1024 and r["tokens_per_s"] > 0 for r in rows)


def test_slurm_submission_then_array_tasks_then_manifest(setup, tmp_path, monkeypatch):
    """The Slurm path without a cluster: capture datatrove's sbatch call, run each array task as Slurm would (the
    pickled executor with SLURM_ARRAY_TASK_ID), then rerun the command: the manifest equals an in-process one."""
    import dill
    from datatrove.executor import slurm

    recipe, tok, _ = setup
    scripts = []
    monkeypatch.setattr(slurm, "launch_slurm_job", lambda contents, *a, **k: scripts.append(contents) or "4242")
    monkeypatch.setattr(slurm, "expand_slurm_nodelist", lambda nodes: [nodes])  # scontrol, inside a real task
    with pytest.raises(DataError, match="--slurm: partition=NAME is required"):
        _prepare(recipe, tok, tmp_path / "s", executor="slurm", workers=8)
    with pytest.raises(DataError, match="--slurm: .*colour"):
        _prepare(recipe, tok, tmp_path / "s", executor="slurm", slurm={"partition": "cpu", "colour": "blue"})
    assert _prepare(recipe, tok, tmp_path / "s", executor="slurm", workers=8, slurm={"partition": "cpu"}) is None
    n_files = len(source_files("stdlib", recipe.data.sources["stdlib"]).paths)
    assert "#SBATCH --partition=cpu" in scripts[0] and f"#SBATCH --array=0-{n_files - 1}%8" in scripts[0]
    (pik,) = (tmp_path / "s" / "logs").glob("*/executor.pik")
    for task in range(n_files):
        with open(pik, "rb") as f:
            executor = dill.load(f)
        for key, value in {
            "SLURM_ARRAY_TASK_ID": str(task),
            "SLURM_NODELIST": "node1",
            "SLURM_NODEID": "0",
            "SLURM_JOB_ID": "4242",
        }.items():
            monkeypatch.setenv(key, value)
        executor.run()
    monkeypatch.delenv("SLURM_ARRAY_TASK_ID")
    done = _prepare(recipe, tok, tmp_path / "s", executor="slurm", slurm={"partition": "cpu"})
    inline = _prepare(recipe, tok, tmp_path / "inline")
    assert done is not None and len(scripts) == 2  # the job array and datatrove's stats merge; nothing resubmitted
    assert {k: v for k, v in done.items() if k != "seconds"} == {k: v for k, v in inline.items() if k != "seconds"}


@pytest.mark.parametrize(
    "text",
    [
        "def f():\n    return 1\n\n\n" * 3000,  # code: cuts after a line break, never inside an indentation run
        "word " * 20000,  # prose without line breaks: cuts before a word
        "x" * 50000,  # no whitespace at all: cut at the limit
        "a\n  \n\t\n" * 8000 + "end",  # whitespace-only lines
    ],
)
def test_text_pieces_tokenize_as_the_whole_text(setup, text):
    from pretrainer.data.prepare import text_pieces

    _, tok, _ = setup
    pieces = list(text_pieces(text, 4096))
    assert "".join(pieces) == text and len(pieces) > 3 and max(map(len, pieces)) <= 4096
    whole = tok(text, add_special_tokens=False).input_ids
    if "x" * 50000 != text:  # a hard cut inside a word may split a token: only where nothing else can be cut
        assert [t for p in pieces for t in tok(p, add_special_tokens=False).input_ids] == whole


def test_one_huge_document_is_prepared_in_bounded_pieces(setup, tmp_path):
    """A document over PIECE_CHARS (256 Ki characters) is tokenized piece by piece: the same tokens as the whole
    text, one document in the index; memory at 1/8/64 MB: `bench_prepare.py --huge-mb`."""
    from pretrainer.data.prepare import PIECE_CHARS

    _, tok, _ = setup
    sources = sorted((ROOT / "src" / "pretrainer").rglob("*.py"))
    code = "".join(p.read_text() for p in sources)
    big = (code * (PIECE_CHARS // len(code) + 2))[: PIECE_CHARS + PIECE_CHARS // 2]
    lines = [json.dumps({"text": "small one"}), json.dumps({"text": big}), json.dumps({"text": "small two"})]
    write(tmp_path / "docs.jsonl", "\n".join(lines) + "\n")
    src = SourceSection(type="files", include=[str(tmp_path / "docs.jsonl")])
    m = prepare_source("huge", src, tok, tmp_path / "out", 0.0)
    assert m["train_docs"] + m["val_docs"] == 3  # the pieces are one document
    expect = tok(big, add_special_tokens=False).input_ids + [tok.eos_token_id]
    docs = [
        split.tokens[int(a) : int(b)].tolist()
        for split in (SplitTokens(tmp_path / "out", s, m) for s in ("train", "val"))
        for a, b in zip(split.doc_offsets[:-1], split.doc_offsets[1:])
    ]
    assert expect in docs and len(docs) == 3
