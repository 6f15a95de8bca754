"""Every mistake a user can make on the train command line or in its data is reported by the
real CLI in one line naming the thing, with exit status 2, before any work: no traceback,
and no workdir (so no empty checkpoints/) left behind. The cases run as subprocesses, a
few at a time, and each parametrized test checks one of them. So are the paths given to
train, decode and serve (a missing --config, a workdir that cannot be one, an existing
--output), the sentences a stopped run ends with, and a workdir holding another model's
checkpoint."""

import concurrent.futures
import errno
import json
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import grain
import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support import ROOT

from gpt_oss_train import config as config_lib
from gpt_oss_train import errors
from gpt_oss_train import train as train_lib
from gpt_oss_train.checkpoints import checkpoint as ckpt_lib
from gpt_oss_train.errors import RunStopped
from gpt_oss_train.io import workdir_lock
from gpt_oss_train.model.transformer import ModelDef


def _data(folder):
    """The broken data files the cases point at; returns {name: path}."""
    (folder / "empty").mkdir()
    (folder / "empty" / "a.txt").write_text("")
    (folder / "bad.jsonl").write_text('{"text": "fine"}\n{"text": \n')
    (folder / "control.jsonl").write_text('{"text": "a\tb"}\n')  # a raw tab inside a string
    chat = [{"role": "human", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    (folder / "role.jsonl").write_text(json.dumps({"messages": chat}) + "\n")
    pq.write_table(pa.table({"body": ["a", "b"]}), folder / "no_text.parquet")
    return {p.name: str(p) for p in folder.iterdir()}


# name -> (command-line overrides, fragment of the one line); {name} is a data file.
GRPO = [
    "--config.train.objective=grpo",
    "--config.data.source=chat:data/sample_prompts.jsonl",
    "--config.train.seq_len=128",
    "--config.rl.max_prompt_tokens=96",
    "--config.rl.max_new_tokens=32",
]
CASES = {
    "unknown field": (
        ["--config.train.stepz=3"],
        "--config.train.stepz=3: no config field 'stepz'",
    ),
    "mistyped value": (["--config.train.steps=ten"], "--config.train.steps=ten"),
    "seq_len 0": (["--config.train.seq_len=0"], "config.train.seq_len: must be > 1"),
    "negative learning rate": (["--config.train.learning_rate=-1"], "config.train.learning_rate"),
    "batch not divisible": (
        ["--config.train.global_batch_size=3"],  # on 2 devices
        "config.train.global_batch_size=3 must be a multiple of 2",
    ),
    "mesh vs devices": (["--config.mesh.fsdp=3"], "config.mesh"),
    "heads vs kv heads": (["--config.model.num_kv_heads=3"], "not divisible by num_kv_heads=3"),
    "non-finite limit": (["--config.train.max_nonfinite_steps=0"], "max_nonfinite_steps"),
    "negative capacity": (["--config.moe_capacity_factor=-1.0"], "config.moe_capacity_factor"),
    # Names the model's registries own, refused by the model when it is built
    "unknown MoE strategy": (
        ["--config.moe_impl=nope"],
        "config.moe_impl: 'nope' is not one of ('dense', 'ragged', 'sharded')",
    ),
    "unknown remat policy": (
        ["--config.remat_policy=nope"],
        "config.remat_policy: 'nope' is not one of ('none', 'full', 'save_dots'",
    ),
    "unknown kernel": (
        ["--config.kernels.attention=nope"],
        "config.kernels.attention: 'nope' is not one of ('auto', 'xla', 'blockwise'",
    ),
    "kernel of another platform": (
        ["--config.kernels.attention=splash"],
        "config.kernels.attention='splash' runs on ['tpu'], not on this program's cpu",
    ),
    "missing file": (["--config.data.source={nope.txt}"], "no such file or directory"),
    "empty corpus": (["--config.data.source={empty}"], "the corpus is empty"),
    "malformed JSONL line": (
        ["--config.data.source={bad.jsonl}"],
        "bad.jsonl:2: not valid JSON (Expecting value at column 1)",
    ),
    "control character": (
        ["--config.data.source={control.jsonl}"],
        "control.jsonl:1: not valid JSON (Invalid control character at column 12)",
    ),
    "unknown chat role": (["--config.data.source={role.jsonl}"], "unknown role 'human'"),
    "parquet without text": (["--config.data.source={no_text.parquet}"], "no 'text' column"),
    "glob matching nothing": (["--config.data.source={empty}/*.jsonl"], "matches no files"),
    # GRPO: before the first rollout
    "grpo reward not found": (
        [*GRPO, "--config.rl.rewards=no_such_module:fn"],
        "config.rl.rewards",
    ),
    "grpo prompt too long": (
        [
            *GRPO,
            "--config.rl.rewards=whitespace",
            "--config.rl.max_prompt_tokens=20",
            "--config.rl.max_new_tokens=108",
        ],
        "the prompt is",
    ),
}


def _run(case, workdir, files):
    overrides, _ = CASES[case]
    files = dict(files, **{"nope.txt": os.path.join(os.path.dirname(workdir), "nope.txt")})
    args = []
    for o in overrides:
        for name, path in files.items():
            o = o.replace("{" + name + "}", path)
        args.append(o)
    env = dict(
        os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2"
    )
    cmd = [
        sys.executable,
        "-m",
        "gpt_oss_train.train",
        "--config=configs/cpu_tiny.py",
        f"--workdir={workdir}",
        "--config.train.eval_every=0",
        *args,
    ]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every case's (workdir, CompletedProcess), run 3 at a time (most of each is
    importing JAX)."""
    files = _data(tmp_path_factory.mktemp("data"))
    root = tmp_path_factory.mktemp("runs")
    workdirs = {case: str(root / f"run{i}") for i, case in enumerate(CASES)}
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = {c: pool.submit(_run, c, workdirs[c], files) for c in CASES}
        return {c: (workdirs[c], f.result()) for c, f in futures.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_train_cli_reports_a_user_error_in_one_line(case, results):
    workdir, r = results[case]
    assert r.returncode == 2, r.stderr[-3000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr[-3000:]
    assert CASES[case][1] in lines[0]
    assert " at at " not in lines[0]
    assert not os.path.exists(workdir), os.listdir(workdir)  # nothing left behind


SHIPPED = [(name, None) for name in sorted(os.listdir(os.path.join(ROOT, "configs")))] + [
    ("tpu_v5e_lora.py", "gpt-oss-120b"),
    ("tpu_v5p.py", "gpt-oss-20b"),
    ("tpu_v6e.py", "gpt-oss-120b"),
    ("tpu_v5e.py", "gpt-oss-120b"),
    ("tpu_grpo.py", "v5e"),
    ("tpu_v5e_serve.py", "gpt-oss-20b"),
]


@pytest.mark.parametrize("name,arg", SHIPPED)
def test_every_shipped_config_passes_validation(name, arg):
    c = config_lib.from_file(os.path.join(ROOT, "configs", name), arg)
    config_lib.validate(c)


# ----------------------------------------------------------------------------- paths
# Paths a new user gets wrong on every command: a --config file that is not there, a workdir
# that cannot be one, an output file that exists. One line each, exit 2, and the user's
# file byte for byte as it was.

KEPT = b"a user's notes\n\x00\xff"  # a file that must come through every case untouched


def _paths(folder) -> dict:
    (folder / "notes.txt").write_bytes(KEPT)
    (folder / "out.jsonl").write_bytes(KEPT)
    (folder / "in.jsonl").write_text('{"tokens": [1, 2]}\n')
    return {p.name: str(p) for p in folder.iterdir()} | {"run": str(folder / "run")}


# name -> (module, arguments, fragment of the one line); {name} is a path of _paths.
PATH_CASES = {
    "train --config missing": (
        "train",
        ["--config=nope.py", "--workdir={run}"],
        f"error: --config=nope.py: no such file (in {ROOT}); give a config .py file",
    ),
    "train --config missing, with an override": (
        "train",
        ["--config=nope.py", "--config.train.steps=3", "--workdir={run}"],
        "error: --config=nope.py: no such file",
    ),
    "train --config a folder": (
        "train",
        ["--config=configs", "--workdir={run}"],
        "error: --config=configs: is a folder",
    ),
    "decode --config missing": (
        "decode",
        ["--config=nope.py", "--checkpoint={run}"],
        "error: --config=nope.py: no such",
    ),
    "serve --config missing": (
        "serve",
        ["--config=nope.py", "--checkpoint={run}"],
        "error: --config=nope.py: no such",
    ),
    "tools.bench_model --config missing": (
        "tools.bench_model",
        ["--config=nope.py"],
        "error: --config=nope.py: no such",
    ),
    "tools.bench_engine --config missing": (
        "tools.bench_engine",
        ["--config=nope.py"],
        "error: --config=nope.py: no such",
    ),
    "tools.aot_compile --config missing": (
        "tools.aot_compile",
        ["--config=nope.py"],
        "error: --config=nope.py: no such",
    ),
    "tools.bench_moe unknown flag": (
        "tools.bench_moe",
        ["--modes=layer"],
        "error: Unknown command line flag 'modes'",
    ),
    "workdir is a file": (
        "train",
        ["--config=configs/cpu_tiny.py", "--workdir={notes.txt}"],
        "error: workdir {notes.txt} is a file, not a folder; use another --workdir",
    ),
    "workdir below a file": (
        "train",
        ["--config=configs/cpu_tiny.py", "--workdir={notes.txt}/run"],
        "error: workdir {notes.txt}/run: {notes.txt} is a file, not a folder; use another",
    ),
    "decode --output exists": (
        "decode",
        ["--checkpoint={run}", "--input={in.jsonl}", "--output={out.jsonl}"],
        "error: --output={out.jsonl} exists; pass --overwrite to replace it",
    ),
}


def _fill(text: str, paths: dict) -> str:
    for name, path in paths.items():
        text = text.replace("{" + name + "}", path)
    return text


def _cli_run(module: str, args: list[str]) -> subprocess.CompletedProcess:
    env = dict(
        os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2"
    )
    cmd = [sys.executable, "-m", f"gpt_oss_train.{module}", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def _one_line(r: subprocess.CompletedProcess) -> str:
    """The one stderr line of a user error (exit 2); fails showing stderr otherwise."""
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2, r.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr[-3000:]
    return lines[0]


@pytest.fixture(scope="module")
def path_runs(tmp_path_factory):
    """Every path case's (its paths, CompletedProcess), run 3 at a time."""
    folders = {case: tmp_path_factory.mktemp("paths") for case in PATH_CASES}
    paths = {case: _paths(folder) for case, folder in folders.items()}

    def go(case):
        module, args, _ = PATH_CASES[case]
        return _cli_run(module, [_fill(a, paths[case]) for a in args])

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = {c: pool.submit(go, c) for c in PATH_CASES}
        return {c: (paths[c], f.result()) for c, f in futures.items()}


@pytest.mark.parametrize("case", list(PATH_CASES))
def test_a_path_the_user_gave_wrong_is_one_line_and_touches_nothing(case, path_runs):
    paths, r = path_runs[case]
    line = _one_line(r)
    assert line.startswith(_fill(PATH_CASES[case][2], paths)), line
    for name in ("notes.txt", "out.jsonl"):
        assert open(paths[name], "rb").read() == KEPT, name
    assert not os.path.exists(paths["run"])  # no workdir made


def test_decode_overwrites_an_existing_output_only_when_asked(tmp_path):
    """--overwrite lets the file be replaced: the refusal above is the only thing in the
    way (the run then stops at the missing checkpoint, with the file still untouched)."""
    paths = _paths(tmp_path)
    args = ["--checkpoint={run}", "--input={in.jsonl}", "--output={out.jsonl}", "--overwrite"]
    line = _one_line(_cli_run("decode", [_fill(a, paths) for a in args]))
    assert line.startswith(f"error: --checkpoint={paths['run']}"), line


def _read_only_folder(tmp_path):
    """A folder nobody can write to, root included: a read-only tmpfs (needs root, which
    ignores permission bits), else a folder without write permission; None if neither."""
    folder = tmp_path / "ro"
    folder.mkdir()
    if os.geteuid() != 0:
        folder.chmod(0o555)
        return folder, lambda: folder.chmod(0o755)
    mount = ["mount", "-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", str(folder)]
    if subprocess.run(mount, capture_output=True).returncode != 0:
        return None, None
    return folder, lambda: subprocess.run(["umount", "-l", str(folder)], check=False)


def test_read_only_workdir_is_one_line(tmp_path):
    folder, undo = _read_only_folder(tmp_path)
    if folder is None:
        pytest.skip("root without permission to mount a read-only tmpfs")
    try:
        for workdir, says in ((folder, "is not writable"), (folder / "run", "cannot be created")):
            r = _cli_run("train", ["--config=configs/cpu_tiny.py", f"--workdir={workdir}"])
            line = _one_line(r)
            assert line.startswith(f"error: workdir {workdir} {says} ("), line
            assert "use another --workdir" in line
        assert os.listdir(folder) == []
    finally:
        undo()


def test_unwritable_workdir_is_a_user_error_before_any_work(tmp_path, monkeypatch, small_config):
    """EACCES (what a user without root meets) on the lock file, simulated: train() raises
    the one-line UserError (exit 2 from errors.report) before creating any parameter."""
    workdir = tmp_path / "run"
    workdir.mkdir()
    real_open = os.open

    def denied(path, *a, **kw):
        if str(path).endswith(workdir_lock.LOCK_NAME):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, *a, **kw)

    monkeypatch.setattr(workdir_lock.os, "open", denied)
    monkeypatch.setattr(ModelDef, "init", lambda *a, **kw: pytest.fail("parameters made"))
    with pytest.raises(errors.UserError) as e:
        train_lib.train(small_config(), str(workdir), devices=jax.devices()[:1])
    message = str(e.value)
    assert message == (
        f"workdir {workdir} is not writable (Permission denied: {workdir}/workdir.lock); make "
        "it writable or use another --workdir"
    )
    assert errors.report(e.value) == 2
    assert os.listdir(workdir) == []


