"""Shared behaviour of the scripts: bad input is one clear line and exit code 2, unless --debug."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from .errors import PretrainerError


def run_main(fn: Callable[[], int], debug: bool = False) -> int:
    try:
        return fn()
    except PretrainerError as e:
        if debug:
            raise
        first, *rest = str(e).splitlines() or [""]
        print(f"error: {first}", file=sys.stderr)
        for line in rest:  # a list of differences, one per line
            print(line, file=sys.stderr)
        return e.exit_code


def script_parser(doc: str | None, recipe: bool | str = True) -> argparse.ArgumentParser:
    """The arguments every script shares: its docstring as help, `--debug`, and (unless `recipe=False`) the recipe
    with `--set` overrides. `recipe="path"` makes the recipe optional with that default."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if recipe:
        if isinstance(recipe, str):
            p.add_argument("recipe", nargs="?", default=recipe, help=f"recipe YAML file (default: {recipe})")
        else:
            p.add_argument("recipe", help="recipe YAML file")
        p.add_argument(
            "--set",
            dest="overrides",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override a recipe field, value parsed as YAML (repeatable)",
        )
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return p
