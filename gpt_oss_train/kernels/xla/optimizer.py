"""The `optimizer_update` op's reference: optax's update of the per-token mean gradient.

    update(tx, t, schedule, decays, grads, n, grad_norm, params, opt_state)
        -> (params, opt_state)

`grads` are sums over `n` tokens; `grad_norm` is the per-token mean's global norm (the
step's metric); `t` is config.train and `decays` marks the parameters with weight decay.
An implementation that fuses the optimizer (kernels/cpu/fused_adamw.py) reads the
hyperparameters from `t`, so it only stands in for the chain `make_optimizer(t)` built,
which is marked as a `ConfiguredOptimizer`.
"""

from __future__ import annotations

import jax
import optax


class ConfiguredOptimizer(optax.GradientTransformation):
    """The chain training/steps.make_optimizer(t) returns, so marked: an update made with
    it and the same `t` may run a fused implementation in its place."""


def update(tx, t, schedule, decays, grads, n, grad_norm, params, opt_state):
    # Per-token means, divided inside the update (a branch of the step): its rounding,
    # and so a run's losses, stay bit for bit what they were.
    mean = jax.tree.map(lambda g: g / n, grads)
    updates, opt_state = tx.update(mean, opt_state, params)
    return optax.apply_updates(params, updates), opt_state
