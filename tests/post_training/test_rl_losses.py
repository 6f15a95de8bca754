"""DPO and GRPO objectives (training/rl_losses.py) and GRPO's group advantages
(post_training/rollouts.py): values, statistics and gradients in float32 JAX against
float64 numpy references written here from the formulas, the exactness of summing
microbatches, and the argument checks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gpt_oss_train.post_training.rollouts import group_advantages
from gpt_oss_train.training import rl_losses as rl

TIGHT = dict(rtol=1e-5, atol=1e-7)


def _logsigmoid(x):
    return -np.logaddexp(0.0, -x)


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


# ----------------------------------------------------------------------------- DPO


def _dpo_inputs(seed=0, b=6):
    rng = np.random.RandomState(seed)
    # Sequence log-probs of a few dozen tokens: large and negative, as in practice.
    pi_c, pi_r, ref_c, ref_r = (rng.randn(4, b) * 4.0 - 60.0).astype(np.float32)
    return pi_c, pi_r, ref_c, ref_r


@pytest.mark.parametrize("ls", [0.0, 0.2])
@pytest.mark.parametrize("padded", [False, True])
def test_dpo_values_stats_and_gradients_match_float64(ls, padded):
    beta = 0.1
    pi_c, pi_r, ref_c, ref_r = _dpo_inputs()
    w = np.array([1, 1, 0, 1, 1, 0] if padded else [1] * 6, np.float32)
    weights = jnp.asarray(w) if padded else None

    def f(*xs):
        loss, count, stats = rl.dpo_sums(*xs, beta=beta, label_smoothing=ls, weights=weights)
        return loss, (count, stats)

    inputs = map(jnp.asarray, (pi_c, pi_r, ref_c, ref_r))
    (loss, (count, stats)), grads = jax.value_and_grad(f, (0, 1, 2, 3), has_aux=True)(*inputs)

    c, r, rc, rr, w = (x.astype(np.float64) for x in (pi_c, pi_r, ref_c, ref_r, w))
    cr, rj = beta * (c - rc), beta * (r - rr)
    z = cr - rj  # beta * h
    per_pair = -(1 - ls) * _logsigmoid(z) - ls * _logsigmoid(-z)
    np.testing.assert_allclose(loss, np.sum(w * per_pair), **TIGHT)
    assert float(count) == w.sum()
    want = dict(
        chosen_reward=cr,
        rejected_reward=rj,
        margin=z,
        accuracy=(cr > rj).astype(np.float64),
        chosen_logp=c,
        rejected_logp=r,
    )
    assert 0 < want["accuracy"].sum() < len(w)  # both outcomes occur
    for k, v in want.items():
        np.testing.assert_allclose(stats[k], np.sum(w * v), rtol=1e-5, atol=1e-5, err_msg=k)

    # d/dh of the loss per pair, times d(beta h)/dh = beta.
    dz = -(1 - ls) * _sigmoid(-z) + ls * _sigmoid(z)
    np.testing.assert_allclose(grads[0], w * beta * dz, **TIGHT)
    np.testing.assert_allclose(grads[1], -w * beta * dz, **TIGHT)
    assert not np.any(grads[2]) and not np.any(grads[3])  # the reference is a constant


def test_sequence_logprobs_sums_masked_tokens_and_ignores_garbage():
    rng = np.random.RandomState(1)
    lp = rng.randn(3, 5).astype(np.float32)
    mask = np.array([[1, 1, 1, 0, 0], [1, 0, 1, 1, 1], [0, 0, 0, 0, 0]], bool)
    lp[~mask] = -np.inf  # what must not leak through the mask
    got = rl.sequence_logprobs(jnp.asarray(lp), jnp.asarray(mask))
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, np.where(mask, lp.astype(np.float64), 0).sum(1), **TIGHT)


# ----------------------------------------------------------------------------- GRPO


def test_group_advantages_match_float64():
    rng = np.random.RandomState(2)
    r = rng.rand(12).astype(np.float32)
    r[8:] = 0.5  # a group of equal rewards: A = 0 either way
    g = r.astype(np.float64).reshape(3, 4)
    centred = g - g.mean(1, keepdims=True)
    scaled = centred / (g.std(1, ddof=1, keepdims=True) + 1e-4)
    for scale, want in ((False, centred), (True, scaled)):
        got = group_advantages(jnp.asarray(r), 4, scale=scale)
        np.testing.assert_allclose(got, want.reshape(-1), rtol=1e-5, atol=1e-6)
        assert not np.any(np.asarray(got)[8:])


B, S = 8, 7
LENGTHS = [7, 5, 3, 1, 0, 6, 7, 4]  # row 4 is an all-masked padding row
EL, EH = 0.2, 0.28  # asymmetric, as DAPO's clip-higher, so swapping them shows


def _grpo_inputs(seed=3):
    rng = np.random.RandomState(seed)
    old = (rng.randn(B, S) * 0.5 - 2.0).astype(np.float32)
    delta = rng.uniform(-0.6, 0.6, (B, S))  # log-ratios; the band is about (-0.22, 0.25)
    logp = (old + delta).astype(np.float32)
    ref = (logp + rng.randn(B, S) * 0.3).astype(np.float32)
    adv = rng.randn(B).astype(np.float32)
    mask = np.arange(S)[None, :] < np.array(LENGTHS)[:, None]
    return logp, old, adv, mask, ref


def _np_grpo(logp, old, adv, mask, ref, kl_coef, averaging, length, el=EL, eh=EH):
    """Mean GRPO loss and per-token terms, in float64, straight from the formulas."""
    logp, old, adv, ref = (np.asarray(x, np.float64) for x in (logp, old, adv, ref))
    ratio, a = np.exp(logp - old), adv[:, None]
    surr = -np.minimum(ratio * a, np.clip(ratio, 1 - el, 1 + eh) * a)
    kl = np.exp(ref - logp) - (ref - logp) - 1
    per_token = np.where(mask, surr + kl_coef * kl, 0.0)
    n, rows = mask.sum(1), mask.sum(1) > 0
    if averaging == "sequence":
        loss = np.mean(per_token.sum(1)[rows] / n[rows])
    elif averaging == "token":
        loss = per_token.sum() / mask.sum()
    else:
        loss = per_token.sum() / (rows.sum() * (length or S))
    clipped = ((ratio < 1 - el) & (a < 0)) | ((ratio > 1 + eh) & (a > 0))
    return loss, ratio, kl, clipped


def _jax_grpo(averaging, length, kl_coef, with_ref=True):
    def f(logp, old, adv, mask, ref):
        return rl.grpo_sums(
            logp,
            old,
            adv,
            mask,
            ref_logp=ref if with_ref else None,
            kl_coef=kl_coef,
            epsilon_low=EL,
            epsilon_high=EH,
            averaging=averaging,
            max_completion_length=length,
        )

    return jax.jit(f)


def test_grpo_test_data_reaches_every_branch():
    logp, old, adv, mask, _ = _grpo_inputs()
    ratio, a = np.exp(logp - old.astype(np.float64)), np.broadcast_to(adv[:, None], mask.shape)
    for out in (ratio < 1 - EL, ratio > 1 + EH, (ratio >= 1 - EL) & (ratio <= 1 + EH)):
        for sign in (a < 0, a > 0):  # clipped (zero gradient) and unclipped outside the band
            assert np.sum(out & sign & mask) >= 2


@pytest.mark.parametrize("kl_coef", [0.0, 0.05])
@pytest.mark.parametrize(
    "averaging,length", [("sequence", None), ("token", None), ("dr_grpo", None), ("dr_grpo", 10)]
)
def test_grpo_values_stats_and_gradients_match_float64(averaging, length, kl_coef):
    logp, old, adv, mask, ref = _grpo_inputs()
    f = _jax_grpo(averaging, length, kl_coef)
    args = tuple(map(jnp.asarray, (logp, old, adv, mask, ref)))
    loss_sum, norm, stats = f(*args)
    want, ratio, kl, clipped = _np_grpo(logp, old, adv, mask, ref, kl_coef, averaging, length)
    np.testing.assert_allclose(loss_sum / norm, want, **TIGHT)
    rows = float(np.sum(mask.sum(1) > 0))
    n_want = {"sequence": rows, "token": mask.sum(), "dr_grpo": rows * (length or S)}
    assert float(norm) == n_want[averaging]
    assert float(stats["tokens"]) == mask.sum() and float(stats["sequences"]) == rows
    assert float(stats["clipped"]) == np.sum(clipped & mask) > 0
    np.testing.assert_allclose(stats["ratio"], np.sum(ratio * mask), **TIGHT)
    np.testing.assert_allclose(stats["kl"], np.sum(kl * mask), rtol=1e-5, atol=1e-6)

    grad = jax.grad(lambda lp: (lambda l, n, _: l / n)(*f(lp, *args[1:])))(args[0])
    h, lp64, fd = 1e-6, logp.astype(np.float64), np.zeros((B, S))
    for i in np.ndindex(B, S):  # central differences of the float64 reference
        up, down = lp64.copy(), lp64.copy()
        up[i] += h
        down[i] -= h
        fd[i] = (
            _np_grpo(up, old, adv, mask, ref, kl_coef, averaging, length)[0]
            - _np_grpo(down, old, adv, mask, ref, kl_coef, averaging, length)[0]
        ) / (2 * h)
    np.testing.assert_allclose(grad, fd, rtol=1e-5, atol=1e-8)
    if kl_coef == 0:  # a clipped token has no gradient
        assert not np.any(np.asarray(grad)[clipped])


@pytest.mark.parametrize("averaging", rl.AVERAGINGS)
def test_grpo_gradient_on_policy_is_minus_advantage_over_normalizer(averaging):
    """Sanity anchor by hand: with logp == old_logp the ratio is 1, nothing is clipped and
    d loss / d logp = -A for every token, divided by what the averaging divides by."""
    logp, _, adv, mask, _ = _grpo_inputs()
    f = _jax_grpo(averaging, None, 0.0, with_ref=False)
    grad = jax.grad(lambda lp: (lambda l, n, _: l / n)(*f(lp, lp, adv, mask, None)))(logp)
    n, rows = mask.sum(1), float(np.sum(mask.sum(1) > 0))
    divisor = {"sequence": rows * np.maximum(n, 1), "token": mask.sum(), "dr_grpo": rows * S}
    want = -adv[:, None] * mask / np.reshape(divisor[averaging], (-1, 1))
    np.testing.assert_allclose(grad, want, **TIGHT)


@pytest.mark.parametrize("averaging", rl.AVERAGINGS)
def test_grpo_microbatch_sums_equal_the_whole_batch(averaging):
    logp, old, adv, mask, ref = map(jnp.asarray, _grpo_inputs())
    f = _jax_grpo(averaging, None, 0.05)

    def split(lp, cut=3):  # uneven halves; the padding row lands in the second
        (l1, n1, s1), (l2, n2, s2) = (
            f(lp[i], old[i], adv[i], mask[i], ref[i]) for i in (slice(0, cut), slice(cut, B))
        )
        return (l1 + l2) / (n1 + n2), jax.tree.map(jnp.add, s1, s2)

    def whole(lp):
        l, n, s = f(lp, old, adv, mask, ref)
        return l / n, s

    (v_split, s_split), g_split = jax.value_and_grad(split, has_aux=True)(logp)
    (v_whole, s_whole), g_whole = jax.value_and_grad(whole, has_aux=True)(logp)
    np.testing.assert_allclose(v_split, v_whole, rtol=1e-6)
    np.testing.assert_allclose(g_split, g_whole, rtol=1e-6, atol=1e-9)
    for k in s_whole:
        np.testing.assert_allclose(s_split[k], s_whole[k], rtol=1e-6, err_msg=k)


def test_bad_arguments_raise_one_clear_line():
    logp, old, adv, mask, _ = _grpo_inputs()
    with pytest.raises(ValueError, match="averaging must be one of"):
        rl.grpo_sums(logp, old, adv, mask, averaging="grpo")
    with pytest.raises(ValueError, match="needs ref_logp"):
        rl.grpo_sums(logp, old, adv, mask, kl_coef=0.1)
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages(jnp.zeros(10), 4)
