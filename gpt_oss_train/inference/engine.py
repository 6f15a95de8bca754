"""The serving engine: continuous batching over a fixed number of decode slots.

It exists beside `Generator` (generate.py, offline batches of known prompts) for requests
that arrive at any time: continuous batching, a prefix cache and streamed tokens.

    engine = Engine.from_checkpoint("runs/cpu_tiny", max_slots=8, max_context=4096)
    engine.start()                                   # compiles every shape, then serves
    handle = engine.submit(prompt_ids, RequestParams(max_tokens=64, temperature=0.7))
    for event in handle: ...                         # TokenEvents as they are sampled
    engine.stop()

Requests wait in a bounded queue and take a slot (a row of the KV cache) as soon as
one is free. A background thread repeats one round: admit waiting requests (each
slot's cache emptied, a cached prompt prefix copied in), prefill one chunk of the
oldest admitted prompt, then one decode step for every slot that is generating, each
with its own position, sampling settings, stop ids and length limit. So a long prompt
is prefilled between decode steps and never stalls the streams already running, and a
finished request frees its slot at once. See engine_steps.py for the compiled
functions, slots.py for the host-side bookkeeping, prefix_cache.py for prefix reuse.

Greedy results equal `decode --mode=generate` of each prompt alone, and a seeded
sample depends on its own seed only, whatever else is batched with it.

LoRA adapters (`adapters=[(name, folder)]`, as decode's --adapter) sit beside the base,
never merged. One unnamed adapter serves every request; named ones are stacked and each
request picks one by `RequestParams.adapter` (None: the base). Every slot carries its
request's adapter into the compiled steps, so requests for different adapters and for
the base are batched together; the prefix cache keys blocks by adapter too.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
import os
import queue
import threading
import time
from typing import Sequence

import jax
from absl import logging

from gpt_oss_train import runtime
from gpt_oss_train.hosts import Link
from gpt_oss_train.inference import adapters as adapters_lib
from gpt_oss_train.inference import constraints, loading, scoring
from gpt_oss_train.inference.engine_loop import EngineLoop
from gpt_oss_train.inference.engine_steps import EngineSteps
from gpt_oss_train.inference.handles import (
    NO_TOKEN,
    Completion,
    RequestHandle,
    RequestParams,
    RequestRejected,
    TokenEvent,
)
from gpt_oss_train.inference.loading import DecodeError, LoadedModel
from gpt_oss_train.io import tokenizer as tok_lib

__all__ = [
    "Completion",
    "Engine",
    "NO_TOKEN",
    "RequestHandle",
    "RequestParams",
    "RequestRejected",
    "TokenEvent",
]

PREFIX_BLOCK = 16  # tokens per prefix-cache block; prefill chunks are multiples of it


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """Engine.from_model's keyword arguments (see Engine.from_checkpoint)."""

    max_slots: int = 8
    max_context: int = 4096
    prefill_chunk: int = 256
    int8_kv_cache: bool = False
    prefix_cache_tokens: int | None = None  # None: 4 x max_context; 0: off
    max_queue: int = 256
    max_logprobs: int = 20

    def check(self, max_positions: int) -> EngineOptions:
        """Raises DecodeError (a UserError) for an option that cannot work."""
        if self.max_slots < 1 or self.max_queue < 0 or self.max_logprobs < 0:
            raise DecodeError("need max_slots >= 1, max_queue >= 0 and max_logprobs >= 0")
        if not 2 <= self.max_context <= max_positions:
            raise DecodeError(
                f"max_context={self.max_context} must be in [2, {max_positions}] (the "
                "model's max_position_embeddings)"
            )
        if self.prefill_chunk < PREFIX_BLOCK or self.prefill_chunk % PREFIX_BLOCK:
            raise DecodeError(
                f"prefill_chunk={self.prefill_chunk} must be a positive multiple of "
                f"{PREFIX_BLOCK} (the prefix-cache block)"
            )
        tokens = self.prefix_cache_tokens
        if tokens is None:
            tokens = 4 * self.max_context
        if tokens and tokens < self.prefill_chunk:
            raise DecodeError(
                f"prefix_cache_tokens={tokens} must be 0 (off) or at least prefill_chunk="
                f"{self.prefill_chunk}"
            )
        return dataclasses.replace(self, prefix_cache_tokens=tokens)


