"""Load a recipe: YAML (safe loader) -> `inherit:` chain -> `--set` overrides -> typed, strict validation.

Precedence: `--set a.b=c` > child recipe > inherited base. Dicts merge key by key; lists and scalars are replaced
whole. Every leaf remembers which file (or `--set`) gave it, so a validation error names the file and the field:

    recipes/x.yaml: schedule.warmup_steps: Input should be greater than or equal to 0
"""

from __future__ import annotations

import copy
import difflib
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from ..errors import RecipeError, first_line
from ..model.build import check_model_config
from .schema import Recipe

CLI = "--set"


MAX_DEPTH = 32
"""Nesting deeper than this is not a recipe (and would exhaust the stack further on)."""
MAX_VALUES = 100_000
"""Values after YAML aliases are expanded; a few aliases can otherwise stand for billions of values."""
SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
"""libyaml's parser under the same safe constructor: ~95% of loading a big recipe was pure-Python scanning."""


def _yaml_problem(e: yaml.YAMLError) -> str:
    mark = getattr(e, "problem_mark", None)
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
    return f"invalid YAML{where}: {getattr(e, 'problem', None) or first_line(e)}"


def check_size(data: Any, where: str) -> None:
    """Bounded depth and size, counted with aliases expanded, in time bounded by MAX_VALUES (never the expansion)."""
    count, stack = 0, [(data, 0, "")]
    while stack:
        node, depth, path = stack.pop()
        count += 1
        if count > MAX_VALUES:
            raise RecipeError(f"{where}: more than {MAX_VALUES:,} values (YAML aliases expanded): not a recipe")
        if depth > MAX_DEPTH:
            raise RecipeError(f"{where}: {path.lstrip('.') or '(top level)'}: nested deeper than {MAX_DEPTH} levels")
        if isinstance(node, dict):
            stack.extend((v, depth + 1, f"{path}.{k}") for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((v, depth + 1, f"{path}.{i}") for i, v in enumerate(node))


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RecipeError(f"{path}: file not found") from None
    except UnicodeDecodeError as e:
        raise RecipeError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise RecipeError(f"{path}: cannot read: {e.strerror}") from None
    try:
        data = yaml.load(text, Loader=SAFE_LOADER)
    except yaml.YAMLError as e:
        raise RecipeError(f"{path}: {_yaml_problem(e)}") from None
    except RecursionError:
        raise RecipeError(f"{path}: nested deeper than {MAX_DEPTH} levels") from None
    check_size(data, str(path))
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data


def _leaf_paths(value: Any, prefix: tuple) -> list[tuple]:
    if isinstance(value, dict) and value:
        out = []
        for k, v in value.items():
            out.extend(_leaf_paths(v, prefix + (k,)))
        return out
    return [prefix]


def _merge(base: dict, over: dict, origin: str, prov: dict[tuple, str], prefix: tuple = ()) -> dict:
    """Merge `over` into a copy of `base`; record the origin of every leaf that `over` sets."""
    out = dict(base)
    for k, v in over.items():
        path = prefix + (k,)
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v, origin, prov, path)
        else:
            # A replaced subtree forgets where its old leaves came from (linear in its size, not in the recipe's).
            if k in out:
                for p in _leaf_paths(out[k], path):
                    prov.pop(p, None)
            out[k] = copy.deepcopy(v)
            for p in _leaf_paths(v, path):
                prov[p] = origin
    return out


def _load_chain(path: Path, prov: dict[tuple, str], stack: tuple[Path, ...] = ()) -> dict:
    path = Path(os.path.normpath(path))
    key = path.resolve()
    if key in [p.resolve() for p in stack]:
        chain = " -> ".join(str(p) for p in stack + (path,))
        raise RecipeError(f"{path}: inherit: cycle in the inheritance chain: {chain}")
    data = _read_yaml(path)
    parent = data.pop("inherit", None)
    merged: dict = {}
    if parent is not None:
        if not isinstance(parent, str):
            raise RecipeError(f"{path}: inherit: must be a relative path string, got {parent!r}")
        parent_path = path.parent / parent
        if not parent_path.exists():
            raise RecipeError(f"{path}: inherit: {parent_path} does not exist")
        merged = _load_chain(parent_path, prov, stack + (path,))
    return _merge(merged, data, str(path), prov)


