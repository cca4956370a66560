"""The recipe reference, generated from the schema: every section's docstring and every field's type, default and
docstring. docs/RECIPE_REFERENCE.md is this text (`python scripts/recipe_reference.py` writes it; a test compares),
so the reference cannot drift from the code and a field without documentation fails a test."""

from __future__ import annotations

import typing
from collections.abc import Iterator

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from .schema import Recipe


def _sections(annotation) -> list[type[BaseModel]]:
    """The section classes inside a field's type (`X`, `X | None`, `list[X]`, `dict[str, X]`)."""
    out, todo = [], [annotation]
    while todo:
        t = todo.pop()
        if isinstance(t, type) and issubclass(t, BaseModel):
            out.append(t)
        else:
            todo += list(typing.get_args(t))
    return out


def _type(annotation) -> str:
    text = getattr(annotation, "__name__", None) if not typing.get_args(annotation) else None
    text = text or str(annotation).replace("typing.", "")
    for cls in _sections(annotation):
        text = text.replace(f"{cls.__module__}.{cls.__qualname__}", "section").replace(cls.__name__, "section")
    return text.replace("NoneType", "None")


def _default(f: FieldInfo) -> str:
    if f.default is PydanticUndefined and f.default_factory is None:
        return "required"
    value = f.default_factory() if f.default_factory is not None else f.default
    if isinstance(value, BaseModel):
        return "(section defaults)"
    return f"`{value!r}`" if value is not None else "`None`"


def doc_of(f: FieldInfo) -> str:
    """A field's documentation: its docstring, else the docstring of the section it holds."""
    if f.description:
        return " ".join(f.description.split())
    for cls in _sections(f.annotation):
        if cls.__doc__ and cls.__doc__ != BaseModel.__doc__:
            return " ".join(cls.__doc__.split())
    return ""


def fields(model: type[BaseModel] = Recipe, prefix: str = "") -> Iterator[tuple[str, FieldInfo, type[BaseModel]]]:
    """(dotted key, field, owning section) for every field of the recipe, depth first."""
    for name, f in model.model_fields.items():
        key = prefix + (f.alias or name)
        yield key, f, model
        for cls in _sections(f.annotation):
            yield from fields(cls, key + ".")


def reference_markdown() -> str:
    lines = [
        "# Recipe reference",
        "",
        "Generated from the schema (`src/pretrainer/recipe/`) by `python scripts/recipe_reference.py`; a test keeps it",
        "equal to the code. Keys are dotted paths (`stages.rope.theta` is a key of each entry of `stages`).",
        "",
    ]
    for name, f in Recipe.model_fields.items():
        key = f.alias or name
        lines += [f"## `{key}`", "", doc_of(f), "", "| key | type | default | meaning |", "|---|---|---|---|"]
        for sub in _sections(f.annotation):
            lines += [_row(k, g) for k, g, _ in fields(sub, key + ".")]
        lines.append("")
    return "\n".join(lines)


def _row(key: str, f: FieldInfo) -> str:
    cells = [f"`{key}`", _type(f.annotation), _default(f), doc_of(f)]
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"
