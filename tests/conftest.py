import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
sys.path.insert(0, str(ROOT / "scripts"))

# No network and no tracker side effects in tests.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("DS_ACCELERATOR", "cpu")


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """One data/tokenizer cache for the whole session: the first test pays for tokenization."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, cache_dir):
    """The tiny recipe as `make run` trains it (its lm-eval tasks are local: `eval_tasks/`, read from the repository
    root like `make run` does): one training for the session's slow tests that read a finished tiny run. A test that
    writes into a run works on a copy."""
    import run_recipe

    out, cwd = tmp_path_factory.mktemp("tiny") / "run", os.getcwd()
    os.chdir(ROOT)
    try:
        assert (
            run_recipe.main(
                [
                    "recipes/tiny.yaml",
                    "--output-dir",
                    str(out),
                    "--set",
                    f"data.cache_dir={cache_dir}",
                    "--set",
                    "logging.report_to=[]",
                ]
            )
            == 0
        )
    finally:
        os.chdir(cwd)
    return out


@pytest.fixture
def micro_recipe() -> Path:
    return FIXTURES / "micro.yaml"


def tiny_llama(layers: int = 2, hidden: int = 32, kv_heads: int = 2, tie: bool = True, seed: int = 0, **config):
    """A small random Llama (vocab 64, 4 heads, MLP 2x hidden) for unit tests; `config` overrides LlamaConfig."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = dict(vocab_size=64, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers)
    cfg.update(num_attention_heads=4, num_key_value_heads=kv_heads, tie_word_embeddings=tie, **config)
    return LlamaForCausalLM(LlamaConfig(**cfg))


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def step_losses(out: Path) -> dict[int, float]:
    """Per-step training losses of a run; a step logged again after a resume or rollback replaces the earlier one."""
    from pretrainer.observe.tracking import read_jsonl

    losses = {}
    for m in read_jsonl(Path(out) / "metrics.jsonl"):
        for s, v in m.get("step_losses", []):
            losses[s] = v
    return losses


def run_micro(out: Path, cache_dir: Path, *sets: str, args=(), processes: int = 1, env: dict | None = None):
    """`scripts/run_recipe.py` on the micro recipe in a subprocess (`processes` > 1: DDP through torchrun), with
    `--set` for each of `sets` and then `args`. Returns the completed process."""
    import subprocess

    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes)]
    cmd = [sys.executable, *(launcher if processes > 1 else []), "scripts/run_recipe.py", "tests/fixtures/micro.yaml"]
    cmd += ["--output-dir", str(out), "--set", f"data.cache_dir={cache_dir}"]
    for s in sets:
        cmd += ["--set", s]
    cmd += list(args)
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
