"""The metrics sink of a training run: metrics.jsonl, TensorBoard and the console."""

from __future__ import annotations

import collections
import json
import math
import os
import time
from typing import Any, Callable, Mapping

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
    from absl import flags, logging

    if flags.FLAGS.is_parsed():
        logging.info("%s", line)
    else:
        print(line, flush=True)


class MetricsWriter:
    """Writes each call's scalars to ``metrics.jsonl``, TensorBoard and the console.

    ``<workdir>/metrics.jsonl`` gets one JSON object per ``write`` with keys
    ``step``, ``time`` (Unix seconds) and the scalars, flushed at once and
    appended to on resume (a restarted run may repeat steps: readers should
    keep the last line for a step, as ``read_metrics_jsonl`` does).
    Non-finite and None values are stored as JSON null. ``<workdir>/tensorboard/``
    gets event files through tensorboard's own writer (no TensorFlow needed);
    None values are left out there. Each call also emits one console line
    (``step s/total | loss .. | other scalars .. | eta ..``) through ``console``
    (default: absl ``logging.info`` in an absl app, else ``print``); the ETA
    uses the step rate between the last ``eta_window`` calls, so a compile
    before the first call does not count, and ``clock`` is there for tests.
    On a non-primary process every method is a no-op and nothing is created.
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
    ):
        self.workdir = os.fspath(workdir)
        self.is_primary = bool(is_primary)
        self.total_steps = total_steps
        self._console = console or _default_console
        self._clock = clock
        self._times: collections.deque[tuple[int, float]] = collections.deque(
            maxlen=max(2, eta_window + 1)
        )
        self._jsonl = None
        self._tb = None
        if not self.is_primary:
            return
        os.makedirs(self.workdir, exist_ok=True)
        self.jsonl_path = os.path.join(self.workdir, "metrics.jsonl")
        self.tensorboard_dir = os.path.join(self.workdir, "tensorboard")
        self._jsonl = open(self.jsonl_path, "a", encoding="utf-8")

        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._tb = EventFileWriter(self.tensorboard_dir)

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
        self._jsonl.write(json.dumps(record, allow_nan=False) + "\n")
        self._jsonl.flush()

        self._write_tensorboard(step, now, values)
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
        if self._jsonl is not None:
            self._jsonl.flush()
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- internals ----------------------------------------------------------

    def _write_tensorboard(self, step: int, wall_time: float, values: Mapping[str, Any]) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        summary_values = [
            Summary.Value(tag=k, simple_value=float(v)) for k, v in values.items() if v is not None
        ]
        if not summary_values:
            return
        self._tb.add_event(
            Event(wall_time=wall_time, step=step, summary=Summary(value=summary_values))
        )
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


def read_metrics_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Read a ``metrics.jsonl`` as a resumed run's history, ordered by step.

    When a line's step is not after the previous one (a run restarted from an
    earlier checkpoint), the earlier lines with that step or later are dropped,
    as TensorBoard purges orphaned data. A truncated line (a run killed
    mid-write) is skipped.
    """
    records: list[dict[str, Any]] = []
    with open(path, encoding="utf-8") as f:
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
