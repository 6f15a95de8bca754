"""The KV cache: its layout, its logical axes, how new keys/values are written.

One cache per block kind, {"sliding": KVCache, "full": KVCache}, each array stacked on a
leading [num_blocks] axis like the block parameters. Slot i of a row holds the key/value
of position pos[b, i] (-1: empty). A token at position p lives in slot p % slots: full
layers have a slot per position, banded layers a ring of at least `window` slots, so
their memory does not grow with context. With an int8 cache, k/v are int8 and
k_scale/v_scale hold one float32 scale per (slot, head). On a CPU a bfloat16 cache keeps
its values as uint16 bit patterns (kernels/platforms.py), which XLA:CPU scatters in place.

The cache is created under jit straight into the shardings the logical axis rules give
`cache_batch`, `cache_length`, `cache_kv_heads` and `cache_head_dim`, like every other
array: no host copy, and decode's attention finds its keys where its queries are.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from gpt_oss_train import sharding
from gpt_oss_train.arrays import bit_moves
from gpt_oss_train.kernels import platforms
from gpt_oss_train.model import quantize

# Logical axes of each cache array (after the leading `layers` axis of the stack).
KV_AXES = ("layers", "cache_batch", "cache_length", "cache_kv_heads", "cache_head_dim")
POS_AXES = ("layers", "cache_batch", "cache_length")


class KVCache(NamedTuple):
    k: jax.Array  # [b, slots, kv_heads, head_dim] (per layer; stacked: a leading axis)
    v: jax.Array  # [b, slots, kv_heads, head_dim]
    pos: jax.Array  # [b, slots] int32
    k_scale: jax.Array | None = None  # [b, slots, kv_heads, 1]
    v_scale: jax.Array | None = None

    def keys_values(self, dtype):
        if self.k_scale is None:
            return bit_moves.from_storage(self.k), bit_moves.from_storage(self.v)
        return (
            quantize.dequantize_kv(self.k, self.k_scale, dtype),
            quantize.dequantize_kv(self.v, self.v_scale, dtype),
        )


def layer_of(cache: KVCache, layer) -> KVCache:
    """Layer `layer` (an int32 scalar) of a stacked cache."""
    return jax.tree.map(lambda a: a[layer], cache)


def write(cache: KVCache, layer, k, v, positions) -> KVCache:
    """Scatter layer `layer`'s new keys/values [b, s, ...] into the stacked cache at slot =
    position % slots; positions < 0 are not written. The rest of the stack is untouched,
    so inside the layer loop XLA updates the carried cache in place."""
    slots = cache.pos.shape[2]
    if positions.shape[1] == 1 and platforms.facts().kv_cache_select_writes:
        return _select_write(cache, layer, k, v, positions)
    slot = jnp.where(positions >= 0, positions % slots, slots)  # out of range -> dropped
    bidx = jnp.arange(k.shape[0])[:, None]
    put = lambda buf, x: buf.at[layer, bidx, slot].set(
        bit_moves.to_storage(x, buf.dtype), mode="drop"
    )
    pos = cache.pos.at[layer, bidx, slot].set(positions.astype(jnp.int32), mode="drop")
    if cache.k_scale is None:
        return KVCache(put(cache.k, k), put(cache.v, v), pos)
    (kq, ks), (vq, vs) = quantize.quantize_kv(k), quantize.quantize_kv(v)
    return KVCache(
        put(cache.k, kq), put(cache.v, vq), pos, put(cache.k_scale, ks), put(cache.v_scale, vs)
    )


def _select_write(cache: KVCache, layer, k, v, positions) -> KVCache:
    """write() of one token a row [b, 1, ...] as a select over the layer's slots: the
    layer read and written whole, in whatever layout its attention reads it in."""
    slots = cache.pos.shape[2]
    slot = jnp.where(positions >= 0, positions % slots, -1)  # [b, 1]; -1: no slot
    hit = jnp.arange(slots)[None, :] == slot  # [b, slots]

    def put(buf, x):  # buf [layers, b, slots, ...], x [b, 1, ...]
        where = hit.reshape(hit.shape + (1,) * (buf.ndim - 3))
        new = jnp.where(where, bit_moves.to_storage(x, buf.dtype), buf[layer])
        return jax.lax.dynamic_update_index_in_dim(buf, new, layer, axis=0)

    pos = put(cache.pos, positions.astype(jnp.int32))
    if cache.k_scale is None:
        return KVCache(put(cache.k, k), put(cache.v, v), pos)
    (kq, ks), (vq, vs) = quantize.quantize_kv(k), quantize.quantize_kv(v)
    return KVCache(
        put(cache.k, kq), put(cache.v, vq), pos, put(cache.k_scale, ks), put(cache.v_scale, vs)
    )


def _axes(cache: KVCache) -> KVCache:
    """The logical axes of each array of a (stacked) cache."""
    scale = None if cache.k_scale is None else KV_AXES
    return KVCache(KV_AXES, KV_AXES, POS_AXES, scale, scale)


def _empty(cfg, batch: int, slots: int, dtype, int8: bool) -> KVCache:
    shape = (cfg.num_blocks, batch, slots, cfg.num_kv_heads, cfg.head_dim)
    pos = jnp.full(shape[:3], -1, jnp.int32)
    if int8:
        scale = shape[:-1] + (1,)
        return KVCache(
            jnp.zeros(shape, jnp.int8),
            jnp.zeros(shape, jnp.int8),
            pos,
            jnp.zeros(scale, jnp.float32),
            jnp.zeros(scale, jnp.float32),
        )
    store = platforms.kv_cache_dtype(dtype)
    return KVCache(jnp.zeros(shape, store), jnp.zeros(shape, store), pos)


def shardings(cache: dict, mesh, rules) -> dict:
    """NamedShardings of a cache (arrays or their abstract shapes) by the logical rules."""

    def one(axes, a):
        spec = sharding.fit_spec(sharding.logical_to_spec(axes, rules), a.shape, mesh)
        return jax.sharding.NamedSharding(mesh, spec)

    return {
        kind: jax.tree.map(
            one, _axes(c), c, is_leaf=lambda x: isinstance(x, tuple) and isinstance(x[0], str)
        )
        for kind, c in cache.items()
    }


def init(cfg, batch: int, max_len: int, ring: int, dtype, int8: bool = False) -> dict:
    """Empty caches for every block: full layers hold `max_len` slots, banded layers a ring
    of `ring`. Created under jit, placed by the active mesh's rules (sharding.use_mesh)."""
    return _maker(cfg, batch, max_len, ring, jnp.dtype(dtype), int8, sharding.active())()


@functools.lru_cache(maxsize=64)
def _maker(cfg, batch: int, max_len: int, ring: int, dtype, int8: bool, ctx):
    """The jitted function that makes these caches, one per shape and mesh: a new one per
    request would be traced and compiled again, inside each prefill's time to first token."""

    def make():
        return {
            "sliding": _empty(cfg, batch, ring, dtype, int8),
            "full": _empty(cfg, batch, max_len, dtype, int8),
        }

    if ctx is None:
        return jax.jit(make)
    mesh, rules = ctx
    return jax.jit(make, out_shardings=shardings(jax.eval_shape(make), mesh, rules))
