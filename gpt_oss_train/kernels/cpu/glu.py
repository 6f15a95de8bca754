"""The experts' gated activation with its biases as CPU custom calls (glu.cc) on CPUs with
AVX512-BF16, forward and backward (a custom VJP: the gradients of gate, up and both
biases in one call): the `gated_activation` op's `cpu` implementation, between the
grouped matmul kernels in bfloat16. Figures in docs/PERFORMANCE.md."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from gpt_oss_train.kernels.cpu import build, one_device

TARGET = "gpt_oss_glu"
GRAD_TARGET = "gpt_oss_glu_grad"
CPU_FLAG = "avx512_bf16"  # vcvtneps2bf16 rounds the activation


HANDLERS = ((TARGET, "GptOssGlu"), (GRAD_TARGET, "GptOssGluGrad"))


def unavailable(platform: str = "cpu") -> str | None:
    return build.unavailable("glu.cc", HANDLERS, CPU_FLAG)


def accepts(gate, up, bias_gate, bias_up, experts, *, limit, alpha, dtype) -> bool:
    """One device (as the grouped matmul kernels), float32 products, float32 or bfloat16
    biases (inference's), a bfloat16 activation."""
    return (
        gate.dtype == jnp.float32
        and bias_gate.dtype in (jnp.float32, jnp.bfloat16)
        and jnp.dtype(dtype) == jnp.bfloat16
        and one_device()
    )


def gated_activation(gate, up, bias_gate, bias_up, experts, *, limit, alpha, dtype):
    """bfloat16 act [R, F] of float32 gate, up [R, F], biases [E, F], row experts [R]. A
    row whose expert is E (none here took it) is computed with the last expert's biases:
    the CPU's grouped matmuls write zeros there, which add nothing to their gradients."""
    build.require("glu.cc", HANDLERS, CPU_FLAG)
    bias_gate, bias_up = bias_gate.astype(jnp.float32), bias_up.astype(jnp.float32)
    experts = jnp.minimum(experts, bias_gate.shape[0] - 1).astype(jnp.int32)
    return _glu(gate, up, bias_gate, bias_up, experts, float(limit), float(alpha))


def _attrs(limit, alpha):
    return dict(limit=np.float32(limit), alpha=np.float32(alpha))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _glu(gate, up, bias_gate, bias_up, experts, limit, alpha):
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(gate.shape, jnp.bfloat16))
    return call(gate, up, bias_gate, bias_up, experts, **_attrs(limit, alpha))


def _fwd(gate, up, bias_gate, bias_up, experts, limit, alpha):
    act = _glu(gate, up, bias_gate, bias_up, experts, limit, alpha)
    return act, (gate, up, bias_gate, bias_up, experts)


def _bwd(limit, alpha, res, dact):
    gate, up, bias_gate, bias_up, experts = res
    rows, bias = (jax.ShapeDtypeStruct(a.shape, jnp.float32) for a in (gate, bias_gate))
    call = jax.ffi.ffi_call(GRAD_TARGET, (rows, rows, bias, bias))
    dgate, dup, dbg, dbu = call(
        gate, up, bias_gate, bias_up, experts, dact.astype(jnp.bfloat16), **_attrs(limit, alpha)
    )
    return dgate, dup, dbg, dbu, None


_glu.defvjp(_fwd, _bwd)
