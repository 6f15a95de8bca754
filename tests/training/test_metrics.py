"""The metrics sink (training/metrics.py): metrics.jsonl, TensorBoard, console, resume."""

import json
import math
import os

import numpy as np
import pytest
from tensorboard.backend.event_processing import event_accumulator

from gpt_oss_train.training.metrics import MetricsWriter, read_metrics_jsonl

# --------------------------------------------------------------------------
# MetricsWriter
# --------------------------------------------------------------------------


def _tb_scalars(logdir):
    acc = event_accumulator.EventAccumulator(logdir, size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _records(n, start=0):
    return [
        (
            start + i,
            {"loss": 5.0 / (start + i + 1), "lr": 1e-4 * (start + i), "tokens": 4096 * (start + i)},
        )
        for i in range(n)
    ]


def test_writer_jsonl_tensorboard_console_and_resume(tmp_path):
    lines = []
    first = _records(4)
    with MetricsWriter(tmp_path, total_steps=10, console=lines.append) as w:
        for step, scalars in first:
            w.write(step, scalars)
        # Flushed per call: readable while the writer is still open (a killed run).
        with open(tmp_path / "metrics.jsonl") as f:
            assert len(f.readlines()) == 4
        assert [s for s, _ in _tb_scalars(str(tmp_path / "tensorboard"))["loss"]] == [0, 1, 2, 3]

    rows = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
    assert len(rows) == 4
    for row, (step, scalars) in zip(rows, first):
        assert set(row) == {"step", "time", "loss", "lr", "tokens"}
        assert row["step"] == step
        assert row["loss"] == scalars["loss"] and row["lr"] == scalars["lr"]
        assert row["tokens"] == scalars["tokens"] and isinstance(row["tokens"], int)
        assert abs(row["time"] - rows[0]["time"]) < 60
    assert len(lines) == 4
    assert lines[0].startswith("step 0/10 | loss 5 | lr 0 | tokens 0")
    assert lines[3].startswith("step 3/10 | loss 1.25 | lr 3.000e-04 | tokens 12288")
    assert "eta" not in lines[0] and "eta" in lines[3]

    # Resume: a new writer appends, does not truncate.
    second = _records(3, start=4)
    with MetricsWriter(tmp_path, total_steps=10, console=lines.append) as w:
        for step, scalars in second:
            w.write(step, scalars)
    rows = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows] == list(range(7))
    assert [r["loss"] for r in rows] == [s["loss"] for _, s in first + second]

    tb = _tb_scalars(str(tmp_path / "tensorboard"))
    assert len(os.listdir(tmp_path / "tensorboard")) == 2
    assert set(tb) == {"loss", "lr", "tokens"}
    expected = first + second
    assert [s for s, _ in tb["loss"]] == [s for s, _ in expected]
    for tag in ("loss", "lr", "tokens"):
        # TensorBoard stores float32 simple_values.
        np.testing.assert_allclose(
            [v for _, v in tb[tag]], [float(np.float32(s[tag])) for _, s in expected], rtol=0
        )


def test_writer_none_and_nan(tmp_path):
    with MetricsWriter(tmp_path, console=lambda line: None) as w:
        w.write(1, {"loss": float("nan"), "perf/mfu": None, "grad_norm": np.float32(0.5)})
        with pytest.raises(ValueError):
            w.write(2, {"step": 3.0})
    (row,) = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
    assert row["loss"] is None and row["perf/mfu"] is None and row["grad_norm"] == 0.5
    tb = _tb_scalars(str(tmp_path / "tensorboard"))
    assert set(tb) == {"loss", "grad_norm"}  # None is not logged to TensorBoard
    assert math.isnan(tb["loss"][0][1]) and tb["grad_norm"] == [(1, 0.5)]


def test_writer_eta_from_recent_steps(tmp_path):
    now = [100.0]
    lines = []
    w = MetricsWriter(
        tmp_path, total_steps=1000, console=lines.append, clock=lambda: now[0], eta_window=3
    )
    w.write(10, {"loss": 1.0})
    assert w.eta_seconds() is None
    now[0] += 500.0  # slow first interval, later dropped from the window
    for step in (20, 30, 40, 50):
        w.write(step, {"loss": 1.0})
        now[0] += 20.0  # 2 s per step from here on
    # The last write came at now - 20; window holds steps 20..50 at 2 s/step.
    assert w.eta_seconds() == pytest.approx((1000 - 50) * 2.0)
    assert lines[-1].endswith("eta 31m40s")
    w.close()
    w.close()  # idempotent


def test_writer_non_primary_is_noop(tmp_path):
    with MetricsWriter(tmp_path / "run", is_primary=False, total_steps=5) as w:
        w.write(1, {"loss": 1.0})
        w.flush()
    assert not (tmp_path / "run").exists()


def test_read_metrics_jsonl_resume_from_earlier_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with MetricsWriter(tmp_path, console=lambda line: None) as w:
        for step in (1, 2, 3, 4):
            w.write(step, {"loss": float(step)})
    with MetricsWriter(tmp_path, console=lambda line: None) as w:  # restored from step 2
        for step in (3, 4, 5):
            w.write(step, {"loss": 10.0 + step})
    with open(path, "a") as f:
        f.write('{"step": 6, "lo')  # killed mid-line
    rows = read_metrics_jsonl(path)
    assert [(r["step"], r["loss"]) for r in rows] == [
        (1, 1.0),
        (2, 2.0),
        (3, 13.0),
        (4, 14.0),
        (5, 15.0),
    ]


def test_resumed_writer_drops_the_replayed_steps_once(tmp_path):
    """A run resumed from step 3 replays steps 4 and 5: metrics.jsonl keeps steps 1-3 of
    the first run (and no half-written line) and gets 4 and 5 once, from the second run;
    TensorBoard, told by a session-start event at step 4, shows the second run's values
    from there on."""
    with MetricsWriter(tmp_path, console=lambda line: None) as w:
        for step in range(1, 7):
            w.write(step, {"loss": float(step)})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "lo')  # killed mid-line
    with MetricsWriter(tmp_path, console=lambda line: None, resume_step=3) as w:
        for step in (4, 5):
            w.write(step, {"loss": 10.0 + step})
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [(r["step"], r["loss"]) for r in rows] == [
        (1, 1.0),
        (2, 2.0),
        (3, 3.0),
        (4, 14.0),
        (5, 15.0),
    ]
    assert _tb_scalars(str(tmp_path / "tensorboard"))["loss"] == [
        (1, 1.0),
        (2, 2.0),
        (3, 3.0),
        (4, 14.0),
        (5, 15.0),
    ]
