"""Model FLOPs, parameter counts, MFU, and the metrics sink used by the training loop.

FLOPs follow MaxText's accounting (``calculate_tflops_training_per_device`` and
``calculate_mixed_attention_model_tflops_training_per_device`` with an attention
pattern of length 2): matmul FLOPs only, 2 FLOPs per multiply-add, forward x3
for forward + backward, active experts only, unembedding counted and the
embedding lookup not, causal attention counted as half of the full S x S
score matrix. Per token, per layer (D hidden, N query heads, K kv heads,
H head dim, E experts, k experts per token, F expert intermediate size):

    qkv       2 * D * (N + 2K) * H
    out-proj  2 * N * H * D
    router    2 * D * E
    experts   k * (2 * D * 2F  +  2 * F * D)        (gate+up, down)

plus the unembedding ``2 * D * V`` once per token. Attention scores and values
cost ``4 * N * H`` per (query, key) pair; the number of pairs per sequence is
``S^2 / 2`` for a causal layer and ``S*W - W^2/2`` for a sliding-window layer
when S > W (causal otherwise), divided by S to give a per-token figure. These
closed forms drop the diagonal (``S/2`` and ``W/2`` pairs) exactly as MaxText
does.

Nothing in the FLOPs/parameter section imports jax: ``m`` is any object with
the attributes vocab_size, hidden_size, num_layers, num_heads, num_kv_heads,
head_dim, num_experts, experts_per_token, intermediate_size, sliding_window.
"""

from __future__ import annotations

import collections
import json
import math
import os
import time
from typing import Any, Callable, Mapping

__all__ = [
    "PEAK_FLOPS",
    "MetricsWriter",
    "StepTimer",
    "attention_pairs",
    "format_scalars",
    "forward_flops_per_token",
    "is_sliding_layer",
    "mfu",
    "param_counts",
    "peak_flops_per_device",
    "read_metrics_jsonl",
    "throughput_metrics",
    "training_flops_per_token",
    "weight_flops_per_token",
]


# --------------------------------------------------------------------------
# FLOPs and parameter counts
# --------------------------------------------------------------------------


def _dims(m: Any) -> tuple[int, ...]:
    return (
        int(m.vocab_size),
        int(m.hidden_size),
        int(m.num_layers),
        int(m.num_heads),
        int(m.num_kv_heads),
        int(m.head_dim),
        int(m.num_experts),
        int(m.experts_per_token),
        int(m.intermediate_size),
    )


def is_sliding_layer(m: Any, layer: int) -> bool:
    """Whether ``layer`` uses the banded (sliding-window) mask.

    GPT-OSS alternates, starting with a banded layer: layers 0, 2, 4, ... are
    banded, odd layers are full causal. With no (or a non-positive) window
    every layer is full causal.
    """
    window = getattr(m, "sliding_window", None)
    if not window or window <= 0:
        return False
    return layer % 2 == 0


def attention_pairs(seq_len: int, window: int | None = None) -> float:
    """(query, key) pairs per sequence, in MaxText's closed form.

    Causal: ``S^2 / 2``. Banded to the last ``window`` keys (self included):
    ``S*W - W^2/2`` when ``S > W``, otherwise the causal count. The exact mask
    counts are these plus ``S/2`` (causal) or ``W/2`` (banded): the diagonal
    that the continuous approximation drops.
    """
    s = float(seq_len)
    if window and 0 < window < seq_len:
        w = float(window)
        return s * w - w * w / 2.0
    return s * s / 2.0


def weight_flops_per_token(m: Any) -> dict[str, float]:
    """Forward matmul FLOPs per token on weights, by component (summed over layers)."""
    V, D, L, N, K, H, E, k, F = _dims(m)
    qkv = 2 * D * (N + 2 * K) * H
    out = 2 * N * H * D
    router = 2 * D * E
    experts = k * (2 * D * 2 * F + 2 * F * D)
    parts = {
        "qkv": float(L * qkv),
        "out_proj": float(L * out),
        "router": float(L * router),
        "experts": float(L * experts),
        "unembedding": float(2 * D * V),
    }
    parts["total"] = sum(parts.values())
    return parts


