import pytest
import yaml
from conftest import write

from pretrainer.errors import RecipeError
from pretrainer.recipe.loading import dump_recipe, load_recipe

BASE = """
model:
  config: {model_type: llama, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1,
           num_attention_heads: 2, num_key_value_heads: 1, vocab_size: 300}
tokenizer: {train: {vocab_size: 300}}
data:
  sources:
    a: {type: files, include: ["*.txt"]}
    b: {type: files, include: ["*.txt"]}
batch: {micro_batch_size: 2, global_batch_tokens: 128}
optimizer: {lr: 1.0e-3}
schedule: {type: wsd, warmup_steps: 2}
stages:
  - {name: main, steps: 20, seq_len: 32, mixture: {a: 1.0}}
"""


def test_inherit_and_precedence(tmp_path):
    write(tmp_path / "base.yaml", BASE)
    write(tmp_path / "mid.yaml", "inherit: base.yaml\noptimizer: {lr: 2.0e-3}\nschedule: {warmup_steps: 5}\n")
    child = write(tmp_path / "sub/child.yaml", "inherit: ../mid.yaml\nschedule: {warmup_steps: 7}\n")
    r = load_recipe(child)
    assert r.optimizer.lr == 2e-3  # from mid
    assert r.schedule.warmup_steps == 7  # child beats mid
    assert r.schedule.type == "wsd"  # dicts merge key by key
    r = load_recipe(child, ["schedule.warmup_steps=9", "optimizer.betas=[0.9, 0.99]"])
    assert r.schedule.warmup_steps == 9  # --set beats the child
    assert r.optimizer.betas == (0.9, 0.99)


def test_set_parses_yaml_lists(tmp_path):
    p = write(tmp_path / "r.yaml", BASE)
    r = load_recipe(
        p,
        [
            "stages=[{name: x, steps: 10, seq_len: 32, mixture: {a: 1}}, {name: y, steps: 5, seq_len: 64, mixture: {b: 1}}]"
        ],
    )
    assert [s.name for s in r.stages] == ["x", "y"]
    r = load_recipe(p, ["stages.0.seq_len=64"])
    assert r.stages[0].seq_len == 64


def test_unknown_key_did_you_mean(tmp_path):
    p = write(tmp_path / "r.yaml", BASE.replace("warmup_steps: 2", "warmup_step: 2"))
    with pytest.raises(RecipeError) as e:
        load_recipe(p)
    msg = str(e.value)
    assert f"{p}: schedule.warmup_step: unknown key; did you mean 'warmup_steps'?" in msg


def test_type_error_names_file_and_field(tmp_path):
    base = write(tmp_path / "base.yaml", BASE)
    child = write(tmp_path / "child.yaml", "inherit: base.yaml\nrun: {seed: 1}\n")
    with pytest.raises(RecipeError) as e:
        load_recipe(child, ["schedule.warmup_steps=-1"])
    assert "--set schedule.warmup_steps=-1: schedule.warmup_steps: Input should be greater than or equal to 0" in str(
        e.value
    )
    write(tmp_path / "base.yaml", BASE.replace("lr: 1.0e-3", "lr: fast"))
    with pytest.raises(RecipeError) as e:
        load_recipe(child)
    # the bad value lives in the base: the error names the base file
    assert str(e.value).startswith(f"{base}: optimizer.lr:")


def test_inherit_cycle(tmp_path):
    write(tmp_path / "a.yaml", "inherit: b.yaml\n")
    write(tmp_path / "b.yaml", "inherit: a.yaml\n")
    with pytest.raises(RecipeError, match="cycle"):
        load_recipe(tmp_path / "a.yaml")


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(RecipeError, match="file not found"):
        load_recipe(tmp_path / "nope.yaml")
    p = write(tmp_path / "bad.yaml", "model: [unclosed\n")
    with pytest.raises(RecipeError, match=r"bad.yaml: invalid YAML \(line"):
        load_recipe(p)


def test_undefined_mixture_source_names_both(tmp_path):
    p = write(tmp_path / "r.yaml", BASE)
    with pytest.raises(RecipeError) as e:
        load_recipe(p, ["stages.0.mixture={nope: 1.0}"])
    assert "stages.0.mixture: source 'nope' of stage 'main' is not defined in data.sources" in str(e.value)


def test_yaml_no_means_no_mixed_precision(tmp_path):
    p = write(tmp_path / "r.yaml", BASE + "precision: {mixed: no}\n")
    assert load_recipe(p).precision.mixed == "no"


def test_batch_divisibility_and_warmup(tmp_path):
    p = write(tmp_path / "r.yaml", BASE)
    with pytest.raises(RecipeError, match="batch.global_batch_tokens"):
        load_recipe(p, ["batch.global_batch_tokens=100"])
    with pytest.raises(RecipeError, match="schedule.warmup_steps"):
        load_recipe(p, ["schedule.warmup_steps=19"])  # runs into the WSD decay


def test_dump_roundtrip(tmp_path):
    r = load_recipe(write(tmp_path / "r.yaml", BASE))
    dump_recipe(r, tmp_path / "out.yaml")
    again = load_recipe(tmp_path / "out.yaml")
    assert again == r
    assert yaml.safe_load((tmp_path / "out.yaml").read_text())["schedule"]["type"] == "wsd"


def test_shipped_recipes_load():
    for path in ["recipes/tiny.yaml", "recipes/1b_wsd.yaml", "recipes/1b_cosine.yaml"]:
        load_recipe(path)
    wsd, cos = load_recipe("recipes/1b_wsd.yaml"), load_recipe("recipes/1b_cosine.yaml")
    # 1b_cosine differs from 1b_wsd in the schedule (and the run name) only
    assert wsd.model_dump(exclude={"schedule", "run"}) == cos.model_dump(exclude={"schedule", "run"})
    assert cos.schedule.type == "cosine" and wsd.schedule.type == "wsd"
