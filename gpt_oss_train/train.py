"""Pre-train or fine-tune a GPT-OSS model.

    python -m gpt_oss_train.train --config=configs/cpu_tiny.py --workdir=/tmp/run

The same command runs on one CPU and on every host of a pod. In order:

  1. config -> validated; the architecture comes from the config, or from
     `checkpoint.init_from` when fine-tuning
  2. the training setup (training/state.py): mesh, logical-axis rules, shardings, the
     jitted donated train step; the same one tools/aot_compile.py compiles for a TPU pod
  3. data: a grain pipeline per process, batches assembled into global arrays
  4. state: resumed from <workdir>/checkpoints, else loaded (init_from), else random;
     created straight into its shardings
  5. loop: train_step, metrics every log_every steps, eval every eval_every, an Orbax
     checkpoint every checkpoint.every, SIGTERM -> save + exit
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from gpt_oss_train import config as config_lib
from gpt_oss_train import errors, hardware, logs
from gpt_oss_train.errors import ConfigError
from gpt_oss_train.model import architecture
from gpt_oss_train.sharding import initialize_distributed
from gpt_oss_train.training import checkpoint as ckpt_lib
from gpt_oss_train.training import data as data_lib
from gpt_oss_train.training import flops as flops_lib
from gpt_oss_train.training import lora as lora_training
from gpt_oss_train.training import state as state_lib
from gpt_oss_train.training.evaluate import evaluate
from gpt_oss_train.training.metrics import MetricsWriter

_CONFIG = config_flags.DEFINE_config_file("config", "configs/cpu_tiny.py", "Config file.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Where checkpoints and metrics go.")


def resolve_architecture(config) -> dict:
    """The architecture to train: config.model, or init_from's when fine-tuning."""
    src = config.checkpoint.init_from
    if not src:
        return architecture.validate(config_lib.model_arch(config))
    if not os.path.exists(src):
        raise ConfigError(f"config.checkpoint.init_from: {src} does not exist")
    from gpt_oss_train.io import hf

    if ckpt_lib.is_orbax_checkpoint(src):
        arch = ckpt_lib.read_model_config(src)
    elif os.path.exists(os.path.join(src, "config.json")):
        arch = hf.HFCheckpoint(src).model_config
    else:
        raise ConfigError(
            f"config.checkpoint.init_from: {src} is neither an Orbax checkpoint written by "
            "gpt_oss_train nor a Hugging Face folder with config.json"
        )
    logging.info("Fine-tuning: architecture taken from %s", src)
    return architecture.validate(arch, src)


def check_eval_source(config):
    t, d = config.train, config.data
    has_eval_split = d.source == "stdlib" or d.source.startswith("tfds:")
    if t.eval_every and not d.eval_source and not has_eval_split:
        raise ConfigError(
            "config.data.eval_source: periodic eval (train.eval_every > 0) needs a held-out "
            f"source; {d.source!r} has no eval split. Set data.eval_source or "
            "train.eval_every=0"
        )


def initial_state(setup: state_lib.TrainSetup, ckpt, pipeline) -> dict:
    """The newest checkpoint of this run, else init_from's parameters, else random ones."""
    start = ckpt.latest_step()
    if start is not None:
        abstract = setup.abstract_state
        params, opt_state, _ = ckpt.restore(
            start, abstract["params"], abstract["opt_state"], pipeline.iterator
        )
        logging.info("Resumed from %s at step %d", ckpt.directory, start)
        return setup.state_from(params, opt_state, start)
    src = setup.config.checkpoint.init_from
    if not src or setup.frozen is not None:  # LoRA: the setup reads its frozen base itself
        return setup.init_state()
    abstract = setup.abstract_state["params"]
    if ckpt_lib.is_orbax_checkpoint(src):
        params = ckpt_lib.load_params(src, abstract)[0]
    else:
        from gpt_oss_train.io import hf

        params = hf.load_sharded(src, abstract)
    return setup.init_state(params)


class StepLogger:
    """Writes the step's scalars every log_every steps, with throughput figures from the
    steps since the last write (the first step includes compilation: none for it)."""

    def __init__(self, setup: state_lib.TrainSetup, writer: MetricsWriter, start: int):
        t = setup.config.train
        self.t, self.writer, self.start = t, writer, start
        self.tokens_per_step = t.global_batch_size * t.seq_len
        self.flops_per_token = flops_lib.training_flops_per_token(setup.model_cfg, t.seq_len)
        kind = jax.devices()[0].device_kind
        self.peak = hardware.peak_flops(kind, t.peak_flops_per_device or None)
        self.window_start, self.window_steps = time.perf_counter(), 0
        self.losses: dict[int, float] = {}

    def after_step(self, step: int, out) -> None:
        self.window_steps += 1
        if not (step % self.t.log_every == 0 or step == self.t.steps or step == self.start + 1):
            return
        out = jax.device_get(out)
        scalars = {k: float(v) for k, v in out.items() if k != "tokens"}
        if step > self.start + 1:
            elapsed = time.perf_counter() - self.window_start
            scalars.update(
                flops_lib.throughput_metrics(
                    step_time_s=elapsed / self.window_steps,
                    tokens_per_step=self.tokens_per_step,
                    num_devices=jax.device_count(),
                    flops_per_token=self.flops_per_token["total"],
                    peak=self.peak,
                )
            )
        self.writer.write(step, scalars)
        self.losses[step] = scalars["loss"]
        self.window_start, self.window_steps = time.perf_counter(), 0


