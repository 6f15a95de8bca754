"""One AdamW step of one float32 parameter in one pass, in place (adamw.cc), on CPUs with
AVX-512; fused_adamw.py puts it behind the `optimizer_update` op with optax's scalars."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gpt_oss_train.kernels.cpu import build

TARGET = "gpt_oss_adamw"
CPU_FLAG = "avx512f"
# The scalars operand of adamw.cc, in its order.
SCALARS = (
    "n",
    "clip",
    "norm",
    "max_norm",
    "b1",
    "b2",
    "bc1",
    "bc2",
    "eps",
    "eps_root",
    "wd",
    "step",
)


HANDLERS = ((TARGET, "GptOssAdamW"),)


def unavailable(platform: str = "cpu") -> str | None:
    return build.unavailable("adamw.cc", HANDLERS, CPU_FLAG)


def step(p, g, m, v, **scalars):
    """(p', m', v') of one parameter: the kernel's update (adamw.cc), written over p, m
    and v where the caller donates them."""
    build.require("adamw.cc", HANDLERS, CPU_FLAG)
    values = jnp.stack([jnp.asarray(scalars[name], jnp.float32) for name in SCALARS])
    shape = jax.ShapeDtypeStruct(p.shape, jnp.float32)
    call = jax.ffi.ffi_call(TARGET, (shape, shape, shape), input_output_aliases={0: 0, 2: 1, 3: 2})
    return call(p, g, m, v, values)
