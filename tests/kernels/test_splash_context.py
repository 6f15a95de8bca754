"""TPU splash attention inside context parallelism (kernels/tpu/splash_attention.py's
`context_parallel`, run by kernels/xla/context_parallel.py), in Pallas' TPU interpreter on
the 8-device CPU mesh: a sequence split 4 ways (x 2 for the batch) gives the unsplit XLA
reference's outputs and gradients, for full layers (the whole mask's block tables split
along the queries) and banded ones (the previous shard's tail in front of the keys), with
packed documents crossing the shard borders, padding and sinks; and the kernels' dispatch
runs it where config.kernels.attention resolves to splash."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gpt_oss_train import config as config_lib
from gpt_oss_train import sharding
from gpt_oss_train.kernels import Kernels, registry
from gpt_oss_train.kernels.tpu import splash_attention
from gpt_oss_train.kernels.xla import attention, context_parallel

B, S, N, KH, H = 2, 1024, 4, 2, 64  # a shard: 256 queries, two of splash's 128-blocks
WINDOW = 128  # gpt-oss's banded layers
MESH = dict(data=1, fsdp=2, context=4, tensor=1, expert=1)


def _case(seed=0):
    """q/k/v, sinks, and rows of three documents each (positions restart, segment ids
    count up, the borders off the shards') ending in padding (segment 0, position -1)."""
    rng = np.random.RandomState(seed)
    q, k, v = (jnp.asarray(rng.randn(B, S, n, H), jnp.float32) for n in (N, KH, KH))
    sinks = jnp.asarray(rng.randn(N), jnp.float32)
    positions = np.full((B, S), -1, np.int32)
    segments = np.zeros((B, S), np.int32)
    for row, cuts in enumerate(([0, 300, 301, 1000], [0, 90, 600, 960])):
        for seg, (a, b) in enumerate(zip(cuts[:-1], cuts[1:]), start=1):
            positions[row, a:b] = np.arange(b - a)
            segments[row, a:b] = seg
    weights = jnp.asarray(rng.randn(B, S, N, H) * (segments > 0)[..., None, None], jnp.float32)
    return (q, k, v, sinks), jnp.asarray(positions), jnp.asarray(segments), weights


def _value_and_grads(f, args, weights):
    """f's outputs and the gradients of their weighted sum (padding queries weigh 0)."""
    loss = lambda *a: jnp.sum(f(*a) * weights)
    out = jax.jit(f)(*args)
    return out, jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*args)


# window 16: a tail of 16 keys, padded in front to whole blocks of keys
@pytest.mark.parametrize("window", [None, WINDOW, 16])
def test_splash_shards_equal_the_unsplit_reference(window):
    args, pos, seg, weights = _case()
    kw = dict(positions=pos, segment_ids=seg, window=window, block=512)
    ref_out, ref_grads = _value_and_grads(
        lambda *a: attention.self_attention(*a, **kw), args, weights
    )
    mesh = sharding.make_mesh(MESH)
    with sharding.use_mesh(mesh, config_lib.DEFAULT_RULES):
        assert context_parallel.length_axes(S, window) == ("context",)
        split = lambda *a: context_parallel.attention(
            *a, **kw, local=splash_attention.context_parallel
        )
        out, grads = _value_and_grads(split, args, weights)
    real = np.asarray(seg > 0)
    scale = float(np.abs(ref_out).max())
    err = float(np.abs(np.asarray(out - ref_out)[real]).max()) / scale
    assert err < 1e-5, ("out", err)
    for name, g, g_ref in zip(("dq", "dk", "dv", "dsinks"), grads, ref_grads):
        g, g_ref = np.asarray(g), np.asarray(g_ref)
        if name == "dq":  # padding queries: their own business (splash lets them see padding)
            g, g_ref = g[real], g_ref[real]
        err = float(np.abs(g - g_ref).max()) / float(np.abs(g_ref).max())
        assert err < 1e-5, (name, err)


def test_the_dispatch_takes_splash_on_split_sequences(monkeypatch):
    """config.kernels.attention="splash" on a context mesh: each shard runs splash (a Pallas
    call in the program), with the reference's numbers. On a CPU the registry lets a TPU
    kernel be chosen only here: it runs in Pallas' interpreter."""
    monkeypatch.setattr(registry, "_interpreted", lambda impl: True)
    args, pos, seg, _ = _case(1)
    kw = dict(positions=pos, segment_ids=seg, window=WINDOW, block=512)
    ref = attention.self_attention(*args, **kw)
    mesh = sharding.make_mesh(MESH)
    with sharding.use_mesh(mesh, config_lib.DEFAULT_RULES):
        f = jax.jit(lambda *a: Kernels.of(attention="splash").attention(*a, **kw))
        assert "pallas_call" in str(jax.make_jaxpr(f)(*args))
        out = f(*args)
    real = np.asarray(seg > 0)
    np.testing.assert_allclose(np.asarray(out)[real], np.asarray(ref)[real], atol=1e-5)


@pytest.mark.parametrize("window", [None, WINDOW])
def test_unsplit_splash_equals_the_reference(window):
    """One device, the whole sequence: the MQA kernel mapped over the KV heads gives the
    reference's outputs and gradients (query head j reads KV head j // group)."""
    args, pos, seg, weights = _case(2)
    kw = dict(positions=pos, segment_ids=seg, window=window, block=512)
    ref_out, ref_grads = _value_and_grads(
        lambda *a: attention.self_attention(*a, **kw), args, weights
    )
    out, grads = _value_and_grads(
        lambda *a: splash_attention.self_attention(*a, **kw), args, weights
    )
    real = np.asarray(seg > 0)
    err = float(np.abs(np.asarray(out - ref_out)[real]).max()) / float(np.abs(ref_out).max())
    assert err < 1e-5, ("out", err)
    for name, g, g_ref in zip(("dq", "dk", "dv", "dsinks"), grads, ref_grads):
        g, g_ref = np.asarray(g), np.asarray(g_ref)
        if name == "dq":
            g, g_ref = g[real], g_ref[real]
        assert float(np.abs(g - g_ref).max()) / float(np.abs(g_ref).max()) < 1e-5, name
