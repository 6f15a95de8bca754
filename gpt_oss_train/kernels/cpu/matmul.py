"""The `matmul` op's `cpu` implementation: a decode step's few rows take rows_matmul.cc
(which reads a streamed layer in place), and bfloat16 rows of training and prefill take
the grouped matmul kernel as one group, whose backward products beat XLA:CPU's
transposed dots (docs/PERFORMANCE.md). Other operands (int8 or MXFP4 weights, float32
rows past a few, a mesh of several devices) are declined: XLA's dot runs."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from gpt_oss_train.kernels.cpu import grouped_matmul, rows_matmul


def _rows(x, w):
    """(rows, depth): x's dimensions after [b, s] contract with w's leading ones."""
    b, s = x.shape[:2]
    return b * s, math.prod(w.shape[: x.ndim - 2])


def unavailable(platform: str = "cpu") -> str | None:
    """Usable if either kernel is (each checks its own operands)."""
    reasons = [rows_matmul.unavailable(), grouped_matmul.unavailable()]
    return None if None in reasons else "; ".join(dict.fromkeys(reasons))  # each reason once


def _few_rows(x, w, dtype) -> bool:
    return rows_matmul.unavailable() is None and rows_matmul.accepts(_rows(x, w)[0], w, dtype)


def _one_group(x, w, dtype) -> bool:
    if not isinstance(w, jax.Array) or grouped_matmul.unavailable() is not None:
        return False
    rows, depth = _rows(x, w)
    like = jax.ShapeDtypeStruct((rows, depth), jnp.dtype(dtype))
    return grouped_matmul.accepts(like, w.reshape(1, depth, -1))


def accepts(spec, x, w, *, dtype) -> bool:
    return _few_rows(x, w, dtype) or _one_group(x, w, dtype)


def matmul(spec, x, w, *, dtype):
    """einsum(spec, x, w) in float32 (see xla/matmul.py), on the kernels."""
    (rows, depth), out = _rows(x, w), (*x.shape[:2], *w.shape[x.ndim - 2 :])
    if _few_rows(x, w, dtype):
        return rows_matmul.rows_matmul(x.reshape(rows, depth), w).reshape(out)
    sizes = jnp.full((1,), rows, jnp.int32)
    matrix = w.reshape(1, depth, -1)
    return grouped_matmul.grouped_matmul(
        x.reshape(rows, depth).astype(dtype), matrix, sizes
    ).reshape(out)
