"""The CPU kernels (kernels/cpu/) against numpy in float64. The MoE decode kernel on
shapes and routings that reach every branch of its bookkeeping: rows per expert past the
4-row blocks, empty experts, every pair on one expert, widths that are not a multiple of
8, contraction lengths that are not a multiple of the 8-row step, split into several
blocks, the layer picked from a stack. The rows matmul on the same kinds of shapes, and
its gradient. Weights and caches in float32 and in bfloat16, whose values the reference
takes exactly (a bfloat16 widens to float32 without rounding), so the tolerances stay
float32's."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gpt_oss_train import runtime
from gpt_oss_train.arrays import bit_moves
from gpt_oss_train.arrays.layer_views import LayerView
from gpt_oss_train.kernels import Kernels
from gpt_oss_train.kernels.cpu import grouped_matmul
from gpt_oss_train.model import kv_cache, quantize, streamed_weights
from gpt_oss_train.model import moe as moe_lib

GLU = dict(limit=7.0, alpha=1.702)


# Each kernel is built when a test first needs it (never at collection); where this
# machine cannot build it, its tests skip with the reason (the last test covers a machine
# without a compiler).
@pytest.fixture
def moe_decode(cpu_kernel):
    return cpu_kernel("moe_decode")


@pytest.fixture
def rows_matmul(cpu_kernel):
    return cpu_kernel("rows_matmul")


@pytest.fixture
def decode_attention(cpu_kernel):
    return cpu_kernel("decode_attention")


def _weights(e, d, f, rng):
    return dict(
        wi_gate=rng.randn(e, d, f) / np.sqrt(d) * 3,
        bi_gate=rng.randn(e, f),
        wi_up=rng.randn(e, d, f) / np.sqrt(d) * 3,
        bi_up=rng.randn(e, f),
        wo=rng.randn(e, f, d) / np.sqrt(f),
        bo=rng.randn(e, d),
    )


def _rounded(a, dtype):
    """a's values as `dtype` holds them, in float64."""
    return np.asarray(jnp.asarray(a, dtype).astype(jnp.float32), np.float64)


def _streamed(w, dtype=jnp.float32):
    """w's experts as layer 1 of a 3-layer stack (of `dtype`) whose other layers differ."""
    cast = lambda a: jnp.asarray(a, jnp.float32)
    stack = lambda a: jnp.stack([cast(a) * 3.0, cast(a), cast(a) - 1.0]).astype(dtype)
    view = lambda a: LayerView(stack(a), jnp.asarray(1, jnp.int32))
    ew = moe_lib.ExpertWeights(**{n: cast(a) for n, a in w.items()})
    return ew._replace(**{n: view(w[n]) for n in streamed_weights.EXPERTS})


# (tokens, k, experts, D, F, routing): D and F not multiples of 8 and longer than one
# 128-row block (odd block ends); rows per expert 1 to 12; "one": every pair on expert 2.
CASES = [
    (1, 4, 32, 64, 48, "random"),
    (3, 2, 8, 300, 260, "random"),
    (16, 4, 8, 40, 136, "random"),
    (12, 1, 6, 129, 9, "one"),
    (5, 3, 16, 17, 257, "random"),
]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("tokens,k,experts,d,f,routing", CASES)
def test_kernel_equals_float64_reference(
    tokens, k, experts, d, f, routing, dtype, expert_ffn_reference, moe_decode
):
    rng = np.random.RandomState(tokens * 100 + d)
    w = _weights(experts, d, f, rng)
    w = {n: _rounded(a, dtype) if n in streamed_weights.EXPERTS else a for n, a in w.items()}
    x = rng.randn(tokens, d)
    if routing == "one":
        idx = np.full((tokens, k), 2, np.int32)
    else:  # distinct experts per token, several experts left empty
        idx = np.stack([rng.choice(experts, k, replace=False) for _ in range(tokens)])
        idx = idx.astype(np.int32)
    weights = rng.dirichlet(np.ones(k), tokens)
    ref = expert_ffn_reference(x, weights, idx, w)
    got = jax.jit(
        lambda ws: moe_decode.moe_decode(
            jnp.asarray(x, jnp.float32),
            jnp.asarray(weights, jnp.float32),
            jnp.asarray(idx),
            ws,
            **GLU,
        )
    )(_streamed(w, dtype))
    # the clamp at 7 is active, so both clamps are exercised
    assert np.abs(np.einsum("td,edf->tef", x, w["wi_gate"])).max() > 7
    np.testing.assert_allclose(np.asarray(got), ref, rtol=2e-5, atol=2e-5 * np.abs(ref).max())


