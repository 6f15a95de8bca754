"""Two real JAX processes on this machine (jax.distributed with gloo CPU collectives),
4 fake CPU devices each, running `gpt_oss_train.train` through launch/local.sh exactly as a
user would: train 4 steps with a checkpoint every 2, then run again to 6 steps, which must
resume from step 4 with each process's data-iterator state.

What the single-process tests cannot show: the coordinator handshake, a mesh spanning two
processes, global batches assembled from per-process shards, Orbax saving and restoring
arrays that no single process holds whole, one grain iterator state per process, and
metrics written by process 0 alone.
"""

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from support import ROOT

from gpt_oss_train.training import data as data_lib

NUM_PROCESSES = 2
DEVICES_PER_PROCESS = 4
SEQ_LEN, BATCH, MAX_DOCS, SEED = 16, 8, 64, 0
# Narrower than cpu_tiny: gloo moves every gradient through loopback sockets, and at
# width 64 the 201k-row embedding makes each step ~3 s; at 16 it is ~1.5 s.
SMALLER = [
    "--config.model.hidden_size=16",
    "--config.model.num_heads=2",
    "--config.model.num_kv_heads=1",
    "--config.model.head_dim=8",
    "--config.model.intermediate_size=16",
]
# Generous: one launch takes ~15 s on an idle 2-core machine (mostly compilation), but
# CI may run other work beside it. A hang (a process stuck in a collective) is killed.
LAUNCH_TIMEOUT_S = 240

