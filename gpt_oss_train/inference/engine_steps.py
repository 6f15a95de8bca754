"""The serving engine's compiled functions: pure functions of (params, KV cache, ...),
jitted with the cache donated so it is updated in place.

The cache (model/kv_cache.py) has one row per decode slot: `max_context` slots per row
for the full layers, a ring of `max(window, prefill_chunk)` for the banded ones. Beside
it lies the prefix pool: `pool_blocks` blocks of `block` positions, holding the keys and
values of both layer kinds at every position of a cached prompt prefix.

    prefill  one chunk of one slot's prompt; samples a token from its last position
    decode   one token for rows [0, rows) (each its own position, -1: idle); full layers
             attend to their first `context` cache slots only

Both take `adapter_ids` (one per row, like positions): with stacked LoRA adapters
(inference/adapters.py) each row runs with its own, so one compiled step serves
requests for different adapters; without, the model ignores them.
    admit    a slot for a new request: every position emptied, then a cached prefix
             copied in from the pool (the full layers' slots and the banded ring)
    save     the blocks of a chunk just prefilled, copied from a slot into the pool

`rows`, `context` and the chunk length are static: each value compiles once. The engine
rounds them up to a few buckets (powers of two rows, context x4) and warms them all.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gpt_oss_train import runtime, sharding
from gpt_oss_train.inference import sampling
from gpt_oss_train.model import kv_cache
from gpt_oss_train.model.transformer import DTYPES, ModelDef

KINDS = ("sliding", "full")
DATA_FIELDS = ("k", "v", "k_scale", "v_scale")  # the KVCache fields a pool block holds
# Prefix pool blocks: [layers, block id, position in block, kv heads, head dim].
POOL_AXES = ("layers", None, None, "cache_kv_heads", "cache_head_dim")


def _data(c: kv_cache.KVCache) -> dict:
    return {f: getattr(c, f) for f in DATA_FIELDS if getattr(c, f) is not None}


def _replace(c: kv_cache.KVCache, fields: dict) -> kv_cache.KVCache:
    return c._replace(**fields)


class EngineSteps:
    """The compiled functions of one model over a cache of `max_slots` rows."""

    def __init__(
        self,
        md: ModelDef,
        *,
        max_slots: int,
        max_context: int,
        prefill_chunk: int,
        int8_kv_cache: bool,
        block: int,
        pool_blocks: int,
        top_logprobs: int,
    ):
        self.md, self.cfg = md, md.cfg
        self.max_slots, self.max_context = max_slots, max_context
        self.ring = max(self.cfg.sliding_window, prefill_chunk)
        self.prefill_chunk, self.int8 = prefill_chunk, int8_kv_cache
        self.block, self.pool_blocks, self.top_n = block, pool_blocks, top_logprobs
        # The longest prefix a slot can take from the pool: whole blocks, and at least one
        # prompt token left to prefill.
        self.max_prefix_blocks = min(pool_blocks, (max_context - 1) // block)
        self.id_slots = max(self.max_prefix_blocks, 1)  # length of admit's block_ids
        options = runtime.inference_compiler_options(sharding.platform())
        self.prefill = jax.jit(
            self._prefill,
            donate_argnums=(1,),
            static_argnames=("context",),
            compiler_options=options,
        )
        self.decode = jax.jit(
            self._decode,
            donate_argnums=(1,),
            static_argnames=("rows", "context"),
            compiler_options=options,
        )
        self.admit = jax.jit(self._admit, donate_argnums=(0,))
        self.save = jax.jit(self._save, donate_argnums=(0,))

    # -- allocation ---------------------------------------------------------------------

    def new_cache(self) -> dict:
        """Empty cache rows for every slot, placed by the active mesh's rules."""
        dtype = DTYPES[self.cfg.dtype]
        return kv_cache.init(
            self.cfg, self.max_slots, self.max_context, self.ring, dtype, self.int8
        )

    def new_pool(self) -> dict:
        """The prefix pool, {kind: {field: [layers, blocks, block, kv_heads, dim]}}."""
        template = jax.eval_shape(self.new_cache)["full"]  # the fields, dtypes, trailing dims

        def make():
            return {
                kind: {
                    f: jnp.zeros(
                        (a.shape[0], max(self.pool_blocks, 1), self.block) + a.shape[3:], a.dtype
                    )
                    for f, a in _data(template).items()
                }
                for kind in KINDS
            }

        ctx = sharding.active()
        if ctx is None:
            return jax.jit(make)()
        mesh, rules = ctx

        def place(a):
            spec = sharding.fit_spec(sharding.logical_to_spec(POOL_AXES, rules), a.shape, mesh)
            return jax.sharding.NamedSharding(mesh, spec)

        return jax.jit(make, out_shardings=jax.tree.map(place, jax.eval_shape(make)))()

    # -- model calls --------------------------------------------------------------------

    def _pick(self, model, hidden_bd, settings: sampling.SamplingRows, want_top):
        """Sampled token, its log-probability and the top alternatives for each row."""
        logits = model.logits(hidden_bd[:, None])[:, 0]
        tokens = sampling.sample(logits, settings)
        chosen, top_ids, top_lp = sampling.logprobs(logits, tokens, want_top, self.top_n)
        return sharding.host_readable((tokens, chosen, top_ids, top_lp))

    @staticmethod
    def _window(cache: dict, rows, context: int, start=0) -> dict:
        """Rows [start, start + rows) of the cache; the full layers' first `context` slots."""
        take = lambda a, n: jax.lax.dynamic_slice_in_dim(a, start, rows, axis=1)[:, :, :n]
        return {
            "sliding": jax.tree.map(lambda a: take(a, a.shape[2]), cache["sliding"]),
            "full": jax.tree.map(lambda a: take(a, context), cache["full"]),
        }

    @staticmethod
    def _put(cache: dict, window: dict, start=0) -> dict:
        put = lambda a, w: jax.lax.dynamic_update_slice(a, w, (0, start) + (0,) * (a.ndim - 2))
        return jax.tree.map(put, cache, window)

    def _rows_sharded(self) -> bool:
        """Whether the cache's rows are split over devices (by the active mesh's rules)."""
        ctx = sharding.active()
        if ctx is None:
            return False
        mesh, rules = ctx
        spec = sharding.fit_spec(
            sharding.logical_to_spec(("cache_batch",), rules), (self.max_slots,), mesh
        )
        return any(mesh.shape[ax] > 1 for ax in sharding.spec_axes(spec[0]))

    # With the cache's rows split over devices, a slice or an update at a traced row would
    # gather the whole cache onto every device (9 GiB a chip for gpt-oss-120b's 64 x 8192
    # on v5e:4x4). A masked sum over the rows reads each device's own rows and moves one
    # row between them; a select writes each device's own rows in place.

    @staticmethod
    def _slot_mask(a, slot):
        """[1, slots, 1, ...]: True at row `slot` of a cache field [layers, slots, ...]."""
        hit = jnp.arange(a.shape[1]) == slot
        return hit.reshape((1, a.shape[1]) + (1,) * (a.ndim - 2))

    def _read_row(self, a, slot, n: int):
        """Row `slot` of a cache field, its first n positions: [layers, 1, n, ...]."""
        if not self._rows_sharded():
            return jax.lax.dynamic_slice_in_dim(a, slot, 1, axis=1)[:, :, :n]
        picked = jnp.where(self._slot_mask(a, slot), a[:, :, :n], jnp.zeros((), a.dtype))
        return jnp.sum(picked, axis=1, keepdims=True, dtype=a.dtype)  # one term is not 0

    def _write_row(self, a, row, slot):
        """`row` [layers, 1, n, ...] written over the first n positions of row `slot`."""
        if not self._rows_sharded():
            return jax.lax.dynamic_update_slice(a, row, (0, slot) + (0,) * (a.ndim - 2))
        head = jnp.where(self._slot_mask(a, slot), row, a[:, :, : row.shape[2]])
        return jax.lax.dynamic_update_slice(a, head, (0,) * a.ndim)

    def _slot_window(self, cache: dict, slot, context: int) -> dict:
        """As _window(cache, 1, context, slot), read without gathering sharded rows."""
        return {
            "sliding": jax.tree.map(
                lambda a: self._read_row(a, slot, a.shape[2]), cache["sliding"]
            ),
            "full": jax.tree.map(lambda a: self._read_row(a, slot, context), cache["full"]),
        }

    def _put_slot(self, cache: dict, window: dict, slot) -> dict:
        """As _put(cache, window, slot), written without gathering sharded rows."""
        return jax.tree.map(lambda a, w: self._write_row(a, w, slot), cache, window)

    def _prefill(
        self,
        params,
        cache,
        slot,
        tokens,
        positions,
        last,
        settings,
        want_top,
        adapter_ids,
        *,
        context,
    ):
        """tokens/positions [1, chunk] of the request in `slot` (positions -1: padding),
        adapter_ids [1] its adapter; `last`: index in the chunk of the position to sample
        from (the prompt's last on its final chunk). Returns ((token, logprob, top ids,
        top logprobs), cache)."""
        model = self.md.bind(params)
        window = self._slot_window(cache, slot, context)
        valid = (positions >= 0).astype(jnp.int32)
        hidden, _, window = model(tokens, positions, valid, window, adapter_ids)
        h = jax.lax.dynamic_index_in_dim(hidden, last, axis=1, keepdims=False)
        return self._pick(model, h, settings, want_top), self._put_slot(cache, window, slot)

    def _decode(
        self, params, cache, tokens, positions, settings, want_top, adapter_ids, *, rows, context
    ):
        """One token for each of rows [0, rows): tokens/positions/adapter_ids [rows]
        (position -1: the row is idle or prefilling and writes nothing)."""
        model = self.md.bind(params)
        window = self._window(cache, rows, context)
        pos = positions[:, None]
        valid = (pos >= 0).astype(jnp.int32)
        hidden, _, window = model(tokens[:, None], pos, valid, window, adapter_ids)
        return self._pick(model, hidden[:, 0], settings, want_top), self._put(cache, window)

    # -- slots and the prefix pool ------------------------------------------------------

    def _admit(self, cache, pool, slot, block_ids, length):
        """Empty the slot, then copy in the first `length` positions (a multiple of the
        block; 0: none) from pool blocks `block_ids` [id_slots]."""
        span = self.max_prefix_blocks * self.block
        p = jnp.arange(span)
        full_pos = jnp.full((cache["full"].pos.shape[0], self.max_context), -1, jnp.int32)
        full_pos = full_pos.at[:, :span].set(jnp.where(p < length, p, -1)[None])
        # Ring slot j holds the latest position < length that is j modulo the ring.
        j = jnp.arange(self.ring)
        ring_p = length - 1 - jnp.mod(length - 1 - j, self.ring)
        ring_pos = jnp.broadcast_to(
            jnp.where(ring_p >= 0, ring_p, -1), full_pos.shape[:1] + j.shape
        )
        ring_p = jnp.maximum(ring_p, 0)
        out = {}
        for kind, positions, pos_row in (("full", p, full_pos), ("sliding", ring_p, ring_pos)):
            c = cache[kind]
            src = {
                f: a[:, block_ids[positions // self.block], positions % self.block]
                for f, a in pool[kind].items()
            }
            fields = {
                f: self._write_row(getattr(c, f), src[f][:, None].astype(getattr(c, f).dtype), slot)
                for f in src
            }
            fields["pos"] = self._write_row(c.pos, pos_row[:, None], slot)
            out[kind] = _replace(c, fields)
        return out

    def _save(self, pool, cache, slot, start, block_ids):
        """Copy the prefill_chunk positions from `start` of `slot` into pool blocks
        `block_ids` [prefill_chunk / block] (an id >= pool_blocks: that block is not kept)."""
        p = start + jnp.arange(self.prefill_chunk)
        where = {"full": jnp.minimum(p, self.max_context - 1), "sliding": p % self.ring}
        n = self.prefill_chunk // self.block
        out = {}
        for kind in KINDS:
            row = {
                f: self._read_row(a, slot, a.shape[2])[:, 0] for f, a in _data(cache[kind]).items()
            }
            out[kind] = {
                f: pool[kind][f]
                .at[:, block_ids]
                .set(
                    row[f][:, where[kind]].reshape((a.shape[0], n, self.block) + a.shape[3:]),
                    mode="drop",
                )
                for f, a in pool[kind].items()
            }
        return out
