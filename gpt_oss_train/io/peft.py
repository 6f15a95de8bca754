"""PEFT adapter folders <-> our LoRA adapter tree.

A folder holds `adapter_config.json` and `adapter_model.safetensors`, the files
`peft.PeftModel.from_pretrained(GptOssForCausalLM, folder)` loads. Attention projections
are `target_modules` (nn.Linear: `lora_A.weight` [r, in], `lora_B.weight` [out, r]); the
experts and the router are `target_parameters` ("mlp.experts.gate_up_proj",
"mlp.experts.down_proj", "mlp.router.weight"), which PEFT wraps in a ParamWrapper: A
[E*r, in] with rows expert-major, B [out, r*E] with columns rank-major. When both expert
tensors are adapted PEFT nests the wrappers, the first registered (gate_up_proj) inside:
its tensors are named `mlp.experts.base_layer.lora_*`, down_proj's `mlp.experts.lora_*`.

Layouts come from the declarations in model/parameters.py (`LORA`). Everything here is
numpy; nothing imports jax or torch.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Mapping

import ml_dtypes  # noqa: F401  (makes bfloat16 safetensors readable through numpy)
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from gpt_oss_train.config import LoraSpec, parse_targets
from gpt_oss_train.errors import UserError
from gpt_oss_train.model import lora as lora_lib
from gpt_oss_train.model import parameters
from gpt_oss_train.model.parameters import KINDS, LORA_TARGETS

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model.model.layers"


class AdapterError(UserError):
    """An adapter folder that does not fit the model; the message names it and the tensor."""


def is_peft_folder(path: str) -> bool:
    return os.path.isfile(os.path.join(path, CONFIG_FILE))


def _module(target: str, targets: tuple[str, ...]) -> str:
    """The PEFT module path (below `model.layers.<n>.`) holding a target's lora_A/lora_B."""
    name = parameters.LORA[parameters.lora_leaves(target)[0]].hf.name
    module = name.removesuffix(".lora_A.weight")
    if target == "gate_up" and "down" in targets:
        module += ".base_layer"  # the inner of the two nested ParamWrappers
    return module


def tensor_names(spec: LoraSpec, num_layers: int) -> dict[str, tuple[str, int, str]]:
    """PEFT tensor name -> (target, HF layer, "A" | "B") for every tensor of an adapter."""
    out = {}
    for n in range(num_layers):
        for t in spec.targets:
            for ab in "AB":
                out[f"{_PREFIX}.{n}.{_module(t, spec.targets)}.lora_{ab}.weight"] = (t, n, ab)
    return out


def adapter_config(spec: LoraSpec, base: str = "") -> dict:
    modules = [LORA_TARGETS[t].peft for t in spec.targets if not LORA_TARGETS[t].is_parameter]
    params = [LORA_TARGETS[t].peft for t in spec.targets if LORA_TARGETS[t].is_parameter]
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base or None,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "target_modules": modules or None,
        "target_parameters": params or None,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }


