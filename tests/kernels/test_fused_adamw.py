"""The one-pass AdamW step on a CPU (kernels/cpu/fused_adamw.py, kernels/cpu/adamw.cc)
against optax's chain that make_optimizer builds: parameters and optimizer state after
updates that clip and that do not, with and without weight decay per parameter, the
state's structure unchanged (checkpoints move between the two paths), and the train step
taking it (the `optimizer_update` op) against the same step with optax's update."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from gpt_oss_train import config as config_lib
from gpt_oss_train.kernels import Kernels
from gpt_oss_train.kernels.cpu import fused_adamw
from gpt_oss_train.model.transformer import ModelDef
from gpt_oss_train.training import steps


@pytest.fixture
def kernel(cpu_kernel):
    """kernels/cpu/adamw.py, built (skips where this CPU or machine cannot: AVX-512 and a
    C++ compiler)."""
    return cpu_kernel("adamw")


def _train_config(**kw):
    t = config_lib.default_config().train
    base = dict(learning_rate=1e-2, warmup_steps=2, steps=10, grad_clip_norm=1.0)
    t.update({**base, "weight_decay": 0.1, **kw})
    return t


def _params(rng):
    """Two parameters with weight decay (matrices) and one without (a norm's scale), sizes
    that are not multiples of a vector."""
    f32 = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    return {
        "unembed": {"kernel": f32(33, 70)},
        "final_norm": {"scale": f32(33)},
        "embed": {"embedding": f32(70, 33)},
    }


@pytest.mark.parametrize("clip_norm", [1.0, 0.0])
def test_updates_equal_optax(clip_norm, kernel):
    t = _train_config(grad_clip_norm=clip_norm)
    tx, schedule = steps.make_optimizer(t)
    rng = np.random.default_rng(0)
    params = _params(rng)
    decays = jax.tree_util.tree_map_with_path(steps._decays, params)
    assert decays["unembed"]["kernel"] and not decays["final_norm"]["scale"]
    ours = ref = (params, tx.init(params))
    fused = jax.jit(lambda *a: fused_adamw.update(tx, t, schedule, decays, *a))
    clipped = []
    for scale in (0.001, 1.0, 0.005):  # per-token gradient norms ~0.07, ~68, ~0.34
        grads = jax.tree.map(
            lambda p: jnp.asarray(rng.standard_normal(p.shape) * scale * 64, jnp.float32), params
        )
        n = jnp.float32(64.0)
        norm = optax.tree.norm(grads) / n
        clipped.append(bool(norm >= 1.0))
        updates, state = tx.update(jax.tree.map(lambda g: g / n, grads), ref[1], ref[0])
        ref = (optax.apply_updates(ref[0], updates), state)
        assert fused_adamw.accepts(tx, t, schedule, decays, grads, n, norm, *ours)
        # the same chain, not marked as make_optimizer's: the kernel does not stand in for it
        plain = optax.GradientTransformation(*tx)
        assert not fused_adamw.accepts(plain, t, schedule, decays, grads, n, norm, *ours)
        ours = fused(grads, n, norm, *ours)
        assert jax.tree.structure(ours) == jax.tree.structure(ref)
        for got, want in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
            want = np.asarray(want)
            # float32, the same operations (the compiler may fuse a multiply-add): a few ulps
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * max(np.abs(want).max(), 1))
    assert clipped == [False, True, False]
    moved = np.abs(np.asarray(ours[0]["unembed"]["kernel"] - params["unembed"]["kernel"]))
    assert moved.max() > 1e-3  # three steps at lr ~1e-2 moved the weights


@pytest.mark.full
def test_train_step_takes_the_kernel_and_matches_optax(kernel):
    """The train step with the "auto" kernels (the fused update) against the same step with
    the `optimizer_update` op's reference (optax), every other op as it was."""
    c = config_lib.default_config()
    c.dtype = "float32"
    c.model.update(
        vocab_size=128,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        num_experts=4,
        experts_per_token=2,
        intermediate_size=32,
        sliding_window=8,
    )
    c.train.update(learning_rate=1e-3, warmup_steps=1, steps=4)
    mc = config_lib.ModelConfig.from_config(c)
    assert mc.kernels.impl("optimizer_update").name == "cpu"
    tx, schedule = steps.make_optimizer(c.train)
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 128, (4, 17)).astype(np.int32)
    batch = {
        "inputs": ids[:, :-1],
        "targets": ids[:, 1:],
        "loss_mask": np.ones((4, 16), np.int32),
        "positions": np.tile(np.arange(16, dtype=np.int32), (4, 1)),
        "segment_ids": np.ones((4, 16), np.int32),
    }
    params = ModelDef(mc).init(0)

    def run(kernels):
        md = ModelDef(mc.replace(kernels=kernels))
        step = jax.jit(steps.make_train_step(md, tx, schedule, c.train))
        state = {"step": jnp.int32(0), "params": params, "opt_state": tx.init(params)}
        hlo = step.lower(state, batch).as_text()
        for _ in range(2):
            state, _ = step(state, batch)
        return state, kernel.TARGET in hlo

    fused, took = run(mc.kernels)
    assert took
    plain, took = run(Kernels.of(**{**dict(mc.kernels.choices), "optimizer_update": "xla"}))
    assert not took
    for got, want in zip(jax.tree.leaves(fused), jax.tree.leaves(plain)):
        want = np.asarray(want)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * max(np.abs(want).max(), 1))
