"""Shared behaviour of the scripts: bad input is one clear line and exit code 2, unless --debug."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from .errors import PretrainerError
from .noise import quiet_library_noise

_JSON_FD: int | None = None
"""With `--json`: the real standard output, kept for the one object `emit_json` writes."""


def emit_json(obj) -> None:
    """The script's JSON object, alone on standard output (whatever the libraries printed went to stderr)."""
    text = json.dumps(obj) + "\n"
    if _JSON_FD is None:
        sys.stdout.write(text)
        return
    sys.stdout.flush()
    os.write(_JSON_FD, text.encode())


def _stdout_is_fd1() -> bool:
    """False when stdout is not the process's (a test's capture): then there is nothing to redirect."""
    try:
        return sys.stdout.fileno() == 1
    except (AttributeError, OSError, ValueError):
        return False


def run_main(fn: Callable[[], int], debug: bool = False, json_out: bool = False) -> int:
    """Run a script's body: a PretrainerError is one `error:` line and its exit code. `json_out`: while the body
    runs, file descriptor 1 points at stderr, so what libraries print to stdout (DeepSpeed's accelerator notice,
    progress bars, loggers that captured `sys.stdout`) cannot come before the object; `emit_json` writes it to the
    real stdout."""
    global _JSON_FD
    quiet_library_noise()
    if json_out and _JSON_FD is None and _stdout_is_fd1():
        sys.stdout.flush()
        _JSON_FD = os.dup(1)
        os.dup2(2, 1)
        try:
            return run_main(fn, debug)
        finally:
            sys.stdout.flush()
            os.dup2(_JSON_FD, 1)
            os.close(_JSON_FD)
            _JSON_FD = None
    try:
        return fn()
    except PretrainerError as e:
        if debug:
            raise
        if e.every_rank or os.environ.get("RANK", "0") == "0":
            first, *rest = str(e).splitlines() or [""]
            print(f"{e.label}: {first}" if e.label else first, file=sys.stderr)
            for line in rest:  # a list of differences, one per line
                print(line, file=sys.stderr)
        return e.exit_code


def output_file(path: str | None, flag: str) -> None:
    """Check a file a script will write (`--plot PNG`) before any work: its directory exists, it is not a directory.

    Raises:
        PretrainerError: one line naming the flag."""
    if path is None:
        return
    p = Path(path)
    if not path or p.is_dir():
        raise PretrainerError(f"{flag} {path!r}: give a file name to write (e.g. report.png), not a directory")
    if not p.parent.is_dir():
        raise PretrainerError(f"{flag} {path}: the directory {p.parent} does not exist")


def script_parser(doc: str | None, recipe: bool | str = True) -> argparse.ArgumentParser:
    """The arguments every script shares: its docstring as help, `--debug`, and (unless `recipe=False`) the recipe
    with `--set` overrides. `recipe="path"` makes the recipe optional with that default."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if recipe:
        if isinstance(recipe, str):
            p.add_argument("recipe", nargs="?", default=recipe, help=f"recipe YAML file (default: {recipe})")
        else:
            p.add_argument("recipe", help="recipe YAML file")
        add_overrides(p)
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return p


def add_overrides(p: argparse.ArgumentParser, what: str = "a recipe field") -> None:
    """`--set KEY=VALUE` (repeatable) into `args.overrides`."""
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"override {what}, value parsed as YAML (repeatable)",
    )
