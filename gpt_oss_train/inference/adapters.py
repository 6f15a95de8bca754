"""LoRA adapters for decoding and serving, kept apart from the base (never merged).

An adapter is a PEFT folder (adapter_config.json + adapter_model.safetensors, ours or
anyone's, see io/peft.py) or a LoRA training workdir / checkpoint (its params item holds
the adapters, its meta the spec and a reference to the base). Both are checked against
the base they are put on: a different architecture, rank or target set is a one-line
error naming the adapter.

One adapter is added as training has it (no adapter axis). Several are stacked: slot 0
holds no adapter (zeros: the base model), adapter i slot i + 1, all padded to the largest
rank with their own scales folded into B; each batch row then names its slot
(`Transformer(..., adapter_ids=[b])`), so one compiled step serves requests for different
adapters, and requests for none, side by side.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Sequence

import jax
import numpy as np

from gpt_oss_train import architecture
from gpt_oss_train.checkpoints import checkpoint as ckpt_lib
from gpt_oss_train.checkpoints.checkpoint import LORA_META_KEY
from gpt_oss_train.config import LoraSpec, ModelConfig, parse_targets
from gpt_oss_train.io import peft as peft_io
from gpt_oss_train.model import lora, parameters
from gpt_oss_train.model.transformer import ModelDef

AdapterError = peft_io.AdapterError


class UnknownAdapter(ValueError):
    """A request names an adapter that is not loaded (the message names those that are)."""


def parse_flag(entries: Sequence[str]) -> list[tuple[str, str]]:
    """--adapter entries (decode's and serve's) as (name, folder): DIR is ("", DIR), the
    one adapter every request uses; NAME=DIR one a request picks by NAME."""
    out = [tuple(a.split("=", 1)) if "=" in a else ("", a) for a in entries]
    if len(out) > 1 and any(not name for name, _ in out):
        raise AdapterError("--adapter: several adapters need names: NAME=DIR,NAME2=DIR2")
    return out


def adapter_slot(name, adapters: tuple[str, ...], stacked: bool) -> int:
    """A request's "adapter" -> its slot: 0 (none given; or the one unstacked adapter
    every request uses), else 1 + its index among the loaded adapters."""
    if name is None:
        return 0
    if name not in adapters:
        loaded = f"loaded: {list(adapters)}" if adapters else "none is loaded (--adapter)"
        raise UnknownAdapter(f'"adapter": {name!r} is not loaded; {loaded}')
    return adapters.index(name) + 1 if stacked else 0


def base_of(named: Sequence[tuple[str, str]]) -> str:
    """The base a LoRA training workdir records, for --adapter without --checkpoint."""
    path = named[0][1]
    source = ""
    if ckpt_lib.is_orbax_checkpoint(path):
        source = ckpt_lib.read_meta(path).get(LORA_META_KEY, {}).get("base", {}).get("source", "")
    if not source:
        raise AdapterError(
            f"--adapter={path} does not name the checkpoint it was trained on; pass --checkpoint"
        )
    return source


@dataclasses.dataclass
class Adapter:
    name: str
    path: str
    spec: LoraSpec
    tree: dict  # our adapter tree, float32 numpy, [layers, ...] leaves
    base: dict  # what it was trained on ({"source", "seed", "format"}), if known


def read_adapter(path: str, arch: Mapping[str, Any], name: str = "") -> Adapter:
    """An adapter folder, checked against the base architecture `arch`."""
    path = os.path.abspath(path)
    name = name or os.path.basename(path.rstrip("/"))
    if not os.path.isdir(path):
        raise AdapterError(f"--adapter={path}: no such folder")
    if peft_io.is_peft_folder(path):
        spec, tree = peft_io.load_peft(path, arch)
        return Adapter(name, path, spec, tree, {})
    if not ckpt_lib.is_orbax_checkpoint(path):
        raise AdapterError(
            f"--adapter={path} is neither a PEFT adapter folder (adapter_config.json) nor a "
            "LoRA training workdir / checkpoint"
        )
    meta = ckpt_lib.read_meta(path).get(LORA_META_KEY)
    if meta is None:
        raise AdapterError(f"--adapter={path} is a full checkpoint, not a LoRA adapter")
    stored = ckpt_lib.read_model_config(path)
    diffs = [k for k in architecture.FIELDS if stored.get(k) != arch.get(k)]
    if diffs:
        k = diffs[0]
        raise AdapterError(
            f"--adapter={path} was trained on another base ({k}: {stored.get(k)!r} there, "
            f"{arch.get(k)!r} in --checkpoint)"
        )
    spec = LoraSpec.from_json(meta)
    tree = ckpt_lib.load_params(path, _abstract(spec, arch))[0]
    return Adapter(name, path, spec, jax.device_get(tree), dict(meta.get("base", {})))


def _abstract(spec: LoraSpec, arch: Mapping[str, Any]) -> dict:
    """The adapter tree's shapes for a base, on one device (restored to host after)."""
    cfg = ModelConfig(**arch).replace(lora=spec)
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    shapes = lora.split(ModelDef(cfg).abstract_params())[1]
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), shapes)


