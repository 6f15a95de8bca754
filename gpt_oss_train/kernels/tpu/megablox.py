"""The `grouped_matmul` op's `megablox` implementation: JAX's Pallas grouped matmul for
TPUs (jax.experimental.pallas.ops.tpu.megablox), whose backward computes the weight
gradient group by group (`tgmm`). XLA's own lowering of `lax.ragged_dot` (the
`ragged_dot` entry) writes that gradient as a dense convolution over every row for every
group: in the compiled gpt-oss-20b step, six such products per layer were 85% of the
step's FLOPs (docs/AOT.md)."""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp

from gpt_oss_train import sharding
from gpt_oss_train.kernels.tpu import ragged_dot

TILE = 512  # rows, depth and columns per block (the kernel masks ragged depth and columns)


def accepts(x, w, group_sizes, out_dtype=None) -> bool:
    """Rows in whole blocks (the kernel tiles rows without masking them)."""
    return x.shape[0] % _tiles(x, w)[0] == 0


def _tiles(x, w) -> tuple[int, int, int]:
    m, k = x.shape
    return min(TILE, m), min(TILE, k), min(TILE, w.shape[-1])


def grouped_matmul(x, w, group_sizes, out_dtype=None):
    if not sharding.per_device():
        # A Pallas kernel runs per device (inside shard_map, as expert parallelism calls
        # it); on a mesh outside one, XLA's ragged dot, which the partitioner splits.
        return ragged_dot.grouped_matmul(x, w, group_sizes, out_dtype)
    w = w.astype(x.dtype)  # a stand-in (int8, layer view) made dense
    # Off a TPU (tests on a CPU) the same kernels run in Pallas' interpreter.
    interpret = sharding.platform() != "tpu"
    out = jnp.dtype(out_dtype or jnp.float32)
    return _gmm(x, w, group_sizes.astype(jnp.int32), interpret, out)


def _kernels():
    """megablox's gmm.py module (the package's `gmm` name is its differentiable wrapper)."""
    # lazy: optional dependency (Pallas TPU)
    return importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")


def _rows_in_groups(y, sizes):
    """Zeros past the groups' rows, which the kernels leave unwritten: the gradient a row
    past them sends back must be zero. The product's own rows there are left undefined,
    as the op allows: a masking pass over them would be paid in full wherever its
    consumer cannot fuse it (a gather)."""
    return jnp.where((jnp.arange(y.shape[0]) < jnp.sum(sizes))[:, None], y, jnp.zeros((), y.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _gmm(x, w, sizes, interpret, out_dtype):
    # accumulated in float32 inside the kernel whatever it writes out
    return _kernels().gmm(x, w, sizes, out_dtype, _tiles(x, w), interpret=interpret)


def _gmm_fwd(x, w, sizes, interpret, out_dtype):
    return _gmm(x, w, sizes, interpret, out_dtype), (x, w, sizes)


def _gmm_bwd(interpret, out_dtype, res, g):
    kernels = _kernels()
    x, w, sizes = res
    g = g.astype(x.dtype)
    tiles = _tiles(x, w)
    dx = kernels.gmm(
        g,
        w,
        sizes,
        x.dtype,
        (tiles[0], tiles[2], tiles[1]),
        transpose_rhs=True,
        interpret=interpret,
    )
    # the weight gradient group by group: each group's rows only
    dw = kernels.tgmm(
        x.swapaxes(0, 1),
        g,
        sizes,
        w.dtype,
        tiles,
        num_actual_groups=w.shape[0],
        interpret=interpret,
    )
    return _rows_in_groups(dx, sizes), dw, None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)
