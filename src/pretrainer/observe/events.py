"""The run's protocol: every event kind with its fields, and the metric keys, in one module that every writer and
reader imports. A misspelt kind is an AttributeError at import, a misspelt field a ValueError at the first write;
neither becomes a silently empty panel.

An `EventKind` is a `str` (so records stay plain JSON and `e["event"] == SPIKE` reads naturally) that also knows its
fields and whether it is an incident (also a metrics row: cumulative `incidents/<kind>` and `marker/<kind>`)."""

from __future__ import annotations

import difflib


class EventKind(str):
    fields: frozenset[str]
    incident: bool
    open_fields: bool
    doc: str

    def __new__(cls, name: str, fields: tuple[str, ...], doc: str, incident: bool = False, open_fields: bool = False):
        obj = super().__new__(cls, name)
        obj.fields, obj.doc, obj.incident, obj.open_fields = frozenset(fields), doc, incident, open_fields
        return obj

    def check(self, details: dict) -> None:
        """Raises ValueError for a field this kind does not declare."""
        if not self.open_fields and (extra := details.keys() - self.fields):
            raise ValueError(f"event {self!s}: undeclared field(s) {sorted(extra)}; declare them in observe/events.py")


KINDS: dict[str, EventKind] = {}

ROW_KEYS = frozenset({"event", "step", "time"})
"""What every event row holds besides its kind's fields."""


def well_formed(row: dict) -> bool:
    """An event row as some writer wrote it: a known kind, an integer step, and no key that reads as a damaged copy of
    a declared field it lacks (`spike` with `onsgt` and no `onset`). A row of an earlier version, with fields since
    added or retired, or a partial row a benchmark wrote, still reads."""
    kind = KINDS.get(row.get("event")) if isinstance(row.get("event"), str) else None
    if kind is None or type(row.get("step")) is not int:
        return False
    if kind.open_fields:
        return True
    missing = list(kind.fields - row.keys())
    extra = row.keys() - kind.fields - ROW_KEYS
    return not (missing and any(difflib.get_close_matches(k, missing, n=1, cutoff=0.6) for k in extra))


def _kind(name: str, fields: tuple[str, ...], doc: str, incident: bool = False, open_fields: bool = False):
    KINDS[name] = k = EventKind(name, fields, doc, incident, open_fields)
    return k


# ------------------------------------------------------------------ the run
RUN_START = _kind("run_start", ("params", "total_steps", "world"), "a fresh run began (not on resume)")
RUN_END = _kind("run_end", ("tokens",), "the last step is done and final/ written")
PUBLISHED = _kind("published", ("repo", "path", "url"), "a model of the run uploaded to the Hub (`publish`)")
PUBLISH_FAILED = _kind("publish_failed", ("repo", "path", "error"), "an upload failed; the model is saved locally")
RUN_IDENTITY = _kind(
    "run_identity",
    ("run_id", "parent", "source", "remote_was"),
    "the run's id at each launch: where it came from, and the remote's previous owner when this run claimed it",
)
RESUME = _kind("resume", ("path", "tokens", "stage", "cursor", "skips"), "restored from a checkpoint", incident=True)
RESUME_SKIP = _kind("resume_skip", ("path", "reason"), "a checkpoint --resume auto passed over, and why")
RECIPE_CHANGE = _kind("recipe_change", ("differences",), "a resume accepted with --allow-recipe-change")
DATA_CHANGE = _kind("data_change", ("differences",), "a resume accepted with --allow-data-change")
STAGE_START = _kind(
    "stage_start",
    ("stage", "seq_len", "tokens", "rope", "mixture", "long_docs"),
    "a stage began (its RoPE applied)",
    incident=True,
)
BATCH_CHANGE = _kind(
    "batch_change",
    ("global_batch_tokens", "grad_accum", "lr_factor", "tokens"),
    "the global batch changed (`batch.schedule`): a new noise level, so the spike rule restarts its grace",
    incident=True,
)
OPTIMIZER = _kind(
    "optimizer", ("type", "muon", "adamw", "adamw_names"), "which parameters each optimizer steps (at the start)"
)
LINT = _kind("lint", ("findings",), "the recipe linter's findings at the start")
INJECT = _kind("inject", ("what",), "a debug.inject fault fired")

# ------------------------------------------------------------------ the ladder of responses
SKIPPED_UPDATE = _kind(
    "skipped_update",
    ("loss", "grad_norm", "reason", "limit", "tokens"),
    "an update not applied (skip-step's outlier, or non-finite): tier 1",
    incident=True,
)
SPIKE = _kind(
    "spike",
    ("onset", "reason", "zscore", "loss", "grad_norm", "layers"),
    "a loss spike detected (`layers`: the decoder layers that moved first, when layer statistics are on)",
    incident=True,
)
ROLLBACK = _kind(
    "rollback",
    ("to_step", "path", "replayed", "tokens", "evidence"),
    "restored an earlier checkpoint: tier 2 (`evidence`: the spike it acted on)",
    incident=True,
)
ROLLBACK_LIMIT = _kind("rollback_limit", ("rollbacks", "window"), "too many rollbacks: the run stops")
SKIP = _kind(
    "skip",
    ("stage", "first", "last", "onset", "blame", "evidence"),
    "a sample range added to the skip ledger (`evidence`: the blamed samples' losses against the steps before)",
    incident=True,
)
RECURRED = _kind(
    "recurred",
    ("onset", "evidence"),
    "a spike recurred on the exact replay but no sample of its steps stands out: nothing skipped, the run goes on",
    incident=True,
)
ABSORBED = _kind(
    "absorbed",
    ("onset", "steps"),
    "a spike whose every update skip-step held back: the weights never saw it, no rollback",
    incident=True,
)
TRANSIENT = _kind("transient", ("onset", "end"), "a replay stayed healthy: the spike was transient", incident=True)

