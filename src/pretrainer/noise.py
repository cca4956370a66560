"""Library messages that say nothing to our users and that we cannot fix at their source, quieted once per process.

Every script calls `quiet_library_noise()` before it imports a library (cli.run_main), and the trainer calls it
again (idempotent) for code that builds a Trainer directly. What is quieted, and why (docs/DASHBOARDS.md lists it):

- DeepSpeed's "Setting accelerator to CPU" notice: importing Accelerate imports DeepSpeed whenever it is installed,
  so every command (check_run, export, a plain single-process run) printed it, on stdout, before its own output.
  The device a run trains on is in its own start block.
- torch's FutureWarnings for `all_gather_into_tensor` / `reduce_scatter_tensor`, which DeepSpeed ZeRO-3 calls ~54
  times per rank per step: each shown once per process, not once per call (a ZeRO-3 week would write gigabytes).
- Accelerate's "Removed shared tensor" warning at every save of a model with tied embeddings (stored once by design).
- Outside a terminal (`quiet_bars_in_files`), the libraries' progress bars: they write carriage returns into a log.
- In the launcher (`quiet_preempted_ranks`), torch elastic's `failed (exitcode: 75)` for ranks that saved and exited
  on a preemption, as they are asked to.
"""

from __future__ import annotations

import logging
import re
import sys
import warnings

_DEPRECATED_COLLECTIVES = r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"
_done = False


class _Drop(logging.Filter):
    """Drops log records whose message contains one of `phrases`."""

    def __init__(self, *phrases: str):
        super().__init__()
        self.phrases = phrases

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            msg = record.getMessage()
        except (TypeError, ValueError):  # arguments that do not fit the message: judge the template
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


def quiet_preempted_ranks() -> None:
    """In the launcher process: torch elastic logs `failed (exitcode: 75)` for ranks that were preempted and saved,
    as if they had crashed; each rank already said `preempted at step N: checkpoint saved`. Other exit codes stay."""
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_Drop("(exitcode: 75)"))


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


def quiet_bars_in_files() -> None:
    """When stdout or stderr is not a terminal (a Slurm log, `make run > log.txt`, `2> err.txt`), the progress bars
    of the libraries we call (loading weights, preparing data, saving shards) are off: in a file they are lines of
    carriage returns. Called before the work that would draw them."""
    if isatty(sys.stdout) and isatty(sys.stderr):
        return
    import datasets
    import huggingface_hub
    import transformers

    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()
    huggingface_hub.utils.disable_progress_bars()


def isatty(stream) -> bool:
    """A stream that is a terminal (False for a closed or fd-less one: a test's capture)."""
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
