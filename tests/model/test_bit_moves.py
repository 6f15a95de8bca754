"""bit_moves: bfloat16 data moved as uint16 bits is moved exactly, and the compiled
programs that slice weight stacks or write the KV cache in bfloat16 no longer hold a
float32 (or copied) array of the whole stack or cache, which XLA:CPU made of them."""

import re

import jax
import jax.numpy as jnp
import numpy as np

from gpt_oss_train import runtime
from gpt_oss_train.arrays import bit_moves
from gpt_oss_train.model import kv_cache


def _whole_arrays(hlo: str, shape) -> list[str]:
    """Fusions and copies in the optimized HLO that write an array of `shape` (any dtype):
    the buffers a program materializes (ops inside a fusion write nothing of their own)."""
    dims = ",".join(map(str, shape))
    return [
        line.strip()
        for line in hlo.splitlines()
        if re.search(rf"= \w+\[{dims}\]\S* (fusion|copy|convert)\(", line)
    ]


def test_moves_are_exact_and_other_dtypes_index_as_usual():
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((3, 4, 5)), jnp.bfloat16)
    i = jnp.asarray(2, jnp.int32)
    np.testing.assert_array_equal(np.asarray(bit_moves.take(a, (i, 1))), np.asarray(a)[2, 1])
    f = jnp.asarray(rng.standard_normal((3, 4)), jnp.float32)
    np.testing.assert_array_equal(np.asarray(bit_moves.take(f, i)), np.asarray(f)[2])
    assert bit_moves.storage_dtype(jnp.bfloat16) == jnp.uint16
    assert bit_moves.storage_dtype(jnp.float32) == jnp.float32
    assert bit_moves.value_dtype(jnp.uint16) == jnp.bfloat16
    stored = bit_moves.to_storage(a, jnp.uint16)
    assert stored.dtype == jnp.uint16
    back = bit_moves.from_storage(stored)
    assert back.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(back), np.asarray(a))


class _Cfg:
    num_blocks, num_kv_heads, head_dim = 4, 2, 8


def test_a_bfloat16_cache_is_written_in_place_and_reads_back_what_was_written():
    cache = kv_cache._empty(_Cfg, 3, 16, jnp.bfloat16, int8=False)
    assert cache.k.dtype == jnp.uint16
    rng = np.random.default_rng(1)
    k = jnp.asarray(rng.standard_normal((3, 1, 2, 8)), jnp.float32)
    positions = jnp.asarray([[5], [0], [-1]], jnp.int32)

    def step(cache, k):
        return kv_cache.write(cache, jnp.asarray(2, jnp.int32), k, -k, positions)

    compiled = jax.jit(step, donate_argnums=0).lower(cache, k).compile()
    whole = _whole_arrays(compiled.as_text(), cache.k.shape)
    assert whole and all("scatter" in line for line in whole), whole  # no convert, no copy
    out = compiled(cache, k)
    keys, values = kv_cache.layer_of(out, 2).keys_values(jnp.bfloat16)
    want = np.asarray(k.astype(jnp.bfloat16).astype(jnp.float32))
    np.testing.assert_array_equal(np.asarray(keys[0, 5], np.float32), want[0, 0])
    np.testing.assert_array_equal(np.asarray(values[1, 0], np.float32), -want[1, 0])
    assert not np.asarray(keys[2].astype(jnp.float32)).any()  # position -1: not written


def test_a_loop_over_slices_of_a_bfloat16_stack_reads_only_the_slices():
    """The MoE prefill's shape of loop: a product per group with group g of a layer-
    stacked bfloat16 weight. Compiled with inference_compiler_options, no instruction makes
    a whole-stack array (XLA's default hoists a float32 conversion, or a bit copy, of it)."""
    stack = jnp.ones((2, 4, 16, 24), jnp.bfloat16)
    x = jnp.ones((8, 16), jnp.bfloat16)

    def per_group(x, stack, layer):
        def body(g, y):
            w = bit_moves.take(stack, (layer, g))
            return y + jnp.dot(x, w, preferred_element_type=jnp.float32)

        return jax.lax.fori_loop(0, 4, body, jnp.zeros((8, 24), jnp.float32))

    args = (x, stack, jnp.asarray(1, jnp.int32))
    options = runtime.inference_compiler_options("cpu")
    hlo = jax.jit(per_group).lower(*args).compile(compiler_options=options).as_text()
    assert _whole_arrays(hlo, stack.shape) == []
    want = np.full((8, 24), 4 * 16.0)
    np.testing.assert_array_equal(np.asarray(jax.jit(per_group)(*args)), want)
