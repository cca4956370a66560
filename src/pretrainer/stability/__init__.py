"""The live rules that decide: what a step's outcome means and what the loop should do about it.

- `decisions`: the typed decisions a part returns (`Ok`, `Rollback`, `Abort`); only the loop acts on them;
- `spikes`: the spike rule, one trend detector judging each step against the recent trend in units of its noise;
- `skip_step`: skip an outlier update in place, decided on the device (tier 2 of the ladder);
- `recovery`: spike episodes, the rollback target, data blame under the restored weights, the skip ledger.
"""
