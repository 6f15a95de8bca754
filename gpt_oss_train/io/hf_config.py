"""Hugging Face GPT-OSS ``config.json`` <-> our architecture dict.

``hf_config_to_model_dict`` reads what transformers writes for ``GptOssForCausalLM`` (and
the published ``openai/gpt-oss-*`` configs), and refuses, naming the field, anything the
model does not implement; ``model_dict_to_hf_config`` writes a config that transformers
loads. The architecture dict has exactly the keys of ``architecture.FIELDS``,
in that order. Plain dicts only: nothing here reads files or imports jax or torch.
"""

from __future__ import annotations

from typing import Any, Mapping

from gpt_oss_train import architecture
from gpt_oss_train.architecture import SWIGLU_ALPHA
from gpt_oss_train.io.tokenizer import CALL_ID, ENDOFTEXT_ID, RETURN_ID, STARTOFTEXT_ID

__all__ = [
    "hf_config_to_model_dict",
    "model_dict_to_hf_config",
    "generation_config",
]

# The special tokens HF's configs name (o200k_harmony ids).
BOS_ID = STARTOFTEXT_ID
PAD_ID = ENDOFTEXT_ID
EOS_ID = RETURN_ID
GENERATION_EOS_IDS = (RETURN_ID, ENDOFTEXT_ID, CALL_ID)

SLIDING, FULL = "sliding_attention", "full_attention"


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
    does not implement; the values are then checked like every architecture
    (model/architecture.py).
    """
    hf = dict(hf_cfg)
    mt = hf.get("model_type")
    if mt is not None and mt != "gpt_oss":
        raise ValueError(f"HF config: model_type is {mt!r}, expected 'gpt_oss'")
    _check_unsupported(hf)
    m = _read_sizes(hf)
    m.update(_read_rope(hf))
    m["max_position_embeddings"] = _as_int(
        "max_position_embeddings", _get(hf, "max_position_embeddings", default=131072)
    )
    if m["rope_scaling_factor"] is None:  # transformers: max_position_embeddings / original
        m["rope_scaling_factor"] = m["max_position_embeddings"] / m["rope_original_max_position"]
    m["rms_norm_eps"] = float(_get(hf, "rms_norm_eps", default=1e-5))
    m["swiglu_limit"] = float(_get(hf, "swiglu_limit", default=7.0))
    return architecture.validate(m, "HF config")


def _read_sizes(hf: Mapping[str, Any]) -> dict[str, Any]:
    m: dict[str, Any] = {}
    m["vocab_size"] = _as_int("vocab_size", _get(hf, "vocab_size"))
    m["hidden_size"] = _as_int("hidden_size", _get(hf, "hidden_size"))
    nl = _as_int("num_hidden_layers", _get(hf, "num_hidden_layers", "num_layers"))
    if nl < 2 or nl % 2:
        raise ValueError(
            f"HF config: num_hidden_layers must be even and >= 2 (layers come in "
            f"sliding/full pairs), got {nl}"
        )
    lt = hf.get("layer_types")
    if lt is not None and list(lt) != [SLIDING, FULL] * (nl // 2):
        raise ValueError(
            f"HF config: layer_types must alternate {SLIDING!r}, {FULL!r} starting "
            f"with {SLIDING!r} for {nl} layers, got {list(lt)}"
        )
    m["num_layers"] = nl
    m["num_heads"] = _as_int("num_attention_heads", _get(hf, "num_attention_heads"))
    m["num_kv_heads"] = _as_int(
        "num_key_value_heads", _get(hf, "num_key_value_heads", default=m["num_heads"])
    )
    m["head_dim"] = _as_int(
        "head_dim", _get(hf, "head_dim", default=m["hidden_size"] // m["num_heads"])
    )
    m["num_experts"] = _as_int("num_local_experts", _get(hf, "num_local_experts", "num_experts"))
    m["experts_per_token"] = _as_int(
        "num_experts_per_tok", _get(hf, "num_experts_per_tok", "experts_per_token")
    )
    m["intermediate_size"] = _as_int("intermediate_size", _get(hf, "intermediate_size"))
    m["sliding_window"] = _as_int("sliding_window", _get(hf, "sliding_window"))
    return m


def _read_rope(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The YaRN fields; rope_scaling_factor None means "derive it" (transformers' rule)."""
    rp = hf.get("rope_parameters") or hf.get("rope_scaling")
    if rp is None:
        raise ValueError(
            "HF config: rope_parameters (or rope_scaling) is missing; GPT-OSS needs YaRN RoPE"
        )
    if not isinstance(rp, Mapping):
        raise ValueError(f"HF config: rope_parameters must be a dict, got {rp!r}")
    rtype = rp.get("rope_type", rp.get("type"))
    if rtype != "yarn":
        raise ValueError(
            f"HF config: rope_parameters.rope_type is {rtype!r}; only 'yarn' is supported"
        )
    for k in ("attention_factor", "mscale", "mscale_all_dim"):
        if rp.get(k) is not None:
            raise ValueError(
                f"HF config: rope_parameters.{k} is not supported (the model uses "
                "attention factor 0.1*ln(factor)+1)"
            )
    prf = rp.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if prf is not None and float(prf) != 1.0:
        raise ValueError(f"HF config: partial_rotary_factor={prf} is not supported")
    if "original_max_position_embeddings" not in rp:
        raise ValueError("HF config: rope_parameters.original_max_position_embeddings is missing")
    theta = rp.get("rope_theta", hf.get("rope_theta"))
    truncate = rp.get("truncate", True)  # transformers: missing means True
    if not isinstance(truncate, bool):
        raise ValueError(f"HF config: rope_parameters.truncate must be a bool, got {truncate!r}")
    factor = rp.get("factor")
    return {
        "rope_theta": float(theta if theta is not None else 150000.0),
        "rope_scaling_factor": None if factor is None else float(factor),
        "rope_original_max_position": _as_int(
            "rope_parameters.original_max_position_embeddings",
            rp["original_max_position_embeddings"],
        ),
        # transformers treats missing / null / 0 beta as the paper's defaults.
        "rope_beta_fast": float(rp.get("beta_fast") or 32.0),
        "rope_beta_slow": float(rp.get("beta_slow") or 1.0),
        "rope_truncate": truncate,
    }