def test_ragged_decode_takes_the_kernel_where_it_applies(expert_ffn_reference, moe_decode):
    """moe.ragged_experts on float32 streamed weights at decode sizes is one custom call
    (and equals the reference); int8 stacks, LoRA and batches past MAX_PAIRS keep XLA, as
    do the reference kernels (Kernels.everywhere("xla"))."""
    assert Kernels().impl("moe_decode").name == "cpu"
    rng = np.random.RandomState(0)
    w = _weights(8, 24, 20, rng)
    x = rng.randn(4, 24)
    weights, idx, _ = moe_lib.route(
        jnp.asarray(x, jnp.float32), jnp.asarray(rng.randn(24, 8), jnp.float32), jnp.zeros(8), 2
    )
    streamed = _streamed(w)
    run = lambda ws, kernels=Kernels(): moe_lib.ragged_experts(
        jnp.asarray(x, jnp.float32), weights, idx, ws, dtype=jnp.float32, kernels=kernels, **GLU
    )
    hlo = jax.jit(run).lower(streamed).as_text()
    assert moe_decode.TARGET in hlo
    ref = expert_ffn_reference(x, np.asarray(weights, np.float64), np.asarray(idx), w)
    np.testing.assert_allclose(
        np.asarray(jax.jit(run)(streamed)), ref, rtol=2e-5, atol=2e-5 * np.abs(ref).max()
    )
    xla = lambda ws: run(ws, Kernels.everywhere("xla"))
    assert moe_decode.TARGET not in jax.jit(xla).lower(streamed).as_text()
    np.testing.assert_allclose(
        np.asarray(jax.jit(xla)(streamed)), ref, rtol=2e-5, atol=2e-5 * np.abs(ref).max()
    )
    int8 = streamed._replace(
        wi_gate=LayerView(
            quantize.quantize_int8(streamed.wi_gate.stack, (2,)), streamed.wi_gate.layer
        )
    )
    assert moe_decode.TARGET not in jax.jit(run).lower(int8).as_text()

    def accepts(tokens, k, ws, dtype):  # a batch of `tokens` rows choosing k experts each
        x, routing = jnp.zeros((tokens, 24), jnp.float32), jnp.zeros((tokens, k), jnp.int32)
        return moe_decode.accepts(x, routing.astype(jnp.float32), routing, ws, dtype=dtype, **GLU)

    assert accepts(4, 2, streamed, jnp.float32)
    assert not accepts(4, 2, int8, jnp.float32)
    assert not accepts(4, 2, streamed._replace(lora=moe_lib.ExpertLoRA()), jnp.float32)
    assert accepts(4, 2, streamed, jnp.bfloat16)
    assert not accepts(4, 2, streamed, jnp.float16)
    assert accepts(moe_decode.MAX_PAIRS // 2, 2, streamed, jnp.float32)
    assert not accepts(moe_decode.MAX_PAIRS // 2 + 1, 2, streamed, jnp.float32)


@pytest.mark.parametrize("m,k,n", [(2, 37, 1000), (5, 300, 24), (16, 64, 515), (1, 9, 7)])
def test_rows_matmul_and_its_gradient_equal_float64(m, k, n, rows_matmul):
    rng = np.random.RandomState(m + k)
    x, w, dy = rng.randn(m, k), rng.randn(k, n), rng.randn(m, n)
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    y, vjp = jax.vjp(jax.jit(rows_matmul.rows_matmul), f32(x), f32(w))
    dx, dw = vjp(f32(dy))
    for got, want in ((y, x @ w), (dx, dy @ w.T), (dw, x.T @ dy)):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert rows_matmul.accepts(1, f32(w), jnp.float32)
    assert not rows_matmul.accepts(rows_matmul.MAX_ROWS + 1, f32(w), jnp.float32)
    assert rows_matmul.accepts(2, f32(w), jnp.bfloat16)
    assert not rows_matmul.accepts(2, f32(w), jnp.float16)
    # bfloat16 weights, read as they are: the product of their exact values.
    wb = jnp.asarray(w, jnp.bfloat16)
    assert rows_matmul.accepts(m, wb, jnp.bfloat16)
    got = jax.jit(rows_matmul.rows_matmul)(f32(x), wb)
    want = x @ _rounded(w, jnp.bfloat16)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 16])
