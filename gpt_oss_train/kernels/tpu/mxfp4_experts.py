"""The `moe_decode` op's `pallas_tpu` implementation: a decode batch through only its
chosen experts, reading the model's packed MXFP4 experts and decoding them in VMEM.

Why: XLA decodes an MXFP4 expert by writing each nibble plane to HBM in bfloat16,
relaying it out and reading it again, about 16x the packed bytes (docs/AOT.md, the
serving step). Here each chosen expert's packed words and scales are copied to VMEM once
and decoded there, so HBM sees 4.25 bits a weight.

Layout: the model's own (arrays/mxfp4_array.py), read as stored, so nothing is converted
at load. Per expert and projection: words uint32 [in/8, out], nibble j of word k holding
input 8k + j, and E8M0 scales uint8 [in/32, out]. Nibble j of every word is "plane j", an
[in/8, out] matrix of the inputs j, 8 + j, 16 + j, ...: one shift and mask of whole tiles
decode it, and it meets the same plane of the activations (x[:, j::8], split outside the
kernel, where x is small), x @ W = sum_j x_j @ plane_j; no nibble is ever interleaved. The
plane's row k lies in scale group k // 4, the same for all 8 planes: the scales are
repeated 4x down the rows once per block.

Routing: gpu/decode_experts.tile_layout's tiles of ROWS rows, one expert each, sorted by
expert. The grid is (output block, tile), tiles innermost, and the experts to fetch come
in as scalar prefetch: an expert's tiles are consecutive, so its block is copied once
(Pallas skips a copy whose block index is unchanged) and decoded once into VMEM scratch,
however many tiles it has; tiles past the used ones fetch, compute and write nothing.
Two calls: gate and up with their biases and the clamped SwiGLU (writes the activation),
then down with its bias; XLA sums each token's pairs by the routing weights.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from gpt_oss_train import sharding
from gpt_oss_train.arrays.layer_views import LayerView
from gpt_oss_train.arrays.mxfp4_array import BLOCK, WORD, MXFP4Array
from gpt_oss_train.kernels.gpu.decode_experts import ROWS, tile_layout
from gpt_oss_train.kernels.xla.experts import ExpertWeights, glu

MAX_PAIRS = 512  # (token, choice) pairs of a decode step; larger batches take grouped matmuls
BLOCK_OUT = 512  # output columns a step: few steps (Pallas' docs: about 0.35 us each)
# The gate and up call at gpt-oss's 2880 inputs needs 17.8 MiB of VMEM (libtpu 0.0.42.1),
# past v5e's default 16 MiB scoped limit; every TPU from v5 has 64 MiB or more.
VMEM_LIMIT = 32 * 2**20
ROWS_PER_SCALE = BLOCK // WORD  # a plane's rows that share one scale


def accepts(x_td, weights_tk, idx_tk, w: ExpertWeights, *, limit, alpha, dtype) -> bool:
    """MXFP4 experts (or inference's views of their layer) without LoRA, up to MAX_PAIRS
    pairs, bf16 or float32 compute, and one device's arrays (a Pallas call is not split by
    the partitioner)."""
    return (
        all(map(_packed, (w.wi_gate, w.wi_up, w.wo)))
        and w.lora is None
        and idx_tk.size <= MAX_PAIRS
        and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float32)
        and sharding.per_device()
    )


def moe_decode(x_td, weights_tk, idx_tk, w: ExpertWeights, *, limit, alpha, dtype):
    # Off a TPU (tests on a CPU) the same kernels run in Pallas' interpreter.
    interpret = sharding.platform() != "tpu"
    return experts(
        x_td, weights_tk, idx_tk, w, limit=limit, alpha=alpha, dtype=dtype, interpret=interpret
    )


def experts(
    x_td,
    weights_tk,
    idx_tk,
    w: ExpertWeights,
    *,
    limit,
    alpha,
    dtype,
    interpret=False,
    block_out=BLOCK_OUT,
):
    """sum_j weights[t, j] * expert_{idx[t, j]}(x_t), float32 [T, D], from MXFP4 experts
    (LayerViews: read in place from their stacks); the products in `dtype` with float32
    sums."""
    t, k = idx_tk.shape
    layout = tile_layout(idx_tk, w.wi_gate.shape[0])
    rows = layout.tile_expert.shape[0] * ROWS
    token = jnp.arange(t * k) // k
    x = jnp.zeros((rows, x_td.shape[1]), dtype).at[layout.pair_row].set(x_td[token].astype(dtype))
    call = functools.partial(_call, layout.tile_expert, interpret=interpret, block_out=block_out)
    gated = functools.partial(glu, limit=limit, alpha=alpha)
    act = call(_planes(x), [w.wi_gate, w.wi_up], [w.bi_gate, w.bi_up], gated, dtype)
    y = call(_planes(act), [w.wo], [w.bo], lambda y: y, jnp.float32)
    return jnp.einsum("tk,tkd->td", weights_tk, y[layout.pair_row].reshape(t, k, -1))


def _planes(x_rd):
    """x [rows, in] -> its 8 planes [8, rows, in/8]: plane j holds inputs j, 8 + j, ..."""
    rows, n = x_rd.shape
    return x_rd.reshape(rows, n // WORD, WORD).transpose(2, 0, 1)


# ----------------------------------------------------------------------------- the call


def _packed(m) -> bool:
    """An MXFP4Array, or inference's view of one layer of a stacked one (not training's
    TrainingView: the kernel has no gradient)."""
    return isinstance(m.stack if isinstance(m, LayerView) else m, MXFP4Array)


def _stacked(m):
    """(the layer-stacked MXFP4Array [layers, E, in, out] a weight reads, its layer): a
    LayerView's own, read in place (a slice would be copied first); an array, one layer."""
    if isinstance(m, LayerView):
        return m.stack, m.layer
    return MXFP4Array(m.blocks[None], m.scales[None]), jnp.zeros((), jnp.int32)


