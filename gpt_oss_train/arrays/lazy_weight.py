"""The interface of a weight that stands in the parameter tree for a dense array without
being one: an int8 `QArray` (model/quantize.py), an `MXFP4Array` (mxfp4_array.py) and a
`LayerView` of a layer-stacked weight (layer_views.py).

Model code reads every weight as `w[...]`, indexes leading axes (a layer, chosen experts)
with `w[index]`, and asks for the dense values with `w.astype(dtype)`; `shape`, `ndim`
and `dtype` describe the dense weight. A stand-in keeps its form through indexing, so
only the part a layer uses is ever made dense.
"""

from __future__ import annotations


class LazyWeight:
    """Subclasses (jax dataclasses) define `shape`, `dtype`, `take(index)` (the stand-in
    for `dense[index]`, leading axes only) and `astype(dtype)` (the dense values)."""

    shape: tuple[int, ...]

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __getitem__(self, index):
        return self if index is Ellipsis else self.take(index)

    def take(self, index):
        raise NotImplementedError

    def astype(self, dtype):
        raise NotImplementedError
