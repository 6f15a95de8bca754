"""POST /v1/chat/completions: Harmony chat behind OpenAI's chat schema, whole or streamed."""

from __future__ import annotations

import time

from fastapi import FastAPI, Request

from gpt_oss_train.inference.server import chat_format, errors, generation, structured
from gpt_oss_train.inference.server.errors import APIError
from gpt_oss_train.inference.server.generation import SSE_DONE, ServerState, sse, usage
from gpt_oss_train.inference.server.harmony_stream import ChatStream, Delta
from gpt_oss_train.inference.server.schemas import ChatCompletionRequest
from gpt_oss_train.inference.server.text import token_text
from gpt_oss_train.io import tokenizer as tok_lib

CHAT_STOP_IDS = tuple(sorted(tok_lib.Tokenizer.stop_ids))  # <|return|>, <|call|>


def _logprob_entry(token: int, logprob: float, top: list) -> dict:
    def one(t, lp):
        return {"token": token_text(t), "logprob": lp, "bytes": list(tok_lib.token_bytes(t))}

    return {**one(token, logprob), "top_logprobs": [one(t, lp) for t, lp in top]}


class _Choice:
    """One choice's state: its Harmony stream, ids, logprobs and finish reason."""

    def __init__(self, req: ChatCompletionRequest):
        self.stream = ChatStream(req.stop_list())
        self.want_logprobs, self.top_n = req.logprobs, req.top_logprobs or 0
        self.tokens: list[int] = []
        self.logprobs: list[dict] = []
        self._sent_logprobs = 0
        self.finish: str | None = None
        self.reported = False  # its final chunk went out (streaming)

    def take(self, ev) -> list[Delta]:
        """Feed one engine event; returns the deltas it produced."""
        if self.finish is not None:
            return []
        deltas = []
        if generation.has_token(ev) and not self.stream.stopped:
            self.tokens.append(ev.token)
            if self.want_logprobs:
                self.logprobs.append(
                    _logprob_entry(ev.token, ev.logprob, ev.top_logprobs[: self.top_n])
                )
            deltas = self.stream.feed(ev.token)
        if ev.finish_reason is not None or self.stream.stopped:
            if ev.finish_reason == "error":
                raise APIError(500, "The engine failed while generating this request.")
            deltas += self.stream.finish()
            self.finish = self._reason(ev.finish_reason)
        return deltas

    def _reason(self, engine_reason: str | None) -> str:
        if engine_reason == "cancelled" and not self.stream.stopped:
            return generation.ABORT  # ended by the engine (the server's shutdown)
        if self.stream.tool_calls and not self.stream.stopped and engine_reason == "stop":
            return "tool_calls"
        return "length" if engine_reason == "length" and not self.stream.stopped else "stop"

    def new_logprobs(self) -> dict | None:
        if not self.want_logprobs:
            return None
        out = self.logprobs[self._sent_logprobs :]
        self._sent_logprobs = len(self.logprobs)
        return {"content": out}


def _delta_dict(d: Delta) -> dict:
    if d.reasoning:
        return {"reasoning_content": d.reasoning}
    if d.content:
        return {"content": d.content}
    call = d.tool_call
    piece: dict = {"index": call.index, "function": {"arguments": call.arguments}}
    if call.id is not None:
        piece.update(id=call.id, type="function")
        piece["function"]["name"] = call.name
    return {"tool_calls": [piece]}


async def _run(state, req, prompt, handles, request_start):
    """Drive the engine requests to the end; returns the finished choices."""
    choices = [_Choice(req) for _ in handles]
    async for i, ev in generation.merged(handles, state.metrics, request_start):
        choices[i].take(ev)
        if choices[i].finish is not None:
            handles[i].cancel()  # a stop string ended it early; no-op when the engine did
    return choices


def _response(state, req, rid, prompt, choices) -> dict:
    out = {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": req.model,
        "choices": [
            {
                "index": i,
                "message": c.stream.message(),
                "logprobs": c.new_logprobs(),
                "finish_reason": c.finish,
                "token_ids": c.tokens,
            }
            for i, c in enumerate(choices)
        ],
        "usage": usage(len(prompt), sum(len(c.tokens) for c in choices)),
    }
    if req.return_token_ids:
        out["prompt_token_ids"] = prompt
    return out


async def _stream(state, req, rid, prompt, handles, request_start):
    created = int(time.time())
    choices = [_Choice(req) for _ in handles]

    def chunk(i, delta, finish=None, logprobs=None):
        c = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return sse(
            {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": req.model,
                "choices": [c],
            }
        )

    for i in range(len(handles)):
        yield chunk(i, {"role": "assistant", "content": ""})
    try:
        async for i, ev in generation.merged(handles, state.metrics, request_start):
            c = choices[i]
            for d in c.take(ev):
                yield chunk(i, _delta_dict(d), logprobs=c.new_logprobs())
            if c.finish is not None and not c.reported:
                c.reported = True
                handles[i].cancel()
                yield chunk(i, {}, c.finish, c.new_logprobs() if c.want_logprobs else None)
    except APIError as e:
        yield sse(e.body())
    if req.stream_options and req.stream_options.include_usage:
        n_out = sum(len(c.tokens) for c in choices)
        yield sse(
            {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": req.model,
                "choices": [],
                "usage": usage(len(prompt), n_out),
            }
        )
    yield SSE_DONE


def _params(state, req, n_prompt, adapter):
    max_tokens = generation.check_length(state, n_prompt, req.token_limit(), "max_tokens")
    logprobs = (req.top_logprobs or 0) if req.logprobs else 0
    tools = [t.function.model_dump() for t in req.tools or []]
    grammar = structured.grammar(
        req.response_format, "response_format", req.tool_choice_value(), tools, max_tokens
    )
    return generation.choice_params(
        req, max_tokens, CHAT_STOP_IDS, logprobs, adapter, grammar=grammar
    )


def register(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        start = time.perf_counter()
        adapter = generation.check_model(state, req.model)
        generation.check_capacity(state, req.n, f"n={req.n}", param="n")
        texts = chat_format.prompt_texts(req)
        generation.check_text_length(
            state, texts, req.token_limit(), param="max_tokens", prompt_param="messages"
        )
        prompt = chat_format.prompt_ids(req, state.tokenizer)
        handles = generation.submit(state, prompt, _params(state, req, len(prompt), adapter))
        rid = generation.request_id("chatcmpl")
        if req.stream:
            return generation.EngineStream(
                _stream(state, req, rid, prompt, handles, start), handles
            )
        work = _run(state, req, prompt, handles, start)
        choices = await generation.unless_disconnected(request, work, handles)
        if any(c.finish == generation.ABORT for c in choices):
            raise errors.shutting_down(1.0, ended=True)
        return _response(state, req, rid, prompt, choices)
