"""Kill points for tests and drills: `PRETRAINER_KILL_AT` SIGKILLs the process at a named point. A leaf module (no
torch, nothing of the package), so datatrove's preparation workers can call it too. The recipe's own injections
(`debug.inject`) are wrappers in train/inject.py, installed only when asked for."""

from __future__ import annotations

import os
import signal

KILL_ENV = "PRETRAINER_KILL_AT"
_KILL_SEEN: dict[str, int] = {}


def kill_point(where: str) -> None:
    """PRETRAINER_KILL_AT=after_state SIGKILLs the process mid-save; `step:29` after step 29; `step:29#2` the second
    time step 29 completes (in a replay after a rollback)."""
    want = os.environ.get(KILL_ENV)
    if not want:
        return
    point, _, nth = want.partition("#")
    if point == where:
        _KILL_SEEN[where] = _KILL_SEEN.get(where, 0) + 1
        if _KILL_SEEN[where] >= int(nth or 1):
            os.kill(os.getpid(), signal.SIGKILL)
