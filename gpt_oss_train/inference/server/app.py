"""The FastAPI application: OpenAI's routes over one engine.

    POST /v1/chat/completions   chat_routes.py
    POST /v1/completions        completion_routes.py
    GET  /v1/models             the served model, then each LoRA adapter (a request
                                names one as its "model" to generate with it)
    GET  /health                200 while serving, 503 once shutting down
    GET  /metrics               Prometheus text (metrics.py)

`create_app(engine, ...)` takes a started engine; `serve.py` makes one from flags and runs
the app under uvicorn.
"""

from __future__ import annotations

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


def create_app(engine, *, tokenizer, model_name: str, max_context: int, vocab_size: int) -> FastAPI:
    metrics = Metrics(engine.stats)
    state = ServerState(
        engine, tokenizer, model_name, max_context, vocab_size, metrics, adapters=engine.adapters
    )
    app = FastAPI(title="gpt_oss_train", docs_url=None, redoc_url=None)
    app.state.server = state
    app.state.shutting_down = False
    errors.install(app)
    _count_requests(app, metrics)
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