def _attention_flops_per_token(m: Any, seq_len: int) -> float:
    _, _, L, N, _, H, _, _, _ = _dims(m)
    window = getattr(m, "sliding_window", None)
    total_pairs = 0.0
    for layer in range(L):
        w = window if is_sliding_layer(m, layer) else None
        total_pairs += attention_pairs(seq_len, w)
    return 4.0 * N * H * total_pairs / seq_len


def forward_flops_per_token(m: Any, seq_len: int) -> dict[str, float]:
    """Forward-pass model FLOPs per token: {"weights", "attention", "total"}."""
    if seq_len <= 0:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    weights = weight_flops_per_token(m)["total"]
    attention = _attention_flops_per_token(m, seq_len)
    return {"weights": weights, "attention": attention, "total": weights + attention}


def training_flops_per_token(m: Any, seq_len: int) -> dict[str, float]:
    """Training (forward + backward = 3 x forward) model FLOPs per token."""
    fwd = forward_flops_per_token(m, seq_len)
    return {key: 3.0 * value for key, value in fwd.items()}


def param_counts(m: Any) -> dict[str, int]:
    """Parameter counts of the GPT-OSS architecture.

    Per layer: two RMSNorm scales (D each); q/k/v/o projections with biases;
    one attention-sink logit per query head; router weight and bias; experts
    with fused gate+up (D x 2F, bias 2F) and down (F x D, bias D). Plus the
    token embedding (V x D), the untied unembedding (D x V) and the final norm.

    Returns ``total``; ``active``, the parameters a token uses with only ``k``
    experts and *without* the embedding table (the convention of the published
    3.61B / 5.13B figures for gpt-oss-20b / 120b); ``active_with_embedding``
    (``active`` plus V x D); and ``embedding`` (V x D).
    """
    V, D, L, N, K, H, E, k, F = _dims(m)
    attention = (D * N * H + N * H) + 2 * (D * K * H + K * H) + (N * H * D + D) + N
    norms = 2 * D
    router = D * E + E
    expert = (D * 2 * F + 2 * F) + (F * D + D)
    embedding = V * D
    unembedding = D * V
    final_norm = D
    shared = embedding + unembedding + final_norm + L * (attention + norms + router)
    total = shared + L * E * expert
    active_with_embedding = shared + L * k * expert
    return {
        "total": total,
        "active": active_with_embedding - embedding,
        "active_with_embedding": active_with_embedding,
        "embedding": embedding,
    }


# --------------------------------------------------------------------------
# Peak FLOP/s and MFU
# --------------------------------------------------------------------------

# Per-device dense bf16 peak FLOP/s, matched as a case-insensitive substring of
# ``jax.devices()[0].device_kind``. Order matters: the first match wins, so the
# more specific names ("TPU v5 lite") precede the shorter ones ("TPU v5").
PEAK_FLOPS: dict[str, float] = {
    # cloud.google.com/tpu/docs/v6e (Trillium): 918 TFLOP/s bf16 per chip.
    "TPU v6 lite": 918e12,
    "TPU v6e": 918e12,
    "v6e": 918e12,
    # cloud.google.com/tpu/docs/v5e: 197 TFLOP/s bf16 per chip.
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "v5e": 197e12,
    # cloud.google.com/tpu/docs/v5p: 459 TFLOP/s bf16 per chip
    # (jax reports v5p as "TPU v5p" or plain "TPU v5").
    "TPU v5p": 459e12,
    "v5p": 459e12,
    "TPU v5": 459e12,
    # cloud.google.com/tpu/docs/v4: 275 TFLOP/s bf16 per chip.
    "TPU v4": 275e12,
    # NVIDIA B200 datasheet (DGX B200): 4.5 PFLOP/s bf16 with sparsity -> 2.25 dense.
    "B200": 2250e12,
    # NVIDIA H200 datasheet (SXM): 1,979 TFLOP/s bf16 with sparsity -> 989 dense.
    "H200": 989e12,
    # NVIDIA H100 datasheet (SXM): 1,979 TFLOP/s bf16 with sparsity -> 989 dense.
    # (H100 PCIe is 756 dense: pass an override for that card.)
    "H100": 989e12,
    # NVIDIA A100 datasheet: 312 TFLOP/s bf16 dense.
    "A100": 312e12,
}


