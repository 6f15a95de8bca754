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
dense tensors); see :func:`dequantize_mxfp4`.

Our tree (the contract with the model) groups HF layers in 2-layer blocks: HF layer 2i is
block i of ``blocks/sliding``, HF layer 2i+1 is block i of ``blocks/full``; every block
parameter carries a leading ``L2 = num_layers // 2`` axis. See :func:`param_shapes`.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import tempfile
from typing import Any, Callable, Mapping

import ml_dtypes  # noqa: F401  (also makes np.dtype("bfloat16") resolvable for safetensors)
import numpy as np

__all__ = [
    "MODEL_FIELDS",
    "HFCheckpoint",
    "dequantize_mxfp4",
    "quantize_mxfp4",
    "hf_config_to_model_dict",
    "model_dict_to_hf_config",
    "param_shapes",
    "hf_tensor_names",
    "load_params",
    "save_hf",
]

# Keys of our model-config dict (same order as gpt_oss_train.config.ARCH_FIELDS).
MODEL_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "num_experts",
    "experts_per_token",
    "intermediate_size",
    "sliding_window",
    "rope_theta",
    "rope_scaling_factor",
    "rope_original_max_position",
    "rope_beta_fast",
    "rope_beta_slow",
    "rope_truncate",
    "max_position_embeddings",
    "rms_norm_eps",
    "swiglu_limit",
)

# GPT-OSS (o200k_harmony) special tokens.
BOS_ID = 199998  # <|startoftext|>
PAD_ID = 199999  # <|endoftext|>
EOS_ID = 200002  # <|return|>
GENERATION_EOS_IDS = (200002, 199999, 200012)  # <|return|>, <|endoftext|>, <|call|>
SWIGLU_ALPHA = 1.702  # hard-wired in the model

SLIDING, FULL = "sliding_attention", "full_attention"
KINDS = ("sliding", "full")  # block i of KINDS[j] is HF layer 2i + j

# E2M1 (FP4) code -> value: bit 3 sign, bits 2-1 exponent, bit 0 mantissa.
FP4_VALUES = np.array(
    [+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
     -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)

# safetensors dtype names.
_ST_DTYPES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16), "U8": np.dtype("u1"), "I8": np.dtype("i1"),
    "I16": np.dtype("<i2"), "U16": np.dtype("<u2"), "I32": np.dtype("<i4"), "U32": np.dtype("<u4"),
    "I64": np.dtype("<i8"), "U64": np.dtype("<u8"), "BOOL": np.dtype("?"),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
_FLOAT_ST = ("F64", "F32", "F16", "BF16")
_SAVE_DTYPES = {"float32": ("F32", np.dtype("<f4")), "bfloat16": ("BF16", np.dtype(ml_dtypes.bfloat16))}

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


# --------------------------------------------------------------------------
# MXFP4
# --------------------------------------------------------------------------


# Byte -> its two values: [b, 0] = low nibble (element 2i), [b, 1] = high nibble (2i+1).
_FP4_PAIRS = np.stack([FP4_VALUES[np.arange(256) & 0x0F], FP4_VALUES[np.arange(256) >> 4]], -1)
_DEQ_ROWS = 256  # output rows per chunk: keeps the temporaries small and the transpose cached


