"""The `optimizer_update` op's `cpu` implementation: the optimizer step of
`training/steps.make_optimizer` (clip by global norm, then optax's AdamW) as one pass per
parameter (adamw.py's kernel): the same arithmetic and the same optimizer state, so
checkpoints move freely between this path and optax's (xla/optimizer.py).

XLA:CPU runs optax's update as three loops per parameter (first moment, second moment,
parameter), and clipping computes a second global norm next to the metric's; here each
parameter, its gradient and both moments cross memory once (figures in
docs/PERFORMANCE.md). Elsewhere (accelerators, meshes of several devices, other
parameter dtypes), optax runs as before.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from gpt_oss_train.kernels.cpu import adamw as kernel
from gpt_oss_train.kernels.cpu import one_device
from gpt_oss_train.kernels.xla.optimizer import ConfiguredOptimizer

_STATES = (optax.ScaleByAdamState, optax.ScaleByScheduleState)


def _float32_arrays(tree) -> bool:
    return all(isinstance(a, jax.Array) and a.dtype == jnp.float32 for a in jax.tree.leaves(tree))


def unavailable(platform: str = "cpu") -> str | None:
    return kernel.unavailable()


def accepts(tx, t, schedule, decays, grads, n, grad_norm, params, opt_state) -> bool:
    """make_optimizer's chain, one device, float32 parameters and moments, one Adam state."""
    adam = [
        s
        for s in jax.tree.leaves(opt_state, is_leaf=lambda s: isinstance(s, _STATES))
        if isinstance(s, optax.ScaleByAdamState)
    ]
    return (
        isinstance(tx, ConfiguredOptimizer)
        and len(adam) == 1
        and one_device()
        and _float32_arrays((params, adam[0].mu, adam[0].nu))
    )


def update(tx, t, schedule, decays, grads, n, grad_norm, params, opt_state):
    """(params, opt_state) after one step of make_optimizer(t)'s chain on the gradient
    sums `grads` of `n` tokens, whose per-token mean has global norm `grad_norm` (the
    metric's); `decays` marks the parameters with weight decay (a tree of bools)."""
    adam = next(
        s
        for s in jax.tree.leaves(opt_state, is_leaf=lambda s: isinstance(s, _STATES))
        if isinstance(s, optax.ScaleByAdamState)
    )
    count = optax.safe_increment(adam.count)
    scalars = dict(
        n=n,
        clip=(t.grad_clip_norm > 0) & ~(grad_norm < t.grad_clip_norm),
        norm=grad_norm,
        max_norm=t.grad_clip_norm,
        b1=t.b1,
        b2=t.b2,
        bc1=1 - t.b1**count,
        bc2=1 - t.b2**count,
        eps=t.eps,
        eps_root=0.0,
        step=-1 * schedule(adam.count),
    )
    out = jax.tree.map(
        lambda p, g, m, v, decay: kernel.step(p, g, m, v, wd=t.weight_decay * decay, **scalars),
        params,
        grads,
        adam.mu,
        adam.nu,
        decays,
    )
    pick = lambda i: jax.tree.map(lambda _, o: o[i], params, out)
    new_params, mu, nu = pick(0), pick(1), pick(2)

    def advance(s):
        if isinstance(s, optax.ScaleByAdamState):
            return optax.ScaleByAdamState(count=count, mu=mu, nu=nu)
        if isinstance(s, optax.ScaleByScheduleState):
            return optax.ScaleByScheduleState(count=optax.safe_increment(s.count))
        return s

    return new_params, jax.tree.map(advance, opt_state, is_leaf=lambda s: isinstance(s, _STATES))
