import json

import inspect_recipe


def test_1b_json(capsys):
    assert inspect_recipe.main(["recipes/1b_wsd.yaml", "--json", "--lr-at", "500,1000"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert 0.9e9 <= info["params"] <= 1.5e9
    assert info["total_steps"] == sum(s["steps"] for s in info["stages"])
    assert info["stages"][0]["start_step"] == 0 and info["stages"][0]["seq_len"] == 2048
    assert info["lr_at"]["500"] == 3e-4 * 500 / 2000
    assert set(info["stages"][0]) >= {"name", "start_step", "steps", "tokens", "seq_len"}


def test_text_and_bad_args(capsys):
    assert inspect_recipe.main(["recipes/tiny.yaml", "--lr-at", "10"]) == 0
    out = capsys.readouterr().out
    assert "parameters" in out and "lr at step         10" in out
    assert inspect_recipe.main(["recipes/tiny.yaml", "--lr-at", "ten"]) == 2


def test_a_gpu_count_the_batch_does_not_divide_over_is_refused(capsys):
    assert inspect_recipe.main(["recipes/1b_wsd.yaml", "--gpus", "256", "--json"]) == 2
    err = capsys.readouterr().err
    assert "--gpus 256:" in err and "does not divide over 256 processes" in err
    assert inspect_recipe.main(["recipes/1b_wsd.yaml", "--gpus", "64", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["grad_accum"] == 2  # 128 micro batches of 16,384 tokens per step over 64 GPUs
