"""The token-embedding lookup, laid out so that its gradient stays sharded.

The table [vocab, embed] is FSDP-sharded along `embed`; tokens are sharded along the
batch. Left to the partitioner, the backward pass scatter-adds every device's tokens
into a full-size float32 table and reduce-scatters it afterwards: a 2.16 GiB buffer and
a 2.16 GiB reduce-scatter per step for gpt-oss (201,088 x 2,880) on a TPU v5e
(tools/aot_compile.py; the step's peak memory is set elsewhere, see
docs/PERFORMANCE.md). Under `shard_map` each device instead looks up its own slice
of `embed` for the tokens of every device sharing that slice, and one all-to-all trades
embed slices for batch rows:

    tokens [b/n, s]  --all-gather over the embed axes-->   [b, s]
    take from the local table slice [vocab, d/n]        -> [b, s, d/n]
    --all-to-all (batch rows <-> embed slices)-->          [b/n, s, d]

The backward pass is the same in reverse: an all-to-all, then a local scatter-add into
the [vocab, d/n] slice. A vocabulary split (the `vocab` rule) is looked up per slice
and summed; when the embed axes do not shard the batch (a decode batch too small to
split), the looked-up slices are summed into whole rows instead.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gpt_oss_train import sharding


def lookup(table_vd, tokens_bs, dtype):
    """Rows of `table_vd` for `tokens_bs`, as [b, s, d] in `dtype`."""
    ctx = sharding.active()
    if ctx is None or ctx[0].size == 1:
        # One device: no exchange to arrange, and shard_map's gradient would still sum the
        # table over the (one-device) batch axes, an all-reduce XLA:CPU runs as a copy.
        return jnp.take(table_vd, tokens_bs, axis=0).astype(dtype)
    mesh, rules = ctx
    tok = sharding.fit_spec(
        sharding.logical_to_spec(("batch", "length"), rules), tokens_bs.shape, mesh
    )
    t_spec = sharding.fit_spec(
        sharding.logical_to_spec(("vocab", "embed"), rules), table_vd.shape, mesh
    )
    tok_axes, vocab_axes, embed_axes = (
        sharding.spec_axes(tok[0]),
        sharding.spec_axes(t_spec[0]),
        sharding.spec_axes(t_spec[1]),
    )
    exchange = all(a in tok_axes for a in embed_axes)  # embed slices <-> batch rows
    if embed_axes and not exchange and any(a in tok_axes for a in embed_axes):
        # Embed split over batch and non-batch axes at once: leave it to the partitioner.
        return jnp.take(table_vd, tokens_bs, axis=0).astype(dtype)
    if set(sharding.spec_axes(tok[1])) & set(vocab_axes + embed_axes):
        # The sequence split over the table's axes (context parallelism sharing them).
        return jnp.take(table_vd, tokens_bs, axis=0).astype(dtype)
    if any(a in tok_axes for a in vocab_axes):
        # A vocabulary split along batch axes would need every device's tokens.
        return jnp.take(table_vd, tokens_bs, axis=0).astype(dtype)

    def local(table, tokens):
        if exchange and embed_axes:
            tokens = jax.lax.all_gather(tokens, embed_axes, axis=0, tiled=True)
        if vocab_axes:
            v_local = table.shape[0]
            idx = tokens - sharding.axes_index(vocab_axes) * v_local
            mine = (idx >= 0) & (idx < v_local)
            x = jnp.take(table, jnp.clip(idx, 0, v_local - 1), axis=0)
            x = jax.lax.psum(jnp.where(mine[..., None], x, 0.0), vocab_axes)
        else:
            x = jnp.take(table, tokens, axis=0)
        x = x.astype(dtype)
        if not embed_axes:
            return x
        if exchange:
            return jax.lax.all_to_all(x, embed_axes, split_axis=0, concat_axis=2, tiled=True)
        # Tokens replicated over the embed axes (a decode batch too small to split, say):
        # place this slice in a zero row and sum, so every device holds the whole row.
        d_local = x.shape[2]
        full = jnp.zeros(x.shape[:2] + (d_local * sharding.axes_size(embed_axes),), x.dtype)
        full = jax.lax.dynamic_update_slice_in_dim(
            full, x, sharding.axes_index(embed_axes) * d_local, axis=2
        )
        return jax.lax.psum(full, embed_axes)

    fn = jax.shard_map(local, mesh=mesh, in_specs=(t_spec, tok), out_specs=jax.P(*tok, None))
    return fn(table_vd, tokens_bs)
