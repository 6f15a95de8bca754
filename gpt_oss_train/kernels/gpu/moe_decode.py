"""The `moe_decode` op's `pallas_gpu` implementation: the decode expert kernels
(decode_experts.py for dense weights, mxfp4_experts.py for MXFP4 ones). The kernels' layout
is made inside the step from the model's [E, in, out] weights (a transpose of the layer's
experts each call, or of the MXFP4 blocks, padded): selectable now, to be made the GPU
default once measured with the layout prepared at load instead."""

from __future__ import annotations

import jax

from gpt_oss_train.arrays.layer_views import stack_of, whole
from gpt_oss_train.arrays.mxfp4_array import MXFP4Array
from gpt_oss_train.kernels.gpu import decode_experts, mxfp4_experts
from gpt_oss_train.kernels.gpu.interpret import interpreting, unavailable  # noqa: F401
from gpt_oss_train.kernels.xla.experts import ExpertWeights

MAX_PAIRS = 512  # (token, choice) pairs of a decode step; larger batches take grouped matmuls


def _kind(w: ExpertWeights) -> str | None:
    mats = [w.wi_gate, w.wi_up, w.wo]
    if all(isinstance(m, MXFP4Array) for m in mats):
        return "mxfp4"
    if all(isinstance(stack_of(m), jax.Array) for m in mats):  # arrays, or views of them
        return "dense"
    return None


def accepts(x_td, weights_tk, idx_tk, w: ExpertWeights, *, limit, alpha, dtype) -> bool:
    """Dense or MXFP4 expert weights without LoRA, up to MAX_PAIRS pairs (MXFP4: output
    sides in whole tiles of decode_experts.ROWS)."""
    kind, rows = _kind(w), decode_experts.ROWS
    if kind == "mxfp4" and (w.wi_gate.shape[-1] % rows or w.wo.shape[-1] % rows):
        return False
    return idx_tk.size <= MAX_PAIRS and w.lora is None and kind is not None


def moe_decode(x_td, weights_tk, idx_tk, w: ExpertWeights, *, limit, alpha, dtype):
    common = dict(limit=limit, alpha=alpha, dtype=dtype, interpret=interpreting())
    if _kind(w) == "mxfp4":
        layout = mxfp4_experts.from_packed(w)
        return mxfp4_experts.mxfp4_ffn(x_td, weights_tk, idx_tk, layout, **common)
    dense = w._replace(**{n: whole(getattr(w, n)) for n in ("wi_gate", "wi_up", "wo")})
    layout = decode_experts.to_contraction_minor(dense, dtype)
    return decode_experts.dense_ffn(x_td, weights_tk, idx_tk, layout, **common)
