"""Judging a run from its run directory, never from the live loop (the live monitor calls the same rules).

- `replay`: the live spike rule replayed over the recorded per-step losses;
- `runfiles`: a run directory read once, as one typed object;
- `verdicts`, `report`: the trend verdicts and the live monitor's rule; check_run's report;
- `laws`, `forecast`, `outlook`: scaling laws in the LR schedule's sums, the forecast of the final loss and its band;
- `critical_batch`: the critical batch estimated from branches trained at several batch sizes;
- `plots`, `summary`: the run's pictures; the `inspect_recipe.py` report of a recipe before it runs.
"""
