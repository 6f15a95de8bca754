"""The metrics sink of a training run: metrics.jsonl, TensorBoard and the console."""

from __future__ import annotations

import collections
import json
import math
import os
import socket
import time
import uuid
from typing import Any, Callable, Mapping

from absl import flags, logging
from tensorboard.compat.proto.event_pb2 import Event, SessionLog
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.summary.writer.record_writer import RecordWriter

from gpt_oss_train.io import storage

# --------------------------------------------------------------------------
# Metrics sink: JSONL + TensorBoard + console
# --------------------------------------------------------------------------

_RESERVED = ("step", "time")


def _to_python(value: Any) -> float | int | None:
    if value is None:
        return None
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if hasattr(value, "item"):  # numpy / jax scalars
        value = value.item()
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return float(value)


def _fmt(value: float | int | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return str(value)
    if not math.isfinite(value):
        return str(value)
    a = abs(value)
    if a != 0 and (a < 1e-3 or a >= 1e5):
        return f"{value:.3e}"
    return f"{value:.4g}"


def _fmt_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    mi, s = divmod(rem, 60)
    if h:
        return f"{h}h{mi:02d}m"
    if mi:
        return f"{mi}m{s:02d}s"
    return f"{s}s"


def _default_console(line: str) -> None:
    """absl INFO inside an absl app; print otherwise (absl hides INFO before flag parsing)."""
    if flags.FLAGS.is_parsed():
        logging.info("%s", line)
    else:
        print(line, flush=True)


class MetricsWriter:
    """Writes each call's scalars to ``metrics.jsonl``, TensorBoard and the console.

    ``<workdir>/metrics.jsonl`` (local or gs://, through io/storage.py) gets one JSON
    object per ``write`` with keys ``step``, ``time`` (Unix seconds) and the scalars,
    flushed at once. A resumed run passes ``resume_step``: the lines after it (steps the
    run will replay) are dropped first, so each step appears once; readers may still keep
    the last line for a step, as ``read_metrics_jsonl`` does, for files of older runs.
    Non-finite and None values are stored as JSON null. ``<workdir>/tensorboard/`` gets
    event files through tensorboard's own record writer (no TensorFlow needed), one new
    file per writer, which starts, on resume, with a session-start event at the first
    replayed step so TensorBoard drops the old events from there; None values are left
    out there. Each call also emits one console line (``step s/total | loss .. | other
    scalars .. | eta ..``) through ``console`` (default: absl ``logging.info`` in an absl
    app, else ``print``); the ETA uses the step rate between the last ``eta_window``
    calls, so a compile before the first call does not count, and ``clock`` is there for
    tests. A write that fails (a full disk) is warned about once and the run goes on; the
    console line is still shown. On a non-primary process every method is a no-op and
    nothing is created.
    """

    def __init__(
        self,
        workdir: str | os.PathLike,
        *,
        is_primary: bool = True,
        total_steps: int | None = None,
        eta_window: int = 20,
        console: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        resume_step: int | None = None,
    ):
        self.workdir = storage.normalize(workdir)
        self.is_primary = bool(is_primary)
        self.total_steps = total_steps
        self._console = console or _default_console
        self._clock = clock
        self._times: collections.deque[tuple[int, float]] = collections.deque(
            maxlen=max(2, eta_window + 1)
        )
        self._jsonl = None
        self._tb = None
        self._write_failed = False
        if not self.is_primary:
            return
        storage.makedirs(self.workdir)
        self.jsonl_path = storage.join(self.workdir, "metrics.jsonl")
        self.tensorboard_dir = storage.join(self.workdir, "tensorboard")
        if resume_step is not None:
            _drop_after(self.jsonl_path, resume_step)
        self._jsonl = storage.open(self.jsonl_path, "a")
        self._tb = _event_file(self.tensorboard_dir, resume_step)

    # -- public API ---------------------------------------------------------

    def write(self, step: int, scalars: Mapping[str, Any]) -> None:
        if not self.is_primary or self._jsonl is None:
            return
        for key in _RESERVED:
            if key in scalars:
                raise ValueError(f"scalar name {key!r} is reserved")
        step = int(step)
        now = time.time()
        values = {k: _to_python(v) for k, v in scalars.items()}

        record: dict[str, Any] = {"step": step, "time": now}
        for k, v in values.items():
            record[k] = v if v is None or math.isfinite(v) else None
        try:
            self._jsonl.write(json.dumps(record, allow_nan=False) + "\n")
            self._jsonl.flush()
            self._write_tensorboard(step, now, values)
        except OSError as e:  # a full disk must not stop the run; the checkpoints decide
            if not self._write_failed:
                self._write_failed = True
                logging.warning(
                    "%s: writing metrics failed (%s); the console still shows them", self.workdir, e
                )
        self._times.append((step, self._clock()))
        self._console(self._console_line(step, values))

    def eta_seconds(self) -> float | None:
        """Seconds left, from the step rate over the recent ``write`` calls."""
        if self.total_steps is None or len(self._times) < 2:
            return None
        (s0, t0), (s1, t1) = self._times[0], self._times[-1]
        if s1 <= s0 or t1 <= t0:
            return None
        seconds_per_step = (t1 - t0) / (s1 - s0)
        return max(0, self.total_steps - s1) * seconds_per_step

    def flush(self) -> None:
        for f in (self._jsonl, self._tb):
            if f is not None:
                f.flush()

    def close(self) -> None:
        files, self._jsonl, self._tb = (self._jsonl, self._tb), None, None
        for f in files:
            if f is not None:
                try:
                    f.close()
                except OSError:
                    pass  # already warned about by write

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- internals ----------------------------------------------------------

    def _write_tensorboard(self, step: int, wall_time: float, values: Mapping[str, Any]) -> None:
        summary_values = [
            Summary.Value(tag=k, simple_value=float(v)) for k, v in values.items() if v is not None
        ]
        if not summary_values:
            return
        event = Event(wall_time=wall_time, step=step, summary=Summary(value=summary_values))
        self._tb.write(event.SerializeToString())
        self._tb.flush()  # so a killed run keeps what it logged

    def _console_line(self, step: int, values: Mapping[str, Any]) -> str:
        head = f"step {step}" if self.total_steps is None else f"step {step}/{self.total_steps}"
        parts = [head]
        if "loss" in values:
            parts.append(f"loss {_fmt(values['loss'])}")
        parts += [f"{k} {_fmt(v)}" for k, v in values.items() if k != "loss"]
        eta = self.eta_seconds()
        if eta is not None:
            parts.append(f"eta {_fmt_duration(eta)}")
        return " | ".join(parts)


def _event_file(logdir: str, resume_step: int | None):
    """A new TensorBoard event file in `logdir` (local or a URL), written through storage:
    tensorboard's EventFileWriter, without TensorFlow, overwrites instead of appending on
    gs://. The name is unique per writer (time, host, pid, random)."""
    now = time.time()
    # TensorBoard reads a folder's event files in name order: microseconds keep two
    # writers of one second (a quick resume) in the order they started.
    stamp = f"{now:.6f}.{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    writer = RecordWriter(storage.open(storage.join(logdir, f"events.out.tfevents.{stamp}"), "ab"))
    writer.write(Event(wall_time=now, file_version="brain.Event:2").SerializeToString())
    if resume_step is not None:
        # TensorBoard drops the older events from this step on (they are being replayed).
        start = Event(
            wall_time=now, step=resume_step + 1, session_log=SessionLog(status=SessionLog.START)
        )
        writer.write(start.SerializeToString())
    writer.flush()
    return writer


def _drop_after(path: str, step: int) -> None:
    """Rewrites metrics.jsonl without the lines of steps after `step` (and any truncated
    line a killed run left), so a resumed run writes each replayed step once."""
    if not storage.exists(path):
        return
    text = storage.read_text(path)
    kept = []
    for line in text.splitlines(keepends=True):
        try:
            if int(json.loads(line)["step"]) <= step:
                kept.append(line if line.endswith("\n") else line + "\n")
        except (ValueError, KeyError, TypeError):
            continue  # blank or truncated
    if "".join(kept) != text:
        storage.write_atomic(path, "".join(kept))


def read_metrics_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Read a ``metrics.jsonl`` as a resumed run's history, ordered by step.

    When a line's step is not after the previous one (a run restarted from an
    earlier checkpoint), the earlier lines with that step or later are dropped,
    as TensorBoard purges orphaned data. A truncated line (a run killed
    mid-write) is skipped.
    """
    records: list[dict[str, Any]] = []
    with storage.open(path, "r") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            step = int(record["step"])
            while records and int(records[-1]["step"]) >= step:
                records.pop()
            records.append(record)
    return records
