"""Per-token log-probabilities without materialising [tokens, vocab] logits: what the
next-token loss (training/loss.py) and scoring (inference/scoring.py) share.

The unembedding of gpt-oss has 201,088 columns: a [batch, seq, vocab] float32 logit
tensor for a 4k-token row is 3.3 GB. We walk the sequence in chunks of `chunk` positions,
compute each chunk's logits, log-sum-exp and target logit, and keep only per-token
numbers. With several chunks, `jax.checkpoint` on each makes the backward pass recompute
the chunk's logits instead of storing them, so peak memory is one chunk of logits; a
single chunk keeps its softmax for the backward instead (no second matmul).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from gpt_oss_train import sharding
from gpt_oss_train.kernels import AUTO_KERNELS, Kernels


def token_logprobs(
    hidden_bsd,
    unembed_dv,
    targets_bs,
    *,
    chunk: int,
    dtype,
    kernels: Kernels = AUTO_KERNELS,
    gather_once: bool = False,
):
    """log p(target | prefix) and log-sum-exp for every position, both [b, s] float32;
    each chunk is the kernel registry's `cross_entropy` operation.

    `gather_once` (config.train.loss_gather_once), on a mesh whose rules split the
    unembedding's model dimension (FSDP) but not its vocabulary: each device runs its own
    rows under shard_map with the unembedding gathered once for all chunks, forward and
    backward, and each chunk's weight gradient reduce-scattered to the device's shard at
    once. Without it the partitioner gathers the whole [d, vocab] matrix per chunk (twice:
    the backward recomputes the chunk) and all-reduces whole gradients."""
    plan = _per_device_plan(hidden_bsd.shape, unembed_dv.shape) if gather_once else None
    if plan is None:
        w = unembed_dv.astype(dtype)
        return _token_logprobs(hidden_bsd, lambda: w, targets_bs, chunk, dtype, kernels)
    mesh, rows, embed_axes = plan  # rows: the [b, s] spec of batch and sequence

    def local(h, w, t):
        whole = jax.lax.stop_gradient(sharding.gather_weight(w, embed_axes, 0, dtype))
        weight = lambda: sharding.joined(w, whole, embed_axes, 0)
        return _token_logprobs(h, weight, t, chunk, dtype, kernels)

    w_spec = P(sharding.spec_entry(embed_axes), None)
    fn = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(rows, w_spec, rows),
        out_specs=(rows, rows),
        check_vma=False,
    )
    return fn(hidden_bsd, unembed_dv, targets_bs)


def _per_device_plan(hidden_shape, unembed_shape):
    """(mesh, the [batch, length] PartitionSpec of the hidden states' rows, the
    unembedding's model-dimension axes) when the loss can run per device (token_logprobs'
    docstring), else None."""
    ctx = sharding.active()
    if ctx is None:
        return None
    mesh, rules = ctx
    rows = sharding.fit_spec(
        sharding.logical_to_spec(("batch", "length"), rules), hidden_shape[:2], mesh
    )
    w_spec = sharding.fit_spec(
        sharding.logical_to_spec(("embed", "vocab"), rules), unembed_shape, mesh
    )
    split_over = lambda entry: sharding.split_axes(entry, mesh)
    embed_axes = split_over(w_spec[0])
    if not embed_axes or split_over(w_spec[1]):
        return None
    # Every device must hold rows of its own: a device repeating another's would add its
    # gradient twice (shard_map sums the unembedding's over the axes it is not split on).
    split = set(sharding.spec_axes(rows[0]) + sharding.spec_axes(rows[1])) | set(embed_axes)
    if any(size > 1 and ax not in split for ax, size in mesh.shape.items()):
        return None
    return mesh, rows, embed_axes


def _token_logprobs(hidden_bsd, weight, targets_bs, chunk, dtype, kernels):
    """`weight()`: the unembedding [d, vocab] in the compute dtype, as one chunk uses it."""
    b, s, d = hidden_bsd.shape
    chunk = min(chunk, s)
    pad = (-s) % chunk
    if pad:
        hidden_bsd = jnp.pad(hidden_bsd, ((0, 0), (0, pad), (0, 0)))
        targets_bs = jnp.pad(targets_bs, ((0, 0), (0, pad)))
    n = hidden_bsd.shape[1] // chunk
    # [n, b, chunk, ...]: scan over n chunks, chunk j holding positions j, j + n, j + 2n...
    # (each token's log-probability is its own, so any grouping gives the same numbers).
    # Strided, every chunk keeps the batch's sharding and the sequence's (context
    # parallelism: `chunk` splits as the positions do), so no device waits on another's.
    h = jnp.moveaxis(hidden_bsd.reshape(b, chunk, n, d), 2, 0)
    t = jnp.moveaxis(targets_bs.reshape(b, chunk, n), 2, 0)

    def one(carry, xs):
        hc, tc = xs
        return carry, kernels.cross_entropy(hc.astype(dtype), weight(), tc)

    if n > 1:  # one chunk's logits at a time: the backward recomputes each chunk's
        one = jax.checkpoint(one)
    _, (logp, lse) = jax.lax.scan(one, None, (h, t))
    logp = jnp.moveaxis(logp, 0, 2).reshape(b, n * chunk)[:, :s]
    lse = jnp.moveaxis(lse, 0, 2).reshape(b, n * chunk)[:, :s]
    return logp, lse
