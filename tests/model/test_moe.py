"""The MoE against independent references: a numpy float64 loop over tokens and experts,
and (for gradients) the dense back-end differentiated in float64. The grouped-matmul
kernels are checked on routings that stress their bookkeeping: empty experts, every row
on one expert, groups smaller and larger than a tile."""

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from gpt_oss_train import config as config_lib
from gpt_oss_train import runtime, sharding
from gpt_oss_train.arrays.layer_views import LayerView
from gpt_oss_train.kernels import Kernels, platforms, registry
from gpt_oss_train.kernels.cpu import build
from gpt_oss_train.kernels.tpu import megablox
from gpt_oss_train.kernels.xla import experts
from gpt_oss_train.kernels.xla import grouped_matmul as gm
from gpt_oss_train.kernels.xla.expert_parallel import round_capacity
from gpt_oss_train.model import moe as moe_lib
from gpt_oss_train.model import quantize, streamed_weights

GLU = dict(limit=7.0, alpha=1.702)


def numpy_moe(x, kernel, bias, w, k, limit=7.0, alpha=1.702):
    logits = x @ kernel + bias
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        top = np.argsort(-logits[t])[:k]
        p = np.exp(logits[t, top] - logits[t, top].max())
        p /= p.sum()
        for weight, e in zip(p, top):
            gate = np.minimum(x[t] @ w["wi_gate"][e] + w["bi_gate"][e], limit)
            up = np.clip(x[t] @ w["wi_up"][e] + w["bi_up"][e], -limit, limit)
            act = gate / (1 + np.exp(-alpha * gate)) * (up + 1)
            out[t] += weight * (act @ w["wo"][e] + w["bo"][e])
    return out


def _moe_inputs(t=24, d=16, e=8, f=12, seed=0):
    rng = np.random.RandomState(seed)
    w = dict(
        wi_gate=rng.randn(e, d, f),
        bi_gate=rng.randn(e, f),
        wi_up=rng.randn(e, d, f),
        bi_up=rng.randn(e, f),
        wo=rng.randn(e, f, d) * 0.3,
        bo=rng.randn(e, d),
    )
    return rng.randn(t, d), rng.randn(d, e), rng.randn(e), w


@pytest.mark.parametrize("impl", ["dense", "ragged"])  # sharded: on a mesh, below
def test_moe_backends_match_float64_reference(impl):
    x, kernel, bias, w = _moe_inputs()
    ref = numpy_moe(x, kernel, bias, w, k=3)
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    weights, idx, _ = moe_lib.route(f32(x), f32(kernel), f32(bias), 3)
    ew = moe_lib.ExpertWeights(**{n: f32(a) for n, a in w.items()})
    got = moe_lib.EXPERT_IMPLS[impl](
        f32(x), weights, idx, ew, limit=7.0, alpha=1.702, dtype=jnp.float32
    )
    # the clamp at 7 is active for these unit-scale inputs, so the clamps are exercised
    assert np.abs(np.einsum("td,edf->tef", x, w["wi_gate"])).max() > 7
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


@pytest.mark.parametrize("exchange", ["xla", "all_to_all"])
def test_sharded_moe_on_an_expert_and_tensor_mesh_equals_ragged(exchange):
    """Both ways of moving tokens to their experts' shards (all-gather; all-to-all of the
    pairs, emulated densely on CPU) give the one-device result."""
    kernels = Kernels.of(expert_parallel=exchange)
    x, kernel, bias, w = _moe_inputs(t=32)
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    weights, idx, _ = moe_lib.route(f32(x), f32(kernel), f32(bias), 2)
    ew = moe_lib.ExpertWeights(**{n: f32(a) for n, a in w.items()})
    ref = moe_lib.ragged_experts(
        f32(x), weights, idx, ew, limit=7.0, alpha=1.702, dtype=jnp.float32
    )
    for sizes in (
        dict(data=2, fsdp=1, tensor=1, expert=4),
        dict(data=1, fsdp=2, tensor=2, expert=2),
        dict(data=1, fsdp=1, tensor=1, expert=8),
    ):
        mesh = sharding.make_mesh(sizes)
        with sharding.use_mesh(mesh, config_lib.DEFAULT_RULES):
            got = jax.jit(
                lambda *a: moe_lib.sharded_experts(
                    *a, limit=7.0, alpha=1.702, dtype=jnp.float32, kernels=kernels
                )
            )(f32(x), weights, idx, ew)
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-4, err_msg=str(sizes))


