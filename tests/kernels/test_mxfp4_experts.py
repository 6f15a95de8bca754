"""MXFP4 decode experts (kernels/gpu/mxfp4_experts.py): the in-kernel E2M1/E8M0 decoding
against the numpy codec, and the whole expert FFN in Pallas interpret mode against
dequantize-then-multiply in float64, directly and as the `moe_decode` op's `pallas_gpu`
implementation (on the model's MXFP4Array experts) through the kernel registry. The
compiled-kernel check needs a GPU."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gpt_oss_train.arrays import mxfp4_array
from gpt_oss_train.arrays.mxfp4 import FP4_VALUES, dequantize_mxfp4, quantize_mxfp4
from gpt_oss_train.kernels import Kernels, registry
from gpt_oss_train.kernels.gpu import decode_experts as dex
from gpt_oss_train.kernels.gpu import mxfp4_experts as mx
from gpt_oss_train.kernels.gpu.interpret import interpret_mode
from gpt_oss_train.model import moe as moe_lib

LIMIT, ALPHA = 7.0, 1.702  # gpt-oss's SwiGLU clamp and slope


def test_in_kernel_decoding_matches_the_codec():
    codes = jnp.arange(16, dtype=jnp.int32)
    np.testing.assert_array_equal(np.asarray(mx._e2m1(codes)), FP4_VALUES)
    scales = jnp.arange(1, 255, dtype=jnp.uint8)  # 2^-126 .. 2^127: every normal float32 power
    expected = np.ldexp(np.float32(1), np.arange(1, 255) - 127)
    np.testing.assert_array_equal(np.asarray(mx._e8m0(scales)), expected)


def _case(t, k, e, d, f, seed, one_expert=False):
    rng = np.random.RandomState(seed)
    x = rng.randn(t, d)
    idx = np.stack([rng.choice(e, k, replace=False) for _ in range(t)])
    if one_expert:
        idx[:, 0] = e - 1
        idx[:, 1:] = rng.randint(0, e - 1, (t, k - 1))
    weights = rng.dirichlet(np.ones(k), t)
    # The checkpoint's form: HF's fused gate_up_proj [E, D, 2F] (gate columns even, up odd)
    # and down_proj [E, F, D], quantized; the float64 reference uses their dequantization.
    hf = dict(gate_up=rng.randn(e, d, 2 * f) * 0.3, down=rng.randn(e, f, d) * 0.3)
    q = {n: quantize_mxfp4(a) for n, a in hf.items()}
    deq = {n: dequantize_mxfp4(*q[n]).astype(np.float64) for n in q}
    b_gu, b_down = rng.randn(e, 2 * f), rng.randn(e, d)
    dense = dict(
        wi_gate=deq["gate_up"][..., 0::2],
        wi_up=deq["gate_up"][..., 1::2],
        bi_gate=b_gu[:, 0::2],
        bi_up=b_gu[:, 1::2],
        wo=deq["down"],
        bo=b_down,
    )
    experts = mx.from_hf(*q["gate_up"], b_gu, *q["down"], b_down)
    return x, weights, idx, dense, experts


@pytest.mark.parametrize(
    "t,k,e,one_expert",
    [(1, 4, 8, False), (6, 4, 8, False), (37, 2, 4, True)],
    ids=["decode_batch1", "batch6", "all_tokens_on_one_expert"],
)
def test_ffn_matches_float64_dequantize_then_multiply(t, k, e, one_expert, expert_ffn_reference):
    """From the HF tensors (interleaved gate/up, groups padded: in = 96 is 3 groups, padded
    to 8), through the interpreted kernel in float32, against float64 numpy."""
    numpy_ffn = expert_ffn_reference
    d, f = 96, 64
    x, weights, idx, dense, experts = _case(t, k, e, d, f, seed=t, one_expert=one_expert)
    ref = numpy_ffn(x, weights, idx, dense)
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    run = jax.jit(
        lambda *a: mx.mxfp4_ffn(*a, limit=LIMIT, alpha=ALPHA, dtype=jnp.float32, interpret=True)
    )
    got = np.asarray(run(f32(x), f32(weights), jnp.asarray(idx, jnp.int32), experts))
    # float32 sums of 96-192 products of O(1-10) terms: ~1e-6 of the scale; a wrong nibble,
    # scale or expert is off by O(1)
    np.testing.assert_allclose(got, ref, atol=2e-6 * np.abs(ref).max())


@pytest.mark.parametrize("t,k,e", [(1, 4, 8), (5, 2, 4)], ids=["batch1", "batch5_every_expert"])
def test_registry_pallas_moe_decode_on_mxfp4_arrays_equals_dequantized_reference(
    t, k, e, expert_ffn_reference
):
    """Kernels.of(moe_decode="pallas_gpu") in interpret mode on a CPU, on the model's MXFP4
    experts (MXFP4Arrays made by arrays.mxfp4_array.quantize from dense weights; in = 64
    and 32, 2 and 1 groups padded to 8): the MXFP4 Pallas kernel runs and equals the op's
    xla reference (the gathered path) on the dequantized dense weights, and float64 numpy
    on them."""
    d, f = 64, 32
    rng = np.random.RandomState(20 + t)
    x = rng.randn(t, d)
    idx = np.stack([rng.choice(e, k, replace=False) for _ in range(t)])
    weights = rng.dirichlet(np.ones(k), t)
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    dense = dict(
        wi_gate=rng.randn(e, d, f) * 0.3,
        wi_up=rng.randn(e, d, f) * 0.3,
        wo=rng.randn(e, f, d) * 0.3,
    )
    packed = {n: jax.jit(mxfp4_array.quantize)(f32(a)) for n, a in dense.items()}
    dequantize = jax.jit(lambda p: p.astype(jnp.float32))
    deq = {n: np.asarray(dequantize(p), np.float64) for n, p in packed.items()}
    assert all(0 < np.abs(deq[n] - dense[n]).max() for n in dense)  # 4-bit: not the originals
    biases = dict(bi_gate=rng.randn(e, f), bi_up=rng.randn(e, f), bo=rng.randn(e, d))
    numpy_ref = expert_ffn_reference(x, weights, idx, {**deq, **biases})
    b32 = {n: f32(a) for n, a in biases.items()}
    ew = moe_lib.ExpertWeights(**packed, **b32)
    ew_dense = moe_lib.ExpertWeights(**{n: f32(a) for n, a in deq.items()}, **b32)
    tokens = (f32(x), f32(weights), jnp.asarray(idx, jnp.int32))
    kw = dict(limit=LIMIT, alpha=ALPHA, dtype=jnp.float32)
    xla_impl = registry.OPS["moe_decode"].impl("xla")  # on a CPU the op itself declines
    ref = np.asarray(jax.jit(lambda *a: xla_impl.call(*a, **kw))(*tokens, ew_dense))
    kernels = Kernels.of(moe_decode="pallas_gpu")
    op = lambda *a: kernels.moe_decode(*a, **kw)
    with interpret_mode():
        impl = kernels.impl("moe_decode", "cpu")
        assert impl.name == "pallas_gpu" and impl.takes(*tokens, ew, **kw)
        names = re.findall(r"gpt_oss_\w+_kernel", str(jax.make_jaxpr(op)(*tokens, ew)))
        assert names == ["gpt_oss_mxfp4_kernel"] * 2
        got = np.asarray(jax.jit(op)(*tokens, ew))
    # float32 sums of 32-64 products: ~1e-6 of the scale; a wrong nibble, scale or expert
    # is off by O(1)
    scale = np.abs(numpy_ref).max()
    np.testing.assert_allclose(ref, numpy_ref, atol=2e-6 * scale)
    np.testing.assert_allclose(got, ref, atol=2e-6 * scale)


def _values(m: mx.MXFP4Matrix) -> np.ndarray:
    e, o, width = m.blocks.shape
    return dequantize_mxfp4(
        np.asarray(m.blocks).reshape(e, o, width // 16, 16), np.asarray(m.scales)
    )


def test_from_dense_and_from_hf_hold_the_same_weights():
    """Quantizing our de-interleaved [E, in, out] weights (already MXFP4 values, so exactly
    representable) gives the layout the HF route gives: same values (a block whose largest
    code is 3 may re-encode as 6 at half the scale), same biases."""
    _, _, _, dense, experts = _case(3, 2, 4, 64, 32, seed=7)
    w = moe_lib.ExpertWeights(**{n: jnp.asarray(a, jnp.float32) for n, a in dense.items()})
    requant = mx.from_dense(w)
    for a, b in ((experts.gate_up, requant.gate_up), (experts.down, requant.down)):
        np.testing.assert_array_equal(_values(a), _values(b))
    np.testing.assert_array_equal(experts.gate_up_bias, requant.gate_up_bias)
    np.testing.assert_array_equal(experts.down_bias, requant.down_bias)


def test_kernel_lowers_to_triton_for_cuda():
    """At gpt-oss-20b expert shapes (32 experts, 2880 -> 2 x 2880 -> 2880; 90 groups padded
    to 96), bf16, batch 8 x top-4: every op of the kernel is one Triton supports."""
    e, d, f, t, k = 32, 2880, 2880, 8, 4
    s = jax.ShapeDtypeStruct
    gp = -(-(d // 32) // mx.GROUP_TILE) * mx.GROUP_TILE
    mat = lambda o: mx.MXFP4Matrix(s((e, o, gp * 16), jnp.uint8), s((e, o, gp), jnp.uint8))
    experts = dex.DecodeExperts(
        mat(2 * f), s((e, 2 * f), jnp.float32), mat(d), s((e, d), jnp.float32)
    )
    fn = lambda x, w, i, ex: mx.mxfp4_ffn(x, w, i, ex, limit=LIMIT, alpha=ALPHA, dtype=jnp.bfloat16)
    exported = jax.export.export(
        jax.jit(fn),
        platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(s((t, d), jnp.bfloat16), s((t, k), jnp.float32), s((t, k), jnp.int32), experts)
    assert (
        re.findall(r'name = "(gpt_oss_\w+)"', exported.mlir_module())
        == ["gpt_oss_mxfp4_kernel"] * 2
    )


@pytest.mark.gpu
@pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("t", [1, 64])
def test_compiled_kernel_matches_bf16_gathered_path(t):
    """gpt-oss-20b expert shapes, bf16 activations: the Triton kernel against the float32
    product of the dequantized weights, within 2x the error of the bf16 XLA path on the
    same (dequantized, bf16-exact) weights + 2^-9 of the scale. Not yet run on a GPU."""
    e, d, f, k = 32, 2880, 2880, 4
    x, weights, idx, dense, experts = _case(t, k, e, d, f, seed=0)
    args = (jnp.asarray(x, jnp.float32), jnp.asarray(weights, jnp.float32), jnp.asarray(idx))
    ew = lambda dt: moe_lib.ExpertWeights(**{n: jnp.asarray(a, dt) for n, a in dense.items()})
    gathered = lambda dt: jax.jit(
        lambda *a: moe_lib.dense_experts(*a, ew(dt), limit=LIMIT, alpha=ALPHA, dtype=dt)
    )
    with jax.default_matmul_precision("highest"):
        ref = np.asarray(gathered(jnp.float32)(*args))
    xla = np.asarray(gathered(jnp.bfloat16)(*args), np.float32)
    run = jax.jit(lambda *a: mx.mxfp4_ffn(*a, limit=LIMIT, alpha=ALPHA, dtype=jnp.bfloat16))
    got = np.asarray(run(*args, experts), np.float32)
    scale = np.abs(ref).max()
    assert np.abs(got - ref).max() <= 2 * np.abs(xla - ref).max() + 2**-9 * scale
