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

With context parallelism the table is split over `context` too (the `embed` rule), and
the sequence pieces trade places with those embed slices the same way, along `s`.

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
    # Only axes of more than one device decide the plan: a size-1 axis in a rule (the
    # `context` of `embed`'s default at mesh.context=1) splits nothing.
    split = lambda entry: sharding.split_axes(entry, mesh)
    row_axes, len_axes = split(tok[0]), split(tok[1])
    vocab_axes, embed_axes = split(t_spec[0]), split(t_spec[1])
    # The embed slices trade places with token rows (axes that split the batch) and with
    # sequence pieces (context parallelism), the rows' axes first as the rule lists them.
    row_embed = tuple(a for a in embed_axes if a in row_axes)
    len_embed = tuple(a for a in embed_axes if a in len_axes)
    exchange = bool(embed_axes) and embed_axes == row_embed + len_embed
    if embed_axes and not exchange and set(embed_axes) & set(row_axes + len_axes):
        # Embed split over token and other axes at once: leave it to the partitioner.
        return jnp.take(table_vd, tokens_bs, axis=0).astype(dtype)
    if set(vocab_axes) & set(row_axes + len_axes):
        # A vocabulary split along the tokens' axes would need every device's tokens.
        return jnp.take(table_vd, tokens_bs, axis=0).astype(dtype)

    def local(table, tokens):
        if exchange:  # every device sharing this embed slice: their tokens
            for axes, dim in ((row_embed, 0), (len_embed, 1)):
                if axes:
                    tokens = jax.lax.all_gather(tokens, axes, axis=dim, tiled=True)
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
        if exchange:  # the sequence's axes were gathered last, so go back first
            for axes, dim in ((len_embed, 1), (row_embed, 0)):
                if axes:
                    x = jax.lax.all_to_all(x, axes, split_axis=dim, concat_axis=2, tiled=True)
            return x
        # Tokens replicated over the embed axes (a decode batch too small to split, say):
        # place this slice in a zero row and sum, so every device holds the whole row.
        d_local = x.shape[2]
        full = jnp.zeros(x.shape[:2] + (d_local * sharding.axes_size(embed_axes),), x.dtype)
        full = jax.lax.dynamic_update_slice_in_dim(
            full, x, sharding.axes_index(embed_axes) * d_local, axis=2
        )
        return jax.lax.psum(full, embed_axes)

    # check_vma off: the plan leaves out size-1 axes, along which every value is trivially
    # the same, and which the varying-axes check would otherwise want reduced.
    fn = jax.shard_map(
        local, mesh=mesh, in_specs=(t_spec, tok), out_specs=jax.P(*tok, None), check_vma=False
    )
    return fn(table_vd, tokens_bs)
