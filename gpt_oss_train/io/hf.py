"""Hugging Face GPT-OSS checkpoints <-> our parameter tree.

Reads the safetensors folders that ``transformers`` writes for ``GptOssForCausalLM``
(dense experts) and the published ``openai/gpt-oss-*`` folders (MXFP4 experts), single
file or sharded with ``model.safetensors.index.json``; writes dense (optionally MXFP4)
folders that ``GptOssForCausalLM.from_pretrained`` loads. Everything here is numpy;
nothing imports jax or torch.

On-disk layout (checked against transformers 5.24 ``save_pretrained``; per layer n)::

    model.embed_tokens.weight                         [V, D]
    model.layers.n.input_layernorm.weight             [D]
    model.layers.n.post_attention_layernorm.weight    [D]
    model.layers.n.self_attn.{q,k,v}_proj.weight      [N*H | K*H, D]   (out, in)
    model.layers.n.self_attn.{q,k,v}_proj.bias        [N*H | K*H]
    model.layers.n.self_attn.o_proj.weight            [D, N*H]         (out, in)
    model.layers.n.self_attn.o_proj.bias              [D]
    model.layers.n.self_attn.sinks                    [N]
    model.layers.n.mlp.router.weight / .bias          [E, D] / [E]
    model.layers.n.mlp.experts.gate_up_proj           [E, D, 2F]  (in, out: used as x @ W;
                                                       columns interleaved gate, up, gate, ...)
    model.layers.n.mlp.experts.gate_up_proj_bias      [E, 2F]
    model.layers.n.mlp.experts.down_proj              [E, F, D]   (in, out)
    model.layers.n.mlp.experts.down_proj_bias         [E, D]
    model.norm.weight                                 [D]
    lm_head.weight                                    [V, D]

MXFP4 folders (``quantization_config.quant_method == "mxfp4"``) replace the two expert
matrices by ``{gate_up,down}_proj_blocks`` uint8 [E, out, in/32, 16] and
``{gate_up,down}_proj_scales`` uint8 [E, out, in/32] (note: (out, in) order, unlike the
dense tensors); the codec is :mod:`gpt_oss_train.io.mxfp4`. config.json is mapped by
:mod:`gpt_oss_train.io.hf_config`, the file format read by :mod:`gpt_oss_train.io.safetensors_io`.

Our tree (the contract with the model) groups HF layers in 2-layer blocks: HF layer 2i is
block i of ``blocks/sliding``, HF layer 2i+1 is block i of ``blocks/full``; every block
parameter carries a leading ``L2 = num_layers // 2`` axis. See :func:`param_shapes`.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from typing import Any, Callable, Mapping

import ml_dtypes  # noqa: F401  (also makes np.dtype("bfloat16") resolvable for safetensors)
import numpy as np

from gpt_oss_train.io.hf_config import (
    check_model_dict,
    generation_config,
    hf_config_to_model_dict,
    model_dict_to_hf_config,
)
from gpt_oss_train.io.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from gpt_oss_train.io.safetensors_io import (
    FLOAT_DTYPES,
    ST_DTYPES,
    TensorInfo,
    read_header,
    write_safetensors,
)

__all__ = [
    "HFCheckpoint",
    "param_shapes",
    "hf_tensor_names",
    "load_params",
    "load_sharded",
    "save_hf",
]

KINDS = ("sliding", "full")  # block i of KINDS[j] is HF layer 2i + j
_SAVE_DTYPES = {
    "float32": ("F32", np.dtype("<f4")),
    "bfloat16": ("BF16", np.dtype(ml_dtypes.bfloat16)),
}

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


# --------------------------------------------------------------------------
# Name / layout mapping
# --------------------------------------------------------------------------


def _dims(m: Mapping[str, Any]) -> dict[str, int]:
    return dict(
        V=int(m["vocab_size"]),
        D=int(m["hidden_size"]),
        N=int(m["num_heads"]),
        K=int(m["num_kv_heads"]),
        H=int(m["head_dim"]),
        E=int(m["num_experts"]),
        F=int(m["intermediate_size"]),
        L2=int(m["num_layers"]) // 2,
    )


# Block leaves: leaf -> per-layer shape (without the L2 axis), in terms of _dims.
_BLOCK_LEAVES = {
    "attn_norm/scale": "D",
    "mlp_norm/scale": "D",
    "attn/q_kernel": "D N H",
    "attn/q_bias": "N H",
    "attn/k_kernel": "D K H",
    "attn/k_bias": "K H",
    "attn/v_kernel": "D K H",
    "attn/v_bias": "K H",
    "attn/o_kernel": "N H D",
    "attn/o_bias": "D",
    "attn/sinks": "N",
    "moe/router_kernel": "D E",
    "moe/router_bias": "E",
    "moe/wi_gate": "E D F",
    "moe/wi_up": "E D F",
    "moe/bi_gate": "E F",
    "moe/bi_up": "E F",
    "moe/wo": "E F D",
    "moe/bo": "E D",
}
_TOP_LEAVES = {"embed/embedding": "V D", "final_norm/scale": "D", "unembed/kernel": "D V"}


def _shape(spec: str, d: Mapping[str, int]) -> tuple[int, ...]:
    return tuple(d[c] for c in spec.split())


def param_shapes(m: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every path of our parameter tree -> its shape, in a fixed order."""
    d = _dims(m)
    out: dict[str, tuple[int, ...]] = {"embed/embedding": _shape("V D", d)}
    for kind in KINDS:
        for leaf, spec in _BLOCK_LEAVES.items():
            out[f"blocks/{kind}/{leaf}"] = (d["L2"], *_shape(spec, d))
    out["final_norm/scale"] = _shape("D", d)
    out["unembed/kernel"] = _shape("D V", d)
    return out