# ----------------------------------------------------------------------------- run stops


class _Ckpt:
    def __init__(self, latest):
        self.latest, self.failure = latest, "saving checkpoint step 4 to W failed: No space"

    def latest_step(self):
        return self.latest


@pytest.mark.parametrize("latest", [2, None])
def test_a_stopped_run_says_what_survives_in_a_sentence(latest):
    """A failed save and a diverged run say which checkpoint holds the work, and read as
    English when none was saved yet (no 'no checkpoint was saved yet is intact')."""
    config = SimpleNamespace(
        checkpoint=SimpleNamespace(max_failed_saves=0), train=SimpleNamespace(learning_rate=1.0)
    )
    skipped = SimpleNamespace(diverged=True, in_a_row=3, last_skipped=7)
    loop = SimpleNamespace(
        r=SimpleNamespace(ckpt=_Ckpt(latest)), c=config, failed_saves=0, skipped=skipped
    )
    with pytest.raises(RunStopped) as saved:
        train_lib._Loop.save_failed(loop)
    with pytest.raises(RunStopped) as diverged:
        train_lib._Loop.check_diverged(loop)
    if latest is None:
        assert str(saved.value) == (
            "saving checkpoint step 4 to W failed: No space. Nothing of that save was kept, "
            "and no checkpoint was saved before it; fix the storage, then run the same "
            "command to start again"
        )
        assert "their updates were skipped and no checkpoint was saved. Lower" in str(
            diverged.value
        )
    else:
        assert str(saved.value) == (
            "saving checkpoint step 4 to W failed: No space. Nothing of that save was kept, "
            "and the newest checkpoint, step 2, is intact; fix the storage, then run the same "
            "command to resume"
        )
        assert (
            "nothing was saved after them: the newest checkpoint, step 2, holds the last "
            "finite parameters. Lower" in str(diverged.value)
        )


