"""What a caller of the serving engine holds: the parameters of a request, the handle
that streams its tokens, and the completion it ends with.

A `RequestHandle` is filled by the engine's thread and read by any other: iterate it
(`for event in handle`) or, in an asyncio server, `async for event in handle`; both
replay every event from the first, so several readers may follow one request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import threading
import time
from typing import Any, Callable

from gpt_oss_train.errors import UserError

# The token of a last event that carries none (a request cancelled or failed between tokens).
NO_TOKEN = -1
FINISH_REASONS = ("stop", "length", "cancelled", "error")


class RequestRejected(UserError):
    """A request the engine refuses before queueing it. `status` is the HTTP status that
    fits: 400 (too long, bad parameters), 429 (queue full), 503 (shutting down); with
    429/503 `retry_after_s` says when trying again may succeed."""

    def __init__(self, message: str, status: int = 400, retry_after_s: float | None = None):
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s


@dataclasses.dataclass(frozen=True)
class RequestParams:
    """How to generate for one request."""

    max_tokens: int = 256
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # 1: off
    top_k: int = 0  # 0: off
    seed: int | None = None  # None: a fresh seed per request
    # Generation stops after emitting one of these; it is the last token of the output.
    stop_ids: tuple[int, ...] = ()
    logprobs: int = 0  # top alternatives per generated token (0: the chosen token's only)
    # The LoRA adapter to generate with, by name (Engine.adapters). None: the base model,
    # or the one unnamed adapter every request uses (decode's --adapter=DIR).
    adapter: str | None = None
    # OpenAI's logit adjustments, applied on the device in the batch (sampling.py): a bias
    # per token id, ((id, amount), ...) with amounts in [-100, 100]; and penalties in
    # [-2, 2] per generated occurrence of a token (frequency) and once it has occurred
    # (presence). The log-probabilities reported stay those of the model's distribution.
    logit_bias: tuple[tuple[int, float], ...] = ()
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # A grammar the output must follow (Lark text in llguidance's dialect; constraints.py
    # builds those of a Harmony turn: json_answer, tool_call). Needs the Harmony vocabulary.
    grammar: str | None = None

    def check(self, vocab_size: int, max_logprobs: int) -> None:
        """Raises RequestRejected (400) naming the first parameter out of range."""

        def bad(what: str):
            raise RequestRejected(f"{what}, got {self!r}", 400)

        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            bad("max_tokens must be an integer >= 1")
        if not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature < math.inf:
            bad("temperature must be a finite number >= 0")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            bad("top_p must be in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < 0:
            bad("top_k must be an integer >= 0")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**32):
            bad("seed must be None or an integer in [0, 2**32)")
        if not isinstance(self.stop_ids, (tuple, list)) or not all(
            _is_int(t) for t in self.stop_ids
        ):
            bad("stop_ids must be a tuple of integer token ids")
        if not _is_int(self.logprobs) or not 0 <= self.logprobs <= max_logprobs:
            bad(f"logprobs must be an integer in [0, {max_logprobs}]")
        if self.adapter is not None and not isinstance(self.adapter, str):
            bad("adapter must be None or an adapter's name")
        self._check_adjustments(vocab_size, bad)

    def _check_adjustments(self, vocab_size: int, bad) -> None:
        pairs = self.logit_bias
        if not isinstance(pairs, (tuple, list)) or not all(
            isinstance(p, (tuple, list)) and len(p) == 2 for p in pairs
        ):
            bad("logit_bias must be a tuple of (token id, amount) pairs")
        ids = [t for t, _ in pairs]
        if not all(_is_int(t) and 0 <= t < vocab_size for t in ids):
            bad(f"logit_bias: token ids must be integers in [0, {vocab_size})")
        if len(set(ids)) != len(ids):
            bad("logit_bias names a token id twice")
        if not all(_is_number(v) and -100 <= v <= 100 for _, v in pairs):
            bad("logit_bias amounts must be numbers in [-100, 100]")
        for name in ("frequency_penalty", "presence_penalty"):
            if not _is_number(getattr(self, name)) or not -2 <= getattr(self, name) <= 2:
                bad(f"{name} must be a number in [-2, 2]")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclasses.dataclass
class TokenEvent:
    """One generated token, streamed as soon as it is sampled."""

    token: int  # NO_TOKEN on a last event that carries no token (cancelled, error)
    logprob: float  # log p(token) under the model (temperature 1)
    top_logprobs: list[tuple[int, float]]  # the params.logprobs most likely (id, logprob)
    finish_reason: str | None  # None while running; one of FINISH_REASONS on the last event
    error: str | None = None  # what went wrong, on a last event with finish_reason "error"


@dataclasses.dataclass
class Completion:
    """A finished request. `tokens` include a final stop id (finish_reason "stop")."""

    prompt_tokens: int
    tokens: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    finish_reason: str
    messages: list[dict] | None = None  # chat(): the reply parsed as Harmony messages
    ttft_s: float = math.nan  # submit -> first token (nan if none came)
    total_s: float = math.nan  # submit -> finish
    cached_prompt_tokens: int = 0  # prompt tokens taken from the prefix cache
    seed: int = 0  # the seed used (a fresh one where params.seed was None)
    error: str | None = None


class RequestHandle:
    """A submitted request: iterate (or `async for`) to receive its TokenEvents as they
    are produced, `result()` to wait for the Completion, `cancel()` to stop it."""

    def __init__(self, request_id: int, prompt: list[int], on_cancel: Callable[[], None]):
        self.id = request_id
        self.prompt = prompt
        self.submitted_at = time.perf_counter()
        self.first_token_at: float | None = None
        self.cancel_requested = False
        self._on_cancel = on_cancel
        self._events: list[TokenEvent] = []
        self._completion: Completion | None = None
        self._cond = threading.Condition()
        self._async_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    # -- reader side --------------------------------------------------------------------

    def cancel(self) -> None:
        """Stop generating: the slot is freed within one engine step, and the stream ends
        with finish_reason "cancelled" (unless the request had already finished)."""
        self.cancel_requested = True
        self._on_cancel()

    @property
    def done(self) -> bool:
        return self._completion is not None

    def result(self, timeout: float | None = None) -> Completion:
        """The Completion, once the request has finished (TimeoutError after `timeout` s)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._completion is not None, timeout):
                raise TimeoutError(f"request {self.id} still running after {timeout} s")
            return self._completion

    def __iter__(self):
        i = 0
        while True:
            with self._cond:
                self._cond.wait_for(lambda: len(self._events) > i)
                event = self._events[i]
            i += 1
            yield event
            if event.finish_reason is not None:
                return

    def __aiter__(self):
        return self._async_events()

    async def _async_events(self):
        wake = asyncio.Event()
        waiter = (asyncio.get_running_loop(), wake)
        with self._cond:
            self._async_waiters.append(waiter)
        try:
            i = 0
            while True:
                with self._cond:
                    pending = self._events[i:]
                    if not pending:
                        wake.clear()  # under the lock: a later event's set() is not lost
                for event in pending:
                    i += 1
                    yield event
                    if event.finish_reason is not None:
                        return
                if not pending:
                    await wake.wait()
        finally:
            with self._cond:
                self._async_waiters.remove(waiter)

    # -- engine side --------------------------------------------------------------------

    def _emit(self, event: TokenEvent, completion: Completion | None = None) -> None:
        with self._cond:
            self._events.append(event)
            if completion is not None:
                self._completion = completion
            self._cond.notify_all()
            for loop, wake in self._async_waiters:
                try:
                    loop.call_soon_threadsafe(wake.set)
                except RuntimeError:  # that reader's event loop has closed
                    pass
