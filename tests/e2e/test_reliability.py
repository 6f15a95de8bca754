"""Faults injected into training and decoding, and what must survive them: a non-finite
step, a damaged newest checkpoint, a save that fails on a full or read-only disk, a
process of a multi-process launch that dies. Each test checks that no finite checkpoint
was lost. Runs use one CPU device and a narrow model (the 201,088-row vocabulary with
width 16), in-process unless the command line itself is under test."""

import hashlib
import json
import os
import shutil
import subprocess
import sys

import grain
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import ROOT

from gpt_oss_train import config as config_lib
from gpt_oss_train import train as train_lib
from gpt_oss_train.checkpoints import checkpoint as ckpt_lib
from gpt_oss_train.errors import RunStopped
from gpt_oss_train.model.transformer import ModelDef
from gpt_oss_train.training import steps as steps_lib
from gpt_oss_train.training.metrics import read_metrics_jsonl

pytestmark = pytest.mark.full  # fault injection over training runs: minutes


def run(config, workdir):
    return train_lib.train(config, str(workdir), devices=jax.devices()[:1])


def digest(path) -> str:
    """sha256 over every file's relative path and bytes under `path`."""
    h = hashlib.sha256()
    for folder, dirs, files in sorted(os.walk(path)):
        dirs.sort()
        for name in sorted(files):
            p = os.path.join(folder, name)
            h.update(os.path.relpath(p, path).encode())
            h.update(open(p, "rb").read())
    return h.hexdigest()


def params_at(config, workdir, step):
    """The params of checkpoint `step` (a step folder restores that step only)."""
    arch = ckpt_lib.read_model_config(str(workdir))
    md = ModelDef(config_lib.ModelConfig.from_config(config, arch))
    folder = os.path.join(workdir, "checkpoints", str(step))
    return ckpt_lib.load_params(folder, md.abstract_params())[0]


# ----------------------------------------------------------------------------- non-finite


def test_nonfinite_step_changes_nothing_but_the_step(small_config):
    """One weight set to inf makes the loss and every gradient non-finite: the compiled
    step skips the update, so parameters and optimizer state come back bit for bit and
    the step counter advances. The same step on finite weights updates every leaf."""
    c = small_config()
    arch = dict(config_lib.model_arch(c), vocab_size=300)
    md = ModelDef(config_lib.ModelConfig.from_config(c, arch))
    tx, schedule = steps_lib.make_optimizer(c.train)
    rng = np.random.default_rng(0)
    params = jax.tree.map(
        lambda a: jnp.asarray(0.1 * rng.standard_normal(a.shape), a.dtype), md.abstract_params()
    )
    broken = jax.tree.map(lambda a: a, params)
    broken["unembed"]["kernel"] = broken["unembed"]["kernel"].at[0, 0].set(jnp.inf)
    ids = rng.integers(0, 300, (8, 17)).astype(np.int32)
    batch = {
        "inputs": ids[:, :-1],
        "targets": ids[:, 1:],
        "positions": np.tile(np.arange(16, dtype=np.int32), (8, 1)),
        "segment_ids": np.ones((8, 16), np.int32),
        "loss_mask": np.ones((8, 16), np.int32),
    }
    step = jax.jit(steps_lib.make_train_step(md, tx, schedule, c.train))
    for p, skipped in ((broken, 1.0), (params, 0.0)):
        state = {"step": jnp.int32(3), "params": p, "opt_state": tx.init(p)}
        before = jax.tree.map(np.asarray, state)
        new, metrics = step(state, batch)
        assert float(metrics["skipped"]) == skipped
        assert not skipped or not np.isfinite(float(metrics["grad_norm"]))
        assert int(new["step"]) == 4
        same = [
            np.array_equal(a, np.asarray(b), equal_nan=True)
            for a, b in zip(jax.tree.leaves(before["params"]), jax.tree.leaves(new["params"]))
        ]
        assert all(same) if skipped else not any(same)
        moments = zip(jax.tree.leaves(before["opt_state"]), jax.tree.leaves(new["opt_state"]))
        assert all(np.array_equal(a, np.asarray(b)) for a, b in moments) == bool(skipped)