def _split_path(path: str) -> tuple[str | None, str]:
    """'blocks/full/attn/q_kernel' -> ('full', 'attn/q_kernel'); top-level -> (None, path)."""
    parts = path.split("/")
    if len(parts) >= 3 and parts[0] == "blocks" and parts[1] in KINDS:
        leaf = "/".join(parts[2:])
        if leaf in _BLOCK_LEAVES:
            return parts[1], leaf
    elif path in _TOP_LEAVES:
        return None, path
    raise KeyError(f"unknown parameter path {path!r}")


# HF per-layer tensor suffix -> (our leaves, HF shape spec). Conversion functions below.
_HF_LAYER = {
    "input_layernorm.weight": (("attn_norm/scale",), "D"),
    "post_attention_layernorm.weight": (("mlp_norm/scale",), "D"),
    "self_attn.q_proj.weight": (("attn/q_kernel",), "NH D"),
    "self_attn.q_proj.bias": (("attn/q_bias",), "NH"),
    "self_attn.k_proj.weight": (("attn/k_kernel",), "KH D"),
    "self_attn.k_proj.bias": (("attn/k_bias",), "KH"),
    "self_attn.v_proj.weight": (("attn/v_kernel",), "KH D"),
    "self_attn.v_proj.bias": (("attn/v_bias",), "KH"),
    "self_attn.o_proj.weight": (("attn/o_kernel",), "D NH"),
    "self_attn.o_proj.bias": (("attn/o_bias",), "D"),
    "self_attn.sinks": (("attn/sinks",), "N"),
    "mlp.router.weight": (("moe/router_kernel",), "E D"),
    "mlp.router.bias": (("moe/router_bias",), "E"),
    "mlp.experts.gate_up_proj": (("moe/wi_gate", "moe/wi_up"), "E D 2F"),
    "mlp.experts.gate_up_proj_bias": (("moe/bi_gate", "moe/bi_up"), "E 2F"),
    "mlp.experts.down_proj": (("moe/wo",), "E F D"),
    "mlp.experts.down_proj_bias": (("moe/bo",), "E D"),
}
_LEAF_TO_HF = {
    leaf: (suffix, j) for suffix, (leaves, _) in _HF_LAYER.items() for j, leaf in enumerate(leaves)
}
_HF_TOP = {
    "model.embed_tokens.weight": ("embed/embedding", "V D"),
    "model.norm.weight": ("final_norm/scale", "D"),
    "lm_head.weight": ("unembed/kernel", "V D"),
}
_TOP_TO_HF = {leaf: name for name, (leaf, _) in _HF_TOP.items()}
_MX_PROJ = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def _hf_shape(spec: str, d: Mapping[str, int]) -> tuple[int, ...]:
    ext = dict(d, NH=d["N"] * d["H"], KH=d["K"] * d["H"])
    ext["2F"] = 2 * d["F"]
    return tuple(ext[c] for c in spec.split())


