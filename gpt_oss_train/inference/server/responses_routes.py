"""POST /v1/responses and GET /v1/responses/{id}: OpenAI's Responses API over the engine,
whole or streamed, Harmony channels as output items (responses_items.py).

A streamed response is server-sent events, each `event: TYPE` and `data: {...}` with a
`sequence_number` counting from 0:

    response.created, response.in_progress
    for each output item:  response.output_item.added
                           response.content_part.added              (reasoning, message)
                           response.reasoning_text.delta | response.output_text.delta |
                           response.function_call_arguments.delta   (token by token)
                           the matching .done
                           response.content_part.done               (reasoning, message)
                           response.output_item.done
    response.completed, or response.incomplete (max_output_tokens reached), or
    response.failed (the engine failed, or the server's shutdown ended the request)

Generation is chat's (the same prompt renderer, stop ids and engine calls); a response is
"completed" when the model ends its turn (<|return|>, or <|call|> after a function_call).
With `store` (the default) the response and its conversation are kept in memory
(responses_store.py) for `previous_response_id` and GET.
"""

from __future__ import annotations

import itertools
import json
import time

from fastapi import FastAPI, Request

from gpt_oss_train.inference.engine import RequestParams
from gpt_oss_train.inference.server import errors, generation, responses_items, structured
from gpt_oss_train.inference.server.chat_routes import CHAT_STOP_IDS
from gpt_oss_train.inference.server.errors import APIError, bad_request
from gpt_oss_train.inference.server.generation import ABORT, ServerState
from gpt_oss_train.inference.server.harmony_stream import ChatStream
from gpt_oss_train.inference.server.responses_items import OutputItems, new_id
from gpt_oss_train.inference.server.responses_request import ResponsesRequest, parse_item
from gpt_oss_train.inference.server.responses_store import ResponseStore, Stored


class _Turn:
    """The generated turn: its Harmony stream, output items, ids and how it ended."""

    def __init__(self):
        self.stream = ChatStream()
        self.output = OutputItems()
        self.tokens: list[int] = []
        self.end: str | None = None  # the engine's "stop" or "length", or ABORT

    def take(self, ev) -> list[dict]:
        """Feed one engine event; returns the stream events it produced."""
        if self.end is not None:
            return []
        events = []
        if generation.has_token(ev):
            self.tokens.append(ev.token)
            for d in self.stream.feed(ev.token):
                events += self.output.add(d)
        if ev.finish_reason is not None:
            if ev.finish_reason == "error":
                raise APIError(500, "The engine failed while generating this response.")
            for d in self.stream.finish():
                events += self.output.add(d)
            self.end = ev.finish_reason if ev.finish_reason in ("stop", "length") else ABORT
            events += self.output.close("completed" if self.end == "stop" else "incomplete")
        return events


def _earlier(store: ResponseStore, response_id: str | None) -> tuple:
    """The conversation `previous_response_id` continues (404 if it is not stored)."""
    if response_id is None:
        return ()
    entry = store.get(response_id)
    if entry is None:
        raise APIError(
            404,
            f"Previous response with id '{response_id}' not found: it was never stored "
            f"(store=false), or is older than the last {store.capacity} stored.",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    return entry.conversation


def _prompt(state: ServerState, req: ResponsesRequest, items: list, first: int) -> list[int]:
    """The rendered prompt, ending with `<|start|>assistant`; text too long for the
    context is refused before it is tokenized."""
    texts = responses_items.prompt_texts(items, req)
    generation.check_text_length(
        state, texts, req.max_output_tokens, param="max_output_tokens", prompt_param="input"
    )
    messages = responses_items.harmony_messages(items, req.instructions, first)
    try:
        return state.tokenizer.render_chat(messages, req.effort, responses_items.render_tools(req))
    except ValueError as e:  # e.g. a system message that is not first
        raise bad_request(f"input: {e}", "input") from None


def _params(req: ResponsesRequest, max_tokens: int, adapter: str | None) -> RequestParams:
    tools = [t.model_dump(include={"name", "parameters", "strict"}) for t in req.tools or []]
    return RequestParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        stop_ids=CHAT_STOP_IDS,
        adapter=adapter,
        grammar=structured.grammar(
            req.text_format(), "text.format", req.tool_choice, tools, max_tokens
        ),
    )