# ----------------------------------------------------------------------------- checkpoints


def _tree(path) -> dict:
    return {
        os.path.relpath(os.path.join(d, f), path): open(os.path.join(d, f), "rb").read()
        for d, _, files in os.walk(path)
        for f in files
    }


@pytest.fixture
def mixed_workdir(tmp_path):
    """A workdir whose checkpoints hold two models: step 2 of architecture A, step 4 of B
    (wider), each a complete training checkpoint. Returns (workdir, A, B, write)."""
    a = config_lib.model_arch(config_lib.from_file(os.path.join(ROOT, "configs", "cpu_tiny.py")))
    b = dict(a, hidden_size=2 * a["hidden_size"])

    def write(workdir, step, arch):
        c = ckpt_lib.TrainCheckpointer(workdir, arch=arch, every=1, keep=5, async_save=False)
        data = iter(grain.MapDataset.range(8).to_iter_dataset())
        next(data)
        params = {"w": np.ones((arch["hidden_size"], 4), np.float32)}
        c.save(step, params, {"m": np.zeros(3, np.float32)}, data, 0, force=True)
        c.close()
        assert c.failure is None, c.failure

    workdir = tmp_path / "run"
    write(str(workdir), 2, a)
    write(str(tmp_path / "other"), 4, b)
    shutil.copytree(tmp_path / "other" / "checkpoints" / "4", workdir / "checkpoints" / "4")
    return workdir, a, b, write