def test_rows_matmul_reads_a_layer_of_a_stack_in_place(m, dtype, rows_matmul):
    """A streamed projection: x [m, n*h] times layer 1 of a [3, n, h, d] stack whose
    layers differ, the kernel's call reading the stack itself (no slice in the HLO)."""
    rng = np.random.RandomState(m)
    stack, x = _rounded(rng.randn(3, 4, 24, 40), dtype), rng.randn(m, 4 * 24)
    view = LayerView(jnp.asarray(stack, dtype), jnp.asarray(1, jnp.int32))
    assert rows_matmul.accepts(m, view, jnp.float32)
    fn = jax.jit(rows_matmul.rows_matmul)
    got = np.asarray(fn(jnp.asarray(x, jnp.float32), view))
    want = x @ stack[1].reshape(96, 40)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    hlo = fn.lower(jnp.asarray(x, jnp.float32), view).as_text()
    assert rows_matmul.TARGET in hlo and "dynamic_slice" not in hlo


def _attention_reference(q, k, v, k_pos, q_pos, sinks, window):
    """gpt-oss attention with sinks over cached keys, numpy float64, one head at a time."""
    b, s, n, h = q.shape
    g = n // k.shape[2]
    out = np.zeros(q.shape)
    for bi in range(b):
        for si in range(s):
            p = q_pos[bi, si]
            seen = (k_pos[bi] >= 0) & (k_pos[bi] <= p)
            if window:
                seen &= p - k_pos[bi] < window
            for head in range(n):
                logits = k[bi, :, head // g] @ q[bi, si, head] / np.sqrt(h)
                m = max(logits[seen].max(initial=-np.inf), sinks[head])
                e = np.where(seen, np.exp(logits - m), 0.0)
                out[bi, si, head] = e @ v[bi, :, head // g] / (e.sum() + np.exp(sinks[head] - m))
    return out


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    "b,s,n,kh,h,t,window",
    [(3, 1, 12, 4, 64, 40, None), (2, 3, 6, 2, 20, 17, 8), (1, 1, 4, 4, 8, 5, 2)],
)
def test_decode_attention_equals_float64(b, s, n, kh, h, t, window, dtype, decode_attention):
    """Layer 1 of a 3-layer cache whose layers differ; slots hold positions out of order
    (a ring), some empty (-1); the last row's first query sees no key at all (output 0).
    A bfloat16 cache is stored as kv_cache stores it (uint16 bits)."""
    rng = np.random.RandomState(t)
    k = _rounded(rng.randn(3, b, t, kh, h), dtype)
    v = _rounded(rng.randn(3, b, t, kh, h), dtype)
    k_pos = np.stack([rng.permutation(t) - t // 4 for _ in range(3 * b)]).reshape(3, b, t)
    k_pos = np.maximum(k_pos, -1)
    q_pos = np.sort(rng.randint(0, t, size=(b, s)), axis=1)
    q_pos[-1, 0] = -5  # before every key
    q, sinks = rng.randn(b, s, n, h), rng.randn(n)
    f32, i32 = (lambda a: jnp.asarray(a, jnp.float32)), (lambda a: jnp.asarray(a, jnp.int32))
    store = lambda a: bit_moves.to_storage(f32(a), bit_moves.storage_dtype(dtype))
    cache = kv_cache.KVCache(store(k), store(v), i32(k_pos))
    accepts = lambda q, cache: decode_attention.accepts(
        q, cache, i32(1), f32(sinks), positions=i32(q_pos), window=window
    )
    assert accepts(f32(q), cache)
    fn = jax.jit(decode_attention.decode_attention, static_argnames="window")
    got = np.asarray(fn(f32(q), cache, i32(1), f32(sinks), i32(q_pos), window=window))
    want = _attention_reference(q, k[1], v[1], k_pos[1], q_pos, sinks, window)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.all(got[-1, 0] == 0)
    assert (
        fn(
            q.astype(np.float32).astype(dtype), cache, i32(1), f32(sinks), i32(q_pos), window=window
        ).dtype
        == dtype
    )
    int8 = kv_cache.KVCache(
        cache.k.astype(jnp.int8), cache.v.astype(jnp.int8), cache.pos, cache.k, cache.v
    )
    assert not accepts(f32(q), int8)


@pytest.mark.parametrize("compiler", ["none on PATH", "CXX missing"])
def test_without_a_compiler_decode_keeps_the_xla_path(tmp_path, compiler, expert_ffn_reference):
    """No C++ compiler (none on PATH, or $CXX naming a file that is not there): nothing
    is built, the kernels say why, the registry keeps the XLA reference for every op and
    ragged MoE still runs, with the reference's numbers."""
    code = (
        "import json, jax, jax.numpy as jnp\n"
        "from gpt_oss_train.arrays.layer_views import LayerView\n"
        "from gpt_oss_train.kernels import Kernels\n"
        "from gpt_oss_train.kernels.cpu import moe_decode, rows_matmul\n"
        "from gpt_oss_train.model import moe\n"
        "print('unavailable:', moe_decode.unavailable(), '|', rows_matmul.unavailable())\n"
        "print('impl:', Kernels().impl('moe_decode').name, Kernels().impl('matmul').name)\n"
        "print(Kernels().describe('cpu'))\n"
        "z = lambda *s: jnp.ones(s, jnp.float32) * 0.1\n"
        "view = lambda a: LayerView(a[None], jnp.int32(0))\n"
        "w = moe.ExpertWeights(view(z(4, 8, 6)), z(4, 6), view(z(4, 8, 6)), z(4, 6),\n"
        "                      view(z(4, 6, 8)), z(4, 8))\n"
        "idx = jnp.array([[0, 3], [1, 3]], jnp.int32)\n"
        "y = jax.jit(lambda w: moe.ragged_experts(z(2, 8), z(2, 2), idx, w, limit=7.0,\n"
        "                                         alpha=1.702, dtype=jnp.float32))(w)\n"
        "print('ragged', json.dumps(y.tolist()))\n"
    )
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path))
    env.pop("GPT_OSS_TRAIN_COMPILATION_CACHE", None)
    env.pop("GPT_OSS_TRAIN_CPU_KERNELS", None)
    if compiler == "none on PATH":  # python is started by its full path
        env.pop("CXX", None)
        env["PATH"] = str(tmp_path)
        reason = "no C++ compiler"
    else:
        env["CXX"] = str(tmp_path / "no-such-compiler")
        reason = "build failed: "
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if " " in line)
    assert all(r.strip().startswith(reason) for r in lines["unavailable:"].split("|"))
    assert lines["impl:"] == "xla xla"
    # grouped_matmul needs avx512_bf16: a CPU without it says so before any compiler is sought
    lacks = grouped_matmul.CPU_FLAG not in runtime.cpu_flags()
    gmm_reason = f"no {grouped_matmul.CPU_FLAG}" if lacks else reason
    assert f"moe_decode=xla (cpu: {reason}" in done.stdout, done.stdout
    assert f"grouped_matmul=xla (cpu: {gmm_reason}" in done.stdout, done.stdout
    if compiler == "CXX missing":
        assert "XLA's lowering in use" in done.stderr
    one = np.full((4, 8, 6), 0.1)
    w = dict(
        wi_gate=one,
        bi_gate=one[:, 0],
        wi_up=one,
        bi_up=one[:, 0],
        wo=np.full((4, 6, 8), 0.1),
        bo=np.full((4, 8), 0.1),
    )
    want = expert_ffn_reference(
        np.full((2, 8), 0.1), np.full((2, 2), 0.1), np.array([[0, 3], [1, 3]]), w
    )
    np.testing.assert_allclose(np.array(json.loads(lines["ragged"])), want, rtol=1e-5)
    folder = tmp_path / "gpt_oss_train" / "cpu_kernels"
    assert not folder.exists() or not any(p.suffix == ".so" for p in folder.iterdir())
