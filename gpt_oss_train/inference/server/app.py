"""The FastAPI application: OpenAI's routes over one engine.

    POST /v1/chat/completions   chat_routes.py
    POST /v1/completions        completion_routes.py
    GET  /v1/models             the served model, then each LoRA adapter (a request
                                names one as its "model" to generate with it)
    GET  /health                200 while serving, 503 once shutting down
    GET  /metrics               Prometheus text (metrics.py)

`create_app(engine, ...)` takes a started engine; `serve.py` makes one from flags and runs
the app under uvicorn. With `api_key`, every /v1/* request must send
`Authorization: Bearer <api_key>` or gets 401 (OpenAI's error, code "invalid_api_key");
/health and /metrics stay open, for load balancers and Prometheus.
"""

from __future__ import annotations

import hmac

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from gpt_oss_train.inference.server import chat_routes, completion_routes, errors
from gpt_oss_train.inference.server.generation import ServerState
from gpt_oss_train.inference.server.metrics import CONTENT_TYPE, Metrics

_COUNTED = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}


def _count_requests(app: FastAPI, metrics: Metrics) -> None:
    @app.middleware("http")
    async def count(request: Request, call_next):
        response = await call_next(request)
        endpoint = _COUNTED.get(request.url.path)
        if endpoint is not None:
            metrics.requests.labels(endpoint, str(response.status_code)).inc()
        return response


def _require_api_key(app: FastAPI, api_key: str) -> None:
    """401 for a /v1/* request without `Authorization: Bearer <api_key>`. The header is
    compared in constant time, so the answer's timing does not tell how much of a guess
    was right."""
    expected = f"Bearer {api_key}".encode()

    @app.middleware("http")
    async def check_key(request: Request, call_next):
        path = request.url.path
        if path == "/v1" or path.startswith("/v1/"):
            sent = request.headers.get("authorization")
            # Starlette decodes headers as latin-1: encoding back gives the bytes sent.
            if sent is None or not hmac.compare_digest(sent.encode("latin-1"), expected):
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
) -> FastAPI:
    """The app over a started engine; `api_key` (None or "": none) guards /v1/*."""
    metrics = Metrics(engine.stats)
    state = ServerState(
        engine, tokenizer, model_name, max_context, vocab_size, metrics, adapters=engine.adapters
    )
    app = FastAPI(title="gpt_oss_train", docs_url=None, redoc_url=None)
    app.state.server = state
    app.state.shutting_down = False
    errors.install(app)
    if api_key:
        _require_api_key(app, api_key)
    _count_requests(app, metrics)  # added last, so it runs first: 401s are counted too
    chat_routes.register(app, state)
    completion_routes.register(app, state)

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
        if app.state.shutting_down:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.text(), media_type=CONTENT_TYPE)

    return app
