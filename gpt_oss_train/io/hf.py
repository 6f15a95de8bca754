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
parameter carries a leading ``L2 = num_layers // 2`` axis. Which HF tensor holds which of
our parameters, and in what layout, is declared once in :mod:`gpt_oss_train.model.parameters`.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from typing import Any, Callable, Iterator, Mapping

import ml_dtypes  # noqa: F401  (also makes np.dtype("bfloat16") resolvable for safetensors)
import numpy as np

from gpt_oss_train.arrays import mxfp4_array
from gpt_oss_train.arrays.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from gpt_oss_train.errors import UserError
from gpt_oss_train.io import tokenizer as tok_lib
from gpt_oss_train.io.hf_config import (
    generation_config,
    hf_config_to_model_dict,
    model_dict_to_hf_config,
)
from gpt_oss_train.io.safetensors_io import (
    FLOAT_DTYPES,
    ST_DTYPES,
    TensorInfo,
    read_header,
    write_safetensors,
)
from gpt_oss_train.model import parameters
from gpt_oss_train.model.parameters import KINDS, Param

__all__ = ["HFCheckpoint", "param_shapes", "load_sharded", "save_hf"]

_SAVE_DTYPES = {
    "float32": ("F32", np.dtype("<f4")),
    "bfloat16": ("BF16", np.dtype(ml_dtypes.bfloat16)),
}

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


# --------------------------------------------------------------------------
# Which HF tensors a model has (derived from model/parameters.py)
# --------------------------------------------------------------------------


