"""Pre-train or fine-tune a GPT-OSS model.

    python -m gpt_oss_train.train --config=configs/cpu_tiny.py --workdir=/tmp/run

The same command runs on one CPU and on every host of a pod; the workdir may be local or
gs://bucket/run (io/storage.py). In order:

  1. config -> validated; then the workdir lock (io/workdir_lock.py): a second run on the
     same workdir stops here with one line, before any work
  2. the architecture: from the config, or from `checkpoint.init_from` when fine-tuning
  3. the training setup (training/state.py): mesh, logical-axis rules, shardings, the
     jitted donated train step; the same one tools/aot_compile.py compiles for a TPU pod
  4. data: a grain pipeline per process, batches assembled into global arrays (GRPO:
     prompts, whose batches the serving engine samples from the live policy,
     post_training/rollouts.py)
  5. state: the newest checkpoint in <workdir>/checkpoints that restores (a damaged one
     is logged and set aside), else init_from's params, else random ones
  6. loop: train_step (which skips an update whose loss or gradient norm is not finite),
     metrics every log_every steps, eval every eval_every, an Orbax checkpoint every
     checkpoint.every. It stops without losing finished work on SIGTERM (saves, exit 0),
     and with one line and exit 1 after train.max_nonfinite_steps skipped steps in a row,
     a failed checkpoint save (checkpoint.max_failed_saves) or a lost workdir lock.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import jax
from absl import app, flags, logging

from gpt_oss_train import architecture, errors, hardware, hosts, logs, runtime, sharding
from gpt_oss_train import config as config_lib
from gpt_oss_train.checkpoints import checkpoint as ckpt_lib
from gpt_oss_train.errors import ConfigError, RunStopped
from gpt_oss_train.io import hf, storage, workdir_lock
from gpt_oss_train.post_training import rollouts
from gpt_oss_train.training import data as data_lib
from gpt_oss_train.training import flops as flops_lib
from gpt_oss_train.training import guards
from gpt_oss_train.training import lora as lora_training
from gpt_oss_train.training import state as state_lib
from gpt_oss_train.training.evaluate import evaluate
from gpt_oss_train.training.metrics import MetricsWriter

_CONFIG = errors.define_config_flag("config", "configs/cpu_tiny.py", "Config file.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Where checkpoints and metrics go.")


def resolve_architecture(config) -> dict:
    """The architecture to train: config.model, or init_from's when fine-tuning."""
    src = config.checkpoint.init_from
    if not src:
        return architecture.validate(config_lib.model_arch(config))
    if not storage.exists(src):
        raise ConfigError(f"config.checkpoint.init_from: {src} does not exist")
    if ckpt_lib.is_orbax_checkpoint(src):
        arch = ckpt_lib.read_model_config(src)
    elif storage.is_remote(src):
        raise ConfigError(
            f"config.checkpoint.init_from: {src} is not an Orbax checkpoint; a Hugging Face "
            "folder is read from local disk (or convert it: python -m "
            "gpt_oss_train.tools.convert_checkpoint)"
        )
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


def check_objective_data(config, source) -> None:
    """DPO trains on preference pairs and only on them."""
    pairs = getattr(source, "has_pairs", False)
    if config.train.objective == "dpo" and not pairs:
        raise ConfigError(
            f"config.data.source: train.objective='dpo' needs preference pairs "
            f"(pairs:PATH.jsonl), got {config.data.source!r}"
        )
    if config.train.objective != "dpo" and pairs:
        raise ConfigError(
            f"config.data.source: {config.data.source!r} holds preference pairs; train them "
            "with train.objective='dpo' (configs/dpo.py)"
        )
    if pairs:
        data_lib.check_pairs_fit(source, config.train.seq_len)


def initial_state(setup: state_lib.TrainSetup, ckpt, pipeline) -> tuple[dict, dict]:
    """(state, the checkpoint's meta) from the newest checkpoint of this run that restores,
    else init_from's parameters, else random ones (meta {})."""
    abstract = setup.abstract_state
    found = ckpt.restore_newest(
        abstract["params"],
        abstract["opt_state"],
        pipeline.iterator,
        whole_batches=pipeline.whole_batches,
    )
    if found is not None:
        start, (params, opt_state, meta) = found
        logging.info("Resumed from %s at step %d", ckpt.directory, start)
        return setup.state_from(params, opt_state, start), meta
    src = setup.config.checkpoint.init_from
    if not src or setup.frozen is not None:  # LoRA: the setup reads its frozen base itself
        return setup.init_state(), {}
    abstract = setup.abstract_state["params"]
    if ckpt_lib.is_orbax_checkpoint(src):
        params = ckpt_lib.load_params(src, abstract)[0]
    else:
        params = hf.load_sharded(src, abstract)
    return setup.init_state(params), {}


