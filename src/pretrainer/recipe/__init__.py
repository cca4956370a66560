"""The recipe: what a run is, declared in YAML and validated before anything runs.

- `sections`, `eval_sections`: one typed, strict class per YAML section; field docstrings are the reference;
- `schema`: the `Recipe` (checks across sections, the run plan derived once);
- `loading`: inherit, `--set` overrides, one-line errors naming file and field; hashing and diffs;
- `plan`: stage spans, steps, accumulation, decay window, as pure functions of the sections;
- `stages`, `schedules`: which stage a step is in, the LR at a step (WSD here, cosine from transformers);
- `lint`: the classic recipe mistakes, with stable ids.
"""
