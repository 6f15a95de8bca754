"""Attention over sequences split along the `context` mesh axis (context parallelism).

When the logical rules shard `length` over mesh axes of more than one device, each device
holds a contiguous piece of every sequence, and everything but attention is per token.
Attention is the one place positions mix, and GPT-OSS's two layer types need different
amounts of the other pieces:

  banded layers (window w)  a query sees at most the w-1 keys before it, so each device
                            gets the previous device's last w-1 keys (rounded up to 8) by
                            one collective permute, and runs the banded blockwise attention
                            over them and its own; the first device gets padding.
  full layers               every device all-gathers the keys and values of the whole
                            sequence (MaxText's default for context parallelism too) and
                            runs its own queries in blocks over all of them, KEY_BLOCK keys
                            at a time (an online softmax); the gradient of the gathered
                            keys comes back reduce-scattered.

Which keys a query sees is still decided by positions and segment ids (attention.py), so
packed segments, padding and the sinks' place in the softmax denominator are exactly the
unsplit computation's. Every device does the same work: each of its query blocks reads
every gathered key and masks what the causal order hides, so no load-balancing order
(zig-zag) is needed here; a kernel that skips masked blocks would need one.

Heads stay split as the rules say (tensor parallelism) when the query and key heads
split alike; the batch as the rules say.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from gpt_oss_train import sharding
from gpt_oss_train.kernels.xla import attention as xla_attention

# A full layer's keys are streamed this many at a time through each query block (an
# online softmax): its logits are [block, KEY_BLOCK] a head, whatever the length, and the
# backward keeps one running sum a key block: 2,048 keeps both small at 131,072 positions.
KEY_BLOCK = 2048


def length_axes(seq_len: int, window: int | None) -> tuple[str, ...]:
    """The mesh axes of more than one device that the active rules split a sequence of
    `seq_len` over, for a layer of `window`; () where none (no mesh, context 1, inside
    shard_map) or where the pieces are shorter than a banded layer's reach (a short
    prompt scored on a context mesh: the partitioner then gathers the sequence)."""
    ctx = sharding.active()
    if ctx is None or sharding.inside_shard_map():
        return ()
    mesh, rules = ctx
    spec = sharding.fit_spec(sharding.logical_to_spec(("length",), rules), (seq_len,), mesh)
    axes = sharding.split_axes(spec[0], mesh)
    pieces = math.prod(mesh.shape[a] for a in axes)
    if window is not None and seq_len // pieces < xla_attention.lead_keys(window):
        return ()
    return axes


def attention(q, k, v, sinks, *, positions, segment_ids, window, block):
    """q [b, s, n, h], k/v [b, s, kh, h], positions/segment_ids [b, s], split over the
    sequence by the active rules (length_axes) -> [b, s, n, h], split alike."""
    mesh, rules = sharding.active()
    fit = lambda names, shape: sharding.fit_spec(
        sharding.logical_to_spec(names, rules), shape, mesh
    )
    q_spec = fit(("batch", "length", "heads", None), q.shape)
    kv_spec = fit(("batch", "length", "kv_heads", None), k.shape)
    if q_spec[2] != kv_spec[2]:
        # A query head's keys must sit on its device: split the heads alike or not at all.
        q_spec = P(q_spec[0], q_spec[1], None, None)
        kv_spec = P(kv_spec[0], kv_spec[1], None, None)
    rows = P(q_spec[0], q_spec[1])
    axes = sharding.spec_axes(q_spec[1])

    def local(q, k, v, sinks, pos, seg):
        if window is None:
            gather = lambda a: jax.lax.all_gather(a, axes, axis=1, tiled=True)
            k, v, k_pos, k_seg = gather(k), gather(v), gather(pos), gather(seg)
            return xla_attention.blockwise_attention(
                q, k, v, sinks, pos, k_pos, seg, k_seg, None, block, key_block=KEY_BLOCK
            )
        lead = xla_attention.lead_keys(window)  # at most the piece's length (length_axes)
        n = sharding.axes_size(axes)
        first = sharding.axes_index(axes) == 0
        # Shard i sends its last `lead` keys to shard i+1; the first receives zeros,
        # which become padding (position -1) below.
        tail = lambda a: jax.lax.ppermute(
            a[:, -lead:], axes, perm=[(i, i + 1) for i in range(n - 1)]
        )
        prev_pos = jnp.where(first, -1, tail(pos))
        k = jnp.concatenate([tail(k), k], axis=1)
        v = jnp.concatenate([tail(v), v], axis=1)
        k_pos = jnp.concatenate([prev_pos, pos], axis=1)
        k_seg = jnp.concatenate([tail(seg), seg], axis=1)
        return xla_attention.blockwise_attention(
            q, k, v, sinks, pos, k_pos, seg, k_seg, window, block, lead=lead
        )

    fn = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(q_spec, kv_spec, kv_spec, P(q_spec[2]), rows, rows),
        out_specs=q_spec,
        check_vma=False,
    )
    return fn(q, k, v, sinks, positions, segment_ids)
