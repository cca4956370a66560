"""`accelerate launch` with the ranks' exit codes: a job script that requeues on 75 (preempted, checkpoint saved)
sees 75, not the 1 that torch elastic reports for any rank that exited non-zero.

The launcher runs `accelerate launch` in a process of its own (`accelerate_launch`), which leaves out accelerate's
and torch elastic's tracebacks for a rank's non-zero exit (the rank printed its one line). Each rank of
`run_recipe.py` writes its exit code to `$PRETRAINER_EXIT_DIR/rank_<RANK>` (`record_exit`); the
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

from ..noise import quiet_preempted_ranks

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


def launch_problem(args: list[str]) -> str | None:
    """What is missing among the files `accelerate launch ARGS` would read (its `--config_file`, the training script),
    in one line; None when they are there. Checked before anything starts: accelerate would fail with a traceback."""
    for i, a in enumerate(args):
        if a == "--config_file" or a.startswith("--config_file="):
            path = a.partition("=")[2] if "=" in a else (args[i + 1] if i + 1 < len(args) else "")
            if not Path(path).is_file():
                return f"--config_file {path}: no such file (an accelerate config: accelerate_configs/*.yaml)"
    script = next((a for a in args if a.endswith(".py") and not a.startswith("-")), None)
    if script is not None and not Path(script).is_file():
        return f"{script}: no such script (run from the repository root)"
    return None


def launch(args: list[str]) -> int:
    """Run `accelerate launch ARGS`, forward SIGTERM/SIGINT to the ranks, return the combined exit code; 2 with one
    line when a file it needs is missing."""
    if (problem := launch_problem(args)) is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="pretrainer-exit-") as exits:
        env = {**os.environ, EXIT_DIR: exits}
        proc = subprocess.Popen([sys.executable, "-m", "pretrainer.train.launcher", *args], env=env)

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


def accelerate_launch(argv: list[str]) -> int:
    """`accelerate launch ARGV` in this process, without its own failure report: a rank that exits non-zero already
    said why in one line (a preemption: `preempted at step N ...`), and the wrapper returns the ranks' exit code;
    accelerate's `CalledProcessError` traceback (one process, DeepSpeed) or torch elastic's `ChildFailedError`
    (several) would only repeat it as a traceback. Run by `launch` as `python -m pretrainer.train.launcher`."""
    from accelerate.commands.launch import launch_command, launch_command_parser

    quiet_preempted_ranks()

    # A signal to the whole process group (Slurm, `timeout`, Ctrl-C) reaches the ranks, which save and exit 75:
    # this process waits for them instead of dying first (a handler, not SIG_IGN, which the ranks would inherit).
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, lambda signum, frame: None)
    args = launch_command_parser().parse_args(argv)
    # torch elastic's agent (several processes) would catch them itself, raise, and kill the ranks 30 s after
    # forwarding: torchrun's `--signals-to-handle` (default SIGTERM,SIGINT,SIGHUP,SIGQUIT) leaves them to the ranks;
    # accelerate passes every argument whose name torchrun knows on to it.
    args.signals_to_handle = "SIGHUP,SIGQUIT"
    try:
        launch_command(args)
    except subprocess.CalledProcessError as e:
        return e.returncode
    except Exception as e:
        if type(e).__name__ != "ChildFailedError":  # torch.distributed.elastic's, without importing it here
            raise
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(accelerate_launch(sys.argv[1:]))
