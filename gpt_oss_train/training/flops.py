"""Model FLOPs per token and MFU, counted as MaxText counts them.

FLOPs follow MaxText's accounting (``calculate_tflops_training_per_device`` and
``calculate_mixed_attention_model_tflops_training_per_device`` with an attention
pattern of length 2): matmul FLOPs only, 2 FLOPs per multiply-add, forward x3
for forward + backward, active experts only, unembedding counted and the
embedding lookup not, causal attention counted as half of the full S x S
score matrix. Per token, per layer (D hidden, N query heads, K kv heads,
H head dim, E experts, k experts per token, F expert intermediate size):

    qkv       2 * D * (N + 2K) * H
    out-proj  2 * N * H * D
    router    2 * D * E
    experts   k * (2 * D * 2F  +  2 * F * D)        (gate+up, down)

plus the unembedding ``2 * D * V`` once per token. Attention scores and values
cost ``4 * N * H`` per (query, key) pair; the number of pairs per sequence is
``S^2 / 2`` for a causal layer and ``S*W - W^2/2`` for a sliding-window layer
when S > W (causal otherwise), divided by S to give a per-token figure. These
closed forms drop the diagonal (``S/2`` and ``W/2`` pairs) exactly as MaxText
does.

Nothing here imports jax: ``m`` is any object with the attributes vocab_size,
hidden_size, num_layers, num_heads, num_kv_heads, head_dim, num_experts,
experts_per_token, intermediate_size, sliding_window. Parameter counts derive
from the declarations in model/parameters.py (``parameters.counts``).
"""

from __future__ import annotations

from typing import Any


def _dims(m: Any) -> tuple[int, ...]:
    return (
        int(m.vocab_size),
        int(m.hidden_size),
        int(m.num_layers),
        int(m.num_heads),
        int(m.num_kv_heads),
        int(m.head_dim),
        int(m.num_experts),
        int(m.experts_per_token),
        int(m.intermediate_size),
    )


def is_sliding_layer(m: Any, layer: int) -> bool:
    """Whether ``layer`` uses the banded (sliding-window) mask.

    GPT-OSS alternates, starting with a banded layer: layers 0, 2, 4, ... are
    banded, odd layers are full causal. With no (or a non-positive) window
    every layer is full causal.
    """
    window = getattr(m, "sliding_window", None)
    if not window or window <= 0:
        return False
    return layer % 2 == 0


def attention_pairs(seq_len: int, window: int | None = None) -> float:
    """(query, key) pairs per sequence, in MaxText's closed form.

    Causal: ``S^2 / 2``. Banded to the last ``window`` keys (self included):
    ``S*W - W^2/2`` when ``S > W``, otherwise the causal count. The exact mask
    counts are these plus ``S/2`` (causal) or ``W/2`` (banded): the diagonal
    that the continuous approximation drops.
    """
    s = float(seq_len)
    if window and 0 < window < seq_len:
        w = float(window)
        return s * w - w * w / 2.0
    return s * s / 2.0


def weight_flops_per_token(m: Any) -> dict[str, float]:
    """Forward matmul FLOPs per token on weights, by component (summed over layers)."""
    V, D, L, N, K, H, E, k, F = _dims(m)
    qkv = 2 * D * (N + 2 * K) * H
    out = 2 * N * H * D
    router = 2 * D * E
    experts = k * (2 * D * 2 * F + 2 * F * D)
    parts = {
        "qkv": float(L * qkv),
        "out_proj": float(L * out),
        "router": float(L * router),
        "experts": float(L * experts),
        "unembedding": float(2 * D * V),
    }
    parts["total"] = sum(parts.values())
    return parts


def _attention_flops_per_token(m: Any, seq_len: int) -> float:
    _, _, L, N, _, H, _, _, _ = _dims(m)
    window = getattr(m, "sliding_window", None)
    total_pairs = 0.0
    for layer in range(L):
        w = window if is_sliding_layer(m, layer) else None
        total_pairs += attention_pairs(seq_len, w)
    return 4.0 * N * H * total_pairs / seq_len


def forward_flops_per_token(m: Any, seq_len: int) -> dict[str, float]:
    """Forward-pass model FLOPs per token: {"weights", "attention", "total"}."""
    if seq_len <= 0:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    weights = weight_flops_per_token(m)["total"]
    attention = _attention_flops_per_token(m, seq_len)
    return {"weights": weights, "attention": attention, "total": weights + attention}


def decode_flops_per_token(m: Any, context: int) -> float:
    """Forward model FLOPs of one token that attends to `context` keys (the banded layers
    to their window of them): a decode step's work per row at that position."""
    if context <= 0:
        raise ValueError(f"context must be positive, got {context}")
    _, _, L, N, _, H, _, _, _ = _dims(m)
    window = getattr(m, "sliding_window", None)
    keys = sum(
        min(context, window) if window and is_sliding_layer(m, layer) else context
        for layer in range(L)
    )
    return weight_flops_per_token(m)["total"] + 4.0 * N * H * keys


def training_flops_per_token(m: Any, seq_len: int) -> dict[str, float]:
    """Training (forward + backward = 3 x forward) model FLOPs per token."""
    fwd = forward_flops_per_token(m, seq_len)
    return {key: 3.0 * value for key, value in fwd.items()}


def forward_passes_per_step(objective: str, *, num_iterations: int = 1, kl: bool = False) -> int:
    """Forward passes' worth of model FLOPs one train step spends on each token of its
    batch, the backward counted as two (MaxText's 3x): language modelling 3; DPO 3 + 1,
    the reference's forward; GRPO 3 per optimizer update (rl.num_iterations), + 1 per
    update for the reference's log-probs with a KL term, + 1 for the sampling policy's
    log-probs taken before several updates. GRPO's rollouts (the engine's generation)
    are not in the step's figure: post_training/rollouts.py times them apart."""
    if objective == "dpo":
        return 4
    if objective == "grpo":
        return num_iterations * (3 + int(kl)) + int(num_iterations > 1)
    return 3


def mfu(flops_per_sec_per_device: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation as a fraction (0..1), or None without a peak."""
    if peak is None or peak <= 0:
        return None
    return flops_per_sec_per_device / peak


def throughput_metrics(
    *,
    step_time_s: float,
    tokens_per_step: int,
    num_devices: int,
    flops_per_token: float,
    peak: float | None,
) -> dict[str, float | None]:
    """The ``perf/*`` scalars MaxText logs, from one step's wall time.

    ``tokens_per_step`` is the global batch (all devices, all micro-batches);
    ``flops_per_token`` the training figure from ``training_flops_per_token``.
    """
    tokens_per_sec_per_device = tokens_per_step / step_time_s / num_devices
    flops_per_sec_per_device = flops_per_token * tokens_per_sec_per_device
    return {
        "perf/step_time_seconds": float(step_time_s),
        "perf/per_device_tokens_per_sec": tokens_per_sec_per_device,
        "perf/per_device_tflops_per_sec": flops_per_sec_per_device / 1e12,
        "perf/mfu": mfu(flops_per_sec_per_device, peak),
    }