class StepLogger:
    """Writes the step's scalars every log_every steps, with throughput figures from the
    steps since the last write (the first step includes compilation: none for it)."""

    def __init__(self, setup: state_lib.TrainSetup, writer: MetricsWriter, start: int):
        t = setup.config.train
        self.t, self.writer, self.start = t, writer, start
        self.tokens_per_step = t.global_batch_size * t.seq_len
        rl = setup.config.rl
        passes = flops_lib.forward_passes_per_step(
            t.objective, num_iterations=rl.num_iterations, kl=bool(rl.kl_coef)
        )
        forward = flops_lib.forward_flops_per_token(setup.model_cfg, t.seq_len)["total"]
        self.flops_per_token = forward * passes
        kind = sharding.device(setup.mesh).device_kind
        self.peak = hardware.peak_flops(kind, t.peak_flops_per_device or None)
        self.window_start, self.window_steps, self.window_rollout_s = time.perf_counter(), 0, 0.0
        self.losses: dict[int, float] = {}

    def due(self, step: int) -> bool:
        return step % self.t.log_every == 0 or step == self.t.steps or step == self.start + 1

    def after_step(self, step: int, out, skipped_steps: int = 0) -> None:
        self.window_steps += 1
        self.window_rollout_s += out.get("rollout_s", 0.0)  # GRPO: the engine's share
        if not self.due(step):
            return
        out = jax.device_get(out)
        scalars = {k: float(v) for k, v in out.items() if k not in ("tokens", "skipped")}
        if skipped_steps:
            scalars["skipped_steps"] = skipped_steps
        if step > self.start + 1:
            elapsed = time.perf_counter() - self.window_start
            perf = lambda seconds: flops_lib.throughput_metrics(
                step_time_s=seconds / self.window_steps,
                tokens_per_step=self.tokens_per_step,
                num_devices=jax.device_count(),
                flops_per_token=self.flops_per_token,
                peak=self.peak,
            )
            scalars.update(perf(elapsed))
            if self.window_rollout_s:  # the learner alone: the step less its rollouts
                learner = perf(max(elapsed - self.window_rollout_s, 1e-9))
                scalars.update({k.replace("perf/", "perf/learner_"): v for k, v in learner.items()})
        self.writer.write(step, scalars)
        self.losses[step] = scalars["loss"]
        self.window_start, self.window_steps, self.window_rollout_s = time.perf_counter(), 0, 0.0


@dataclasses.dataclass
class Run:
    """A training run ready to step: its setup, checkpointer, data and starting state,
    holding its workdir's lock (None on processes other than 0) until `close()`."""

    setup: state_lib.TrainSetup
    ckpt: ckpt_lib.TrainCheckpointer
    pipeline: data_lib.Pipeline
    state: dict
    workdir: str
    lock: workdir_lock.WorkdirLock | None = None
    meta: dict = dataclasses.field(default_factory=dict)  # the resumed checkpoint's
    rollouts: rollouts.Rollouts | None = None  # GRPO: `pipeline` is its prompts'

    def next_batch(self, step: int) -> tuple[dict, dict]:
        """(this step's local batch, metrics of how it was made: GRPO's rollout)."""
        if self.rollouts is not None:
            return self.rollouts.batch(self.state, step)
        return next(self.pipeline), {}

    def close(self) -> None:
        """Waits for a save under way, then releases the workdir."""
        try:
            if self.rollouts is not None:
                self.rollouts.close()
            self.ckpt.close()
        finally:
            if self.lock is not None:
                self.lock.release()


def prepare(config, workdir: str, devices=None, link: hosts.Link | None = None) -> Run:
    """Everything before the first step; user errors are raised here, before the model
    is created (the workdir's checkpoints are checked first, and never touched). A run
    that fails here leaves no lock and no folder it created behind."""
    config_lib.validate(config)
    check_eval_source(config)
    workdir = storage.normalize(workdir)
    created = not storage.exists(workdir)
    lock = workdir_lock.acquire_for_job(workdir)  # process 0 holds it; all refuse together
    try:
        return _prepare_locked(config, workdir, devices, lock, link)
    except BaseException:
        if lock is not None:
            lock.release()
        if created and not storage.is_remote(workdir) and jax.process_index() == 0:
            try:
                os.rmdir(workdir)  # only if empty
            except OSError:
                pass
        raise


