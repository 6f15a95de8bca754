"""Inference reads the large weights it uses straight from their layer-stacked arrays.

The layer loop (`jax.lax.scan` over blocks) hands each block its slice of every stacked
parameter, and XLA copies a slice before a dot or a loop reads it. For the expert
weights that slice is all E experts of the layer: 226 MB per layer at the CPU
benchmark's shape, copied to use 4 experts (28 MB) at batch 1; the copies were ~80% of a
batch-1 decode step (docs/PERFORMANCE.md). The attention projections are read whole, but
copying them before reading them still doubles their memory traffic.

So in inference these matrices stay out of the scanned state: each block gets a
`LayerView` (the stacked array and its layer index) in their place. Indexing a view by
expert reads that expert from the stack, `stack[layer, e]`, never the whole layer, and
the CPU kernels (model/cpu_kernels/) read a view's layer in place.

Training cannot hand the blocks plain views: a view's gradient would be a stack-sized
accumulator in the backward scan. Where the CPU grouped matmul kernels run the experts,
each block gets a `TrainingView` instead: the kernels read the layer in place from the
stack (its gradient stopped), and the gradient goes to the block's own slice, which
nothing reads, so XLA drops the slice's copy (75 MB a matrix at the CPU benchmark's
shape, three a layer, once more under remat) and the backward scan stores each layer's
gradient as before.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from gpt_oss_train import sharding
from gpt_oss_train.model import bit_moves
from gpt_oss_train.model.lazy_weight import LazyWeight

# The expert matrices (E x D x F each) and the attention projections, by module; biases
# are small and stay in the scan.
EXPERTS = ("wi_gate", "wi_up", "wo")
PROJECTIONS = ("q_kernel", "k_kernel", "v_kernel", "o_kernel")
STREAMED = {"moe": EXPERTS, "attn": PROJECTIONS}


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
    Kernels that read stacks in place (cpu_kernels/grouped_matmul.py) take both; anything
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
    return bit_moves.take(w.stack, w.layer) if isinstance(w, LayerView) else w


def applies(cache, num_blocks: int) -> bool:
    """Stream in inference (a KV cache is given) on a CPU with one device. Other
    platforms keep the measured layer slices (GPU decode was profiled with them; TPU's
    ragged dot reads the whole layer anyway), and a mesh could shard the experts, where
    indexing a stack by a traced expert would gather it."""
    if cache is None or num_blocks < 1 or sharding.platform() != "cpu":
        return False
    ctx = sharding.active()
    return ctx is None or ctx[0].size == 1


def _is_streamed(path) -> bool:
    names = [getattr(k, "key", k) for k in path]
    return len(names) >= 2 and names[-1] in STREAMED.get(names[-2], ())


def _map_streamed(fn, state):
    """`state` with each streamed parameter's value v replaced by fn(path, v)."""

    def one(path, var):
        if not _is_streamed(path):
            return var
        return var.replace(value=fn(path, var[...]))

    return jax.tree_util.tree_map_with_path(
        one, state, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )


def take(block_params, num_blocks: int):
    """Split the streamed matrices off the scanned block state. Returns (the state
    with each of them replaced by its layer indices [num_blocks], {path: stack})."""
    stacks = {}

    def keep(path, stack):
        stacks[jax.tree_util.keystr(path)] = stack
        return jnp.arange(num_blocks, dtype=jnp.int32)

    return _map_streamed(keep, block_params), stacks


def put(layer_params, stacks):
    """Inside the scan: each streamed parameter (now its layer index) becomes a view."""
    return _map_streamed(
        lambda path, layer: LayerView(stacks[jax.tree_util.keystr(path)], layer), layer_params
    )


def training_stacks(block_params, readable) -> dict:
    """The expert matrices' stacks that `readable(stack)` accepts, gradient stopped, by
    path: what `put_training` reads."""
    stacks = {}

    def keep(path, stack):
        if getattr(path[-2], "key", None) == "moe" and readable(stack):
            stacks[jax.tree_util.keystr(path)] = jax.lax.stop_gradient(stack)
        return stack

    _map_streamed(keep, block_params)
    return stacks


def put_training(layer_params, stacks, layer):
    """Inside the scan: each expert matrix (the scan's slice) becomes a TrainingView."""
    return _map_streamed(
        lambda path, value: (
            TrainingView(stacks[key], layer, value)
            if (key := jax.tree_util.keystr(path)) in stacks
            else value
        ),
        layer_params,
    )
