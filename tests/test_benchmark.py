"""The benchmark machinery runs end to end (numbers come from `make bench`, never asserted as timings here)."""

import json

import bench_gpu
import pytest
import torch

from pretrainer.benchmark_report import write_markdown


def test_bench_gpu_skips_without_cuda(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the gpu-marked test covers it")
    assert bench_gpu.main([]) == 0
    assert "skipped" in capsys.readouterr().out


@pytest.mark.gpu
def test_bench_gpu_runs_small(capsys, tmp_path):
    args = ["recipes/1b_wsd.yaml", "--steps", "2", "--warmup", "1", "--no-compile", "--out", str(tmp_path / "g.json"),
            "--set", "model.config.num_hidden_layers=2"]  # fmt: skip
    assert bench_gpu.main(args) == 0
    v = json.loads((tmp_path / "g.json").read_text())["variants"][0]
    assert v["tokens_per_s"] > 0 and 0 < v["mfu"] < 1


def test_benchmark_end_to_end_small(tmp_path, cache_dir, monkeypatch):
    import benchmark

    from pretrainer import benchmark as lib

    monkeypatch.setattr(lib, "BENCH_OVERRIDES", lib.BENCH_OVERRIDES + [f"data.cache_dir={cache_dir}"])
    j, md = tmp_path / "b.json", tmp_path / "B.md"
    assert benchmark.main(["tests/fixtures/micro.yaml", "--rounds", "1", "--chunk", "1", "--json-out", str(j),
                           "--md-out", str(md), "--threads", "1"]) == 0  # fmt: skip
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
        "environment": {"date": "2026-12-02", "machine": "m", "gpu": None, "python": "3", "torch": "t",
                        "transformers": "x", "accelerate": "a"},
        "command": "python scripts/benchmark.py", "threads": 2, "params": 10, "grad_accum": 2, "micro_batch_size": 4,
        "seq_len": 8,
        "step_time": {"pretrainer": d, "plain": d, "hf_trainer": d, "ratio_vs_plain": 1.2, "ratio_vs_hf_trainer": 0.9,
                      "tokens_per_step": 8, "rounds": 1, "chunk": 1},
        "data": {"delivered_tokens_per_s": 1e6, "consumed_tokens_per_s": 1e3, "headroom": 1000.0},
        "checkpoint_stall": {"sync_s": d, "background_s": d, "ratio": 0.05},
        "resume": {"100": d, "1000000000": d, "ratio": 1.0},
    }  # fmt: skip
    write_markdown(r, tmp_path / "B.md")
    text = (tmp_path / "B.md").read_text()
    assert "1.200x | <= 1.03x | **missed**" in text and "0.900x | <= 1.00x | met" in text
