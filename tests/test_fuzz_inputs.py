"""Bad input of every class, generated: damaged source files, damaged checkpoints, unusable remotes, damaged token
files. Each must be one `error:` line naming the file (and line) or field, exit 2: never a traceback, never
silence. The recipe fields have their own fuzz (test_hardening.py). The default suite runs one seed per class; `slow`
runs many."""

import json
import random
import shutil
import sysconfig
from pathlib import Path

import export_checkpoint
import numpy as np
import pytest
import run_recipe
from test_hardening import cli, one_line_error, saved  # noqa: F401 - `saved` is a fixture

from pretrainer.checkpoint import format as ck

# ---------------------------------------------------------------------------- source files

JSONL_DAMAGE = ("not_utf8", "not_json", "not_object", "text_not_str", "no_text")
TEXT_DAMAGE = ("not_utf8", "binary", "latin1")


def _lines(rng: random.Random, n: int) -> list[bytes]:
    return [json.dumps({"text": f"def f{i}(x):\n    return x * {rng.randint(0, 99)}\n"}).encode() for i in range(n)]


def bad_source_file(rng: random.Random) -> tuple[str, bytes, str]:
    """A damaged jsonl or text file: (name, content, what its one error line must say)."""
    n = rng.randint(1, 40)
    k = rng.randint(1, n)  # the damaged line, 1-based
    if rng.random() < 0.6:
        kind, lines = rng.choice(JSONL_DAMAGE), _lines(rng, n)
        line = lines[k - 1]
        if kind == "not_utf8":
            at, byte = rng.randrange(len(line)), bytes([rng.randrange(0x80, 0xC0)])  # a lone continuation byte
            lines[k - 1] = line[:at] + byte + line[at:]
            expect = f"line {k} is not UTF-8 (byte {byte!r} at offset {at}"
        elif kind == "not_json":
            lines[k - 1] = line[: rng.randrange(1, len(line))]  # any proper prefix of an object
            expect = f"line {k} is not JSON"
        elif kind == "not_object":
            value = rng.choice([[1, 2], 3, "s", None, True, 1.5])
            lines[k - 1] = json.dumps(value).encode()
            expect = f"line {k} is {type(value).__name__}, not an object"
        elif kind == "text_not_str":
            value = rng.choice([5, 1.5, [1], {"a": 1}, True])
            lines[k - 1] = json.dumps({"text": value}).encode()
            expect = f"holds {type(value).__name__} values, not text (bad.jsonl, document {k})"
        else:
            lines[k - 1] = json.dumps({"body": "x = 1"}).encode()
            expect = "'text' not in the rows of"
        return "bad.jsonl", b"\n".join(lines) + b"\n", expect
    kind = rng.choice(TEXT_DAMAGE)
    lines = [f"x{i} = {rng.randint(0, 999)}".encode() for i in range(n)]
    if kind == "binary":
        text = b"\n".join(lines)
        at = rng.randrange(len(text))
        return "bad.py", text[:at] + b"\x00" + text[at:], f"is binary (a NUL byte at offset {at})"
    line = lines[k - 1]
    at = rng.randrange(len(line) + 1)
    insert = bytes([rng.randrange(0x80, 0xC0)]) if kind == "not_utf8" else "café".encode("latin-1")
    lines[k - 1] = line[:at] + insert + line[at:]
    return "bad.py", b"\n".join(lines) + b"\n", f"line {k} is not UTF-8"


def check_bad_sources(tmp_path: Path, capsys, seeds) -> None:
    for seed in seeds:
        name, content, expect = bad_source_file(random.Random(seed))
        data = tmp_path / f"data{seed}"
        data.mkdir()
        ext = name.rsplit(".", 1)[1]
        for i in range(20):  # good files around the bad one
            good = json.dumps({"text": "def f(): pass"}) + "\n" if ext == "jsonl" else "x = 1\n"
            (data / f"good{i}.{ext}").write_text(good)
        (data / name).write_bytes(content)
        source = f"data.sources.stdlib={{type: files, include: ['{data}/*']}}"
        assert run_recipe.main([*cli(tmp_path / f"o{seed}", tmp_path / "cache", "--set", source)]) == 2, seed
        line = one_line_error(capsys)
        assert name in line and expect in line, (seed, line, expect)


# ---------------------------------------------------------------------------- checkpoints


