"""Observation: what a person and a dashboard see of a run.

- `events`: the event kinds and metric keys, the one protocol every writer and reader imports;
- `tracking`: metrics.jsonl and events.jsonl, mirrored to W&B and TensorBoard;
- `wandb_history`: one W&B run per training run, its history equal to metrics.jsonl;
- `meters`: throughput, MFU, memory, the step window;
- `health`, `plots`: the trend verdicts of `check_run.py` and the run's plots;
- `console`, `summary`: the start and end blocks, the `inspect_recipe.py` report.
"""
