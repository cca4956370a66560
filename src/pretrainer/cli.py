"""Shared behaviour of the scripts: bad input is one clear line and exit code 2, unless --debug."""

from __future__ import annotations

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
