"""The chunked next-token loss (loss.py): values and gradients against float64 numpy, with
the "auto" kernels (on a CPU with AVX512-BF16, bfloat16 chunks take the cross-entropy
kernels) and with the XLA references, and values and gradients on meshes against the
same function with no mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gpt_oss_train import config as config_lib
from gpt_oss_train import sharding
from gpt_oss_train.kernels import Kernels
from gpt_oss_train.kernels.cpu import cross_entropy as cpu_cross_entropy
from gpt_oss_train.kernels.cpu import grouped_matmul as cpu_grouped_matmul
from gpt_oss_train.training import loss as loss_lib

KERNELS = {"auto": Kernels(), "xla": Kernels.everywhere("xla")}

B, S, D, V = 8, 12, 16, 40  # S=12 with chunk 5: two full chunks and a padded one


def _inputs(seed=0):
    rng = np.random.RandomState(seed)
    h = rng.randn(B, S, D).astype(np.float32)
    w = (rng.randn(D, V) * 0.5).astype(np.float32)
    t = rng.randint(0, V, (B, S)).astype(np.int32)
    m = (rng.rand(B, S) > 0.2).astype(np.int32)
    return h, w, t, m


@pytest.mark.parametrize("kernels", KERNELS)
def test_token_logprobs_match_float64_log_softmax(kernels):
    h, w, t, _ = _inputs()
    logp, lse = loss_lib.token_logprobs(
        jnp.asarray(h),
        jnp.asarray(w),
        jnp.asarray(t),
        chunk=5,
        dtype=jnp.float32,
        kernels=KERNELS[kernels],
    )
    logits = h.astype(np.float64) @ w.astype(np.float64)
    ref_lse = np.log(np.sum(np.exp(logits), axis=-1))
    ref_logp = np.take_along_axis(logits, t[..., None], -1)[..., 0] - ref_lse
    # float32 matmul over D=16 and a 40-way log-sum-exp: ~1e-6 relative
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(logp, ref_logp, rtol=1e-5, atol=1e-5)


def _loss_and_grads(h, w, t, m, gather_once=False):
    def f(h, w):
        nll, z, n = loss_lib.lm_loss_sums(
            h, w, t, m, chunk=5, dtype=jnp.float32, gather_once=gather_once
        )
        return nll / n + 1e-2 * z / n

    return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(h, w)


RULES = config_lib.DEFAULT_RULES


@pytest.mark.parametrize(
    "sizes",
    [
        dict(data=1, fsdp=8, tensor=1, expert=1),  # unembedding gathered over fsdp
        dict(data=2, fsdp=2, tensor=2, expert=1),  # and its vocabulary split over tensor
        dict(data=2, fsdp=1, tensor=1, expert=4),
        dict(data=1, fsdp=4, tensor=1, expert=2),  # the TPU configs' shape
    ],
)
@pytest.mark.parametrize("gather_once", [False, True])  # True: rows per device, shard_map
def test_loss_and_gradients_on_a_mesh_equal_no_mesh(sizes, gather_once):
    rules = RULES
    h, w, t, m = (jnp.asarray(a) for a in _inputs(1))
    ref_loss, (ref_dh, ref_dw) = _loss_and_grads(h, w, t, m)
    mesh = sharding.make_mesh(sizes)
    with sharding.use_mesh(mesh, rules):
        put = lambda a, names: jax.device_put(
            a, jax.sharding.NamedSharding(mesh, sharding.logical_to_spec(names, rules))
        )
        loss, (dh, dw) = _loss_and_grads(
            put(h, ("batch", None, None)),
            put(w, ("embed", "vocab")),
            put(t, ("batch", None)),
            put(m, ("batch", None)),
            gather_once,
        )
    # float32, sums over 8 devices in another order: agreement to a few ulps
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    np.testing.assert_allclose(dh, ref_dh, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(dw, ref_dw, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("chunk", [5, S])  # three chunks (recomputed), one (softmax kept)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gradients_match_float64_reference(dtype, chunk, kernels):
    """The chunk's log-probabilities have a hand-written backward pass (cotangents and the
    weight gradient in the compute dtype, the softmax kept from the forward pass when
    there is one chunk): its gradients against the float64 formulas, d loss / d logits =
    (softmax - onehot + 2 z lse softmax) over the masked tokens."""
    h, w, t, m = _inputs(2)
    z = 1e-2

    def f(h, w):
        nll, zs, n = loss_lib.lm_loss_sums(
            h, w, t, m, chunk=chunk, dtype=dtype, kernels=KERNELS[kernels]
        )
        return nll / n + z * zs / n

    grad = jax.jit(jax.grad(f, argnums=(0, 1)))
    dh, dw = grad(jnp.asarray(h), jnp.asarray(w))
    # bfloat16 on a CPU with AVX512-BF16 (and a compiler): the chunk's softmax is the
    # cross-entropy kernels' and its products the grouped matmul kernels'
    took = dtype == jnp.bfloat16 and KERNELS[kernels].impl("cross_entropy").name == "cpu"
    text = grad.lower(h, w).as_text()
    assert (cpu_grouped_matmul.TARGET in text) == took
    assert (cpu_cross_entropy.GRAD_TARGET in text) == took
    h64, w64 = h.astype(np.float64), w.astype(np.float64)
    logits = h64 @ w64
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    lse = np.log(np.exp(logits).sum(-1, keepdims=True))
    g = (p - np.eye(V)[t] + 2 * z * lse * p) * (m / m.sum())[..., None]
    ref_dh = g @ w64.T
    ref_dw = np.einsum("bsd,bsv->dv", h64, g)
    # float32: sums of 16 and 40 terms, ~1e-6; bf16: inputs, weights, softmax and
    # cotangents rounded (8-bit mantissa, ~0.4% each)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(dh, ref_dh, atol=tol * np.abs(ref_dh).max())
    np.testing.assert_allclose(dw, ref_dw, atol=tol * np.abs(ref_dw).max())


@pytest.mark.parametrize("vocab", [1, 37, 4096])  # tails of 1 and 5 lanes, whole vectors
def test_softmax_kernels_match_float64(vocab, cpu_kernel):
    """cross_entropy.cc: lse, target logit and softmax of each row, and the logits'
    gradient, against numpy in float64 (targets include one past the vocabulary)."""
    cpu_kernel("cross_entropy")  # built, or skipped with the reason
    rng = np.random.default_rng(vocab)
    rows = 9
    logits = (rng.standard_normal((rows, vocab)) * 6).astype(np.float32)
    targets = rng.integers(0, vocab, rows).astype(np.int32)
    targets[-1] = vocab  # out of range: clamped in the forward, no column in the gradient
    lse, target, probs = jax.jit(cpu_cross_entropy.softmax)(logits, targets)
    x = logits.astype(np.float64)
    ref_lse = x.max(-1) + np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1))
    ref_p = np.exp(x - ref_lse[:, None])
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(target, x[np.arange(rows), np.minimum(targets, vocab - 1)])
    assert probs.dtype == jnp.bfloat16
    # bfloat16 rounding of the float64 softmax: within half a unit in the 8th bit
    np.testing.assert_allclose(np.asarray(probs, np.float64), ref_p, rtol=2**-8, atol=1e-30)

    scale = rng.standard_normal(rows).astype(np.float32)
    add = rng.standard_normal(rows).astype(np.float32)
    g = jax.jit(cpu_cross_entropy.logits_grad)(probs, targets, scale, add)
    p64 = np.asarray(probs, np.float64)
    onehot = np.arange(vocab) == targets[:, None]
    ref_g = scale[:, None] * p64 + np.where(onehot, add[:, None], 0.0)
    assert g.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(g, np.float64), ref_g, rtol=2**-8, atol=1e-30)


def test_reduce_scatter_in_pieces_sums_each_devices_share(monkeypatch):
    """sharding.reduce_scatter (the unembedding's and experts' gradients back to their
    FSDP shards) split into pieces along another axis, as libtpu needs for large arrays:
    each device gets the sum over devices of its block, as numpy computes it."""
    monkeypatch.setattr(sharding, "_REDUCE_SCATTER_PIECE_BYTES", 4 * 16 * 5)  # 7 pieces
    mesh = sharding.make_mesh(dict(data=1, fsdp=8, tensor=1, expert=1))
    parts = np.random.RandomState(3).randn(8, 16, 33).astype(np.float32)  # one per device

    def local(x):
        return sharding.reduce_scatter(x[0], ("fsdp",), 0)

    fn = jax.jit(
        jax.shard_map(
            local, mesh=mesh, in_specs=jax.P("fsdp"), out_specs=jax.P("fsdp"), check_vma=False
        )
    )
    text = fn.lower(parts).as_text()
    assert text.count("reduce_scatter") == 7
    np.testing.assert_allclose(fn(parts), parts.astype(np.float64).sum(0), rtol=1e-6, atol=1e-6)
