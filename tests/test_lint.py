"""Each finding fires on a recipe with the mistake; the shipped recipes are quiet."""

import json

import inspect_recipe
import pytest
from conftest import FIXTURES

from pretrainer.errors import RecipeError
from pretrainer.recipe.lint import lint
from pretrainer.recipe.loading import load_recipe

TINY = "recipes/tiny.yaml"


def ids(recipe):
    return {f.id for f in lint(recipe)}


@pytest.mark.parametrize(
    "path", ["recipes/tiny.yaml", "recipes/1b_wsd.yaml", "recipes/1b_cosine.yaml", "recipes/1b_wsd_stable.yaml"]
)
def test_shipped_recipes_are_quiet(path):
    assert lint(load_recipe(path)) == []


@pytest.mark.parametrize(
    "overrides, expect",
    [
        (["schedule.warmup_steps=0"], "PT001"),
        (["schedule.warmup_steps=40"], "PT002"),
        (["clipping.max_grad_norm=null"], "PT004"),
        (["model.config.max_position_embeddings=4096"], "PT005"),
        (["stages.1.rope=null"], "PT006"),
        (["stages.2.steps=5"], "PT007"),
        (["schedule.type=cosine", "schedule.decay_stage=null", "schedule.min_lr_ratio=0.9"], "PT008"),
        (["stages.0.mixture={modules: 3, packages: 1}"], "PT009"),
        (["eval.every_steps=0"], "PT010"),
        (["checkpoint.every_minutes=120"], "PT011"),
        (["checkpoint.every_tokens=100000000"], "PT011"),
        (["batch.critical_batch_tokens=1024"], "PT012"),
        (["stages.2.mixture={modules: 0.6, packages: 0.4}"], "PT013"),
    ],
)
def test_each_finding_fires(overrides, expect):
    found = lint(load_recipe(TINY, overrides))
    assert expect in {f.id for f in found}
    f = next(f for f in found if f.id == expect)
    assert f.message and f.fix and f.field


def test_keep_last_below_two_is_rejected_outright():
    with pytest.raises(RecipeError, match="checkpoint.keep_last: must be >= 2"):
        load_recipe(TINY, ["checkpoint.keep_last=1"])


