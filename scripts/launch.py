"""`accelerate launch` that exits with the ranks' code: 75 when they were preempted and saved (requeue), 2 for bad
input, 74 for a failed save; SIGTERM/SIGINT to this process reach the ranks directly.

    python scripts/launch.py --config_file accelerate_configs/zero1.yaml scripts/run_recipe.py recipes/1b_wsd.yaml
    # in a job script:  python scripts/launch.py ...; [ $? -eq 75 ] && scontrol requeue $SLURM_JOB_ID

Every argument goes to `accelerate launch` unchanged.
"""

from __future__ import annotations

import sys


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if args else 2
    from pretrainer.train.launcher import launch

    return launch(args)


if __name__ == "__main__":
    raise SystemExit(main())
