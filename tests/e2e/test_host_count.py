"""Runs that change hands: the same training command on 1 and on 2 JAX processes
(launch/local.sh, 4 CPU devices in all) trains on the same batches when the data is
pre-tokenized, and a checkpoint 2 processes wrote to a gs:// workdir (the local GCS
emulator) resumes on 1 process with the batches an uninterrupted run would have seen.
A second trainer started on a workdir in use is refused in one line, before any work,
and the first run goes on to save its checkpoint."""

import json
import os
import signal
import subprocess
import time

import pytest
from support import ROOT

from gpt_oss_train.io import storage, workdir_lock

pytestmark = pytest.mark.full  # several training processes

# LLVM's cheap settings halve compile time on 2 cores; every run here uses them alike.
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def _launch(train_cli, processes: int, workdir: str, *overrides: str) -> dict[int, float]:
    """Trains through launch/local.sh on `processes` processes sharing 4 devices; returns
    the losses metrics.jsonl holds by step."""
    cmd, env = train_cli(workdir, "--config.checkpoint.every=2", *overrides)
    env.update(DEVICES_PER_PROCESS=str(4 // processes), XLA_FLAGS=FAST_COMPILE)
    launch = ["bash", os.path.join(ROOT, "launch", "local.sh"), str(processes), *cmd]
    r = subprocess.run(launch, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = storage.read_text(storage.join(workdir, "metrics.jsonl")).splitlines()
    records = [json.loads(line) for line in lines]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


@pytest.mark.full
@pytest.mark.multiprocess
def test_pretokenized_run_is_the_same_on_1_and_2_processes_and_resumes_across(
    train_cli, pretokenized_corpus, gcs_dir, tmp_path
):
    data = [f"--config.data.source={pretokenized_corpus}", "--config.train.global_batch_size=8"]
    reference = _launch(train_cli, 1, str(tmp_path / "one"), "--config.train.steps=4", *data)
    assert sorted(reference) == [1, 2, 3, 4]

    two = _launch(train_cli, 2, gcs_dir, "--config.train.steps=2", *data)
    assert two == pytest.approx({s: reference[s] for s in (1, 2)}, rel=1e-6, abs=0)
    assert "2" in storage.listdir(storage.join(gcs_dir, "checkpoints"))

    # Step 2's checkpoint, written by 2 processes, resumes on 1: steps 3 and 4 see the
    # batches of the uninterrupted run.
    resumed = _launch(train_cli, 1, gcs_dir, "--config.train.steps=4", *data)
    assert resumed == pytest.approx(reference, rel=1e-6, abs=0)


def test_second_trainer_is_refused_and_the_first_saves(train_cli, tmp_path):
    workdir = tmp_path / "run"
    cmd, env = train_cli(workdir, "--config.train.steps=100000", "--config.checkpoint.every=1000")
    env["XLA_FLAGS"] = FAST_COMPILE
    first = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 300
        while not (workdir / workdir_lock.LOCK_NAME).exists():
            assert first.poll() is None and time.monotonic() < deadline, first.stdout.read()
            time.sleep(0.2)

        second = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert second.returncode == 2, second.stderr[-3000:]
        errors = [line for line in second.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "workdir" in errors[0] and str(first.pid) in errors[0], errors
        assert "Traceback" not in second.stderr

        # The first run still owns the workdir and trains; once it has logged a step (its
        # SIGTERM handler is in place), SIGTERM saves that step and it exits 0.
        metrics = workdir / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().strip()):
            assert first.poll() is None and time.monotonic() < deadline, first.stdout.read()
            time.sleep(0.2)
        first.send_signal(signal.SIGTERM)
        out, _ = first.communicate(timeout=300)
    finally:
        first.kill()
    assert first.returncode == 0, out[-3000:]
    steps = [int(n) for n in os.listdir(workdir / "checkpoints") if n.isdigit()]
    assert len(steps) == 1 and steps[0] > 0, steps
    assert not (workdir / workdir_lock.LOCK_NAME).exists()
