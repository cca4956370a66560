"""The per-step record: every optimizer step the live loop judged, in columns, append-only, kept across rollbacks.

`metrics.jsonl` is a log for people and trackers: a row every `logging.every_steps`, and a rolled-back step's row is
replaced by its replay. The spike rule, though, judged every step as it happened, including the steps a rollback
then threw away. This record keeps those: one row per step with the loss and gradient norm the rule saw and the
*epoch* (the rollbacks and resumes before the step), so `check_run.py` replays what the live rule really saw
(`spike_replay.lived_episodes`), and reads a long run's curve without parsing JSON.

Format: Arrow IPC streams, zstd-compressed, two per launch, a record batch per flush: `records/steps-NNNN.arrows`
(every step: step, epoch, loss, gradient norm; ~6 bytes a step on disk) and `records/rows-NNNN.arrows` (each
logging step: stage, tokens, whether the update was applied, and the metrics row's loss, LR, tokens/s and noise
scale). Chosen by measurement (docs/BENCHMARKS.md, "check_run.py at a run's real length"): an IPC stream appends a
batch without rewriting anything, and reads back a batch at a time, so the reader keeps only the columns it needs;
a process killed mid-write leaves a torn last batch, which the reader drops (the steps after the newest checkpoint
are replayed after a resume anyway, under a new epoch).

Written by the main process only, at logging steps, saves and rollbacks: never inside the step. Per step the loop
appends five host numbers it already has (`observe`); the losses arrive with the logging step's one transfer.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import first_line

DIR = "records"
FLUSH_ROWS = 16384
"""Most buffered steps written as one batch (~1 MB of host memory while buffered)."""
ROW_FIELDS = ("row_loss", "lr", "tokens_per_s", "gns")
"""The logging step's metrics-row values kept in the rows stream (the row's `loss`, `lr`, `tokens_per_s`,
`gns/b_simple`)."""


def step_schema():
    import pyarrow as pa

    return pa.schema(
        [
            ("step", pa.int64()),
            ("epoch", pa.int32()),
            ("loss", pa.float32()),  # the step's loss averaged over ranks: float32 on the device, exact here
            ("grad_norm", pa.float32()),  # null where the guard did not read it
        ]
    )


def row_schema():
    import pyarrow as pa

    return pa.schema(
        [
            ("step", pa.int64()),
            ("epoch", pa.int32()),
            ("stage", pa.int16()),
            ("tokens", pa.int64()),
            ("applied", pa.bool_()),  # False: skip-step (or the non-finite guard) held the update back
            ("grad_norm", pa.float32()),
            *((name, pa.float64()) for name in ROW_FIELDS),
        ]
    )


class _Stream:
    """One append-only IPC stream file, opened at its first batch."""

    def __init__(self, path: Path, schema):
        self.path, self.schema = path, schema
        self.sink = self.writer = None

    def write(self, rows: list[tuple]) -> None:
        import pyarrow as pa

        if self.writer is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.sink = pa.OSFile(str(self.path), "wb")
            options = pa.ipc.IpcWriteOptions(compression="zstd")
            self.writer = pa.ipc.new_stream(self.sink, self.schema, options=options)
        arrays = [pa.array(c, type=f.type) for c, f in zip(zip(*rows), self.schema)]
        self.writer.write_batch(pa.record_batch(arrays, schema=self.schema))
        self.sink.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class StepRecorder:
    """Buffers the live loop's per-step values and appends them to this launch's streams (main process only)."""

    def __init__(self, output_dir: Path, enabled: bool):
        self.enabled = enabled
        self.dir = Path(output_dir) / DIR
        self.streams: tuple[_Stream, _Stream] | None = None
        self.pending: dict[int, list] = {}
        """step -> [epoch, loss seen by the guard, grad_norm, applied, stage, tokens], until the logging step."""
        self.steps: list[tuple] = []
        self.rows: list[tuple] = []

    def observe(self, step: int, epoch: int, observed, applied: bool, stage: int, tokens: int) -> None:
        """A finished step: `observed` is what the guard read on the host (loss and gradient norm, exactly what the
        spike rule judged), or None when the guard is off (the loss then comes with the logging step)."""
        if self.enabled:
            loss, norm = (observed.loss, observed.grad_norm) if observed is not None else (None, None)
            self.pending[step] = [epoch, loss, norm, applied, stage, tokens]

    def losses(self, steps: list[int], losses: list[float], row: dict[str, Any] | None = None) -> None:
        """The window's per-step losses (after the logging step's transfer); `row`: the metrics row logged at the
        window's last step."""
        if not self.enabled:
            return
        for s, v in zip(steps, losses):
            epoch, seen, norm, applied, stage, tokens = self.pending.pop(s, [0, None, None, True, 0, 0])
            self.steps.append((s, epoch, v if seen is None else seen, norm))
            if row is not None and s == steps[-1]:
                values = (_num(row.get(k)) for k in ("loss", "lr", "tokens_per_s", "gns/b_simple"))
                self.rows.append((s, epoch, stage, tokens, applied, norm, *values))
        if len(self.steps) >= FLUSH_ROWS:
            self.flush()

    def flush(self) -> None:
        """Write the buffered steps as one batch (at saves, rollbacks and the end: the record on disk covers what a
        checkpoint covers)."""
        if not (self.enabled and self.steps):
            return
        if self.streams is None:
            n = len(list(self.dir.glob("steps-*.arrows")))
            self.streams = (
                _Stream(self.dir / f"steps-{n:04d}.arrows", step_schema()),
                _Stream(self.dir / f"rows-{n:04d}.arrows", row_schema()),
            )
        self.streams[0].write(self.steps)
        if self.rows:
            self.streams[1].write(self.rows)
        self.steps, self.rows = [], []

    def close(self) -> None:
        self.flush()
        for stream in self.streams or ():
            stream.close()


