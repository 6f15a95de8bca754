"""One layer of a layer-stacked weight, handed to a block in place of the layer's slice.

The layer loop (`jax.lax.scan` over blocks) hands each block its slice of every stacked
parameter, and XLA copies a slice before a dot or a loop reads it. Where a kernel can read
a layer straight from the stack, the model hands the block a view instead
(model/streamed_weights.py decides where):

  LayerView      inference: the stack and the layer index. `view[e]` reads expert e of
                 that layer, `stack[layer, e]`, never the whole layer; kernels read the
                 layer in place.
  TrainingView   training: the stack (its gradient stopped) for kernels to read in place,
                 and the scan's own slice (`value`), which carries the gradient and which
                 nothing reads, so XLA drops its copy.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from gpt_oss_train.arrays import bit_moves
from gpt_oss_train.arrays.lazy_weight import LazyWeight


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerView(LazyWeight):
    """Layer `layer` of a layer-stacked weight (an array, an int8 QArray or an MXFP4Array),
    read lazily: `view[i]` is `stack[layer, i]`; `astype` materializes the whole layer
    (for kernels that need it, such as `lax.ragged_dot`)."""

    stack: Any  # [layers, E, ...]
    layer: jax.Array  # int32 scalar

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.stack.shape[1:])

    @property
    def dtype(self):
        return self.stack.dtype

    def take(self, index):
        return bit_moves.take(self.stack, (self.layer, index))

    def astype(self, dtype):
        return bit_moves.take(self.stack, self.layer).astype(dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainingView(LazyWeight):
    """Layer `layer` of a layer-stacked weight in training: `stack` (gradient stopped) to
    read it in place, `value` (the scan's slice of the same weight) to carry its gradient.
    Kernels that read stacks in place (kernels/cpu/grouped_matmul.py) take both; anything
    else reads `value`."""

    stack: Any  # [layers, E, ...]
    layer: jax.Array  # int32 scalar
    value: jax.Array  # stack[layer], as the scan hands it to the block

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.value.shape)

    @property
    def dtype(self):
        return self.value.dtype

    def take(self, index):
        return self.value[index]

    def astype(self, dtype):
        return self.value.astype(dtype)


def whole(w):
    """A view's whole layer (kernels that take a layer's weights as one operand); any
    other weight as it is."""
    if isinstance(w, LayerView):
        return bit_moves.take(w.stack, w.layer)
    return w.value if isinstance(w, TrainingView) else w


def stack_of(w):
    """The stacked array a view reads (a plain weight: itself)."""
    return w.stack if isinstance(w, (LayerView, TrainingView)) else w