def test_load_balancing_loss_is_k_when_balanced():
    # 4 tokens, 4 experts, uniform router probabilities, each expert chosen equally often
    logits = jnp.zeros((4, 4))
    idx = jnp.array([[0, 1], [2, 3], [0, 1], [2, 3]])
    assert float(moe_lib.load_balancing_loss(logits, idx, jnp.ones(4))) == pytest.approx(2.0)
    # padding tokens do not count
    idx2 = jnp.array([[0, 1], [2, 3], [0, 0], [0, 0]])
    valid = jnp.array([1, 1, 0, 0])
    assert float(moe_lib.load_balancing_loss(logits, idx2, valid)) == pytest.approx(2.0)


def test_gathered_path_for_decode_sized_batches_matches_reference():
    x, kernel, bias, w = _moe_inputs(t=3, e=24)  # 4 x 3 tokens x k=2 <= 24 experts
    ref = numpy_moe(x, kernel, bias, w, k=2)
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    weights, idx, _ = moe_lib.route(f32(x), f32(kernel), f32(bias), 2)
    ew = moe_lib.ExpertWeights(**{n: f32(a) for n, a in w.items()})
    # a CPU takes the grouped path at every size; accelerators gather at this one
    assert not experts.use_gathered(3, 2, 24)
    for rows in (1, 16):  # one row per product (CPU form) or 16 (the GPU's GEMM form)
        got = experts.gathered(
            f32(x), weights, idx, ew, limit=7.0, alpha=1.702, dtype=jnp.float32, rows=rows
        )
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    # int8 weights gather (or slice, in the tiled kernel) only what they need, and stay
    # close to the float path
    qw = ew._replace(
        wi_gate=quantize.quantize_int8(ew.wi_gate, (1,)), wo=quantize.quantize_int8(ew.wo, (1,))
    )
    for impl in (experts.gathered, moe_lib.ragged_experts):
        got_q = impl(f32(x), weights, idx, qw, limit=7.0, alpha=1.702, dtype=jnp.float32)
        assert 0 < np.abs(got_q - ref).max() < 0.05 * np.abs(ref).max()