def _num(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


@dataclass(frozen=True)
class Record:
    """A run's per-step record in the order the steps were lived (rolled-back and re-run steps included): three
    columns per step (~17 bytes a step in memory), and the logging steps' rows (`rows`: a column each)."""

    step: np.ndarray  # int64
    epoch: np.ndarray  # int32
    loss: np.ndarray  # float32, as the device computed it
    bad_norm: np.ndarray  # bool: the step's gradient norm was not finite
    rows: dict[str, np.ndarray]

    def __len__(self) -> int:
        return len(self.step)

    def judged_loss(self) -> np.ndarray:
        """The loss as the spike rule judged it (float32, as computed): NaN where the gradient norm was not finite
        (the rule flags either at once, as a non-finite step)."""
        if not self.bad_norm.any():
            return self.loss
        out = self.loss.copy()
        out[self.bad_norm] = np.nan
        return out


MAX_BATCH_ROWS = 1 << 20
"""Most rows a record batch may claim when read (the writer flushes at most `FLUSH_ROWS`): a damaged length or
buffer size is refused before Arrow allocates for it (a damaged byte must never cost gigabytes)."""


class Damaged(ValueError):
    """A complete batch that does not read as the record's schema (a damaged byte, not a torn write)."""


def _batches(path: Path, schema, damaged: list[str]):
    """A stream's batches, one at a time. A torn last batch (a killed process) ends it silently; a batch that is
    complete but damaged ends it too and is named in `damaged` (the batches before it are kept)."""
    import pyarrow as pa

    errors = (pa.ArrowException, OSError, ValueError, IndexError, struct.error)
    try:
        messages = pa.ipc.MessageReader.open_stream(pa.memory_map(str(path)))
        first = messages.read_next_message()
    except (StopIteration, *errors):
        return  # created, nothing (whole) written
    try:
        if not pa.ipc.read_schema(first).equals(schema):
            raise Damaged("not the record's schema")
    except errors as e:
        damaged.append(f"{path.name}: {first_line(e, 120)}")
        return
    while True:
        try:
            message = messages.read_next_message()
        except StopIteration:
            return
        except errors:
            return  # torn
        try:
            _check_layout(message)
            batch = pa.ipc.read_record_batch(message, schema)
            batch.validate(full=True)
        except errors as e:
            damaged.append(f"{path.name}: {first_line(e, 120)}")
            return
        yield batch


def _check_layout(message) -> None:
    """Refuse a record batch whose metadata claims more than a record batch can hold: rows past `MAX_BATCH_ROWS`, a
    buffer outside the body, a compressed buffer that would decompress past 8 bytes a row (read from the message's
    flatbuffer before Arrow allocates anything).

    Raises:
        Damaged: what is wrong."""
    if message.type != "record batch":
        raise Damaged(f"a {message.type} message where a record batch belongs")
    rows, buffers, compressed = _batch_layout(memoryview(message.metadata.to_pybytes()))
    if not 0 <= rows <= MAX_BATCH_ROWS:
        raise Damaged(f"a batch of {rows} rows")
    body = message.body
    size = body.size if body is not None else 0
    head = memoryview(body) if body is not None else memoryview(b"")
    for offset, length in buffers:
        if offset < 0 or length < 0 or offset + length > size:
            raise Damaged(f"a buffer at {offset}+{length} outside the batch's {size} bytes")
        if compressed and length >= 8:
            full = struct.unpack_from("<q", head, offset)[0]
            if full != -1 and not 0 <= full <= 8 * rows + 64:
                raise Damaged(f"a buffer that claims {full} bytes for {rows} rows")


def _batch_layout(buf: memoryview) -> tuple[int, list[tuple[int, int]], bool]:
    """(rows, [(offset, length) of each buffer], compressed) of an IPC RecordBatch message's flatbuffer metadata
    (Message: field 1 header type, 2 header; RecordBatch: 0 length, 2 buffers, 3 compression; Arrow's Message.fbs)."""
    msg = _table(buf, struct.unpack_from("<I", buf, 0)[0])
    kind = _field(buf, msg, 1)
    if kind is None or buf[kind] != 3:  # MessageHeader.RecordBatch
        raise Damaged("not a record batch header")
    at = _field(buf, msg, 2)
    batch = _table(buf, at + struct.unpack_from("<I", buf, at)[0])
    rows = struct.unpack_from("<q", buf, f)[0] if (f := _field(buf, batch, 0)) is not None else 0
    buffers = []
    if (f := _field(buf, batch, 2)) is not None:
        vec = f + struct.unpack_from("<I", buf, f)[0]
        n = struct.unpack_from("<I", buf, vec)[0]
        if 4 + 16 * n > len(buf) - vec:
            raise Damaged(f"{n} buffers in {len(buf)} bytes of metadata")
        buffers = [struct.unpack_from("<qq", buf, vec + 4 + 16 * k) for k in range(n)]
    return rows, buffers, _field(buf, batch, 3) is not None


def _table(buf: memoryview, pos: int) -> tuple[int, list[int]]:
    """A flatbuffer table: its position and its vtable's field offsets."""
    vtable = pos - struct.unpack_from("<i", buf, pos)[0]
    size = struct.unpack_from("<H", buf, vtable)[0]
    return pos, [struct.unpack_from("<H", buf, vtable + 4 + 2 * i)[0] for i in range(max(0, size - 4) // 2)]


def _field(buf: memoryview, table: tuple[int, list[int]], i: int) -> int | None:
    pos, offsets = table
    return pos + offsets[i] if i < len(offsets) and offsets[i] else None


def _np(arr) -> np.ndarray:
    """A primitive Arrow array as numpy, nulls as 0. (Not `to_numpy`: its first call imports pandas, 0.2 s and 50 MB
    of a 10M-step check_run.)"""
    import pyarrow as pa

    validity, data = arr.buffers()[:2]
    if arr.type == pa.bool_():
        out = _bits(data, arr.offset, len(arr))
    else:
        out = np.frombuffer(data, arr.type.to_pandas_dtype())[arr.offset : arr.offset + len(arr)]
    if arr.null_count:
        out = np.where(_bits(validity, arr.offset, len(arr)), out, 0)
    return out


def _bits(buf, offset: int, n: int) -> np.ndarray:
    return np.unpackbits(np.frombuffer(buf, np.uint8), bitorder="little")[offset : offset + n].astype(bool)


def read_record(output_dir: str | Path, damaged: list[str] | None = None) -> Record | None:
    """The run's record (None: a run written before the record existed, or with nothing recorded yet), read a batch
    at a time into the columns it keeps. `damaged` collects the files read only up to a damaged batch (name: why)."""
    d = Path(output_dir) / DIR
    files = sorted(d.glob("steps-*.arrows"))
    if not files:
        return None
    cols: dict[str, list] = {"step": [], "epoch": [], "loss": [], "bad_norm": []}
    rows: dict[str, list] = {f: [] for f in row_schema().names}
    damaged = [] if damaged is None else damaged
    steps, row = step_schema(), row_schema()
    for f in files:
        for b in _batches(f, steps, damaged):
            for k in ("step", "epoch", "loss"):
                cols[k].append(_np(b.column(k)).copy())  # a copy: the batch's buffers go with it
            cols["bad_norm"].append(~np.isfinite(_np(b.column("grad_norm"))))  # an unread norm (null): no flag
        for b in _batches(d / f.name.replace("steps-", "rows-"), row, damaged):
            for k in rows:
                rows[k].append(_np(b.column(k)).copy())
    if not cols["step"]:
        return None
    cat = {}
    for k in list(cols):  # one column at a time, its pieces freed as it is joined
        cat[k] = np.concatenate(cols.pop(k))
    return Record(
        step=cat["step"],
        epoch=cat["epoch"],
        loss=cat["loss"],
        bad_norm=cat["bad_norm"],
        rows={k: np.concatenate(v) if v else np.zeros(0) for k, v in rows.items()},
    )
