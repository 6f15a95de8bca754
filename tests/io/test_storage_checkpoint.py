"""Orbax checkpoints in a gs:// bucket (the local GCS emulator of conftest.py): sharded arrays
through TensorStore, JSON and grain iterator items through etils.epath/gcsfs, exactly the
items train.py's checkpoints hold, restored bit for bit, also by a fresh process."""

import hashlib
import json
import os
import socket
import subprocess
import sys

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from support import ROOT

from gpt_oss_train.checkpoints import checkpoint as ckpt_lib
from gpt_oss_train.io import storage, workdir_lock

pytestmark = pytest.mark.full  # the GCS emulator

P = jax.sharding.PartitionSpec


def _mesh():
    return jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))


def _params(mesh, seed: int):
    """A small tree like a model's: sharded 2-D weights, a bfloat16 leaf, a replicated bias."""
    rng = np.random.default_rng(seed)

    def put(x, spec):
        return jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))

    return {
        "embed": put(rng.standard_normal((16, 8), np.float32), P("data", "model")),
        "layers": {
            "w": put(rng.standard_normal((2, 8, 12), np.float32), P(None, "model", "data")),
            "w_bf16": put(rng.standard_normal((8, 4)).astype(jnp.bfloat16), P("data", None)),
        },
        "bias": put(rng.standard_normal(5).astype(np.float32), P()),
    }


def _abstract(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)


def _digests(tree) -> dict:
    """sha256 of each leaf's bytes (gathered), keyed by its path."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {
        jax.tree_util.keystr(k): hashlib.sha256(np.asarray(v).tobytes()).hexdigest()
        for k, v in flat
    }


def _manager(directory, **options):
    return ocp.CheckpointManager(
        directory,
        options=ocp.CheckpointManagerOptions(**options),
        item_names=("params",),
    )


_RESTORE_SCRIPT = """
import hashlib, json, sys
import jax, numpy as np, orbax.checkpoint as ocp
directory, step, shapes = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
abstract = {k: jax.ShapeDtypeStruct(tuple(s), np.dtype(d), sharding=replicated)
            for k, (s, d) in shapes.items()}
mngr = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(read_only=True),
                             item_names=("params",))
tree = mngr.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(abstract)))
print(json.dumps({"steps": list(mngr.all_steps()),
                  "digests": {k: hashlib.sha256(np.asarray(v).tobytes()).hexdigest()
                              for k, v in tree["params"].items()}}))
