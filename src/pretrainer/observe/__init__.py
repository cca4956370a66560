"""Observation: what a person and a dashboard see of a run.

- `events`: the event kinds and metric keys, the one protocol every writer and reader imports;
- `tracking`: metrics.jsonl and events.jsonl, mirrored to W&B and TensorBoard;
- `wandb_history`: one W&B run per training run, its history equal to metrics.jsonl;
- `steprecord`: the per-step record of every step the spike rule judged (`records/`);
- `meters`: throughput, MFU, memory, the step window.

The verdicts, forecast and plots that read these files are in `analysis/`.
"""
