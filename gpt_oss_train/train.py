"""Pre-train or fine-tune a GPT-OSS model.

    python -m gpt_oss_train.train --config=configs/cpu_tiny.py --workdir=/tmp/run

The same command runs on one CPU and on every host of a pod. In order:

  1. config -> validated; the architecture comes from the config, or from
     `checkpoint.init_from` when fine-tuning
  2. mesh (data, fsdp, tensor, expert) and logical-axis rules
  3. data: a grain pipeline per process, batches assembled into global arrays
  4. state: resumed from <workdir>/checkpoints, else loaded (init_from), else random;
     created straight into its shardings
  5. loop: train_step (one jit, state donated), metrics every log_every steps,
     eval every eval_every, Orbax checkpoint every checkpoint.every, SIGTERM -> save+exit
"""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
from absl import app, flags, logging
from ml_collections import config_flags

from gpt_oss_train import config as config_lib
from gpt_oss_train import runtime, sharding
from gpt_oss_train.model.transformer import ModelDef
from gpt_oss_train.training import checkpoint as ckpt_lib
from gpt_oss_train.training import data as data_lib
from gpt_oss_train.training import metrics as metrics_lib
from gpt_oss_train.training.steps import (
    make_eval_step,
    make_optimizer,
    make_train_step,
    opt_state_shardings,
)

_CONFIG = config_flags.DEFINE_config_file("config", "configs/cpu_tiny.py", "Config file.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Where checkpoints and metrics go.")


# ----------------------------------------------------------------------------- setup


def resolve_architecture(config) -> dict:
    """The architecture to train: config.model, or init_from's when fine-tuning."""
    arch = config_lib.model_arch(config)
    src = config.checkpoint.init_from
    if src:
        if not os.path.exists(src):
            raise config_lib.ConfigError(f"config.checkpoint.init_from: {src} does not exist")
        from gpt_oss_train.io import hf

        if ckpt_lib.is_orbax_checkpoint(src):
            arch = ckpt_lib.read_model_config(src)
        elif os.path.exists(os.path.join(src, "config.json")):
            arch = hf.HFCheckpoint(src).model_config
        else:
            raise config_lib.ConfigError(
                f"config.checkpoint.init_from: {src} is neither an Orbax checkpoint written by "
                "gpt_oss_train nor a Hugging Face folder with config.json"
            )
        logging.info("Fine-tuning: architecture taken from %s", src)
    config_lib.validate_model(arch)
    return arch


def load_init_params(src: str, model_def: ModelDef, mesh, rules):
    from gpt_oss_train.io import hf

    abstract = model_def.abstract_params(mesh, rules)
    if ckpt_lib.is_orbax_checkpoint(src):
        params, _, _ = ckpt_lib.load_params(src, abstract)
        return params
    return hf.load_sharded(src, abstract)