def _layer_name(n: int, suffix: str) -> str:
    return f"model.layers.{n}.{suffix}"


def hf_tensor_names(m: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every dense HF tensor name -> shape, in file order (embed, layers 0..L-1, norm, lm_head)."""
    d = _dims(m)
    out = {"model.embed_tokens.weight": _hf_shape("V D", d)}
    for n in range(int(m["num_layers"])):
        for suffix, (_, spec) in _HF_LAYER.items():
            out[_layer_name(n, suffix)] = _hf_shape(spec, d)
    out["model.norm.weight"] = _hf_shape("D", d)
    out["lm_head.weight"] = _hf_shape("V D", d)
    return out


def _hf_to_ours(suffix: str, w: np.ndarray, d: Mapping[str, int]) -> tuple[np.ndarray, ...]:
    """One HF layer tensor -> our per-layer leaves (views where possible)."""
    D, N, K, H = d["D"], d["N"], d["K"], d["H"]
    if suffix == "self_attn.q_proj.weight":
        return (w.T.reshape(D, N, H),)
    if suffix in ("self_attn.k_proj.weight", "self_attn.v_proj.weight"):
        return (w.T.reshape(D, K, H),)
    if suffix == "self_attn.q_proj.bias":
        return (w.reshape(N, H),)
    if suffix in ("self_attn.k_proj.bias", "self_attn.v_proj.bias"):
        return (w.reshape(K, H),)
    if suffix == "self_attn.o_proj.weight":
        return (w.T.reshape(N, H, D),)
    if suffix == "mlp.router.weight":
        return (w.T,)
    if suffix in ("mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj_bias"):
        return (w[..., 0::2], w[..., 1::2])
    return (w,)


def _ours_to_hf(suffix: str, parts: list[np.ndarray], d: Mapping[str, int]) -> np.ndarray:
    """Our per-layer leaves -> one HF layer tensor."""
    D = d["D"]
    w = parts[0]
    if suffix in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"):
        return w.reshape(D, -1).T
    if suffix.endswith("_proj.bias") and suffix.startswith("self_attn.") and "o_proj" not in suffix:
        return w.reshape(-1)
    if suffix == "self_attn.o_proj.weight":
        return w.reshape(-1, D).T
    if suffix == "mlp.router.weight":
        return w.T
    if suffix in ("mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj_bias"):
        g, u = parts
        out = np.empty((*g.shape[:-1], 2 * g.shape[-1]), np.result_type(g, u))
        out[..., 0::2] = g
        out[..., 1::2] = u
        return out
    return w


# --------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------


class HFCheckpoint:
    """A Hugging Face GPT-OSS checkpoint folder, read lazily one tensor at a time.

    Construction reads config.json and every safetensors header and checks that each
    tensor our tree needs is present with the right shape and dtype class; errors name the
    tensor and the file. ``read(path, layers)`` returns our float32 layout for a range of
    stacked blocks only.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        if not os.path.isdir(self.path):
            raise FileNotFoundError(f"HF checkpoint folder {self.path} does not exist")
        cfg_path = os.path.join(self.path, "config.json")
        if not os.path.isfile(cfg_path):
            raise FileNotFoundError(f"HF checkpoint {self.path} has no config.json")
        try:
            with open(cfg_path) as f:
                self.hf_config: dict[str, Any] = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{cfg_path} is not valid JSON ({e})") from None
        try:
            self._model_config = hf_config_to_model_dict(self.hf_config)
        except ValueError as e:
            raise ValueError(f"{cfg_path}: {e}") from None
        self._dims = _dims(self._model_config)
        self._shapes = param_shapes(self._model_config)
        self._tensors = self._index_tensors()
        self._handles: dict[str, Any] = {}
        self._mx_layers: set[int] = set()
        self._validate()

    # -- discovery / validation ------------------------------------------------
    def _index_tensors(self) -> dict[str, TensorInfo]:
        idx_path = os.path.join(self.path, INDEX_FILE)
        single = os.path.join(self.path, SINGLE_FILE)
        tensors: dict[str, TensorInfo] = {}
        if os.path.isfile(idx_path):
            try:
                with open(idx_path) as f:
                    wmap = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{idx_path} is not a valid safetensors index ({e!r})") from None
            headers: dict[str, dict[str, TensorInfo]] = {}
            for fname in sorted(set(wmap.values())):
                fpath = os.path.join(self.path, fname)
                if not os.path.isfile(fpath):
                    raise FileNotFoundError(f"{idx_path} lists {fname}, which does not exist")
                headers[fname] = read_header(fpath)[0]
            for name, fname in wmap.items():
                if name not in headers[fname]:
                    raise ValueError(
                        f"{idx_path} says tensor {name!r} is in "
                        f"{os.path.join(self.path, fname)}, but that file lacks it"
                    )
                tensors[name] = headers[fname][name]
            return tensors
        if os.path.isfile(single):
            files = [single]
        else:
            files = sorted(
                os.path.join(self.path, f)
                for f in os.listdir(self.path)
                if f.endswith(".safetensors")
            )
            if not files:
                raise FileNotFoundError(
                    f"HF checkpoint {self.path} has no {SINGLE_FILE}, no "
                    f"{INDEX_FILE} and no *.safetensors files"
                )
        for fpath in files:
            for name, info in read_header(fpath)[0].items():
                if name in tensors:
                    raise ValueError(
                        f"tensor {name!r} appears in both {tensors[name].file} and {fpath}"
                    )
                tensors[name] = info
        return tensors

    def _where(self) -> str:
        files = sorted({os.path.basename(t.file) for t in self._tensors.values()})
        return f"{self.path} (files: {', '.join(files)})"

    def _check(self, name: str, shape: tuple[int, ...], kind: str) -> None:
        t = self._tensors.get(name)
        if t is None:
            raise ValueError(f"HF checkpoint is missing tensor {name!r} in {self._where()}")
        if t.shape != tuple(shape):
            raise ValueError(
                f"tensor {name!r} in {t.file} has shape {list(t.shape)}, expected "
                f"{list(shape)} from config.json"
            )
        ok = t.dtype in FLOAT_DTYPES if kind == "float" else t.dtype == "U8"
        if not ok:
            want = "a float dtype (F32/BF16/F16/F64)" if kind == "float" else "U8"
            raise ValueError(f"tensor {name!r} in {t.file} has dtype {t.dtype}, expected {want}")

    def _validate(self) -> None:
        d = self._dims
        for name, (_, spec) in _HF_TOP.items():
            self._check(name, _hf_shape(spec, d), "float")
        for n in range(self._model_config["num_layers"]):
            for suffix, (_, spec) in _HF_LAYER.items():
                name = _layer_name(n, suffix)
                if suffix in _MX_PROJ and name not in self._tensors:
                    blocks, scales = name + "_blocks", name + "_scales"
                    if blocks in self._tensors or scales in self._tensors:
                        dense = _hf_shape(spec, d)  # [E, in, out]
                        e, i, o = dense
                        if i % 32:
                            raise ValueError(
                                f"tensor {blocks!r}: MXFP4 needs the input size {i} "
                                "to be a multiple of 32"
                            )
                        self._check(blocks, (e, o, i // 32, 16), "u8")
                        self._check(scales, (e, o, i // 32), "u8")
                        self._mx_layers.add(n)
                        continue
                    raise ValueError(
                        f"HF checkpoint is missing tensor {name!r} (or its MXFP4 form "
                        f"{blocks!r} + {scales!r}) in {self._where()}"
                    )
                self._check(name, _hf_shape(spec, d), "float")

    # -- public API --------------------------------------------------------------
    @property
    def model_config(self) -> dict[str, Any]:
        return dict(self._model_config)

    @property
    def is_mxfp4(self) -> bool:
        """Whether any layer stores its experts in MXFP4."""
        return bool(self._mx_layers)

    def param_paths(self) -> list[str]:
        return list(self._shapes)

    def param_shape(self, path: str) -> tuple[int, ...]:
        if path not in self._shapes:
            raise KeyError(f"unknown parameter path {path!r}")
        return self._shapes[path]

    def read(self, path: str, layers: slice | None = None) -> np.ndarray:
        """Our float32 array for `path`; for block parameters only the stacked blocks in
        `layers` (a slice over the leading L2 axis; None = all). Reads only those tensors."""
        kind, leaf = _split_path(path)
        if kind is None:
            if layers is not None:
                raise ValueError(f"{path} has no layer axis; pass layers=None")
            name = _TOP_TO_HF[path]
            w = self._tensor(name)
            if path == "unembed/kernel":
                w = w.T
            return np.ascontiguousarray(w, dtype=np.float32)
        l2 = self._dims["L2"]
        idx = range(l2)[layers if layers is not None else slice(None)]
        shape = self._shapes[path]
        out = np.empty((len(idx), *shape[1:]), np.float32)
        j = KINDS.index(kind)
        for k, i in enumerate(idx):
            out[k] = self._read_layer_leaf(2 * i + j, leaf)
        return out

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> "HFCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------
    def _read_layer_leaf(self, n: int, leaf: str) -> np.ndarray:
        suffix, j = _LEAF_TO_HF[leaf]
        if suffix in _MX_PROJ and n in self._mx_layers:
            name = _layer_name(n, suffix)
            blocks = self._tensor(name + "_blocks")
            scales = self._tensor(name + "_scales")
            if suffix == "mlp.experts.gate_up_proj":
                # Output rows are interleaved gate/up: dequantize only the half we need.
                blocks, scales = blocks[:, j::2], scales[:, j::2]
            return dequantize_mxfp4(blocks, scales)
        w = self._tensor(_layer_name(n, suffix))
        return _hf_to_ours(suffix, w, self._dims)[j]

    def _tensor(self, name: str) -> np.ndarray:
        t = self._tensors[name]
        h = self._handles.get(t.file)
        if h is None:
            from safetensors import safe_open  # local: keep module import cheap

            h = self._handles[t.file] = safe_open(t.file, framework="numpy")
        try:
            return h.get_tensor(name)
        except TypeError:
            # A numpy without a registered bfloat16 name: read the raw bytes instead.
            _, start = read_header(t.file)
            dt = ST_DTYPES[t.dtype]
            return np.fromfile(
                t.file, dtype=dt, count=math.prod(t.shape), offset=start + t.begin
            ).reshape(t.shape)


def load_params(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model_config, nested dict of float32 arrays) for a whole (small) checkpoint."""
    ckpt = HFCheckpoint(path)
    tree: dict[str, Any] = {}
    for p in ckpt.param_paths():
        _set(tree, p, ckpt.read(p))
    ckpt.close()
    return ckpt.model_config, tree


def _set(tree: dict, path: str, value: Any) -> None:
    *head, last = path.split("/")
    for k in head:
        tree = tree.setdefault(k, {})
    tree[last] = value


def _get_tree(tree: Mapping, path: str) -> Any:
    for k in path.split("/"):
        tree = tree[k]
    return tree


# --------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------


def _is_checkpoint_dir(p: str) -> bool:
    return any(os.path.exists(os.path.join(p, f)) for f in ("config.json", SINGLE_FILE, INDEX_FILE))


def _check_out_dir(out_dir: str) -> None:
    if os.path.lexists(out_dir):
        if not os.path.isdir(out_dir):
            raise FileExistsError(f"{out_dir} exists and is not a directory")
        if os.listdir(out_dir):
            what = "already holds a checkpoint" if _is_checkpoint_dir(out_dir) else "is not empty"
            raise FileExistsError(f"{out_dir} {what}; refusing to overwrite it")


def save_hf(
    out_dir: str | os.PathLike,
    model_config: Mapping[str, Any],
    get_param: Callable[[str, slice | None], Any] | Mapping[str, Any],
    dtype: str = "bfloat16",
    max_shard_bytes: float = 5e9,
    *,
    mxfp4: bool = False,
    with_tokenizer: bool = True,
) -> None:
    """Write a Hugging Face GPT-OSS checkpoint folder.

    get_param(path, layers) returns our array for `path` (layers is None for top-level
    parameters and slice(i, i+1) for block parameters: one stacked block at a time); a
    nested dict of arrays is accepted too. Tensors are written one at a time into
    model.safetensors, or into model-0000k-of-0000n.safetensors shards (each at most
    max_shard_bytes unless a single tensor is larger) plus model.safetensors.index.json;
    then config.json and generation_config.json. dtype: "bfloat16" or "float32".
    mxfp4=True stores the expert matrices as MXFP4 blocks/scales (as the published
    checkpoints do) and adds quantization_config to config.json. with_tokenizer: a model
    with the o200k_harmony vocabulary also gets its tokenizer files and chat template
    (:mod:`gpt_oss_train.io.hf_tokenizer`), so servers built on transformers load it alone.

    The folder is written under a temporary name next to out_dir and renamed at the end;
    an existing non-empty out_dir raises FileExistsError and is left untouched.
    """
    if dtype not in _SAVE_DTYPES:
        raise ValueError(f"save_hf: dtype must be one of {sorted(_SAVE_DTYPES)}, got {dtype!r}")
    out_dir = os.path.abspath(os.fspath(out_dir))
    m = dict(model_config)
    check_model_dict(m)
    hf_cfg = model_dict_to_hf_config(m, dtype=dtype)
    hf_config_to_model_dict(hf_cfg)  # validates the model config through the reader
    st, np_dt = _SAVE_DTYPES[dtype]
    d = _dims(m)
    shapes = param_shapes(m)
    if mxfp4 and (d["D"] % 32 or d["F"] % 32):
        raise ValueError(
            f"save_hf(mxfp4=True) needs hidden_size ({d['D']}) and "
            f"intermediate_size ({d['F']}) divisible by 32"
        )
    _check_out_dir(out_dir)

    if callable(get_param):
        getter = get_param
    else:
        tree = get_param

        def getter(path, layers):
            a = _get_tree(tree, path)
            return a if layers is None else a[layers]

    def fetch(path: str, layer: int | None) -> np.ndarray:
        want = shapes[path] if layer is None else shapes[path][1:]
        a = getter(path, None if layer is None else slice(layer, layer + 1))
        a = np.asarray(a)
        if layer is not None:
            if a.shape != (1, *want):
                raise ValueError(
                    f"get_param({path!r}, slice({layer}, {layer + 1})) returned shape "
                    f"{a.shape}, expected {(1, *want)}"
                )
            a = a[0]
        elif a.shape != want:
            raise ValueError(f"get_param({path!r}, None) returned shape {a.shape}, expected {want}")
        return a

    # Plan: (hf name, safetensors dtype, shape, producer).
    plan: list[tuple[str, str, tuple[int, ...], Callable[[], np.ndarray]]] = []

    def cast(a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(a.astype(np_dt, copy=False))

    plan.append(
        (
            "model.embed_tokens.weight",
            st,
            _hf_shape("V D", d),
            lambda: cast(fetch("embed/embedding", None)),
        )
    )
    for n in range(int(m["num_layers"])):
        i, kind = n // 2, KINDS[n % 2]
        for suffix, (leaves, spec) in _HF_LAYER.items():
            name = _layer_name(n, suffix)
            paths = [f"blocks/{kind}/{leaf}" for leaf in leaves]

            def combined(suffix=suffix, paths=paths, i=i):
                return _ours_to_hf(suffix, [fetch(p, i) for p in paths], d)

            def dense(combined=combined):
                return cast(combined())

            if mxfp4 and suffix in _MX_PROJ:
                e, ii, o = _hf_shape(spec, d)
                cache: dict[str, np.ndarray] = {}

                def quant(part, combined=combined, cache=cache):
                    if not cache:
                        w = combined()
                        cache["blocks"], cache["scales"] = quantize_mxfp4(w)
                    return cache.pop(part)

                plan.append(
                    (
                        name + "_blocks",
                        "U8",
                        (e, o, ii // 32, 16),
                        lambda quant=quant: quant("blocks"),
                    )
                )
                plan.append(
                    (name + "_scales", "U8", (e, o, ii // 32), lambda quant=quant: quant("scales"))
                )
            else:
                plan.append((name, st, _hf_shape(spec, d), dense))
    plan.append(
        ("model.norm.weight", st, _hf_shape("D", d), lambda: cast(fetch("final_norm/scale", None)))
    )
    plan.append(
        ("lm_head.weight", st, _hf_shape("V D", d), lambda: cast(fetch("unembed/kernel", None).T))
    )

    # Shard greedily in plan order (blocks before scales, so a pair stays adjacent).
    shards: list[list[int]] = [[]]
    size = 0
    total = 0
    for k, (_, sdt, shape, _) in enumerate(plan):
        nb = math.prod(shape) * ST_DTYPES[sdt].itemsize
        total += nb
        if shards[-1] and size + nb > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(k)
        size += nb
    nsh = len(shards)
    fnames = (
        [SINGLE_FILE]
        if nsh == 1
        else [f"model-{s + 1:05d}-of-{nsh:05d}.safetensors" for s in range(nsh)]
    )

    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
    try:
        weight_map: dict[str, str] = {}
        for fname, ks in zip(fnames, shards):
            producers = {plan[k][0]: plan[k][3] for k in ks}
            write_safetensors(
                os.path.join(tmp, fname),
                [plan[k][:3] for k in ks],
                lambda name, producers=producers: producers[name](),
            )
            for k in ks:
                weight_map[plan[k][0]] = fname
        if nsh > 1:
            with open(os.path.join(tmp, INDEX_FILE), "w") as f:
                json.dump(
                    {"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2
                )
        if mxfp4:
            hf_cfg["quantization_config"] = {
                "quant_method": "mxfp4",
                "modules_to_not_convert": [
                    "model.layers.*.self_attn",
                    "model.layers.*.mlp.router",
                    "model.embed_tokens",
                    "lm_head",
                ],
            }
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(hf_cfg, f, indent=2)
        with open(os.path.join(tmp, "generation_config.json"), "w") as f:
            json.dump(generation_config(m), f, indent=2)
        if with_tokenizer:
            from gpt_oss_train.io import hf_tokenizer  # imports openai-harmony: only here

            if int(m["vocab_size"]) >= hf_tokenizer.VOCAB_SIZE:  # ids fit the embedding
                hf_tokenizer.save_tokenizer(tmp, m["max_position_embeddings"])
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        _check_out_dir(out_dir)
        try:
            os.rename(tmp, out_dir)  # atomic; replaces an empty directory, fails on a full one
        except OSError as e:
            raise FileExistsError(f"cannot move the new checkpoint to {out_dir}: {e}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def load_sharded(path: str | os.PathLike, abstract_params: Any) -> Any:
    """The checkpoint's parameters as sharded jax.Arrays laid out like `abstract_params`
    (a nested dict of jax.ShapeDtypeStruct with shardings, e.g. ModelDef.abstract_params).

    Each device shard is filled by a callback that reads only the stacked blocks that
    shard covers, so a host holds one tensor (or one range of layers) at a time, never the
    whole model: a 120b MXFP4 checkpoint loads on hosts with far less RAM than 120b floats.
    """
    import jax

    ckpt = HFCheckpoint(path)
    out: dict[str, Any] = {}
    try:
        for p in ckpt.param_paths():
            target = abstract_params
            for k in p.split("/"):
                target = target[k]
            if tuple(target.shape) != tuple(ckpt.param_shape(p)):
                raise ValueError(
                    f"{path}: {p} has shape {ckpt.param_shape(p)} in the checkpoint "
                    f"but the model expects {tuple(target.shape)}"
                )
            _set(
                out,
                p,
                jax.make_array_from_callback(
                    tuple(target.shape), target.sharding, _shard_reader(ckpt, p, target.dtype)
                ),
            )
    finally:
        ckpt.close()
    return out


def _shard_reader(ckpt: HFCheckpoint, p: str, dtype: Any):
    """Callback for make_array_from_callback: index (a tuple of slices) -> numpy shard.
    Remembers the last read so devices sharing a layer range do not re-read it."""
    stacked = _split_path(p)[0] is not None
    last: dict[Any, np.ndarray] = {}

    def read(index):
        index = tuple(index)
        layers = index[0] if stacked and index else None
        key = (layers.start, layers.stop, layers.step) if layers is not None else None
        if key not in last:
            last.clear()
            last[key] = ckpt.read(p, layers) if stacked else ckpt.read(p)
        block = last[key]
        rest = index[1:] if stacked else index
        return np.asarray(block[(slice(None),) + rest if stacked else rest], dtype=dtype)

    return read
