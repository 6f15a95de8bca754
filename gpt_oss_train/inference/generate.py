"""Autoregressive generation: KV cache, chunked prefill, a compiled decode loop, sampling.

`Generator` exists beside the serving engine (engine.py) for offline batches of known
prompts (decode's generate, chat and benchmark modes): one compiled prefill and a compiled
decode loop on the device.

The cache is allocated once per call at a bucketed maximum length and updated in place
(scatter into donated buffers). Full-attention layers keep a slot per position; banded
layers keep a ring of `max(window, prefill_chunk)` slots, so their memory does not grow
with context. Prompts of different lengths share a batch: they are right-padded, padding
gets position -1 (never written, never attended to), and each row continues from its own
length.

    prefill   the prompt in fixed-size chunks (one compiled shape, any prompt length)
    decode    the whole token loop in one `lax.while_loop`: sample, stop per row on a
              stop token or the length limit, feed the token back. Compiled once per
              (batch, cache bucket, max_new_tokens).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from gpt_oss_train import runtime, sharding
from gpt_oss_train.inference import sampling as sampling_lib
from gpt_oss_train.model import kv_cache
from gpt_oss_train.model.transformer import DTYPES, ModelDef


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off


def cache_length(needed: int, minimum: int = 256) -> int:
    """Cache buckets: powers of two, so only a few shapes are ever compiled."""
    return max(minimum, 1 << max(0, needed - 1).bit_length())


def _sample(logits, seeds, step, sp: SamplingParams):
    """One token per row: sampling.sample with the batch's one setting."""
    rows = sampling_lib.SamplingRows.broadcast(
        logits.shape[0], sp.temperature, sp.top_k, sp.top_p, seeds, step
    )
    return sampling_lib.sample(logits, rows)


def _adapter_ids(ids, b: int) -> jax.Array:
    return jnp.zeros((b,), jnp.int32) if ids is None else jnp.asarray(ids, jnp.int32)


