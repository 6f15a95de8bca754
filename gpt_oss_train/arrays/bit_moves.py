"""Moving bfloat16 data as its 16-bit patterns.

XLA:CPU (jax 0.10.2) computes a dynamic slice or a scatter of a bfloat16 array by
converting the whole array to float32 and back, and hoists the conversion out of the loops
around it: a bfloat16 decode step converted its whole stacked KV cache every layer, and a
prefill chunk all of its expert stacks (docs/PERFORMANCE.md). The same moves on uint16 bit
patterns are exact and stay in place, and the dots that read the result stay in bfloat16.

take(a, i)          a[i], by its bits where a is bfloat16
storage_dtype(dt)   how an array that is written by scatters (the KV cache) keeps values
                    of dtype dt: uint16 bits for bfloat16
to_storage(x, st)   x as stored in an array of dtype st
from_storage(a)     the values of a stored array
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_BF16, _BITS = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.uint16)
_bitcast = jax.lax.bitcast_convert_type


def take(a, index):
    """a[index]; other arrays (int8 QArray, MXFP4Array, any other dtype) as usual."""
    if not (isinstance(a, jax.Array) and a.dtype == _BF16):
        return a[index]
    return _bitcast(_bitcast(a, _BITS)[index], _BF16)


def storage_dtype(dtype):
    return _BITS if jnp.dtype(dtype) == _BF16 else jnp.dtype(dtype)


def value_dtype(storage):
    """The dtype of the values an array of dtype `storage` holds."""
    return _BF16 if jnp.dtype(storage) == _BITS else jnp.dtype(storage)


def to_storage(x, storage):
    if jnp.dtype(storage) == _BITS:
        return _bitcast(x.astype(_BF16), _BITS)
    return x.astype(storage)


def from_storage(a):
    return _bitcast(a, _BF16) if a.dtype == _BITS else a
