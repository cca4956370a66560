"""The benchmark machinery runs end to end (numbers come from `make bench`, never asserted as timings here)."""

import json

import bench_gpu
import pytest
import torch
from benchkit.report import write_markdown


def test_bench_gpu_skips_without_cuda(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the gpu-marked test covers it")
    assert bench_gpu.main([]) == 0
    assert "skipped" in capsys.readouterr().out


@pytest.mark.slow  # a variation; the default set keeps a representative
def test_bench_gpu_runs_the_trainer_per_variant(tmp_path, cache_dir):
    """On the CPU (--cpu) the plumbing runs as on a GPU: one real trainer run per variant, numbers from its own
    metrics; a variant that cannot run here is reported with its error and the others go on."""
    out = tmp_path / "g.json"
    args = [
        "tests/fixtures/micro.yaml",
        "--cpu",
        "--recipe-data",
        "--steps",
        "12",
        "--peak-tflops",
        "1",
        "--variants",
        "eager,masking,liger",
        "--work-dir",
        str(tmp_path / "runs"),
        "--out",
        str(out),
        "--set",
        f"data.cache_dir={cache_dir}",
    ]
    assert bench_gpu.main(args) == 0
    v = {r["variant"]: r for r in json.loads(out.read_text())["variants"]}
    for name in ("eager", "masking"):
        assert v[name]["tokens_per_s"] > 0 and 0 < v[name]["mfu"] < 1 and v[name]["windows"] >= 2, v[name]
    assert v["masking"]["overrides"] == ["model.compile=true", "data.document_masking=true"]
    if not torch.cuda.is_available():
        assert "liger needs an NVIDIA GPU" in v["liger"]["error"]
    resolved = (tmp_path / "runs" / "masking" / "recipe.resolved.yaml").read_text()
    assert "document_masking: true" in resolved


@pytest.mark.slow  # `make bench` itself; its report and the checkpoint benchmark stay in the default set
def test_benchmark_end_to_end_small(tmp_path, cache_dir, monkeypatch):
    import benchmark
    from benchkit import harness as lib

    monkeypatch.setattr(lib, "BENCH_OVERRIDES", lib.BENCH_OVERRIDES + [f"data.cache_dir={cache_dir}"])
    j, md = tmp_path / "b.json", tmp_path / "B.md"
    assert (
        benchmark.main(
            [
                "tests/fixtures/micro.yaml",
                "--rounds",
                "1",
                "--chunk",
                "1",
                "--json-out",
                str(j),
                "--md-out",
                str(md),
                "--threads",
                "1",
            ]
        )
        == 0
    )
    r = json.loads(j.read_text())
    st = r["step_time"]
    for name in ("pretrainer", "plain", "hf_trainer"):
        assert st[name]["n"] == 1 and st[name]["median"] > 0
    assert r["data"]["headroom"] > 0 and r["checkpoint_stall"]["sync_s"]["n"] == 5
    assert r["resume"]["100"]["n"] == 3
    text = md.read_text()
    assert "| pretrainer / plain loop |" in text and r["environment"]["torch"] in text


def test_markdown_marks_missed_goals(tmp_path):
    d = {"median": 1.0, "q1": 0.9, "q3": 1.1, "min": 0.8, "max": 1.2, "n": 3}
    r = {
        "environment": {
            "date": "2026-12-02",
            "machine": "m",
            "gpu": None,
            "python": "3",
            "torch": "t",
            "transformers": "x",
            "accelerate": "a",
        },
        "command": "python scripts/benchmark.py",
        "threads": 2,
        "params": 10,
        "grad_accum": 2,
        "micro_batch_size": 4,
        "seq_len": 8,
        "step_time": {
            "pretrainer": d,
            "plain": d,
            "hf_trainer": d,
            "ratio_vs_plain": 1.2,
            "ratio_vs_hf_trainer": 0.9,
            "tokens_per_step": 8,
            "rounds": 1,
            "chunk": 1,
        },
        "data": {"delivered_tokens_per_s": 1e6, "consumed_tokens_per_s": 1e3, "headroom": 1000.0},
        "checkpoint_stall": {"sync_s": d, "background_s": d, "ratio": 0.05},
        "resume": {"100": d, "1000000000": d, "ratio": 1.0},
        "machine_speed": {
            "before": {"matmul_gflops": 60.0, "memcpy_gb_s": 10.0},
            "after": {"matmul_gflops": 58.5, "memcpy_gb_s": 9.5},
        },
    }
    (tmp_path / "B.md").write_text("# Benchmarks\n\n| old table |\n\n## Forecast\n\nwritten by hand\n")
    write_markdown(r, tmp_path / "B.md")
    text = (tmp_path / "B.md").read_text()
    assert "1.200x | <= 1.03x | **missed**" in text and "0.900x | <= 1.00x | met" in text
    assert "fp32 matmul 60.0 / 58.5 GFLOP/s, memcpy 10.0 / 9.5 GB/s" in text  # the reference beside the table
    assert "| old table |" not in text and text.endswith("## Forecast\n\nwritten by hand\n")  # the rest is kept


def test_bench_checkpoint_runs_one_small_size(tmp_path, capsys):
    """The README's checkpoint benchmark command, at one tiny size: every column is measured."""
    import bench_checkpoint

    assert bench_checkpoint.main(["--sizes", "64x1", "--out", str(tmp_path)]) == 0
    row = json.loads(next(x for x in capsys.readouterr().out.splitlines() if x.startswith("{")))
    for key in ("sync_total_s", "async_blocked_s", "verify_world_s", "verify_one_s", "finite_s", "bytes"):
        assert row[key] > 0, key


@pytest.mark.slow  # a variation; the default set keeps a representative
def test_bench_eval_measures_each_window_in_its_own_process(capsys):
    import bench_eval

    assert (
        bench_eval.main(["--windows", "64,128", "--docs", "2", "--vocab", "256", "--models", "64x1", "--limit", "2"])
        == 0
    )
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("| window |") and [r.split("|")[1].strip() for r in table[2:4]] == ["64", "128"]
    rows = [r.split("|") for r in table[-2:]]  # the lm-eval rows, fp32 and bf16 gathers: a copy and a scoring timed
    assert [(r[1].strip(), r[3].strip(), r[7].strip()) for r in rows] == [
        ("64x1", d, "2") for d in ("float32", "bfloat16")
    ]
    assert all(float(r[6]) > 0 for r in rows)