class _Response:
    """One request's response: generated, returned whole or as events, then stored."""

    def __init__(self, state, store, req, conversation, prompt, handles, start):
        self.state, self.store, self.req = state, store, req
        self.conversation = conversation  # the items the prompt renders
        self.prompt, self.handles, self.start = prompt, handles, start
        self.id, self.created = new_id("resp"), int(time.time())
        self.turn = _Turn()

    def body(self, status: str, error: dict | None = None) -> dict:
        """The Response object; its output and usage once generation has ended."""
        req, ended = self.req, status in ("completed", "incomplete")
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": error,
            "incomplete_details": incomplete,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": req.model,
            "output": self.turn.output.items if ended else [],
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": req.effort, "summary": None},
            "store": req.store,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": {"format": req.text_format()},
            "tool_choice": req.tool_choice or "auto",
            "tools": [t.model_dump() for t in req.tools or []],
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "truncation": "disabled",
            "usage": self._usage() if ended else None,
            "user": req.user,
            "metadata": req.metadata or {},
        }

    def _usage(self) -> dict:
        handle = self.handles[0]
        cached = handle.result(0).cached_prompt_tokens if handle.done else 0
        n_in, n_out = len(self.prompt), len(self.turn.tokens)
        return {
            "input_tokens": n_in,
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": n_out,
            "output_tokens_details": {"reasoning_tokens": self.turn.stream.reasoning_tokens},
            "total_tokens": n_in + n_out,
        }

    def _finish(self) -> dict:
        """The ended response, stored with its conversation if `store`."""
        body = self.body("completed" if self.turn.end == "stop" else "incomplete")
        if self.req.store:
            # Output items are input items as they are: parsed once, they render the same
            # whether the client continues by previous_response_id or sends them back.
            output = [parse_item(i, item) for i, item in enumerate(body["output"])]
            self.store.put(self.id, Stored(body, (*self.conversation, *output)))
        return body

    async def whole(self) -> dict:
        merged = generation.merged(self.handles, self.state.metrics, self.start)
        async for _, ev in merged:
            self.turn.take(ev)
        if self.turn.end == ABORT:
            raise errors.shutting_down(1.0, ended=True)
        return self._finish()

    async def events(self):
        numbers = itertools.count()

        def sse(event: dict) -> str:
            event["sequence_number"] = next(numbers)
            data = json.dumps(event, ensure_ascii=False)
            return f"event: {event['type']}\ndata: {data}\n\n"

        yield sse({"type": "response.created", "response": self.body("in_progress")})
        yield sse({"type": "response.in_progress", "response": self.body("in_progress")})
        try:
            async for _, ev in generation.merged(self.handles, self.state.metrics, self.start):
                for event in self.turn.take(ev):
                    yield sse(event)
        except APIError as e:
            error = {"code": "server_error", "message": e.message}
            yield sse({"type": "response.failed", "response": self.body("failed", error)})
            return
        if self.turn.end == ABORT:
            error = {"code": errors.SHUTTING_DOWN, "message": errors.shutting_down(0, True).message}
            yield sse({"type": "response.failed", "response": self.body("failed", error)})
            return
        body = self._finish()
        yield sse({"type": f"response.{body['status']}", "response": body})


def register(app: FastAPI, state: ServerState, store: ResponseStore | None = None) -> None:
    """The routes, over `store` (default: a new ResponseStore, also at app.state.responses)."""
    store = ResponseStore() if store is None else store
    app.state.responses = store

    @app.post("/v1/responses")
    async def create_response(req: ResponsesRequest, request: Request):
        start = time.perf_counter()
        adapter = generation.check_model(state, req.model)
        earlier = _earlier(store, req.previous_response_id)
        conversation = [*earlier, *req.items]
        prompt = _prompt(state, req, conversation, len(earlier))
        max_tokens = generation.check_length(
            state, len(prompt), req.max_output_tokens, "max_output_tokens", "input"
        )
        handles = generation.submit(state, prompt, [_params(req, max_tokens, adapter)])
        response = _Response(state, store, req, conversation, prompt, handles, start)
        if req.stream:
            return generation.EngineStream(response.events(), handles)
        return await generation.unless_disconnected(request, response.whole(), handles)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str):
        entry = store.get(response_id)
        if entry is None:
            raise APIError(
                404,
                f"Response with id '{response_id}' not found: it was never stored "
                f"(store=false), or is older than the last {store.capacity} stored.",
                param="response_id",
                code="response_not_found",
            )
        return entry.response