"""


@pytest.mark.parametrize("async_save", [True, False])
def test_sharded_checkpoint_in_bucket_restores_bit_identically(gcs_dir, async_save):
    mesh = _mesh()
    directory = storage.join(gcs_dir, "run", "checkpoints")
    mngr = _manager(directory, max_to_keep=2, enable_async_checkpointing=async_save)
    saved = {step: _params(mesh, seed=step) for step in (1, 2, 3)}
    for step, params in saved.items():
        mngr.save(step, args=ocp.args.Composite(params=ocp.args.StandardSave(params)))
    mngr.wait_until_finished()
    assert mngr.all_steps() == [2, 3]  # keep-2 deleted step 1 from the bucket
    assert storage.listdir(directory) == ["2", "3"]

    for step in (2, 3):
        restored = mngr.restore(
            step,
            args=ocp.args.Composite(params=ocp.args.StandardRestore(_abstract(saved[step]))),
        )["params"]
        assert _digests(restored) == _digests(saved[step])
        assert jax.tree.map(lambda a: a.sharding, restored) == jax.tree.map(
            lambda a: a.sharding, saved[step]
        )
    mngr.close()


def test_fresh_process_restores_from_bucket(gcs_dir):
    """Nothing lives only in this process: another one, with another mesh, restores the
    same bytes from the bucket."""
    mesh = _mesh()
    directory = storage.join(gcs_dir, "checkpoints")
    params = {"a": _params(mesh, 7)["embed"], "b": _params(mesh, 8)["layers"]["w_bf16"]}
    mngr = _manager(directory)
    mngr.save(5, args=ocp.args.Composite(params=ocp.args.StandardSave(params)))
    mngr.wait_until_finished()
    mngr.close()

    shapes = {k: (v.shape, v.dtype.name) for k, v in params.items()}
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run(
        [sys.executable, "-c", _RESTORE_SCRIPT, directory, "5", json.dumps(shapes)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["steps"] == [5]
    assert result["digests"] == {k[2:-2]: v for k, v in _digests(params).items()}


def _json_or_none(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _data_iterator():
    ds = grain.MapDataset.range(1000).shuffle(seed=3).map(lambda x: np.array([x, x * x]))
    return iter(ds.batch(4).to_iter_dataset())


def test_training_checkpoint_items_in_bucket(gcs_dir):
    """The five items of a training checkpoint (checkpoints/checkpoint.py), as TrainCheckpointer
    writes them, saved to and restored from the bucket; the restored data iterator goes on
    with the same batches the saved one would have given."""
    mesh = _mesh()
    params = _params(mesh, seed=0)
    tx = optax.adamw(1e-3)
    opt_state = jax.jit(tx.init)(params)
    opt_state = jax.jit(lambda s: jax.tree.map(lambda x: x + 1 if x.ndim else x, s))(opt_state)
    arch = {"hidden_size": 8, "num_layers": 2, "vocab_size": 16}
    meta = {"step": 4, "seed": 0, "writer": "gpt_oss_train.train"}
    iterator = _data_iterator()
    for _ in range(5):
        next(iterator)

    directory = storage.join(gcs_dir, "checkpoints")
    mngr = ocp.CheckpointManager(
        directory,
        options=ocp.CheckpointManagerOptions(enable_async_checkpointing=True),
        item_names=ckpt_lib.ALL_ITEMS,
    )
    mngr.save(
        4,
        args=ocp.args.Composite(
            **{
                ckpt_lib.MODEL_CONFIG: ocp.args.JsonSave(arch),
                ckpt_lib.PARAMS: ocp.args.StandardSave(params),
                ckpt_lib.OPT_STATE: ocp.args.StandardSave(opt_state),
                ckpt_lib.META: ocp.args.JsonSave(meta),
                ckpt_lib.DATA: grain.checkpoint.CheckpointSave(iterator),
            }
        ),
    )
    mngr.wait_until_finished()
    expected_batches = [next(iterator) for _ in range(3)]

    # The items are plain objects a reader finds through the storage API (read_model_config).
    step_dir = storage.join(directory, "4")
    assert set(ckpt_lib.ALL_ITEMS) <= set(storage.listdir(step_dir))
    config_files = storage.glob(step_dir, f"{ckpt_lib.MODEL_CONFIG}/*")
    assert arch in [_json_or_none(storage.read_text(f)) for f in config_files]

    fresh = _data_iterator()
    restored = mngr.restore(
        4,
        args=ocp.args.Composite(
            **{
                ckpt_lib.PARAMS: ocp.args.StandardRestore(_abstract(params)),
                ckpt_lib.OPT_STATE: ocp.args.StandardRestore(_abstract(opt_state)),
                ckpt_lib.META: ocp.args.JsonRestore(),
                ckpt_lib.DATA: grain.checkpoint.CheckpointRestore(fresh),
            }
        ),
    )
    mngr.close()
    assert _digests(restored[ckpt_lib.PARAMS]) == _digests(params)
    assert _digests(restored[ckpt_lib.OPT_STATE]) == _digests(opt_state)
    assert restored[ckpt_lib.META] == meta
    for want in expected_batches:
        np.testing.assert_array_equal(next(fresh), want)


# ----------------------------------------------------------------------------- 2 processes

_JOB_SCRIPT = """
import json, sys
import jax, numpy as np, orbax.checkpoint as ocp
from gpt_oss_train import sharding
from gpt_oss_train.io import storage, workdir_lock

sharding.initialize_distributed()
workdir = sys.argv[1]
try:
    lock = workdir_lock.acquire_for_job(workdir)
except workdir_lock.WorkdirLockError as e:
    print(f"refused: {e}", flush=True)
    sys.exit(2)
mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", "model"))
full = np.arange(48, dtype=np.float32).reshape(8, 6) * 1.5
x = jax.make_array_from_callback(full.shape, sh, lambda index: full[index])
mngr = ocp.CheckpointManager(storage.join(workdir, "checkpoints"), item_names=("params",))
mngr.save(1, args=ocp.args.Composite(params=ocp.args.StandardSave({"x": x})))
mngr.wait_until_finished()
abstract = {"x": jax.ShapeDtypeStruct(full.shape, full.dtype, sharding=sh)}
got = mngr.restore(1, args=ocp.args.Composite(params=ocp.args.StandardRestore(abstract)))
mngr.close()
shards = got["params"]["x"].addressable_shards
ok = all(np.array_equal(np.asarray(s.data), full[s.index]) for s in shards)
if jax.process_index() == 0:  # shared files: process 0 alone
    with storage.open(storage.join(workdir, "metrics.jsonl"), "a") as f:
        f.write(json.dumps({"processes": jax.process_count()}) + "\\n")
print(json.dumps({"process": jax.process_index(), "shards": len(shards), "ok": ok}), flush=True)
if lock is not None:
    lock.release()
"""


def _launch_two(workdir: str) -> subprocess.CompletedProcess:
    """Runs _JOB_SCRIPT as 2 JAX processes of 4 CPU devices each through launch/local.sh."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=ROOT, COORDINATOR_PORT=str(port), DEVICES_PER_PROCESS="4")
    cmd = ["bash", os.path.join(ROOT, "launch", "local.sh"), "2"]
    return subprocess.run(
        [*cmd, sys.executable, "-c", _JOB_SCRIPT, workdir],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


def _job_lines(out: str) -> dict[int, str]:
    """The last result line ({...} or "refused: ...") each process ([0] ..., [1] ...)
    printed; libraries (Gloo) may print after it, or into the same line before it."""
    lines = {}
    for line in out.splitlines():
        if line[:1] != "[":
            continue
        if line[4:5] == "{":
            lines[int(line[1])] = line[4:]
        elif "refused:" in line:
            lines[int(line[1])] = line[line.index("refused:") :]
    return lines


@pytest.mark.multiprocess
def test_two_process_job_checkpoints_to_bucket_and_refuses_a_locked_workdir(gcs_dir):
    """Two JAX processes, each holding half the devices, save one sharded array to the bucket
    (each process writes its own shards; Orbax coordinates) and restore it; process 0 alone
    holds the workdir lock and writes the shared file. While another run holds the lock,
    the same job is refused on both processes before it writes anything (exit 2)."""
    done = _launch_two(gcs_dir)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    lines = _job_lines(done.stdout)
    assert {p: json.loads(lines[p]) for p in (0, 1)} == {
        p: {"process": p, "shards": 4, "ok": True} for p in (0, 1)
    }
    assert storage.read_text(storage.join(gcs_dir, "metrics.jsonl")) == '{"processes": 2}\n'
    params_dir = storage.join(gcs_dir, "checkpoints", "1", "params")
    assert {"ocdbt.process_0", "ocdbt.process_1"} <= set(storage.listdir(params_dir))
    assert storage.listdir(gcs_dir) == ["checkpoints", "metrics.jsonl"]  # lock released

    # The bucket holds the whole array, whichever process wrote each part.
    one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = {"x": jax.ShapeDtypeStruct((8, 6), np.float32, sharding=one_device)}
    mngr = ocp.CheckpointManager(storage.join(gcs_dir, "checkpoints"), item_names=("params",))
    whole = mngr.restore(1, args=ocp.args.Composite(params=ocp.args.StandardRestore(target)))
    mngr.close()
    np.testing.assert_array_equal(
        whole["params"]["x"], np.arange(48, dtype=np.float32).reshape(8, 6) * 1.5
    )

    second = storage.join(gcs_dir, "second")
    other = workdir_lock.WorkdirLock(second).acquire()
    try:
        refused = _launch_two(second)
        assert storage.listdir(second) == [workdir_lock.LOCK_NAME]  # the job wrote nothing
    finally:
        other.release()
    assert refused.returncode == 2, refused.stdout[-4000:] + refused.stderr[-4000:]
    lines = _job_lines(refused.stdout)
    assert lines[0].startswith("refused: workdir gs://") and f"pid {os.getpid()}" in lines[0]
    assert lines[1].startswith("refused: ") and "process 0" in lines[1]