@dataclasses.dataclass
class Run:
    """A training run ready to step: its setup, checkpointer, data and starting state."""

    setup: state_lib.TrainSetup
    ckpt: ckpt_lib.TrainCheckpointer
    pipeline: data_lib.Pipeline
    state: dict
    workdir: str


def prepare(config, workdir: str, devices=None) -> Run:
    """Everything before the first step; user errors are raised here, before the model
    is created (the workdir's checkpoints are checked first, and never touched)."""
    config_lib.validate(config)
    check_eval_source(config)
    workdir = os.path.abspath(workdir)
    t = config.train
    arch = resolve_architecture(config)
    setup = state_lib.build(config, arch, devices)
    pipeline = data_lib.make_pipeline(
        config.data.source,
        seq_len=t.seq_len,
        global_batch_size=t.global_batch_size,
        seed=config.seed,
        shuffle=config.data.shuffle,
        num_workers=config.data.num_workers,
        max_docs=config.data.max_docs,
    )
    # Refuses a workdir whose checkpoint has another shape, before anything expensive.
    ckpt = ckpt_lib.TrainCheckpointer(
        workdir,
        arch=arch,
        every=config.checkpoint.every,
        keep=config.checkpoint.keep,
        async_save=config.checkpoint.async_save,
        extra_meta=lora_training.checkpoint_meta(setup),
    )
    lora_training.check_workdir(ckpt, setup)
    return Run(setup, ckpt, pipeline, initial_state(setup, ckpt, pipeline), workdir)


def train(config, workdir: str, devices=None) -> dict:
    """Runs the training job; returns a summary (used by tests and the CLI). `devices`
    restricts the mesh to some of the devices (tests compare meshes in one process)."""
    run = prepare(config, workdir, devices)
    setup, ckpt, pipeline, state, t = run.setup, run.ckpt, run.pipeline, run.state, config.train
    start = step = int(state["step"])
    writer = MetricsWriter(run.workdir, is_primary=jax.process_index() == 0, total_steps=t.steps)
    logger = StepLogger(setup, writer, start)
    save = lambda step, force=False: ckpt.save(
        step, state["params"], state["opt_state"], pipeline.iterator, config.seed, force=force
    )
    ckpt.install_sigterm_handler()
    preempted = False
    with setup.scope():
        while step < t.steps:
            batch = data_lib.global_batch(next(pipeline), setup.mesh, setup.rules)
            state, out = setup.train_step(state, batch)
            step += 1
            logger.after_step(step, out)
            if t.eval_every and step % t.eval_every == 0:
                writer.write(step, {"eval_loss": evaluate(setup, state["params"])})
            if ckpt.should_stop(step):
                save(step, force=True)
                logging.warning(
                    "Preempted: saved step %d to %s; run the same command to resume",
                    step,
                    ckpt.directory,
                )
                preempted = True
                break
            save(step)
        if not preempted and ckpt.latest_step() != step:
            save(step, force=True)
    ckpt.close()
    writer.close()
    return {
        "step": step,
        "losses": logger.losses,
        "checkpoints": ckpt.directory,
        "metrics": os.path.join(run.workdir, "metrics.jsonl"),
        "tensorboard": os.path.join(run.workdir, "tensorboard"),
        "preempted": preempted,
    }


def main(argv):
    del argv
    logs.quiet_library_logs()
    initialize_distributed()
    if not _WORKDIR.value:
        raise app.UsageError("--workdir is required: where checkpoints and metrics go")
    try:
        summary = train(_CONFIG.value, _WORKDIR.value)
    except errors.UserError as e:
        sys.exit(errors.report(e))
    if jax.process_index() == 0:
        losses = summary["losses"]
        if losses:
            first, last = min(losses), max(losses)
            print(f"loss: step {first} {losses[first]:.4f} -> step {last} {losses[last]:.4f}")
        print(f"checkpoints: {summary['checkpoints']}")
        print(f"metrics:     {summary['metrics']}")
        print(f"tensorboard: tensorboard --logdir {summary['tensorboard']}")


if __name__ == "__main__":
    app.run(main)