pytestmark = [
    pytest.mark.full,  # several jax.distributed processes
    pytest.mark.multiprocess,
    pytest.mark.skipif(sys.platform == "win32", reason="launch/local.sh is bash"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _launch(workdir: str, steps: int, cache_dir: str) -> str:
    """Runs the training command as 2 processes; returns their combined, prefixed output."""
    env = dict(os.environ)
    # conftest gives this process 8 devices; each child gets its own 4 (local.sh adds the
    # count). Compiling is most of a launch's time on 2 cores: LLVM's cheap settings halve
    # it (the steps run about as fast), and the compilation cache lets the resumed run skip
    # recompiling the train step.
    env.update(
        JAX_PLATFORMS="cpu",
        COORDINATOR_PORT=str(_free_port()),
        DEVICES_PER_PROCESS=str(DEVICES_PER_PROCESS),
        JAX_COMPILATION_CACHE_DIR=cache_dir,
        XLA_FLAGS="--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true",
    )
    cmd = [
        "bash",
        os.path.join(ROOT, "launch", "local.sh"),
        str(NUM_PROCESSES),
        sys.executable,
        "-m",
        "gpt_oss_train.train",
        "--config=configs/cpu_tiny.py",
        f"--workdir={workdir}",
        f"--config.train.steps={steps}",
        f"--config.train.seq_len={SEQ_LEN}",
        f"--config.train.global_batch_size={BATCH}",
        "--config.train.log_every=1",
        "--config.train.eval_every=0",
        "--config.checkpoint.every=2",
        f"--config.data.max_docs={MAX_DOCS}",
        f"--config.seed={SEED}",
        *SMALLER,
    ]
    # Own process group, so a timeout kills the launcher and both trainers with it.
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(
            f"2-process run to step {steps} hung (> {LAUNCH_TIMEOUT_S} s); output tail:\n"
            + out[-6000:]
        )
    if proc.returncode != 0:
        pytest.fail(
            f"2-process run to step {steps} exited {proc.returncode}; output tail:\n" + out[-6000:]
        )
    return out


def _metrics(workdir: str) -> list[dict]:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def _check_complete_checkpoint(ckpt_dir: str, step: int):
    d = os.path.join(ckpt_dir, str(step))
    assert os.path.isdir(d), f"no checkpoint for step {step}: {sorted(os.listdir(ckpt_dir))}"
    items = set(os.listdir(d))
    for item in ("model_config", "params", "opt_state", "meta", "data"):
        assert item in items, f"{d} lacks {item}: {sorted(items)}"
    # Orbax writes into a temporary folder and renames it when every process has finished.
    assert not [n for n in os.listdir(ckpt_dir) if "tmp" in n], os.listdir(ckpt_dir)
    with open(os.path.join(d, "meta", "metadata")) as f:
        assert json.load(f)["step"] == step
    # Each process wrote its own shards of the arrays and its own iterator state.
    for item in ("params", "opt_state"):
        shard_dirs = {
            n for n in os.listdir(os.path.join(d, item)) if n.startswith("ocdbt.process_")
        }
        assert shard_dirs == {f"ocdbt.process_{i}" for i in range(NUM_PROCESSES)}, shard_dirs
    data = sorted(os.listdir(os.path.join(d, "data")))
    assert [n for n in data if n.endswith(".json")] == [
        f"process_{i}-of-{NUM_PROCESSES}.json" for i in range(NUM_PROCESSES)
    ], data


def _iterator_state(ckpt_dir: str, step: int, process: int) -> dict:
    path = os.path.join(ckpt_dir, str(step), "data", f"process_{process}-of-{NUM_PROCESSES}.json")
    with open(path) as f:
        return json.load(f)


def _expected_iterator_state(process: int, batches: int) -> dict:
    """The state process `process` must have after `batches` batches: its own pipeline,
    rebuilt here without JAX, advanced the same number of steps."""
    pipeline = data_lib.make_pipeline(
        "stdlib",
        seq_len=SEQ_LEN,
        global_batch_size=BATCH,
        seed=SEED,
        shuffle=True,
        process_index=process,
        process_count=NUM_PROCESSES,
        max_docs=MAX_DOCS,
    )
    for _ in range(batches):
        next(pipeline)
    return json.loads(json.dumps(pipeline.iterator.get_state()))


@pytest.mark.full
def test_two_processes_train_checkpoint_and_resume(tmp_path):
    workdir = str(tmp_path / "run")
    cache_dir = str(tmp_path / "jax_cache")
    ckpt_dir = os.path.join(workdir, "checkpoints")

    t0 = time.perf_counter()
    out = _launch(workdir, steps=4, cache_dir=cache_dir)
    first_s = time.perf_counter() - t0
    # Both processes joined one job; a single-process run would log neither line.
    assert "[0] " in out and "[1] " in out, out[-3000:]
    assert "Starting JAX distributed service" in out, out[-3000:]
    assert out.count("Connecting to JAX distributed service") == NUM_PROCESSES, out[-3000:]

    records = _metrics(workdir)
    # One line per step: process 1 wrote nothing (it would have duplicated every step).
    assert [r["step"] for r in records] == [1, 2, 3, 4], records
    losses = [r["loss"] for r in records]
    assert all(x is not None and math.isfinite(x) for x in losses), losses
    assert losses[-1] < losses[0], losses
    # The global batch was split over 8 devices: tokens/s/device x step time = tokens / 8.
    for r in records[1:]:
        per_device_tokens = r["perf/per_device_tokens_per_sec"] * r["perf/step_time_seconds"]
        devices = BATCH * SEQ_LEN / per_device_tokens
        assert devices == pytest.approx(NUM_PROCESSES * DEVICES_PER_PROCESS, rel=1e-6), r

    for step in (2, 4):
        _check_complete_checkpoint(ckpt_dir, step)
    # Each process saved the position of its own, disjoint share of the documents.
    states = [_iterator_state(ckpt_dir, 4, p) for p in range(NUM_PROCESSES)]
    assert states[0] != states[1], states
    for p in range(NUM_PROCESSES):
        assert states[p] == _expected_iterator_state(p, 4), p

    t0 = time.perf_counter()
    out = _launch(workdir, steps=6, cache_dir=cache_dir)
    second_s = time.perf_counter() - t0
    assert out.count("Resumed from") == NUM_PROCESSES, out[-3000:]
    assert "at step 4" in out, out[-3000:]
    records = _metrics(workdir)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6], records
    assert all(math.isfinite(r["loss"]) for r in records[4:]), records
    _check_complete_checkpoint(ckpt_dir, 6)
    # Restored iterators went on from step 4: after 2 more batches each process is exactly
    # where an uninterrupted 6-batch pipeline would be.
    for p in range(NUM_PROCESSES):
        assert _iterator_state(ckpt_dir, 6, p) == _expected_iterator_state(p, 6), p
    # cpu_tiny keeps 2 checkpoints.
    assert sorted(int(n) for n in os.listdir(ckpt_dir) if n.isdigit()) == [4, 6]
    print(f"2-process runs: {first_s:.0f} s to step 4, {second_s:.0f} s resuming to step 6")
