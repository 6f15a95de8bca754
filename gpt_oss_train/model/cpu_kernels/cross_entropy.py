"""The loss's softmax over the vocabulary and its gradient as CPU custom calls
(cross_entropy.cc) on CPUs with AVX512-BF16: a chunk's float32 logits -> (log-sum-exp,
target logit, bfloat16 softmax), and the bfloat16 gradient of the logits from the kept
softmax. training/loss.py takes them with the grouped matmul kernels; figures in
docs/PERFORMANCE.md."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gpt_oss_train import runtime
from gpt_oss_train.model.cpu_kernels import build

TARGET = "gpt_oss_softmax_xent"
GRAD_TARGET = "gpt_oss_softmax_xent_grad"
CPU_FLAG = "avx512_bf16"  # vcvtneps2bf16 rounds the results


def available() -> bool:
    return CPU_FLAG in runtime.cpu_flags() and build.load(
        "cross_entropy.cc", ((TARGET, "GptOssSoftmaxXent"), (GRAD_TARGET, "GptOssSoftmaxXentGrad"))
    )


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
