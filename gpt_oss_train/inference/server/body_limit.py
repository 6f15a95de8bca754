"""The request body limit (serve --max_request_bytes), enforced before a body is read whole.

A request whose Content-Length is over the limit gets 413 at once, its body never read;
a chunked body (no Content-Length) is counted as it arrives and gets 413 as soon as it
grows past the limit. Both answers are OpenAI's error JSON (code "request_too_large").
"""

from __future__ import annotations

from starlette.exceptions import HTTPException

from gpt_oss_train.inference.server.errors import APIError

TOO_LARGE = "request_too_large"


class BodyTooLarge(HTTPException):
    """Raised from `receive` when a streamed body passes the limit. An HTTPException, so
    FastAPI's body reader passes it on to the error handlers (errors.install), which answer
    413 in OpenAI's shape."""

    code = TOO_LARGE

    def __init__(self, limit: int, length: int | None = None):
        sent = f"{length} bytes" if length is not None else f"more than {limit} bytes"
        super().__init__(
            413,
            f"The request body ({sent}) is over this server's limit of {limit} bytes "
            "(serve --max_request_bytes). Send a smaller request.",
        )


def _content_length(scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # uvicorn refuses a malformed length before the app sees it
    return None


class BodyLimit:
    """ASGI middleware: at most `limit` body bytes per HTTP request."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = _content_length(scope)
        if length is not None and length > self.limit:
            e = BodyTooLarge(self.limit, length)
            return await APIError(413, e.detail, code=TOO_LARGE).response()(scope, receive, send)
        received = 0
        started = False

        async def counted():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise BodyTooLarge(self.limit)
            return message

        async def watched(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, watched)
        except BodyTooLarge as e:  # read outside a route (the handlers answer inside one)
            if started:
                raise
            await APIError(413, e.detail, code=TOO_LARGE).response()(scope, receive, send)