def _check_unsupported(hf: Mapping[str, Any]) -> None:
    """Options transformers accepts that this model does not implement."""
    alpha = hf.get("swiglu_alpha")
    if alpha is not None and float(alpha) != SWIGLU_ALPHA:
        raise ValueError(
            f"HF config: swiglu_alpha={alpha} is not supported (the model uses {SWIGLU_ALPHA})"
        )
    if hf.get("tie_word_embeddings", False):
        raise ValueError(
            "HF config: tie_word_embeddings=true is not supported (GPT-OSS has a separate lm_head)"
        )
    if hf.get("attention_bias", True) is not True:
        raise ValueError(
            "HF config: attention_bias=false is not supported (the model has q/k/v/o biases)"
        )
    qc = hf.get("quantization_config")
    if qc is not None:
        qm = qc.get("quant_method") if isinstance(qc, Mapping) else None
        if qm != "mxfp4":
            raise ValueError(
                f"HF config: quantization_config.quant_method={qm!r} is not supported "
                "(only 'mxfp4')"
            )


def model_dict_to_hf_config(m: Mapping[str, Any], *, dtype: str = "bfloat16") -> dict[str, Any]:
    """Our model-config dict -> a transformers ``config.json`` dict (dense, no quantization).

    The special-token ids (bos 199998, eos 200002, pad 199999) are written when they fall
    inside the vocabulary, and null otherwise (transformers refuses a pad id outside it).
    """
    m = architecture.validate(m)
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


def generation_config(m: Mapping[str, Any]) -> dict[str, Any]:
    """A ``generation_config.json`` dict: the special-token ids that fit the vocabulary."""
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
