"""Tests for gpt_oss_train.training.metrics: FLOPs, parameter counts, peak table, metrics sink."""

import json
import math
import os
from types import SimpleNamespace

import numpy as np
import pytest

from gpt_oss_train.training.metrics import (
    MetricsWriter,
    StepTimer,
    attention_pairs,
    forward_flops_per_token,
    param_counts,
    peak_flops_per_device,
    read_metrics_jsonl,
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
# Parameter counts
# --------------------------------------------------------------------------


def test_param_counts_match_published_gpt_oss():
    c20 = param_counts(GPT_OSS_20B)
    c120 = param_counts(GPT_OSS_120B)
    assert c20["total"] == 20_914_757_184
    assert c120["total"] == 116_829_156_672
    # Published active counts (openai/gpt-oss model card: 3.61B and 5.13B) exclude
    # the embedding table; ours are exact integers that round to those.
    assert c20["active"] == 3_608_307_264
    assert c120["active"] == 5_132_849_472
    assert round(c20["active"] / 1e9, 2) == 3.61
    assert round(c120["active"] / 1e9, 2) == 5.13
    for c in (c20, c120):
        assert c["active_with_embedding"] == c["active"] + 201088 * 2880
        assert c["embedding"] == 201088 * 2880


def _tiny_param_shapes(m):
    """Every tensor of the model, listed by shape, for an independent count."""
    D, N, K, H, E, F, V = (
        m.hidden_size,
        m.num_heads,
        m.num_kv_heads,
        m.head_dim,
        m.num_experts,
        m.intermediate_size,
        m.vocab_size,
    )
    shapes = {"embed": (V, D), "unembed": (D, V), "final_norm": (D,)}
    for i in range(m.num_layers):
        layer = {
            "input_norm": (D,),
            "post_attn_norm": (D,),
            "q_w": (D, N, H),
            "q_b": (N, H),
            "k_w": (D, K, H),
            "k_b": (K, H),
            "v_w": (D, K, H),
            "v_b": (K, H),
            "o_w": (N, H, D),
            "o_b": (D,),
            "sinks": (N,),
            "router_w": (D, E),
            "router_b": (E,),
            "gate_up_w": (E, D, 2 * F),
            "gate_up_b": (E, 2 * F),
            "down_w": (E, F, D),
            "down_b": (E, D),
        }
        shapes.update({f"layer{i}/{k}": v for k, v in layer.items()})
    return shapes


def test_param_counts_tiny_from_tensor_shapes():
    shapes = _tiny_param_shapes(TINY)
    total = sum(int(np.prod(s)) for s in shapes.values())
    expert_tensors = [
        s for k, s in shapes.items() if k.split("/")[-1].startswith(("gate_up", "down"))
    ]
    per_expert = sum(int(np.prod(s[1:])) for s in expert_tensors)  # over layers, one expert
    active = total - (TINY.num_experts - TINY.experts_per_token) * per_expert
    c = param_counts(TINY)
    assert c["total"] == total
    assert c["active_with_embedding"] == active
    assert c["active"] == active - TINY.vocab_size * TINY.hidden_size


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
    assert t["total"] == pytest.approx(22.93e9, rel=1e-3)
    assert training_flops_per_token(GPT_OSS_120B, 4096)["total"] == pytest.approx(32.71e9, rel=1e-3)


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
    assert peak_flops_per_device(kind) == peak


def test_peak_override_and_mfu():
    assert peak_flops_per_device("cpu", override=1e12) == 1e12
    assert peak_flops_per_device("TPU v4", override=2e12) == 2e12
    perf = throughput_metrics(
        step_time_s=2.0, tokens_per_step=8 * 4096, num_devices=4, flops_per_token=1e9, peak=1e13
    )
    assert perf["perf/per_device_tokens_per_sec"] == 4096.0
    assert perf["perf/per_device_tflops_per_sec"] == pytest.approx(4.096)
    assert perf["perf/mfu"] == pytest.approx(0.4096)


def test_mfu_is_none_on_cpu():
    jax = pytest.importorskip("jax")
    kind = jax.devices("cpu")[0].device_kind
    peak = peak_flops_per_device(kind)
    assert peak is None
    perf = throughput_metrics(
        step_time_s=1.0, tokens_per_step=1024, num_devices=1, flops_per_token=1e9, peak=peak
    )
    assert perf["perf/mfu"] is None
    assert perf["perf/per_device_tflops_per_sec"] == pytest.approx(1.024)


def test_step_timer_skips_compile_lap():
    timer = StepTimer(skip=1)
    assert timer.mean is None
    timer.lap()
    assert timer.mean is None
    timer.lap()
    timer.lap()
    assert len(timer.laps) == 3
    assert timer.mean == pytest.approx(sum(timer.laps[1:]) / 2)


# --------------------------------------------------------------------------
# MetricsWriter
# --------------------------------------------------------------------------


def _tb_scalars(logdir):
    from tensorboard.backend.event_processing import event_accumulator

    acc = event_accumulator.EventAccumulator(logdir, size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _records(n, start=0):
    return [
        (
            start + i,
            {"loss": 5.0 / (start + i + 1), "lr": 1e-4 * (start + i), "tokens": 4096 * (start + i)},
        )
        for i in range(n)
    ]


def test_writer_jsonl_tensorboard_console_and_resume(tmp_path):
    lines = []
    first = _records(4)
    with MetricsWriter(tmp_path, total_steps=10, console=lines.append) as w:
        for step, scalars in first:
            w.write(step, scalars)
        # Flushed per call: readable while the writer is still open (a killed run).
        with open(tmp_path / "metrics.jsonl") as f:
            assert len(f.readlines()) == 4
        assert [s for s, _ in _tb_scalars(str(tmp_path / "tensorboard"))["loss"]] == [0, 1, 2, 3]

    rows = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
    assert len(rows) == 4
    for row, (step, scalars) in zip(rows, first):
        assert set(row) == {"step", "time", "loss", "lr", "tokens"}
        assert row["step"] == step
        assert row["loss"] == scalars["loss"] and row["lr"] == scalars["lr"]
        assert row["tokens"] == scalars["tokens"] and isinstance(row["tokens"], int)
        assert abs(row["time"] - rows[0]["time"]) < 60
    assert len(lines) == 4
    assert lines[0].startswith("step 0/10 | loss 5 | lr 0 | tokens 0")
    assert lines[3].startswith("step 3/10 | loss 1.25 | lr 3.000e-04 | tokens 12288")
    assert "eta" not in lines[0] and "eta" in lines[3]

    # Resume: a new writer appends, does not truncate.
    second = _records(3, start=4)
    with MetricsWriter(tmp_path, total_steps=10, console=lines.append) as w:
        for step, scalars in second:
            w.write(step, scalars)
    rows = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows] == list(range(7))
    assert [r["loss"] for r in rows] == [s["loss"] for _, s in first + second]

    tb = _tb_scalars(str(tmp_path / "tensorboard"))
    assert len(os.listdir(tmp_path / "tensorboard")) == 2
    assert set(tb) == {"loss", "lr", "tokens"}
    expected = first + second
    assert [s for s, _ in tb["loss"]] == [s for s, _ in expected]
    for tag in ("loss", "lr", "tokens"):
        # TensorBoard stores float32 simple_values.
        np.testing.assert_allclose(
            [v for _, v in tb[tag]], [float(np.float32(s[tag])) for _, s in expected], rtol=0
        )


def test_writer_none_and_nan(tmp_path):
    with MetricsWriter(tmp_path, console=lambda line: None) as w:
        w.write(1, {"loss": float("nan"), "perf/mfu": None, "grad_norm": np.float32(0.5)})
        with pytest.raises(ValueError):
            w.write(2, {"step": 3.0})
    (row,) = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
    assert row["loss"] is None and row["perf/mfu"] is None and row["grad_norm"] == 0.5
    tb = _tb_scalars(str(tmp_path / "tensorboard"))
    assert set(tb) == {"loss", "grad_norm"}  # None is not logged to TensorBoard
    assert math.isnan(tb["loss"][0][1]) and tb["grad_norm"] == [(1, 0.5)]


def test_writer_eta_from_recent_steps(tmp_path):
    now = [100.0]
    lines = []
    w = MetricsWriter(
        tmp_path, total_steps=1000, console=lines.append, clock=lambda: now[0], eta_window=3
    )
    w.write(10, {"loss": 1.0})
    assert w.eta_seconds() is None
    now[0] += 500.0  # slow first interval, later dropped from the window
    for step in (20, 30, 40, 50):
        w.write(step, {"loss": 1.0})
        now[0] += 20.0  # 2 s per step from here on
    # The last write came at now - 20; window holds steps 20..50 at 2 s/step.
    assert w.eta_seconds() == pytest.approx((1000 - 50) * 2.0)
    assert lines[-1].endswith("eta 31m40s")
    w.close()
    w.close()  # idempotent


def test_writer_non_primary_is_noop(tmp_path):
    with MetricsWriter(tmp_path / "run", is_primary=False, total_steps=5) as w:
        w.write(1, {"loss": 1.0})
        w.flush()
    assert not (tmp_path / "run").exists()


def test_read_metrics_jsonl_resume_from_earlier_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with MetricsWriter(tmp_path, console=lambda line: None) as w:
        for step in (1, 2, 3, 4):
            w.write(step, {"loss": float(step)})
    with MetricsWriter(tmp_path, console=lambda line: None) as w:  # restored from step 2
        for step in (3, 4, 5):
            w.write(step, {"loss": 10.0 + step})
    with open(path, "a") as f:
        f.write('{"step": 6, "lo')  # killed mid-line
    rows = read_metrics_jsonl(path)
    assert [(r["step"], r["loss"]) for r in rows] == [
        (1, 1.0),
        (2, 2.0),
        (3, 13.0),
        (4, 14.0),
        (5, 15.0),
    ]
