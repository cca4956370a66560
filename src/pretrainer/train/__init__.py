"""The training loop and the parts that decide.

- `trainer`: the loop (`Trainer.steps`); the one place where restores, resumes and saves happen;
- `step`: one optimizer step through Accelerate, returning a typed outcome;
- `accelerator`: the accelerator, optimizer groups and DeepSpeed settings the recipe owns;
- `recovery`, `spikes`: spike detection and the decision to roll back or skip data;
- `resume`: what `--resume` restores, and whether the recipe may continue from it;
- `state`: the run state and the protocol of every stateful part;
- `gns`, `preemption`, `rundir`: the noise scale, SIGTERM handling, the run directory's lock;
- `launcher`: `accelerate launch` with the ranks' exit codes (scripts/launch.py);
- `skip_step`, `averaging`, `layers`, `evals`: skip-step, the merged weights, per-layer statistics, one eval round.
"""
