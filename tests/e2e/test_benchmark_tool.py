"""gpt_oss_train.tools.bench_model as a user runs it: one JSON record per measurement."""

import gzip
import json
import os
import subprocess
import sys

import pytest
from support import ROOT

from gpt_oss_train.decode.benchmarking import summarize_trace

pytestmark = pytest.mark.full  # the benchmark tool end to end


def run(*args):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpt_oss_train.tools.bench_model",
            "--config=configs/cpu_tiny.py",
            "--config.train.global_batch_size=2",
            "--config.train.seq_len=16",
            *args,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]


def test_train_and_decode_records():
    (train,) = run("--mode=train", "--steps=1")
    assert train["batch"] == 2 and train["seq_len"] == 16
    assert train["step_time_seconds"] > 0 and train["per_device_tokens_per_sec"] > 0
    assert 11 < train["loss"] < 13  # ln(201088) = 12.2 at random init
    assert train["mfu"] is None  # no peak FLOP/s is known for a CPU
    # XLA's memory of the step, per device: at least the float32 parameters and their two
    # Adam moments (the 201,088 x 64 embedding and unembedding alone are 98 MiB together)
    assert 3 * 98 / 1024 < train["compiled_memory_gb"] < 4
    (compiled,) = run("--mode=train", "--steps=0")  # compile only
    assert compiled["compiled_memory_gb"] == train["compiled_memory_gb"]
    assert "step_time_seconds" not in compiled and "loss" not in compiled
    rows = run("--mode=decode", "--batch_sizes=1,2", "--prompt_len=8", "--new_tokens=4")
    assert [r["batch"] for r in rows] == [1, 2]
    assert all(r["decode_tok_s"] > 0 and r["prefill_tok_s"] > 0 for r in rows)


def test_trace_summary_adds_device_kernel_time(tmp_path):
    """summarize_trace on a hand-written Perfetto trace: host events are ignored, device
    kernels are summed by name, and launches are counted per decode step."""
    events = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "X", "pid": 1, "ts": 0.0, "dur": 999.0, "name": "PjitFunction(decode)"},
        {"ph": "X", "pid": 2, "ts": 10.0, "dur": 300.0, "name": "gemm"},
        {"ph": "X", "pid": 2, "ts": 400.0, "dur": 100.0, "name": "reduce"},
        {"ph": "X", "pid": 2, "ts": 600.0, "dur": 300.0, "name": "gemm"},
    ]
    d = tmp_path / "plugins" / "profile" / "run"
    d.mkdir(parents=True)
    with gzip.open(d / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    s = summarize_trace(str(tmp_path), steps=2)
    assert s["events"] == 3 and s["events_per_step"] == 1.5
    assert abs(s["device_busy_ms"] - 0.7) < 1e-9
    assert abs(s["device_span_ms"] - 0.89) < 1e-9  # from 10 us to 900 us
    assert [(t["name"], t["count"]) for t in s["top"]] == [("gemm", 2), ("reduce", 1)]
    assert abs(s["top"][0]["share"] - 600 / 700) < 1e-9


def test_trace_summary_of_a_cpu_run_counts_each_op_once(tmp_path):
    """A CPU trace has no device processes: XLA:CPU's ops on its worker threads stand in,
    the executor's own spans are left out, and a `while` op is charged only the time its
    body's ops (nested in its span on the same thread) did not take."""
    worker = {"name": "tf_XLAEigen/123"}
    events = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "M", "pid": 1, "tid": 7, "name": "thread_name", "args": worker},
        {"ph": "M", "pid": 1, "tid": 8, "name": "thread_name", "args": {"name": "python"}},
        {"ph": "X", "pid": 1, "tid": 8, "ts": 0.0, "dur": 5000.0, "name": "PjitFunction(step)"},
        {"ph": "X", "pid": 1, "tid": 7, "ts": 0.0, "dur": 2000.0, "name": "ThunkExecutor::Execute"},
        {"ph": "X", "pid": 1, "tid": 7, "ts": 100.0, "dur": 1000.0, "name": "while.3"},
        {"ph": "X", "pid": 1, "tid": 7, "ts": 150.0, "dur": 400.0, "name": "dot.1"},
        {"ph": "X", "pid": 1, "tid": 7, "ts": 600.0, "dur": 300.0, "name": "dot.1"},
        {"ph": "X", "pid": 1, "tid": 7, "ts": 1200.0, "dur": 200.0, "name": "fusion.2"},
    ]
    d = tmp_path / "plugins" / "profile" / "run"
    d.mkdir(parents=True)
    with gzip.open(d / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    s = summarize_trace(str(tmp_path), steps=1)
    got = {t["name"]: (round(t["ms"], 6), t["count"]) for t in s["top"]}
    assert got == {"dot.1": (0.7, 2), "while.3": (0.3, 1), "fusion.2": (0.2, 1)}
    assert abs(s["device_busy_ms"] - 1.2) < 1e-9  # the while's 1 ms span less its 0.7 ms body
    assert abs(s["device_span_ms"] - 1.3) < 1e-9  # 100 us to 1400 us
