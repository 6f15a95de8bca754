"""The serving engine's step loop: the thread that owns the KV cache and the slots.

Each round: end cancelled requests, admit waiting ones into free slots (the slot
emptied, a cached prompt prefix copied in), prefill one chunk of the oldest admitted
prompt, then one decode step for every slot that is generating. A prompt is therefore
prefilled between decode steps, and the streams already running keep producing tokens.

Only this thread touches the cache, the prefix pool and the slot table; other threads
reach the loop through `enqueue` and a handle's cancel flag, under `cond`.
"""

from __future__ import annotations

import collections
import math
import threading
import time

import jax
import numpy as np
from absl import logging

from gpt_oss_train.hosts import Link, LinkClosed
from gpt_oss_train.inference import constraints, rounds, scoring, slots
from gpt_oss_train.inference.engine_stats import EngineStats
from gpt_oss_train.inference.engine_steps import EngineSteps
from gpt_oss_train.inference.handles import (
    NO_TOKEN,
    Completion,
    RequestHandle,
    RequestParams,
    RequestRejected,
    TokenEvent,
)
from gpt_oss_train.inference.loading import LoadedModel
from gpt_oss_train.inference.prefix_cache import PrefixIndex, block_names


class _Plan:
    """A round being planned: its calls, and for each the requests it affects and what
    to do with its outputs once they are on the host (`take`, or None)."""

    def __init__(self):
        self.calls: list[rounds.Call] = []
        self.affected: list[list[slots.Active]] = []
        self.takes: list = []

    def add(self, op: str, affected, *args, static=None, take=None) -> None:
        self.calls.append(rounds.Call(op, args, static or {}))
        self.affected.append(list(affected))
        self.takes.append(take)


