"""tools/benchmark.py as a user runs it: one JSON record per measurement."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    r = subprocess.run(
        [
            sys.executable,
            "tools/benchmark.py",
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
    rows = run("--mode=decode", "--batch_sizes=1,2", "--prompt_len=8", "--new_tokens=4")
    assert [r["batch"] for r in rows] == [1, 2]
    assert all(r["decode_tok_s"] > 0 and r["prefill_tok_s"] > 0 for r in rows)
