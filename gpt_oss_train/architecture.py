"""The GPT-OSS architecture as data: its fields, the published presets, the checks
every architecture passes, wherever it comes from (a config, a checkpoint's stored
model config, a Hugging Face config.json), and the weights LoRA can adapt. Plain dicts;
nothing here imports jax.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping

from gpt_oss_train.errors import ConfigError

# The architecture fields, in the order they are documented, with what each must be. A
# checkpoint stores exactly these, so a decode or fine-tune run rebuilds the network it
# was trained with.
_FIELD_KINDS = {
    "vocab_size": "count",
    "hidden_size": "count",
    "num_layers": "count",
    "num_heads": "count",
    "num_kv_heads": "count",
    "head_dim": "count",
    "num_experts": "count",
    "experts_per_token": "count",
    "intermediate_size": "count",
    "sliding_window": "count",
    "rope_theta": "number",
    "rope_scaling_factor": "number",
    "rope_original_max_position": "count",
    "rope_beta_fast": "number",
    "rope_beta_slow": "number",
    "rope_truncate": "bool",
    "max_position_embeddings": "count",
    "rms_norm_eps": "number",
    "swiglu_limit": "number",
}
FIELDS = tuple(_FIELD_KINDS)

# The SwiGLU gate's sigmoid slope: fixed in the reference implementation, not a field of
# config.json (a checkpoint asking for another value is refused).
SWIGLU_ALPHA = 1.702


def _gpt_oss_20b(**overrides) -> dict[str, Any]:
    """gpt-oss-20b's architecture (the published config.json values), with overrides."""
    arch = dict(
        vocab_size=201088,
        hidden_size=2880,
        num_layers=24,
        num_heads=64,
        num_kv_heads=8,
        head_dim=64,
        num_experts=32,
        experts_per_token=4,
        intermediate_size=2880,
        sliding_window=128,
        rope_theta=150000.0,
        rope_scaling_factor=32.0,
        rope_original_max_position=4096,
        rope_beta_fast=32.0,
        rope_beta_slow=1.0,
        rope_truncate=False,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        swiglu_limit=7.0,
    )
    arch.update(overrides)
    return arch


def _shrunk(*, hidden, layers, heads, kv_heads, head_dim, experts, window) -> dict[str, Any]:
    return _gpt_oss_20b(
        hidden_size=hidden,
        intermediate_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        num_experts=experts,
        experts_per_token=2,
        sliding_window=window,
    )


PRESETS: dict[str, dict[str, Any]] = {
    "gpt-oss-20b": _gpt_oss_20b(),
    "gpt-oss-120b": _gpt_oss_20b(num_layers=36, num_experts=128),
    # Small shapes of the same architecture: the real vocabulary (so the real tokenizer
    # works), everything else shrunk. `tiny` is for unit tests, `small` for CPU runs.
    "tiny": _shrunk(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, experts=4, window=8),
    "small": _shrunk(hidden=256, layers=4, heads=8, kv_heads=2, head_dim=32, experts=8, window=64),
}


# ------------------------------------------------------------------------- LoRA targets


@dataclasses.dataclass(frozen=True)
class LoraTarget:
    """A weight LoRA can adapt; model/parameters.py derives its A/B pair from the weight's
    declaration (letters, logical axes, the tensors PEFT saves)."""

    weights: tuple[str, ...]  # parameters.LAYER paths it adapts (a fused tensor's share A)
    contract: str  # letters of W the input contracts with
    peft: str  # PEFT's name: a module (target_modules) or a parameter (target_parameters)

    @property
    def is_parameter(self) -> bool:
        """PEFT targets it with target_parameters (a bare nn.Parameter), not target_modules."""
        return "." in self.peft


