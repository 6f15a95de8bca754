"""MXFP4 weights inside the model: the published checkpoints' expert blocks and scales,
kept as they are and decoded to a dense matrix only where a layer uses it.

`MXFP4Array` stands in for an expert weight [..., E, in, out] in the parameter tree, as
an int8 `QArray` does: model code calls `w[...]`, `w[experts]` and `.astype(dtype)`, and
the last decodes. Inside the layer scan that decodes one layer's experts at a time, so a
frozen gpt-oss-20b base costs its 4.25 bits per expert weight plus one layer of dense
experts. The codec is arrays/mxfp4.py's (numpy), here in jax; both are exact.

Layout, as on disk: blocks uint8 [..., out, in/32, 16] (two E2M1 codes a byte, the low
nibble first) and scales uint8 [..., out, in/32] (E8M0: 2**(s - 127)).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from gpt_oss_train.arrays.lazy_weight import LazyWeight
from gpt_oss_train.arrays.mxfp4 import FP4_VALUES

BLOCK = 32


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MXFP4Array(LazyWeight):
    blocks: jax.Array  # uint8 [..., out, in/32, 16]
    scales: jax.Array  # uint8 [..., out, in/32]

    @property
    def shape(self) -> tuple[int, ...]:
        """The dense weight's shape, [..., in, out]."""
        *lead, out, nblk, _ = self.blocks.shape
        return (*lead, nblk * BLOCK, out)

    @property
    def dtype(self):
        return jnp.dtype(jnp.bfloat16)  # what its values fit exactly

    def take(self, index):
        # Leading axes only (a layer, chosen experts): the blocks stay packed.
        return MXFP4Array(self.blocks[index], self.scales[index])

    def astype(self, dtype):
        return dequantize(self.blocks, self.scales, dtype)

    def partition_spec(self, dense_spec: P) -> "MXFP4Array":
        """shard_map specs of the blocks and scales from a dense [..., in, out] spec."""
        *lead, s_in, s_out = tuple(dense_spec) + (None,) * (self.ndim - len(dense_spec))
        return MXFP4Array(P(*lead, s_out, s_in, None), P(*lead, s_out, s_in))


def dequantize(blocks, scales, dtype=jnp.float32):
    """blocks [..., out, n, 16], scales [..., out, n] -> dense [..., n * 32, out]."""
    lut = jnp.asarray(FP4_VALUES)
    pairs = jnp.stack([lut[blocks & 0x0F], lut[blocks >> 4]], axis=-1)  # low nibble first
    vals = pairs.reshape(*blocks.shape[:-1], BLOCK)
    vals = jnp.ldexp(vals, scales.astype(jnp.int32)[..., None] - 127)  # exact
    dense = vals.reshape(*blocks.shape[:-2], blocks.shape[-2] * BLOCK)
    return jnp.swapaxes(dense, -1, -2).astype(dtype)


# Round to the nearest E2M1 magnitude [0, .5, 1, 1.5, 2, 3, 4, 6], ties to the even code:
# a value above a midpoint moves up, at a midpoint it moves up only into an even code.
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIE_GOES_UP = (False, True, False, True, False, True, False)


def quantize(w) -> MXFP4Array:
    """float [..., in, out] (in % 32 == 0) -> MXFP4Array; the same bytes as
    arrays/mxfp4.quantize_mxfp4: per 32 inputs the smallest power-of-two scale with
    max|w| <= 6 * scale, then round-to-nearest-even onto E2M1."""
    x = jnp.swapaxes(w.astype(jnp.float32), -1, -2)  # [..., out, in]
    x = x.reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    amax = jnp.max(jnp.abs(x), axis=-1)
    e = jnp.ceil(jnp.log2(amax / 6.0))
    # log2 may round either way: settle on the smallest e with amax <= 6 * 2**e.
    e = jnp.where(amax > 6.0 * jnp.exp2(e), e + 1, e)
    e = jnp.where(amax <= 3.0 * jnp.exp2(e), e - 1, e)
    e = jnp.where(amax > 0, e, -127.0)
    s = jnp.clip(e + 127, 0, 254).astype(jnp.int32)
    y = jnp.abs(x) / jnp.ldexp(jnp.ones_like(amax), s - 127)[..., None]
    code = jnp.zeros(y.shape, jnp.uint8)
    for m, up in zip(_MIDPOINTS, _TIE_GOES_UP):
        code = code + (y >= m if up else y > m).astype(jnp.uint8)
    code = code | (jnp.signbit(x).astype(jnp.uint8) << 3)
    code = code.reshape(*code.shape[:-1], BLOCK // 2, 2)
    return MXFP4Array((code[..., 0] | (code[..., 1] << 4)).astype(jnp.uint8), s.astype(jnp.uint8))