def damage_checkpoint(rng: random.Random, path: Path) -> str:
    """One random damage to a checkpoint directory: a file removed, truncated, a byte flipped, replaced by noise, or
    meta.json/manifest.json rewritten with a wrong value. Returns what was done."""
    files = sorted([*ck.list_files(path), ck.MANIFEST])
    rel = rng.choice(files)
    f = path / rel
    hows = ["remove", "truncate", "flip", "noise"] + (["json"] if rel in (ck.META, ck.MANIFEST) else [])
    data = f.read_bytes()
    how = rng.choice(hows) if data else rng.choice(["remove", "noise"])
    if how == "remove":
        f.unlink()
    elif how == "truncate":
        f.write_bytes(data[: rng.randrange(len(data))])
    elif how == "flip":
        at = rng.randrange(len(data))
        f.write_bytes(data[:at] + bytes([data[at] ^ (1 << rng.randrange(8))]) + data[at + 1 :])
    elif how == "noise":
        f.write_bytes(rng.randbytes(rng.randint(1, 64)))
    else:  # a wrong value where the value matters (the manifest's `hash` and `created` are informative only)
        doc = json.loads(data)
        wrong = rng.choice([None, "x", -1, 0, [], {}, 1e308])
        if rel == ck.MANIFEST and rng.random() < 0.7:
            entry = doc["files"][rng.choice(sorted(doc["files"]))]
            entry[rng.choice(sorted(entry))] = wrong
        else:
            doc[rng.choice(["files"] if rel == ck.MANIFEST else sorted(doc))] = wrong
        f.write_text(json.dumps(doc))
    return f"{how} {rel}"


def check_bad_checkpoints(saved_run: Path, tmp_path: Path, cache_dir: Path, capsys, seeds, resume_seeds) -> None:
    newest = ck.list_checkpoints(saved_run / "checkpoints")[-1].path
    for seed in seeds:
        rng = random.Random(seed)
        ckpt = tmp_path / f"ckpt{seed}"
        shutil.copytree(newest, ckpt)
        what = damage_checkpoint(rng, ckpt)
        if not ck.verify(ckpt):  # a flip that changed nothing the manifest records cannot happen: all files hashed
            pytest.fail(f"seed {seed}: {what} passed verification")
        assert export_checkpoint.main([str(ckpt), str(tmp_path / f"x{seed}")]) == 2, what
        assert str(ckpt) in one_line_error(capsys), what
        assert not (tmp_path / f"x{seed}").exists(), what  # nothing half-exported
        if seed in resume_seeds:
            out = tmp_path / f"r{seed}"
            assert run_recipe.main(cli(out, cache_dir, "--resume", str(ckpt))) == 2, what
            assert f"--resume {ckpt}: not a valid checkpoint" in one_line_error(capsys), what


# ---------------------------------------------------------------------------- remotes


def bad_remote(rng: random.Random, tmp_path: Path) -> str:
    blocker = tmp_path / f"blocker{rng.randrange(10**6)}"
    blocker.write_text("a regular file")
    proto = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 9)))
    return rng.choice([f"{proto}://bucket/run", f"file://{blocker}/run/{proto}", f"{blocker}/{proto}"])


def check_bad_remotes(tmp_path: Path, cache_dir: Path, capsys, seeds) -> None:
    for seed in seeds:
        url = bad_remote(random.Random(seed), tmp_path)
        args = cli(tmp_path / f"node{seed}", cache_dir, "--set", f"checkpoint.remote={url}", "--resume", "auto")
        assert run_recipe.main(args) == 2, url
        assert "checkpoint.remote" in (line := one_line_error(capsys)) and url.split("://")[-1][:20] in line, line


# ---------------------------------------------------------------------------- token files


