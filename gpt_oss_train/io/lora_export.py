"""A LoRA adapter merged into its base, written as a Hugging Face folder: W + (alpha/r) A B
for every adapted weight, one block of layers at a time (io/hf.py save_hf writes it, the
tokenizer included). Into MXFP4 the merged experts are quantized again, and that rounding
is measured: against the merged weights, and against the adapter's own change (a delta
smaller than the MXFP4 step is partly rounded away)."""

from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from gpt_oss_train.arrays.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from gpt_oss_train.config import LoraSpec
from gpt_oss_train.io import hf
from gpt_oss_train.model import lora, parameters


class RequantError:
    """Sums of squares per expert weight kind, for relative RMS errors."""

    def __init__(self):
        self.sums: dict[str, np.ndarray] = {}

    def add(self, leaf: str, merged: np.ndarray, delta: np.ndarray):
        blocks, scales = quantize_mxfp4(merged)
        err = dequantize_mxfp4(blocks, scales) - merged
        s = self.sums.setdefault(leaf, np.zeros(4))
        s += [
            np.sum(err.astype(np.float64) ** 2),
            np.sum(merged.astype(np.float64) ** 2),
            np.sum(delta.astype(np.float64) ** 2),
            0.0,
        ]
        s[3] = max(s[3], float(np.abs(err).max()))

    def report(self) -> dict:
        """{weight: {"rel_rms_vs_weight", "rel_rms_vs_delta", "max_abs"}}."""
        out = {}
        for leaf, (e2, w2, d2, mx) in sorted(self.sums.items()):
            out[leaf] = {
                "rel_rms_vs_weight": float(np.sqrt(e2 / w2)) if w2 else 0.0,
                "rel_rms_vs_delta": float(np.sqrt(e2 / d2)) if d2 else None,
                "max_abs": mx,
            }
        return out


def merged_getter(
    spec: LoraSpec,
    adapters: Mapping,
    read_base: Callable[[str, Any], np.ndarray],
    errors: RequantError | None = None,
):
    """get_param(path, layers) for save_hf: the base's array plus the adapter's delta.
    read_base(path, layers) gives the base in our layout (float32). With `errors`, the
    MXFP4-stored weights' re-quantization error is measured on the way."""

    def get(path: str, layers):
        w = np.asarray(read_base(path, layers), np.float32)
        if layers is None:
            return w
        d = lora.weight_delta(spec, adapters, path, layers)
        if d is None:
            return w
        w = w + d
        decl, _ = parameters.lookup(path)
        if errors is not None and decl.hf.mxfp4:
            errors.add(path.rpartition("/")[2], w[0], d[0])
        return w

    return get


def save_merged(
    out_dir: str,
    arch: Mapping[str, Any],
    spec,
    adapters,
    read_base,
    *,
    dtype: str = "bfloat16",
    mxfp4: bool = False,
) -> dict:
    """Writes the merged model; returns the MXFP4 re-quantization report ({} if dense)."""
    errors = RequantError() if mxfp4 else None
    getter = merged_getter(spec, adapters, read_base, errors)
    hf.save_hf(out_dir, arch, getter, dtype=dtype, mxfp4=mxfp4)
    return errors.report() if errors else {}
