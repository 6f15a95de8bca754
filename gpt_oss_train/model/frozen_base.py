"""The frozen base of a LoRA run, stored in one of config.BASE_FORMATS:

  param_dtype  as trained (float32 by default)
  bfloat16     every matrix in bfloat16; norms, biases and sinks as trained
  int8         the matmul weights parameters.py gives contraction axes: int8 with a scale
               per output channel (quantize.QArray); other matrices bfloat16
  mxfp4        the experts as the published checkpoints store them (mxfp4_array.MXFP4Array:
               blocks + scales, decoded inside the layer scan); other matrices bfloat16

Which leaf takes which form derives from its declaration in parameters.py. `convert`
turns a dense tree into a format (jit-able, so it runs sharded on the devices);
`abstract` gives the format's shapes with shardings by the logical axis rules, packed
leaves included: an expert's blocks shard over `exp` like the expert.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from gpt_oss_train import config, sharding
from gpt_oss_train.arrays import mxfp4_array
from gpt_oss_train.model import parameters, quantize

FORMATS = config.BASE_FORMATS  # declared below the model, where config checks them


def form_of(path: str, fmt: str) -> str:
    """'keep', 'bfloat16', 'int8' or 'mxfp4': how a (dense) leaf is stored in `fmt`."""
    decl, stacked = parameters.lookup(path)
    if fmt == "param_dtype" or len(decl.dims.split()) < 2:
        return "keep"  # vectors (norms, biases, sinks) are small: kept as trained
    if fmt == "int8" and decl.contract:
        return "int8"
    if fmt == "mxfp4" and decl.hf.mxfp4:
        return "mxfp4"
    return "bfloat16"


def _path(key_path) -> tuple[str, str | None]:
    """(parameter path, packed field or None) from a jax key path."""
    names = [str(getattr(k, "key", getattr(k, "name", k))) for k in key_path]
    if isinstance(key_path[-1], jax.tree_util.GetAttrKey):
        return "/".join(names[:-1]), names[-1]
    return "/".join(names), None


def convert(params: dict, fmt: str) -> dict:
    """A dense base tree in `fmt` (leaves already packed pass through). Jit-able."""

    def one(key_path, w):
        path = parameters.path_of(key_path)
        form = form_of(path, fmt)
        if form == "keep":
            return w
        if form == "bfloat16":
            return w.astype(jnp.bfloat16)
        if form == "int8":
            decl, stacked = parameters.lookup(path)
            return quantize.quantize_int8(w, tuple(a + int(stacked) for a in decl.contract))
        return mxfp4_array.quantize(w)

    packed = lambda x: isinstance(x, (mxfp4_array.MXFP4Array, quantize.QArray))
    return jax.tree_util.tree_map_with_path(
        lambda kp, w: w if packed(w) else one(kp, w), params, is_leaf=packed
    )


def logical_axes(path: str, field: str | None) -> tuple[str | None, ...]:
    """The logical axes of a base leaf, or of a packed leaf's field (MXFP4 blocks and
    scales keep the dense weight's axis order)."""
    decl, stacked = parameters.lookup(path)
    axes = (("layers",) if stacked else ()) + decl.axes
    if field == "scale":  # int8 scales: size 1 along the contraction axes
        drop = {a + int(stacked) for a in decl.contract}
        return tuple(None if i in drop else a for i, a in enumerate(axes))
    return axes


def abstract(dense_abstract: dict, fmt: str, mesh=None, rules=None) -> dict:
    """The tree `convert` makes from `dense_abstract` (ShapeDtypeStructs), with shardings
    when a mesh is given."""
    shapes = jax.eval_shape(lambda p: convert(p, fmt), dense_abstract)
    if mesh is None:
        return shapes

    def one(key_path, a):
        sh = leaf_sharding(key_path, a, mesh, rules)
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh)

    return jax.tree_util.tree_map_with_path(one, shapes)


def leaf_sharding(key_path, a, mesh, rules) -> jax.sharding.NamedSharding:
    path, field = _path(key_path)
    spec = sharding.logical_to_spec(logical_axes(path, field), rules)
    return jax.sharding.NamedSharding(mesh, sharding.fit_spec(spec, a.shape, mesh))


def read_targets(dense_abstract: dict, fmt: str, packed_abstract: dict) -> dict:
    """What to read each leaf of a checkpoint as, for a tree in `fmt`: a packed MXFP4
    leaf as its blocks and scales (`packed_abstract`'s), a bfloat16 one in bfloat16, the
    others (int8 ones included, quantized on the devices) as `dense_abstract` has them."""

    def one(key_path, dense):
        path = parameters.path_of(key_path)
        form = form_of(path, fmt)
        if form == "mxfp4":
            leaf = packed_abstract
            for k in path.split("/"):
                leaf = leaf[k]
            return leaf
        if form == "bfloat16":
            return jax.ShapeDtypeStruct(dense.shape, jnp.bfloat16, sharding=dense.sharding)
        return dense

    return jax.tree_util.tree_map_with_path(one, dense_abstract)


def place(tree: dict, fmt: str, packed_abstract: dict) -> dict:
    """`tree` (read with read_targets, or dense) converted to `fmt` on the devices, laid
    out as packed_abstract (its input donated)."""
    to_format = lambda p: convert(p, fmt)
    return jax.jit(to_format, out_shardings=shardings(packed_abstract), donate_argnums=0)(tree)


def shardings(abstract_tree: dict) -> Any:
    return jax.tree.map(lambda a: a.sharding, abstract_tree)


def nbytes(tree) -> int:
    return sum(a.size * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))
