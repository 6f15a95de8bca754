"""The math of one training step: AdamW with warmup + cosine, the objective's gradient
(training/objectives.py), gradient accumulation over microbatches, GRPO's several updates per
rollout batch, and the optimizer state's shardings. `train.py` runs the loop around
these; `tools/bench_model.py` times them on synthetic batches.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from gpt_oss_train.kernels.xla.optimizer import ConfiguredOptimizer
from gpt_oss_train.model import parameters
from gpt_oss_train.model.transformer import ModelDef
from gpt_oss_train.training import objectives


def _decays(key_path, _) -> bool:
    """Weight decay where model/parameters.py declares it (matrices, not norms, biases or
    attention sinks)."""
    return parameters.lookup(parameters.path_of(key_path))[0].decay


def updates_per_step(t, rl=None) -> int:
    """Optimizer updates in one train step: GRPO's rl.num_iterations passes over each
    rollout batch (TRL's num_iterations), 1 otherwise."""
    return rl.num_iterations if t.objective == "grpo" and rl is not None else 1


def make_optimizer(t, updates: int = 1) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW (clipped by the global norm) on the schedule below, marked as the chain made
    from `t`, so the `optimizer_update` kernels may fuse it (kernels/xla/optimizer.py).
    `updates` (updates_per_step) stretches the schedule, which counts optimizer updates,
    over the run's train.steps steps."""
    # Linear warmup then cosine decay, shifted by one so the first update (count 0) already
    # uses lr/warmup_steps rather than 0, and the last (count steps-1) the end value.
    warmup, total = t.warmup_steps * updates, t.steps * updates
    base = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=t.learning_rate,
        warmup_steps=warmup,
        decay_steps=max(total, warmup + 1),
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


def update_if_finite(finite, update, old):
    """update() if `finite` else `old`: a step whose loss or gradient norm is not finite
    leaves the parameters and optimizer state exactly as they were (the step counter and
    the data still advance). A branch, not a select of both results: XLA:CPU did not fuse
    a select into the optimizer's update, so it cost one more pass over the parameters and
    both moments every step (docs/PERFORMANCE.md)."""
    return jax.lax.cond(finite, lambda _: update(), lambda _: old, None)


def make_train_step(model_def: ModelDef, tx, schedule, t, dpo=None, rl=None):
    """(state, batch) -> (state, metrics). metrics["skipped"] is 1.0 when the loss or the
    gradient norm was not finite and the update was skipped (update_if_finite). The
    update is the kernel registry's `optimizer_update` operation. `dpo`, `rl`: config.dpo
    and config.rl. GRPO with rl.num_iterations > 1: iterated_updates."""
    loss_fn = objectives.make_loss_fn(model_def, t, dpo, rl=rl)
    objective = objectives.OBJECTIVES[t.objective]
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

            zero_stats = {k_: jnp.zeros((), jnp.float32) for k_ in objective.stats}
            (grads, stats), _ = jax.lax.scan(one, (zeros, zero_stats), micro)
        n = jnp.maximum(stats[objective.count], 1.0)

        grad_norm = optax.tree.norm(grads) / n

        def update():
            decays = jax.tree_util.tree_map_with_path(_decays, params)
            return model_def.cfg.kernels.optimizer_update(
                tx, t, schedule, decays, grads, n, grad_norm, params, state["opt_state"]
            )

        metrics = {
            **objective.metrics(stats),
            "grad_norm": grad_norm,
            "learning_rate": schedule(state["step"]),
            "tokens": stats["tokens"],
        }
        finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(metrics["grad_norm"])
        params, opt_state = update_if_finite(finite, update, (params, state["opt_state"]))
        metrics["skipped"] = 1.0 - finite.astype(jnp.float32)
        return {"step": state["step"] + 1, "params": params, "opt_state": opt_state}, metrics

    updates = updates_per_step(t, rl)
    if updates == 1:
        return train_step
    return iterated_updates(train_step, model_def, t, rl)


def iterated_updates(train_step, model_def: ModelDef, t, rl):
    """A GRPO step of `updates` optimizer updates on one rollout batch (TRL's
    num_iterations): the sampling policy's log-probs (the ratio's denominator) are taken
    once, before the first update, microbatch by microbatch like the gradients; the
    metrics are the updates' means (skipped: 1 if any update was). The state's step
    counts train steps, one per rollout; inside, the learning-rate metric counts updates
    as the schedule does (make_optimizer(t, updates))."""
    is_lora, updates = model_def.cfg.lora is not None, rl.num_iterations

    def old_logprobs(params, batch, frozen):
        k = t.grad_accum_steps
        micro = jax.tree.map(lambda x: x.reshape(k, x.shape[0] // k, *x.shape[1:]), batch)
        base = frozen if is_lora else None

        def logprobs(mb):
            return objectives.policy_logprobs(model_def, t, params, mb, base, rl.temperature)[0]

        logp = jax.lax.map(logprobs, micro)
        return jax.lax.stop_gradient(logp.reshape(batch["targets"].shape))

    def step(state, batch, frozen=None):
        batch = {**batch, "old_logp": old_logprobs(state["params"], batch, frozen)}
        first = {**state, "step": state["step"] * updates}
        last, metrics = jax.lax.scan(
            lambda s, _: train_step(s, batch, frozen), first, None, length=updates
        )
        means = {k: jnp.mean(v) for k, v in metrics.items()}
        means["skipped"] = jnp.max(metrics["skipped"])
        return {**last, "step": state["step"] + 1}, means

    return step


def make_eval_step(model_def: ModelDef, t, dpo=None, objective: str | None = None, rl=None):
    """(params, batch, frozen=None) -> the objective's stats, summed over the batch
    (Objective.metrics turns their sums over batches into the logged means)."""
    loss_fn = objectives.make_loss_fn(model_def, t, dpo, objective, rl)

    def eval_step(params, batch, frozen=None):
        return loss_fn(params, batch, frozen)[1]

    return eval_step
