"""A training workdir in a gs:// bucket (the local GCS emulator of conftest.py): checkpoints,
the lock, metrics.jsonl and TensorBoard there; resume, fine-tuning (init_from) and decode
read from it; pre-tokenized data is read from it. Each result is compared with the same
run on local disk, which must give the same bits."""

import json

import fsspec
import jax
import numpy as np
import pytest
from tensorboard.backend.event_processing import event_accumulator

from gpt_oss_train import config as config_lib
from gpt_oss_train import train as train_lib
from gpt_oss_train.checkpoints import checkpoint as ckpt_lib
from gpt_oss_train.inference import loading
from gpt_oss_train.io import storage
from gpt_oss_train.model.transformer import ModelDef
from gpt_oss_train.training import data as data_lib
from gpt_oss_train.training import sources

pytestmark = pytest.mark.full  # the GCS emulator


def run(config, workdir):
    return train_lib.train(config, str(workdir), devices=jax.devices()[:1])


def leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


@pytest.fixture(scope="module")
def runs(small_config, gcs_bucket, tmp_path_factory):
    """(bucket workdir, local workdir, their summaries): 2 steps then a resume to 4 in
    the bucket; 4 uninterrupted steps on local disk."""
    bucket = f"{gcs_bucket}/cloud_workdir_run"
    first = run(small_config(steps=2), bucket)
    second = run(small_config(steps=4), bucket)
    local = tmp_path_factory.mktemp("local") / "run"
    reference = run(small_config(steps=4), local)
    return bucket, str(local), (first, second, reference)


def test_bucket_workdir_trains_resumes_and_logs_like_local_disk(runs):
    bucket, _, (first, second, reference) = runs
    assert first["checkpoints"] == f"{bucket}/checkpoints"
    # The resumed run went on from checkpoint 2, bit for bit as the uninterrupted one.
    assert {**first["losses"], **second["losses"]} == reference["losses"]
    assert sorted(second["losses"]) == [3, 4]
    assert storage.listdir(bucket) == ["checkpoints", "metrics.jsonl", "tensorboard"]  # unlocked
    assert storage.listdir(f"{bucket}/checkpoints") == ["2", "4"]
    for step in ("2", "4"):
        assert "file_sizes.json" in storage.listdir(f"{bucket}/checkpoints/{step}")
    lines = storage.read_text(f"{bucket}/metrics.jsonl").splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert {r["step"]: r["loss"] for r in records} == reference["losses"]
    # Two writers, two event files (appended through storage), read back by TensorBoard.
    assert len(storage.listdir(f"{bucket}/tensorboard")) == 2
    acc = event_accumulator.EventAccumulator(f"{bucket}/tensorboard")
    acc.Reload()
    got = {e.step: e.value for e in acc.Scalars("loss")}
    assert got == {s: float(np.float32(v)) for s, v in reference["losses"].items()}


def test_init_from_and_decode_read_a_bucket_checkpoint(runs, small_config, tmp_path):
    bucket, local, _ = runs
    arch = ckpt_lib.read_model_config(bucket)
    md = ModelDef(config_lib.ModelConfig.from_config(small_config(), arch))
    want = leaves(ckpt_lib.load_params(f"{local}/checkpoints/4", md.abstract_params())[0])

    c = small_config(steps=1)
    c.checkpoint.init_from = bucket
    fine_tune = train_lib.prepare(c, str(tmp_path / "ft"), devices=jax.devices()[:1])
    try:
        assert all(map(np.array_equal, leaves(fine_tune.state["params"]), want))
    finally:
        fine_tune.close()

    model = loading.load_model(bucket, small_config(), dtype="float32")
    assert model.kind == "orbax" and model.path == bucket
    assert all(map(np.array_equal, leaves(model.params), want))


def test_damaged_bucket_checkpoint_falls_back(runs, small_config, gcs_dir, caplog):
    """A params object of the newest step shortened in place: decode's reader names it
    (from the sizes recorded in the bucket) and serves step 2."""
    _, local, _ = runs
    run(small_config(steps=4), gcs_dir)  # its own run: copying objects is slow on the emulator
    fs = fsspec.filesystem("gs")
    data_dir = f"{gcs_dir}/checkpoints/4/params/ocdbt.process_0/d"
    biggest = max(fs.find(data_dir, detail=True).items(), key=lambda kv: kv[1]["size"])[0]
    fs.pipe_file(biggest, fs.cat_file(biggest)[:1000])
    arch = ckpt_lib.read_model_config(gcs_dir)
    md = ModelDef(config_lib.ModelConfig.from_config(small_config(), arch))
    params, _, step = ckpt_lib.load_params(gcs_dir, md.abstract_params())
    assert step == 2
    want = ckpt_lib.load_params(f"{local}/checkpoints/2", md.abstract_params())[0]
    assert all(map(np.array_equal, leaves(params), leaves(want)))
    name = biggest.rsplit("/checkpoints/4/", 1)[1]
    assert any(f"{name}: 1000 bytes" in r.getMessage() for r in caplog.records)


def test_pretokenized_data_in_a_bucket_gives_the_same_batches(pretokenized_corpus, gcs_dir):
    remote = f"{gcs_dir}/tokens"
    fsspec.filesystem("gs").put(pretokenized_corpus, remote, recursive=True)
    kw = dict(seq_len=32, global_batch_size=4, seed=3)
    here, there = (
        data_lib.make_pipeline(pretokenized_corpus, **kw),
        data_lib.make_pipeline(remote, **kw),
    )
    for _ in range(3):
        a, b = next(here), next(there)
        assert all(np.array_equal(a[k], b[k]) for k in data_lib.BATCH_KEYS)
    with pytest.raises(sources.DataError, match="only folders written by gpt_oss_train.tools"):
        sources.make_source(f"{gcs_dir}/some_text")


def test_bucket_training_releases_its_lock_after_a_user_error(small_config, gcs_dir, tmp_path):
    """The lock is taken before any work and given back when a run fails before its
    first step (here: a data source that does not exist)."""
    c = small_config()
    c.data.source = str(tmp_path / "missing")
    with pytest.raises(sources.DataError):
        run(c, gcs_dir)
    assert not storage.exists(f"{gcs_dir}/workdir.lock")