def _dequant_rows(blk: np.ndarray, scl: np.ndarray, out_t: np.ndarray) -> None:
    """blk uint8 [O, G, 16], scl uint8 [O, G] -> writes out_t [G*32, O] (float32)."""
    o, g, _ = blk.shape
    for r0 in range(0, o, _DEQ_ROWS):
        r1 = min(o, r0 + _DEQ_ROWS)
        vals = _FP4_PAIRS[blk[r0:r1]]  # [r, G, 16, 2]
        exp = scl[r0:r1].astype(np.int32) - 127
        np.ldexp(vals, exp[:, :, None, None], out=vals)  # exact (power-of-two scaling)
        out_t[:, r0:r1] = vals.reshape(r1 - r0, g * 32).T


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MXFP4 -> float32, transposed to the (in, out) orientation used as ``x @ W``.

    blocks: uint8 [..., out, nblk, 16]; each byte holds two E2M1 codes, the low nibble
    being element 2i and the high nibble element 2i+1 of a 32-element block along the input
    axis. scales: uint8 [..., out, nblk], E8M0 (value = code * 2**(scale - 127)).
    Returns float32 [..., in = nblk*32, out]. Processes one leading index at a time.
    """
    blocks = np.asarray(blocks)
    scales = np.asarray(scales)
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(f"MXFP4 blocks/scales must be uint8, got {blocks.dtype}/{scales.dtype}")
    if blocks.ndim < 3 or blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {blocks.shape} / scales {scales.shape}: expected "
                         "blocks [..., out, nblk, 16] and scales [..., out, nblk]")
    *lead, o, g, _ = blocks.shape
    out = np.empty((*lead, g * 32, o), np.float32)
    n = math.prod(lead)
    b2 = blocks.reshape(n, o, g, 16)
    s2 = scales.reshape(n, o, g)
    o2 = out.reshape(n, g * 32, o)
    for i in range(n):
        _dequant_rows(b2[i], s2[i], o2[i])
    return out


# Round-to-nearest onto the E2M1 magnitudes [0, .5, 1, 1.5, 2, 3, 4, 6], ties to the even
# code (IEEE style): the midpoint between codes c and c+1 rounds down when c is even.
_MID_DOWN = np.array([0.25, 1.25, 2.5, 5.0])  # ties go to the lower (even) code
_MID_UP = np.array([0.75, 1.75, 3.5])  # ties go to the upper (even) code


def _quant_rows(w_t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w_t float [O, I] (I % 32 == 0) -> blocks uint8 [O, I/32, 16], scales uint8 [O, I/32]."""
    o, i = w_t.shape
    x = w_t.astype(np.float64).reshape(o, i // 32, 32)
    amax = np.max(np.abs(x), axis=-1)
    with np.errstate(divide="ignore"):
        e = np.ceil(np.log2(amax / 6.0))
    e = np.where(amax > 0, e, -127.0)
    # Guard against log2 rounding: make sure amax / 2**e <= 6.
    e = np.where(amax / np.ldexp(1.0, e.astype(np.int64)) > 6.0, e + 1, e)
    s = np.clip(e + 127, 0, 254).astype(np.int64)
    y = np.abs(x) / np.ldexp(1.0, (s - 127))[..., None]
    code = np.zeros(y.shape, np.uint8)
    for m in _MID_DOWN:
        code += (y > m)
    for m in _MID_UP:
        code += (y >= m)
    code |= np.signbit(x).astype(np.uint8) << 3
    code = code.reshape(o, i // 32, 16, 2)
    blocks = (code[..., 0] | (code[..., 1] << 4)).astype(np.uint8)
    return blocks, s.astype(np.uint8)


def quantize_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float [..., in, out] -> (blocks uint8 [..., out, in/32, 16], scales uint8 [..., out, in/32]).

    The inverse layout of :func:`dequantize_mxfp4`. Per 32-element block the scale exponent
    is ceil(log2(amax / 6)) (clamped to [-127, 127]), values round to the nearest E2M1 value
    (ties to even, saturating at +-6). Exact on values that are already MXFP4-representable.
    """
    w = np.asarray(w)
    if w.ndim < 2 or w.shape[-2] % 32:
        raise ValueError(f"quantize_mxfp4: expected [..., in, out] with in % 32 == 0, got {w.shape}")
    *lead, i, o = w.shape
    n = math.prod(lead)
    w2 = w.reshape(n, i, o)
    blocks = np.empty((n, o, i // 32, 16), np.uint8)
    scales = np.empty((n, o, i // 32), np.uint8)
    for k in range(n):
        blocks[k], scales[k] = _quant_rows(w2[k].T)
    return blocks.reshape(*lead, o, i // 32, 16), scales.reshape(*lead, o, i // 32)


# --------------------------------------------------------------------------
# Config mapping
# --------------------------------------------------------------------------


def _get(hf: Mapping[str, Any], *names: str, default: Any = KeyError) -> Any:
    for n in names:
        if n in hf and hf[n] is not None:
            return hf[n]
    if default is KeyError:
        raise ValueError(f"HF config: required field {names[0]!r} is missing")
    return default


def _as_int(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v:
        raise ValueError(f"HF config: {name} must be an integer, got {v!r}")
    return int(v)


def hf_config_to_model_dict(hf_cfg: Mapping[str, Any]) -> dict[str, Any]:
    """A transformers GPT-OSS ``config.json`` dict -> our model-config dict.

    Accepts both the transformers-5 ``rope_parameters`` and the older ``rope_scaling`` +
    ``rope_theta`` spellings. Raises ValueError naming the field for anything the model
    does not implement.
    """
    hf = dict(hf_cfg)
    mt = hf.get("model_type")
    if mt is not None and mt != "gpt_oss":
        raise ValueError(f"HF config: model_type is {mt!r}, expected 'gpt_oss'")
    m: dict[str, Any] = {}
    m["vocab_size"] = _as_int("vocab_size", _get(hf, "vocab_size"))
    m["hidden_size"] = _as_int("hidden_size", _get(hf, "hidden_size"))
    nl = _as_int("num_hidden_layers", _get(hf, "num_hidden_layers", "num_layers"))
    if nl < 2 or nl % 2:
        raise ValueError(f"HF config: num_hidden_layers must be even and >= 2 (layers come in "
                         f"sliding/full pairs), got {nl}")
    m["num_layers"] = nl
    m["num_heads"] = _as_int("num_attention_heads", _get(hf, "num_attention_heads"))
    m["num_kv_heads"] = _as_int("num_key_value_heads",
                                _get(hf, "num_key_value_heads", default=m["num_heads"]))
    if m["num_heads"] % m["num_kv_heads"]:
        raise ValueError(f"HF config: num_attention_heads ({m['num_heads']}) must be a multiple "
                         f"of num_key_value_heads ({m['num_kv_heads']})")
    m["head_dim"] = _as_int("head_dim", _get(hf, "head_dim",
                                             default=m["hidden_size"] // m["num_heads"]))
    m["num_experts"] = _as_int("num_local_experts", _get(hf, "num_local_experts", "num_experts"))
    m["experts_per_token"] = _as_int("num_experts_per_tok",
                                     _get(hf, "num_experts_per_tok", "experts_per_token"))
    if not 1 <= m["experts_per_token"] <= m["num_experts"]:
        raise ValueError(f"HF config: num_experts_per_tok={m['experts_per_token']} must be in "
                         f"[1, num_local_experts={m['num_experts']}]")
    m["intermediate_size"] = _as_int("intermediate_size", _get(hf, "intermediate_size"))
    sw = hf.get("sliding_window")
    if sw is None or _as_int("sliding_window", sw) < 1:
        raise ValueError(f"HF config: sliding_window must be a positive integer, got {sw!r}")
    m["sliding_window"] = int(sw)

    # Layer pattern: sliding, full, sliding, full, ...
    lt = hf.get("layer_types")
    if lt is not None:
        want = [SLIDING, FULL] * (nl // 2)
        if list(lt) != want:
            raise ValueError(f"HF config: layer_types must alternate {SLIDING!r}, {FULL!r} starting "
                             f"with {SLIDING!r} for {nl} layers, got {list(lt)}")

    # RoPE (YaRN).
    rp = hf.get("rope_parameters") or hf.get("rope_scaling")
    if rp is None:
        raise ValueError("HF config: rope_parameters (or rope_scaling) is missing; GPT-OSS needs "
                         "YaRN RoPE")
    if not isinstance(rp, Mapping):
        raise ValueError(f"HF config: rope_parameters must be a dict, got {rp!r}")
    rtype = rp.get("rope_type", rp.get("type"))
    if rtype != "yarn":
        raise ValueError(f"HF config: rope_parameters.rope_type is {rtype!r}; only 'yarn' is supported")
    for k in ("attention_factor", "mscale", "mscale_all_dim"):
        if rp.get(k) is not None:
            raise ValueError(f"HF config: rope_parameters.{k} is not supported (the model uses "
                             "attention factor 0.1*ln(factor)+1)")
    prf = rp.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if prf is not None and float(prf) != 1.0:
        raise ValueError(f"HF config: partial_rotary_factor={prf} is not supported")
    theta = rp.get("rope_theta", hf.get("rope_theta"))
    m["rope_theta"] = float(theta if theta is not None else 150000.0)
    if "original_max_position_embeddings" not in rp:
        raise ValueError("HF config: rope_parameters.original_max_position_embeddings is missing")
    orig = _as_int("rope_parameters.original_max_position_embeddings",
                   rp["original_max_position_embeddings"])
    m["max_position_embeddings"] = _as_int(
        "max_position_embeddings", _get(hf, "max_position_embeddings", default=131072))
    factor = rp.get("factor")
    # transformers: a missing factor means max_position_embeddings / original.
    m["rope_scaling_factor"] = float(factor if factor is not None
                                     else m["max_position_embeddings"] / orig)
    m["rope_original_max_position"] = orig
    # transformers treats missing / null / 0 beta as the paper defaults, and missing
    # truncate as True.
    m["rope_beta_fast"] = float(rp.get("beta_fast") or 32.0)
    m["rope_beta_slow"] = float(rp.get("beta_slow") or 1.0)
    tr = rp.get("truncate", True)
    if not isinstance(tr, bool):
        raise ValueError(f"HF config: rope_parameters.truncate must be a bool, got {tr!r}")
    m["rope_truncate"] = tr

    m["rms_norm_eps"] = float(_get(hf, "rms_norm_eps", default=1e-5))
    m["swiglu_limit"] = float(_get(hf, "swiglu_limit", default=7.0))
    alpha = hf.get("swiglu_alpha")
    if alpha is not None and float(alpha) != SWIGLU_ALPHA:
        raise ValueError(f"HF config: swiglu_alpha={alpha} is not supported (the model uses "
                         f"{SWIGLU_ALPHA})")
    if hf.get("tie_word_embeddings", False):
        raise ValueError("HF config: tie_word_embeddings=true is not supported (GPT-OSS has a "
                         "separate lm_head)")
    if hf.get("attention_bias", True) is not True:
        raise ValueError("HF config: attention_bias=false is not supported (the model has "
                         "q/k/v/o biases)")
    qc = hf.get("quantization_config")
    if qc is not None:
        qm = qc.get("quant_method") if isinstance(qc, Mapping) else None
        if qm != "mxfp4":
            raise ValueError(f"HF config: quantization_config.quant_method={qm!r} is not supported "
                             "(only 'mxfp4')")
    return {k: m[k] for k in MODEL_FIELDS}


def _check_model_dict(m: Mapping[str, Any]) -> None:
    missing = [k for k in MODEL_FIELDS if k not in m]
    if missing:
        raise ValueError(f"model config is missing fields {missing}")
    if m["num_layers"] < 2 or m["num_layers"] % 2:
        raise ValueError(f"model config: num_layers must be even and >= 2, got {m['num_layers']}")


def model_dict_to_hf_config(m: Mapping[str, Any], *, dtype: str = "bfloat16") -> dict[str, Any]:
    """Our model-config dict -> a transformers ``config.json`` dict (dense, no quantization).

    The special-token ids (bos 199998, eos 200002, pad 199999) are written when they fall
    inside the vocabulary, and null otherwise (transformers refuses a pad id outside it).
    """
    _check_model_dict(m)
    nl = int(m["num_layers"])
    v = int(m["vocab_size"])

    def tok(i: int) -> int | None:
        return i if i < v else None

    rope = {
        "rope_type": "yarn",
        "factor": float(m["rope_scaling_factor"]),
        "original_max_position_embeddings": int(m["rope_original_max_position"]),
        "beta_fast": float(m["rope_beta_fast"]),
        "beta_slow": float(m["rope_beta_slow"]),
        "truncate": bool(m["rope_truncate"]),
    }
    return {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "vocab_size": v,
        "hidden_size": int(m["hidden_size"]),
        "intermediate_size": int(m["intermediate_size"]),
        "num_hidden_layers": nl,
        "num_attention_heads": int(m["num_heads"]),
        "num_key_value_heads": int(m["num_kv_heads"]),
        "head_dim": int(m["head_dim"]),
        "num_local_experts": int(m["num_experts"]),
        "num_experts_per_tok": int(m["experts_per_token"]),
        "experts_per_token": int(m["experts_per_token"]),
        "sliding_window": int(m["sliding_window"]),
        "layer_types": [SLIDING, FULL] * (nl // 2),
        "max_position_embeddings": int(m["max_position_embeddings"]),
        "initial_context_length": int(m["rope_original_max_position"]),
        "rms_norm_eps": float(m["rms_norm_eps"]),
        # transformers 5 reads rope_parameters; older readers read rope_scaling + rope_theta.
        "rope_parameters": {**rope, "rope_theta": float(m["rope_theta"])},
        "rope_scaling": dict(rope),
        "rope_theta": float(m["rope_theta"]),
        "swiglu_limit": float(m["swiglu_limit"]),
        "swiglu_alpha": SWIGLU_ALPHA,
        "attention_bias": True,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "router_aux_loss_coef": 0.9,
        "output_router_logits": False,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": tok(BOS_ID),
        "eos_token_id": tok(EOS_ID),
        "pad_token_id": tok(PAD_ID),
        "dtype": dtype,
        "torch_dtype": dtype,
    }


def _generation_config(m: Mapping[str, Any]) -> dict[str, Any]:
    v = int(m["vocab_size"])
    g: dict[str, Any] = {"do_sample": True}
    if BOS_ID < v:
        g["bos_token_id"] = BOS_ID
    eos = [i for i in GENERATION_EOS_IDS if i < v]
    if eos:
        g["eos_token_id"] = eos
    if PAD_ID < v:
        g["pad_token_id"] = PAD_ID
    return g


# --------------------------------------------------------------------------
# Name / layout mapping
# --------------------------------------------------------------------------


def _dims(m: Mapping[str, Any]) -> dict[str, int]:
    return dict(V=int(m["vocab_size"]), D=int(m["hidden_size"]), N=int(m["num_heads"]),
                K=int(m["num_kv_heads"]), H=int(m["head_dim"]), E=int(m["num_experts"]),
                F=int(m["intermediate_size"]), L2=int(m["num_layers"]) // 2)


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
_LEAF_TO_HF = {leaf: (suffix, j) for suffix, (leaves, _) in _HF_LAYER.items()
               for j, leaf in enumerate(leaves)}
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
# safetensors headers
# --------------------------------------------------------------------------


class _TensorInfo:
    __slots__ = ("name", "file", "dtype", "shape", "begin", "end")

    def __init__(self, name, file, dtype, shape, begin, end):
        self.name, self.file, self.dtype, self.shape, self.begin, self.end = (
            name, file, dtype, shape, begin, end)


def _read_header(fpath: str) -> tuple[dict[str, _TensorInfo], int]:
    """Parse and validate a safetensors header; returns (tensors, data start offset)."""
    try:
        size = os.path.getsize(fpath)
    except OSError as e:
        raise FileNotFoundError(f"safetensors file {fpath} cannot be read: {e}") from None
    with open(fpath, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"safetensors file {fpath} is truncated or corrupt "
                             f"({size} bytes, no header)")
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
            raise ValueError(f"safetensors file {fpath} is truncated or corrupt: header length "
                             f"{n} runs past the end of the file ({size} bytes)")
        raw = f.read(n)
    try:
        hdr = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"safetensors file {fpath} has a corrupt header ({e})") from None
    if not isinstance(hdr, dict):
        raise ValueError(f"safetensors file {fpath} has a corrupt header (not a JSON object)")
    data_len = size - 8 - n
    out: dict[str, _TensorInfo] = {}
    max_end = 0
    for name, info in hdr.items():
        if name == "__metadata__":
            continue
        try:
            st, shape, (b, e) = info["dtype"], tuple(int(s) for s in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"safetensors file {fpath}: corrupt header entry for {name!r}") from None
        if st not in _ST_DTYPES:
            raise ValueError(f"safetensors file {fpath}: tensor {name!r} has unsupported dtype {st}")
        nbytes = math.prod(shape) * _ST_DTYPES[st].itemsize
        if not (0 <= b <= e) or e - b != nbytes:
            raise ValueError(f"safetensors file {fpath}: tensor {name!r} has data_offsets {[b, e]} "
                             f"inconsistent with {st} {list(shape)}")
        if e > data_len:
            raise ValueError(f"safetensors file {fpath} is truncated: tensor {name!r} ends at byte "
                             f"{8 + n + e} but the file has {size} bytes")
        max_end = max(max_end, e)
        out[name] = _TensorInfo(name, fpath, st, shape, b, e)
    if max_end != data_len:
        raise ValueError(f"safetensors file {fpath} is corrupt: {data_len} data bytes but the "
                         f"header describes {max_end}")
    return out, 8 + n


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
    def _index_tensors(self) -> dict[str, _TensorInfo]:
        idx_path = os.path.join(self.path, INDEX_FILE)
        single = os.path.join(self.path, SINGLE_FILE)
        tensors: dict[str, _TensorInfo] = {}
        if os.path.isfile(idx_path):
            try:
                with open(idx_path) as f:
                    wmap = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{idx_path} is not a valid safetensors index ({e!r})") from None
            headers: dict[str, dict[str, _TensorInfo]] = {}
            for fname in sorted(set(wmap.values())):
                fpath = os.path.join(self.path, fname)
                if not os.path.isfile(fpath):
                    raise FileNotFoundError(f"{idx_path} lists {fname}, which does not exist")
                headers[fname] = _read_header(fpath)[0]
            for name, fname in wmap.items():
                if name not in headers[fname]:
                    raise ValueError(f"{idx_path} says tensor {name!r} is in "
                                     f"{os.path.join(self.path, fname)}, but that file lacks it")
                tensors[name] = headers[fname][name]
            return tensors
        if os.path.isfile(single):
            files = [single]
        else:
            files = sorted(os.path.join(self.path, f) for f in os.listdir(self.path)
                           if f.endswith(".safetensors"))
            if not files:
                raise FileNotFoundError(f"HF checkpoint {self.path} has no {SINGLE_FILE}, no "
                                        f"{INDEX_FILE} and no *.safetensors files")
        for fpath in files:
            for name, info in _read_header(fpath)[0].items():
                if name in tensors:
                    raise ValueError(f"tensor {name!r} appears in both {tensors[name].file} and {fpath}")
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
            raise ValueError(f"tensor {name!r} in {t.file} has shape {list(t.shape)}, expected "
                             f"{list(shape)} from config.json")
        ok = t.dtype in _FLOAT_ST if kind == "float" else t.dtype == "U8"
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
                            raise ValueError(f"tensor {blocks!r}: MXFP4 needs the input size {i} "
                                             "to be a multiple of 32")
                        self._check(blocks, (e, o, i // 32, 16), "u8")
                        self._check(scales, (e, o, i // 32), "u8")
                        self._mx_layers.add(n)
                        continue
                    raise ValueError(f"HF checkpoint is missing tensor {name!r} (or its MXFP4 form "
                                     f"{blocks!r} + {scales!r}) in {self._where()}")
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
            _, start = _read_header(t.file)
            dt = _ST_DTYPES[t.dtype]
            return np.fromfile(t.file, dtype=dt, count=math.prod(t.shape),
                               offset=start + t.begin).reshape(t.shape)


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


def _write_safetensors(fpath: str, entries: list[tuple[str, str, tuple[int, ...]]],
                       produce: Callable[[str], np.ndarray]) -> None:
    """Write a safetensors file tensor by tensor: the header is built from the declared
    (name, dtype, shape) entries, then produce(name) is called once per tensor in order."""
    header: dict[str, Any] = {}
    off = 0
    for name, st, shape in entries:
        nb = math.prod(shape) * _ST_DTYPES[st].itemsize
        header[name] = {"dtype": st, "shape": list(shape), "data_offsets": [off, off + nb]}
        off += nb
    header["__metadata__"] = {"format": "pt"}
    hb = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hb += b" " * ((-len(hb)) % 8)
    with open(fpath, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for name, st, shape in entries:
            a = produce(name)
            dt = _ST_DTYPES[st]
            if a.dtype != dt or a.shape != tuple(shape):
                raise AssertionError(f"internal: {name} produced {a.dtype} {a.shape}, declared "
                                     f"{dt} {shape}")
            f.write(np.ascontiguousarray(a).reshape(-1).view(np.uint8).data)
        f.flush()
        os.fsync(f.fileno())


def save_hf(out_dir: str | os.PathLike, model_config: Mapping[str, Any],
            get_param: Callable[[str, slice | None], Any] | Mapping[str, Any],
            dtype: str = "bfloat16", max_shard_bytes: float = 5e9, *,
            mxfp4: bool = False) -> None:
    """Write a Hugging Face GPT-OSS checkpoint folder.

    get_param(path, layers) returns our array for `path` (layers is None for top-level
    parameters and slice(i, i+1) for block parameters: one stacked block at a time); a
    nested dict of arrays is accepted too. Tensors are written one at a time into
    model.safetensors, or into model-0000k-of-0000n.safetensors shards (each at most
    max_shard_bytes unless a single tensor is larger) plus model.safetensors.index.json;
    then config.json and generation_config.json. dtype: "bfloat16" or "float32".
    mxfp4=True stores the expert matrices as MXFP4 blocks/scales (as the published
    checkpoints do) and adds quantization_config to config.json.

    The folder is written under a temporary name next to out_dir and renamed at the end;
    an existing non-empty out_dir raises FileExistsError and is left untouched.
    """
    if dtype not in _SAVE_DTYPES:
        raise ValueError(f"save_hf: dtype must be one of {sorted(_SAVE_DTYPES)}, got {dtype!r}")
    out_dir = os.path.abspath(os.fspath(out_dir))
    m = dict(model_config)
    _check_model_dict(m)
    hf_cfg = model_dict_to_hf_config(m, dtype=dtype)
    hf_config_to_model_dict(hf_cfg)  # validates the model config through the reader
    st, np_dt = _SAVE_DTYPES[dtype]
    d = _dims(m)
    shapes = param_shapes(m)
    if mxfp4 and (d["D"] % 32 or d["F"] % 32):
        raise ValueError(f"save_hf(mxfp4=True) needs hidden_size ({d['D']}) and "
                         f"intermediate_size ({d['F']}) divisible by 32")
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
                raise ValueError(f"get_param({path!r}, slice({layer}, {layer + 1})) returned shape "
                                 f"{a.shape}, expected {(1, *want)}")
            a = a[0]
        elif a.shape != want:
            raise ValueError(f"get_param({path!r}, None) returned shape {a.shape}, expected {want}")
        return a

    # Plan: (hf name, safetensors dtype, shape, producer).
    plan: list[tuple[str, str, tuple[int, ...], Callable[[], np.ndarray]]] = []

    def cast(a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(a.astype(np_dt, copy=False))

    plan.append(("model.embed_tokens.weight", st, _hf_shape("V D", d),
                 lambda: cast(fetch("embed/embedding", None))))
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

                plan.append((name + "_blocks", "U8", (e, o, ii // 32, 16),
                             lambda quant=quant: quant("blocks")))
                plan.append((name + "_scales", "U8", (e, o, ii // 32),
                             lambda quant=quant: quant("scales")))
            else:
                plan.append((name, st, _hf_shape(spec, d), dense))
    plan.append(("model.norm.weight", st, _hf_shape("D", d),
                 lambda: cast(fetch("final_norm/scale", None))))
    plan.append(("lm_head.weight", st, _hf_shape("V D", d),
                 lambda: cast(fetch("unembed/kernel", None).T)))

    # Shard greedily in plan order (blocks before scales, so a pair stays adjacent).
    shards: list[list[int]] = [[]]
    size = 0
    total = 0
    for k, (_, sdt, shape, _) in enumerate(plan):
        nb = math.prod(shape) * _ST_DTYPES[sdt].itemsize
        total += nb
        if shards[-1] and size + nb > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(k)
        size += nb
    nsh = len(shards)
    fnames = ([SINGLE_FILE] if nsh == 1 else
              [f"model-{s + 1:05d}-of-{nsh:05d}.safetensors" for s in range(nsh)])

    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
    try:
        weight_map: dict[str, str] = {}
        for fname, ks in zip(fnames, shards):
            producers = {plan[k][0]: plan[k][3] for k in ks}
            _write_safetensors(os.path.join(tmp, fname), [plan[k][:3] for k in ks],
                               lambda name, producers=producers: producers[name]())
            for k in ks:
                weight_map[plan[k][0]] = fname
        if nsh > 1:
            with open(os.path.join(tmp, INDEX_FILE), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        if mxfp4:
            hf_cfg["quantization_config"] = {
                "quant_method": "mxfp4",
                "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                           "model.embed_tokens", "lm_head"],
            }
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(hf_cfg, f, indent=2)
        with open(os.path.join(tmp, "generation_config.json"), "w") as f:
            json.dump(_generation_config(m), f, indent=2)
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
                raise ValueError(f"{path}: {p} has shape {ckpt.param_shape(p)} in the checkpoint "
                                 f"but the model expects {tuple(target.shape)}")
            _set(out, p, jax.make_array_from_callback(
                tuple(target.shape), target.sharding, _shard_reader(ckpt, p, target.dtype)))
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