class EngineLoop:
    def __init__(
        self, model: LoadedModel, steps: EngineSteps, max_queue: int, link: Link | None = None
    ):
        self.model, self.steps, self.max_queue = model, steps, max_queue
        # Process 0's link to the others of a multi-host engine (hosts.py): each round's
        # calls go to them before they run here.
        self.link = link or Link(0, 1, {})
        self.rows = slots.row_buckets(steps.max_slots)
        self.chunks = slots.chunk_buckets(steps.prefill_chunk, steps.block)
        self.contexts = slots.context_buckets(steps.max_context, max(256, steps.prefill_chunk))
        with model.scope():
            self.cache = steps.new_cache()
            self.pool = steps.new_pool()
        self.index = PrefixIndex(steps.pool_blocks)
        self.slots = slots.SlotTable(steps.max_slots)
        # (handle, params, seed, adapter slot), first come first served
        self.queue: collections.deque[tuple[RequestHandle, RequestParams, int, int]] = (
            collections.deque()
        )
        # Calls of scoring.JOBS to run in the next round (a multi-host engine's, whose
        # every device call goes through the rounds): (op, inputs, take(output or None)).
        self.jobs: collections.deque = collections.deque()
        self.cond = threading.Condition()
        self.stats = EngineStats()
        self.accepting = True
        self.shutdown = False
        self.dead: str | None = None  # why the loop died, if it did

    # -- other threads ------------------------------------------------------------------

    def enqueue(
        self, handle: RequestHandle, params: RequestParams, seed: int, adapter: int = 0
    ) -> None:
        """Queues a request (to run with stacked adapter slot `adapter`), or raises
        RequestRejected: 503 once stopping, 429 when max_queue requests already wait
        beyond the free slots."""
        with self.cond:
            if not self.accepting or self.dead is not None:
                self.reject("the engine is shutting down", 503, self._retry_after_s())
            if len(self.queue) >= self.max_queue + self.slots.free:
                self.reject(
                    f"the queue is full ({len(self.queue)} requests waiting)",
                    429,
                    self._retry_after_s(),
                )
            self.queue.append((handle, params, seed, adapter))
            self.cond.notify_all()

    def add_job(self, op: str, inputs: tuple, take) -> None:
        """Queues a call of scoring.JOBS[op] for the next round; take(output) gets its
        output on the host, take(None) if the engine ends first."""
        with self.cond:
            if self.shutdown or self.dead is not None:
                take(None)
                return
            self.jobs.append((op, inputs, take))
            self.cond.notify_all()

    def reject(self, message: str, status: int, retry_after_s: float | None = None):
        self.stats.reject(status)
        raise RequestRejected(message, status, retry_after_s)

    def _retry_after_s(self) -> float:
        """Whole seconds until a slot is likely free: the mean request latency per wave
        of max_slots requests ahead."""
        waves = (len(self.queue) + 1) / self.steps.max_slots
        return float(max(1, math.ceil(waves * self.stats.mean_latency_s(default=1.0))))

    def idle(self) -> bool:
        return not self.queue and not self.slots.active

    def wake(self) -> None:
        with self.cond:
            self.cond.notify_all()

    # -- the thread ---------------------------------------------------------------------

    def run(self) -> None:
        """Rounds until `shutdown`; a failure outside a step (a bug) fails every request
        and refuses new ones rather than leaving them hanging."""
        try:
            with self.model.scope():
                while True:
                    with self.cond:
                        if self.shutdown:
                            return
                    if not self._round():
                        with self.cond:
                            self.cond.wait_for(self._has_work, timeout=0.5)
        except Exception as e:  # noqa: BLE001 - reported to every request, then logged
            logging.exception("engine loop died")
            with self.cond:
                self.dead = f"{type(e).__name__}: {e}"
                self.cond.notify_all()
            self.end_everything(reason="error", error=self.dead)

    def _has_work(self) -> bool:
        return bool(self.queue) or bool(self.slots.active) or bool(self.jobs) or self.shutdown

    def run_until_idle(self) -> None:
        """Rounds on the calling thread until no request waits or runs (for a batch of
        known requests, with no loop thread running)."""
        with self.model.scope():
            while self._round():
                pass

    def follow(self) -> None:
        """Another process of a multi-host engine: runs process 0's rounds as they come,
        until process 0 says its work is done or closes the link."""
        with self.model.scope():
            while True:
                try:
                    round_ = rounds.decode(self.link.receive())
                except LinkClosed:
                    return
                if round_.end:
                    return
                self.apply(round_.calls)

    def end_work(self) -> None:
        """Process 0: tells the others that no rounds come for now (they return from
        `follow`)."""
        if self.link.multihost:
            self.link.send(rounds.encode(rounds.Round(end=True)))

    def _round(self) -> bool:
        """Admit, one prefill chunk, one decode step. False when there was nothing to do.

        The round is planned first, then run: every call's inputs are decided before any
        runs (the decode step takes the rows that were generating when the round began;
        a prompt whose prefill ends here decodes from the next round), so the whole
        round is one message to the other processes of a multi-host engine."""
        self._reap_cancelled()
        plan = _Plan()
        self._admit(plan)
        decoding = self.slots.decoding()
        a = self.slots.next_prefill()
        if a is not None:
            self._plan_prefill(plan, a)
        if decoding:
            self._plan_decode(plan, decoding)
        with self.cond:
            jobs, self.jobs = list(self.jobs), collections.deque()
        for op, inputs, take in jobs:
            plan.add(op, [], *inputs, take=take)
        if not plan.calls:
            return False
        self._run(plan)
        return True

    def _run(self, plan: _Plan) -> None:
        """Sends the round to the other processes, runs it here, then hands each call's
        outputs to its request(s). A failure fails the requests the round affected; if it
        had consumed the donated cache, the cache is made anew and every request in it
        fails too. On several processes a failure ends the engine: the processes could
        no longer be sure to hold the same cache."""
        try:
            if self.link.multihost:
                self.link.send(rounds.encode(rounds.Round(plan.calls)))
            outs = jax.device_get(self.apply(plan.calls))
        except Exception as e:  # noqa: BLE001 - the requests get the message
            if self.link.multihost:
                raise
            logging.exception("engine step failed")
            self.stats.add(step_errors=1)
            self._fail([a for group in plan.affected for a in group], e)
            return
        for out, take in zip(outs, plan.takes):
            if take is not None:
                take(out)

    def _fail(self, affected: list[slots.Active], e: Exception) -> None:
        error = f"{type(e).__name__}: {e}"
        if any(x.is_deleted() for x in jax.tree.leaves((self.cache, self.pool))):
            self.cache, self.pool = self.steps.new_cache(), self.steps.new_pool()
            self.index = PrefixIndex(self.steps.pool_blocks)
            affected = list(self.slots.active.values())
        for a in dict.fromkeys(affected):  # once each, in order
            self.end(a, "error", error=error)

    def apply(self, calls: list[rounds.Call]) -> list:
        """Runs a round's calls in order on this process's shards of the cache, the
        prefix pool and the parameters (process 0 and every follower alike); returns
        each call's outputs (None for admit and save)."""
        s, p = self.steps, self.model.params
        outs = []
        for c in calls:
            out = None
            if c.op == "admit":
                self.cache = s.admit(self.cache, self.pool, *c.args)
            elif c.op == "prefill":
                out, self.cache = s.prefill(p, self.cache, *c.args, **c.static)
            elif c.op == "save":
                self.pool = s.save(self.pool, self.cache, *c.args)
            elif c.op == "decode":
                out, self.cache = s.decode(p, self.cache, *c.args, **c.static)
            elif c.op in scoring.JOBS:
                out = scoring.job(self.model, c.op)(p, *c.args)
            else:
                raise ValueError(f"unknown engine operation {c.op!r}")
            outs.append(out)
        return outs

    # -- planning -----------------------------------------------------------------------

    def _admit(self, plan: _Plan) -> None:
        """Waiting requests into free slots."""
        while self.slots.free:
            with self.cond:
                if not self.queue:
                    return
                handle, params, seed, adapter = self.queue.popleft()
            pooled = self.steps.pool_blocks > 0
            names = block_names(handle.prompt, self.steps.block, adapter) if pooled else []
            a = self.slots.take(handle, params, seed, names, adapter)
            self._restore(plan, a)

    def _restore(self, plan: _Plan, a: slots.Active) -> None:
        """Empties a's slot and copies in the longest cached prefix of its prompt (whole
        blocks, leaving at least the last prompt token to prefill)."""
        s = self.steps
        usable = min(s.max_prefix_blocks, (len(a.prompt) - 1) // s.block)
        ids = self.index.lookup(a.names, usable)
        block_ids = np.zeros(s.id_slots, np.int32)
        block_ids[: len(ids)] = ids
        a.cached = a.prefilled = len(ids) * s.block
        plan.add("admit", [a], np.int32(a.slot), block_ids, np.int32(a.cached))
        hit = "prefix_cache_hits" if ids else "prefix_cache_misses"
        self.stats.add(
            prompt_tokens=len(a.prompt), cached_prompt_tokens=a.cached, **{hit: int(bool(a.names))}
        )

    def _plan_prefill(self, plan: _Plan, a: slots.Active) -> None:
        """The next chunk of a's prompt, and the whole blocks it completes into the pool."""
        x = slots.prefill_inputs(a, self.chunks, self.contexts)
        start = a.prefilled
        a.prefilled = start + x["n"]
        last = a.prefilled == len(a.prompt)  # the prompt's last position: the first token
        plan.add(
            "prefill",
            [a],
            np.int32(a.slot),
            x["tokens"],
            x["positions"],
            x["last"],
            x["settings"],
            x["want_top"],
            x["adapter_ids"],
            static=dict(context=x["context"]),
            take=(lambda out: self._tokens([a], out)) if last else None,
        )
        self._save_blocks(plan, a, start, a.prefilled)
        self.stats.add(prefill_chunks=1, prefill_tokens=x["n"])

    def _save_blocks(self, plan: _Plan, a: slots.Active, start: int, end: int) -> None:
        """The prompt's whole blocks in [start, end) into the prefix pool (those not there)."""
        s = self.steps
        first, stop = start // s.block, min(end // s.block, len(a.names), s.max_prefix_blocks)
        if stop <= first:
            return
        block_ids = np.full(s.prefill_chunk // s.block, s.pool_blocks, np.int32)
        for i, pool_id in enumerate(self.index.allocate(a.names[:stop], first)):
            if pool_id is not None:
                block_ids[i] = pool_id
        if (block_ids < s.pool_blocks).any():
            plan.add("save", [a], np.int32(a.slot), np.int32(start), block_ids)

    def _plan_decode(self, plan: _Plan, rows: list[slots.Active]) -> None:
        """One decode step for every row that is generating."""
        x = slots.decode_inputs(rows, self.rows, self.contexts)
        picked = [a.slot for a in rows]
        plan.add(
            "decode",
            rows,
            x["tokens"],
            x["positions"],
            x["settings"],
            x["want_top"],
            x["adapter_ids"],
            static=dict(rows=x["rows"], context=x["context"]),
            take=lambda out: self._tokens(rows, [v[picked] for v in out]),
        )
        self.stats.add(decode_steps=1)

    def _tokens(self, rows: list[slots.Active], out) -> None:
        """One sampled token per row (outputs in row order): recorded, streamed, and the
        request ended on a stop id or at max_tokens."""
        now = time.perf_counter()
        for a, token, lp, ids, lps in zip(rows, *out):
            token, lp, n_top = int(token), float(lp), a.params.logprobs
            top = [(int(i), float(v)) for i, v in zip(ids[:n_top], lps[:n_top])]
            if a.last_token_at is None:
                self.stats.first_token(now - a.handle.submitted_at)
                a.handle.first_token_at = now
            else:
                self.stats.next_token(now - a.last_token_at)
            a.last_token_at = now
            try:
                a.generated(token, lp, top)
            except constraints.GrammarError as e:  # the mask failed to hold: a bug, said so
                logging.error("request %d: %s", a.handle.id, e)
                self.end(a, "error", error=f"GrammarError: {e}")
                continue
            self.stats.add(generation_tokens=1)
            reason = a.finish_reason(token)
            if reason is None:
                a.handle._emit(TokenEvent(token, lp, top, None))
            else:
                self.end(a, reason, TokenEvent(token, lp, top, reason))

    # -- ending requests ----------------------------------------------------------------

    def end(self, a, reason: str, event: TokenEvent | None = None, error: str | None = None):
        """Finishes a request (an Active in a slot, or a queue entry): frees its slot and
        sends the last event with the Completion."""
        if isinstance(a, slots.Active):
            self.slots.release(a)
            handle, seed, cached = a.handle, a.seed, a.cached
            body = (a.tokens, a.logprobs, a.top_logprobs)
        else:
            (handle, _, seed, _), cached, body = a, 0, ([], [], [])
        if handle.done:
            return
        now, first = time.perf_counter(), handle.first_token_at
        completion = Completion(
            prompt_tokens=len(handle.prompt),
            tokens=list(body[0]),
            logprobs=list(body[1]),
            top_logprobs=list(body[2]),
            finish_reason=reason,
            ttft_s=(first - handle.submitted_at) if first is not None else math.nan,
            total_s=now - handle.submitted_at,
            cached_prompt_tokens=cached,
            seed=seed,
            error=error,
        )
        self.stats.finish(reason, completion.total_s)
        handle._emit(event or TokenEvent(NO_TOKEN, 0.0, [], reason, error), completion)
        self.wake()

    def _reap_cancelled(self) -> None:
        with self.cond:
            queued = [q for q in self.queue if q[0].cancel_requested]
            for q in queued:
                self.queue.remove(q)
        for q in queued:
            self.end(q, "cancelled")
        for a in list(self.slots.active.values()):
            if a.handle.cancel_requested:
                self.end(a, "cancelled")

    def end_everything(self, reason: str = "cancelled", error: str | None = None) -> None:
        """Ends every queued and running request (once the loop has stopped)."""
        with self.cond:
            queued, self.queue = list(self.queue), collections.deque()
            jobs, self.jobs = list(self.jobs), collections.deque()
        for *_, take in jobs:
            take(None)
        for q in queued:
            self.end(q, reason, error=error)
        for a in list(self.slots.active.values()):
            self.end(a, reason, error=error)

    # -- start-up -----------------------------------------------------------------------

    def warm_up(self) -> int:
        """Runs every compiled shape once, on inputs that write nothing (positions -1,
        pool ids out of range); returns how many there are."""
        p, s = self.model.params, self.steps
        self.cache = s.admit(
            self.cache, self.pool, np.int32(0), np.zeros(s.id_slots, np.int32), np.int32(0)
        )
        shapes = [("prefill", c, ctx) for c in self.chunks for ctx in self.contexts if c <= ctx]
        shapes += [("prefill", c, self.contexts[-1]) for c in self.chunks if c > self.contexts[-1]]
        shapes += [("decode", n, ctx) for n in self.rows for ctx in self.contexts]
        for kind, n, context in shapes:
            positions = np.full((1, n) if kind == "prefill" else n, -1, np.int32)
            args = (p, self.cache, np.zeros_like(positions))
            settings = slots.sampling_settings([], 1 if kind == "prefill" else n)
            if kind == "prefill":
                args = (p, self.cache, np.int32(0), np.zeros_like(positions), positions)
                out, self.cache = s.prefill(
                    *args,
                    np.int32(0),
                    settings,
                    np.zeros(1, bool),
                    np.zeros(1, np.int32),
                    context=context,
                )
            else:
                out, self.cache = s.decode(
                    *args,
                    positions,
                    settings,
                    np.zeros(n, bool),
                    np.zeros(n, np.int32),
                    rows=n,
                    context=context,
                )
        if s.pool_blocks:
            dropped = np.full(s.prefill_chunk // s.block, s.pool_blocks, np.int32)
            self.pool = s.save(self.pool, self.cache, np.int32(0), np.int32(0), dropped)
        jax.block_until_ready((self.cache, self.pool))
        return len(shapes) + 1 + bool(s.pool_blocks)
