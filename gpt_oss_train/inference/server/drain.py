"""Shutting down without cutting a response off (serve's SIGTERM or Ctrl-C).

Draining begins with `Drain.begin(grace_s)`; the listener keeps accepting meanwhile:
/health answers 503 and every new /v1 request gets 503 in OpenAI's error JSON (code
"server_shutting_down") with Retry-After, while the requests already running go on.
`Drain.finish(engine)` returns once none runs, or at the end of the grace period; then the
engine ends every request still queued or running (its finish reason "cancelled"), so
each route finishes its response the normal way: a stream with a last chunk whose
finish_reason is "abort" (as vLLM's) then `data: [DONE]`, a whole response with 503.
Only after that does uvicorn close the listener and the connections.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

from absl import logging

from gpt_oss_train.inference.server import errors

# Once the engine has ended the requests still running: how long their routes may take
# to send the last chunk or error (a client reading slowly), before uvicorn cuts them.
FINISH_S = 5.0


def is_api(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/")


class Drain:
    """The server's drain state: /v1 requests in flight, and the grace period's end."""

    def __init__(self):
        self.in_flight = 0
        self.deadline: float | None = None  # time.monotonic() at which the grace period ends

    @property
    def draining(self) -> bool:
        return self.deadline is not None

    def begin(self, grace_s: float) -> None:
        """From now on /health says 503 and new /v1 requests are refused (503)."""
        if self.deadline is None:
            self.deadline = time.monotonic() + grace_s

    def retry_after_s(self) -> float:
        """Until the grace period ends: this server serves nothing new before then."""
        return max(1.0, (self.deadline or 0.0) - time.monotonic())

    async def finish(self, engine, forced: Callable[[], bool] = lambda: False) -> None:
        """Waits for the /v1 requests in flight to end, up to the grace period (or until
        `forced()`); then stops the engine, which ends those still queued or running, and
        waits up to FINISH_S for their routes to send what they end with."""
        self.begin(0.0)
        while self.in_flight and time.monotonic() < self.deadline and not forced():
            await asyncio.sleep(0.05)
        if self.in_flight:
            logging.warning(
                "grace period over: ending the %d request(s) still running (a stream ends "
                'with finish_reason "abort", a whole response is a 503)',
                self.in_flight,
            )
        await asyncio.to_thread(engine.stop, 0.0)
        end = time.monotonic() + FINISH_S
        while self.in_flight and time.monotonic() < end and not forced():
            await asyncio.sleep(0.05)


class DrainGate:
    """ASGI middleware: counts the /v1 requests in flight, and refuses new ones (503 with
    Retry-After) once the drain has begun."""

    def __init__(self, app, drain: Drain):
        self.app, self.drain = app, drain

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not is_api(scope["path"]):
            return await self.app(scope, receive, send)
        if self.drain.draining:
            refusal = errors.shutting_down(self.drain.retry_after_s())
            return await refusal.response()(scope, receive, send)
        self.drain.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.in_flight -= 1