def _call(tile_expert, x_planes, mats, biases, epilogue, out_dtype, *, interpret, block_out):
    """epilogue(x @ mats[0] + biases[0], ...) per tile with the tile's expert -> [rows,
    out] in out_dtype (rows of unused tiles undefined). mats: MXFP4Arrays [E, in, out] (or
    views of one layer of them) sharing their shape; biases [E, out]."""
    _, rows, in8 = x_planes.shape
    stacks, layers = zip(*map(_stacked, mats))
    _, num_experts, _, out = stacks[0].blocks.shape
    tiles = tile_expert.shape[0]
    block = out if out <= block_out else block_out  # a last block past `out` is cut short
    used = jnp.sum(tile_expert >= 0, dtype=jnp.int32).reshape(1)
    layer = layers[0].astype(jnp.int32).reshape(1)  # gate and up: views of the same layer

    def last_used(t, used_ref):  # unused tiles repeat the last used one's blocks: no copy
        return jnp.minimum(t, used_ref[0] - 1)

    def expert_block(n, t, experts_ref, used_ref, layer_ref):
        return layer_ref[0], experts_ref[last_used(t, used_ref)], 0, n

    def bias_block(n, t, experts_ref, used_ref, _):
        return experts_ref[last_used(t, used_ref)], 0, n

    x_spec = pl.BlockSpec(
        (WORD, ROWS, in8), lambda n, t, experts_ref, used_ref, _: (0, last_used(t, used_ref), 0)
    )
    weight_specs = [
        pl.BlockSpec((None, None, in8, block), expert_block),  # words
        pl.BlockSpec((None, None, in8 // ROWS_PER_SCALE, block), expert_block),  # scales
        pl.BlockSpec((None, 1, block), bias_block),  # bias: not stacked (the scan slices it)
    ]
    out_spec = pl.BlockSpec(
        (ROWS, block), lambda n, t, experts_ref, used_ref, _: (last_used(t, used_ref), n)
    )
    weight_args = []
    for m, b in zip(stacks, biases):
        weight_args += [m.blocks, m.scales, b.astype(jnp.float32).reshape(num_experts, 1, out)]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(pl.cdiv(out, block), tiles),
        in_specs=[x_spec, *weight_specs * len(mats)],
        out_specs=out_spec,
        scratch_shapes=[pltpu.VMEM((WORD, in8, block), x_planes.dtype) for _ in mats],
    )
    packed_bytes = sum(_expert_bytes(m.blocks) + _expert_bytes(m.scales) for m in stacks)
    kernel = functools.partial(_kernel, num_mats=len(mats), epilogue=epilogue)
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((rows, out), out_dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary"), vmem_limit_bytes=VMEM_LIMIT
        ),
        cost_estimate=pl.CostEstimate(
            flops=2 * rows * in8 * WORD * out * len(mats),
            transcendentals=rows * out if len(mats) > 1 else 0,
            # each expert a tile can choose read once, the rows once per output block
            bytes_accessed=min(tiles, num_experts) * packed_bytes
            + x_planes.nbytes * pl.cdiv(out, block)
            + rows * out * jnp.dtype(out_dtype).itemsize,
        ),
        interpret=interpret,
        name=f"mxfp4_experts_{len(mats)}",
    )(tile_expert, used, layer, x_planes, *weight_args)


