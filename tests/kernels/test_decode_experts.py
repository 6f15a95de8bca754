"""The decode expert kernel (kernels/gpu/decode_experts.py): the routing tile layout, the
bf16 contraction-minor layout, and the FFN in Pallas interpret mode against float64 numpy
and against the XLA reference's `gathered` path, directly and as the `moe_decode` op's
`pallas_gpu` implementation through the kernel registry. The compiled-kernel check needs a
GPU."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gpt_oss_train.errors import ConfigError
from gpt_oss_train.kernels import Kernels, registry
from gpt_oss_train.kernels.gpu import decode_experts as dex
from gpt_oss_train.kernels.gpu.interpret import interpret_mode
from gpt_oss_train.kernels.xla import experts as xla_experts
from gpt_oss_train.model import moe as moe_lib

LIMIT, ALPHA = 7.0, 1.702


def test_tile_layout_puts_each_pair_in_a_tile_of_its_expert():
    rng = np.random.RandomState(0)
    for t, k, e, skew in ((1, 4, 32, False), (64, 4, 32, False), (40, 2, 8, True)):
        idx = rng.randint(0, e, (t, k))
        if skew:
            idx[:, 0] = 3  # one expert takes every token: 40 rows, 3 tiles
        lay = jax.jit(dex.tile_layout, static_argnums=1)(jnp.asarray(idx, jnp.int32), e)
        rows = np.asarray(lay.pair_row)
        tile_expert = np.asarray(lay.tile_expert)
        assert len(set(rows.tolist())) == t * k  # no two pairs share a row
        np.testing.assert_array_equal(tile_expert[rows // dex.ROWS], idx.reshape(-1))
        counts = np.bincount(idx.reshape(-1), minlength=e)
        used = int((-(-counts // dex.ROWS)).sum())
        assert np.all(tile_expert[:used] >= 0) and np.all(tile_expert[used:] == -1)
        assert np.all(np.diff(tile_expert[:used]) >= 0)  # tiles in expert order


def _routing(t, k, e, rng, one_expert=False):
    idx = np.stack([rng.choice(e, k, replace=False) for _ in range(t)])
    if one_expert:  # every token's first choice is the last expert; the rest elsewhere
        idx[:, 0] = e - 1
        idx[:, 1:] = np.stack([rng.choice(e - 1, k - 1, replace=False) for _ in range(t)])
    return idx, rng.dirichlet(np.ones(k), t)


@pytest.mark.parametrize(
    "t,k,e,one_expert",
    [(1, 4, 8, False), (6, 4, 8, False), (37, 2, 4, True)],
    ids=["decode_batch1", "batch6", "all_tokens_on_one_expert"],
)
def test_dense_ffn_matches_float64_reference_and_gathered_path(
    t, k, e, one_expert, expert_ffn_reference
):
    """float32 weights in the contraction-minor layout (in = 80 padded to 128), through the
    interpreted kernel, against float64 numpy and against xla/experts.gathered."""
    numpy_ffn = expert_ffn_reference
    d, f = 80, 48
    rng = np.random.RandomState(t)
    idx, weights = _routing(t, k, e, rng, one_expert)
    x = rng.randn(t, d)
    w = _random_experts(rng, e, d, f)
    ref = numpy_ffn(x, weights, idx, w)
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    ew = moe_lib.ExpertWeights(**{n: f32(a) for n, a in w.items()})
    experts = dex.to_contraction_minor(ew, jnp.float32)
    assert experts.gate_up.shape == (e, 2 * f, 128) and experts.down.shape == (e, d, 64)
    args = (f32(x), f32(weights), jnp.asarray(idx, jnp.int32))
    kw = dict(limit=LIMIT, alpha=ALPHA, dtype=jnp.float32)
    got = jax.jit(lambda *a: dex.dense_ffn(*a, experts, interpret=True, **kw))(*args)
    gathered = jax.jit(lambda *a: xla_experts.gathered(*a, ew, **kw))(*args)
    # float32 sums of 48-96 products: ~1e-6 of the scale; a wrong row, expert or pad is O(1)
    np.testing.assert_allclose(got, ref, atol=2e-6 * np.abs(ref).max())
    np.testing.assert_allclose(got, gathered, atol=2e-6 * np.abs(ref).max())


def _random_experts(rng, e: int, d: int, f: int) -> dict:
    """float64 expert weights [E, in, out] and biases, scaled so activations stay O(1)."""
    return dict(
        wi_gate=rng.randn(e, d, f) * 0.3,
        bi_gate=rng.randn(e, f),
        wi_up=rng.randn(e, d, f) * 0.3,
        bi_up=rng.randn(e, f),
        wo=rng.randn(e, f, d) * 0.3,
        bo=rng.randn(e, d),
    )


def _pallas_kernels_in(fn, *args) -> list[str]:
    """The decode Pallas kernels (by name) in fn's jaxpr: proves the kernel ran, not the
    XLA reference the registry falls back to."""
    return re.findall(r"gpt_oss_\w+_kernel", str(jax.make_jaxpr(fn)(*args)))


@pytest.mark.parametrize("t,k,e", [(1, 4, 8), (5, 2, 4)], ids=["batch1", "batch5_every_expert"])
def test_registry_pallas_moe_decode_equals_xla_reference(t, k, e, expert_ffn_reference):
    """Kernels.of(moe_decode="pallas_gpu") in interpret mode on a CPU runs the Pallas
    kernel (laying out the model's dense float32 [E, in, out] experts inside the step) and
    equals the op's xla reference (the gathered path) and float64 numpy; so does the MoE
    layer (`ragged_experts`) given those kernels."""
    d, f = 48, 32
    rng = np.random.RandomState(10 + t)
    idx, weights = _routing(t, k, e, rng)
    x = rng.randn(t, d)
    w = _random_experts(rng, e, d, f)
    numpy_ref = expert_ffn_reference(x, weights, idx, w)
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    ew = moe_lib.ExpertWeights(**{n: f32(a) for n, a in w.items()})
    args = (f32(x), f32(weights), jnp.asarray(idx, jnp.int32), ew)
    kw = dict(limit=LIMIT, alpha=ALPHA, dtype=jnp.float32)
    # The reference called as the op's `xla` implementation: on a CPU the op itself declines
    # unstreamed weights (a CPU never gathers) and the layer takes grouped matmuls instead.
    xla_impl = registry.OPS["moe_decode"].impl("xla")
    ref = np.asarray(jax.jit(lambda *a: xla_impl.call(*a, **kw))(*args))
    kernels = Kernels.of(moe_decode="pallas_gpu")
    op = lambda *a: kernels.moe_decode(*a, **kw)
    layer = lambda *a: moe_lib.ragged_experts(*a, kernels=kernels, **kw)
    with interpret_mode():
        impl = kernels.impl("moe_decode", "cpu")
        assert impl.name == "pallas_gpu" and impl.takes(*args, **kw)
        assert _pallas_kernels_in(op, *args) == ["gpt_oss_dense_kernel"] * 2
        got = np.asarray(jax.jit(op)(*args))
        got_layer = np.asarray(jax.jit(layer)(*args))
    # float32 sums of 32-64 products: ~1e-6 of the scale; a wrong row, expert or tile is O(1)
    scale = np.abs(numpy_ref).max()
    np.testing.assert_allclose(ref, numpy_ref, atol=2e-6 * scale)
    np.testing.assert_allclose(got, ref, atol=2e-6 * scale)
    np.testing.assert_allclose(got_layer, ref, atol=2e-6 * scale)


def test_pallas_moe_decode_outside_interpret_mode_on_a_cpu_is_a_config_error():
    message = (
        r"config\.kernels\.moe_decode='pallas_gpu' runs on \['gpu'\], not on this program's cpu"
    )
    with pytest.raises(ConfigError, match=message) as e:
        Kernels.of(moe_decode="pallas_gpu").impl("moe_decode", "cpu")
    assert "\n" not in str(e.value)


def test_dense_kernel_lowers_to_triton_for_cuda():
    """At gpt-oss-20b expert shapes (32 experts, 2880 -> 2 x 2880 -> 2880), bf16, batch 64
    x top-4: every op of the kernel is one Triton supports."""
    e, d, f, t, k = 32, 2880, 2880, 64, 4
    s = jax.ShapeDtypeStruct
    experts = dex.DecodeExperts(
        s((e, 2 * f, d), jnp.bfloat16),
        s((e, 2 * f), jnp.float32),
        s((e, d, f), jnp.bfloat16),
        s((e, d), jnp.float32),
    )
    fn = lambda x, w, i, ex: dex.dense_ffn(
        x, w, i, ex, limit=LIMIT, alpha=ALPHA, dtype=jnp.bfloat16
    )
    exported = jax.export.export(
        jax.jit(fn),
        platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(s((t, d), jnp.bfloat16), s((t, k), jnp.float32), s((t, k), jnp.int32), experts)
    kernels = re.findall(r'name = "(gpt_oss_\w+)"', exported.mlir_module())
    assert kernels == ["gpt_oss_dense_kernel"] * 2


@pytest.mark.full
def test_bench_moe_decode_kernels_report_each_backend(run_tool_json):
    """bench_moe's decode_kernels mode in interpret mode on tiny shapes (9 tokens x top-2 of
    4 experts: every expert chosen): one record per (batch, back-end)."""
    run_tool = run_tool_json
    rows = run_tool(
        "bench_moe",
        "--mode=decode_kernels",
        "--tokens=1,9",
        "--experts=4",
        "--k=2",
        "--hidden=64",
        "--expert_hidden=32",
        "--routings=2",
        "--steps=1",
        "--interpret",
    )
    assert [(r["batch"], r["impl"]) for r in rows] == [
        (b, impl) for b in (1, 9) for impl in ("ragged", "tiled", "mxfp4")
    ]
    assert all(r["us_per_layer"] > 0 for r in rows)
    assert [r["distinct_experts"] for r in rows] == [2.0] * 3 + [4.0] * 3


@pytest.mark.gpu
@pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs a GPU")
@pytest.mark.parametrize("t", [1, 8, 64])
def test_compiled_dense_kernel_matches_gathered_path(t):
    """gpt-oss-20b expert shapes, bf16: the Triton kernel against moe.ragged_experts (today's
    decode path) and both against float32, within 2x its error + 2^-9 of the scale. Not yet
    run on a GPU."""
    e, d, f, k = 32, 2880, 2880, 4
    rng = np.random.RandomState(t)
    idx, weights = _routing(t, k, e, rng)
    keys = jax.random.split(jax.random.key(t), 4)
    normal = lambda key, shape, s=0.02: jax.random.normal(key, shape, jnp.float32) * s
    ew = moe_lib.ExpertWeights(
        normal(keys[0], (e, d, f)),
        jnp.zeros((e, f)),
        normal(keys[1], (e, d, f)),
        jnp.zeros((e, f)),
        normal(keys[2], (e, f, d)),
        jnp.zeros((e, d)),
    )
    ew = jax.tree.map(lambda a: a.astype(jnp.bfloat16).astype(jnp.float32), ew)  # bf16-exact
    args = (normal(keys[3], (t, d), 1.0), jnp.asarray(weights, jnp.float32), jnp.asarray(idx))
    kw = dict(limit=LIMIT, alpha=ALPHA)
    with jax.default_matmul_precision("highest"):
        ref = np.asarray(
            jax.jit(lambda *a: moe_lib.ragged_experts(*a, ew, dtype=jnp.float32, **kw))(*args)
        )
    xla = jax.jit(lambda *a: moe_lib.ragged_experts(*a, ew, dtype=jnp.bfloat16, **kw))(*args)
    experts = dex.to_contraction_minor(ew)
    got = jax.jit(lambda *a: dex.dense_ffn(*a, experts, dtype=jnp.bfloat16, **kw))(*args)
    err = lambda a: np.abs(np.asarray(a, np.float32) - ref).max()
    assert err(got) <= 2 * err(xla) + 2**-9 * np.abs(ref).max()