def train(config, workdir: str, devices=None) -> dict:
    """Runs the training job; returns a summary (used by tests and the CLI). `devices`
    restricts the mesh to some of the devices (tests compare meshes in one process)."""
    config_lib.validate(config)
    workdir = os.path.abspath(workdir)
    t = config.train
    if (
        t.eval_every
        and not config.data.eval_source
        and not (config.data.source == "stdlib" or config.data.source.startswith("tfds:"))
    ):
        raise config_lib.ConfigError(
            "config.data.eval_source: periodic eval (train.eval_every > 0) needs a held-out "
            f"source; {config.data.source!r} has no eval split. Set data.eval_source or "
            "train.eval_every=0"
        )
    arch = resolve_architecture(config)
    model_cfg = config_lib.ModelConfig.from_config(config, arch)
    rules = sharding.validate_rules(config.logical_axis_rules)
    mesh = sharding.make_mesh(config.mesh, config.mesh_dcn, devices)
    divisor = sharding.batch_divisor(mesh, rules) * t.grad_accum_steps
    if t.global_batch_size % divisor:
        raise config_lib.ConfigError(
            f"config.train.global_batch_size={t.global_batch_size} must be a multiple of "
            f"{divisor} (the batch shards x grad_accum_steps)"
        )
    # Refuses a workdir whose checkpoint has another shape, before anything expensive.
    ckpt = ckpt_lib.TrainCheckpointer(
        workdir,
        arch=arch,
        every=config.checkpoint.every,
        keep=config.checkpoint.keep,
        async_save=config.checkpoint.async_save,
    )
    model_def = ModelDef(model_cfg)
    tx, schedule = make_optimizer(t)

    pipeline = data_lib.make_pipeline(
        config.data.source,
        seq_len=t.seq_len,
        global_batch_size=t.global_batch_size,
        seed=config.seed,
        shuffle=config.data.shuffle,
        num_workers=config.data.num_workers,
        max_docs=config.data.max_docs,
    )

    with sharding.use_mesh(mesh, rules):
        param_sh = model_def.shardings(mesh, rules)
        abstract_params = model_def.abstract_params(mesh, rules)
        opt_sh = opt_state_shardings(tx, abstract_params, param_sh, mesh)
        abstract_opt = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            jax.eval_shape(tx.init, abstract_params),
            opt_sh,
        )
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        state_sh = {"step": replicated, "params": param_sh, "opt_state": opt_sh}

        start = ckpt.latest_step()
        if start is not None:
            params, opt_state, meta = ckpt.restore(
                start, abstract_params, abstract_opt, pipeline.iterator
            )
            logging.info("Resumed from %s at step %d", ckpt.directory, start)
        else:
            start = 0
            if config.checkpoint.init_from:
                params = load_init_params(config.checkpoint.init_from, model_def, mesh, rules)
            else:
                params = model_def.init(config.seed, mesh, rules)
            opt_state = jax.jit(tx.init, out_shardings=opt_sh)(params)
        state = {
            "step": jax.device_put(jnp.asarray(start, jnp.int32), replicated),
            "params": params,
            "opt_state": opt_state,
        }

        batch_sh = sharding.batch_sharding(mesh, rules, 2)
        train_step = jax.jit(
            make_train_step(model_def, tx, schedule, t),
            in_shardings=(state_sh, batch_sh),
            out_shardings=(state_sh, None),
            donate_argnums=0,
        )
        eval_step = jax.jit(make_eval_step(model_def, t), in_shardings=(param_sh, batch_sh))

        flops_per_token = metrics_lib.training_flops_per_token(model_cfg, t.seq_len)["total"]
        peak = metrics_lib.peak_flops_per_device(
            jax.devices()[0].device_kind, t.peak_flops_per_device or None
        )
        writer = metrics_lib.MetricsWriter(
            workdir, is_primary=jax.process_index() == 0, total_steps=t.steps
        )
        ckpt.install_sigterm_handler()
        losses = {}
        step = start
        stopped_early = False
        window_start, window_steps = time.perf_counter(), 0
        while step < t.steps:
            batch = data_lib.global_batch(next(pipeline), mesh, rules)
            state, out = train_step(state, batch)
            step += 1
            window_steps += 1
            if step % t.log_every == 0 or step == t.steps or step == start + 1:
                out = jax.device_get(out)
                elapsed = time.perf_counter() - window_start
                scalars = {k: float(v) for k, v in out.items() if k != "tokens"}
                if step > start + 1:  # the first step includes compilation: no throughput for it
                    scalars.update(
                        metrics_lib.throughput_metrics(
                            step_time_s=elapsed / window_steps,
                            tokens_per_step=t.global_batch_size * t.seq_len,
                            num_devices=jax.device_count(),
                            flops_per_token=flops_per_token,
                            peak=peak,
                        )
                    )
                writer.write(step, scalars)
                losses[step] = scalars["loss"]
                window_start, window_steps = time.perf_counter(), 0
            if t.eval_every and step % t.eval_every == 0:
                writer.write(
                    step, {"eval_loss": evaluate(config, eval_step, state["params"], mesh, rules)}
                )
            if ckpt.should_stop(step):
                ckpt.save(
                    step,
                    state["params"],
                    state["opt_state"],
                    pipeline.iterator,
                    config.seed,
                    force=True,
                )
                logging.warning(
                    "Preempted: saved step %d to %s; run the same command to resume",
                    step,
                    ckpt.directory,
                )
                stopped_early = True
                break
            ckpt.save(step, state["params"], state["opt_state"], pipeline.iterator, config.seed)
        if not stopped_early and ckpt.latest_step() != step:
            ckpt.save(
                step,
                state["params"],
                state["opt_state"],
                pipeline.iterator,
                config.seed,
                force=True,
            )
        ckpt.close()
        writer.close()
    summary = {
        "step": step,
        "losses": losses,
        "checkpoints": ckpt.directory,
        "metrics": os.path.join(workdir, "metrics.jsonl"),
        "tensorboard": os.path.join(workdir, "tensorboard"),
        "preempted": stopped_early,
    }
    return summary


def evaluate(config, eval_step, params, mesh, rules) -> float:
    """Mean next-token loss over config.train.eval_batches batches of the held-out split,
    read from the start each time so evals are comparable."""
    t = config.train
    source = config.data.eval_source or config.data.source
    pipeline = data_lib.make_pipeline(
        source,
        seq_len=t.seq_len,
        global_batch_size=t.global_batch_size,
        seed=config.seed,
        shuffle=False,
        split="eval",
        max_docs=config.data.max_docs,
    )
    nll, n = 0.0, 0.0
    for _ in range(t.eval_batches):
        a, b = eval_step(params, data_lib.global_batch(next(pipeline), mesh, rules))
        nll, n = nll + float(a), n + float(b)
    return nll / max(n, 1.0)


def main(argv):
    del argv
    metrics_lib.quiet_library_logs()
    runtime.setup_compilation_cache()
    sharding.initialize_distributed()
    if not _WORKDIR.value:
        raise app.UsageError("--workdir is required: where checkpoints and metrics go")
    summary = train(_CONFIG.value, _WORKDIR.value)
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
