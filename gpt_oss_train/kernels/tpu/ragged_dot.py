"""The `grouped_matmul` op's `ragged_dot` implementation: `jax.lax.ragged_dot`, which TPUs
lower natively (a megablox-style grouped matmul). XLA's CPU and GPU lowerings multiply
every row by every group, so it is registered for TPUs only."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def grouped_matmul(x, w, group_sizes, out_dtype=None):
    w = w.astype(x.dtype)  # a stand-in (int8, layer view) made dense
    out = out_dtype or jnp.promote_types(x.dtype, jnp.float32)
    return jax.lax.ragged_dot(x, w, group_sizes, preferred_element_type=out)
