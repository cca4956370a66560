"""The training loop and what it is built from.

- `trainer`: the loop (`Trainer.steps`); the one place where restores, resumes and saves happen;
- `step`: one optimizer step through Accelerate, returning a typed outcome;
- `build`, `accelerator`, `optim`: the model, optimizer and schedule, the accelerator and DeepSpeed settings the
  recipe owns, the optimizer's parameter groups;
- `resume`, `startup`, `rundir`: what `--resume` restores and whether the recipe may continue from it, the run's
  identity, the run directory's lock;
- `state`, `hooks`: the run state and the protocol of every stateful part; the in-step hooks;
- `evals`, `averaging`, `saving`, `preemption`: one eval round, the merged weights, when to save, SIGTERM handling;
- `console`: the start and end blocks and the progress line;
- `engines/`: DeepSpeed adapters (skip-step inside the engine, partitioned layer gradients, Muon under ZeRO);
- `measures/`: the noise scale, per-layer statistics, the optimizer probe;
- `batch_branches`: the critical batch's branches, trained through this loop (`scripts/critical_batch.py`);
- `inject`: the faults a recipe's `debug.inject` asks for (drills and benchmarks);
- `launcher`: `accelerate launch` with the ranks' exit codes (scripts/launch.py).

The rules that decide (spikes, skip-step, recovery) live in `stability/`; what judges a run offline in `analysis/`.
"""