def test_a_step_of_another_model_is_refused_not_called_damaged(mixed_workdir, caplog):
    """Each step is judged by its own model config: a run of B (the newest step's shape)
    is refused because of step 2, one of A because of step 4. Neither is 'CHECKPOINT
    DAMAGED', and nothing is moved or changed."""
    workdir, a, b, _ = mixed_workdir
    before = _tree(workdir)
    wide, narrow = b["hidden_size"], a["hidden_size"]
    for arch, step, stored, wanted in ((b, 2, narrow, wide), (a, 4, wide, narrow)):
        diff = f"hidden_size: checkpoint {stored} vs config {wanted}"
        with pytest.raises(ckpt_lib.CheckpointError) as e:
            ckpt_lib.TrainCheckpointer(str(workdir), arch=arch, every=1, keep=5)
        message = str(e.value)
        assert message.startswith(
            f"{workdir}/checkpoints/{step} holds a checkpoint of a different model ({diff}"
        ), message
        assert "\n" not in message and "the checkpoint was not touched" in message
    assert not any("DAMAGED" in r.getMessage() for r in caplog.records)
    assert _tree(workdir) == before


def test_an_unreadable_model_config_is_damage_and_the_previous_step_resumes(mixed_workdir, caplog):
    """A step whose model config cannot be read is damaged, not another model: the run
    falls back to the previous step and sets the damaged one aside, whole."""
    workdir, a, _, write = mixed_workdir
    shutil.rmtree(workdir / "checkpoints" / "4")
    write(str(workdir), 4, a)
    (workdir / "checkpoints" / "4" / "model_config" / "metadata").write_text("")
    damaged = _tree(workdir / "checkpoints" / "4")
    ckpt = ckpt_lib.TrainCheckpointer(str(workdir), arch=a, every=1, keep=5, async_save=False)
    shape = lambda *s: jax.ShapeDtypeStruct(s, np.float32)  # noqa: E731
    data = iter(grain.MapDataset.range(8).to_iter_dataset())
    found = ckpt.restore_newest({"w": shape(a["hidden_size"], 4)}, {"m": shape(3)}, data)
    ckpt.close()
    assert found is not None and found[0] == 2
    assert any("CHECKPOINT DAMAGED: step 4" in r.getMessage() for r in caplog.records)
    assert _tree(workdir / "damaged_checkpoints" / "4") == damaged


def test_decode_reads_past_a_newest_step_whose_model_config_is_unreadable(mixed_workdir):
    """As training does: decode's loader takes the architecture, and the params, of the
    newest step that reads (step 2), rather than failing on the damaged step 4."""
    workdir, a, _, write = mixed_workdir
    shutil.rmtree(workdir / "checkpoints" / "4")
    write(str(workdir), 4, a)
    (workdir / "checkpoints" / "4" / "model_config" / "metadata").write_text("")
    before = _tree(workdir)
    assert ckpt_lib.read_model_config(str(workdir)) == a
    shape = lambda *s: jax.ShapeDtypeStruct(s, np.float32)  # noqa: E731
    params, arch, step = ckpt_lib.load_params(str(workdir), {"w": shape(a["hidden_size"], 4)})
    assert (arch, step) == (a, 2) and np.all(np.asarray(params["w"]) == 1)
    with pytest.raises(ckpt_lib.CheckpointError, match="model config JSON not found"):
        ckpt_lib.read_model_config(str(workdir / "checkpoints" / "4"))  # asked for by name
    assert _tree(workdir) == before  # decode moves nothing
