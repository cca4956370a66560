"""Save a W&B workspace laid out for pretraining runs: loss and val/ref with the forecast band, the stages, LR, gradient
norm, incidents, per-layer statistics, throughput and MFU, every panel over `train/step` (docs/DASHBOARDS.md).

    python scripts/wandb_workspace.py runs/tiny --entity my-team                # saves it in the run's project
    python scripts/wandb_workspace.py runs/tiny --json                          # the layout, no network

The panels are chosen from the keys the run logged (its sources, its per-layer statistics); every run of the project
shows in it, grouped as the runs are (by recipe, job type, tags). Needs `pip install wandb-workspaces` and a W&B login.
"""

from __future__ import annotations

import argparse

from pretrainer.cli import emit_json, run_main, script_parser


def parse_args(argv=None) -> argparse.Namespace:
    p = script_parser(__doc__, recipe=False)
    p.add_argument("run_dir", help="a run directory: its metrics.jsonl says which panels the run can fill")
    p.add_argument("--entity", help="W&B entity (user or team) that owns the project")
    p.add_argument("--project", help="W&B project (default: the run's logging.project)")
    p.add_argument("--name", default="pretraining", help="the workspace's name (default: pretraining)")
    p.add_argument("--json", action="store_true", help="print the layout as JSON and save nothing")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)

    def run() -> int:
        from pathlib import Path

        from pretrainer.analysis.runfiles import resolved_recipe
        from pretrainer.errors import PretrainerError
        from pretrainer.observe.dashboard import workspace_spec
        from pretrainer.observe.tracking import iter_jsonl, tracked

        metrics = Path(args.run_dir) / "metrics.jsonl"
        if not metrics.is_file():
            raise PretrainerError(f"{metrics}: file not found (give a run directory)")
        keys: set[str] = set()
        for row in iter_jsonl(metrics):
            keys.update(tracked(row))
        if not keys - {"train/step", "train/tokens"}:
            raise PretrainerError(f"{metrics}: no metrics rows yet")
        spec = workspace_spec(keys)
        recipe, _ = resolved_recipe(Path(args.run_dir))
        project = args.project or ((recipe or {}).get("logging") or {}).get("project") or "pretrainer"
        if args.json:
            emit_json({"name": args.name, "project": project, "sections": spec})
            return 0
        if not args.entity:
            raise PretrainerError("--entity: the W&B user or team that owns the project (or --json to print)")
        url = save(spec, args.entity, project, args.name)
        print(f"workspace {args.name!r} saved: {url}")
        return 0

    return run_main(run, debug=args.debug, json_out=args.json)


def build(spec: list[dict], entity: str, project: str, name: str):
    """W&B's workspace object for `spec` (nothing sent): runs grouped by recipe, then job type."""
    from pretrainer.errors import PretrainerError

    try:
        import wandb_workspaces.reports.v2 as wr
        import wandb_workspaces.workspaces as ws
    except ImportError:
        raise PretrainerError("the workspace needs wandb-workspaces: pip install wandb-workspaces") from None

    sections = [
        ws.Section(
            name=s["name"],
            is_open=s["name"] in ("Loss", "Optimization", "Incidents"),
            panels=[wr.LinePlot(title=p["title"], x=p["x"], y=p["y"], log_y=p.get("log_y")) for p in s["panels"]],
        )
        for s in spec
    ]
    return ws.Workspace(
        name=name,
        entity=entity,
        project=project,
        sections=sections,
        settings=ws.WorkspaceSettings(x_axis="train/step"),
        runset_settings=ws.RunsetSettings(groupby=[ws.Metric("Group"), ws.Metric("JobType")]),
    )


def save(spec: list[dict], entity: str, project: str, name: str) -> str:
    workspace = build(spec, entity, project, name)
    workspace.save()
    return workspace.url


if __name__ == "__main__":
    raise SystemExit(main())