def peak_flops_per_device(device_kind: str, override: float | None = None) -> float | None:
    """Dense bf16 peak FLOP/s for a ``device_kind``; ``override`` wins if given.

    Returns None for an unknown device (CPU included), so MFU is reported as
    None rather than a made-up number.
    """
    if override is not None:
        if override <= 0:
            raise ValueError(f"peak FLOP/s override must be positive, got {override}")
        return float(override)
    kind = (device_kind or "").lower()
    for name, peak in PEAK_FLOPS.items():
        if name.lower() in kind:
            return peak
    return None


def mfu(flops_per_sec_per_device: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation as a fraction (0..1), or None without a peak."""
    if peak is None or peak <= 0:
        return None
    return flops_per_sec_per_device / peak


def throughput_metrics(
    *,
    step_time_s: float,
    tokens_per_step: int,
    num_devices: int,
    flops_per_token: float,
    peak: float | None,
) -> dict[str, float | None]:
    """The ``perf/*`` scalars MaxText logs, from one step's wall time.

    ``tokens_per_step`` is the global batch (all devices, all micro-batches);
    ``flops_per_token`` the training figure from ``training_flops_per_token``.
    """
    tokens_per_sec_per_device = tokens_per_step / step_time_s / num_devices
    flops_per_sec_per_device = flops_per_token * tokens_per_sec_per_device
    return {
        "perf/step_time_seconds": float(step_time_s),
        "perf/per_device_tokens_per_sec": tokens_per_sec_per_device,
        "perf/per_device_tflops_per_sec": flops_per_sec_per_device / 1e12,
        "perf/mfu": mfu(flops_per_sec_per_device, peak),
    }


class StepTimer:
    """Wall time per step, blocking on the step's outputs; compile steps excluded.

    timer = StepTimer()
    for step in ...:
        state, out = train_step(state, batch)
        dt = timer.lap(out)      # seconds since the previous lap (or start)
    timer.mean                   # mean over laps after the first ``skip``
    """

    def __init__(self, skip: int = 1):
        self.skip = skip
        self.laps: list[float] = []
        self._last = time.perf_counter()

    def start(self) -> None:
        self._last = time.perf_counter()

    def lap(self, *block_on: Any) -> float:
        if block_on:
            import jax  # only needed when there is something to wait for

            jax.block_until_ready(block_on)
        now = time.perf_counter()
        dt, self._last = now - self._last, now
        self.laps.append(dt)
        return dt

    @property
    def mean(self) -> float | None:
        timed = self.laps[self.skip :]
        return sum(timed) / len(timed) if timed else None


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


def format_scalars(scalars: Mapping[str, Any]) -> str:
    """``name value`` pairs, compactly formatted, joined by " | "."""
    return " | ".join(f"{k} {_fmt(_to_python(v))}" for k, v in scalars.items())


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


class _LibraryInfoFilter:
    """Drops INFO-and-below records logged from inside orbax and grain: a checkpoint save
    prints ~40 INFO lines there, which would bury the one metrics line per log step."""

    _NOISY = (f"{os.sep}orbax{os.sep}", f"{os.sep}grain{os.sep}")

    def filter(self, record) -> bool:
        import logging as std_logging

        if record.levelno > std_logging.INFO:
            return True
        return not any(part in record.pathname for part in self._NOISY)


def quiet_library_logs() -> None:
    """Keeps absl INFO for this project, warnings and errors for everyone."""
    from absl import logging

    handler = logging.get_absl_handler()
    if not any(isinstance(f, _LibraryInfoFilter) for f in handler.filters):
        handler.addFilter(_LibraryInfoFilter())
