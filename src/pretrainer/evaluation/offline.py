"""Evaluate a model outside training: an HF model directory (ours or any other project's) or one of our checkpoints.

Loss by position reads held-out long documents: a recipe's validation documents (the run's own, by default), or
text files; they are tokenized with the model's own tokenizer, so another project's model is measured on the same
text. Downstream tasks run through the same `lm_eval_scores` as the training loop, so a checkpoint scores the same
offline as it did in the loop.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ..checkpoint.export import export_checkpoint
from ..data.pipeline import split_texts
from ..errors import PretrainerError
from ..recipe.loading import load_recipe
from .context import context_verdict, position_buckets, position_table, round_robin
from .validation import context_sources


@contextlib.contextmanager
def loaded_model(path: str | Path, device: str = "cpu", dtype: str = "float32") -> Iterator[tuple]:
    """(model, tokenizer, model directory) of an HF model directory, or of a checkpoint (exported to a temporary
    directory first). Local directories only."""
    path = Path(path)
    with contextlib.ExitStack() as stack:
        if (path / "meta.json").exists():  # one of our checkpoints
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="eval-export-")))
            path = export_checkpoint(path, tmp / "model", dtype=dtype)
        if problem := model_dir_problem(path):
            raise PretrainerError(f"{path}: {problem}")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device)
        tokenizer = AutoTokenizer.from_pretrained(path)
        yield model, tokenizer, path


WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def model_dir_problem(path: Path) -> str | None:
    """Why `path` is not a Hugging Face model directory (None when it is): one line instead of transformers'
    traceback from deep inside `from_pretrained`."""
    if not (path / "config.json").is_file():
        return "no config.json: not a model directory (a run's final/ or merged/, an export, or a checkpoint)"
    if not any((path / w).is_file() for w in WEIGHTS):
        return f"config.json but no weights ({', '.join(WEIGHTS[::2])}): an unfinished export?"
    return None


def run_recipe_of(model_dir: Path) -> Path | None:
    """The resolved recipe of the run a `final/` or `checkpoints/step_N/` directory belongs to, if any."""
    for up in (model_dir.parent, model_dir.parent.parent):
        if (up / "recipe.resolved.yaml").exists():
            return up / "recipe.resolved.yaml"
    return None


def recipe_texts(recipe_path: str | Path) -> dict[str, Iterable[str]]:
    """The held-out documents of the recipe's context sources (as the training loop chooses them), streamed."""
    recipe = load_recipe(recipe_path)
    return {n: split_texts(recipe, n, validation=True) for n in context_sources(recipe)}


def file_texts(paths: list[str]) -> dict[str, Iterable[str]]:
    """Each file a document (a directory: its files, sorted), one source."""
    files = [
        f for p in map(Path, paths) for f in (sorted(x for x in p.rglob("*") if x.is_file()) if p.is_dir() else [p])
    ]
    return {"files": (f.read_text(errors="replace") for f in files)}


def text_rows(tokenizer, texts: dict[str, Iterable[str]], window: int, max_docs: int) -> list[np.ndarray]:
    """The first `window` tokens (tokenized as `prepare_data.py` does: no special tokens, EOS appended) of documents
    at least that long, per source in order, round-robin over sources: the training loop's `long_rows`."""
    per_source = []
    for docs in texts.values():
        found = []
        for text in docs:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            if len(ids) >= window:
                found.append(np.asarray(ids[:window], dtype=np.int64))
                if len(found) == max_docs:
                    break
        per_source.append(found)
    return round_robin(per_source, max_docs)


def context_report(
    model,
    tokenizer,
    texts: dict[str, Iterable[str]],
    max_docs: int = 16,
    first_bucket: int = 256,
    window: int | None = None,
) -> dict:
    """Loss by position up to `window` (default: the model's `max_position_embeddings`) and the context verdict."""
    window = window or int(model.config.max_position_embeddings)
    rows = text_rows(tokenizer, texts, window, max_docs)
    if not rows:
        raise PretrainerError(f"no document of {window:,} tokens or more to measure loss by position on")
    model.eval()
    table = position_table(model, rows, position_buckets(window, first_bucket), model.device)
    return {"window": window, "docs": len(rows), "buckets": table, **context_verdict(table, window)}
