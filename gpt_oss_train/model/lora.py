"""LoRA: low-rank adapters beside frozen weights, W x + (alpha / r) (x A) B.

Which weights can be adapted is architecture.LORA_TARGETS; the shapes, logical axes and
PEFT tensors of their A/B pairs are declared in model/parameters.py (`LORA`); the spec a
model is built with is config.LoraSpec. This module holds what the model and the tools
do with them: the adapters' declarations, the low-rank product the layers add, and the
split of a parameter tree into the frozen base and the adapters (the only leaves
training differentiates).

Adapters live in the same nested tree as the weights they adapt, at
`blocks/<kind>/attn/lora_q_a` and so on, so one `ModelDef.bind` takes base and adapters
together. Several adapters can be served at once: a spec with `adapters=n` stacks n of
them on an axis after the layers' and each batch row names the one it uses.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from gpt_oss_train.architecture import LORA_TARGETS
from gpt_oss_train.config import LoraSpec
from gpt_oss_train.model import parameters

TARGETS = tuple(LORA_TARGETS)  # the targets' names, in the order a LoraSpec lists them
PREFIX = "lora_"  # every adapter leaf's name starts with it


def module_decls(spec: LoraSpec | None, prefix: str) -> dict[str, parameters.Param]:
    """The adapter leaves of one module ("attn", "moe") that `spec` targets."""
    if spec is None:
        return {}
    wanted = set()
    for t in spec.targets:
        a, bs = parameters.lora_leaves(t)
        wanted |= {a, *bs.values()}
    return {
        k: p
        for k, p in parameters.group(prefix, parameters.LORA).items()
        if f"{prefix}/{k}" in wanted
    }


def dim_sizes(cfg, spec: LoraSpec) -> dict[str, int]:
    return {**parameters.dim_sizes(cfg), "R": spec.rank}


def leaf_shape(p: parameters.Param, cfg, spec: LoraSpec) -> tuple[int, ...]:
    """One layer's shape of an adapter leaf (with the adapter axis when stacked)."""
    shape = parameters.shape(p.dims, dim_sizes(cfg, spec))
    return (spec.adapters, *shape) if spec.adapters else shape


def leaf_axes(p: parameters.Param, spec: LoraSpec) -> tuple[str | None, ...]:
    return (None, *p.axes) if spec.adapters else p.axes


# ----------------------------------------------------------------------------- compute


def delta(x, a, b, *, dtype, rows=None):
    """(x A) B in float32 for x [b, s, in..], A [in.., r], B [r, out..] -> [b, s, out..].
    With `rows` [b] (stacked adapters), A and B carry a leading adapter axis and row i
    uses adapter rows[i]."""
    n_in = a.ndim - 1 - (rows is not None)
    ins, outs = "ijkl"[:n_in], "mnop"[: b.ndim - 1 - (rows is not None)]
    x, a, b = x.astype(dtype), a.astype(dtype), b.astype(dtype)
    f32 = jnp.float32
    if rows is None:
        xa = jnp.einsum(f"bs{ins},{ins}r->bsr", x, a, preferred_element_type=f32)
        return jnp.einsum(f"bsr,r{outs}->bs{outs}", xa.astype(dtype), b, preferred_element_type=f32)
    xa = jnp.einsum(f"bs{ins},b{ins}r->bsr", x, a[rows], preferred_element_type=f32)
    return jnp.einsum(
        f"bsr,br{outs}->bs{outs}", xa.astype(dtype), b[rows], preferred_element_type=f32
    )


# ----------------------------------------------------------------------------- trees


def is_adapter_path(path: str) -> bool:
    return path.rpartition("/")[2].startswith(PREFIX)


def split(tree: dict) -> tuple[dict, dict]:
    """(base, adapters): a nested param dict cut by leaf name; empty branches dropped."""

    def cut(node, prefix):
        if not isinstance(node, Mapping):
            keep = is_adapter_path(prefix)
            return (None, node) if keep else (node, None)
        base, adapters = {}, {}
        for k, v in node.items():
            b, a = cut(v, f"{prefix}/{k}" if prefix else k)
            if b is not None and not _empty(b):
                base[k] = b
            if a is not None and not _empty(a):
                adapters[k] = a
        return base, adapters

    return cut(tree, "")


def _empty(node) -> bool:
    return isinstance(node, Mapping) and not node


def merge(base: Mapping, adapters: Mapping) -> dict:
    """The union of two nested dicts with disjoint leaves (what ModelDef.bind takes)."""
    out = dict(base)
    for k, v in adapters.items():
        out[k] = merge(out[k], v) if isinstance(v, Mapping) and k in out else v
    return out


def get(tree: Mapping, path: str):
    for k in path.split("/"):
        tree = tree[k]
    return tree


def flat(tree: Mapping, prefix: str = "") -> dict[str, Any]:
    """{"a/b/c": leaf} of a nested dict."""
    out = {}
    for k, v in tree.items():
        p = f"{prefix}/{k}" if prefix else k
        out.update(flat(v, p) if isinstance(v, Mapping) else {p: v})
    return out


def unflat(items: Mapping[str, Any]) -> dict:
    out: dict = {}
    for path, v in items.items():
        *head, last = path.split("/")
        node = out
        for k in head:
            node = node.setdefault(k, {})
        node[last] = v
    return out


def weight_delta(
    spec: LoraSpec, adapters: Mapping, weight_path: str, layers: slice = slice(None)
) -> np.ndarray | None:
    """scale * A B for the stacked blocks `layers` of a weight ("blocks/full/moe/wi_gate"),
    in its own layout [layers, ...], float32; None if no target adapts it."""
    kind, _, leaf = weight_path.partition("/")[2].partition("/")
    for t in spec.targets:
        a_leaf, b_leaves = parameters.lora_leaves(t)
        if leaf in b_leaves:
            a = np.asarray(get(adapters, f"blocks/{kind}/{a_leaf}")[layers], np.float64)
            b = np.asarray(get(adapters, f"blocks/{kind}/{b_leaves[leaf]}")[layers], np.float64)
            letters = lambda p: p.dims.replace(" ", "")
            a_dims, b_dims = (
                letters(parameters.LORA[a_leaf]),
                letters(parameters.LORA[b_leaves[leaf]]),
            )
            eq = f"L{a_dims},L{b_dims}->L{letters(parameters.LAYER[leaf])}"
            return (spec.scale * np.einsum(eq, a, b)).astype(np.float32)
    return None


def random_like(tree: Mapping, seed: int, std: float = 0.05) -> dict:
    """Adapters with every leaf random (B included): for tests and examples, where B = 0
    would hide every mistake."""
    leaves, treedef = jax.tree.flatten(tree)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(
        treedef,
        [std * jax.random.normal(k, np.shape(x), jnp.float32) for k, x in zip(keys, leaves)],
    )