# The LoRA targets, in the order a LoraSpec (config.py) lists them. Declared here, below
# config, which checks and orders config.lora.targets by it; the model, above config, takes
# it from here (model/parameters.py derives each target's A/B pair).
LORA_TARGETS: dict[str, LoraTarget] = {
    "q": LoraTarget(("attn/q_kernel",), "D", "q_proj"),
    "k": LoraTarget(("attn/k_kernel",), "D", "k_proj"),
    "v": LoraTarget(("attn/v_kernel",), "D", "v_proj"),
    "o": LoraTarget(("attn/o_kernel",), "N H", "o_proj"),
    "gate_up": LoraTarget(("moe/wi_gate", "moe/wi_up"), "D", "mlp.experts.gate_up_proj"),
    "down": LoraTarget(("moe/wo",), "F", "mlp.experts.down_proj"),
    "router": LoraTarget(("moe/router_kernel",), "D", "mlp.router.weight"),
}


def _check(cond: bool, where: str, msg: str):
    if not cond:
        raise ConfigError(f"{where}: {msg}")


def validate(arch: Mapping[str, Any], where: str = "config.model") -> dict[str, Any]:
    """Checks an architecture; raises ConfigError naming the first bad field (as
    `<where>.<field>`). Returns it as a plain dict in FIELDS order."""
    unknown = [k for k in arch if k not in FIELDS]
    _check(not unknown, f"{where}.{unknown[0] if unknown else ''}", "unknown field")
    missing = [k for k in FIELDS if k not in arch]
    _check(not missing, where, f"missing fields {missing}")
    m = {k: arch[k] for k in FIELDS}
    for k, kind in _FIELD_KINDS.items():
        v = m[k]
        if kind == "count":
            ok, what = (
                isinstance(v, int) and not isinstance(v, bool) and v > 0,
                "a positive integer",
            )
        elif kind == "bool":
            ok, what = isinstance(v, bool), "true or false"
        else:
            ok, what = isinstance(v, (int, float)) and not isinstance(v, bool), "a number"
        _check(ok, f"{where}.{k}", f"must be {what}, got {v!r}")
    _check(
        m["num_layers"] % 2 == 0,
        f"{where}.num_layers",
        f"must be even (layers come in (banded, full) pairs), got {m['num_layers']}",
    )
    _check(
        m["num_heads"] % m["num_kv_heads"] == 0,
        f"{where}.num_heads",
        f"{m['num_heads']} query heads are not divisible by num_kv_heads="
        f"{m['num_kv_heads']}; pick num_kv_heads dividing num_heads",
    )
    _check(m["head_dim"] % 2 == 0, f"{where}.head_dim", "must be even for rotary embeddings")
    _check(
        m["experts_per_token"] <= m["num_experts"],
        f"{where}.experts_per_token",
        f"{m['experts_per_token']} > num_experts={m['num_experts']}; "
        "lower experts_per_token or raise num_experts",
    )
    _check(m["rope_theta"] > 1, f"{where}.rope_theta", f"must be > 1, got {m['rope_theta']}")
    _check(
        m["rope_scaling_factor"] >= 1,
        f"{where}.rope_scaling_factor",
        f"must be >= 1 (1 disables YaRN), got {m['rope_scaling_factor']}",
    )
    _check(
        m["rope_beta_fast"] > m["rope_beta_slow"] > 0,
        f"{where}.rope_beta_fast",
        f"need rope_beta_fast > rope_beta_slow > 0, got {m['rope_beta_fast']}, "
        f"{m['rope_beta_slow']}",
    )
    _check(m["rms_norm_eps"] > 0, f"{where}.rms_norm_eps", "must be > 0")
    _check(m["swiglu_limit"] > 0, f"{where}.swiglu_limit", "must be > 0")
    return m


def from_json(text: str, where: str) -> dict[str, Any]:
    """An architecture stored as JSON (a checkpoint's model config), validated."""
    try:
        arch = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}: model config is not valid JSON ({e})") from None
    if not isinstance(arch, dict):
        raise ConfigError(f"{where}: model config is not a JSON object")
    return validate(arch, where)
