"""The one place a training run's state and step are built: model, optimizer, shardings,
abstract state, the jitted donated train step and the eval step.

`train.py` runs it, `tools/aot_compile.py` compiles it for a TPU topology and
`tools/bench_model.py` times it, so the memory verdict and the timings describe exactly
what training runs. Nothing here allocates the state: `init_state` does, on request.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections

from gpt_oss_train import config as config_lib
from gpt_oss_train import sharding
from gpt_oss_train.errors import ConfigError
from gpt_oss_train.model import lora
from gpt_oss_train.model.transformer import ModelDef
from gpt_oss_train.training import lora as lora_training
from gpt_oss_train.training import steps
from gpt_oss_train.training.data import BATCH_KEYS


@dataclasses.dataclass
class TrainSetup:
    config: ml_collections.ConfigDict
    model_def: ModelDef
    mesh: jax.sharding.Mesh
    rules: tuple
    tx: Any
    schedule: Any
    state_shardings: dict  # {"step", "params", "opt_state"} -> NamedShardings
    abstract_state: dict  # the same tree of jax.ShapeDtypeStruct (with shardings)
    batch_sharding: jax.sharding.NamedSharding
    train_step: Any  # jitted (state, batch) -> (state, metrics); the state is donated
    eval_step: Any  # jitted (params, batch) -> (summed nll, token count)
    # LoRA: the frozen base (training/lora.py); params, gradients and optimizer state are
    # then the adapters'. None: full fine-tuning.
    frozen: lora_training.FrozenBase | None = None
    # Full fine-tuning with DPO, or GRPO with rl.kl_coef > 0: the reference policy, a frozen
    # copy of the starting parameters (under LoRA it is the base with the adapters off).
    reference: lora_training.FrozenBase | None = None

    @property
    def model_cfg(self):
        return self.model_def.cfg

    def scope(self):
        """Steps trace under this: activations are constrained to the mesh by the rules."""
        return sharding.use_mesh(self.mesh, self.rules)

    def abstract_batch(self) -> dict:
        """What data.global_batch gives the step: int32 [global_batch, seq_len] arrays (and
        GRPO's float32 advantages, a row's repeated along it)."""
        t = self.config.train
        shape = (t.global_batch_size, t.seq_len)
        batch = {
            k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self.batch_sharding)
            for k in BATCH_KEYS
        }
        if t.objective == "grpo":
            batch["advantages"] = jax.ShapeDtypeStruct(
                shape, jnp.float32, sharding=self.batch_sharding
            )
        return batch

    def init_state(self, params=None, step: int = 0) -> dict:
        """A state at `step` from `params` (random ones from config.seed if None), with a
        fresh optimizer state; every array created straight into its sharding."""
        with self.scope():
            if self.frozen is not None:  # LoRA: the base comes from the config; fresh adapters
                params = lora_training.init_adapters(
                    self.model_def,
                    self.config.seed,
                    self.mesh,
                    self.rules,
                    self.state_shardings["params"],
                )
            elif params is None:
                params = self.model_def.init(self.config.seed, self.mesh, self.rules)
            opt_state = jax.jit(self.tx.init, out_shardings=self.state_shardings["opt_state"])(
                params
            )
        return self.state_from(params, opt_state, step)

    def state_from(self, params, opt_state, step: int) -> dict:
        return {
            "step": jax.device_put(jnp.asarray(step, jnp.int32), self.state_shardings["step"]),
            "params": params,
            "opt_state": opt_state,
        }


def check_batch(global_batch_size: int, grad_accum_steps: int, mesh, rules):
    """The global batch must split evenly over the batch shards and the microbatches."""
    divisor = sharding.batch_divisor(mesh, rules) * grad_accum_steps
    if global_batch_size % divisor:
        raise ConfigError(
            f"config.train.global_batch_size={global_batch_size} must be a multiple of "
            f"{divisor} (the batch shards x grad_accum_steps)"
        )


def _with_shardings(tree, shardings):
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings
    )


def build(config, arch: dict | None = None, devices=None) -> TrainSetup:
    """Everything a training step needs, for `config` (validated here) with architecture
    `arch` (default: config.model) on `devices` (default: all)."""
    config_lib.validate(config)
    t = config.train
    rules = sharding.validate_rules(config.logical_axis_rules)
    mesh = sharding.make_mesh(config.mesh, config.mesh_dcn, devices)
    platform = sharding.platform(mesh)
    model_def = ModelDef(config_lib.ModelConfig.from_config(config, arch, platform))
    model_def.cfg.kernels.check(platform)
    check_batch(t.global_batch_size, t.grad_accum_steps, mesh, rules)
    tx, schedule = steps.make_optimizer(t, steps.updates_per_step(t, config.rl))

    # Built outside the mesh context: optax creates its step counters eagerly, and under a
    # mesh of compile-only devices (tools/aot_compile.py) an eager op has nowhere to run.
    param_sh = model_def.shardings(mesh, rules)
    abstract_params = model_def.abstract_params(mesh, rules)
    frozen = None
    if model_def.cfg.lora is not None:  # only the adapters train; the base is frozen
        frozen = lora_training.FrozenBase(config, model_def, mesh, rules)
        param_sh, abstract_params = lora.split(param_sh)[1], lora.split(abstract_params)[1]
    opt_sh = steps.opt_state_shardings(tx, abstract_params, param_sh, mesh)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    state_sh = {"step": replicated, "params": param_sh, "opt_state": opt_sh}
    abstract_state = {
        "step": jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated),
        "params": abstract_params,
        "opt_state": _with_shardings(jax.eval_shape(tx.init, abstract_params), opt_sh),
    }
    batch_sh = sharding.batch_sharding(mesh, rules, 2)
    reference = None
    needs_reference = t.objective == "dpo" or (t.objective == "grpo" and config.rl.kl_coef)
    if needs_reference and frozen is None:  # the starting parameters, loaded again
        reference = lora_training.FrozenBase(config, model_def, mesh, rules)
    bound = frozen or reference  # the step's extra, non-donated argument
    bound_sh = () if bound is None else (bound.shardings,)
    train_step = jax.jit(
        steps.make_train_step(model_def, tx, schedule, t, config.dpo, config.rl),
        in_shardings=(state_sh, batch_sh, *bound_sh),
        out_shardings=(state_sh, None),
        donate_argnums=0,
    )
    eval_step = jax.jit(
        steps.make_eval_step(model_def, t, config.dpo, rl=config.rl),
        in_shardings=(param_sh, batch_sh, *bound_sh),
    )
    if bound is not None:
        train_step = lora_training.WithFrozen(train_step, bound)
        eval_step = lora_training.WithFrozen(eval_step, bound)
    return TrainSetup(
        config,
        model_def,
        mesh,
        rules,
        tx,
        schedule,
        state_sh,
        abstract_state,
        batch_sh,
        train_step,
        eval_step,
        frozen,
        reference,
    )