def param_shapes(m: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every path of our parameter tree -> its shape, in a fixed order."""
    return {path: shape for path, _, shape, _ in parameters.leaves(m)}


class HFTensorPlan:
    """One HF tensor: its name, dense shape, and our parameters (tree paths) stored in it
    (two for a fused tensor), with `layer` the HF layer for per-layer tensors."""

    def __init__(self, name: str, decls: list[Param], paths: list[str], layer: int | None, sizes):
        self.name, self.decls, self.paths, self.layer = name, decls, paths, layer
        shape = parameters.shape(decls[0].hf.dims, sizes)
        self.shape = (*shape[:-1], shape[-1] * len(decls))
        self.mxfp4 = decls[0].hf.mxfp4

    @property
    def block(self) -> int | None:
        """The index along our stacked [num_layers / 2] axis (None: a top-level tensor)."""
        return None if self.layer is None else self.layer // 2


def hf_tensors(m: Mapping[str, Any]) -> Iterator[HFTensorPlan]:
    """Every dense HF tensor of a model, in file order (embedding, layers 0..L-1, final
    norm, lm_head)."""
    sizes = parameters.dim_sizes(m)
    top = parameters.TOP
    yield HFTensorPlan(
        top["embed/embedding"].hf.name, [top["embed/embedding"]], ["embed/embedding"], None, sizes
    )
    layer_tensors = parameters.hf_layer_tensors()
    for n in range(int(m["num_layers"])):
        kind = KINDS[n % 2]
        for suffix, leaves in layer_tensors.items():
            decls = [parameters.LAYER[leaf] for leaf in leaves]
            paths = [f"blocks/{kind}/{leaf}" for leaf in leaves]
            yield HFTensorPlan(f"model.layers.{n}.{suffix}", decls, paths, n, sizes)
    for path in ("final_norm/scale", "unembed/kernel"):
        yield HFTensorPlan(top[path].hf.name, [top[path]], [path], None, sizes)


def _mxfp4_shapes(plan: HFTensorPlan) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of the MXFP4 blocks and scales of an [E, in, out] tensor: (out, in) order."""
    e, i, o = plan.shape
    return (e, o, i // 32, 16), (e, o, i // 32)


# --------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------


class HFCheckpointError(UserError):
    """A Hugging Face folder that cannot be read as gpt-oss; the message names the file."""


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
            raise HFCheckpointError(f"{cfg_path} is not valid JSON ({e})") from None
        try:
            self._model_config = hf_config_to_model_dict(self.hf_config)
        except ValueError as e:
            raise HFCheckpointError(f"{cfg_path}: {e}") from None
        self._sizes = parameters.dim_sizes(self._model_config)
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
                raise HFCheckpointError(
                    f"{idx_path} is not a valid safetensors index ({e!r})"
                ) from None
            headers: dict[str, dict[str, TensorInfo]] = {}
            for fname in sorted(set(wmap.values())):
                fpath = os.path.join(self.path, fname)
                if not os.path.isfile(fpath):
                    raise FileNotFoundError(f"{idx_path} lists {fname}, which does not exist")
                headers[fname] = read_header(fpath)[0]
            for name, fname in wmap.items():
                if name not in headers[fname]:
                    raise HFCheckpointError(
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
                    raise HFCheckpointError(
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
            raise HFCheckpointError(f"HF checkpoint is missing tensor {name!r} in {self._where()}")
        if t.shape != tuple(shape):
            raise HFCheckpointError(
                f"tensor {name!r} in {t.file} has shape {list(t.shape)}, expected "
                f"{list(shape)} from config.json"
            )
        ok = t.dtype in FLOAT_DTYPES if kind == "float" else t.dtype == "U8"
        if not ok:
            want = "a float dtype (F32/BF16/F16/F64)" if kind == "float" else "U8"
            raise HFCheckpointError(
                f"tensor {name!r} in {t.file} has dtype {t.dtype}, expected {want}"
            )

    def _validate(self) -> None:
        for plan in hf_tensors(self._model_config):
            blocks, scales = plan.name + "_blocks", plan.name + "_scales"
            stored_mxfp4 = blocks in self._tensors or scales in self._tensors
            if plan.mxfp4 and plan.name not in self._tensors and stored_mxfp4:
                if plan.shape[1] % 32:
                    raise HFCheckpointError(
                        f"tensor {blocks!r}: MXFP4 needs the input size {plan.shape[1]} "
                        "to be a multiple of 32"
                    )
                blocks_shape, scales_shape = _mxfp4_shapes(plan)
                self._check(blocks, blocks_shape, "u8")
                self._check(scales, scales_shape, "u8")
                self._mx_layers.add(plan.layer)
            elif plan.mxfp4 and plan.name not in self._tensors:
                raise HFCheckpointError(
                    f"HF checkpoint is missing tensor {plan.name!r} (or its MXFP4 form "
                    f"{blocks!r} + {scales!r}) in {self._where()}"
                )
            else:
                self._check(plan.name, plan.shape, "float")

    # -- public API --------------------------------------------------------------
    @property
    def model_config(self) -> dict[str, Any]:
        return dict(self._model_config)

    def param_paths(self) -> list[str]:
        return list(self._shapes)

    def param_shape(self, path: str) -> tuple[int, ...]:
        if path not in self._shapes:
            raise KeyError(f"unknown parameter path {path!r}")
        return self._shapes[path]

    def read(self, path: str, layers: slice | None = None) -> np.ndarray:
        """Our float32 array for `path`; for block parameters only the stacked blocks in
        `layers` (a slice over the leading L2 axis; None = all). Reads only those tensors."""
        decl, stacked = parameters.lookup(path)
        if not stacked:
            if layers is not None:
                raise ValueError(f"{path} has no layer axis; pass layers=None")
            w = parameters.from_hf(decl, self._tensor(decl.hf.name), self._sizes)
            return np.ascontiguousarray(w, dtype=np.float32)
        idx = range(self._shapes[path][0])[layers if layers is not None else slice(None)]
        out = np.empty((len(idx), *self._shapes[path][1:]), np.float32)
        j = KINDS.index(path.split("/")[1])
        for k, i in enumerate(idx):
            out[k] = self._read_layer(2 * i + j, decl)
        return out

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> "HFCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------
    def read_mxfp4(self, path: str, layers: slice | None = None) -> tuple[np.ndarray, np.ndarray]:
        """An expert weight's MXFP4 blocks uint8 [k, E, out, in/32, 16] and scales [k, E,
        out, in/32] (our part of a fused tensor) for the stacked blocks in `layers`: the
        stored bytes when the checkpoint is MXFP4, else quantized from its dense values."""
        decl, stacked = parameters.lookup(path)
        if not (stacked and decl.hf.mxfp4):
            raise ValueError(f"{path} is not stored as MXFP4")
        idx = range(self._shapes[path][0])[layers if layers is not None else slice(None)]
        j = KINDS.index(path.split("/")[1])
        pairs = [
            self._layer_mxfp4(2 * i + j, decl)
            if 2 * i + j in self._mx_layers
            else quantize_mxfp4(self._read_layer(2 * i + j, decl))
            for i in idx
        ]
        return np.stack([b for b, _ in pairs]), np.stack([s for _, s in pairs])

    def _layer_mxfp4(self, n: int, decl: Param) -> tuple[np.ndarray, np.ndarray]:
        name = f"model.layers.{n}.{decl.hf.name}"
        blocks, scales = self._tensor(name + "_blocks"), self._tensor(name + "_scales")
        if decl.hf.part is not None:
            # Output rows of a fused tensor are interleaved: keep only our part.
            blocks, scales = blocks[:, decl.hf.part :: 2], scales[:, decl.hf.part :: 2]
        return blocks, scales

    def _read_layer(self, n: int, decl: Param) -> np.ndarray:
        name = f"model.layers.{n}.{decl.hf.name}"
        if decl.hf.mxfp4 and n in self._mx_layers:
            w = dequantize_mxfp4(*self._layer_mxfp4(n, decl))
        else:
            w = parameters.split(decl, self._tensor(name))
        return parameters.from_hf(decl, w, self._sizes)

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
    hf_cfg = model_dict_to_hf_config(m, dtype=dtype)
    hf_config_to_model_dict(hf_cfg)  # validates the model config through the reader
    sizes = parameters.dim_sizes(m)
    if mxfp4 and (sizes["D"] % 32 or sizes["F"] % 32):
        raise ValueError(
            f"save_hf(mxfp4=True) needs hidden_size ({sizes['D']}) and "
            f"intermediate_size ({sizes['F']}) divisible by 32"
        )
    _check_out_dir(out_dir)
    plan = _write_plan(m, _param_fetcher(m, get_param), _SAVE_DTYPES[dtype], mxfp4)
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
    tokenizer = None
    if with_tokenizer and int(m["vocab_size"]) >= tok_lib.VOCAB_SIZE:  # ids fit the embedding
        from gpt_oss_train.io import hf_tokenizer  # builds the BPE tables: only here

        tokenizer = lambda folder: hf_tokenizer.save_tokenizer(folder, m["max_position_embeddings"])
    _write_folder(out_dir, plan, max_shard_bytes, hf_cfg, generation_config(m), tokenizer)


def _param_fetcher(m: Mapping[str, Any], get_param) -> Callable[[str, int | None], np.ndarray]:
    """fetch(path, block) -> our numpy array for one parameter (one block of a stacked
    one), checked against the declared shape."""
    shapes = param_shapes(m)
    if callable(get_param):
        getter = get_param
    else:

        def getter(path, layers):
            a = get_param
            for k in path.split("/"):
                a = a[k]
            return a if layers is None else a[layers]

    def fetch(path: str, block: int | None) -> np.ndarray:
        want = shapes[path] if block is None else (1, *shapes[path][1:])
        a = np.asarray(getter(path, None if block is None else slice(block, block + 1)))
        if a.shape != want:
            asked = "None" if block is None else f"slice({block}, {block + 1})"
            raise ValueError(
                f"get_param({path!r}, {asked}) returned shape {a.shape}, expected {want}"
            )
        return a if block is None else a[0]

    return fetch


def _write_plan(m, fetch, save_dtype, mxfp4: bool) -> list[tuple[str, str, tuple, Callable]]:
    """(HF name, safetensors dtype, shape, producer) for every tensor to write, in file
    order; MXFP4 tensors become a blocks + scales pair quantized once."""
    st, np_dt = save_dtype
    out = []
    for plan in hf_tensors(m):

        def dense(plan=plan):
            parts = [
                parameters.to_hf(d, fetch(p, plan.block)) for d, p in zip(plan.decls, plan.paths)
            ]
            return parameters.fuse(parts)

        if not (mxfp4 and plan.mxfp4):
            out.append(
                (
                    plan.name,
                    st,
                    plan.shape,
                    lambda dense=dense: np.ascontiguousarray(dense().astype(np_dt, copy=False)),
                )
            )
            continue
        cache: dict[str, np.ndarray] = {}

        def quantized(part, dense=dense, cache=cache):
            if not cache:
                cache["blocks"], cache["scales"] = quantize_mxfp4(dense())
            return cache.pop(part)

        blocks_shape, scales_shape = _mxfp4_shapes(plan)
        out.append((plan.name + "_blocks", "U8", blocks_shape, lambda q=quantized: q("blocks")))
        out.append((plan.name + "_scales", "U8", scales_shape, lambda q=quantized: q("scales")))
    return out


def _shards(plan, max_shard_bytes: float) -> tuple[list[list[int]], int]:
    """Greedy sharding in plan order (blocks before scales, so a pair stays adjacent):
    (indices per shard, total bytes)."""
    shards: list[list[int]] = [[]]
    size = total = 0
    for k, (_, sdt, shape, _) in enumerate(plan):
        nb = math.prod(shape) * ST_DTYPES[sdt].itemsize
        total += nb
        if shards[-1] and size + nb > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(k)
        size += nb
    return shards, total


def _write_folder(out_dir: str, plan, max_shard_bytes, hf_cfg: dict, gen_cfg: dict, tokenizer):
    """Writes the tensors, index, configs and (tokenizer(folder), if given) the tokenizer
    into a temporary folder beside out_dir, then renames it into place (nothing
    half-written is ever at out_dir)."""
    shards, total = _shards(plan, max_shard_bytes)
    n = len(shards)
    fnames = (
        [SINGLE_FILE] if n == 1 else [f"model-{s + 1:05d}-of-{n:05d}.safetensors" for s in range(n)]
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
            weight_map.update({plan[k][0]: fname for k in ks})
        if n > 1:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            with open(os.path.join(tmp, INDEX_FILE), "w") as f:
                json.dump(index, f, indent=2)
        for name, content in (("config.json", hf_cfg), ("generation_config.json", gen_cfg)):
            with open(os.path.join(tmp, name), "w") as f:
                json.dump(content, f, indent=2)
        if tokenizer is not None:
            tokenizer(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        _check_out_dir(out_dir)
        try:
            os.rename(tmp, out_dir)  # atomic; replaces an empty directory, fails on a full one
        except OSError as e:
            raise FileExistsError(f"cannot move the new checkpoint to {out_dir}: {e}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _set(tree: dict, path: str, value: Any) -> None:
    *head, last = path.split("/")
    for k in head:
        tree = tree.setdefault(k, {})
    tree[last] = value


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
                raise HFCheckpointError(
                    f"{path}: {p} has shape {ckpt.param_shape(p)} in the checkpoint "
                    f"but the model expects {tuple(target.shape)}"
                )
            if hasattr(target, "blocks"):  # an MXFP4Array: the experts stay packed
                cache: dict = {}
                value = type(target)(
                    *(
                        jax.make_array_from_callback(
                            a.shape, a.sharding, _shard_reader(ckpt, p, a.dtype, part, cache)
                        )
                        for part, a in enumerate((target.blocks, target.scales))
                    )
                )
            else:
                value = jax.make_array_from_callback(
                    tuple(target.shape), target.sharding, _shard_reader(ckpt, p, target.dtype)
                )
            _set(out, p, value)
    finally:
        ckpt.close()
    return out


def _shard_reader(ckpt: HFCheckpoint, p: str, dtype: Any, part=None, last=None):
    """Callback for make_array_from_callback: index (a tuple of slices) -> numpy shard.
    Remembers the last read (in `last`, which an MXFP4 weight's blocks and scales share)
    so devices sharing a layer range do not re-read it. part: 0 blocks, 1 scales."""
    stacked = parameters.lookup(p)[1]
    last = {} if last is None else last

    def read(index):
        index = tuple(index)
        layers = index[0] if stacked and index else None
        key = (layers.start, layers.stop, layers.step) if layers is not None else None
        if key not in last:
            last.clear()
            if part is not None:
                last[key] = ckpt.read_mxfp4(p, layers)
            else:
                last[key] = ckpt.read(p, layers) if stacked else ckpt.read(p)
        block = last[key] if part is None else mxfp4_array.from_file(*last[key])[part]
        rest = index[1:] if stacked else index
        return np.asarray(block[(slice(None),) + rest if stacked else rest], dtype=dtype)

    return read
