"""Where a block reads layers of the stacked weights in place (arrays/layer_views.py).

The layer loop (`jax.lax.scan` over blocks) hands each block its slice of every stacked
parameter, and XLA copies a slice before a dot or a loop reads it. For the expert
weights that slice is all E experts of the layer: 226 MB per layer at the CPU
benchmark's shape, copied to use 4 experts (28 MB) at batch 1; the copies were ~80% of a
batch-1 decode step (docs/PERFORMANCE.md). The attention projections are read whole, but
copying them before reading them still doubles their memory traffic.

So in inference these matrices stay out of the scanned state: each block gets a
`LayerView` (the stacked array and its layer index) in their place. Indexing a view by
expert reads that expert from the stack, `stack[layer, e]`, never the whole layer, and
the CPU kernels (kernels/cpu/) read a view's layer in place.

Training cannot hand the blocks plain views: a view's gradient would be a stack-sized
accumulator in the backward scan. Where the grouped matmul that runs reads stacks in
place (`Kernels.reads_in_place`), each block gets a `TrainingView` instead: the kernel
reads the layer in place from the stack (its gradient stopped), and the gradient goes to
the block's own slice, which nothing reads, so XLA drops the slice's copy (75 MB a
matrix at the CPU benchmark's shape, three a layer, once more under remat) and the
backward scan stores each layer's gradient as before.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from gpt_oss_train import sharding
from gpt_oss_train.arrays.layer_views import LayerView, TrainingView
from gpt_oss_train.kernels import platforms

# The expert matrices (E x D x F each) and the attention projections, by module; biases
# are small and stay in the scan.
EXPERTS = ("wi_gate", "wi_up", "wo")
PROJECTIONS = ("q_kernel", "k_kernel", "v_kernel", "o_kernel")
STREAMED = {"moe": EXPERTS, "attn": PROJECTIONS}


def streams(cache, num_blocks: int) -> bool:
    """Stream in inference (a KV cache is given) where the platform does
    (kernels/platforms.py) and on one device: a mesh could shard the experts, where
    indexing a stack by a traced expert would gather it."""
    if cache is None or num_blocks < 1 or not platforms.facts().streams_layer_weights:
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
