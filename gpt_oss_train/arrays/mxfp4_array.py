"""MXFP4 weights inside the model: the published checkpoints' expert blocks and scales,
kept packed and decoded to a dense matrix only where a layer uses it.

`MXFP4Array` stands in for an expert weight [..., E, in, out] in the parameter tree, as
an int8 `QArray` does: model code calls `w[...]`, `w[experts]` and `.astype(dtype)`, and
the last decodes. Inside the layer scan that decodes one layer's experts at a time, so a
frozen gpt-oss-20b base costs its 4.25 bits per expert weight plus one layer of dense
experts. The codec is arrays/mxfp4.py's (numpy), here in jax; both are exact.

Layout: the file's bytes in the dense weight's axis order, four to a 32-bit word: blocks
uint32 [..., in/8, out] (word k of column o holds inputs 8k..8k+7, a nibble each, input
8k + j in bits 4j..4j+3) and scales uint8 [..., in/32, out] (E8M0: 2**(s - 127), one per
32 inputs). The file stores bytes [..., out, in/32, 16] (byte c of a row: inputs 2c in its
low nibble and 2c + 1) and scales [..., out, in/32]; `from_file` and `to_file` convert.
Why not the file's form: on a TPU a transpose of the codes, or 8-bit codes feeding 32-bit
arithmetic, makes XLA relayout a whole layer-stacked weight before the layer scan (six
1.5 GiB copies for gpt-oss-20b), and a minor axis of 16 bytes pads to 128 lanes. In this
form decoding is elementwise plus an interleave along a major axis.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from gpt_oss_train.arrays.lazy_weight import LazyWeight

BLOCK = 32  # inputs a scale covers
WORD = 8  # inputs a uint32 of blocks holds


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MXFP4Array(LazyWeight):
    blocks: jax.Array  # uint32 [..., in/8, out]
    scales: jax.Array  # uint8 [..., in/32, out]

    @property
    def shape(self) -> tuple[int, ...]:
        """The dense weight's shape, [..., in, out]."""
        *lead, words, out = self.blocks.shape
        return (*lead, words * WORD, out)

    @property
    def dtype(self):
        return jnp.dtype(jnp.bfloat16)  # what its values fit exactly

    def take(self, index):
        # Leading axes only (a layer, chosen experts): the blocks stay packed.
        return MXFP4Array(self.blocks[index], self.scales[index])

    def astype(self, dtype):
        return dequantize(self.blocks, self.scales, dtype)

    def partition_spec(self, dense_spec: P) -> "MXFP4Array":
        """shard_map specs of the blocks and scales: the dense [..., in, out] spec's."""
        return MXFP4Array(dense_spec, dense_spec)


def from_file(blocks, scales):
    """The file's blocks uint8 [..., out, in/32, 16] and scales [..., out, in/32] -> ours
    (uint32 [..., in/8, out], uint8 [..., in/32, out]); numpy or jax arrays."""
    quads = blocks.reshape(*blocks.shape[:-2], blocks.shape[-2] * 4, 4).astype("uint32")
    words = quads[..., 0] | quads[..., 1] << 8 | quads[..., 2] << 16 | quads[..., 3] << 24
    return words.swapaxes(-1, -2), scales.swapaxes(-1, -2)


def to_file(blocks, scales):
    """Ours -> the file's (blocks uint8 [..., out, in/32, 16], scales [..., out, in/32])."""
    words, scales = blocks.swapaxes(-1, -2), scales.swapaxes(-1, -2)
    quads = [(words >> (8 * i)) & 0xFF for i in range(4)]
    stack = np.stack if isinstance(words, np.ndarray) else jnp.stack
    codes = stack(quads, axis=-1).astype("uint8")
    return codes.reshape(*words.shape[:-1], scales.shape[-1], BLOCK // 2), scales


def e2m1(code):
    """E2M1 codes 0..15 (any unsigned int type) -> float32 (FP4_VALUES), by arithmetic:
    bit 3 the sign, bits 2-1 the exponent e, bit 0 the mantissa m; e = 0 is subnormal (0
    or 0.5), else (2 + m) * 2**e / 4. Elementwise, where a table lookup would be a gather
    with int32 indices 4x the codes' size."""
    e, m = (code >> 1) & 3, code & 1
    mag = jnp.where(e == 0, m * 0.5, ((2 + m) << e).astype(jnp.float32) * 0.25)
    return jnp.where((code & 8) != 0, -mag, mag)


def dequantize(blocks, scales, dtype=jnp.float32):
    """blocks uint32 [..., in/8, out], scales [..., in/32, out] -> dense [..., in, out]."""
    exponent = jnp.repeat(scales, BLOCK // WORD, axis=-2).astype(jnp.int32) - 127
    nibbles = [(blocks >> (4 * j)) & 0xF for j in range(WORD)]
    values = [jnp.ldexp(e2m1(n), exponent) for n in nibbles]  # exact
    dense = jnp.stack(values, axis=-2).astype(dtype)  # [..., in/8, 8, out]
    return dense.reshape(*blocks.shape[:-2], blocks.shape[-2] * WORD, blocks.shape[-1])


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
    packed = (code[..., 0] | (code[..., 1] << 4)).astype(jnp.uint8)
    return MXFP4Array(*from_file(packed, s.astype(jnp.uint8)))
