"""Errors in OpenAI's JSON shape, with the status a client can act on.

    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}

400 for a request that can never run as written (malformed JSON, unknown or invalid
fields, a prompt longer than the context, more completions than the engine ever holds),
401 without the server's API key, 404 for an unknown model, 413 for a body over
--max_request_bytes, 429 / 503 with a `Retry-After` header when the engine's queue is full
or the server is shutting down (a request the shutdown ended unfinished included).
Anything unexpected becomes a 500 for that request alone: the server keeps serving the
rest. Errors FastAPI and Starlette raise themselves (a body too deeply nested to parse, an
unknown path, a wrong method) get the same shape, never their `{"detail": ...}`.
"""

from __future__ import annotations

import json
import math

from absl import logging
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",  # as OpenAI's, with code "invalid_api_key"
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_exceeded",
    500: "internal_server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error answer; `param` names the request field at fault, if any."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after_s = retry_after_s
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": _TYPES.get(self.status, "invalid_request_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        headers = dict(self.headers)
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after_s)))
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def unauthorized(missing: bool) -> APIError:
    """401 as OpenAI words it; the key sent, if any, is not echoed."""
    if missing:
        message = (
            "You didn't provide an API key. Send it in the Authorization header as "
            "'Authorization: Bearer YOUR_KEY'."
        )
    else:
        message = "Incorrect API key provided. Send 'Authorization: Bearer YOUR_KEY'."
    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


SHUTTING_DOWN = "server_shutting_down"  # the code of a 503 the shutdown causes


def shutting_down(retry_after_s: float, ended: bool = False) -> APIError:
    """503 while the server drains after SIGTERM: a new request is refused, or (`ended`)
    one still running when the grace period ran out was ended unfinished."""
    if ended:
        message = (
            "The server is shutting down: this request was still running when its grace "
            "period ended and was stopped unfinished. Send it again."
        )
    else:
        message = "The server is shutting down and takes no new requests. Send it elsewhere."
    return APIError(503, message, code=SHUTTING_DOWN, retry_after_s=retry_after_s)


def from_rejection(e: Exception) -> APIError:
    """The engine's RequestRejected (status 400 / 429 / 503, retry_after_s) as an APIError."""
    status = int(getattr(e, "status", 400))
    retry = getattr(e, "retry_after_s", None)
    if status in (429, 503) and retry is None:
        retry = 1.0
    return APIError(status, str(e), retry_after_s=retry if status in (429, 503) else None)


def _validation_message(e: RequestValidationError) -> tuple[str, str | None]:
    """The first problem pydantic found, as one line naming the field."""
    first = e.errors()[0] if e.errors() else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx", {})
        return f"The body is not valid JSON: {ctx.get('error', 'parse error')}.", None
    if first.get("type") == "extra_forbidden":
        return f"Unrecognized request argument supplied: {param}", param
    msg = first.get("msg", "invalid request")
    return (f"{param}: {msg}" if param else msg), param


def _from_http_exception(e: HTTPException) -> APIError:
    """FastAPI's own refusals (its body parser's 400, 404 for a path, 405 for a method)."""
    if isinstance(e.__cause__, RecursionError):  # json.loads on a body nested too deeply
        return bad_request("The body is nested too deeply to parse as JSON.")
    if isinstance(e.__cause__, BaseExceptionGroup):
        # An HTTPException raised while the body was read (body_limit.py's 413), wrapped
        # by a BaseHTTPMiddleware's task group, which FastAPI then calls a parse error.
        inner, _ = e.__cause__.split(HTTPException)
        while isinstance(inner, BaseExceptionGroup):
            inner = inner.exceptions[0]
        if inner is not None:
            e = inner
    detail = e.detail if isinstance(e.detail, str) else json.dumps(e.detail)
    return APIError(e.status_code, detail, code=getattr(e, "code", None), headers=e.headers)


def install(app: FastAPI) -> None:
    """Route every error through the OpenAI error shape."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError):
        message, param = _validation_message(e)
        return bad_request(message, param).response()

    @app.exception_handler(json.JSONDecodeError)
    async def _bad_json(_: Request, e: json.JSONDecodeError):
        return bad_request(f"The body is not valid JSON: {e.msg}.").response()

    @app.exception_handler(HTTPException)
    async def _http(_: Request, e: HTTPException):
        return _from_http_exception(e).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):
        logging.exception("request %s %s failed", request.method, request.url.path)
        return APIError(500, f"Internal error: {type(e).__name__}: {e}").response()
