"""The FastAPI application: OpenAI's routes over one engine.

    POST /v1/chat/completions   chat_routes.py
    POST /v1/completions        completion_routes.py
    POST /v1/responses          responses_routes.py (OpenAI's Responses API), and
    GET  /v1/responses/{id}     a stored response (responses_store.py)
    GET  /v1/models             the served model, then each LoRA adapter (a request
                                names one as its "model" to generate with it)
    GET  /health                200 while serving, 503 once draining (drain.py) or when a
                                peer process of a multi-host engine is gone
    GET  /metrics               Prometheus text (metrics.py)

`create_app(engine, ...)` takes a started engine; `serve.py` makes one from flags and runs
the app under uvicorn. With `api_key`, every /v1/* request must send
`Authorization: Bearer <api_key>` (the scheme in any case, as RFC 7235 has it; the key
exactly) or gets 401 (OpenAI's error, code "invalid_api_key"); /health and /metrics stay
open, for load balancers and Prometheus. With `max_request_bytes`, a larger body gets 413
before it is read whole (body_limit.py). `app.state.drain` (drain.py) is what serve.py
drains on SIGTERM.
"""

from __future__ import annotations

import hmac

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from gpt_oss_train.inference.server import chat_routes, completion_routes, errors, responses_routes
from gpt_oss_train.inference.server.body_limit import BodyLimit
from gpt_oss_train.inference.server.drain import Drain, DrainGate, is_api
from gpt_oss_train.inference.server.generation import ServerState
from gpt_oss_train.inference.server.metrics import CONTENT_TYPE, Metrics

_COUNTED = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/responses": "responses",
}


def _count_requests(app: FastAPI, metrics: Metrics) -> None:
    @app.middleware("http")
    async def count(request: Request, call_next):
        response = await call_next(request)
        endpoint = _COUNTED.get(request.url.path)
        if endpoint is not None:
            metrics.requests.labels(endpoint, str(response.status_code)).inc()
        return response


def key_matches(sent: str, expected: bytes) -> bool:
    """Whether an Authorization header is `Bearer <expected>`: the scheme in any case
    (RFC 7235), then one space and the key, compared in constant time, so the answer's
    timing does not tell how much of a guess was right."""
    scheme, _, key = sent.partition(" ")
    # Starlette decodes headers as latin-1: encoding back gives the bytes sent.
    same = hmac.compare_digest(key.encode("latin-1"), expected)
    return scheme.lower() == "bearer" and same


def _require_api_key(app: FastAPI, api_key: str) -> None:
    """401 for a /v1/* request without `Authorization: Bearer <api_key>`."""
    expected = api_key.encode()

    @app.middleware("http")
    async def check_key(request: Request, call_next):
        if is_api(request.url.path):
            sent = request.headers.get("authorization")
            if sent is None or not key_matches(sent, expected):
                return errors.unauthorized(missing=sent is None).response()
        return await call_next(request)


def create_app(
    engine,
    *,
    tokenizer,
    model_name: str,
    max_context: int,
    vocab_size: int,
    api_key: str | None = None,
    max_request_bytes: int | None = None,
) -> FastAPI:
    """The app over a started engine; `api_key` (None or "": none) guards /v1/*;
    `max_request_bytes` (None: no limit) bounds every request's body."""
    metrics = Metrics(engine.stats)
    state = ServerState(
        engine, tokenizer, model_name, max_context, vocab_size, metrics, adapters=engine.adapters
    )
    app = FastAPI(title="gpt_oss_train", docs_url=None, redoc_url=None)
    app.state.server = state
    app.state.drain = drain = Drain()
    errors.install(app)
    # The last added runs first: counting, then the body limit and the drain's refusals,
    # then the key; so 401s, 413s and 503s are counted too.
    if api_key:
        _require_api_key(app, api_key)
    app.add_middleware(DrainGate, drain=drain)
    if max_request_bytes is not None:
        app.add_middleware(BodyLimit, limit=max_request_bytes)
    _count_requests(app, metrics)
    chat_routes.register(app, state)
    completion_routes.register(app, state)
    responses_routes.register(app, state)

    @app.get("/v1/models")
    async def models():
        def card(name: str, parent: str | None) -> dict:
            return {
                "id": name,
                "object": "model",
                "created": state.created,
                "owned_by": "gpt_oss_train",
                "max_model_len": max_context,
                "parent": parent,
            }

        cards = [card(model_name, None)] + [card(a, model_name) for a in state.adapters]
        return {"object": "list", "data": cards}

    @app.get("/health")
    async def health():
        if drain.draining:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        lost = engine.link.lost
        if lost is not None:  # a multi-host engine whose peer process is gone (hosts.py)
            return JSONResponse({"status": f"process {lost} is gone"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.text(), media_type=CONTENT_TYPE)

    return app
