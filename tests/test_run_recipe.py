"""Smoke test of the README's run command, on a recipe smaller than tiny."""

import json

import pytest
import run_recipe
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pretrainer.observe.tracking import read_jsonl


def run(recipe, out, cache_dir, *extra):
    return run_recipe.main([str(recipe), "--output-dir", str(out), "--set", f"data.cache_dir={cache_dir}", *extra])


def test_micro_run_learns_and_exports(micro_recipe, tmp_path, cache_dir):
    out = tmp_path / "run"
    assert run(micro_recipe, out, cache_dir) == 0
    metrics = read_jsonl(out / "metrics.jsonl")
    train = [m for m in metrics if "loss" in m]
    val = [m for m in metrics if "val/avg" in m]
    assert train[-1]["loss"] < train[0]["loss"] - 0.5
    assert val[0]["step"] == 0 and val[-1]["val/avg"] < val[0]["val/avg"] - 0.5
    assert {"step", "tokens", "stage", "loss", "lr", "grad_norm", "tokens_per_s"} <= set(train[0])
    assert "val/stdlib" in val[-1]
    events = [e["event"] for e in read_jsonl(out / "events.jsonl")]
    assert events[:4] == ["run_identity", "run_start", "optimizer", "stage_start"] and events[-1] == "run_end"
    assert (out / "recipe.resolved.yaml").exists()

    model = AutoModelForCausalLM.from_pretrained(out / "final")
    tok = AutoTokenizer.from_pretrained(out / "final")
    ids = tok("import json\n", return_tensors="pt").input_ids
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss
    assert torch.isfinite(loss)
    cfg = json.loads((out / "final" / "config.json").read_text())
    assert cfg["hidden_size"] == 64 and cfg["vocab_size"] == len(tok)

    # the same directory again is refused (nothing written is lost) ...
    assert run(micro_recipe, out, cache_dir) == 2
    assert len(read_jsonl(out / "metrics.jsonl")) == len(metrics)


@pytest.mark.parametrize(
    "args, expect",
    [
        (["--set", "schedule.warmup_step=3"], "schedule.warmup_step: unknown key; did you mean 'warmup_steps'?"),
        (["--set", "optimizer.lr=fast"], "--set optimizer.lr=fast: optimizer.lr:"),
        (["--set", "data.sources.stdlib.include=[nothing/*.py]"], "data.sources.stdlib.include: 'nothing/*.py'"),
    ],
)
def test_bad_input_is_one_clear_line(micro_recipe, tmp_path, cache_dir, capsys, args, expect):
    assert run(micro_recipe, tmp_path / "r", cache_dir, *args) == 2
    err = capsys.readouterr().err.strip()
    assert expect in err
    assert "Traceback" not in err and len(err.splitlines()) == 1


def test_missing_recipe_exit_2(tmp_path, capsys):
    assert run_recipe.main([str(tmp_path / "none.yaml")]) == 2
    assert "none.yaml: file not found" in capsys.readouterr().err


def test_publish_uploads_final_with_a_card_when_the_run_ends(micro_recipe, tmp_path, cache_dir, monkeypatch):
    """`publish.repo`: at the end, final/ goes up through huggingface_hub's HfApi (its two network calls intercepted
    here) with the card written from the run; a failed upload is one line, never a failed run."""
    from pathlib import Path

    import httpx
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    calls = []

    def upload_folder(self, *, folder_path, repo_id, **kw):
        calls.append((repo_id, sorted(p.name for p in Path(folder_path).iterdir())))
        if repo_id == "me/down":
            request = httpx.Request("POST", "https://huggingface.co/api/upload")
            raise HfHubHTTPError("503 Service Unavailable", response=httpx.Response(503, request=request))
        return type("Info", (), {"commit_url": f"https://hf.co/{repo_id}/commit/1"})()

    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, **kw: None)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    out = tmp_path / "run"
    sets = ["--set", "stages.0.steps=10", "--set", "eval.every_steps=5", "--set", "logging.report_to=[]"]
    assert run(micro_recipe, out, cache_dir, *sets, "--set", "publish.repo=me/micro") == 0
    ((repo, files),) = calls
    assert repo == "me/micro" and {"README.md", "config.json", "model.safetensors", "provenance.json"} <= set(files)
    event = read_jsonl(out / "events.jsonl")[-1]
    assert event["event"] == "published" and event["url"] == "https://hf.co/me/micro/commit/1"
    assert (
        "`val/ref` (held-out loss on the run's fixed validation batches) at step 10: "
        in (out / "final" / "README.md").read_text()
    )

    from pretrainer.errors import PretrainerError
    from pretrainer.publishing.hub import push_to_hub

    with pytest.raises(PretrainerError, match="--push-to-hub me/down: 503 Service Unavailable"):
        push_to_hub(out / "final", "me/down")