def test_diverging_run_stops_and_its_newest_checkpoint_is_the_last_finite_one(
    tmp_path, small_config, train_cli
):
    """learning_rate=1e6: the loss turns non-finite within a few steps. The run skips those
    steps, stops after max_nonfinite_steps of them in a row with one line and exit 1, and
    saves nothing after the last finite step: that one is the newest checkpoint, and every
    checkpoint left holds finite parameters."""
    cmd, env = train_cli(
        tmp_path,
        "--config.train.steps=14",
        "--config.train.learning_rate=1e6",
        "--config.train.max_nonfinite_steps=3",
        "--config.checkpoint.every=1",
        "--config.checkpoint.keep=2",
    )
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 1, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: 3 steps in a row (to step "), last
    records = read_metrics_jsonl(tmp_path / "metrics.jsonl")
    finite = [x["step"] for x in records if x["loss"] is not None and x["grad_norm"] is not None]
    bad = [x["step"] for x in records if x["step"] not in finite]
    newest = max(finite)
    assert bad == [newest + 1, newest + 2, newest + 3] and finite == list(range(1, newest + 1))
    assert f"the newest checkpoint, step {newest}," in last
    kept = sorted(int(n) for n in os.listdir(tmp_path / "checkpoints"))
    assert kept == [newest - 1, newest]
    for step in kept:
        assert all(
            np.isfinite(np.asarray(p)).all()
            for p in jax.tree.leaves(params_at(small_config(), tmp_path, step))
        )
    assert records[-1]["skipped_steps"] == 3


def test_decode_writes_valid_json_from_a_model_that_gives_nan(tmp_path, small_config):
    """A checkpoint whose unembedding is NaN (not one training writes any more, but a
    converted or hand-made one can be) gives NaN log-probabilities: decode writes null."""
    arch = config_lib.model_arch(small_config())
    arch["vocab_size"] = 300
    c = small_config()
    md = ModelDef(config_lib.ModelConfig.from_config(c, arch))
    params = md.init(0)
    params["unembed"]["kernel"] = jnp.full_like(params["unembed"]["kernel"], jnp.nan)
    ckpt_lib.save_params_only(str(tmp_path / "ckpt"), params, arch)
    (tmp_path / "in.jsonl").write_text('{"tokens": [1, 2, 3]}\n{"tokens": [5, 6, 7, 8]}\n')
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    for mode, extra in (("generate", ["--max_new_tokens=3"]), ("score", [])):
        out = tmp_path / f"{mode}.jsonl"
        cmd = [
            sys.executable,
            "-m",
            "gpt_oss_train.decode",
            f"--checkpoint={tmp_path / 'ckpt'}",
            f"--mode={mode}",
            f"--input={tmp_path / 'in.jsonl'}",
            f"--output={out}",
            "--dtype=float32",
            *extra,
        ]
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]

        def no_constants(name):
            raise AssertionError(f"{mode}: bare {name} is not JSON")

        rows = [
            json.loads(line, parse_constant=no_constants) for line in out.read_text().splitlines()
        ]
        assert len(rows) == 2
        assert all(v is None for row in rows for v in row["logprobs"]), rows
    assert all(row["sum_logprob"] is None and row["perplexity"] is None for row in rows)


# ----------------------------------------------------------------------------- damaged


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory, small_config):
    """A workdir trained 4 steps, with checkpoints 2 and 4 (the template each damage
    test copies), and the losses of the uninterrupted 6-step run of the same config."""
    path = tmp_path_factory.mktemp("four") / "run"
    run(small_config(steps=4), path)
    six = losses_of(run(small_config(steps=6), tmp_path_factory.mktemp("six") / "run"))
    return path, six


def losses_of(summary) -> dict:
    return dict(summary["losses"])


def _truncate_params(step_dir):
    folder = step_dir / "params" / "ocdbt.process_0" / "d"
    biggest = max(folder.iterdir(), key=lambda p: p.stat().st_size)
    with open(biggest, "r+b") as f:
        f.truncate(1000)
    return str(biggest.relative_to(step_dir))


