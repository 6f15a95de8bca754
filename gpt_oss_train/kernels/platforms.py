"""What a platform decides about data layout, beside its kernels: read once per program
from the platform of the mesh it runs on, never from the machine the compiler runs on.

  streams_layer_weights   inference hands each block views of the layer-stacked weights
                          (arrays/layer_views.py) in place of the scan's slices: XLA:CPU
                          copies a slice before reading it; GPUs and TPUs keep the slices
                          their profiles were measured with
  kv_cache_bits           a bfloat16 KV cache is stored as uint16 bit patterns
                          (arrays/bit_moves.py): XLA:CPU converts a whole bfloat16 array to
                          scatter into it, and scatters 16-bit integers in place
  huge_page_weights       inference's weights on 2 MB pages (cpu/huge_pages.py): decode
                          streams them every step, and large pages spare a page walk
                          every 4 KB
  kv_cache_select_writes  a decode step's one new key a row goes into the cache by a select
                          over the layer's slots (model/kv_cache.py), not a scatter: on TPU
                          the scatter runs in another layout than attention's reads, and
                          XLA relays the whole cache out around it every step
  expert_products_in_compute_dtype
                          the MoE's grouped matmuls write their products in the compute
                          dtype (accumulated in float32 inside): the expert buffers, sized
                          for the worst routing, are the largest arrays of a TPU step and
                          every elementwise pass over them is paid in HBM bytes. The CPU
                          kernels take float32 products (its GLU kernel reads them)
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from gpt_oss_train import sharding
from gpt_oss_train.arrays import bit_moves
from gpt_oss_train.kernels.cpu import huge_pages


@dataclasses.dataclass(frozen=True)
class Facts:
    streams_layer_weights: bool = False
    kv_cache_bits: bool = False
    huge_page_weights: bool = False
    kv_cache_select_writes: bool = False
    expert_products_in_compute_dtype: bool = False


FACTS = {
    "cpu": Facts(streams_layer_weights=True, kv_cache_bits=True, huge_page_weights=True),
    "gpu": Facts(expert_products_in_compute_dtype=True),
    "tpu": Facts(kv_cache_select_writes=True, expert_products_in_compute_dtype=True),
}


def facts(platform: str | None = None) -> Facts:
    """The facts of `platform` (default: the platform being traced for)."""
    return FACTS.get(platform or sharding.platform(), Facts())


def kv_cache_dtype(dtype, platform: str | None = None):
    """The dtype a KV cache of `dtype` values is stored in on this platform."""
    if facts(platform).kv_cache_bits:
        return bit_moves.storage_dtype(dtype)
    return jnp.dtype(dtype)


def place_weights(params, platform: str) -> None:
    """Inference's weights, once loaded, where the platform wants them in memory."""
    if facts(platform).huge_page_weights:
        huge_pages.back_with_huge_pages(params)
