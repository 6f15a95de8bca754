"""Attention over sequences split along the `context` mesh axis (context parallelism).

When the logical rules shard `length` over mesh axes of more than one device, each device
holds a contiguous piece of every sequence, and everything but attention is per token.
Attention is the one place positions mix, and GPT-OSS's two layer types need different
amounts of the other pieces:

  banded layers (window w)  a query sees at most the w-1 keys before it, so each device
                            gets the previous device's last w-1 keys (rounded up to 8) by
                            one collective permute, and attends over them and its own; the
                            first device gets padding.
  full layers               every device all-gathers the keys and values of the whole
                            sequence (MaxText's default for context parallelism too) and
                            attends with its own queries over all of them (the XLA kernel
                            KEY_BLOCK keys at a time, an online softmax); the gradient of
                            the gathered keys comes back reduce-scattered.

Each shard then runs a local kernel over its queries and those keys (`attention`'s
`local`): by default the XLA blockwise attention here, the reference, where positions and
segment ids decide which keys a query sees (attention.py), so packed segments, padding and
the sinks' place in the softmax denominator are exactly the unsplit computation's. Every
device does the same work: each of its query blocks reads every gathered key and masks
what the causal order hides, so no load-balancing order (zig-zag) is needed for it. Where
config.kernels.attention resolves to splash (TPU), the kernels' dispatch passes splash's
per-shard kernel instead (kernels/tpu/splash_attention.py), which masks by index and
segment ids and skips the hidden blocks; it declines shards of partial 128-blocks, which
keep the XLA one.

Heads stay split as the rules say (tensor parallelism) when the query and key heads
split alike; the batch as the rules say.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
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


@dataclasses.dataclass(frozen=True)
class Split:
    """One shard's part of a split sequence, what a local kernel is made for: the
    sequence's length and a shard's, the shard's query heads, the layer's window, the keys
    before a banded shard's own (lead; 0 for a full layer), the query block of the
    blockwise attention, and the mesh axes that split the sequence."""

    mesh: Mesh
    axes: tuple[str, ...]
    seq_len: int
    shard_len: int
    heads: int
    group: int
    window: int | None
    lead: int
    block: int


def blockwise(split: Split):
    """The XLA local kernel, the reference (takes any shard): (run, no extra operands).
    run(q, k, v, sinks, q_pos, k_pos, q_seg, k_seg) gets a shard's queries and the keys it
    may see: the gathered sequence (full layers) or the previous shard's tail and its own
    (banded layers)."""
    key_block = KEY_BLOCK if split.window is None else None

    def run(*operands):  # q, k, v, sinks, q_pos, k_pos, q_seg, k_seg
        return xla_attention.blockwise_attention(
            *operands, split.window, split.block, lead=split.lead, key_block=key_block
        )

    return run, ()


def attention(q, k, v, sinks, *, positions, segment_ids, window, block, local=blockwise):
    """q [b, s, n, h], k/v [b, s, kh, h], positions/segment_ids [b, s], split over the
    sequence by the active rules (length_axes) -> [b, s, n, h], split alike.

    `local(Split)` makes the per-shard kernel: (run, extra) where extra holds (operand,
    shard_map in_spec) pairs that run takes after the keys (a kernel's own tables); None
    where it does not take this split, and `blockwise` runs."""
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
    size = lambda entry: math.prod(mesh.shape[a] for a in sharding.spec_axes(entry))
    split = Split(
        mesh=mesh,
        axes=axes,
        seq_len=q.shape[1],
        shard_len=q.shape[1] // size(q_spec[1]),
        heads=q.shape[2] // size(q_spec[2]),
        group=q.shape[2] // k.shape[2],
        window=window,
        # at most a shard's length (length_axes)
        lead=0 if window is None else xla_attention.lead_keys(window),
        block=block,
    )
    run, extra = local(split) or blockwise(split)

    def shard(q, k, v, sinks, pos, seg, *tables):
        k, v, k_pos, k_seg = _keys(k, v, pos, seg, axes, split.lead, window)
        return run(q, k, v, sinks, pos, k_pos, seg, k_seg, *tables)

    fn = jax.shard_map(
        shard,
        mesh=mesh,
        in_specs=(q_spec, kv_spec, kv_spec, P(q_spec[2]), rows, rows, *(s for _, s in extra)),
        out_specs=q_spec,
        check_vma=False,
    )
    return fn(q, k, v, sinks, positions, segment_ids, *(e for e, _ in extra))


def _keys(k, v, pos, seg, axes, lead, window):
    """Inside shard_map: the keys, values, positions and segment ids a shard's queries may
    see (the module docstring): the whole sequence's for a full layer, the previous shard's
    last `lead` and its own for a banded one."""
    if window is None:
        gather = lambda a: jax.lax.all_gather(a, axes, axis=1, tiled=True)
        return gather(k), gather(v), gather(pos), gather(seg)
    n = sharding.axes_size(axes)
    first = sharding.axes_index(axes) == 0
    # Shard i sends its last `lead` keys to shard i+1; the first receives zeros, which
    # become padding: position -1, segment 0 (which no query of a document matches).
    tail = lambda a: jax.lax.ppermute(a[:, -lead:], axes, perm=[(i, i + 1) for i in range(n - 1)])
    prev_pos = jnp.where(first, -1, tail(pos))
    cat = lambda a, b: jnp.concatenate([a, b], axis=1)
    return cat(tail(k), k), cat(tail(v), v), cat(prev_pos, pos), cat(tail(seg), seg)
