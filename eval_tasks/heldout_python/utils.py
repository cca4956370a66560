"""Loaders for the local tasks: the jsonl files next to this file, wherever lm-eval is run from."""

from pathlib import Path

import datasets

HERE = Path(__file__).resolve().parent


def _load(name: str) -> datasets.DatasetDict:
    return datasets.DatasetDict({"test": datasets.Dataset.from_json(str(HERE / name))})


def load_text(**kwargs) -> datasets.DatasetDict:
    return _load("text.jsonl")


def load_next_line(**kwargs) -> datasets.DatasetDict:
    return _load("next_line.jsonl")
