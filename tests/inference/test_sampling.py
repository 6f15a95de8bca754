"""Per-row sampling (inference/sampling.py) against numpy: the distributions it draws
from, top-k / top-p filtering, and rows that do not influence each other."""

import jax.numpy as jnp
import numpy as np

from gpt_oss_train.inference import rounds
from gpt_oss_train.inference.handles import RequestHandle, RequestParams
from gpt_oss_train.inference.sampling import SamplingRows, logprobs, sample
from gpt_oss_train.inference.slots import IDLE_ROW, Active, sampling_settings

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


def _adjusted_rows(n, ids, by, **kw):
    rows = SamplingRows.broadcast(n, step=jnp.arange(n), **kw)
    ids = jnp.broadcast_to(jnp.asarray(ids, jnp.int32), (n, len(ids)))
    by = jnp.broadcast_to(jnp.asarray(by, jnp.float32), (n, len(by)))
    return rows._replace(adjust_ids=ids, adjust_by=by)


def test_logit_adjustments_shift_the_distribution_drawn_from():
    """Pairs (id, amount) add to the logits: the draws follow softmax(log p + amounts)
    (numpy), a padding pair (0, 0) changes nothing, and +-100 decide greedy rows."""
    adds = np.array([0.0, -1.0, 2.0, 0.0])
    ref = PROBS * np.exp(adds) / np.sum(PROBS * np.exp(adds))
    rows = _adjusted_rows(8000, [1, 2, 0], [-1.0, 2.0, 0.0], temperature=1.0)
    draws = np.asarray(sample(jnp.broadcast_to(LOGITS, (8000, 4)), rows))
    np.testing.assert_allclose(_frequencies(draws), ref, atol=0.025)
    greedy = lambda ids, by: set(
        np.asarray(sample(jnp.broadcast_to(LOGITS, (50, 4)), _adjusted_rows(50, ids, by)))
    )
    assert greedy([3], [100.0]) == {3}  # the least likely token, made certain
    assert greedy([0], [-100.0]) == {1}  # the most likely, never
    sampled = _adjusted_rows(2000, [0, 1, 2], [-100.0, -100.0, -100.0], temperature=1.5)
    assert set(np.asarray(sample(jnp.broadcast_to(LOGITS, (2000, 4)), sampled))) == {3}


def test_penalties_become_adjustments_from_the_generated_counts():
    """slots.Active.adjustments: OpenAI's definition, by hand: logit_bias, minus, for each
    generated token, count x frequency_penalty + presence_penalty (prompt not counted)."""
    params = RequestParams(
        logit_bias=((7, 5.0), (9, -3.0)), frequency_penalty=0.5, presence_penalty=0.25
    )
    a = Active(RequestHandle(0, [9, 9, 4], lambda: None), params, 1, slot=0, order=0, names=[])
    for t in (4, 7, 4, 4):
        a.generated(t, -1.0, [])
    assert a.adjustments() == {7: 5.0 - 0.5 - 0.25, 9: -3.0, 4: -3 * 0.5 - 0.25}
    rows = sampling_settings([a.settings(), IDLE_ROW], 4)
    assert rows.adjust_ids.shape == rows.adjust_by.shape == (4, 16)  # the smallest width
    got = dict(zip(rows.adjust_ids[0].tolist()[:3], rows.adjust_by[0].tolist()[:3]))
    assert got == a.adjustments() and not np.any(rows.adjust_by[1:])
    plain = sampling_settings([IDLE_ROW], 2)
    assert plain.adjust_ids.shape == (2, 0)  # nobody adjusts: nothing in the program


def test_adjusted_settings_reach_the_other_processes_whole():
    """A decode round's settings, adjustments included, survive the multi-host message
    (rounds.encode / decode) bit for bit; without adjustments they stay 0 wide."""
    params = RequestParams(logit_bias=((3, 1.5), (250, -100.0)), presence_penalty=0.5)
    a = Active(RequestHandle(0, [1, 2], lambda: None), params, 9, slot=1, order=0, names=[])
    a.generated(17, -2.0, [])
    adjusted = sampling_settings([IDLE_ROW, a.settings()], 4)
    for settings in (adjusted, sampling_settings([], 2)):
        sent = rounds.Round([rounds.Call("decode", (np.arange(4), settings), {"rows": 4})])
        (call,) = rounds.decode(rounds.encode(sent)).calls
        for got, want in zip(call.args[1], settings):
            assert got.dtype == want.dtype and np.array_equal(got, want)
