"""What chat and completions share between the HTTP request and the engine: submitting
one engine request per choice, merging their token streams, noticing a client that went
away, and server-sent events.

A client that disconnects (or a stream the client closes) cancels its engine requests, so
their decode slots free within a step; the engine never works for nobody. A request the
engine itself ends (finish reason "cancelled": the server's shutdown, drain.py) finishes
with reason ABORT when streamed, as vLLM's do, and as a 503 when whole.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from gpt_oss_train.inference.engine import RequestParams, RequestRejected
from gpt_oss_train.inference.server.errors import APIError, from_rejection
from gpt_oss_train.inference.server.metrics import Metrics, TokenClock


@dataclasses.dataclass
class ServerState:
    """What the routes need: the engine, its tokenizer, names and limits, metrics."""

    engine: Any
    tokenizer: Any
    model_name: str
    max_context: int
    vocab_size: int
    metrics: Metrics
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    # LoRA adapters a request selects by naming one as its "model" (Engine.adapters)
    adapters: tuple[str, ...] = ()

    @property
    def model_names(self) -> tuple[str, ...]:
        """What "model" may be: the served model, then each adapter."""
        return (self.model_name, *self.adapters)


# The finish_reason of a choice the engine ended unfinished (its "cancelled"): vLLM's word.
ABORT = "abort"


def has_token(ev) -> bool:
    """False for a last event that carries no token (a cancelled or failed request)."""
    return ev.token is not None and ev.token >= 0


def request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def check_model(state: ServerState, name: str) -> str | None:
    """The adapter a request's "model" selects (RequestParams.adapter): None for the
    served model (the base, or the one adapter every request uses), else the adapter of
    that name. 404 for a name this server does not serve."""
    if name == state.model_name:
        return None
    if name in state.adapters:
        return name
    served = ", ".join(f"'{n}'" for n in state.model_names)
    raise APIError(
        404,
        f"The model '{name}' does not exist; this server serves {served}.",
        param="model",
        code="model_not_found",
    )


def check_length(
    state: ServerState,
    n_prompt: int,
    max_tokens: int | None,
    param: str,
    prompt_param: str = "messages",
) -> int:
    """The number of tokens to generate: max_tokens, or what is left of the context.
    A prompt that leaves no room is refused before it is queued (naming `prompt_param`)."""
    room = state.max_context - n_prompt
    if room < 1 or (max_tokens is not None and max_tokens > room):
        raise APIError(
            400,
            f"This model's context holds {state.max_context} tokens; the prompt has "
            f"{n_prompt} and {max_tokens or 1} more were asked for. Shorten the prompt or "
            f"lower {param}.",
            param=param if room >= 1 else prompt_param,
            code="context_length_exceeded",
        )
    return room if max_tokens is None else max_tokens


# The longest o200k token is 128 bytes (128 spaces), so text of B UTF-8 bytes is at least
# ceil(B / 128) tokens: a bound known before tokenizing that never refuses a prompt that fits.
LONGEST_TOKEN_BYTES = 128


def check_text_length(
    state: ServerState, texts: list[str], max_tokens: int | None, *, param: str, prompt_param: str
) -> None:
    """Refuse, before tokenizing, prompt text too long for the context to hold it and
    max_tokens (None: one) more tokens, so a huge prompt costs a length check only."""
    n_bytes = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
    least = -(-n_bytes // LONGEST_TOKEN_BYTES)
    wanted = 1 if max_tokens is None else max_tokens
    if least + wanted > state.max_context:
        raise APIError(
            400,
            f"This model's context holds {state.max_context} tokens; the prompt's "
            f"{n_bytes} bytes of text are at least {least} tokens and {wanted} more were "
            f"asked for. Shorten the prompt or lower {param}.",
            param=param if least < state.max_context else prompt_param,
            code="context_length_exceeded",
        )


def check_capacity(state: ServerState, count: int, what: str, *, param: str) -> None:
    """Refuse (400) a request of more engine requests (`count`: prompts x n) than the
    engine ever holds at once, running and waiting: it could never be queued, so the 429
    a full queue gets (try again later) would mislead."""
    opts = state.engine.opts
    most = opts.max_slots + opts.max_queue
    if count > most:
        raise APIError(
            400,
            f"This request asks for {count} completions ({what}); this server takes at most "
            f"{most} at once ({opts.max_slots} decoding + {opts.max_queue} waiting). Send at "
            f"most {most} per request.",
            param=param,
        )


def choice_seeds(seed: int | None, n: int) -> list[int | None]:
    """Choice i samples with seed + i, so n choices differ yet each is reproducible."""
    return [None if seed is None else (seed + i) % 2**32 for i in range(n)]


def choice_params(req, max_tokens: int, stop_ids, logprobs: int, adapter, grammar=None) -> list:
    """RequestParams for each of a request's `n` choices (its own seed each), with the
    sampling fields chat and text completions share (and chat's grammar, if any)."""
    return [
        RequestParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=max(0, req.top_k or 0),
            seed=seed,
            stop_ids=stop_ids,
            logprobs=logprobs,
            adapter=adapter,
            grammar=grammar,
            **req.logit_adjustments(),
        )
        for seed in choice_seeds(req.seed, req.n)
    ]


def submit(state: ServerState, prompt: list[int], params: list) -> list:
    """One engine request per choice; all or none (a refusal cancels the ones made)."""
    handles = []
    try:
        for p in params:
            handles.append(state.engine.submit(prompt, p))
    except RequestRejected as e:
        for h in handles:
            h.cancel()
        raise from_rejection(e) from None
    state.metrics.prompt_tokens.inc(len(prompt) * len(params))
    return handles


async def merged(handles: list, metrics: Metrics, start: float) -> AsyncIterator[tuple[int, Any]]:
    """(choice index, TokenEvent) from all handles as they come."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i, h):
        clock = TokenClock(metrics, start)
        try:
            async for ev in h:
                if has_token(ev):
                    clock.tick()
                await queue.put((i, ev))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(handles)]
    try:
        remaining = len(handles)
        while remaining:
            i, ev = await queue.get()
            if ev is done:
                remaining -= 1
            else:
                yield i, ev
    finally:
        for h in handles:
            h.cancel()
        for t in tasks:
            t.cancel()


async def until_disconnect(request: Request) -> None:
    """Returns when the client has gone (the request body is read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work, handles: list):
    """await `work`, but cancel it and the handles if the client goes away first."""
    job = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(until_disconnect(request))
    try:
        await asyncio.wait({job, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not job.done():
        for h in handles:
            h.cancel()
        job.cancel()
        raise APIError(499, "The client closed the request.")
    return job.result()


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class EngineStream(StreamingResponse):
    """Server-sent events whose engine requests are cancelled when the response ends for
    any reason: finished, or the client gone (its slots free within a decode step)."""

    def __init__(self, body, handles: list):
        super().__init__(body, media_type="text/event-stream")
        self._handles = handles

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            for h in self._handles:
                h.cancel()