def parse_override(item: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (["a", "b", "c"], value parsed as YAML)."""
    if "=" not in item:
        raise RecipeError(f"{CLI} {item}: expected KEY=VALUE, for example schedule.warmup_steps=100")
    key, raw = item.split("=", 1)
    if not key or any(not part for part in key.split(".")):
        raise RecipeError(f"{CLI} {item}: empty key")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError as e:
        raise RecipeError(f"{CLI} {item}: the value is {_yaml_problem(e)}") from None
    except RecursionError:
        raise RecipeError(f"{CLI} {item}: nested deeper than {MAX_DEPTH} levels") from None
    check_size(value, f"{CLI} {item}")
    return key.split("."), value


def _apply_override(data: dict, keys: list[str], value: Any, item: str, prov: dict[tuple, str]) -> None:
    node: Any = data
    path: tuple = ()
    for i, k in enumerate(keys):
        last = i == len(keys) - 1
        if isinstance(node, list):
            if not re.fullmatch(r"\d+", k) or int(k) >= len(node):
                raise RecipeError(f"{CLI} {item}: {'.'.join(keys[: i + 1])}: no list element {k} (length {len(node)})")
            k = int(k)
        elif not isinstance(node, dict):
            raise RecipeError(f"{CLI} {item}: {'.'.join(keys[:i])} is not a section")
        path = path + (k,)
        if last:
            if isinstance(node, list) or k in node:
                for p in _leaf_paths(node[k], path):
                    prov.pop(p, None)
            node[k] = value
            for p in _leaf_paths(value, path):
                prov[p] = f"{CLI} {item}"
        else:
            if isinstance(node, dict) and k not in node:
                node[k] = {}
            node = node[k]


def _origin(prov: dict[tuple, str], loc: tuple, default: str) -> str:
    """The file that set the deepest known prefix of `loc` (only on errors: a scan is fine)."""
    for n in range(len(loc), 0, -1):
        hits = [o for p, o in prov.items() if p[:n] == loc[:n]]
        if hits:
            return hits[-1]
    return default


def _model_at(loc: tuple) -> type[BaseModel] | None:
    """The pydantic class that owns the field at `loc` (for did-you-mean suggestions)."""
    model: Any = Recipe
    for part in loc:
        if isinstance(part, int) or not (isinstance(model, type) and issubclass(model, BaseModel)):
            continue
        field = model.model_fields.get(part)
        if field is None:
            return None
        ann = field.annotation
        # Unwrap Optional[...] / list[...] / dict[str, ...] down to a model class.
        while get_origin(ann) is not None:
            args = [a for a in get_args(ann) if a is not type(None)]
            ann = args[-1] if args else None
        model = ann
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _format_errors(err: ValidationError, prov: dict[tuple, str], main_file: str) -> str:
    lines = []
    for e in err.errors():
        loc = tuple(e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if not loc:
            # Cross-section checks put the field path at the start of the message.
            m = re.match(r"([\w.]+): ", msg)
            if m:
                loc = tuple(int(p) if p.isdigit() else p for p in m.group(1).split("."))
                msg = msg[m.end() :]
        field = ".".join(str(p) for p in loc) or "(top level)"
        if e["type"] == "extra_forbidden":
            parent = _model_at(loc[:-1]) if len(loc) > 1 else Recipe
            known = list(parent.model_fields) if parent else []
            close = difflib.get_close_matches(str(loc[-1]), known, n=1)
            msg = f"unknown key{f'; did you mean {close[0]!r}?' if close else ''} (known: {', '.join(known)})"
        elif e["type"] == "missing":
            msg = "required field is missing"
        origin = _origin(prov, loc, main_file)
        lines.append(f"{origin}: {field}: {msg}")
    return "\n".join(lines)


def load_recipe(path: str | Path, overrides: list[str] | None = None, check_model: bool = True) -> Recipe:
    """Load, merge and validate a recipe.

    Args:
        path: the recipe YAML file.
        overrides: `a.b=c` strings; values are parsed as YAML (`stages='[...]'` works).
        check_model: build `model.config` on the meta device through transformers (seconds of imports). Off only
            for a run's own `recipe.resolved.yaml`, whose model was built when the run started.

    Returns:
        The validated `Recipe`.

    Raises:
        RecipeError: with one line per problem, each naming the file (or `--set`) and the field.
    """
    path = Path(path)
    prov: dict[tuple, str] = {}
    data = _load_chain(path, prov)
    for item in overrides or []:
        keys, value = parse_override(item)
        _apply_override(data, keys, value, item, prov)
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as e:
        raise RecipeError(_format_errors(e, prov, str(path))) from None
    if not check_model:
        return recipe
    try:  # the free-form model.config, as transformers reads it (meta device: no memory, no download)
        vocab = recipe.tokenizer.train.vocab_size if recipe.tokenizer.train else None
        check_model_config(recipe.model, vocab, max(s.seq_len for s in recipe.stages))
    except RecipeError as e:
        field = re.search(r"[Ff]ield '(\w+)'", str(e))
        loc = ("model", "config", field.group(1)) if field else ("model", "config")
        msg = str(e).removeprefix("model.config: ")
        raise RecipeError(f"{_origin(prov, loc, str(path))}: {'.'.join(loc)}: {msg}") from None
    return recipe


def validate_derived(data: dict[str, Any], origin: str) -> Recipe:
    """A recipe a tool built (a branch, a resume's continued plan) validated like a file's: a problem is one line
    per field, named after `origin` (the flag or checkpoint the tool built it from), never a traceback.

    Raises:
        RecipeError: `origin: field: problem` lines."""
    try:
        return Recipe.model_validate(data)
    except ValidationError as e:
        raise RecipeError(_format_errors(e, {}, origin)) from None


def recipe_dict(recipe: Recipe) -> dict[str, Any]:
    """The resolved recipe as plain data (what is written to recipe.resolved.yaml and the tracker config)."""
    return recipe.model_dump(mode="json")


def dump_recipe(recipe: Recipe, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(recipe_dict(recipe), sort_keys=False))


def recipe_hash(recipe: Recipe) -> str:
    return hashlib.sha256(json.dumps(recipe_dict(recipe), sort_keys=True).encode()).hexdigest()[:16]


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; for tracker configs, which want flat keys."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v if isinstance(v, int | float | str | bool) or v is None else json.dumps(v)
    return out


# Settings that do not change what is trained: free to change on resume.
BENIGN_ON_RESUME = ("checkpoint.", "logging.", "eval.", "run.name", "run.output_dir", "data.cache_dir")


def training_diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Differences between two resolved recipes that change the training itself (cadence of checkpoints, logs and
    evals excluded), one `key: old -> new` line each."""
    a, b = flatten(old), flatten(new)
    keys = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k) and not k.startswith(BENIGN_ON_RESUME)]
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in keys]
