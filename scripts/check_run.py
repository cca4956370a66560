"""Health report of a run directory (live or finished): verdict, stages, train/val gap, incidents, throughput,
latest verified checkpoint, gradient noise scale, and a picture.

    python scripts/check_run.py runs/tiny --plot report.png
    python scripts/check_run.py runs/tiny --json
    python scripts/check_run.py runs/tiny --target 5.3      # will the final val/ref reach 5.3?
"""

from __future__ import annotations

import argparse

from pretrainer.cli import emit_json, output_file, run_main, script_parser


def parse_args(argv=None) -> argparse.Namespace:
    p = script_parser(__doc__, recipe=False)
    p.add_argument("output_dir")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--plot", metavar="PNG", help="loss / LR / grad norm / tokens-per-second picture")
    p.add_argument(
        "--verify",
        choices=["fast", "deep"],
        default="deep",
        help="latest checkpoint: deep (default) also reads every tensor back for NaN/Inf; fast: hashes",
    )
    p.add_argument("--target", type=float, help="will the final val/ref reach this? (the forecast's answer)")
    p.add_argument("--stall-minutes", type=float, default=30.0, help="no metrics for this long means stalled")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)

    def run() -> int:
        from pathlib import Path

        from pretrainer.analysis.outlook import forecast_report, merged_report
        from pretrainer.analysis.report import format_report, report
        from pretrainer.analysis.runfiles import load_run
        from pretrainer.errors import PretrainerError

        output_file(args.plot, "--plot")
        if not args.stall_minutes > 0:  # NaN too; inf: never stalled
            raise PretrainerError(f"--stall-minutes: a positive number of minutes, not {args.stall_minutes}")
        if args.target is not None and not 0 < args.target < float("inf"):
            raise PretrainerError(f"--target: a positive finite loss, not {args.target}")
        if not Path(args.output_dir).is_dir():
            raise PretrainerError(f"{args.output_dir}: not a run directory")
        run_data = load_run(args.output_dir)  # read once: a long run's metrics are ~100 MB of JSON
        r = report(args.output_dir, args.stall_minutes, deep=args.verify == "deep", run=run_data)
        # the per-step data is the report's alone: a 10M-step run's ~300 MB, freed before the forecast's LR arrays
        run_data = run_data.without_steps()
        if (fc := forecast_report(args.output_dir, args.target, run=run_data)) is not None:
            r["forecast"] = fc
        if (mr := merged_report(args.output_dir, run=run_data)) is not None:
            r["merged"] = mr
        if args.plot:
            from pretrainer.analysis.plots import plot_run

            r["plot"] = str(plot_run(args.output_dir, args.plot, report=r))
        text = format_report(r) + "".join(f"\nforecast: {line}" for line in r.get("forecast", {}).get("lines", []))
        text += f"\naveraging: {mr['line']}" if mr is not None else ""
        text += f"\nplot: {r['plot']}" if args.plot else ""
        emit_json(r) if args.json else print(text)
        return 0

    return run_main(run, debug=args.debug, json_out=args.json)


if __name__ == "__main__":
    raise SystemExit(main())
