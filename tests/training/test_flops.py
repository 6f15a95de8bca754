"""FLOPs per token and MFU (training/flops.py), parameter counts (model/parameters.py)
and the accelerator table (hardware.py), each against an independent count: the
attention mask built out, matmuls written by hand, transformers' own model."""

from types import SimpleNamespace

import jax
import numpy as np
import pytest

from gpt_oss_train import hardware
from gpt_oss_train.architecture import PRESETS
from gpt_oss_train.io.hf_config import model_dict_to_hf_config
from gpt_oss_train.model import parameters
from gpt_oss_train.training.flops import (
    attention_pairs,
    decode_flops_per_token,
    forward_flops_per_token,
    forward_passes_per_step,
    throughput_metrics,
    training_flops_per_token,
)

GPT_OSS_20B = SimpleNamespace(
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
)
GPT_OSS_120B = SimpleNamespace(**{**vars(GPT_OSS_20B), "num_layers": 36, "num_experts": 128})

# Odd layer count (2 banded + 1 full), head_dim != hidden/heads, F != D.
TINY = SimpleNamespace(
    vocab_size=50,
    hidden_size=12,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=5,
    num_experts=6,
    experts_per_token=2,
    intermediate_size=7,
    sliding_window=4,
)


# --------------------------------------------------------------------------
# Parameter counts: against transformers' own model, built on the meta device
# --------------------------------------------------------------------------


