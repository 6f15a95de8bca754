"""Sampling a token per row from float32 logits, with per-row settings.

Every row has its own temperature (0: greedy), top_k (0: off), top_p (1: off) and seed;
the key of a row's draw is fold_in(key(seed), step), so a request's sample depends only
on its own seed and step, never on what else is in the batch. The Generator (one setting
for the whole batch) and the serving engine (one per slot) both sample here.

A row may also carry logit adjustments: (token id, amount) pairs added to its logits
before anything else (OpenAI's logit_bias and its frequency and presence penalties, which
the host turns into such pairs from the tokens the row has generated: slots.py). They are
sparse, [b, K] with K the batch's bucket of pairs; K = 0 (no row has any) adds nothing to
the program, so a batch without them pays nothing. Padding pairs add 0 to token 0.

And a row may be held to a grammar (constraints.py): `allowed` is a bitmask over the
vocabulary, [b, words] uint32, bit j of word i for token 32 i + j, which the host fills for
each constrained row (all ones for the others); 0 words when no row is constrained.

The vocabulary sort that top-k/top-p need, and the top-n log-probabilities, run under
`lax.cond` only when some row asks for them: a greedy batch pays for neither.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class SamplingRows(NamedTuple):
    """Per-row sampling settings, each an array [b]."""

    temperature: jax.Array  # float32; 0: greedy
    top_k: jax.Array  # int32; 0: off
    top_p: jax.Array  # float32; 1: off
    seed: jax.Array  # uint32
    step: jax.Array  # int32: which token of its request the row is drawing (0 first)
    adjust_ids: jax.Array  # int32 [b, K]: tokens whose logits are adjusted (K may be 0)
    adjust_by: jax.Array  # float32 [b, K]: what is added to each one's logit
    allowed: jax.Array  # uint32 [b, words]: the tokens a grammar allows (words may be 0)

    @staticmethod
    def broadcast(b: int, temperature=0.0, top_k=0, top_p=1.0, seed=0, step=0) -> SamplingRows:
        """One setting for every row (scalars or arrays that broadcast to [b]); no
        logit adjustments."""
        full = lambda x, dt: jnp.broadcast_to(jnp.asarray(x, dt), (b,))
        return SamplingRows(
            full(temperature, jnp.float32),
            full(top_k, jnp.int32),
            full(top_p, jnp.float32),
            full(seed, jnp.uint32),
            full(step, jnp.int32),
            jnp.zeros((b, 0), jnp.int32),
            jnp.zeros((b, 0), jnp.float32),
            jnp.zeros((b, 0), jnp.uint32),
        )


def adjusted(logits, rows: SamplingRows):
    """logits [b, V] with each row's (id, amount) pairs added (unchanged when K = 0)."""
    if rows.adjust_ids.shape[1] == 0:  # static: the program has no scatter at all
        return logits
    b = logits.shape[0]
    row = jnp.broadcast_to(jnp.arange(b)[:, None], rows.adjust_ids.shape)
    return logits.at[row, rows.adjust_ids].add(rows.adjust_by.astype(logits.dtype))


def _filter(x, top_k, top_p):
    """Logits with the tokens outside each row's top-k and top-p nucleus set to -inf."""
    sorted_x = jnp.sort(x, axis=-1)[:, ::-1]
    vocab = x.shape[-1]
    kth = jnp.take_along_axis(sorted_x, jnp.clip(top_k - 1, 0, vocab - 1)[:, None], axis=1)
    kth = jnp.where(top_k[:, None] > 0, kth, -jnp.inf)
    x = jnp.where(x < kth, -jnp.inf, x)
    sorted_x = jnp.where(sorted_x < kth, -jnp.inf, sorted_x)  # = sort of the filtered x
    probs = jax.nn.softmax(sorted_x, axis=-1)
    # keep the smallest prefix whose mass reaches top_p (always at least one token)
    # (top_p 1 keeps everything: rounding must not cut the tail of a top-k-only row)
    keep = (jnp.cumsum(probs, axis=-1) - probs < top_p[:, None]) | (top_p[:, None] >= 1.0)
    cutoff = jnp.min(jnp.where(keep, sorted_x, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(x < cutoff, -jnp.inf, x)


def masked(logits, rows: SamplingRows):
    """logits [b, V] with the tokens outside each row's `allowed` bits at -inf (unchanged
    when no row is constrained)."""
    if rows.allowed.shape[1] == 0:  # static, as in `adjusted`
        return logits
    b, vocab = logits.shape
    shifts = jnp.arange(32, dtype=jnp.uint32)
    bits = (rows.allowed[:, :, None] >> shifts) & 1  # [b, words, 32]: token 32 i + j
    return jnp.where(bits.reshape(b, -1)[:, :vocab] == 1, logits, -jnp.inf)


def sample(logits, rows: SamplingRows):
    """One token id per row [b] int32 from float32 logits [b, V], after each row's logit
    adjustments and within its grammar's tokens (greedy rows too: a bias of +100 makes a
    token certain)."""
    logits = masked(adjusted(logits, rows), rows)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw(logits):
        sampled = rows.temperature > 0
        x = logits / jnp.where(sampled, rows.temperature, 1.0)[:, None]
        filtering = jnp.any(sampled & ((rows.top_k > 0) | (rows.top_p < 1.0)))
        x = jax.lax.cond(filtering, _filter, lambda x, *_: x, x, rows.top_k, rows.top_p)
        keys = jax.vmap(lambda s, t: jax.random.fold_in(jax.random.key(s), t))(rows.seed, rows.step)
        drawn = jax.vmap(jax.random.categorical)(keys, x).astype(jnp.int32)
        return jnp.where(sampled, drawn, greedy)

    return jax.lax.cond(jnp.any(rows.temperature > 0), draw, lambda _: greedy, logits)


def logprobs(logits, tokens, want_top, top_n: int):
    """log p(token) per row under the temperature-1 distribution [b], and the top_n most
    likely ids with their log-probabilities ([b, top_n] each; computed only when some
    row's `want_top` [b] bool is set, else zeros)."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(logp, tokens[:, None], axis=1)[:, 0]
    if top_n == 0:
        empty = jnp.zeros((logits.shape[0], 0))
        return chosen, empty.astype(jnp.int32), empty

    def top(logp):
        values, ids = jax.lax.top_k(logp, top_n)
        return ids.astype(jnp.int32), values

    def none(logp):
        shape = (logp.shape[0], top_n)
        return jnp.zeros(shape, jnp.int32), jnp.zeros(shape, jnp.float32)

    ids, values = jax.lax.cond(jnp.any(want_top), top, none, logp)
    return chosen, ids, values
