"""The KV cache's two ways to write a decode step's keys: the scatter every platform
uses, and the select over a layer's slots that TPUs use for one token a row
(platforms.Facts.kv_cache_select_writes). Both must leave the same cache."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gpt_oss_train.model import kv_cache


def _cache(rng, dtype, int8, layers=3, rows=4, slots=6, heads=2, dim=8):
    shape = (layers, rows, slots, heads, dim)
    pos = rng.integers(-1, 20, shape[:3]).astype(np.int32)
    if int8:
        scale = rng.random(shape[:-1] + (1,), np.float32)
        return kv_cache.KVCache(
            jnp.asarray(rng.integers(-127, 128, shape), jnp.int8),
            jnp.asarray(rng.integers(-127, 128, shape), jnp.int8),
            jnp.asarray(pos),
            jnp.asarray(scale),
            jnp.asarray(scale * 2),
        )
    k = jnp.asarray(rng.standard_normal(shape), dtype)
    return kv_cache.KVCache(k, -k, jnp.asarray(pos))


@pytest.mark.parametrize(
    "dtype,int8", [(jnp.float32, False), (jnp.bfloat16, False), (jnp.float32, True)]
)
def test_select_write_leaves_the_scatters_cache(dtype, int8):
    rng = np.random.default_rng(0)
    cache = _cache(rng, dtype, int8)
    k = jnp.asarray(rng.standard_normal((4, 1, 2, 8)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((4, 1, 2, 8)), jnp.float32)
    # Row 1 idle (-1: nothing written); row 3 past the slots (a ring's wrap: slot 9 % 6).
    positions = jnp.asarray([[2], [-1], [5], [9]], jnp.int32)
    layer = jnp.int32(1)
    scattered = jax.jit(kv_cache.write)(cache, layer, k, v, positions)  # CPU: the scatter
    selected = jax.jit(kv_cache._select_write)(cache, layer, k, v, positions)
    for name, a, b in zip(kv_cache.KVCache._fields, scattered, selected):
        if a is not None:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
    # The write landed where a hand count says: layer 1, slot 9 % 6 of row 3, nothing in row 1.
    assert int(selected.pos[1, 3, 3]) == 9 and int(selected.pos[1, 0, 2]) == 2
    np.testing.assert_array_equal(np.asarray(selected.pos[1, 1]), np.asarray(cache.pos[1, 1]))
    np.testing.assert_array_equal(np.asarray(selected.pos[0]), np.asarray(cache.pos[0]))