def _hf_counts(arch):
    """(total, per-expert parameters summed over layers) of transformers' GptOssForCausalLM
    for an architecture, with no memory allocated (meta device)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import GptOssConfig, GptOssForCausalLM

    with torch.device("meta"):
        model = GptOssForCausalLM(GptOssConfig(**model_dict_to_hf_config(arch)))
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    return total, experts // arch["num_experts"]


@pytest.mark.parametrize("preset", ["gpt-oss-20b", "gpt-oss-120b", "tiny"])
def test_param_counts_match_transformers(preset):
    arch = PRESETS[preset]
    total, per_expert = _hf_counts(arch)
    c = parameters.counts(arch)
    assert c["total"] == total
    embedding = arch["vocab_size"] * arch["hidden_size"]
    unused = (arch["num_experts"] - arch["experts_per_token"]) * per_expert
    assert c["active_with_embedding"] == total - unused
    assert c["active"] == total - unused - embedding and c["embedding"] == embedding
    if preset == "gpt-oss-20b":  # the model card's rounded figures: 21B total, 3.6B active
        assert round(total / 1e9) == 21 and round(c["active"] / 1e9, 1) == 3.6
    if preset == "gpt-oss-120b":  # 117B total, 5.1B active
        assert round(total / 1e9) == 117 and round(c["active"] / 1e9, 1) == 5.1


# --------------------------------------------------------------------------
# FLOPs
# --------------------------------------------------------------------------


def _mask_pairs(seq_len, window=None):
    """Exact number of allowed (query, key) pairs, by building the mask."""
    q = np.arange(seq_len)[:, None]
    k = np.arange(seq_len)[None, :]
    allowed = k <= q
    if window is not None:
        allowed &= (q - k) < window  # the last `window` keys, self included
    return int(allowed.sum())


@pytest.mark.parametrize(
    "seq_len,window", [(10, 4), (64, 16), (33, 32), (4, 4), (3, 8), (17, None)]
)
def test_attention_pair_closed_forms_vs_mask(seq_len, window):
    exact = _mask_pairs(seq_len, window)
    # MaxText's closed forms drop the diagonal: S/2 pairs for causal, W/2 for banded.
    if window is not None and seq_len > window:
        assert attention_pairs(seq_len, window) == exact - window / 2
    else:
        assert exact == _mask_pairs(seq_len)  # band wider than the sequence = causal
        assert attention_pairs(seq_len, window) == exact - seq_len / 2


def _hand_forward_flops(m, seq_len):
    """Forward FLOPs per token, written out layer by layer with explicit matmuls."""
    D, N, K, H = m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim
    E, k, F, V, W = (
        m.num_experts,
        m.experts_per_token,
        m.intermediate_size,
        m.vocab_size,
        m.sliding_window,
    )

    def matmul(n_in, n_out):  # per token: one multiply-add per weight = 2 FLOPs
        return 2 * n_in * n_out

    weights = 0
    attention_per_seq = 0.0
    for layer in range(m.num_layers):
        weights += matmul(D, N * H) + matmul(D, K * H) + matmul(D, K * H)  # q, k, v
        weights += matmul(N * H, D)  # out-proj
        weights += matmul(D, E)  # router
        for _ in range(k):  # active experts only
            weights += matmul(D, F) + matmul(D, F) + matmul(F, D)  # gate, up, down
        banded = layer % 2 == 0
        exact = _mask_pairs(seq_len, W if banded else None)
        diagonal = (W if banded and seq_len > W else seq_len) / 2
        pairs = exact - diagonal
        # per pair and head: q.k (H mult-adds) and p*v (H mult-adds)
        attention_per_seq += N * pairs * (2 * H + 2 * H)
    weights += matmul(D, V)  # unembedding; embedding lookup is free
    return weights, attention_per_seq / seq_len


@pytest.mark.parametrize("seq_len", [3, 4, 10, 32])
def test_tiny_flops_match_hand_count(seq_len):
    weights, attention = _hand_forward_flops(TINY, seq_len)
    fwd = forward_flops_per_token(TINY, seq_len)
    assert fwd["weights"] == weights
    assert fwd["attention"] == pytest.approx(attention, rel=1e-12)
    assert fwd["total"] == pytest.approx(weights + attention, rel=1e-12)
    train = training_flops_per_token(TINY, seq_len)
    for key in ("weights", "attention", "total"):
        assert train[key] == pytest.approx(3 * fwd[key], rel=1e-12)


def test_gpt_oss_20b_flops_values():
    t = training_flops_per_token(GPT_OSS_20B, 4096)
    # Weights: 6 x the active non-embedding matmul parameters (no biases/norms/sinks).
    D, V = 2880, 201088
    matmul_params = 24 * (D * (64 + 16) * 64 + 64 * 64 * D + D * 32 + 4 * 3 * D * 2880) + D * V
    assert t["weights"] == 6 * matmul_params
    # 12 full layers of S^2/2 pairs + 12 banded layers of S*W - W^2/2 pairs.
    attn = 3 * 4 * 64 * 64 * (12 * 4096**2 / 2 + 12 * (4096 * 128 - 128**2 / 2)) / 4096
    assert t["attention"] == attn
    # 120b: 36 layers, 128 experts (the router grows, the active experts do not).
    t120 = training_flops_per_token(GPT_OSS_120B, 4096)
    matmul_params = 36 * (D * (64 + 16) * 64 + 64 * 64 * D + D * 128 + 4 * 3 * D * 2880) + D * V
    assert t120["weights"] == 6 * matmul_params


def test_decode_token_flops_by_hand():
    # gpt-oss-20b's token at position 8191: its weights' 2 x active matmul parameters, and
    # q.k + p.v over 8192 keys in the 12 full layers and 128 in the 12 banded ones.
    D, V = 2880, 201088
    matmul_params = 24 * (D * (64 + 16) * 64 + 64 * 64 * D + D * 32 + 4 * 3 * D * 2880) + D * V
    attention = 64 * (2 * 64 + 2 * 64) * (12 * 8192 + 12 * 128)
    assert decode_flops_per_token(GPT_OSS_20B, 8192) == 2 * matmul_params + attention
    # A context inside the window: every layer sees all of it.
    assert decode_flops_per_token(GPT_OSS_20B, 100) == 2 * matmul_params + 64 * 256 * 24 * 100
    with pytest.raises(ValueError):
        decode_flops_per_token(GPT_OSS_20B, 0)


def test_no_window_means_all_layers_causal():
    full = SimpleNamespace(**{**vars(TINY), "sliding_window": None})
    S = 20
    expected = 4 * TINY.num_heads * TINY.head_dim * TINY.num_layers * (S * S / 2) / S
    assert forward_flops_per_token(full, S)["attention"] == pytest.approx(expected)
    with pytest.raises(ValueError):
        forward_flops_per_token(TINY, 0)


# --------------------------------------------------------------------------
# Peak FLOP/s and MFU
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind,peak",
    [
        ("TPU v4", 275e12),
        ("TPU v5 lite", 197e12),
        ("TPU v5e", 197e12),
        ("TPU v5", 459e12),
        ("TPU v5p", 459e12),
        ("TPU v6 lite", 918e12),
        ("TPU v6e", 918e12),
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA B200", 2250e12),
        ("cpu", None),
        ("TFRT_CPU_0", None),
        ("", None),
    ],
)
def test_peak_table_lookup(kind, peak):
    # Datasheet figures (see hardware.py for the sources), typed in from the datasheets.
    assert hardware.peak_flops(kind) == peak


def test_peak_override_and_mfu():
    assert hardware.peak_flops("cpu", override=1e12) == 1e12
    assert hardware.peak_flops("TPU v4", override=2e12) == 2e12
    perf = throughput_metrics(
        step_time_s=2.0, tokens_per_step=8 * 4096, num_devices=4, flops_per_token=1e9, peak=1e13
    )
    assert perf["perf/per_device_tokens_per_sec"] == 4096.0
    assert perf["perf/per_device_tflops_per_sec"] == pytest.approx(4.096)
    assert perf["perf/mfu"] == pytest.approx(0.4096)


def test_forward_passes_per_step_by_objective():
    passes = forward_passes_per_step
    assert passes("lm") == 3  # forward + backward (2 forwards)
    assert passes("dpo") == 4  # + the reference's forward
    assert passes("grpo") == 3  # one update, the sampling log-probs are the policy's own
    assert passes("grpo", kl=True) == 4  # + the reference's log-probs
    # 2 updates with the KL: 2 x (3 + 1), + the sampling policy's log-probs once
    assert passes("grpo", num_iterations=2, kl=True) == 9


def test_mfu_is_none_on_cpu():
    kind = jax.devices("cpu")[0].device_kind
    peak = hardware.peak_flops(kind)
    assert peak is None
    perf = throughput_metrics(
        step_time_s=1.0, tokens_per_step=1024, num_devices=1, flops_per_token=1e9, peak=peak
    )
    assert perf["perf/mfu"] is None
    assert perf["perf/per_device_tflops_per_sec"] == pytest.approx(1.024)
