"""Per-token log-probabilities of given token sequences under a loaded model (and a
stacked adapter slot): decode's `score` mode and the engine's `score`.
"""

from __future__ import annotations

import jax
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