def stack(adapters: Sequence[Adapter], arch: Mapping[str, Any]) -> tuple[LoraSpec, dict]:
    """Several adapters as one stacked tree (see the module docstring): slot 0 none,
    adapter i in slot i + 1; every leaf [layers, n + 1, ...]."""
    targets = parse_targets([t for a in adapters for t in a.spec.targets])
    rank = max(a.spec.rank for a in adapters)
    spec = LoraSpec(rank, float(rank), targets).stacked(len(adapters) + 1)
    sizes = {**parameters.dim_sizes(arch), "R": rank}
    out = {}
    for kind in parameters.KINDS:
        for module in ("attn", "moe"):
            for leaf, decl in lora.module_decls(spec, module).items():
                path = f"blocks/{kind}/{module}/{leaf}"
                shape = (parameters.num_blocks(arch), *parameters.shape(decl.dims, sizes))
                slots = [np.zeros(shape, np.float32)]
                for a in adapters:
                    mine = lora.flat(a.tree).get(path)
                    slots.append(
                        np.zeros(shape, np.float32)
                        if mine is None
                        else _pad_rank(decl, mine, rank, a.spec.scale)
                    )
                out[path] = np.stack(slots, axis=1)
    return spec, lora.unflat(out)


def _pad_rank(decl, x: np.ndarray, rank: int, scale: float) -> np.ndarray:
    """A [layers, ...] leaf zero-padded to `rank` along its R axis; a B factor (R not
    last) takes the adapter's scale, as stacked adapters have scale 1."""
    letters = decl.dims.split()
    axis = 1 + letters.index("R")
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, rank - x.shape[axis])
    x = np.asarray(x, np.float32) * (1.0 if letters[-1] == "R" else scale)
    return np.pad(x, pad)


def attach(model, named: Sequence[tuple[str, str]]):
    """Adds adapters [(name, folder)] to a LoadedModel (loading.py) beside its base. One
    unnamed adapter is added as trained (every request uses it); otherwise they are
    stacked and `model.adapters` lists their names (slot = index + 1)."""
    arch = {k: getattr(model.cfg, k) for k in architecture.FIELDS}
    read = [read_adapter(path, arch, name) for name, path in named]
    names = [a.name for a in read]
    if len(set(names)) < len(names):
        raise AdapterError(f"--adapter: two adapters are named {names}; give distinct NAME=DIR")
    if len(read) == 1 and not named[0][0]:
        spec, tree = read[0].spec, read[0].tree
    else:
        spec, tree = stack(read, arch)

    model.md = ModelDef(model.cfg.replace(lora=spec))
    shardings = lora.split(model.md.shardings(model.mesh, model.rules))[1]
    model.params = lora.merge(model.params, jax.device_put(tree, shardings))
    model.adapters = tuple(names)
