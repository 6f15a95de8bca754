"""Hugging Face GPT-OSS checkpoints <-> our parameter tree.

Reads the safetensors folders that ``transformers`` writes for ``GptOssForCausalLM``
(dense experts) and the published ``openai/gpt-oss-*`` folders (MXFP4 experts), single
file or sharded with ``model.safetensors.index.json``; writes dense (optionally MXFP4)
folders that ``GptOssForCausalLM.from_pretrained`` loads. Everything here is numpy but
`load_sharded` (which fills jax.Arrays); nothing imports torch.

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
import threading
from typing import Any, Callable, Iterator, Mapping

import jax
import ml_dtypes  # noqa: F401  (also makes np.dtype("bfloat16") resolvable for safetensors)
import numpy as np
from safetensors import safe_open

from gpt_oss_train.arrays import mxfp4_array
from gpt_oss_train.arrays.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from gpt_oss_train.errors import UserError
from gpt_oss_train.io import hf_tokenizer
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
    map_file,
    read_header,
    read_part,
    write_safetensors,
)
from gpt_oss_train.model import parameters
from gpt_oss_train.model.parameters import KINDS, Param

__all__ = ["HFCheckpoint", "ReadCount", "param_shapes", "load_sharded", "save_hf"]

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


def _part(decl: Param, a: int, b: int) -> slice:
    """Where elements [a, b) of a parameter lie along its HF tensor's fused axis (every
    other one, from its part: gate 0, up 1), or along its own axis if not fused."""
    return slice(a, b) if decl.hf.part is None else slice(2 * a + decl.hf.part, 2 * b, 2)


def _block_runs(mid: tuple[int, int], per: int) -> list[tuple[int, int, bool]]:
    """The MXFP4 blocks under [mid) (in units `per` to a block) as runs (start, stop,
    edge): a block the range covers only in part (its neighbour has the rest) is a run of
    its own with edge True, the blocks it covers whole one run."""
    k0, k1 = mid[0] // per, -(-mid[1] // per)
    first, last = mid[0] % per != 0, mid[1] % per != 0
    if k1 - k0 == 1:
        return [(k0, k1, first or last)]
    a, b = k0 + first, k1 - last
    runs = [(k0, a, True)] if first else []
    runs += [(a, b, False)] if b > a else []
    return runs + ([(b, k1, True)] if last else [])


def _mxfp4_shapes(plan: HFTensorPlan) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of the MXFP4 blocks and scales of an [E, in, out] tensor: (out, in) order."""
    e, i, o = plan.shape
    return (e, o, i // 32, 16), (e, o, i // 32)


# --------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------


class HFCheckpointError(UserError):
    """A Hugging Face folder that cannot be read as gpt-oss; the message names the file."""


class ReadCount:
    """What loads read from checkpoint files: `read` bytes copied out of them, of `total`,
    the bytes of every tensor the models take from them. Readers add under a lock."""

    def __init__(self):
        self.read = 0
        self.total = 0
        self._lock = threading.Lock()

    def add(self, read: int = 0, total: int = 0) -> None:
        with self._lock:
            self.read += read
            self.total += total


class HFCheckpoint:
    """A Hugging Face GPT-OSS checkpoint folder, read lazily one tensor at a time.

    Construction reads config.json and every safetensors header and checks that each
    tensor our tree needs is present with the right shape and dtype class; errors name the
    tensor and the file. ``read(path, layers)`` returns our float32 layout for a range of
    stacked blocks only; ``read_box(path, box)`` any box of our layout (a device's shard),
    reading only the bytes under it and adding them to `count` (a ReadCount, whose total
    grows by the bytes of the tensors the model takes from this folder).
    """

    def __init__(self, path: str | os.PathLike, count: ReadCount | None = None):
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
        self._mapped: dict[str, np.ndarray] = {}
        self._mx_layers: set[int] = set()
        self._used: list[str] = []  # the tensors the model takes
        self._validate()
        self.count = ReadCount() if count is None else count
        self.count.add(total=sum(self._tensors[n].end - self._tensors[n].begin for n in self._used))

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

    def _check(self, name: str, shape: tuple[int, ...], *, kind: str) -> None:
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
                self._check(blocks, blocks_shape, kind="u8")
                self._check(scales, scales_shape, kind="u8")
                self._mx_layers.add(plan.layer)
                self._used += [blocks, scales]
            elif plan.mxfp4 and plan.name not in self._tensors:
                raise HFCheckpointError(
                    f"HF checkpoint is missing tensor {plan.name!r} (or its MXFP4 form "
                    f"{blocks!r} + {scales!r}) in {self._where()}"
                )
            else:
                self._check(plan.name, plan.shape, kind="float")
                self._used.append(plan.name)

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
        self._mapped.clear()

    def __enter__(self) -> "HFCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def read_box(self, path: str, box, part: int | None = None, shared=None) -> np.ndarray:
        """Our array for `path` restricted to `box` (a (start, stop) per axis of our shape,
        the stacked blocks first): float32, or with part 0 / 1 the MXFP4 blocks / scales
        of an expert weight (arrays/mxfp4_array.py's layout, [..., in/8 | in/32, out];
        quantized here when the folder stores it dense). Reads only the bytes under the
        box (MXFP4: its whole 32-input blocks). `shared`, a dict the reads of one weight
        share (its blocks' and scales'), keeps the MXFP4 blocks two shards split and the
        scales quantized with the blocks, so that no bytes are read twice.
        """
        decl, stacked = parameters.lookup(path)
        shared = {} if shared is None else shared
        if not stacked:
            return self._layer_box(None, decl, tuple(box), part, shared)
        (b0, b1), rest, j = box[0], tuple(box[1:]), KINDS.index(path.split("/")[1])
        out = None
        for k, i in enumerate(range(b0, b1)):
            piece = self._layer_box(2 * i + j, decl, rest, part, shared)
            if out is None:
                out = np.empty((b1 - b0, *piece.shape), piece.dtype)
            out[k] = piece
        return out

    # -- internals -----------------------------------------------------------------
    def _layer_box(self, n: int | None, decl: Param, box: tuple, part, shared) -> np.ndarray:
        """`read_box` for one HF layer n (None: a top-level tensor)."""
        name = decl.hf.name if n is None else f"model.layers.{n}.{decl.hf.name}"
        if part is None and not (decl.hf.mxfp4 and n in self._mx_layers):
            return self._dense_box(name, decl, box)
        # An expert weight [E, in, out]: our axes are the HF dense tensor's.
        if decl.dims != decl.hf.dims:
            raise AssertionError(f"internal: {name} is MXFP4 but not in its HF order")
        e, mid, o = box
        # The 32-input blocks under the box; `mid` counts inputs, words of 8, or blocks.
        per = {None: mxfp4_array.BLOCK, 0: mxfp4_array.BLOCK // mxfp4_array.WORD, 1: 1}[part]
        runs = [
            self._mx_blocks(n, decl, e, o, a, b, part, shared, edge)
            for a, b, edge in _block_runs(mid, per)
        ]
        blocks, scales = (None if x[0] is None else np.concatenate(x, axis=2) for x in zip(*runs))
        skip = mid[0] % per
        if part is None:  # float32 [E, in, out]
            return dequantize_mxfp4(blocks, scales)[:, skip : skip + mid[1] - mid[0]]
        if part == 0:  # the words [E, in/8, out] (from_file's scales argument is unused here)
            words = mxfp4_array.from_file(blocks, blocks[..., 0])[0]
            return words[:, skip : skip + mid[1] - mid[0]]
        return scales.swapaxes(-1, -2)

    def _mx_blocks(self, n: int, decl: Param, e, o, k0, k1, part, shared, edge: bool):
        """The file's (blocks, scales) of an expert weight's 32-input blocks [k0, k1), for
        experts [e) and outputs [o) (None for the one `part` 0 / 1 does not need): read,
        or quantized from the dense tensor. A block a neighbouring shard shares (`edge`) is
        kept in `shared` for it, as are quantized scales (per block) for the scales' reads."""
        key = (n, e, o, k0, k1, part)
        if key in shared:
            return shared[key]
        quantized = [(n, e, o, k, "scales") for k in range(k0, k1)]
        if part == 1 and all(q in shared for q in quantized):
            return None, np.concatenate([shared.pop(q) for q in quantized], axis=2)
        name = f"model.layers.{n}.{decl.hf.name}"
        if n in self._mx_layers:
            index = (slice(*e), _part(decl, *o), slice(k0, k1))
            blocks = self._read(name + "_blocks", index) if part != 1 else None
            scales = self._read(name + "_scales", index) if part != 0 else None
        else:  # a dense folder: quantized from the dense bytes of these blocks
            inputs = (k0 * mxfp4_array.BLOCK, k1 * mxfp4_array.BLOCK)
            blocks, scales = quantize_mxfp4(self._dense_box(name, decl, (e, inputs, o)))
            if part == 0:
                shared.update((q, scales[:, :, i : i + 1]) for i, q in enumerate(quantized))
        if edge:
            shared[key] = (blocks, scales)
        return blocks, scales

    def _dense_box(self, name: str, decl: Param, box: tuple) -> np.ndarray:
        """Our float32 layout of one HF tensor (a part of a fused one) within `box`. An
        axis of merged HF letters ("NH") is read for its first letter's range, the others
        whole (a box that splits head_dim reads its heads' whole rows)."""
        ours, have = decl.dims.split(), dict(zip(decl.dims.split(), box))
        index, sizes, rest = [], [], []
        for group in decl.hf.dims.split():
            (a, b), inner = have[group[0]], group[1:]
            size = math.prod(self._sizes[c] for c in inner)
            if decl.hf.part is not None and "F" in group:  # fused: every other element
                index.append(_part(decl, a, b))
            else:
                index.append(slice(a * size, b * size))
            sizes += [b - a, *(self._sizes[c] for c in inner)]
            rest += [slice(None), *(slice(*have[c]) for c in inner)]
        w = self._read(name, tuple(index)).reshape(sizes)[tuple(rest)]
        flat = [c for group in decl.hf.dims.split() for c in group]
        return np.transpose(w, [flat.index(c) for c in ours]).astype(np.float32, copy=False)

    def _read(self, name: str, index: tuple) -> np.ndarray:
        """A box of a stored tensor, copied from its file; its bytes are counted."""
        t = self._tensors[name]
        if t.file not in self._mapped:
            self._mapped[t.file] = map_file(t.file)
        a = read_part(self._mapped[t.file], t, index)
        self.count.add(read=a.nbytes)
        return a

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


def load_sharded(
    path: str | os.PathLike, abstract_params: Any, count: ReadCount | None = None
) -> Any:
    """The checkpoint's parameters as sharded jax.Arrays laid out like `abstract_params`
    (a nested dict of jax.ShapeDtypeStruct with shardings, e.g. ModelDef.abstract_params).

    Each of this process's device shards is filled by a callback that reads only the bytes
    under that shard (`HFCheckpoint.read_box`), once however many of its devices hold it:
    on N hosts each reads about 1/N of the model (plus what they all replicate), and a
    host never holds more of it than its devices do. What it read is added to `count`.
    """
    ckpt = HFCheckpoint(path, count)
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
                shared: dict = {}
                value = type(target)(
                    *(
                        jax.make_array_from_callback(
                            a.shape, a.sharding, _shard_reader(ckpt, p, a, part, shared)
                        )
                        for part, a in enumerate((target.blocks, target.scales))
                    )
                )
            else:
                value = jax.make_array_from_callback(
                    tuple(target.shape), target.sharding, _shard_reader(ckpt, p, target)
                )
            _set(out, p, value)
    finally:
        ckpt.close()
    return out


def _shard_reader(ckpt: HFCheckpoint, p: str, target, part=None, shared=None):
    """Callback for make_array_from_callback: index (a tuple of slices) -> numpy shard of
    `target` (its shape and dtype). Devices asking for the same index (replicas) get the
    one read (JAX holds every device's value until the array is made: no extra memory).
    part: 0 blocks, 1 scales of an MXFP4 weight; `shared` (read_box's) is the weight's."""
    shape, dtype, done = tuple(target.shape), target.dtype, {}
    shared = {} if shared is None else shared

    def read(index):
        box = tuple(s.indices(n)[:2] for s, n in zip(tuple(index), shape))
        box += tuple((0, n) for n in shape[len(box) :])
        if box not in done:
            done[box] = np.asarray(ckpt.read_box(p, box, part, shared), dtype=dtype)
        return done[box]

    return read
