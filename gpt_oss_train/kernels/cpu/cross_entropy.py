"""The loss's softmax over the vocabulary and its gradient as CPU custom calls
(cross_entropy.cc) on CPUs with AVX512-BF16: a chunk's float32 logits -> (log-sum-exp,
target logit, bfloat16 softmax), and the bfloat16 gradient of the logits from the kept
softmax. With the grouped matmul kernels for the chunk's three products (logits, dh, dW)
they are the `cross_entropy` op's `cpu` implementation: XLA:CPU otherwise keeps the
float32 logits and recomputes their exponentials, slowly, inside the backward's loop.
The arithmetic is xla/cross_entropy.py's; figures in docs/PERFORMANCE.md."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gpt_oss_train.kernels.cpu import build, grouped_matmul

TARGET = "gpt_oss_softmax_xent"
GRAD_TARGET = "gpt_oss_softmax_xent_grad"
CPU_FLAG = "avx512_bf16"  # vcvtneps2bf16 rounds the results


HANDLERS = ((TARGET, "GptOssSoftmaxXent"), (GRAD_TARGET, "GptOssSoftmaxXentGrad"))


def unavailable(platform: str = "cpu") -> str | None:
    return build.unavailable("cross_entropy.cc", HANDLERS, CPU_FLAG) or grouped_matmul.unavailable()


def _rows(a_bcx):
    return a_bcx.reshape(-1, a_bcx.shape[-1])


def accepts(h_bcd, w_dv, t_bc) -> bool:
    """The chunk's products fit the grouped matmul kernel: bfloat16, one device."""
    return grouped_matmul.accepts(_rows(h_bcd), w_dv[None])


def _logits(h_bcd, w_dv):
    return grouped_matmul.matmul(_rows(h_bcd), w_dv).reshape(*h_bcd.shape[:2], -1)


@jax.custom_vjp
def chunk_logprobs(h_bcd, w_dv, t_bc):
    """xla/cross_entropy.chunk_logprobs on the kernels."""
    z = _logits(h_bcd, w_dv)
    lse = jax.nn.logsumexp(z, axis=-1)
    target = jnp.take_along_axis(z, t_bc[..., None], axis=-1)[..., 0]
    return target - lse, lse


def _fwd(h_bcd, w_dv, t_bc):
    b, c = t_bc.shape
    lse, target, probs = softmax(_rows(_logits(h_bcd, w_dv)), t_bc.reshape(-1))
    lse, target = lse.reshape(b, c), target.reshape(b, c)
    return (target - lse, lse), (h_bcd, w_dv, t_bc, probs.reshape(b, c, -1))


def _bwd(res, cts):
    h_bcd, w_dv, t_bc, probs = res
    ct_logp, ct_lse = cts
    scale, add = (ct_lse - ct_logp).reshape(-1), ct_logp.reshape(-1)
    g = logits_grad(_rows(probs), t_bc.reshape(-1), scale, add)
    dh = grouped_matmul.matmul(g, w_dv, transpose=True).reshape(h_bcd.shape)
    dw = grouped_matmul.weight_grad(_rows(h_bcd), g).astype(w_dv.dtype)
    return dh.astype(h_bcd.dtype), dw, None


chunk_logprobs.defvjp(_fwd, _bwd)


def softmax(logits_rv, targets_r):
    """(lse [R], target logit [R], softmax [R, V] bfloat16) of float32 logits [R, V]."""
    r, v = logits_rv.shape
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    call = jax.ffi.ffi_call(TARGET, (f32(r), f32(r), jax.ShapeDtypeStruct((r, v), jnp.bfloat16)))
    return call(logits_rv, targets_r.astype(jnp.int32))


def logits_grad(probs_rv, targets_r, scale_r, add_r):
    """bfloat16 scale[r] * probs + (v == targets[r]) * add[r], [R, V]."""
    call = jax.ffi.ffi_call(GRAD_TARGET, jax.ShapeDtypeStruct(probs_rv.shape, jnp.bfloat16))
    f32 = lambda a: a.astype(jnp.float32)
    return call(probs_rv, targets_r.astype(jnp.int32), f32(scale_r), f32(add_r))
