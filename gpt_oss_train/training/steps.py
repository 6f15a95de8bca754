"""The math of one training step: AdamW with warmup + cosine, the objective (next-token
loss, DPO or GRPO), gradient accumulation over microbatches, GRPO's several updates per
rollout batch, and the optimizer state's shardings. `train.py` runs the loop around
these; `tools/benchmark.py` times them on synthetic batches.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

from gpt_oss_train.kernels.xla.optimizer import ConfiguredOptimizer
from gpt_oss_train.model import lora, parameters
from gpt_oss_train.model.transformer import DTYPES, ModelDef
from gpt_oss_train.training import loss as loss_lib
from gpt_oss_train.training import rl_losses


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


# ----------------------------------------------------------------------------- objectives


@dataclasses.dataclass(frozen=True)
class Objective:
    """What an objective's loss function sums (`stats`: every one adds up over
    microbatches), which of them normalises the objective (`count`: the gradient is the
    summed objective's over it), and what is logged: each of `means` is a stat divided by
    the count, or by the stat named with it."""

    stats: tuple[str, ...]
    count: str
    means: dict[str, str | tuple[str, str]]  # logged name -> stat, or (stat, its count)

    def metrics(self, stats: dict) -> dict:
        out = {}
        for name, key in self.means.items():
            key, count = (key, self.count) if isinstance(key, str) else key
            out[name] = stats[key] / jnp.maximum(stats[count], 1.0)
        return out


OBJECTIVES = {  # config.train.objective
    "lm": Objective(
        stats=("nll", "z", "aux", "tokens"),
        count="tokens",
        means={"loss": "nll", "aux_loss": "aux", "z_loss": "z"},
    ),
    # Names as TRL's DPOTrainer logs them.
    "dpo": Objective(
        stats=("loss", "aux", "pairs", "tokens", *rl_losses.DPO_STATS),
        count="pairs",
        means={
            "loss": "loss",
            "aux_loss": "aux",
            "rewards/chosen": "chosen_reward",
            "rewards/rejected": "rejected_reward",
            "rewards/margins": "margin",
            "rewards/accuracies": "accuracy",
            "logps/chosen": "chosen_logp",
            "logps/rejected": "rejected_logp",
        },
    ),
    # Names as TRL's GRPOTrainer logs them; the rollouts' own (rewards, lengths) are the
    # loop's (rollouts.py).
    "grpo": Objective(
        stats=("loss", "aux", "normalizer", *rl_losses.GRPO_STATS),
        count="normalizer",
        means={
            "loss": "loss",
            "aux_loss": ("aux", "sequences"),
            "kl": ("kl", "tokens"),
            "clip_ratio": ("clipped", "tokens"),
            "ratio": ("ratio", "tokens"),
        },
    ),
}


def _hidden(model_def: ModelDef, tree, batch):
    model = model_def.bind(tree)
    hidden, aux, _ = model(batch["inputs"], batch["positions"], batch["segment_ids"])
    return hidden, aux


def _token_logprobs(model_def: ModelDef, t, tree, hidden, batch):
    """log p(target) of every position, [rows, seq_len]."""
    return loss_lib.token_logprobs(
        hidden,
        tree["unembed"]["kernel"],
        batch["targets"],
        chunk=t.loss_chunk_size,
        dtype=DTYPES[model_def.cfg.dtype],
        kernels=model_def.cfg.kernels,
        gather_once=t.loss_gather_once,
    )[0]


def policy_logprobs(model_def: ModelDef, t, params, batch, frozen=None, temperature=1.0):
    """The trained policy's log p(target) of every position, [rows, seq_len], and the MoE
    aux loss. Under LoRA `params` are the adapters and `frozen` the base (else None).
    `temperature`: of the distribution the tokens were sampled from (logits / T, as the
    engine samples; the final hidden state scaled is the logits scaled)."""
    policy = params if frozen is None else lora.merge(frozen, params)
    hidden, aux = _hidden(model_def, policy, batch)
    if temperature != 1.0:
        hidden = hidden / jnp.asarray(temperature, hidden.dtype)
    return _token_logprobs(model_def, t, policy, hidden, batch), aux


def make_loss_fn(model_def: ModelDef, t, dpo=None, objective: str | None = None, rl=None):
    """loss_fn(params, batch, frozen=None) -> (summed objective, stats): sums (over tokens,
    or DPO's pairs), so the gradient-accumulation path divides once by the total count
    (OBJECTIVES[t.objective].count). With LoRA, `params` are the adapters (what is
    differentiated) and `frozen` the base; under full-fine-tuning DPO, `frozen` is the
    reference's parameters. `dpo`, `rl`: config.dpo and config.rl; `objective` overrides
    t.objective."""
    dtype = DTYPES[model_def.cfg.dtype]
    is_lora = model_def.cfg.lora is not None

    def lm_loss(params, batch, frozen=None):
        tree = params if frozen is None else lora.merge(frozen, params)
        hidden, aux = _hidden(model_def, tree, batch)
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

    def token_logprobs(tree, hidden, batch):
        return _token_logprobs(model_def, t, tree, hidden, batch)

    def sequence_logprobs(tree, batch):
        """Each row's summed log-probability of its trained tokens, [rows]; and the MoE aux."""
        hidden, aux = _hidden(model_def, tree, batch)
        logp = token_logprobs(tree, hidden, batch)
        return rl_losses.sequence_logprobs(logp, batch["loss_mask"]), aux

    def dpo_loss(params, batch, frozen):
        # The reference: the base with the adapters off (LoRA), or a frozen copy of the
        # starting parameters (full fine-tuning); no gradient flows into it.
        # Adapters off are zero adapters (B = 0): the LoRA model computes the base exactly.
        if is_lora:
            policy = lora.merge(frozen, params)
            reference = lora.merge(frozen, jax.tree.map(jnp.zeros_like, params))
        else:
            policy, reference = params, frozen
        logp, aux = sequence_logprobs(policy, batch)
        ref_logp, _ = sequence_logprobs(jax.lax.stop_gradient(reference), batch)
        trained = jnp.sum(batch["loss_mask"], axis=1).reshape(-1, 2)  # rows 2i, 2i+1: pair i
        real = jnp.all(trained > 0, axis=1).astype(jnp.float32)  # padding pairs count for 0
        loss, pairs, stats = rl_losses.dpo_sums(
            *logp.reshape(-1, 2).T,
            *ref_logp.reshape(-1, 2).T,
            beta=dpo.beta,
            label_smoothing=dpo.label_smoothing,
            weights=real,
        )
        objective = loss + t.aux_loss_coef * aux * pairs
        tokens = jnp.sum(batch["loss_mask"]).astype(jnp.float32)
        return objective, {"loss": loss, "aux": aux * pairs, "pairs": pairs, "tokens": tokens,
                           **stats}  # fmt: skip

    def grpo_loss(params, batch, frozen=None):
        # Log-probs at the sampling temperature, the reference's too (as TRL takes them).
        base = frozen if is_lora else None
        logp, aux = policy_logprobs(model_def, t, params, batch, base, rl.temperature)
        # The sampling policy's log-probs: the batch carries them when the step makes
        # several updates on it (make_train_step); at the first update the sampling policy
        # is these parameters, so they are logp without its gradient (the ratio is 1, its
        # gradient is not).
        old_logp = batch.get("old_logp", jax.lax.stop_gradient(logp))
        ref_logp = None
        if rl.kl_coef:
            reference = (lora.merge(frozen, jax.tree.map(jnp.zeros_like, params))
                         if is_lora else frozen)  # fmt: skip
            ref_logp, _ = policy_logprobs(model_def, t, jax.lax.stop_gradient(reference), batch,
                                          temperature=rl.temperature)  # fmt: skip
        loss, normalizer, stats = rl_losses.grpo_sums(
            logp,
            old_logp,
            batch["advantages"][:, 0],
            batch["loss_mask"],
            ref_logp=ref_logp,
            kl_coef=rl.kl_coef,
            epsilon_low=rl.epsilon_low,
            epsilon_high=rl.epsilon_high,
            averaging=rl.averaging,
            max_completion_length=rl.max_new_tokens,
        )
        objective = loss + t.aux_loss_coef * aux * normalizer
        return objective, {"loss": loss, "aux": aux * stats["sequences"],
                           "normalizer": normalizer, **stats}  # fmt: skip

    return {"lm": lm_loss, "dpo": dpo_loss, "grpo": grpo_loss}[objective or t.objective]


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
    loss_fn = make_loss_fn(model_def, t, dpo, rl=rl)
    objective = OBJECTIVES[t.objective]
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
        logp = jax.lax.map(
            lambda mb: policy_logprobs(model_def, t, params, mb, base, rl.temperature)[0], micro
        )
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
    loss_fn = make_loss_fn(model_def, t, dpo, objective, rl)

    def eval_step(params, batch, frozen=None):
        return loss_fn(params, batch, frozen)[1]

    return eval_step