def test_streamed_expert_weights_match_reference_on_every_path():
    """Inference's layer views (arrays/layer_views.py): the layer's experts read from a
    [layers, E, ...] stack give the reference's outputs on the pairwise (decode), tiled
    (prefill) and whole-layer (dense) paths, and on the MoE layer's decode path (the
    `moe_decode` op: the CPU kernel where this machine builds it, else pairwise), for
    float and int8 stacks."""
    x, kernel, bias, w = _moe_inputs(t=4, e=8)
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    weights, idx, _ = moe_lib.route(f32(x), f32(kernel), f32(bias), 2)
    layer = 1  # stack the layer between two others of different values
    stack = lambda a: jnp.stack([f32(a) * 3.0, f32(a), f32(a) - 1.0])
    layer_idx = jnp.asarray(layer, jnp.int32)
    view = lambda a: LayerView(a, layer_idx)
    ew = moe_lib.ExpertWeights(**{n: f32(a) for n, a in w.items()})
    streamed = ew._replace(**{n: view(stack(w[n])) for n in streamed_weights.EXPERTS})
    ref = numpy_moe(x, kernel, bias, w, k=2)
    assert experts.use_pairwise(4, 2, streamed) and not experts.use_pairwise(4, 2, ew)
    assert not experts.use_pairwise(experts.PAIRWISE_MAX_PAIRS, 2, streamed)
    for impl in (
        experts.pairwise,
        moe_lib.grouped_experts,
        moe_lib.dense_experts,
        moe_lib.ragged_experts,
    ):
        fn = jax.jit(lambda ws: impl(f32(x), weights, idx, ws, dtype=jnp.float32, **GLU))
        np.testing.assert_allclose(fn(streamed), ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    # the layer's decode path ran the CPU kernel exactly where the registry chose it
    kernel_call = "gpt_oss_moe_decode" in fn.lower(streamed).as_text()
    assert kernel_call == (Kernels().impl("moe_decode").name == "cpu")
    q = lambda a: quantize.quantize_int8(stack(a), (2,))
    qs = ew._replace(wi_gate=view(q(w["wi_gate"])), wo=view(q(w["wo"])))
    by_layer = ew._replace(
        wi_gate=quantize.quantize_int8(f32(w["wi_gate"]), (1,)),
        wo=quantize.quantize_int8(f32(w["wo"]), (1,)),
    )
    want = experts.gathered(f32(x), weights, idx, by_layer, dtype=jnp.float32, **GLU)
    got = experts.pairwise(f32(x), weights, idx, qs, dtype=jnp.float32, **GLU)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    assert 0 < np.abs(got - ref).max() < 0.05 * np.abs(ref).max()


# ----------------------------------------------------------------------------- grouped matmul


def numpy_grouped_matmul(x, w, sizes, dy):
    """y, dx, dW of y = grouped x @ w in float64, one group at a time."""
    y, dx, dw = np.zeros((x.shape[0], w.shape[2])), np.zeros_like(x), np.zeros_like(w)
    start = 0
    for g, n in enumerate(sizes):
        rows = slice(start, start + n)
        y[rows] = x[rows] @ w[g]
        dx[rows] = dy[rows] @ w[g].T
        dw[g] = x[rows].T @ dy[rows]
        start += n
    return y, dx, dw


# (group sizes over 6 groups, rows): empty groups first, in the middle and last; every row
# on one group; groups of 1 row; fewer rows in groups than in the array (the rest: zeros).
GROUPINGS = [
    ([0, 17, 3, 0, 20, 0], 40),
    ([40, 0, 0, 0, 0, 0], 40),
    ([0, 0, 0, 0, 0, 40], 40),
    ([1, 1, 1, 1, 1, 35], 40),
    ([5, 0, 9, 0, 0, 0], 40),
    ([0, 0, 0, 0, 0, 0], 40),
]


# (big, small) tiles: one-row tiles; small tiles only; both, smaller and larger than groups
TILES = [gm.Tiles(1, 1), gm.Tiles(4, 4), gm.Tiles(16, 4), gm.Tiles(64, 8)]


@pytest.mark.parametrize("sizes,rows", GROUPINGS)
def test_tiled_grouped_matmul_and_its_gradients_equal_float64(sizes, rows):
    rng = np.random.RandomState(sum(sizes) + len(sizes))
    x, w = rng.randn(rows, 8), rng.randn(len(sizes), 8, 5)
    dy = rng.randn(rows, 5)
    ref = numpy_grouped_matmul(x, w, sizes, dy)
    gs = jnp.array(sizes, jnp.int32)
    with jax.enable_x64(True):
        for tiles in TILES:
            f = lambda x, w: gm.tiled_grouped_matmul(x, w, gs, tiles)
            y, vjp = jax.vjp(f, jnp.asarray(x), jnp.asarray(w))
            for got, want in zip((y, *vjp(jnp.asarray(dy))), ref):
                assert got.dtype == jnp.float64
                np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, err_msg=str(tiles))
    # float32 operands, the op's tile sizes: float32 rounding only (products of 8 terms)
    f = lambda x, w: gm.tiled(x, w, gs)
    y, vjp = jax.vjp(f, jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32))
    for got, want in zip((y, *vjp(jnp.asarray(dy, jnp.float32))), ref):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_tile_sizes_follow_the_mean_group_size():
    assert gm.tile_rows(8192, 8) == (128, 32)  # training and prefill: big tiles
    assert gm.tile_rows(8192, 128) == (64, 16)
    assert gm.tile_rows(64, 32) == (8, 8)  # decode sizes: little padding per expert


