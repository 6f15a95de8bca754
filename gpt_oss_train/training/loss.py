"""Next-token loss without materialising [tokens, vocab] logits.

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

from gpt_oss_train.kernels import AUTO_KERNELS, Kernels


def token_logprobs(
    hidden_bsd, unembed_dv, targets_bs, *, chunk: int, dtype, kernels: Kernels = AUTO_KERNELS
):
    """log p(target | prefix) and log-sum-exp for every position, both [b, s] float32;
    each chunk is the kernel registry's `cross_entropy` operation."""
    b, s, d = hidden_bsd.shape
    chunk = min(chunk, s)
    pad = (-s) % chunk
    if pad:
        hidden_bsd = jnp.pad(hidden_bsd, ((0, 0), (0, pad), (0, 0)))
        targets_bs = jnp.pad(targets_bs, ((0, 0), (0, pad)))
    n = hidden_bsd.shape[1] // chunk
    # [n, b, chunk, ...]: scan over chunks of positions; every chunk keeps the batch
    # sharding, so no device waits on another's rows.
    h = jnp.moveaxis(hidden_bsd.reshape(b, n, chunk, d), 1, 0)
    t = jnp.moveaxis(targets_bs.reshape(b, n, chunk), 1, 0)
    w = unembed_dv.astype(dtype)

    def one(carry, xs):
        hc, tc = xs
        return carry, kernels.cross_entropy(hc.astype(dtype), w, tc)

    if n > 1:  # one chunk's logits at a time: the backward recomputes each chunk's
        one = jax.checkpoint(one)
    _, (logp, lse) = jax.lax.scan(one, None, (h, t))
    logp = jnp.moveaxis(logp, 0, 1).reshape(b, n * chunk)[:, :s]
    lse = jnp.moveaxis(lse, 0, 1).reshape(b, n * chunk)[:, :s]
    return logp, lse


def lm_loss_sums(
    hidden_bsd, unembed_dv, targets_bs, mask_bs, *, chunk: int, dtype, kernels=AUTO_KERNELS
):
    """Sums over masked tokens: (negative log-likelihood, z-loss term lse^2, token count).

    Sums, not means, so microbatches of a gradient-accumulation step add up to exactly the
    loss of the whole batch once divided by the total count."""
    logp, lse = token_logprobs(
        hidden_bsd, unembed_dv, targets_bs, chunk=chunk, dtype=dtype, kernels=kernels
    )
    m = mask_bs.astype(jnp.float32)
    return -jnp.sum(logp * m), jnp.sum(jnp.square(lse) * m), jnp.sum(m)
