"""Every parameter of the network, declared once.

Each entry says, for one parameter: its shape (in the architecture's dimension letters),
its logical axes (mapped to the mesh by config rules), its initializer, whether AdamW
decays it, the axes a matmul contracts it over (int8 quantization keeps one scale per
remaining index; none: not quantized), and the Hugging Face tensor it is stored as.
The model (transformer.py) creates its parameters from this table; the HF reader and
writer, quantization, the optimizer's decay mask and parameter counts derive from it.

Dimension letters: V vocab, D hidden, N query heads, K KV heads, H head dim, E experts,
F expert hidden. In an HF layout, letters written together ("NH") are one merged axis.

The tree: top-level parameters at their path ("embed/embedding"); the parameters of one
layer under "blocks/sliding/..." (even layers) and "blocks/full/..." (odd layers), each
stacked on a leading axis of num_layers / 2 (logical axis `layers`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterator, Mapping

import numpy as np

from gpt_oss_train.architecture import LORA_TARGETS

KINDS = ("sliding", "full")  # block i of KINDS[j] is HF layer 2i + j


@dataclasses.dataclass(frozen=True)
class HFTensor:
    name: str  # top level: the whole name; per layer: what follows "model.layers.<n>."
    dims: str  # its shape in dimension letters, e.g. "NH D" for our "D N H" transposed
    # Fused HF tensors (gate_up_proj) interleave two of our parameters along the last
    # axis: part j of them is columns j, j + 2, j + 4, ...
    part: int | None = None
    mxfp4: bool = False  # published checkpoints store it as MXFP4 blocks + scales


@dataclasses.dataclass(frozen=True)
class Param:
    dims: str
    axes: tuple[str | None, ...]
    init: str  # "normal" (std = initializer_range), "zeros" or "ones"
    hf: HFTensor
    decay: bool = True
    contract: tuple[int, ...] = ()


def _norm(hf_name: str) -> Param:
    return Param("D", (None,), "ones", HFTensor(hf_name, "D"), decay=False)


def _bias(dims: str, axes, hf: HFTensor) -> Param:
    return Param(dims, axes, "zeros", hf, decay=False)


def _matrix(dims: str, axes, hf: HFTensor, contract=()) -> Param:
    return Param(dims, axes, "normal", hf, contract=contract)


_Q, _KV = ("embed", "heads", "head_dim"), ("embed", "kv_heads", "head_dim")
_EXPERT_IN = ("exp", "embed", "mlp")  # [E, D, F]
_GATE_UP = "mlp.experts.gate_up_proj"

TOP: dict[str, Param] = {
    "embed/embedding": _matrix(
        "V D", ("vocab", "embed"), HFTensor("model.embed_tokens.weight", "V D")
    ),
    "final_norm/scale": _norm("model.norm.weight"),
    "unembed/kernel": _matrix("D V", ("embed", "vocab"), HFTensor("lm_head.weight", "V D"), (0,)),
}

LAYER: dict[str, Param] = {
    "attn_norm/scale": _norm("input_layernorm.weight"),
    "attn/q_kernel": _matrix("D N H", _Q, HFTensor("self_attn.q_proj.weight", "NH D"), (0,)),
    "attn/q_bias": _bias("N H", _Q[1:], HFTensor("self_attn.q_proj.bias", "NH")),
    "attn/k_kernel": _matrix("D K H", _KV, HFTensor("self_attn.k_proj.weight", "KH D"), (0,)),
    "attn/k_bias": _bias("K H", _KV[1:], HFTensor("self_attn.k_proj.bias", "KH")),
    "attn/v_kernel": _matrix("D K H", _KV, HFTensor("self_attn.v_proj.weight", "KH D"), (0,)),
    "attn/v_bias": _bias("K H", _KV[1:], HFTensor("self_attn.v_proj.bias", "KH")),
    "attn/o_kernel": _matrix(
        "N H D", ("heads", "head_dim", "embed"), HFTensor("self_attn.o_proj.weight", "D NH"), (0, 1)
    ),
    "attn/o_bias": _bias("D", ("embed",), HFTensor("self_attn.o_proj.bias", "D")),
    # One learned logit per query head that joins the softmax denominator only.
    "attn/sinks": Param("N", ("heads",), "normal", HFTensor("self_attn.sinks", "N"), decay=False),
    "mlp_norm/scale": _norm("post_attention_layernorm.weight"),
    # The router stays unquantized: its top-k must pick the float model's experts.
    "moe/router_kernel": _matrix("D E", ("embed", None), HFTensor("mlp.router.weight", "E D")),
    "moe/router_bias": Param("E", (None,), "normal", HFTensor("mlp.router.bias", "E"), decay=False),
    "moe/wi_gate": _matrix("E D F", _EXPERT_IN, HFTensor(_GATE_UP, "E D F", 0, True), (1,)),
    "moe/bi_gate": _bias("E F", ("exp", "mlp"), HFTensor(_GATE_UP + "_bias", "E F", 0)),
    "moe/wi_up": _matrix("E D F", _EXPERT_IN, HFTensor(_GATE_UP, "E D F", 1, True), (1,)),
    "moe/bi_up": _bias("E F", ("exp", "mlp"), HFTensor(_GATE_UP + "_bias", "E F", 1)),
    "moe/wo": _matrix(
        "E F D",
        ("exp", "mlp", "embed"),
        HFTensor("mlp.experts.down_proj", "E F D", None, True),
        (1,),
    ),
    "moe/bo": _bias("E D", ("exp", "embed"), HFTensor("mlp.experts.down_proj_bias", "E D")),
}


# ------------------------------------------------------------------------- LoRA
#
# A LoRA target adapts a weight W (or both parts of a fused HF tensor) to
# W + (alpha / R) A B, with A [batch.., in.., R] and B [batch.., R, out..]: "in" are the
# letters the input contracts with, "batch" the experts' E (each expert its own pair),
# "out" the rest. The pair's declarations derive from W's: letters, logical axes (R is
# unsharded, so expert LoRA shards over `exp` like the experts), and the tensors PEFT
# saves: `<module>.lora_A.weight` [R, in] and `.lora_B.weight` [out, R]; per-expert pairs
# stacked as PEFT's ParamWrapper stacks them (A rows expert-major [E*R, in], B columns
# rank-major [out, R*E]); the fused gate_up's B interleaves gate and up along its F axis.
# The targets (LORA_TARGETS: the weights each adapts, its contraction letters, its PEFT
# name) are declared in architecture.py, below config, which orders a LoraSpec's targets
# by them.


def lora_leaves(target: str) -> tuple[str, dict[str, str]]:
    """(A's layer path, {adapted weight's layer path: its B's layer path}) of a target."""
    t = LORA_TARGETS[target]
    module = t.weights[0].rpartition("/")[0]
    a = f"{module}/lora_{target}_a"
    if len(t.weights) == 1:
        return a, {t.weights[0]: f"{module}/lora_{target}_b"}
    return a, {w: f"{module}/lora_{target}_b_{w.rpartition('/')[2]}" for w in t.weights}


def _lora_decls() -> dict[str, Param]:
    out = {}
    for name, t in LORA_TARGETS.items():
        w = LAYER[t.weights[0]]
        letters = w.dims.split()
        axes = dict(zip(letters, w.axes))
        batch = [c for c in letters if axes[c] == "exp"]
        inputs = t.contract.split()
        outputs = [c for c in letters if c not in batch and c not in inputs]
        hf_module = t.peft.rpartition(".")[0] if t.is_parameter else w.hf.name.rpartition(".")[0]
        a_dims = batch + inputs + ["R"]
        a_path, b_paths = lora_leaves(name)
        out[a_path] = Param(
            " ".join(a_dims),
            tuple(axes.get(c) for c in a_dims),
            "normal",
            HFTensor(f"{hf_module}.lora_A.weight", f"{''.join(batch)}R {''.join(inputs)}"),
        )
        b_dims = batch + ["R"] + outputs
        for j, b_path in enumerate(b_paths.values()):
            out[b_path] = Param(
                " ".join(b_dims),
                tuple(axes.get(c) for c in b_dims),
                "zeros",
                HFTensor(
                    f"{hf_module}.lora_B.weight",
                    f"{''.join(outputs)} R{''.join(batch)}",
                    j if len(b_paths) > 1 else None,
                ),
            )
    return out


LORA: dict[str, Param] = _lora_decls()


def dim_sizes(arch: Mapping[str, Any] | Any) -> dict[str, int]:
    """Dimension letter -> size, from an architecture dict or a ModelConfig."""
    get = arch.get if isinstance(arch, Mapping) else lambda k: getattr(arch, k)
    return dict(
        V=int(get("vocab_size")),
        D=int(get("hidden_size")),
        N=int(get("num_heads")),
        K=int(get("num_kv_heads")),
        H=int(get("head_dim")),
        E=int(get("num_experts")),
        F=int(get("intermediate_size")),
    )


def num_blocks(arch: Mapping[str, Any] | Any) -> int:
    get = arch.get if isinstance(arch, Mapping) else lambda k: getattr(arch, k)
    return int(get("num_layers")) // 2


def shape(dims: str, sizes: Mapping[str, int]) -> tuple[int, ...]:
    """A shape from dimension letters; merged letters ("NH") multiply."""
    return tuple(math.prod(sizes[c] for c in group) for group in dims.split())


def group(prefix: str, table: Mapping[str, Param] | None = None) -> dict[str, Param]:
    """The parameters of one module: {"q_kernel": Param, ...} for prefix "attn"."""
    tables = (LAYER, TOP) if table is None else (table,)
    out = {}
    for t in tables:
        for path, p in t.items():
            head, _, leaf = path.rpartition("/")
            if head == prefix:
                out[leaf] = p
    return out


def leaves(arch) -> Iterator[tuple[str, Param, tuple[int, ...], bool]]:
    """(tree path, declaration, full shape, stacked) for every parameter, in HF file order
    (embedding, the layer blocks, final norm, unembedding)."""
    sizes, l2 = dim_sizes(arch), num_blocks(arch)
    yield "embed/embedding", TOP["embed/embedding"], shape("V D", sizes), False
    for kind in KINDS:
        for leaf, p in LAYER.items():
            yield f"blocks/{kind}/{leaf}", p, (l2, *shape(p.dims, sizes)), True
    for path in ("final_norm/scale", "unembed/kernel"):
        yield path, TOP[path], shape(TOP[path].dims, sizes), False


def lookup(path: str) -> tuple[Param, bool]:
    """(declaration, stacked) for a tree path; KeyError for an unknown one."""
    parts = path.split("/")
    stacked = parts[0] == "blocks" and len(parts) > 2 and parts[1] in KINDS
    leaf = "/".join(parts[2:])
    decl = (LAYER.get(leaf) or LORA.get(leaf)) if stacked else TOP.get(path)
    if decl is None:
        raise KeyError(f"unknown parameter path {path!r}")
    return decl, stacked


def path_of(key_path) -> str:
    """ "a/b/c" from a jax tree key path (DictKey / GetAttrKey entries)."""
    return "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in key_path)


# ------------------------------------------------------------------------- HF layouts


def _hf_letters(p: Param) -> tuple[list[str], list[str]]:
    ours = p.dims.split()
    flat = [c for group_ in p.hf.dims.split() for c in group_]
    if sorted(ours) != sorted(flat):
        raise ValueError(f"HF layout {p.hf.dims!r} is not a permutation of {p.dims!r}")
    return ours, flat


def to_hf(p: Param, w: np.ndarray) -> np.ndarray:
    """Our array (one layer's, for block parameters) -> its HF layout (one part of a
    fused tensor: `fuse` joins the parts)."""
    ours, flat = _hf_letters(p)
    w = np.transpose(w, [ours.index(c) for c in flat])
    sizes = dict(zip(flat, w.shape))
    return w.reshape(shape(p.hf.dims, sizes))


def from_hf(p: Param, w: np.ndarray, sizes: Mapping[str, int]) -> np.ndarray:
    """An HF array (one part of a fused tensor: `split` takes it apart) -> our layout."""
    ours, flat = _hf_letters(p)
    w = w.reshape([sizes[c] for c in flat])
    return np.transpose(w, [flat.index(c) for c in ours])


def fused_axis(p: Param) -> int:
    """The axis a fused HF tensor interleaves its parts along: the one holding F (the
    experts' hidden units, gate and up alternating)."""
    return next(i for i, g in enumerate(p.hf.dims.split()) if "F" in g)


def split(p: Param, fused: np.ndarray) -> np.ndarray:
    """This parameter's part of a fused HF tensor (interleaved along `fused_axis`)."""
    if p.hf.part is None:
        return fused
    index = [slice(None)] * fused.ndim
    index[fused_axis(p)] = slice(p.hf.part, None, 2)
    return fused[tuple(index)]


def fuse(parts: list[np.ndarray], axis: int = -1) -> np.ndarray:
    """Interleaves the parts of a fused HF tensor along `axis`."""
    if len(parts) == 1:
        return parts[0]
    a0 = np.moveaxis(parts[0], axis, -1)
    out = np.empty((*a0.shape[:-1], len(parts) * a0.shape[-1]), np.result_type(*parts))
    for j, a in enumerate(parts):
        out[..., j :: len(parts)] = np.moveaxis(a, axis, -1)
    return np.moveaxis(out, -1, axis)


def hf_layer_tensors() -> dict[str, list[str]]:
    """Per-layer HF tensor suffix -> our layer leaves stored in it, in part order."""
    out: dict[str, list[tuple[int, str]]] = {}
    for leaf, p in LAYER.items():
        out.setdefault(p.hf.name, []).append((p.hf.part or 0, leaf))
    return {name: [leaf for _, leaf in sorted(parts)] for name, parts in out.items()}


# ------------------------------------------------------------------------- counts


def counts(arch) -> dict[str, int]:
    """Parameter counts: `total`; `active`, what one token uses (k of E experts, without
    the embedding table: the convention of the published 3.61B / 5.13B for gpt-oss-20b /
    120b); `active_with_embedding`; `embedding`."""
    get = arch.get if isinstance(arch, Mapping) else lambda k: getattr(arch, k)
    k, e = int(get("experts_per_token")), int(get("num_experts"))
    total = active = 0.0
    for path, p, shp, _ in leaves(arch):
        n = math.prod(shp)
        total += n
        per_expert = p.axes[:1] == ("exp",)
        active += n * k / e if per_expert else n
    embedding = math.prod(shape("V D", dim_sizes(arch)))
    return {
        "total": int(total),
        "active": int(round(active)) - embedding,
        "active_with_embedding": int(round(active)),
        "embedding": embedding,
    }
