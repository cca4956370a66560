import pytest
from conftest import FIXTURES

from pretrainer.errors import RecipeError
from pretrainer.recipe.loading import load_recipe
from pretrainer.recipe.schedules import lr_at
from pretrainer.recipe.stages import grad_accum_steps, stage_at, stage_spans, total_steps


def test_stage_map_is_pure_and_batch_fixed_in_tokens():
    r = load_recipe("recipes/tiny.yaml")
    spans = stage_spans(r)
    assert [(s.name, s.start_step, s.steps, s.seq_len) for s in spans] == [
        ("main", 0, 150, 256),
        ("long", 150, 30, 1024),
        ("anneal", 180, 40, 256),
    ]
    assert all(s.tokens_per_step == 8192 for s in spans)
    assert [s.sequences_per_step for s in spans] == [32, 8, 32]
    assert [s.micro_batch_size for s in spans] == [16, 4, 16]  # tokens per micro batch fixed
    assert stage_at(spans, 149).name == "main" and stage_at(spans, 150).name == "long"
    assert stage_at(spans, 180).name == "anneal" and stage_at(spans, 10**6).name == "anneal"
    assert total_steps(r) == 220 and grad_accum_steps(r, 1) == 2 and grad_accum_steps(r, 2) == 1


def test_lr_across_stage_boundaries_with_pinned_decay():
    r = load_recipe("recipes/tiny.yaml")
    peak = r.optimizer.lr
    assert lr_at(r, 10) == pytest.approx(peak / 2)  # warmup
    assert lr_at(r, 150) == lr_at(r, 179) == peak  # stable through the long-context stage
    assert lr_at(r, 180) == pytest.approx(peak)  # decay starts with the anneal
    assert lr_at(r, 190) < peak and lr_at(r, 219) < 0.05 * peak
    assert lr_at(r, 220) == pytest.approx(0.0)


def test_tokens_stage_rounds_up_to_whole_steps():
    r = load_recipe("recipes/1b_wsd.yaml")
    spans = stage_spans(r)
    for s, st in zip(spans, r.stages):
        assert s.tokens >= st.tokens and s.tokens - st.tokens < r.batch.global_batch_tokens


def test_mixture_normalized_with_warning_and_undefined_source():
    r = load_recipe(FIXTURES / "micro3.yaml", ["stages.0.mixture={stdlib: 3, curated: 1}"])
    from pretrainer.recipe.lint import lint

    assert any(f.id == "PT009" and f.field == "stages.0.mixture" and "sum to 4" in f.message for f in lint(r))
    with pytest.raises(RecipeError, match="source 'books' of stage 'long' is not defined in data.sources"):
        load_recipe(FIXTURES / "micro3.yaml", ["stages.1.mixture={books: 1}"])


def test_decay_stage_must_exist_and_be_wsd():
    with pytest.raises(RecipeError, match="schedule.decay_stage: no stage named 'cooldown'"):
        load_recipe("recipes/tiny.yaml", ["schedule.decay_stage=cooldown"])
    with pytest.raises(RecipeError, match="only a WSD schedule"):
        load_recipe("recipes/tiny.yaml", ["schedule.type=cosine"])