def _empty_data_state(step_dir):
    (step_dir / "data" / "process_0-of-1.json").write_text("")
    return "data/process_0-of-1.json"


# How each damage is found and named: against the file sizes recorded after the save; by
# parsing the JSON files (a checkpoint whose record was never written); by the restore
# itself, where TensorStore names the item folder it could not read.
DAMAGES = {
    "truncated params file": (_truncate_params, True, lambda rel, step: f"{rel}: 1000 bytes, "),
    "emptied iterator state": (_empty_data_state, False, lambda rel, step: f"{rel}: empty"),
    "truncated, no size record": (_truncate_params, False, lambda rel, step: f"{step}/params/"),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_damaged_newest_checkpoint_is_named_set_aside_and_the_previous_one_resumes(
    damage, four_steps, tmp_path, caplog, small_config
):
    template, uninterrupted = four_steps
    workdir = tmp_path / "run"
    shutil.copytree(template, workdir)
    step4 = workdir / "checkpoints" / "4"
    hurt, keep_record, name = DAMAGES[damage]
    if not keep_record:
        (step4 / "file_sizes.json").unlink()
    named = name(hurt(step4), step4)
    damaged = digest(step4)
    good = digest(workdir / "checkpoints" / "2")

    # decode's reader (ckpt_lib.load_params, which loading.load_model uses) falls back too,
    # and changes nothing.
    arch = ckpt_lib.read_model_config(str(workdir))
    md = ModelDef(config_lib.ModelConfig.from_config(small_config(), arch))
    _, _, step = ckpt_lib.load_params(str(workdir), md.abstract_params())
    assert digest(step4) == damaged
    if damage == "emptied iterator state":  # decode reads no iterator state: step 4 serves
        assert step == 4
    else:
        assert step == 2
        assert any(
            "CHECKPOINT DAMAGED: step 4" in r.getMessage() and named in r.getMessage()
            for r in caplog.records
        )

    caplog.clear()
    summary = run(small_config(steps=6), workdir)
    messages = [r.getMessage() for r in caplog.records]
    assert any("CHECKPOINT DAMAGED: step 4" in m and named in m for m in messages), messages
    # Moved aside whole, never deleted; the older checkpoint was only read.
    assert digest(workdir / "damaged_checkpoints" / "4") == damaged
    assert sorted(os.listdir(workdir / "checkpoints")) == ["2", "4", "6"]
    assert digest(workdir / "checkpoints" / "2") == good
    # The replayed steps are those of the uninterrupted run, bit for bit.
    assert losses_of(summary) == {s: uninterrupted[s] for s in (3, 4, 5, 6)}
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4, 5, 6]  # each once


def test_no_restorable_checkpoint_is_refused_and_nothing_moves(four_steps, tmp_path, small_config):
    workdir = tmp_path / "run"
    shutil.copytree(four_steps[0], workdir)
    _truncate_params(workdir / "checkpoints" / "4")
    _empty_data_state(workdir / "checkpoints" / "2")
    before = digest(workdir / "checkpoints")
    with pytest.raises(
        ckpt_lib.CheckpointError, match=r"no checkpoint can be restored \(damaged steps \[4, 2\]"
    ):
        run(small_config(steps=6), workdir)
    assert digest(workdir / "checkpoints") == before
    assert not (workdir / "damaged_checkpoints").exists()


# ----------------------------------------------------------------------------- failed saves


def _mount(*args) -> bool:
    return subprocess.run(["mount", *args], capture_output=True).returncode == 0


@pytest.fixture
def small_checkpoint_disk(tmp_path, small_config):
    """A workdir whose checkpoints/ folder is its own tmpfs (root only), holding the
    checkpoint of a 2-step run; yields (workdir, remount) where remount(options) changes
    the tmpfs (size=..., ro)."""
    workdir = tmp_path / "run"
    folder = workdir / "checkpoints"
    folder.mkdir(parents=True)
    if os.geteuid() != 0 or not _mount("-t", "tmpfs", "-o", "size=512m", "tmpfs", str(folder)):
        pytest.skip("needs root to mount a tmpfs")
    try:
        run(small_config(steps=2, learning_rate=1e-3), workdir)
        yield workdir, lambda options: _mount("-o", f"remount,{options}", str(folder))
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def _used_bytes(folder) -> int:
    st = os.statvfs(folder)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


