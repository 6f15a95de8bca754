"""The training setup is built once (training/state.py) for train.py, the AOT compile
(aot/train_step.py) and tools.bench_model: the step train.py runs on real arrays and the
step the AOT compile lowers from abstract values are the same program, so the AOT memory
verdict describes what a pod runs."""

import os

import jax
import pytest
from support import ROOT

from gpt_oss_train import config as config_lib
from gpt_oss_train import train as train_lib
from gpt_oss_train.aot import train_step
from gpt_oss_train.training import data as data_lib

pytestmark = pytest.mark.full  # the AOT tool's lowering beside training's


def test_train_and_aot_compile_lower_the_same_step(tmp_path):
    config = config_lib.from_file(os.path.join(ROOT, "configs", "cpu_tiny.py"))
    config.mesh.update(data=2, fsdp=2, tensor=2, expert=1)
    config.train.update(global_batch_size=8, seq_len=32, grad_accum_steps=2)
    config.checkpoint.update(every=0, async_save=False)

    run = train_lib.prepare(config, str(tmp_path))
    batch = data_lib.global_batch(next(run.pipeline), run.setup.mesh, run.setup.rules)
    with run.setup.scope():
        trained = run.setup.train_step.lower(run.state, batch).as_text()
    run.close()

    _, aot = train_step.lower(config, jax.devices())
    assert aot.as_text() == trained
    # the program is the real step: sharded over the 8 devices, its state donated
    assert "num_partitions = 8" in trained and "tf.aliasing_output" in trained