class Generator:
    """Holds compiled prefill/decode functions for one model and parameter tree."""

    def __init__(
        self,
        model_def: ModelDef,
        params,
        *,
        prefill_chunk: int = 256,
        int8_kv_cache: bool = False,
        on_token=None,
    ):
        """`on_token(tokens [b], live [b])`, if given, is called on the host with every
        step's sampled tokens while the compiled loop runs (an ordered io_callback): the
        hook for streaming output."""
        self.md = model_def
        self.cfg = model_def.cfg
        self.params = params
        self.chunk = prefill_chunk
        self.ring = max(self.cfg.sliding_window, prefill_chunk)
        self.int8_kv = int8_kv_cache
        self.dtype = DTYPES[self.cfg.dtype]
        self.on_token = on_token
        options = runtime.inference_compiler_options(sharding.platform())
        self._prefill = jax.jit(self._prefill_chunk, donate_argnums=(1,), compiler_options=options)
        self._decode = jax.jit(
            self._decode_loop,
            donate_argnums=(1,),
            static_argnames=("max_new", "sampling"),
            compiler_options=options,
        )

    # -- compiled pieces --------------------------------------------------------------

    def _prefill_chunk(self, params, cache, tokens, positions, adapter_ids):
        model = self.md.bind(params)
        hidden, _, cache = model(
            tokens, positions, (positions >= 0).astype(jnp.int32), cache, adapter_ids
        )
        return hidden, cache

    def _logits(self, params, hidden_bd):
        model = self.md.bind(params)
        return model.logits(hidden_bd[:, None])[:, 0]

    def _decode_loop(
        self,
        params,
        cache,
        last_hidden,
        next_pos,
        limit,
        seeds,
        stop_ids,
        adapter_ids,
        *,
        max_new,
        sampling,
    ):
        """From the prompt's last hidden state, generate up to max_new tokens per row.
        Returns (tokens [b, max_new], logprobs [b, max_new], lengths [b], stop reason codes,
        cache). The cache comes back so its donated buffers are updated in place."""
        model = self.md.bind(params)
        b = last_hidden.shape[0]
        logits0 = self._logits(params, last_hidden)

        def cond(s):
            return (s["step"] < max_new) & ~jnp.all(s["done"])

        def body(s):
            logits = s["logits"]
            tok = _sample(logits, seeds, s["step"], sampling)
            logp = sampling_lib.logprobs(logits, tok, None, top_n=0)[0]
            live = ~s["done"]
            if self.on_token is not None:
                io_callback(self.on_token, None, tok, live, ordered=True)
            tokens = s["tokens"].at[:, s["step"]].set(jnp.where(live, tok, 0))
            logprobs = s["logprobs"].at[:, s["step"]].set(jnp.where(live, logp, 0.0))
            lengths = s["lengths"] + live.astype(jnp.int32)
            hit_stop = jnp.any(tok[:, None] == stop_ids[None, :], axis=-1)
            full = s["pos"] + 1 >= limit  # no room to feed this token back
            reason = jnp.where(live & hit_stop, 1, jnp.where(live & full, 2, s["reason"]))
            done = s["done"] | hit_stop | full
            pos = jnp.where(done, -1, s["pos"])  # finished rows stop writing to the cache
            hidden, _, cache = model(
                tok[:, None],
                pos[:, None],
                (pos[:, None] >= 0).astype(jnp.int32),
                s["cache"],
                adapter_ids,
            )
            return dict(
                step=s["step"] + 1,
                cache=cache,
                logits=self._logits(params, hidden[:, 0]),
                pos=jnp.where(done, s["pos"], s["pos"] + 1),
                done=done,
                tokens=tokens,
                logprobs=logprobs,
                lengths=lengths,
                reason=reason,
            )

        state = dict(
            step=jnp.int32(0),
            cache=cache,
            logits=logits0,
            pos=next_pos,
            done=jnp.zeros(b, bool),
            tokens=jnp.zeros((b, max_new), jnp.int32),
            logprobs=jnp.zeros((b, max_new), jnp.float32),
            lengths=jnp.zeros(b, jnp.int32),
            reason=jnp.zeros(b, jnp.int32),
        )
        out = jax.lax.while_loop(cond, body, state)
        results = sharding.host_readable(
            (out["tokens"], out["logprobs"], out["lengths"], out["reason"])
        )
        return (*results, out["cache"])

    # -- public API ---------------------------------------------------------------------

    def prefill(self, prompts: Sequence[Sequence[int]], max_len: int, adapter_ids=None):
        """Runs the prompts through the model; returns (cache, last hidden [b, d], lengths).
        adapter_ids [b]: the stacked adapter each row uses (model/lora.py; default 0)."""
        b = len(prompts)
        adapter_ids = _adapter_ids(adapter_ids, b)
        lengths = np.array([len(p) for p in prompts], np.int32)
        if lengths.min() < 1:
            raise ValueError("every prompt needs at least one token")
        padded = -(-int(lengths.max()) // self.chunk) * self.chunk
        tokens = np.zeros((b, padded), np.int32)
        positions = np.full((b, padded), -1, np.int32)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = p
            positions[i, : len(p)] = np.arange(len(p))
        cache = kv_cache.init(self.cfg, b, max_len, self.ring, self.dtype, self.int8_kv)
        last = None
        for start in range(0, padded, self.chunk):
            sl = slice(start, start + self.chunk)
            hidden, cache = self._prefill(
                self.params,
                cache,
                jnp.asarray(tokens[:, sl]),
                jnp.asarray(positions[:, sl]),
                adapter_ids,
            )
            # rows whose last prompt token is in this chunk: keep its hidden state
            idx = np.clip(lengths - 1 - start, 0, self.chunk - 1)
            here = (lengths - 1 >= start) & (lengths - 1 < start + self.chunk)
            h = hidden[jnp.arange(b), jnp.asarray(idx)]
            last = h if last is None else jnp.where(jnp.asarray(here)[:, None], h, last)
        return cache, last, lengths

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        stop_ids: Sequence[int],
        sampling: SamplingParams = SamplingParams(),
        seeds: Sequence[int] | None = None,
        max_len: int | None = None,
        adapter_ids: Sequence[int] | None = None,
    ) -> list[dict]:
        """Generates for a batch of token prompts. Returns one dict per prompt: tokens,
        logprobs (log p of each generated token under the model, temperature 1),
        stop_reason ('stop' | 'length')."""
        longest = max(len(p) for p in prompts)
        max_len = max_len or cache_length(longest + max_new_tokens)
        if longest + 1 > max_len:
            raise ValueError(f"prompt of {longest} tokens does not fit the cache of {max_len}")
        cache, last, lengths = self.prefill(prompts, max_len, adapter_ids)
        return self.decode(
            cache,
            last,
            lengths,
            max_len=max_len,
            max_new_tokens=max_new_tokens,
            stop_ids=stop_ids,
            sampling=sampling,
            seeds=seeds,
            adapter_ids=adapter_ids,
        )

    def decode(
        self,
        cache,
        last,
        lengths,
        *,
        max_len: int,
        max_new_tokens: int,
        stop_ids: Sequence[int],
        sampling: SamplingParams = SamplingParams(),
        seeds: Sequence[int] | None = None,
        adapter_ids: Sequence[int] | None = None,
    ) -> list[dict]:
        """The token loop of `generate`, from what `prefill(prompts, max_len)` returned; a
        separate step so callers can time prefill and decode apart (decode/benchmarking.py).
        The cache is donated: it cannot be used again."""
        seeds = list(seeds) if seeds is not None else [0] * len(lengths)
        # A row may not grow past the cache (full layers hold one slot per position).
        limit = jnp.asarray(np.minimum(lengths + max_new_tokens, max_len), jnp.int32)
        toks, logps, n, reason, _ = self._decode(
            self.params,
            cache,
            last,
            jnp.asarray(lengths),
            limit,
            jnp.asarray(seeds, jnp.uint32),
            jnp.asarray(sorted(set(stop_ids)) or [-1], jnp.int32),
            _adapter_ids(adapter_ids, len(lengths)),
            max_new=max_new_tokens,
            sampling=sampling,
        )
        toks, logps, n, reason = jax.device_get((toks, logps, n, reason))
        return [
            dict(
                tokens=toks[i, : n[i]].tolist(),
                logprobs=logps[i, : n[i]].tolist(),
                stop_reason="stop" if reason[i] == 1 else "length",
            )
            for i in range(len(lengths))
        ]