@pytest.mark.parametrize(
    "fault,retries,cause",
    [
        ("full", 0, "No space left on device"),
        ("read-only", 0, "Read-only file system"),
        ("read-only", 1, "Read-only file system"),
    ],
)
def test_failed_save_is_reported_when_it_finishes_and_the_previous_checkpoint_survives(
    small_checkpoint_disk, fault, retries, cause, caplog, small_config
):
    """The save of step 4 fails (a full disk: the tmpfs shrunk to what checkpoint 2 uses;
    or a read-only one). The failure is one line naming the cause, reported before the
    next checkpoint step (8): as soon as the save finished; the partial folder is gone and
    checkpoint 2 is intact. With checkpoint.max_failed_saves=1 the run goes on, tries again
    at step 8 and stops there."""
    workdir, remount = small_checkpoint_disk
    folder = workdir / "checkpoints"
    before = digest(folder / "2")
    options = f"size={_used_bytes(folder) + 64 * 1024}" if fault == "full" else "ro"
    assert remount(options)
    c = small_config(steps=12, learning_rate=1e-3)
    c.checkpoint.update(every=4, max_failed_saves=retries)
    with pytest.raises(RunStopped) as e:
        run(c, workdir)
    failed_at = 8 if retries else 4
    message = str(e.value)
    assert message.startswith(f"saving checkpoint step {failed_at} to {folder} failed: {cause}")
    assert "the newest checkpoint, step 2, is intact" in message
    logged = max(r["step"] for r in read_metrics_jsonl(workdir / "metrics.jsonl"))
    assert failed_at <= logged < failed_at + 4, logged  # noticed before the next save
    if retries:
        assert any("1 of 1 failed saves allowed" in r.getMessage() for r in caplog.records)
    assert sorted(os.listdir(folder)) == ["2"]  # no partial folder left
    assert digest(folder / "2") == before


# ----------------------------------------------------------------------------- launcher


@pytest.mark.multiprocess
def test_local_launcher_stops_survivors_without_promising_a_checkpoint(tmp_path):
    """When one process of a launch/local.sh job fails, the others cannot checkpoint (that
    needs every process): the launcher says so and stops them without SIGTERM, so none
    logs 'saving a checkpoint'; the job exits with the failure's status."""
    script = (
        "import os, signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: print('SIGTERM received: saving a "
        "checkpoint', flush=True))\n"
        "if os.environ['JAX_PROCESS_ID'] == '1':\n"
        "    sys.exit(3)\n"
        "print('waiting in a collective', flush=True)\n"
        "time.sleep(600)\n"
    )
    r = subprocess.run(
        ["bash", os.path.join(ROOT, "launch", "local.sh"), "2", sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 3, r.stdout + r.stderr
    assert "[0] waiting in a collective" in r.stdout
    assert "SIGTERM" not in r.stdout
    # The survivor sleeps for 600 s: the timeout above fails the test unless it was stopped.
    assert "process 1 exited with status 3; the others cannot save a checkpoint" in r.stderr


def test_back_to_back_async_saves_each_get_their_integrity_record(tmp_path):
    """A save started while the previous one is still under way (no poll between them)
    settles that one first: every step gets its file_sizes.json, which a restore checks."""
    arch = config_lib.model_arch(config_lib.from_file(os.path.join(ROOT, "configs", "cpu_tiny.py")))
    ckpt = ckpt_lib.TrainCheckpointer(str(tmp_path), arch=arch, every=1, keep=5, async_save=True)
    data = iter(grain.MapDataset.range(8).to_iter_dataset())
    for step in (1, 2, 3):
        params = {"w": np.full((512, 64), step, np.float32)}
        assert ckpt.save(step, params, {"m": np.zeros(3, np.float32)}, data, 0, force=True)
    ckpt.close()
    assert ckpt.failure is None, ckpt.failure
    for step in (1, 2, 3):
        assert os.path.isfile(tmp_path / "checkpoints" / str(step) / "file_sizes.json"), step
