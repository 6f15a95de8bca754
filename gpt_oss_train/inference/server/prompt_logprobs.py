"""The most likely tokens at every prompt position, for `echo` with `logprobs=k`.

`engine.score` gives the prompt tokens' own log-probabilities (decode's numbers); OpenAI's
echo also lists the k most likely tokens at each position, which harnesses use to tell
whether a continuation is the greedy one. One forward pass over the prompt, then the
unembedding a block of positions at a time, so [positions, vocab] logits never exist at
once. Compiled once per padded length (powers of two); k is always MAX_TOP_LOGPROBS and
sliced after.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from gpt_oss_train.inference.server.schemas import MAX_TOP_LOGPROBS

BLOCK = 128  # positions unembedded together


def _top_fn(model):
    md = model.md

    def top(params, tokens_1s, adapter_ids):
        s = tokens_1s.shape[1]
        positions = jnp.arange(s, dtype=jnp.int32)[None]
        net = md.bind(params)
        # Padding after the prompt is harmless: attention is causal.
        hidden, _, _ = net(tokens_1s, positions, jnp.ones_like(tokens_1s), None, adapter_ids)
        blocks = hidden[0].reshape(s // BLOCK, BLOCK, -1)

        def one(h_cd):
            logp = jax.nn.log_softmax(net.logits(h_cd[None])[0], axis=-1)
            return jax.lax.top_k(logp, MAX_TOP_LOGPROBS)

        vals, ids = jax.lax.map(one, blocks)
        return vals.reshape(s, -1), ids.reshape(s, -1)

    return jax.jit(top)


def top_logprobs(
    model, prompt: list[int], k: int, adapter: int = 0
) -> list[list[tuple[int, float]]]:
    """For i in [0, n-1): the k most likely (id, logprob) for the token after prompt[:i+1],
    under stacked adapter slot `adapter` (inference/adapters.py)."""
    n = len(prompt)
    width = max(BLOCK, 1 << (n - 1).bit_length())
    tokens = np.zeros((1, width), np.int32)
    tokens[0, :n] = prompt
    fn = model.kept("prompt_top_logprobs", lambda: _top_fn(model))
    with model.scope():
        vals, ids = jax.device_get(
            fn(model.params, jnp.asarray(tokens), jnp.full(1, adapter, jnp.int32))
        )
    return [[(int(t), float(v)) for t, v in zip(ids[i, :k], vals[i, :k])] for i in range(n - 1)]
