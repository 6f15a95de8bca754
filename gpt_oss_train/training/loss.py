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

from gpt_oss_train import sharding
from gpt_oss_train.model.cpu_kernels import cross_entropy as cpu_cross_entropy
from gpt_oss_train.model.cpu_kernels import grouped_matmul as cpu_grouped_matmul


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

    def one(carry, xs):
        hc, tc = xs
        return carry, _chunk_logprobs(hc.astype(dtype), w, tc)

    if n > 1:  # one chunk's logits at a time: the backward recomputes each chunk's
        one = jax.checkpoint(one)
    _, (logp, lse) = jax.lax.scan(one, None, (h, t))
    logp = jnp.moveaxis(logp, 0, 1).reshape(b, n * chunk)[:, :s]
    lse = jnp.moveaxis(lse, 0, 1).reshape(b, n * chunk)[:, :s]
    return logp, lse


def _rows(a_bcx):
    return a_bcx.reshape(-1, a_bcx.shape[-1])


def _on_cpu_kernels(h_bcd, w_dv) -> bool:
    """One CPU device with AVX512-BF16 and bfloat16 compute: the chunk's three products
    take the grouped matmul kernels as one group (faster than XLA:CPU's dots on the
    unembedding's shapes, docs/PERFORMANCE.md)."""
    return cpu_grouped_matmul.applies(_rows(h_bcd), w_dv[None])


def _chunk_logits(h_bcd, w_dv):
    if _on_cpu_kernels(h_bcd, w_dv):
        return cpu_grouped_matmul.matmul(_rows(h_bcd), w_dv).reshape(*h_bcd.shape[:2], -1)
    logits = jnp.einsum("bcd,dv->bcv", h_bcd, w_dv, preferred_element_type=jnp.float32)
    return sharding.constrain(logits, ("batch", "length", "vocab"))


@jax.custom_vjp
def _chunk_logprobs(h_bcd, w_dv, t_bc):
    """(log p(target), log-sum-exp) [b, c] float32 of a chunk's float32 logits, from
    compute-dtype inputs. The custom backward pass is the usual mixed-precision one: the
    logits' gradient is cast to the compute dtype and the weight gradient comes out in
    it, accumulated in float32 inside the matmul. Left to autodiff, the weight gradient is
    a float32 x bf16 matmul with a float32 [embed, vocab] result: 2.16 GiB per chip for
    gpt-oss, the largest buffer of the TPU v5e step. The forward keeps the softmax (in the
    compute dtype) for it, so a single chunk's logits are never computed twice."""
    logits = _chunk_logits(h_bcd, w_dv)
    lse = jax.nn.logsumexp(logits, axis=-1)
    target = jnp.take_along_axis(logits, t_bc[..., None], axis=-1)[..., 0]
    return target - lse, lse


def _softmax_on_kernels(h_bcd, w_dv) -> bool:
    """The chunk's softmax and its gradient as CPU kernels too (cpu_kernels/cross_entropy):
    XLA:CPU otherwise keeps the float32 logits and recomputes their exponentials, slowly,
    inside the backward's loop."""
    return _on_cpu_kernels(h_bcd, w_dv) and cpu_cross_entropy.available()


def _chunk_fwd(h_bcd, w_dv, t_bc):
    if _softmax_on_kernels(h_bcd, w_dv):
        b, c = t_bc.shape
        logits = _rows(_chunk_logits(h_bcd, w_dv))
        lse, target, probs = cpu_cross_entropy.softmax(logits, t_bc.reshape(-1))
        lse, target = lse.reshape(b, c), target.reshape(b, c)
        return (target - lse, lse), (h_bcd, w_dv, t_bc, probs.reshape(b, c, -1))
    logits = _chunk_logits(h_bcd, w_dv)
    lse = jax.nn.logsumexp(logits, axis=-1)
    target = jnp.take_along_axis(logits, t_bc[..., None], axis=-1)[..., 0]
    probs = jnp.exp(logits - lse[..., None]).astype(w_dv.dtype)
    return (target - lse, lse), (h_bcd, w_dv, t_bc, probs)


def _chunk_bwd(res, cts):
    """d logp / d logits = onehot(target) - softmax, d lse / d logits = softmax."""
    h_bcd, w_dv, t_bc, probs = res
    ct_logp, ct_lse = cts
    if _softmax_on_kernels(h_bcd, w_dv):
        g = cpu_cross_entropy.logits_grad(
            _rows(probs), t_bc.reshape(-1), (ct_lse - ct_logp).reshape(-1), ct_logp.reshape(-1)
        ).reshape(probs.shape)
    else:
        target = jnp.arange(probs.shape[-1]) == t_bc[..., None]
        g = (ct_lse - ct_logp)[..., None] * probs + jnp.where(target, ct_logp[..., None], 0.0)
        g = g.astype(w_dv.dtype)
    if _on_cpu_kernels(h_bcd, w_dv):
        dh = cpu_grouped_matmul.matmul(_rows(g), w_dv, transpose=True).reshape(h_bcd.shape)
        dw = cpu_grouped_matmul.weight_grad(_rows(h_bcd), _rows(g)).astype(w_dv.dtype)
    else:
        dh = jnp.einsum("bcv,dv->bcd", g, w_dv, preferred_element_type=jnp.float32)
        dw = jnp.einsum("bcd,bcv->dv", h_bcd, g, preferred_element_type=w_dv.dtype)
    return dh.astype(h_bcd.dtype), dw, None


_chunk_logprobs.defvjp(_chunk_fwd, _chunk_bwd)


def lm_loss_sums(hidden_bsd, unembed_dv, targets_bs, mask_bs, *, chunk: int, dtype):
    """Sums over masked tokens: (negative log-likelihood, z-loss term lse^2, token count).

    Sums, not means, so microbatches of a gradient-accumulation step add up to exactly the
    loss of the whole batch once divided by the total count."""
    logp, lse = token_logprobs(hidden_bsd, unembed_dv, targets_bs, chunk=chunk, dtype=dtype)
    m = mask_bs.astype(jnp.float32)
    return -jnp.sum(logp * m), jnp.sum(jnp.square(lse) * m), jnp.sum(m)