def _token_ids(prompt) -> list[int]:
    """Ints (numpy ints too) as a list; TypeError for anything else (str, float, bool)."""
    if isinstance(prompt, (str, bytes)) or any(isinstance(t, bool) for t in prompt):
        raise TypeError("not token ids")
    return [operator.index(t) for t in prompt]


def _nbytes(tree) -> int:
    return sum(int(x.nbytes) for x in jax.tree.leaves(tree))


class Engine:
    """Continuous batching over `max_slots` decode slots of `max_context` positions.
    Thread-safe: submit, cancel, stats, generate and chat may be called from any thread."""

    def __init__(self, model: LoadedModel, opts: EngineOptions, link: Link | None = None):
        """`link`: on several processes, the job's hosts.Link. Process 0 schedules and
        sends each round to the others; they run it (`follow`) with no scheduler of their
        own, so every process runs the same device calls on its shards."""
        opts = opts.check(model.cfg.max_position_embeddings)
        self.model, self.opts = model, opts
        self.max_context = opts.max_context
        stacked = model.cfg.lora is not None and model.cfg.lora.adapters > 0
        # The names a request may give as RequestParams.adapter (stacked adapters only:
        # one unnamed adapter serves every request).
        self.adapters: tuple[str, ...] = model.adapters if stacked else ()
        self.steps = EngineSteps(
            model.md,
            max_slots=opts.max_slots,
            max_context=opts.max_context,
            prefill_chunk=opts.prefill_chunk,
            int8_kv_cache=opts.int8_kv_cache,
            block=PREFIX_BLOCK,
            pool_blocks=opts.prefix_cache_tokens // PREFIX_BLOCK,
            top_logprobs=opts.max_logprobs,
        )
        self.link = link or Link(0, 1, {})
        self._loop = EngineLoop(model, self.steps, opts.max_queue, self.link)
        self.memory = {
            "weights": _nbytes(model.params),
            "kv_cache": _nbytes(self._loop.cache),
            "prefix_cache": _nbytes(self._loop.pool) if self.steps.pool_blocks else 0,
        }
        self.memory["total"] = sum(self.memory.values())
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._warm = False
        self._start_lock = threading.Lock()

    # -- construction -------------------------------------------------------------------

    @classmethod
    def from_checkpoint(
        cls,
        path: str,
        *,
        config=None,
        dtype: str | None = None,
        int8_weights: bool = False,
        weights: str = "param_dtype",
        devices=None,
        compilation_cache: bool = True,
        adapters: Sequence[tuple[str, str]] = (),
        link: Link | None = None,
        **options,
    ) -> Engine:
        """An engine over a checkpoint (an Orbax tree or a Hugging Face folder), loaded as
        decode loads it: `config` is the runtime config (mesh, kernels; default
        loading.default_runtime_config()), `dtype` the compute dtype, `devices` the
        devices of the mesh. Engine options (EngineOptions): max_slots=8,
        max_context=4096, prefill_chunk=256 (a multiple of 16), int8_kv_cache=False,
        prefix_cache_tokens (default 4 x max_context, 0: off), max_queue=256 (requests
        waiting for a slot), max_logprobs=20 (the most top alternatives a request may
        ask for). Options are checked before the checkpoint is read.
        `link`: the job's hosts.Link on several processes (see __init__).
        `weights`: the form the weights are kept in (loading.load_model).
        `compilation_cache`: turn on JAX's persistent compilation cache (process-wide).
        `adapters`: LoRA adapters [(name, folder)] beside the base, as decode's --adapter:
        [("", folder)] is one adapter every request uses; named ones are chosen per
        request (RequestParams.adapter, None: the base)."""
        opts = EngineOptions(**options)
        kind = loading.checkpoint_kind(path)
        opts.check(loading.read_architecture(path, kind)["max_position_embeddings"])
        if compilation_cache:
            runtime.setup_compilation_cache()
        model = loading.load_model(
            path,
            config,
            dtype=dtype,
            int8_weights=int8_weights,
            weights=weights,
            devices=devices,
            adapters=adapters,
        )
        return cls(model, opts, link)

    @classmethod
    def from_model(cls, model: LoadedModel, link: Link | None = None, **options) -> Engine:
        """An engine over a loaded model (loading.load_model, loading.random_model);
        options as from_checkpoint's."""
        return cls(model, EngineOptions(**options), link)

    def __enter__(self) -> Engine:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- life cycle ---------------------------------------------------------------------

    def start(self) -> None:
        """Compiles and runs every shape the loop uses once, then starts the loop thread
        (process 0 only: the others `follow`). Logs the memory it holds. Calling it again
        does nothing."""
        with self._start_lock:
            self._warm_up()
            if self._thread is None and self.link.leader:
                self._thread = threading.Thread(
                    target=self._loop.run, name="gpt-oss-engine", daemon=True
                )
                self._thread.start()

    def follow(self) -> None:
        """Another process of a multi-host engine: warms up as process 0 does, then runs
        process 0's rounds until it says its work is done (after `run_batch`) or closes
        the link (the server stopping)."""
        assert not self.link.leader, "process 0 schedules; the others follow"
        with self._start_lock:
            self._warm_up()
        self._loop.follow()

    def run_batch(
        self,
        prompts: Sequence[Sequence[int]],
        params: RequestParams | Sequence[RequestParams] = RequestParams(),
    ) -> list[Completion]:
        """Every prompt's Completion, in order, with the rounds run on the calling thread
        (no loop thread may run: a batch of known requests, as GRPO's rollouts). The
        rounds depend on the requests alone, not on timing; on several processes they go
        to the others, which `follow` until this returns."""
        assert self._thread is None, "run_batch runs the rounds itself: do not start() first"
        with self._start_lock:
            self._warm_up()
        try:
            # A full queue is drained here: no other thread runs the rounds.
            handles = self._submit_all(prompts, params, self._drain_queue)
            self._loop.run_until_idle()
        finally:
            self._loop.end_work()
        return [h.result() for h in handles]

    def _drain_queue(self, handles) -> bool:
        self._loop.run_until_idle()
        return True

    def _submit_all(self, prompts, params, when_full) -> list[RequestHandle]:
        """Submits every prompt (`params` one for all, or one per prompt); on 429 (the
        queue is full) calls when_full(handles so far) and tries again."""
        each = [params] * len(prompts) if isinstance(params, RequestParams) else list(params)
        handles: list[RequestHandle] = []
        for prompt, p in zip(prompts, each, strict=True):
            while True:
                try:
                    handles.append(self.submit(prompt, p))
                    break
                except RequestRejected as e:
                    if e.status != 429 or not when_full(handles):
                        raise
        return handles

    def _warm_up(self) -> None:
        if self._warm:
            return
        self._warm = True
        gib = {k: f"{v / 2**30:.3f} GiB" for k, v in self.memory.items()}
        logging.info(
            "engine: %d slots x %d positions; memory %s", self.opts.max_slots, self.max_context, gib
        )
        t0 = time.perf_counter()
        with self.model.scope():
            shapes = self._loop.warm_up()
        logging.info(
            "engine: %d shapes compiled and run in %.1f s", shapes, time.perf_counter() - t0
        )

    def stop(self, grace_s: float = 30.0) -> None:
        """Stops accepting requests, lets queued and running ones finish for up to
        `grace_s` seconds, cancels the rest (finish_reason "cancelled") and ends the loop."""
        loop = self._loop
        with loop.cond:
            loop.accepting = False
            if self._thread is not None:
                loop.cond.wait_for(lambda: loop.idle() or loop.dead is not None, grace_s)
            loop.shutdown = True
            loop.cond.notify_all()
        if self._thread is not None:
            self._thread.join()
        loop.end_everything()

    # -- requests -----------------------------------------------------------------------

    def _reject(self, message: str, status: int = 400):
        self._loop.reject(message, status)

    def adapter_slot(self, name: str | None) -> int:
        """The stacked adapter slot a request for adapter `name` runs with (decode's
        rule: None is the base, or the one unnamed adapter); RequestRejected (400) naming
        the loaded adapters for a name that is not loaded."""
        stacked = bool(self.adapters)
        try:
            return adapters_lib.adapter_slot(name, self.model.adapters, stacked)
        except adapters_lib.UnknownAdapter as e:
            self._reject(str(e), 400)

    def submit(self, prompt: Sequence[int], params: RequestParams = RequestParams()):
        """Queues a request; returns its RequestHandle. Raises RequestRejected before
        queueing: 400 for an empty or out-of-vocabulary prompt, bad parameters, or
        len(prompt) + max_tokens > max_context; 429 when max_queue requests already
        wait for a slot; 503 once stop() has begun (both with retry_after_s); 400 for an
        adapter that is not loaded."""
        vocab = self.model.cfg.vocab_size
        if not isinstance(params, RequestParams):
            self._reject(f"params must be a RequestParams, got {type(params).__name__}", 400)
        try:
            params.check(vocab, self.opts.max_logprobs)
            prompt = _token_ids(prompt)
        except RequestRejected as e:
            self._reject(str(e), 400)
        except TypeError:
            self._reject("the prompt must be a list of integer token ids", 400)
        adapter = self.adapter_slot(params.adapter)
        if params.grammar is not None:
            self._check_grammar(params.grammar, vocab)
        if not prompt or min(prompt) < 0 or max(prompt) >= vocab:
            self._reject(f"the prompt must be 1 or more token ids in [0, {vocab})", 400)
        if len(prompt) + params.max_tokens > self.max_context:
            self._reject(
                f"the prompt's {len(prompt)} tokens + max_tokens={params.max_tokens} exceed "
                f"this engine's max_context={self.max_context}",
                400,
            )
        handle = RequestHandle(next(self._ids), prompt, self._loop.wake)
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(4), "little")
        self._loop.enqueue(handle, params, seed, adapter)
        return handle

    def _check_grammar(self, grammar, vocab: int) -> None:
        """400 for a grammar that does not compile, or on a model whose vocabulary is not
        Harmony's (the grammar's tokens would not be the model's)."""
        if vocab != tok_lib.VOCAB_SIZE:
            self._reject(
                f"a grammar needs the Harmony vocabulary ({tok_lib.VOCAB_SIZE} ids); this "
                f"model has {vocab}",
                400,
            )
        try:
            constraints.check(grammar)
        except constraints.GrammarError as e:
            self._reject(f"grammar: {e}", 400)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: RequestParams | Sequence[RequestParams] = RequestParams(),
    ) -> list[Completion]:
        """Every prompt's Completion, in order (blocking; starts the engine if needed).
        Submits as fast as the queue takes them. `params`: one for all, or one per prompt."""
        self.start()
        return [h.result() for h in self._submit_all(prompts, params, self._wait_for_one)]

    @staticmethod
    def _wait_for_one(handles: list[RequestHandle]) -> bool:
        """Waits for the oldest unfinished request (False: none, the queue stays full)."""
        waiting = [h for h in handles if not h.done]
        if waiting:
            waiting[0].result()
        return bool(waiting)

    def chat_prompt(
        self,
        messages: list[dict],
        params: RequestParams = RequestParams(),
        *,
        tools=None,
        reasoning_effort: str = "medium",
    ) -> tuple[list[int], RequestParams]:
        """(prompt ids, params) to submit for the next assistant turn of a Harmony chat
        (Tokenizer.render_chat); params without stop ids get Harmony's (<|return|>,
        <|call|>). RequestRejected (400) for a chat that cannot be rendered."""
        try:
            prompt = loading.tokenizer().render_chat(messages, reasoning_effort, tools=tools)
        except (ValueError, TypeError) as e:
            self._reject(f"messages: {e}", 400)
        if not params.stop_ids:
            params = dataclasses.replace(
                params, stop_ids=tuple(sorted(loading.tokenizer().stop_ids))
            )
        return prompt, params

    def chat(
        self,
        messages: list[dict],
        params: RequestParams = RequestParams(),
        *,
        tools=None,
        reasoning_effort: str = "medium",
    ) -> Completion:
        """The next assistant turn of a Harmony chat (blocking); `messages` of the
        Completion is the reply parsed by Tokenizer.parse_completion."""
        self.start()
        prompt, params = self.chat_prompt(
            messages, params, tools=tools, reasoning_effort=reasoning_effort
        )
        completion = self.submit(prompt, params).result()
        completion.messages = loading.tokenizer().parse_completion(completion.tokens)
        return completion

    def score(self, prompt: Sequence[int], adapter: str | None = None) -> list[float]:
        """log p(t[i+1] | t[:i+1]) for i in [0, n-1) of a prompt of n >= 2 tokens, as
        `decode --mode=score` computes them, under `adapter` (as RequestParams.adapter).
        Runs on the calling thread, beside the loop (on several processes, in the loop's
        next round)."""
        slot = self.adapter_slot(adapter)
        vocab = self.model.cfg.vocab_size
        try:
            ids = tuple(_token_ids(prompt))
        except TypeError:
            self._reject("the prompt must be a list of integer token ids", 400)
        if not 2 <= len(ids) <= self.max_context or min(ids) < 0 or max(ids) >= vocab:
            self._reject(
                f"scoring needs 2 to {self.max_context} token ids in [0, {vocab}), got {len(ids)}",
                400,
            )
        logp = self._job("score", scoring.score_inputs([ids], rows=1, adapter=slot))
        return scoring.unpad(logp, [ids])[0].tolist()

    def top_logprobs(
        self, prompt: Sequence[int], k: int, adapter: str | None = None
    ) -> list[list[tuple[int, float]]]:
        """For i in [0, n-1): the k most likely (id, logprob) after prompt[:i+1] (the
        server's echo with logprobs=k), under `adapter`; as score, beside the loop."""
        ids = list(prompt)
        inputs = scoring.top_inputs(ids, self.adapter_slot(adapter))
        return scoring.top_unpack(self._job("top", inputs), len(ids), k)

    def _job(self, op: str, inputs: tuple):
        """scoring.JOBS[op] on `inputs`: here, or on several processes in the loop's next
        round (every device call of a multi-host engine goes through the rounds)."""
        if not self.link.multihost:
            with self.model.scope():
                return jax.device_get(scoring.job(self.model, op)(self.model.params, *inputs))
        done = queue.Queue(maxsize=1)
        self._loop.add_job(op, inputs, done.put)
        out = done.get()
        if out is None:
            self._reject("the engine stopped before it could run the request", 503)
        return out

    def stats(self) -> dict:
        """Counters since start-up (EngineStats.COUNTERS), gauges (queue_depth, running,
        max_slots, prefix-cache blocks), finished requests by finish_reason, rejections
        by status, and histograms (cumulative buckets, sum, count, recent samples) of
        time to first token, inter-token latency and request latency, in seconds."""
        loop = self._loop
        return loop.stats.snapshot(
            queue_depth=len(loop.queue),
            running=len(loop.slots.active),
            max_slots=self.opts.max_slots,
            prefix_cache_blocks=self.steps.pool_blocks,
            prefix_cache_blocks_used=len(loop.index),
            prefix_cache_evictions=loop.index.evictions,
        )
