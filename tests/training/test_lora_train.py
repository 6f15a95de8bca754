"""LoRA training runs: only the adapters change (the frozen base's bytes do not, in any
format, from a published-layout MXFP4 folder too), checkpoints hold the adapters and the
base's reference, the SFT config's loss falls, a run resumes bitwise after SIGTERM, and
a workdir of another kind is refused."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from support import ROOT

from gpt_oss_train import config as config_lib
from gpt_oss_train import train as train_lib
from gpt_oss_train.arrays import mxfp4_array
from gpt_oss_train.checkpoints import checkpoint as ckpt_lib
from gpt_oss_train.errors import ConfigError
from gpt_oss_train.inference import adapters as adapters_lib
from gpt_oss_train.io import hf
from gpt_oss_train.model import lora
from gpt_oss_train.model.transformer import ModelDef
from gpt_oss_train.training import data as data_lib
from gpt_oss_train.training.metrics import read_metrics_jsonl

pytestmark = pytest.mark.full  # LoRA training runs: minutes


def lora_config(**overrides):
    c = config_lib.from_file(os.path.join(ROOT, "configs/lora_sft.py"))
    c.train.update(steps=4, global_batch_size=2, seq_len=32, log_every=1, loss_chunk_size=32)
    c.data.update(source="stdlib", max_docs=100)
    c.checkpoint.update(every=2, async_save=False)
    c.mesh.fsdp = 1
    for key, value in overrides.items():
        section, _, field = key.rpartition(".")
        (c[section] if section else c)[field] = value
    return c


@pytest.fixture(scope="module")
def mxfp4_base(tmp_path_factory):
    """A random tiny model (the real vocabulary) as published: MXFP4 experts, bf16 rest."""
    c = lora_config()
    arch = config_lib.model_arch(c)
    params = jax.device_get(ModelDef(config_lib.ModelConfig(**arch)).init(7))
    folder = str(tmp_path_factory.mktemp("base") / "gpt-oss-tiny")
    hf.save_hf(folder, arch, params, "bfloat16", mxfp4=True, with_tokenizer=False)
    return folder


def _digest(folder):
    h = hashlib.sha256()
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def _bytes(tree):
    leaves = jax.tree.leaves(jax.device_get(tree))
    return [np.asarray(a).tobytes() for a in leaves]


@pytest.mark.parametrize("fmt", ["mxfp4", "int8"])
def test_only_adapters_train_and_the_base_bytes_stay(fmt, mxfp4_base, tmp_path):
    digest = _digest(mxfp4_base)
    c = lora_config(**{"checkpoint.init_from": mxfp4_base, "lora.base_format": fmt})
    run = train_lib.prepare(c, str(tmp_path / "run"), devices=jax.devices()[:1])
    frozen = run.setup.frozen.arrays()
    if fmt == "mxfp4":  # read as the file's blocks, never dequantized
        wo = frozen["blocks"]["full"]["moe"]["wo"]
        assert isinstance(wo, mxfp4_array.MXFP4Array)
        stored = hf.HFCheckpoint(mxfp4_base)._tensor("model.layers.1.mlp.experts.down_proj_blocks")
        file_form = mxfp4_array.to_file(np.asarray(wo.blocks[0]), np.asarray(wo.scales[0]))
        assert np.array_equal(file_form[0], stored)
    before, adapters0 = _bytes(frozen), jax.device_get(run.state["params"])
    assert sorted(lora.flat(adapters0)) == sorted(
        p for p in lora.flat(adapters0) if lora.is_adapter_path(p)
    )
    state = run.state
    with run.setup.scope():
        for _ in range(3):
            batch = data_lib.global_batch(next(run.pipeline), run.setup.mesh, run.setup.rules)
            state, out = run.setup.train_step(state, batch)
    assert np.isfinite(float(out["loss"]))
    assert _bytes(run.setup.frozen.arrays()) == before
    changed = [
        p
        for p, a in lora.flat(jax.device_get(state["params"])).items()
        if not np.array_equal(a, lora.flat(adapters0)[p])
    ]
    assert sorted(changed) == sorted(lora.flat(adapters0))  # every adapter moved (B from 0)
    run.ckpt.close()
    assert _digest(mxfp4_base) == digest


def test_adapter_checkpoints_are_small_and_name_their_base(mxfp4_base, tmp_path):
    c = lora_config(**{"checkpoint.init_from": mxfp4_base, "lora.base_format": "mxfp4"})
    summary = train_lib.train(c, str(tmp_path / "run"), devices=jax.devices()[:1])
    assert summary["step"] == 4
    meta = ckpt_lib.read_meta(str(tmp_path / "run"))["lora"]
    assert meta["rank"] == 8 and meta["targets"] == ["q", "k", "v", "o", "gate_up", "down"]
    assert meta["base"] == {"source": mxfp4_base, "seed": 0, "format": "mxfp4"}
    size = lambda d: sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(d) for f in fs)
    ckpt_dir = str(tmp_path / "run" / "checkpoints" / "4")
    # params + Adam moments of the adapters: far below the base (its embedding alone is
    # 201088 x 64 bf16 = 25.7 MB)
    assert size(ckpt_dir) < 2e6 < size(mxfp4_base)


def test_workdir_of_another_kind_is_refused(mxfp4_base, tmp_path):
    c = lora_config(**{"checkpoint.init_from": mxfp4_base, "train.steps": 2})
    train_lib.train(c, str(tmp_path / "run"), devices=jax.devices()[:1])
    for overrides, match in (
        ({"lora.rank": 4}, r"holds rank-8 LoRA on .* config.lora asks for rank-4"),
        ({"lora.targets": "q,v"}, r"config.lora asks for rank-8 LoRA on \['q', 'v'\]"),
    ):
        c2 = lora_config(**{"checkpoint.init_from": mxfp4_base, "train.steps": 4, **overrides})
        with pytest.raises(ConfigError, match=match):
            train_lib.prepare(c2, str(tmp_path / "run"), devices=jax.devices()[:1])


def _cli(workdir, *overrides):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="", PYTHONPATH=ROOT)
    return [
        sys.executable,
        "-m",
        "gpt_oss_train.train",
        "--config=configs/lora_sft.py",
        f"--workdir={workdir}",
        "--config.train.steps=10",
        "--config.train.log_every=1",
        "--config.train.global_batch_size=2",
        "--config.train.seq_len=64",
        "--config.train.loss_chunk_size=64",
        "--config.checkpoint.every=3",
        "--config.lora.base_format=bfloat16",
        *overrides,
    ], env


def _losses(workdir):
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return {}
    return {r["step"]: r["loss"] for r in read_metrics_jsonl(path) if r.get("loss") is not None}


@pytest.mark.full
def test_lora_run_resumes_bitwise_after_sigterm(tmp_path):
    full, cut = str(tmp_path / "full"), str(tmp_path / "cut")
    cmd, env = _cli(full)
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    cmd, env = _cli(cut)
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    deadline = time.time() + 300
    while time.time() < deadline and max(_losses(cut) or {0: 0}) < 4:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "Preempted" in err, err[-2000:]
    stopped = ckpt_lib.find_step_dir(cut)[1]
    assert 4 <= stopped < 10
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    want, got = _losses(full), _losses(cut)
    assert sorted(want) == list(range(1, 11))
    assert {s: got[s] for s in want} == want  # bitwise: the same floats
    adapters = [
        jax.device_get(ckpt_lib.load_params(d, _abstract_adapters(d))[0]) for d in (full, cut)
    ]
    assert _bytes(adapters[0]) == _bytes(adapters[1])


def _abstract_adapters(workdir):
    return adapters_lib._abstract(
        lora.LoraSpec.from_json(ckpt_lib.read_meta(workdir)["lora"]),
        ckpt_lib.read_model_config(workdir),
    )


@pytest.mark.full
def test_loss_falls_on_the_lora_sft_config(tmp_path):
    cmd, env = _cli(str(tmp_path / "sft"))
    cmd = [a for a in cmd if "steps=" not in a and "seq_len" not in a and "batch_size" not in a]
    cmd += ["--config.train.steps=20", "--config.lora.base_format=param_dtype"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    losses = _losses(str(tmp_path / "sft"))
    first, last = np.mean([losses[s] for s in (1, 2)]), np.mean([losses[s] for s in (19, 20)])
    assert last < first - 0.5, losses
    with open(os.path.join(tmp_path, "sft", "metrics.jsonl")) as f:
        assert all(np.isfinite(json.loads(line).get("loss", 0.0)) for line in f)