def _prepare_locked(config, workdir: str, devices, lock, link) -> Run:
    t = config.train
    arch = resolve_architecture(config)
    setup = state_lib.build(config, arch, devices)
    grpo = None
    if t.objective == "grpo":
        grpo = rollouts.Rollouts(setup, config, link)
        pipeline = grpo.pipeline
    else:
        pipeline = data_lib.make_pipeline(
            config.data.source,
            seq_len=t.seq_len,
            global_batch_size=t.global_batch_size,
            seed=config.seed,
            shuffle=config.data.shuffle,
            num_workers=config.data.num_workers,
            max_docs=config.data.max_docs,
        )
        check_objective_data(config, pipeline.source)
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
    state, meta = initial_state(setup, ckpt, pipeline)
    logging.info("%s", setup.model_cfg.kernels.describe(sharding.platform(setup.mesh)))
    return Run(setup, ckpt, pipeline, state, workdir, lock, meta, grpo)


def _lock_lost(lock) -> str | None:
    try:
        if lock is not None:
            lock.check()
    except workdir_lock.WorkdirLockLostError as e:
        return str(e)
    return None


class _Loop:
    """The training loop's state between steps; `run()` is the loop."""

    def __init__(self, run: Run, writer: MetricsWriter):
        self.r, self.c, self.writer = run, run.setup.config, writer
        self.state = run.state
        self.step = int(self.state["step"])
        self.logger = StepLogger(run.setup, writer, self.step)
        self.skipped = guards.SkippedSteps(
            self.c.train.max_nonfinite_steps, run.meta.get("skipped_steps", 0)
        )
        self.failed_saves = 0

    def save(self, force: bool = False) -> None:
        self.r.ckpt.save(
            self.step,
            self.state["params"],
            self.state["opt_state"],
            self.r.pipeline.iterator,
            self.c.seed,
            force=force,
            meta={"skipped_steps": self.skipped.total},
        )

    def run(self) -> bool:
        """Trains to train.steps; True if it stopped early for a SIGTERM (saved first)."""
        setup, ckpt, pipeline, t = self.r.setup, self.r.ckpt, self.r.pipeline, self.c.train
        ckpt.install_sigterm_handler()
        with setup.scope():
            while self.step < t.steps:
                self.r.state = self.state  # what GRPO's rollouts sample from
                local, made = self.r.next_batch(self.step)
                batch = data_lib.global_batch(
                    local, setup.mesh, setup.rules, whole=pipeline.whole_batches
                )
                self.state, out = setup.train_step(self.state, batch)
                self.step += 1
                self.skipped.push(self.step, out)
                due = ckpt.due(self.step)
                # The previous step's flag is ready by now; this one's only before a save.
                self.skipped.settle(
                    self.step if due or self.logger.due(self.step) else self.step - 1
                )
                self.logger.after_step(self.step, {**out, **made}, self.skipped.total)
                self.check_diverged()
                if t.eval_every and self.step % t.eval_every == 0:
                    held_out = (
                        self.r.rollouts.evaluate(self.state)
                        if self.r.rollouts
                        else evaluate(setup, self.state["params"])
                    )
                    self.writer.write(self.step, held_out)
                if self.check_stops():
                    return True
                if due and not self.skipped.in_a_row:  # never rotate out good ones mid-streak
                    self.save()
            self.skipped.settle(self.step)
            self.check_diverged()
            if ckpt.latest_step() != self.step:
                self.save(force=True)
            self.finish_saving()
        return False

    def check_diverged(self) -> None:
        if self.skipped.diverged:
            step = self.r.ckpt.latest_step()
            kept = (
                "nothing was saved after them: the newest checkpoint, step "
                f"{step}, holds the last finite parameters"
                if step is not None
                else "no checkpoint was saved"
            )
            raise RunStopped(
                f"{self.skipped.in_a_row} steps in a row (to step {self.skipped.last_skipped}) "
                "had a non-finite loss or gradient norm; their updates were skipped and "
                f"{kept}. Lower train.learning_rate (now "
                f"{self.c.train.learning_rate:g}) or check the data, then run again "
                "(train.max_nonfinite_steps sets the limit)"
            )

    def check_stops(self) -> bool:
        """Acts on what any process saw: a lost lock or a failed save (raises) or SIGTERM
        (saves, returns True)."""
        ckpt = self.r.ckpt
        ckpt.poll()
        lost = _lock_lost(self.r.lock)
        stop, failed, lock_lost = guards.agree_any(
            ckpt.stop_requested(self.step), ckpt.failure is not None, lost is not None
        )
        if lock_lost:
            raise workdir_lock.WorkdirLockLostError(
                lost or "process 0 lost the workdir lock (its log says to whom)"
            )
        if failed:
            self.save_failed()
        if stop:
            self.save(force=True)
            self.finish_saving()
            logging.warning(
                "Preempted: saved step %d to %s; run the same command to resume",
                self.step,
                ckpt.directory,
            )
        return stop

    def save_failed(self, last: bool = False) -> None:
        """Stops the run, unless checkpoint.max_failed_saves allows another try later."""
        message = self.r.ckpt.failure or "a checkpoint save failed on another process"
        self.r.ckpt.failure = None
        self.failed_saves += 1
        allowed = self.c.checkpoint.max_failed_saves
        if last or self.failed_saves > allowed:
            step = self.r.ckpt.latest_step()
            kept = (
                f"the newest checkpoint, step {step}, is intact; fix the storage, then run the "
                "same command to resume"
                if step is not None
                else "no checkpoint was saved before it; fix the storage, then run the same "
                "command to start again"
            )
            raise RunStopped(f"{message}. Nothing of that save was kept, and {kept}")
        logging.error(
            "%s; training goes on and saves again at the next checkpoint step (%d of %d "
            "failed saves allowed by checkpoint.max_failed_saves)",
            message,
            self.failed_saves,
            allowed,
        )

    def finish_saving(self) -> None:
        """Waits for the run's last save; a failure stops the run (there is no later try)."""
        self.r.ckpt.wait()
        (failed,) = guards.agree_any(self.r.ckpt.failure is not None)
        if failed:
            self.save_failed(last=True)


