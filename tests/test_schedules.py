import math

import pytest

from pretrainer.errors import RecipeError
from pretrainer.recipe.loading import load_recipe
from pretrainer.recipe.schedules import cosine, lr_array, lr_at, wsd
from pretrainer.recipe.stages import branch_decay_recipe

ROOT_1B = "recipes/1b_cosine.yaml"


def test_seed_example_cosine_from_transformers():
    # peak 3e-4, 2,000 warmup, 50,000 total, cosine to 0
    f = lambda s: 3e-4 * cosine(s, warmup_steps=2000, total_steps=50_000, min_lr_ratio=0.0)  # noqa: E731
    assert f(500) == pytest.approx(7.5e-5, rel=1e-12)
    assert f(1000) == pytest.approx(1.5e-4, rel=1e-12)
    assert f(26_000) == pytest.approx(1.5e-4, rel=1e-9)
    assert f(0) == 0.0
    assert f(2000) == pytest.approx(3e-4)
    assert f(50_000) == pytest.approx(0.0, abs=1e-15)


def test_cosine_min_lr_ratio():
    assert cosine(1000, warmup_steps=10, total_steps=1000, min_lr_ratio=0.1) == pytest.approx(0.1)
    assert cosine(505, warmup_steps=10, total_steps=1000, min_lr_ratio=0.1) == pytest.approx(0.55)


@pytest.mark.parametrize("shape", ["linear", "cosine", "1-sqrt"])
def test_wsd_boundaries(shape):
    kw = dict(warmup_steps=100, total_steps=1000, decay_steps=200, decay_shape=shape, min_lr_ratio=0.1)
    assert wsd(0, **kw) == 0.0
    assert wsd(50, **kw) == pytest.approx(0.5)
    assert wsd(100, **kw) == 1.0
    assert wsd(799, **kw) == 1.0  # last stable step
    assert wsd(800, **kw) == pytest.approx(1.0)  # decay starts at the peak
    assert wsd(1000, **kw) == pytest.approx(0.1)  # ends at min_lr_ratio
    values = [wsd(s, **kw) for s in range(800, 1001)]
    assert all(a >= b for a, b in zip(values, values[1:])), "decay must be monotone"


def test_wsd_shapes_midpoint():
    kw = dict(warmup_steps=0, total_steps=200, decay_steps=100, min_lr_ratio=0.0)
    assert wsd(150, decay_shape="linear", **kw) == pytest.approx(0.5)
    assert wsd(150, decay_shape="cosine", **kw) == pytest.approx(0.5)
    assert wsd(150, decay_shape="1-sqrt", **kw) == pytest.approx(1 - math.sqrt(0.5))
    assert wsd(125, decay_shape="cosine", **kw) > wsd(125, decay_shape="linear", **kw)


def test_recipe_lr_at_cosine_1b():
    r = load_recipe(
        ROOT_1B, ["schedule.min_lr_ratio=0.0", "stages=[{name: main, steps: 50000, seq_len: 2048, mixture: {web: 1}}]"]
    )
    assert lr_at(r, 500) == pytest.approx(7.5e-5)
    assert lr_at(r, 1000) == pytest.approx(1.5e-4)
    assert lr_at(r, 26_000) == pytest.approx(1.5e-4)


def test_run_lr_is_lambda_lr_that_saves_the_step_and_recomputes_on_load():
    """torch's LambdaLR: each group's own peak times the schedule (Muon's and AdamW's groups keep their ratio); only
    the step goes into meta.json, and the LR is recomputed from it on load, with no warning for a first update that
    skip-step held back."""
    import warnings

    import torch

    from pretrainer.train.build import RunLR

    p, q = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([{"params": [p], "lr": 2.0}, {"params": [q], "lr": 0.5}])
    fn = lambda s: min(1.0, s / 10)  # noqa: E731
    c = RunLR(opt, fn)
    assert [g["lr"] for g in opt.param_groups] == [0.0, 0.0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the first step comes before any optimizer step: no warning
        for _ in range(5):
            c.step()
    assert [g["lr"] for g in opt.param_groups] == [pytest.approx(1.0), pytest.approx(0.25)]
    assert c.state_dict() == {"step": 5}
    opt2 = torch.optim.SGD([{"params": [p], "lr": 2.0}, {"params": [q], "lr": 0.5}])
    c2 = RunLR(opt2, fn)
    c2.load_state_dict(c.state_dict())
    assert c2.get_last_lr() == [pytest.approx(1.0), pytest.approx(0.25)] and c2.step_count == 5
    c2.step()
    assert c2.get_last_lr() == [pytest.approx(1.2), pytest.approx(0.3)]


@pytest.mark.parametrize(
    "overrides", [[], ["schedule.type=cosine", "schedule.decay_stage=null", "schedule.min_lr_ratio=0.1"]]
)
def test_lr_array_is_lr_lambda_at_every_step(overrides):
    """The vectorised schedule (forecasts over a million steps) is the trainer's own, step for step."""
    import numpy as np

    from pretrainer.recipe.schedules import lr_array, lr_lambda

    recipe = load_recipe("recipes/tiny.yaml", overrides)
    fn = lr_lambda(recipe)
    np.testing.assert_array_equal(lr_array(recipe), [fn(i) for i in range(recipe.plan.total_steps)])


def test_a_branch_decay_decays_or_is_refused():
    """A branch off a constant-LR recipe (min_lr_ratio 1) would hold the LR: refused, the field named. With a floor
    the branch's LR falls over exactly its decay steps."""
    const = load_recipe("tests/fixtures/micro.yaml", ["schedule.min_lr_ratio=1.0", "stages.0.steps=600"])
    with pytest.raises(RecipeError, match="min_lr_ratio is 1"):
        branch_decay_recipe(const, 450, 30)
    floor = load_recipe("tests/fixtures/micro.yaml", ["schedule.min_lr_ratio=0", "stages.0.steps=600"])
    lr = lr_array(branch_decay_recipe(floor, 450, 30))
    assert len(lr) == 480 and lr[449] == 1.0 and lr[-1] < 0.1 and (lr[451:] < 1.0).all()
