"""`accelerate launch` with the ranks' exit codes: a job script that requeues on 75 (preempted, checkpoint saved)
sees 75, not the 1 that torch elastic reports for any rank that exited non-zero.

Each rank of `run_recipe.py` writes its exit code to `$PRETRAINER_EXIT_DIR/rank_<RANK>` (`record_exit`); the
launcher's own code stands only when no rank said anything (a rank killed outright, a launcher error). A SIGTERM or
SIGINT sent to this wrapper goes to the ranks themselves, not to `accelerate launch`: the elastic agent would
SIGKILL them 30 seconds after forwarding a signal, which a large checkpoint may not survive, while the ranks,
signalled directly, save and exit 75 and the agent then ends on its own.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil

EXIT_DIR = "PRETRAINER_EXIT_DIR"


def record_exit(code: int) -> None:
    """In a rank: leave its exit code for the wrapper (nothing without one)."""
    if directory := os.environ.get(EXIT_DIR):
        rank = os.environ.get("RANK", "0")
        Path(directory, f"rank_{rank}").write_text(str(code))


def combined(launcher_rc: int, codes: list[int]) -> int:
    """The job's exit code from the ranks' own: 0 if the launcher succeeded; else the ranks' code when they agree, or
    75 when every rank that failed was preempted, or the first failing rank's other code; the launcher's code when no
    rank recorded one."""
    if launcher_rc == 0:
        return 0
    failed = [c for c in codes if c != 0]
    if not failed:
        return launcher_rc
    if all(c == failed[0] for c in failed):
        return failed[0]
    others = [c for c in failed if c != 75]
    return others[0] if others else 75


def launch(args: list[str]) -> int:
    """Run `accelerate launch ARGS`, forward SIGTERM/SIGINT to the ranks, return the combined exit code."""
    with tempfile.TemporaryDirectory(prefix="pretrainer-exit-") as exits:
        env = {**os.environ, EXIT_DIR: exits}
        proc = subprocess.Popen([sys.executable, "-m", "accelerate.commands.launch", *args], env=env)

        def forward(signum, frame) -> None:
            try:
                ranks = psutil.Process(proc.pid).children()  # the elastic agent runs in the launcher: its children
            except psutil.NoSuchProcess:
                return
            for p in ranks or [psutil.Process(proc.pid)]:  # before the ranks exist: the launcher itself
                try:
                    p.send_signal(signum)
                except psutil.NoSuchProcess:
                    pass

        previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            rc = proc.wait()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        codes = [int(f.read_text()) for f in sorted(Path(exits).glob("rank_*")) if f.read_text().strip()]
    return combined(rc, codes)