def test_inspect_strict_and_plot(tmp_path, capsys):
    assert inspect_recipe.main([TINY, "--strict"]) == 0
    assert inspect_recipe.main([TINY, "--strict", "--set", "eval.every_steps=0"]) == 2
    assert "PT010" in capsys.readouterr().out
    png = tmp_path / "lr.png"
    assert inspect_recipe.main([str(FIXTURES / "micro3.yaml"), "--plot", str(png), "--json", "--gpus", "4"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert info["wall_time"]["seconds"] == pytest.approx(info["total_flops"] / (4 * 0.4 * 989e12))
    assert all(s["flops_per_token"] > 0 for s in info["stages"])
    assert info["findings"] == []  # the test fixtures are lint-clean too


def test_repetition_finding_reads_the_prepared_manifests(cache_dir, capsys):
    from pretrainer.data.pipeline import get_tokenizer, load_sources
    from pretrainer.data.sources import prepared_tokens

    tiny = load_recipe(TINY, [f"data.cache_dir={cache_dir}"])
    assert prepared_tokens(tiny) == {} or set(prepared_tokens(tiny)) <= {"modules", "packages", "curated"}
    sources = load_sources(tiny, get_tokenizer(tiny))  # prepares the tiny recipe's sources (shared session cache)
    available = prepared_tokens(tiny)
    assert available == {n: len(s.train.tokens) for n, s in sources.items()}
    assert lint(tiny, available) == []  # the shipped recipe draws less than one pass of every source
    # a longer anneal draws the curated source more than once over
    longer = load_recipe(TINY, [f"data.cache_dir={cache_dir}", "stages.2.steps=200"])
    found = [f for f in lint(longer, prepared_tokens(longer)) if f.id == "PT014"]
    want = 200 * 8192 * 0.4 / available["curated"]
    # curated: the anneal alone exceeds it; modules and packages: only the three stages together do
    assert [f.field for f in found] == ["stages.2.mixture.curated", "data.sources.modules", "data.sources.packages"]
    assert f"{want:.1f}x its {available['curated']:,} prepared" in found[0].message
    run_modules = sum(s.tokens * w for s, w in zip(longer.plan.spans, (0.6, 0.5, 0.3)))
    assert f"{run_modules / available['modules']:.1f}x" in found[1].message
    assert "PT014" not in ids(longer)  # unknown sizes are not judged
    # inspect_recipe shows drawn vs. available per stage and source, and the finding
    assert (
        inspect_recipe.main([TINY, "--json", "--set", f"data.cache_dir={cache_dir}", "--set", "stages.2.steps=200"])
        == 0
    )
    info = json.loads(capsys.readouterr().out)
    anneal = info["stages"][2]["sources"]
    assert anneal["curated"] == {"drawn": round(200 * 8192 * 0.4), "available": available["curated"]}
    assert [f["id"] for f in info["findings"]] == ["PT014"] * 3
    assert inspect_recipe.main([TINY, "--set", "data.cache_dir=/nonexistent/cache"]) == 0
    assert "unknown" in capsys.readouterr().out


def test_fp8_on_hardware_without_it_is_flagged_and_refused(tmp_path, cache_dir, capsys):
    import run_recipe

    from pretrainer.runtime import fp8_capable

    recipe = load_recipe(FIXTURES / "micro.yaml", ["precision.mixed=fp8"])
    assert [f.id for f in lint(recipe, fp8_capable=False)] == ["PT015"]
    assert lint(recipe, fp8_capable=True) == [] and lint(recipe) == []  # unknown hardware is not judged
    if not fp8_capable():
        argv = [
            str(FIXTURES / "micro.yaml"),
            "--output-dir",
            str(tmp_path / "run"),
            "--set",
            "precision.mixed=fp8",
            "--set",
            f"data.cache_dir={cache_dir}",
        ]
        assert run_recipe.main(argv) == 2
        assert "precision.mixed: fp8 needs an NVIDIA GPU with fp8 tensor cores" in capsys.readouterr().err
        assert not (tmp_path / "run" / "checkpoints").exists()


def test_evaluation_findings_context_off_and_misaligned_downstream():
    assert lint(load_recipe(TINY)) == []  # the shipped tiny recipe, lm-eval and all, is clean
    off = lint(load_recipe(TINY, ["eval.context.enabled=false"]))
    assert [f.id for f in off] == ["PT016"] and "1024 tokens" in off[0].message
    lm = "eval.lm_eval={tasks: [heldout_python_bpb], include_path: eval_tasks, every_steps: 70}"
    found = [f for f in lint(load_recipe(TINY, [lm])) if f.id == "PT017"]
    assert len(found) == 1 and "e.g. 50" in found[0].fix
    assert not [f for f in lint(load_recipe(TINY, [lm.replace("70", "100")])) if f.id == "PT017"]


def test_muon_with_an_adamw_lr_and_the_original_adjustment_is_flagged():
    muon = ["optimizer.type=muon", "optimizer.muon.adjust_lr=original"]
    assert [f.id for f in lint(load_recipe(TINY, muon)) if f.id == "PT018"] == ["PT018"]
    assert not [f for f in lint(load_recipe(TINY, muon + ["optimizer.lr=0.02"])) if f.id == "PT018"]
    assert not [f for f in lint(load_recipe(TINY, ["optimizer.type=muon"])) if f.id == "PT018"]  # match_rms_adamw


def test_a_large_low_precision_run_needs_qk_norm_or_z_loss():
    wsd = "recipes/1b_wsd.yaml"
    assert "PT019" in ids(load_recipe(wsd, ["stability.z_loss=0"]))  # 1.18B in bf16, Llama, no z-loss
    assert "PT019" not in ids(load_recipe(wsd, ["stability.z_loss=0", "model.config.model_type=qwen3"]))
    assert "PT019" not in ids(load_recipe(wsd, ["stability.z_loss=0", "precision.mixed=no"]))
    assert "PT019" not in ids(load_recipe(TINY, ["precision.mixed=bf16"]))  # 5M parameters: not judged
    f = next(f for f in lint(load_recipe(wsd, ["stability.z_loss=0"])) if f.id == "PT019")
    assert "1.2B" in f.message and "z_loss" in f.fix