def _expert_bytes(a):
    """Bytes of one expert of a stack [layers, E, ...]."""
    return a.size // (a.shape[0] * a.shape[1]) * a.dtype.itemsize


# ----------------------------------------------------------------------------- the kernel


def _kernel(experts_ref, used_ref, layer_ref, x_ref, *refs, num_mats, epilogue):
    weights, out_ref, decoded = refs[: 3 * num_mats], refs[3 * num_mats], refs[3 * num_mats + 1 :]
    t = pl.program_id(1)
    used = t < used_ref[0]
    # an expert's first tile in this output block: the tiles before it held another one
    first = (t == 0) | (experts_ref[t] != experts_ref[jnp.maximum(t - 1, 0)])

    @pl.when(used & first)
    def _():
        for m in range(num_mats):
            words_ref, scales_ref, _ = weights[3 * m : 3 * m + 3]
            _decode(words_ref, scales_ref, decoded[m])

    @pl.when(used)
    def _():
        products = []
        for m in range(num_mats):
            acc = weights[3 * m + 2][...]  # the bias [1, block], float32
            for j in range(WORD):
                acc = acc + jnp.dot(x_ref[j], decoded[m][j], preferred_element_type=jnp.float32)
            products.append(acc)
        out_ref[...] = epilogue(*products).astype(out_ref.dtype)


def _decode(words_ref, scales_ref, out_ref):
    """Packed words [in/8, block] and scales [in/32, block] -> the 8 planes' values
    [8, in/8, block] in out_ref's dtype (exact: 2 bits of mantissa, power-of-two scales)."""
    words = words_ref[...]
    scales = _e8m0(scales_ref[...])
    rows, block = words.shape
    scale = jnp.broadcast_to(scales[:, None, :], (rows // ROWS_PER_SCALE, ROWS_PER_SCALE, block))
    scale = scale.reshape(rows, block)
    for j in range(WORD):
        out_ref[j] = (e2m1((words >> (4 * j)) & 15) * scale).astype(out_ref.dtype)


_HALF = 0x3F000000  # the float32 bits of 0.5


def e2m1(code):
    """uint32 E2M1 codes 0..15 -> float32, by building the float's bits: bit 3 the sign;
    magnitude codes 0 and 1 are 0 and 0.5 (subnormal), and from 2 on, exponent e = mag >> 1
    and mantissa bit m = mag & 1 make (1 + m/2) 2^(e - 1), the float whose bits are
    (mag + 252) << 22. A few vector operations, where a table lookup would be a gather."""
    mag = code & 7
    bits = jnp.where(mag == 0, 0, jnp.where(mag == 1, _HALF, (mag + 252) << 22))
    return lax.bitcast_convert_type(bits.astype(jnp.uint32) | (code & 8) << 28, jnp.float32)


def _e8m0(code):
    """uint8 E8M0 scales -> float32 2^(s - 127), exactly, from the float's bits (s = 0,
    2^-127, comes out 0: it only scales all-zero groups, see arrays/mxfp4.quantize_mxfp4)."""
    return lax.bitcast_convert_type(code.astype(jnp.int32) << 23, jnp.float32)
