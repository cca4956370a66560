"""Library messages that say nothing to our users and that we cannot fix at their source, quieted once per process.

Every script calls `quiet_library_noise()` before it imports a library (cli.run_main), and the trainer calls it
again (idempotent) for code that builds a Trainer directly. What is quieted, and why (docs/DASHBOARDS.md lists it):

- DeepSpeed's "Setting accelerator to CPU" notice: importing Accelerate imports DeepSpeed whenever it is installed,
  so every command (check_run, export, a plain single-process run) printed it, on stdout, before its own output.
  The device a run trains on is in its own start block.
- torch's FutureWarnings for `all_gather_into_tensor` / `reduce_scatter_tensor`, which DeepSpeed ZeRO-3 calls ~54
  times per rank per step: each shown once per process, not once per call (a ZeRO-3 week would write gigabytes).
- Accelerate's "Removed shared tensor" warning at every save of a model with tied embeddings (stored once by design).
"""

from __future__ import annotations

import logging
import re
import warnings

_DEPRECATED_COLLECTIVES = r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"
_done = False


class _Drop(logging.Filter):
    """Drops log records whose message contains one of `phrases`."""

    def __init__(self, *phrases: str):
        super().__init__()
        self.phrases = phrases

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        return not any(p in msg for p in self.phrases)


def quiet_library_noise() -> None:
    """Install the filters (once per process; later calls do nothing). Must run before DeepSpeed is imported:
    its logger keeps the filter that is on it when the import configures it."""
    global _done
    if _done:
        return
    _done = True
    logging.getLogger("DeepSpeed").addFilter(_Drop("Setting accelerator to CPU"))
    logging.getLogger("accelerate.utils.other").addFilter(_Drop("Removed shared tensor"))
    warnings.showwarning = _once_per_text(warnings.showwarning)


def _once_per_text(show):
    """`showwarning` that shows a known repeated warning only the first time its text comes. A "once" filter is
    not enough: inside DeepSpeed's step something enters `warnings.catch_warnings()`, and every filter change clears
    the registries ("once"'s too, in CPython's C implementation), so the warning came back at every call."""
    seen: set[str] = set()

    def showwarning(message, category, filename, lineno, file=None, line=None):
        text = str(message)
        if re.match(_DEPRECATED_COLLECTIVES, text):
            if text in seen:
                return
            seen.add(text)
        show(message, category, filename, lineno, file, line)

    return showwarning