def _layer(adapters: Mapping, path: str, n: int) -> np.ndarray:
    """One HF layer's array of an adapter leaf ("attn/lora_q_a")."""
    return np.asarray(lora_lib.get(adapters, f"blocks/{KINDS[n % 2]}/{path}")[n // 2])


def to_peft_tensors(spec: LoraSpec, adapters: Mapping, num_layers: int) -> dict:
    """Our adapter tree -> {PEFT tensor name: float32 array}."""
    out = {}
    for name, (t, n, ab) in tensor_names(spec, num_layers).items():
        a_path, b_paths = parameters.lora_leaves(t)
        paths = [a_path] if ab == "A" else list(b_paths.values())
        parts = [parameters.to_hf(parameters.LORA[p], _layer(adapters, p, n)) for p in paths]
        axis = parameters.fused_axis(parameters.LORA[paths[0]]) if len(parts) > 1 else -1
        out[name] = np.ascontiguousarray(parameters.fuse(parts, axis), np.float32)
    return out


def save_peft(out_dir: str, spec: LoraSpec, adapters: Mapping, num_layers: int, base: str = ""):
    """Writes a PEFT adapter folder (refuses a non-empty out_dir)."""
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        raise FileExistsError(f"{out_dir} is not empty; refusing to overwrite it")
    os.makedirs(out_dir, exist_ok=True)
    tensors = to_peft_tensors(spec, adapters, num_layers)
    save_file(tensors, os.path.join(out_dir, WEIGHTS_FILE), metadata={"format": "pt"})
    with open(os.path.join(out_dir, CONFIG_FILE), "w") as f:
        json.dump(adapter_config(spec, base), f, indent=2)


# ----------------------------------------------------------------------------- reading


def _targets_from_config(cfg: dict, where: str) -> tuple[str, ...]:
    by_peft = {t.peft: name for name, t in LORA_TARGETS.items()}
    names = []
    for field in ("target_modules", "target_parameters"):
        value = cfg.get(field) or []
        if isinstance(value, str):
            raise AdapterError(
                f"{where}: {field}={value!r} is a pattern; only explicit lists of "
                f"{sorted(by_peft)} are supported"
            )
        for v in value:
            match = [p for p in by_peft if v == p or v.endswith("." + p)]
            if not match:
                raise AdapterError(
                    f"{where}: {field} names {v!r}, which gpt-oss LoRA does not support; "
                    f"supported: {sorted(by_peft)}"
                )
            names.append(by_peft[match[0]])
    return parse_targets(names, f"{where}: targets")


def read_spec(path: str) -> LoraSpec:
    """The LoRA spec of a PEFT folder's adapter_config.json (plain LoRA only)."""
    where = os.path.join(path, CONFIG_FILE)
    try:
        with open(where) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise AdapterError(f"{where}: cannot read it ({e})") from None
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{where}: peft_type {cfg.get('peft_type')!r}; only LORA is supported")
    for key, ok in (
        ("use_dora", lambda v: not v),
        ("bias", lambda v: v in (None, "none")),
        ("rank_pattern", lambda v: not v),
        ("alpha_pattern", lambda v: not v),
        ("layers_to_transform", lambda v: v is None),
        ("modules_to_save", lambda v: not v),
        ("fan_in_fan_out", lambda v: not v),
    ):
        if key in cfg and not ok(cfg[key]):
            raise AdapterError(f"{where}: {key}={cfg[key]!r} is not supported")
    rank, alpha = int(cfg["r"]), float(cfg["lora_alpha"])
    if cfg.get("use_rslora"):
        alpha = alpha * math.sqrt(rank)  # rsLoRA scales by alpha / sqrt(r)
    return LoraSpec(rank, alpha, _targets_from_config(cfg, where))


def load_peft(path: str, arch: Mapping[str, Any]) -> tuple[LoraSpec, dict]:
    """(spec, our adapter tree of float32 numpy arrays) from a PEFT folder, checked
    against the base architecture `arch`: every tensor present with the shape it needs."""
    spec = read_spec(path)
    weights = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights):
        raise AdapterError(f"{path}: no {WEIGHTS_FILE}")
    num_layers = int(arch["num_layers"])
    names = tensor_names(spec, num_layers)
    sizes = {**parameters.dim_sizes(arch), "R": spec.rank}
    with safe_open(weights, framework="numpy") as f:
        stored = set(f.keys())
        extra = sorted(stored - set(names))
        if extra:
            raise AdapterError(
                f"{weights}: tensor {extra[0]!r} is not one a {num_layers}-layer gpt-oss "
                f"adapter with targets {list(spec.targets)} has"
            )
        layers: dict[str, list] = {}
        for name, (t, n, ab) in names.items():
            if name not in stored:
                raise AdapterError(f"{weights}: missing tensor {name!r}")
            a_path, b_paths = parameters.lora_leaves(t)
            paths = [a_path] if ab == "A" else list(b_paths.values())
            fused = np.asarray(f.get_tensor(name), np.float32)
            decl = parameters.LORA[paths[0]]
            want = parameters.shape(decl.hf.dims, sizes)
            if len(paths) > 1:
                want = _fused_shape(decl, want)
            if fused.shape != want:
                raise AdapterError(
                    f"{weights}: {name} has shape {list(fused.shape)}, but rank {spec.rank} on "
                    f"this base needs {list(want)} (a different rank or base model?)"
                )
            for p in paths:
                part = parameters.split(parameters.LORA[p], fused)
                ours = parameters.from_hf(parameters.LORA[p], part, sizes)
                layers.setdefault(f"blocks/{KINDS[n % 2]}/{p}", []).append(ours)
    return spec, lora_lib.unflat({k: np.stack(v) for k, v in layers.items()})


def _fused_shape(decl: parameters.Param, part_shape: tuple[int, ...]) -> tuple[int, ...]:
    axis = parameters.fused_axis(decl)
    return tuple(2 * d if i == axis else d for i, d in enumerate(part_shape))
