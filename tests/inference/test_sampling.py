"""Per-row sampling (inference/sampling.py) against numpy: the distributions it draws
from, top-k / top-p filtering, and rows that do not influence each other."""

import jax.numpy as jnp
import numpy as np

from gpt_oss_train.inference.sampling import SamplingRows, logprobs, sample

PROBS = np.array([0.5, 0.3, 0.15, 0.05])
LOGITS = jnp.log(jnp.asarray(PROBS, jnp.float32))


def _draws(n, **kw):
    """n draws of one distribution in one call: row i is step i of seed 0."""
    rows = SamplingRows.broadcast(n, step=jnp.arange(n), **kw)
    return np.asarray(sample(jnp.broadcast_to(LOGITS, (n, 4)), rows))


def _frequencies(draws):
    return np.bincount(draws, minlength=4) / len(draws)


def test_temperature_draws_from_the_tempered_softmax():
    ref = PROBS**0.5 / np.sum(PROBS**0.5)  # temperature 2
    # 8000 draws: a frequency's standard deviation is at most 0.0056; 0.025 is 4.5 of it
    np.testing.assert_allclose(_frequencies(_draws(8000, temperature=2.0)), ref, atol=0.025)


def test_top_p_keeps_the_nucleus_and_top_k_the_k_best():
    nucleus = _frequencies(_draws(4000, temperature=1.0, top_p=0.7))  # 0.5 + 0.3 reach 0.7
    np.testing.assert_allclose(nucleus, [0.625, 0.375, 0, 0], atol=0.03)
    top2 = _frequencies(_draws(4000, temperature=1.0, top_k=2))
    np.testing.assert_allclose(top2, [0.625, 0.375, 0, 0], atol=0.03)
    assert set(_draws(200, temperature=1.0, top_k=1)) == {0}
    assert set(_draws(50, temperature=0.0, top_p=0.1)) == {0}  # greedy ignores the filters


def test_a_row_samples_the_same_whatever_its_neighbours():
    rng = np.random.RandomState(0)
    logits = jnp.asarray(rng.randn(5, 50), jnp.float32)
    settings = [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.5), (1.0, 3, 0.9)]
    t, k, p = (np.array(c) for c in zip(*settings))
    seeds, steps = np.array([1, 2, 3, 4, 5]), np.array([0, 7, 2, 9, 4])
    batch = sample(logits, SamplingRows.broadcast(5, t, k, p, seeds, steps))
    alone = [
        int(sample(logits[i : i + 1], SamplingRows.broadcast(1, *s, seeds[i], steps[i]))[0])
        for i, s in enumerate(settings)
    ]
    assert np.asarray(batch).tolist() == alone
    assert alone[0] == int(np.argmax(logits[0]))


def test_logprobs_and_top_alternatives_match_numpy():
    rng = np.random.RandomState(1)
    x = rng.randn(3, 40) * 3
    ref = x - np.log(np.sum(np.exp(x), axis=1, keepdims=True))  # float64 log-softmax
    tokens = np.array([4, 17, 39])
    chosen, ids, values = logprobs(
        jnp.asarray(x, jnp.float32), jnp.asarray(tokens), jnp.array([True, False, False]), 5
    )
    np.testing.assert_allclose(chosen, ref[np.arange(3), tokens], atol=1e-5)
    best = np.argsort(-ref, axis=1)[:, :5]
    assert np.asarray(ids).tolist() == best.tolist()
    np.testing.assert_allclose(values, np.take_along_axis(ref, best, 1), atol=1e-5)
    _, ids, values = logprobs(
        jnp.asarray(x, jnp.float32), jnp.asarray(tokens), jnp.zeros(3, bool), 5
    )
    assert not np.any(np.asarray(values)) and not np.any(np.asarray(ids))  # nobody asked
