"""The `matmul` op's reference: the projections' and the unembedding's products."""

from __future__ import annotations

import jax.numpy as jnp

from gpt_oss_train.arrays.layer_views import whole


def matmul(spec, x, w, *, dtype):
    """einsum(spec, x, w) in `dtype` with float32 results, where x's dimensions after
    [b, s] contract with w's leading ones; w may be a layer view (read whole)."""
    w = whole(w)
    return jnp.einsum(spec, x.astype(dtype), w.astype(dtype), preferred_element_type=jnp.float32)