def test_cpu_uses_tiles_and_int8_weights_dequantize_per_tile():
    """float32 rows on a CPU, and any rows on a mesh of several CPU devices (what
    `sharded` runs under shard_map), take the tiled XLA reference: the platform's choice
    (the bf16 kernel, where built) declines them, and no kernel call is compiled. An int8
    QArray is dequantized per group by the tiles."""
    x = jnp.ones((6, 8), jnp.float32)
    w = jnp.asarray(np.random.RandomState(0).randn(3, 8, 4), jnp.float32)
    gs = jnp.array([2, 0, 4], jnp.int32)

    def takes_the_reference(x, w):
        impl = Kernels().impl("grouped_matmul")
        assert impl.name in ("cpu", "xla")
        hlo = jax.jit(lambda x, w: Kernels().grouped_matmul(x, w, gs)).lower(x, w).as_text()
        return (impl.name == "xla" or not impl.takes(x, w, gs)) and "gpt_oss_grouped" not in hlo

    assert takes_the_reference(x, w)
    mesh = sharding.make_mesh(dict(data=1, fsdp=4, tensor=1, expert=2))
    with sharding.use_mesh(mesh, config_lib.DEFAULT_RULES):
        assert takes_the_reference(x, w)
        assert takes_the_reference(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16))
    q = quantize.quantize_int8(w, (1,))
    want = jax.lax.ragged_dot(x, q.astype(jnp.float32), gs)
    np.testing.assert_allclose(Kernels().grouped_matmul(x, q, gs), want, rtol=1e-6)
    np.testing.assert_allclose(gm.tiled(x, q, gs), want, rtol=1e-6)


def test_cpus_without_bfloat16_dot_products_keep_the_tiled_kernel(monkeypatch):
    """The AVX512-BF16 kernels are chosen by the CPU's flags (and built only there); other
    CPUs, such as a Zen 3, multiply bfloat16 rows with the tiled kernel (the `xla`
    reference), and the start-up line says why."""
    x, w = jnp.ones((6, 8), jnp.bfloat16), jnp.ones((3, 8, 4), jnp.bfloat16)
    monkeypatch.setattr(runtime, "cpu_flags", lambda path=None: frozenset({"avx2", "fma"}))
    # The checks are cached per process (the real CPU's answer): ask afresh, uncached; the
    # missing flag answers before anything is built.
    monkeypatch.setattr(build, "unavailable", build.unavailable.__wrapped__)
    monkeypatch.setattr(registry, "_unavailable", registry._unavailable.__wrapped__)
    impl = Kernels().impl("grouped_matmul", "cpu")
    assert impl.name == "xla" and impl is registry.OPS["grouped_matmul"].reference
    assert "grouped_matmul=xla (cpu: no avx512_bf16)" in Kernels().describe("cpu")
    hlo = jax.jit(lambda x, w: Kernels().grouped_matmul(x, w, jnp.array([2, 0, 4]))).lower(x, w)
    assert "gpt_oss_grouped" not in hlo.as_text()


# ----------------------------------------------------------------------------- MoE gradients


