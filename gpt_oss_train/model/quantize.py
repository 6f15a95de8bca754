"""int8 weight-only quantization for decoding, and the int8 KV cache's (de)quantizers.

Decode is bound by memory bandwidth: every step reads every active weight once. Storing
matmul weights as int8 with one float32 scale per output channel halves the bytes read
against bf16 (quarters them against float32). A `QArray` stands in for the weight inside
the parameter tree; model code only ever calls `w[...]` and `.astype(dtype)`, which for a
QArray dequantizes (XLA fuses the multiply into the consuming matmul's operand).

Scales are symmetric: scale = max|w| / 127 over the contraction axes, q = round(w/scale).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from gpt_oss_train.arrays.lazy_weight import LazyWeight
from gpt_oss_train.model import parameters


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class QArray(LazyWeight):
    q: jax.Array  # int8, the weight's shape
    scale: jax.Array  # float32, the weight's shape with contraction axes of size 1

    @property
    def shape(self) -> tuple[int, ...]:
        return self.q.shape

    @property
    def dtype(self):
        return self.scale.dtype

    def take(self, index):
        # Slicing whole leading axes (e.g. one layer of a stacked weight) keeps it quantized.
        return QArray(self.q[index], self.scale[index])

    def astype(self, dtype):
        return self.q.astype(dtype) * self.scale.astype(dtype)


def quantize_int8(w: jax.Array, contraction_axes: tuple[int, ...]) -> QArray:
    w = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(w), axis=contraction_axes, keepdims=True)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    q = jnp.clip(jnp.round(w / scale), -127, 127).astype(jnp.int8)
    return QArray(q, scale)


def quantize_params(params: dict) -> dict:
    """The parameter tree with matmul weights replaced by QArrays (jit-able): those
    model/parameters.py declares contraction axes for. Embedding (a gather), norms,
    biases, sinks and the router keep their dtype."""

    def one(key_path, w):
        decl, stacked = parameters.lookup(parameters.path_of(key_path))
        if not decl.contract:
            return w
        return quantize_int8(w, tuple(a + int(stacked) for a in decl.contract))

    return jax.tree_util.tree_map_with_path(one, params)


def quantize_kv(x):
    """[..., head_dim] -> (int8 values, float32 scale [..., 1]) per token and head."""
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1, keepdims=True)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    return jnp.clip(jnp.round(x / scale), -127, 127).astype(jnp.int8), scale


def dequantize_kv(q, scale, dtype):
    return q.astype(dtype) * scale.astype(dtype)
