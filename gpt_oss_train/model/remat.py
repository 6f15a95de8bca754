"""Rematerialisation policies for a layer block, keyed by `config.remat_policy`: what the
backward pass may keep from the forward pass instead of recomputing it."""

from __future__ import annotations

import jax

from gpt_oss_train.errors import ConfigError

_policies = jax.checkpoint_policies

# The name (jax.ad_checkpoint.checkpoint_name) of the expert matmuls' outputs, which
# "save_moe" keeps: on a CPU the grouped matmuls are most of a block's forward FLOPs and
# their outputs a small part of its activations (tokens x k x (2 F + D) float32 a layer).
EXPERT_PRODUCTS = "expert_products"

# The name of a block's input, the residual stream entering it, which "offload_inputs"
# moves to host memory: at long length the only activation a block keeps for the backward.
BLOCK_INPUT = "block_input"


def _checkpointed(policy):
    # prevent_cse only matters outside a scan (a scan body is never CSE'd across steps).
    return lambda body, scanned: jax.checkpoint(body, policy=policy, prevent_cse=not scanned)


POLICIES = {
    "none": lambda body, scanned: body,  # keep every activation
    "full": _checkpointed(None),  # keep nothing inside a block: recompute it
    "save_dots": _checkpointed(_policies.checkpoint_dots),
    "save_dots_no_batch": _checkpointed(_policies.checkpoint_dots_with_no_batch_dims),
    # keep the expert matmuls' outputs, recompute the rest (attention, routing, GLU, norms)
    "save_moe": _checkpointed(_policies.save_only_these_names(EXPERT_PRODUCTS)),
    # keep each block's input in host memory (copied out in the forward, back in the
    # backward) and recompute the rest: the device holds only the running block's
    # activations. On a CPU the copy is none (host memory is its memory): "full"'s program.
    "offload_inputs": _checkpointed(
        _policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[],
            names_which_can_be_offloaded=[BLOCK_INPUT],
            offload_src="device",
            offload_dst="pinned_host",
        )
    ),
}


def check_policy(name: str) -> None:
    """config.remat_policy's one-line error for a name POLICIES lacks. The names are
    declared here alone: config, below the model, cannot see them, so the model checks
    them when it is built (ModelDef), before any compute."""
    if name not in POLICIES:
        raise ConfigError(f"config.remat_policy: {name!r} is not one of {tuple(POLICIES)}")


def wrap(body, policy: str, *, scanned: bool):
    """`body` (one block's forward function) under the named policy."""
    return POLICIES[policy](body, scanned)