def _routings(t, e, k, rng):
    """Random top-k with some experts left empty; every token on the same k experts."""
    crowded = np.stack([rng.permutation(e // 2)[:k] for _ in range(t)])  # e/2.. stay empty
    one = np.tile(np.array([e - 1, 2, 0][:k]), (t, 1))
    return {"random_with_empty_experts": crowded, "all_tokens_on_the_same_experts": one}


def test_expert_outputs_and_gradients_equal_dense_float64():
    """Output and gradients (x, routing weights, every expert weight and bias) of the
    grouped path against the dense back-end in float64, on float32 operands (`sharded`
    on an expert mesh: the test below)."""
    impl = "ragged"
    t, d, e, f, k = 12, 16, 8, 12, 2
    rng = np.random.RandomState(0)
    x, _, _, w = _moe_inputs(t=t, d=d, e=e, f=f)
    for name, idx in _routings(t, e, k, rng).items():
        wts = rng.dirichlet(np.ones(k), size=t)
        args = (x, wts, w)

        def loss(impl_fn, dtype, x, wts, w):
            cast = lambda a: jnp.asarray(a, dtype)
            ew = moe_lib.ExpertWeights(**{n: cast(a) for n, a in w.items()})
            y = impl_fn(cast(x), cast(wts), jnp.asarray(idx), ew, dtype=dtype, **GLU)
            return jnp.sum(jnp.sin(y)), y

        with jax.enable_x64(True):
            grad64 = jax.grad(loss, argnums=(2, 3, 4), has_aux=True)
            ref_g, ref_y = grad64(moe_lib.dense_experts, jnp.float64, *args)
            ref_g, ref_y = jax.tree.map(np.asarray, (ref_g, ref_y))
        grad32 = jax.grad(loss, argnums=(2, 3, 4), has_aux=True)
        got_g, got_y = grad32(moe_lib.EXPERT_IMPLS[impl], jnp.float32, *args)
        scale = lambda a: 2e-5 * max(1.0, np.abs(a).max())
        np.testing.assert_allclose(got_y, ref_y, rtol=1e-5, atol=scale(ref_y), err_msg=name)
        for path, got, want in zip(
            jax.tree_util.tree_leaves_with_path(ref_g),
            jax.tree.leaves(got_g),
            jax.tree.leaves(ref_g),
        ):
            np.testing.assert_allclose(
                got, want, rtol=1e-4, atol=scale(want), err_msg=f"{name} {path[0]}"
            )
        # experts no token chose get exactly zero gradient
        unused = sorted(set(range(e)) - set(idx.reshape(-1).tolist()))
        assert unused and np.all(np.asarray(got_g[2]["wi_gate"])[unused] == 0)


@pytest.mark.parametrize("exchange", ["xla", "all_to_all"])
def test_sharded_gradients_on_an_expert_mesh_equal_dense(exchange):
    """Expert parallelism (each device's experts through the tiled kernel under
    shard_map) differentiates to the dense back-end's gradients, however the tokens move."""
    kernels = Kernels.of(expert_parallel=exchange)
    x, kernel, bias, w = _moe_inputs(t=32)
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    weights, idx, _ = moe_lib.route(f32(x), f32(kernel), f32(bias), 2)
    ew = moe_lib.ExpertWeights(**{n: f32(a) for n, a in w.items()})

    def grads(fn):
        loss = lambda x, wts, ew: jnp.sum(jnp.sin(fn(x, wts, idx, ew, dtype=jnp.float32, **GLU)))
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(f32(x), weights, ew)

    ref = grads(moe_lib.dense_experts)
    # The second mesh splits the experts' model dimension over fsdp: gathered inside,
    # their gradients reduce-scattered back (sharding.gather_weight).
    for sizes in (dict(data=2, fsdp=1, tensor=1, expert=4), dict(fsdp=2, tensor=2, expert=2)):
        mesh = sharding.make_mesh(dict(dict(data=1), **sizes))
        with sharding.use_mesh(mesh, config_lib.DEFAULT_RULES):
            got = grads(functools.partial(moe_lib.sharded_experts, kernels=kernels))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
            np.testing.assert_allclose(
                a, b, rtol=1e-4, atol=1e-4 * max(1.0, np.abs(b).max()), err_msg=str(sizes)
            )


@pytest.mark.parametrize("exchange", ["xla", "all_to_all"])
@pytest.mark.parametrize("routing", ["routed", "all_on_one_shard"])
def test_capacity_rounds_equal_one_pass_with_gradients(routing, exchange):
    """config.moe_capacity_factor: a shard's rows run in rounds of a capacity (here 1/2,
    1x and 2x the balanced share, so from one round to several run; with every pair on
    one shard, that shard needs 4x its share and the others none) and give the one-pass
    outputs and gradients, whichever way the tokens move."""
    kernels = Kernels.of(expert_parallel=exchange)
    x, kernel, bias, w = _moe_inputs(t=64)
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    weights, idx, _ = moe_lib.route(f32(x), f32(kernel), f32(bias), 2)
    if routing == "all_on_one_shard":  # experts 0 and 1 live on the first of 4 shards
        idx = jnp.stack([jnp.zeros(64, jnp.int32), jnp.ones(64, jnp.int32)], axis=1)
    ew = moe_lib.ExpertWeights(**{n: f32(a) for n, a in w.items()})

    def run(capacity_factor):
        fn = functools.partial(
            moe_lib.sharded_experts, capacity_factor=capacity_factor, kernels=kernels
        )
        loss = lambda x, wts, ew: jnp.sum(jnp.sin(fn(x, wts, idx, ew, dtype=jnp.float32, **GLU)))
        y = fn(f32(x), weights, idx, ew, dtype=jnp.float32, **GLU)
        return y, jax.grad(loss, argnums=(0, 1, 2))(f32(x), weights, ew)

    mesh = sharding.make_mesh(dict(data=2, fsdp=1, tensor=1, expert=4))
    with sharding.use_mesh(mesh, config_lib.DEFAULT_RULES):
        want = jax.jit(lambda: run(0.0))()
        jaxpr = str(jax.make_jaxpr(lambda: run(0.5))())
        assert "cond[" in jaxpr and "scan[" in jaxpr  # the rounds past the first, skippable
        for factor in (0.5, 1.0, 2.0):
            got = jax.jit(lambda: run(factor))()
            # The same products summed in another order (the rounds scatter-add each
            # weighted row; one pass may fuse multiply-adds): float32 rounding apart
            # (worst seen 1.5e-6 of a leaf's largest value, gathered with every pair on
            # one shard).
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
                np.testing.assert_allclose(a, b, rtol=2e-6, atol=4e-6 * np.abs(b).max())


def test_capacity_is_whole_tiles():
    rows, want = (0, 1, 8, 9, 128, 129, 1000.5), [0, 8, 8, 16, 128, 256, 1024]
    assert [round_capacity(r) for r in rows] == want


def test_tpu_megablox_grouped_matmul_and_its_gradients_equal_the_reference():
    """The TPU's grouped matmul (Pallas megablox, here in its interpreter): the product and
    both gradients, the weight's computed group by group, against the XLA reference, with
    an empty group and rows past the groups (undefined out, zero gradient in)."""
    rng = np.random.RandomState(0)
    x = jnp.asarray(rng.randn(256, 96), jnp.bfloat16)
    w = jnp.asarray(rng.randn(4, 96, 80), jnp.float32)
    sizes = jnp.array([100, 0, 60, 40], jnp.int32)  # 200 of 256 rows
    assert megablox.accepts(x, w, sizes)

    def run(fn):  # rows past the groups are undefined: not in the loss
        loss = lambda x, w: jnp.sum(jnp.sin(fn(x, w, sizes)[:200]))
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w)

    (got, (dx, dw)), (want, (rdx, rdw)) = run(megablox.grouped_matmul), run(gm.tiled)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    # a cotangent on every row, past the groups too: none reaches x there
    _, pull = jax.vjp(lambda x: megablox.grouped_matmul(x, w, sizes), x)
    np.testing.assert_array_equal(pull(jnp.ones((256, 80), jnp.float32))[0][200:], 0)
    np.testing.assert_allclose(np.float32(dx), np.float32(rdx), rtol=0, atol=1e-6)
    # weight gradients in the weight's compute dtype (bfloat16) on both paths
    np.testing.assert_allclose(dw, rdw, rtol=0, atol=1e-2 * float(np.abs(rdw).max()))
    assert np.all(np.asarray(dw)[1] == 0)  # the empty group
    # products written in bfloat16 (accumulated in float32): the reference's, rounded
    y16 = megablox.grouped_matmul(x, w, sizes, out_dtype=jnp.bfloat16)
    assert y16.dtype == jnp.bfloat16
    want16 = gm.tiled(x, w, sizes).astype(jnp.bfloat16)
    np.testing.assert_allclose(
        np.float32(y16[:200]), np.float32(want16[:200]), rtol=1e-2, atol=1e-2
    )


def test_expert_products_in_the_compute_dtype(monkeypatch):
    """platforms.Facts.expert_products_in_compute_dtype (TPU, GPU; forced here on the CPU):
    the grouped matmuls write bfloat16 products (accumulated in float32) and the expert
    outputs stay bfloat16 until the weighted sum. On an expert mesh, outputs and
    gradients against the dense float64 reference within bfloat16 rounding (2e-2 of the
    largest value), and not equal to the float32-products path's (they did round). The
    inputs are scaled so no product lands near the activation's clamp, where a rounding
    can flip a gradient between 0 and 1."""
    x, kernel_w, bias, w = _moe_inputs(t=32)
    x = x / 4
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    weights, idx, _ = moe_lib.route(f32(x), f32(kernel_w), f32(bias), 2)
    proj = np.random.RandomState(1).randn(*x.shape)  # a linear loss: its cotangent exact

    def loss_fn(fn, dtype):
        def loss(x, wts, w):
            ew = moe_lib.ExpertWeights(**{n: a.astype(dtype) for n, a in w.items()})
            y = fn(x.astype(dtype), wts, idx, ew, dtype=dtype, **GLU)
            return jnp.sum(y * proj.astype(y.dtype)), y

        return jax.grad(loss, argnums=(0, 1, 2), has_aux=True)

    with jax.enable_x64(True):
        args64 = (jnp.asarray(x), jnp.asarray(weights, jnp.float64), w)
        ref = jax.tree.map(np.asarray, loss_fn(moe_lib.dense_experts, jnp.float64)(*args64))
    mesh = sharding.make_mesh(dict(data=2, fsdp=1, tensor=1, expert=4))
    args = (f32(x), weights, jax.tree.map(f32, w))

    def run(products_in_compute_dtype):
        facts = platforms.Facts(expert_products_in_compute_dtype=products_in_compute_dtype)
        monkeypatch.setitem(platforms.FACTS, "cpu", facts)
        with sharding.use_mesh(mesh, config_lib.DEFAULT_RULES):
            grad = jax.jit(loss_fn(moe_lib.sharded_experts, jnp.bfloat16))
            return jax.tree.map(lambda a: np.asarray(a, np.float64), grad(*args))

    got, wide = run(True), run(False)
    scale = lambda a: 2e-2 * max(1.0, np.abs(a).max())
    for path, g, r in zip(
        jax.tree_util.tree_leaves_with_path(ref), jax.tree.leaves(got), jax.tree.leaves(ref)
    ):
        np.testing.assert_allclose(g, r, atol=scale(r), err_msg=str(path[0]))
    assert not np.array_equal(got[1], wide[1])  # the outputs were rounded on the way


def _dot_operand_dtypes(jaxpr) -> set:
    """The operand dtypes of every dot_general in a jaxpr, sub-jaxprs included."""
    found = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found |= {v.aval.dtype for v in eqn.invars}
    for sub in jax.extend.core.subjaxprs(jaxpr):
        found |= _dot_operand_dtypes(sub)
    return found


def test_weighted_sum_backward_multiplies_16_bit_operands():
    """With bfloat16 expert outputs (TPU, GPU), the weighted sum's backward multiplies
    16-bit operands (autodiff widened the [t, k, d] outputs to float32 for the routing
    weights' gradient, a copy of them), and both gradients equal float64 within
    bfloat16 rounding."""
    bf16 = jnp.bfloat16
    rng = np.random.RandomState(3)
    t, k, f = 16, 4, 32
    proj = rng.randn(t, f)
    wts = jnp.asarray(rng.dirichlet(np.ones(k), size=t), jnp.float32)
    y = jnp.asarray(rng.randn(t * k, f), bf16)
    order = jnp.asarray(rng.permutation(t * k), jnp.int32)
    summed = lambda w, y: jnp.sum(experts.weighted_sum(w, y, order) * proj)
    grad_jaxpr = jax.make_jaxpr(jax.grad(summed, (0, 1)))(wts, y).jaxpr
    assert _dot_operand_dtypes(grad_jaxpr) <= {jnp.dtype(bf16)}
    gw, gy = jax.grad(summed, (0, 1))(wts, y)
    assert gy.dtype == bf16 and gw.dtype == jnp.float32
    # row i of y is pair order[i] ((token, choice), token-major): pair p is row pair_rows[p]
    pair_rows = np.argsort(np.asarray(order))
    y64 = np.asarray(y, np.float64)[pair_rows].reshape(t, k, f)
    want_w = np.einsum("td,tkd->tk", proj, y64)
    want_y = (np.asarray(wts, np.float64)[:, :, None] * proj[:, None, :]).reshape(t * k, f)
    np.testing.assert_allclose(gw, want_w, atol=1e-2 * np.abs(want_w).max())
    got_y = np.empty_like(want_y)
    got_y[np.asarray(order)] = np.asarray(gy, np.float64)
    np.testing.assert_allclose(got_y, want_y, atol=1e-2 * np.abs(want_y).max())


def test_weighted_sum_adds_output_bias_and_drops_pairs_no_expert_took():
    """Under expert parallelism the weighted sum adds each pair's output bias and drops
    the pairs no local expert took (key == E), whose rows the grouped matmul may have
    left as anything (NaN here): forward and all three gradients against float64, with
    exact zeros where nothing was taken."""
    rng = np.random.RandomState(5)
    t, k, d, e = 16, 4, 24, 3
    wts = rng.dirichlet(np.ones(k), size=t).astype(np.float32)
    key = rng.randint(0, e + 1, size=t * k).astype(np.int32)  # e: no expert here
    order = rng.permutation(t * k).astype(np.int32)
    bias = rng.randn(e, d).astype(np.float32)
    y_pairs = rng.randn(t * k, d).astype(np.float32)  # row p: pair p (token-major)
    y_pairs[key == e] = np.nan
    y_sorted = y_pairs[order]  # row i holds pair order[i]
    proj = rng.randn(t, d)

    def summed(w, y, b):
        out = experts.weighted_sum(w, y, jnp.asarray(order), b, jnp.asarray(key))
        return jnp.sum(out * proj), out

    (_, out), (gw, gy, gb) = jax.value_and_grad(summed, (0, 1, 2), has_aux=True)(
        jnp.asarray(wts), jnp.asarray(y_sorted), jnp.asarray(bias)
    )
    taken = (key < e).reshape(t, k)
    pair = np.where(taken.reshape(-1)[:, None], y_pairs + bias[np.minimum(key, e - 1)], 0.0)
    pair = pair.astype(np.float64).reshape(t, k, d)
    w64 = wts.astype(np.float64)
    np.testing.assert_allclose(out, np.einsum("tk,tkd->td", w64, pair), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gw, np.einsum("td,tkd->tk", proj, pair), rtol=1e-5, atol=1e-5)
    want_y = np.where(taken[:, :, None], w64[:, :, None] * proj[:, None, :], 0.0)
    want_y = want_y.reshape(t * k, d)[order]
    np.testing.assert_allclose(gy, want_y, rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(gy)[key[order] == e] == 0)
    want_b = np.zeros((e, d))
    pairs_taken = np.flatnonzero(key < e)
    np.add.at(want_b, key[pairs_taken], want_y[np.argsort(order)][pairs_taken])
    np.testing.assert_allclose(gb, want_b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_experts", [5, 40])
def test_row_bias_chooses_each_rows_expert(num_experts):
    """A row's bias is its expert's, by selects for a few experts (fused into the pass that
    adds them) and by a gather for many; the gradient sums each expert's rows."""
    rng = np.random.RandomState(7)
    bias = rng.randn(num_experts, 24).astype(np.float32)
    rows = rng.randint(0, num_experts, size=50)
    x = rng.randn(50, 24).astype(np.float32)
    got = experts.add_row_bias(jnp.asarray(x), jnp.asarray(bias), jnp.asarray(rows))
    np.testing.assert_array_equal(got, x + bias[rows])
    proj = rng.randn(50, 24)
    grad = jax.grad(lambda b: jnp.sum(experts.add_row_bias(jnp.asarray(x), b, rows) * proj))
    want = np.zeros((num_experts, 24))
    np.add.at(want, rows, proj)
    np.testing.assert_allclose(grad(jnp.asarray(bias)), want, rtol=1e-5, atol=1e-5)
    # rows no expert here took (expert == E) hold anything, and so may their cotangent:
    # the bias gradient leaves them out, NaN included
    none = rng.rand(50) < 0.3
    rows_e = np.where(none, num_experts, rows)
    proj_nan = np.where(none[:, None], np.nan, proj)
    loss = lambda b: jnp.sum(experts.add_row_bias(jnp.asarray(x), b, rows_e) * proj_nan)
    want = np.zeros((num_experts, 24))
    np.add.at(want, rows[~none], proj[~none])
    np.testing.assert_allclose(jax.grad(loss)(jnp.asarray(bias)), want, rtol=1e-5, atol=1e-5)
