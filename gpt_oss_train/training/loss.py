"""Next-token loss without materialising [tokens, vocab] logits.

The unembedding of gpt-oss has 201,088 columns: a [batch, seq, vocab] float32 logit
tensor for a 4k-token row is 3.3 GB. We walk the sequence in chunks of `chunk` positions,
compute each chunk's logits, log-sum-exp and target logit, and keep only per-token
numbers. `jax.checkpoint` on the chunk makes the backward pass recompute the chunk's
logits instead of storing them, so peak memory is one chunk of logits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gpt_oss_train import sharding


def token_logprobs(hidden_bsd, unembed_dv, targets_bs, *, chunk: int, dtype):
    """log p(target | prefix) and log-sum-exp for every position, both [b, s] float32."""
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

    @jax.checkpoint
    def one(carry, xs):
        hc, tc = xs
        logits = _logits(hc.astype(dtype), w)
        logits = sharding.constrain(logits, ("batch", "length", "vocab"))
        lse = jax.nn.logsumexp(logits, axis=-1)
        target_logit = jnp.take_along_axis(logits, tc[..., None], axis=-1)[..., 0]
        return carry, (target_logit - lse, lse)

    _, (logp, lse) = jax.lax.scan(one, None, (h, t))
    logp = jnp.moveaxis(logp, 0, 1).reshape(b, n * chunk)[:, :s]
    lse = jnp.moveaxis(lse, 0, 1).reshape(b, n * chunk)[:, :s]
    return logp, lse


@jax.custom_vjp
def _logits(h_bcd, w_dv):
    """float32 logits of compute-dtype inputs. The custom backward pass is the usual
    mixed-precision one: the logits' gradient is cast to the compute dtype and the weight
    gradient comes out in it, accumulated in float32 inside the matmul. Left to autodiff,
    the weight gradient is a float32 x bf16 matmul with a float32 [embed, vocab] result:
    2.16 GiB per chip for gpt-oss, the largest buffer of the TPU v5e step."""
    return jnp.einsum("bcd,dv->bcv", h_bcd, w_dv, preferred_element_type=jnp.float32)


def _logits_fwd(h_bcd, w_dv):
    return _logits(h_bcd, w_dv), (h_bcd, w_dv)


def _logits_bwd(res, g_bcv):
    h_bcd, w_dv = res
    g = g_bcv.astype(w_dv.dtype)
    dh = jnp.einsum("bcv,dv->bcd", g, w_dv, preferred_element_type=jnp.float32)
    dw = jnp.einsum("bcd,bcv->dv", h_bcd, g, preferred_element_type=w_dv.dtype)
    return dh.astype(h_bcd.dtype), dw


_logits.defvjp(_logits_fwd, _logits_bwd)


def lm_loss_sums(hidden_bsd, unembed_dv, targets_bs, mask_bs, *, chunk: int, dtype):
    """Sums over masked tokens: (negative log-likelihood, z-loss term lse^2, token count).

    Sums, not means, so microbatches of a gradient-accumulation step add up to exactly the
    loss of the whole batch once divided by the total count."""
    logp, lse = token_logprobs(hidden_bsd, unembed_dv, targets_bs, chunk=chunk, dtype=dtype)
    m = mask_bs.astype(jnp.float32)
    return -jnp.sum(logp * m), jnp.sum(jnp.square(lse) * m), jnp.sum(m)