def train(config, workdir: str, devices=None, link: hosts.Link | None = None) -> dict:
    """Runs the training job; returns a summary (used by tests and the CLI). `devices`
    restricts the mesh to some of the devices (tests compare meshes in one process);
    `link`: the job's hosts.Link on several processes (GRPO's rollouts use it)."""
    run = prepare(config, workdir, devices, link)
    try:
        start = int(run.state["step"])
        writer = MetricsWriter(
            run.workdir,
            is_primary=jax.process_index() == 0,
            total_steps=config.train.steps,
            resume_step=start,
        )
        try:
            loop = _Loop(run, writer)
            preempted = loop.run()
        finally:
            writer.close()
    finally:
        run.close()
    return {
        "step": loop.step,
        "losses": loop.logger.losses,
        "skipped_steps": loop.skipped.total,
        "checkpoints": run.ckpt.directory,
        "metrics": storage.join(run.workdir, "metrics.jsonl"),
        "tensorboard": storage.join(run.workdir, "tensorboard"),
        "preempted": preempted,
    }


def main(argv):
    del argv
    logs.quiet_library_logs()
    link = hosts.join()  # before anything asks JAX for its devices
    with link:
        runtime.setup_process(sharding.platform())
        if not _WORKDIR.value:
            raise app.UsageError("--workdir is required: where checkpoints and metrics go")
        try:
            summary = train(_CONFIG.value, _WORKDIR.value, link=link)
        except (errors.UserError, errors.RunStopped) as e:
            status = errors.report(e)
        else:
            status = 0
    if status:
        sys.exit(status)
    if jax.process_index() == 0:
        losses = summary["losses"]
        if losses:
            first, last = min(losses), max(losses)
            print(f"loss: step {first} {losses[first]:.4f} -> step {last} {losses[last]:.4f}")
        print(f"checkpoints: {summary['checkpoints']}")
        print(f"metrics:     {summary['metrics']}")
        print(f"tensorboard: tensorboard --logdir {summary['tensorboard']}")


def run():
    """The `gpt-oss-train` console script: `python -m gpt_oss_train.train`."""
    app.run(main, flags_parser=errors.parse_flags)


if __name__ == "__main__":
    run()