def check_bad_token_files(tmp_path: Path, capsys, seed: int) -> None:
    """A prepared source damaged at random: a `.ds` file cut, its index cut, or one foreign token id placed in a
    sample the run draws (the start check samples the files; the batch check sees every drawn token)."""
    rng = random.Random(seed)
    src, cache = tmp_path / f"src{seed}", tmp_path / f"cache{seed}"
    shutil.copytree(Path(sysconfig.get_paths()["stdlib"]) / "email", src)  # ~200k tokens: the start check reads 64k
    source = f"data.sources.stdlib={{type: files, include: ['{src}/*.py']}}"
    assert run_recipe.main([*cli(tmp_path / f"a{seed}", cache), "--set", source]) == 0
    capsys.readouterr()
    files = [f for f in sorted((cache / "tokens").glob("stdlib-*/files/*/train.ds")) if f.stat().st_size]
    kind = rng.choice(["cut_ds", "cut_index", "foreign_id"])
    if kind == "cut_ds":
        ds = rng.choice(files)
        ds.write_bytes(ds.read_bytes()[: rng.randrange(ds.stat().st_size)])
        expect = f"{ds}: "
    elif kind == "cut_index":
        index = Path(f"{rng.choice(files)}.index")
        index.write_bytes(index.read_bytes()[: rng.randrange(index.stat().st_size)])
        expect = f"{index}: "
    else:
        ds, pos = drawn_token(tmp_path, cache, source, rng)
        ds = Path(ds)
        ids = np.memmap(ds, dtype=np.uint16, mode="r+")
        ids[pos] = 60000 + rng.randrange(5000)
        ids.flush()
        expect = f"{ds}: token id {int(ids[pos])} at token {pos} (data.sources.stdlib, training sample"
    assert run_recipe.main([*cli(tmp_path / f"b{seed}", cache), "--set", source]) == 2, kind
    assert expect in one_line_error(capsys), kind


def sampled(ds: Path, pos: int) -> bool:
    """Whether the check at start reads this token (its windows over the split's files as one array)."""
    from pretrainer.data.pipeline import ID_SAMPLES

    files = sorted(ds.parent.parent.glob("*/train.ds"))
    sizes = [f.stat().st_size // 2 for f in files]
    at = sum(sizes[: files.index(ds)]) + pos
    starts = np.linspace(0, max(0, sum(sizes) - 1024), ID_SAMPLES).astype(np.int64)
    return bool(((starts <= at) & (at < starts + 1024)).any())


def drawn_token(tmp_path: Path, cache: Path, source: str, rng: random.Random) -> tuple[str, int]:
    """A token that the run draws (its 8 steps) and that the check at start does not read: its file and position
    there. (The start check's own finds are test_hardening's `foreign_ids`.)"""
    from test_hardening import ROOT, SHORT

    from pretrainer.data.pipeline import StageBatches, get_tokenizer, load_sources
    from pretrainer.recipe.loading import load_recipe
    from pretrainer.recipe.stages import stage_spans

    sets = [*SHORT, "--set", f"data.cache_dir={cache}", "--set", source][1::2]
    recipe = load_recipe(ROOT / "tests/fixtures/micro.yaml", sets)
    sources = load_sources(recipe, get_tokenizer(recipe))
    span = stage_spans(recipe)[0]
    sb = StageBatches(recipe.stages[0], span, sources, recipe.run.seed)
    for _ in range(1000):
        d = sb.sampler(rng.randrange(span.steps * span.sequences_per_step))
        at = sb.tables[d.source].start(d.sample) + rng.randrange(span.seq_len)
        path, pos = sources[d.source].train.tokens.file_of(at)
        if not sampled(Path(path), pos):
            return path, pos
    raise AssertionError("every drawn token is read by the check at start: use a larger source")


# ---------------------------------------------------------------------------- the tests


def test_generated_bad_inputs_are_one_line_exit_2(saved, tmp_path, cache_dir, capsys):  # noqa: F811
    check_bad_sources(tmp_path, capsys, range(12))
    check_bad_checkpoints(saved, tmp_path, cache_dir, capsys, range(10), resume_seeds={0})
    check_bad_remotes(tmp_path, cache_dir, capsys, range(3))
    check_bad_token_files(tmp_path, capsys, seed=5)  # one foreign id the check at start does not read


@pytest.mark.slow  # more seeds of the same generators
def test_many_generated_bad_inputs_are_one_line_exit_2(saved, tmp_path, cache_dir, capsys):  # noqa: F811
    check_bad_sources(tmp_path, capsys, range(100, 300))
    check_bad_checkpoints(saved, tmp_path, cache_dir, capsys, range(100, 200), resume_seeds=set(range(100, 110)))
    check_bad_remotes(tmp_path, cache_dir, capsys, range(100, 120))
    for seed in range(100, 106):
        check_bad_token_files(tmp_path, capsys, seed)
