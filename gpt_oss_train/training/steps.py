"""The math of one optimizer step: AdamW with warmup + cosine, the loss, gradient
accumulation over microbatches, and the optimizer state's shardings. `train.py` runs the
loop around these; `tools/benchmark.py` times them on synthetic batches.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from gpt_oss_train.kernels.xla.optimizer import ConfiguredOptimizer
from gpt_oss_train.model import lora, parameters
from gpt_oss_train.model.transformer import DTYPES, ModelDef
from gpt_oss_train.training import loss as loss_lib


def _decays(key_path, _) -> bool:
    """Weight decay where model/parameters.py declares it (matrices, not norms, biases or
    attention sinks)."""
    return parameters.lookup(parameters.path_of(key_path))[0].decay


def make_optimizer(t) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW (clipped by the global norm) on the schedule below, marked as the chain made
    from `t`, so the `optimizer_update` kernels may fuse it (kernels/xla/optimizer.py)."""
    # Linear warmup then cosine decay, shifted by one so the first update (count 0) already
    # uses lr/warmup_steps rather than 0, and the last (count steps-1) the end value.
    base = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=t.learning_rate,
        warmup_steps=t.warmup_steps,
        decay_steps=max(t.steps, t.warmup_steps + 1),
        end_value=t.learning_rate * t.end_lr_ratio,
    )
    schedule = lambda count: base(count + 1)
    tx = optax.adamw(
        schedule,
        b1=t.b1,
        b2=t.b2,
        eps=t.eps,
        weight_decay=t.weight_decay,
        mask=lambda params: jax.tree_util.tree_map_with_path(_decays, params),
    )
    if t.grad_clip_norm > 0:
        tx = optax.chain(optax.clip_by_global_norm(t.grad_clip_norm), tx)
    return ConfiguredOptimizer(*tx), schedule


def opt_state_shardings(tx, abstract_params, param_shardings, mesh):
    """Optimizer-state leaves shaped like params take the param's sharding; scalars
    (step counts) are replicated."""
    abstract_state = jax.eval_shape(tx.init, abstract_params)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return optax.tree_utils.tree_map_params(
        tx,
        lambda _, s: s,
        abstract_state,
        param_shardings,
        transform_non_params=lambda _: replicated,
    )


# ----------------------------------------------------------------------------- steps


def make_loss_fn(model_def: ModelDef, t):
    """loss_fn(params, batch, frozen=None) -> (summed objective, stats): sums over tokens,
    so the gradient-accumulation path divides once by the total token count. With LoRA,
    `params` are the adapters (what is differentiated) and `frozen` the base."""
    dtype = DTYPES[model_def.cfg.dtype]

    def loss_fn(params, batch, frozen=None):
        tree = params if frozen is None else lora.merge(frozen, params)
        model = model_def.bind(tree)
        hidden, aux, _ = model(batch["inputs"], batch["positions"], batch["segment_ids"])
        nll, z, n = loss_lib.lm_loss_sums(
            hidden,
            tree["unembed"]["kernel"],
            batch["targets"],
            batch["loss_mask"],
            chunk=t.loss_chunk_size,
            dtype=dtype,
            kernels=model_def.cfg.kernels,
            gather_once=t.loss_gather_once,
        )
        # The aux and z terms are scaled by the token count so that, like the NLL, they are
        # per-token means once the summed objective is divided by the total count.
        objective = nll + t.z_loss_coef * z + t.aux_loss_coef * aux * n
        return objective, {"nll": nll, "z": z, "aux": aux * n, "tokens": n}

    return loss_fn


def update_if_finite(finite, update, old):
    """update() if `finite` else `old`: a step whose loss or gradient norm is not finite
    leaves the parameters and optimizer state exactly as they were (the step counter and
    the data still advance). A branch, not a select of both results: XLA:CPU did not fuse
    a select into the optimizer's update, so it cost one more pass over the parameters and
    both moments every step (docs/PERFORMANCE.md)."""
    return jax.lax.cond(finite, lambda _: update(), lambda _: old, None)


def make_train_step(model_def: ModelDef, tx, schedule, t):
    """(state, batch) -> (state, metrics). metrics["skipped"] is 1.0 when the loss or the
    gradient norm was not finite and the update was skipped (update_if_finite). The
    update is the kernel registry's `optimizer_update` operation."""
    loss_fn = make_loss_fn(model_def, t)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def train_step(state, batch, frozen=None):
        params = state["params"]
        if t.grad_accum_steps == 1:
            (_, stats), grads = grad_fn(params, batch, frozen)
        else:
            # Microbatches under scan: the summed gradients of k microbatches equal those of
            # the whole batch (up to float summation order), at 1/k of the activation memory.
            k = t.grad_accum_steps
            micro = jax.tree.map(lambda x: x.reshape(k, x.shape[0] // k, *x.shape[1:]), batch)
            zeros = jax.tree.map(jnp.zeros_like, params)

            def one(acc, mb):
                (_, st), g = grad_fn(params, mb, frozen)
                return jax.tree.map(jnp.add, acc, (g, st)), None

            zero_stats = {k_: jnp.zeros((), jnp.float32) for k_ in ("nll", "z", "aux", "tokens")}
            (grads, stats), _ = jax.lax.scan(one, (zeros, zero_stats), micro)
        n = jnp.maximum(stats["tokens"], 1.0)

        grad_norm = optax.tree.norm(grads) / n

        def update():
            decays = jax.tree_util.tree_map_with_path(_decays, params)
            return model_def.cfg.kernels.optimizer_update(
                tx, t, schedule, decays, grads, n, grad_norm, params, state["opt_state"]
            )

        metrics = {
            "loss": stats["nll"] / n,
            "aux_loss": stats["aux"] / n,
            "z_loss": stats["z"] / n,
            "grad_norm": grad_norm,
            "learning_rate": schedule(state["step"]),
            "tokens": stats["tokens"],
        }
        finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(metrics["grad_norm"])
        params, opt_state = update_if_finite(finite, update, (params, state["opt_state"]))
        metrics["skipped"] = 1.0 - finite.astype(jnp.float32)
        return {"step": state["step"] + 1, "params": params, "opt_state": opt_state}, metrics

    return train_step


def make_eval_step(model_def: ModelDef, t):
    loss_fn = make_loss_fn(model_def, t)

    def eval_step(params, batch, frozen=None):
        _, stats = loss_fn(params, batch, frozen)
        return stats["nll"], stats["tokens"]

    return eval_step
