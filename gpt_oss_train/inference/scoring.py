"""Per-token log-probabilities of given token sequences under a loaded model (and a
stacked adapter slot): decode's `score` mode and the engine's `score`; and the most likely
tokens at every prompt position (the server's `echo` with `logprobs=k`).

Each is a compiled function of (params, host inputs) with its inputs and its unpacking
apart, so a multi-host engine can send the inputs to every process and run the function
there in one of its rounds (engine_loop.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from gpt_oss_train import sharding
from gpt_oss_train.inference.loading import LoadedModel, pow2_at_least
from gpt_oss_train.model.logprobs import token_logprobs
from gpt_oss_train.model.transformer import DTYPES


def score_fn(model: LoadedModel):
    """jit(params, inputs, targets, positions, segment_ids, adapter_ids) -> log p(target)
    [b, s]; adapter_ids [b]: each row's stacked adapter (inference/adapters.py)."""
    md, chunk = model.md, model.config.train.loss_chunk_size
    dtype = DTYPES[model.cfg.dtype]

    def score(params, inputs, targets, positions, segment_ids, adapter_ids):
        hidden, _, _ = md.bind(params)(inputs, positions, segment_ids, None, adapter_ids)
        logp, _ = token_logprobs(
            hidden, params["unembed"]["kernel"], targets, chunk=chunk, dtype=dtype
        )
        return sharding.host_readable(logp)

    return jax.jit(score)


def job(model: LoadedModel, op: str):
    """The compiled function of JOBS[op] for `model` (made once, kept on the model)."""
    return model.kept(("job", op), lambda: JOBS[op](model))


def score_inputs(seqs: list[tuple[int, ...]], rows: int, adapter: int = 0) -> tuple:
    """score_fn's inputs after the params (inputs, targets, positions, segment_ids,
    adapter_ids) for `rows` rows holding `seqs`: rows are padded (segment 0) to a
    power-of-two length, as training pads."""
    width = max(16, pow2_at_least(max(len(s) - 1 for s in seqs)))
    arrays = {
        k: np.zeros((rows, width), np.int32)
        for k in ("inputs", "targets", "positions", "segment_ids")
    }
    for i, s in enumerate(seqs):
        n = len(s) - 1
        arrays["inputs"][i, :n] = s[:-1]
        arrays["targets"][i, :n] = s[1:]
        arrays["positions"][i, :n] = np.arange(n)
        arrays["segment_ids"][i, :n] = 1
    return (*arrays.values(), np.full(rows, adapter, np.int32))


def unpad(logp, seqs: list[tuple[int, ...]]) -> list:
    """score_fn's [rows, width] output -> each sequence's n-1 log-probabilities."""
    return [logp[i, : len(s) - 1] for i, s in enumerate(seqs)]


def score_batch(
    model: LoadedModel, fn, seqs: list[tuple[int, ...]], rows: int, adapter: int = 0
) -> list:
    """log p(t[i+1] | t[:i+1]) for each sequence (under stacked adapter slot `adapter`),
    as float32 numpy arrays of n-1 values."""
    with model.scope():
        logp = jax.device_get(fn(model.params, *score_inputs(seqs, rows, adapter)))
    return unpad(logp, seqs)


# ---------------------------------------------------------------- top tokens at each position

MAX_TOP_LOGPROBS = 20  # the most alternatives a request may ask for at each position
BLOCK = 128  # positions unembedded together


def top_fn(model: LoadedModel):
    """jit(params, tokens [1, s], adapter_ids [1]) -> (log-probs, ids) [s, MAX_TOP_LOGPROBS]
    of the most likely next tokens at each position. One forward pass over the prompt,
    then the unembedding a block of positions at a time, so [positions, vocab] logits
    never exist at once. Compiled once per padded length (powers of two)."""
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
        return sharding.host_readable((vals.reshape(s, -1), ids.reshape(s, -1)))

    return jax.jit(top)


def top_inputs(prompt: list[int], adapter: int = 0) -> tuple:
    """top_fn's inputs after the params: the prompt padded to a power of two (>= BLOCK)."""
    n = len(prompt)
    tokens = np.zeros((1, max(BLOCK, 1 << (n - 1).bit_length())), np.int32)
    tokens[0, :n] = prompt
    return tokens, np.full(1, adapter, np.int32)


def top_unpack(out, n: int, k: int) -> list[list[tuple[int, float]]]:
    """top_fn's output -> for i in [0, n-1): the k most likely (id, logprob)."""
    vals, ids = out
    return [[(int(t), float(v)) for t, v in zip(ids[i, :k], vals[i, :k])] for i in range(n - 1)]


def top_logprobs(
    model: LoadedModel, prompt: list[int], k: int, adapter: int = 0
) -> list[list[tuple[int, float]]]:
    """For i in [0, n-1): the k most likely (id, logprob) for the token after prompt[:i+1],
    under stacked adapter slot `adapter` (inference/adapters.py)."""
    with model.scope():
        out = jax.device_get(job(model, "top")(model.params, *top_inputs(prompt, adapter)))
    return top_unpack(out, len(prompt), k)


# The engine's device calls beside its slots, by name: what a multi-host engine runs in
# a round (engine_loop.py) when the server asks for them.
JOBS = {"score": score_fn, "top": top_fn}