# ------------------------------------------------------------------ checkpoints
CHECKPOINT = _kind(
    "checkpoint",
    ("path", "reason", "tokens", "blocked_s", "total_s", "bytes", "state_finite"),
    "a checkpoint committed (manifest written, renamed into place)",
    incident=True,
)
CHECKPOINT_FAILED = _kind("checkpoint_failed", ("name", "error"), "a save failed; earlier checkpoints intact")
CLEANUP_INCOMPLETE = _kind("cleanup_incomplete", ("path", "error"), "a dead save's directory removed")
PRUNE = _kind("prune", ("path",), "a checkpoint removed by retention")
PRUNE_FAILED = _kind("prune_failed", ("path", "error"), "retention could not remove a checkpoint")
UNIVERSAL_CONVERT = _kind(
    "universal_convert",
    ("path", "to", "saved_world", "world"),
    "a DeepSpeed checkpoint converted for a new world size",
)
REMOTE_UPLOAD = _kind("remote_upload", ("path", "url", "bytes"), "a checkpoint copied to checkpoint.remote")
REMOTE_FAILED = _kind("remote_failed", ("path", "error"), "a remote copy failed")
REMOTE_PRUNE = _kind("remote_prune", ("path",), "a remote copy removed by retention")
REMOTE_SKIP = _kind("remote_skip", ("path", "reason"), "a remote checkpoint passed over")
REMOTE_FETCH = _kind("remote_fetch", ("path", "to"), "a remote checkpoint fetched for a replaced node")

# ------------------------------------------------------------------ observation
HEALTH = _kind("health", ("verdict", "reasons"), "the trend verdict at an eval")
CONTEXT = _kind("context", (), "the loss-by-position table and its verdict", open_fields=True)
FORECAST = _kind(
    "forecast",
    ("law", "params", "sigma", "points", "mode", "fit_step", "validation", "at_bound", "level"),
    "the loss-curve law chosen and fitted at an eval, with each law's validation score (and the run's own level "
    "against a law shared with a sibling calibration run)",
)
OFF_TRACK = _kind(
    "off_track",
    ("evals", "fit_step"),
    "the last evals lie above the band of the law fitted before them (a drift); logged when it begins",
)
TRACKER_BACKFILL = _kind("tracker_backfill", ("rows",), "metrics rows a resumed W&B run was missing")

INCIDENTS = tuple(k for k in KINDS.values() if k.incident)


def kind(name: str) -> EventKind:
    """The kind named `name` (a record read back from events.jsonl)."""
    return KINDS[name]


# ------------------------------------------------------------------ metric keys (metrics.jsonl, W&B, TensorBoard)
LOSS = "loss"
LR = "lr"
GRAD_NORM = "grad_norm"
TOKENS = "tokens"
STAGE = "stage"
TOKENS_PER_S = "tokens_per_s"
MFU = "mfu"
GNS = "gns/b_simple"
CKPT_BLOCKED = "ckpt/blocked_s"
VAL_REF = "val/ref"
VAL_REF_SE = "val/ref_se"
"""The standard error of `val/ref` from the spread of its fixed batches' losses: the eval's own noise, which the
trend verdicts weigh a change of `val/ref` against."""
"""The held-out loss at one fixed context and batch for the whole run: comparable across stages."""
VAL_REF_MERGED = "val/ref_merged"
"""`val/ref` of the averaged weights (recipe `averaging`), evaluated beside the live model's."""
VAL_AVG = "val/avg"
"""The mean of the per-source held-out losses at the current stage's context (runs from before `val/ref`)."""
VAL_PREFIX = "val/"
VAL_POS_PREFIX = "val_pos/"
EVAL_PREFIX = "eval/"


def is_downstream_key(key: str) -> bool:
    """An lm-eval score's key, `eval/<task>/<metric>` (not the eval timings, not a score's standard error)."""
    return key.startswith(EVAL_PREFIX) and key.count("/") >= 2 and "_stderr" not in key


INCIDENT = "incident"
FORECAST_FINAL = "forecast/final"
"""The final `val/ref` the law forecasts for the run's own schedule; `_lo` and `_hi`: its 90% band."""
FORECAST_LO = "forecast/final_lo"
TOKENS_LOST = "instability/tokens_lost"
"""Tokens of the updates skip-step held back, cumulative (tier 1's cost; rollbacks' replays are in their events)."""
LOSS_Z = "loss/z"
"""The z-loss term's value (coefficient included), when `stability.z_loss` is on."""
LAYERS_PREFIX = "layers/"
FORECAST_HI = "forecast/final_hi"
FORECAST_OFF_TRACK = "forecast/off_track"
"""1 while the last evals lie above the band of the law fitted before them (a drift), else 0."""


def val_key(rows_or_row) -> str:
    """The validation key health reads: `val/ref` where the run logged it, else `val/avg` (older runs)."""
    rows = [rows_or_row] if isinstance(rows_or_row, dict) else rows_or_row
    return VAL_REF if any(VAL_REF in r for r in rows) else VAL_AVG
