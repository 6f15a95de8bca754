"""POST /v1/completions: raw continuation of text or token-id prompts.

`echo` with `logprobs` returns the prompt's own log-probabilities (from `engine.score`,
the numbers evaluation harnesses sum for log-likelihood), the first prompt token's being
null as in OpenAI's API. Every choice carries its generated ids as `token_ids`.
"""

from __future__ import annotations

import asyncio
import time

from fastapi import FastAPI, Request

from gpt_oss_train.inference.loading import TEXT_STOP_IDS
from gpt_oss_train.inference.server import errors, generation
from gpt_oss_train.inference.server.errors import APIError, bad_request
from gpt_oss_train.inference.server.generation import SSE_DONE, ServerState, sse, usage
from gpt_oss_train.inference.server.schemas import CompletionRequest
from gpt_oss_train.inference.server.text import Detokenizer, StopMatcher, decode, token_text


def _prompt_ids(state: ServerState, prompt, i: int, max_tokens: int) -> list[int]:
    if isinstance(prompt, str):
        # max_tokens=0 (echo only) needs room for the prompt alone
        generation.check_text_length(
            state, [prompt], max_tokens, param="max_tokens", prompt_param="prompt"
        )
        ids = state.tokenizer.encode(prompt)
        if not ids:
            raise bad_request(f"prompt {i} is empty.", "prompt")
        return ids
    vocab = state.vocab_size
    if not prompt or any(not 0 <= t < vocab for t in prompt):
        raise bad_request(f"prompt {i}: token ids must be in [0, {vocab}) and not empty.", "prompt")
    return list(prompt)


class _Logprobs:
    """OpenAI's legacy logprobs object, built a token at a time."""

    def __init__(self, top_n: int):
        self.top_n = top_n
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []
        self._offset = 0

    def add(self, token: int, logprob: float | None, top, text: str) -> None:
        self.tokens.append(token_text(token))
        self.token_logprobs.append(logprob)
        self.top_logprobs.append(
            None if top is None else {token_text(t): lp for t, lp in top[: self.top_n]}
        )
        self.text_offset.append(self._offset)
        self._offset += len(text)

    def dict(self, start: int = 0) -> dict:
        return {
            k: getattr(self, k)[start:]
            for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")
        }


class _Choice:
    def __init__(self, req: CompletionRequest, prompt: list[int]):
        self.prompt = prompt
        self.detok = Detokenizer()
        self.stop = StopMatcher(req.stop_list())
        self.text, self.tokens, self.finish = "", [], None
        self.logprobs = _Logprobs(req.logprobs) if req.logprobs is not None else None

    def echo(self, scored) -> str:
        """The prompt as the start of the text, and its logprobs rows (the first null)."""
        text = decode(self.prompt)
        if self.logprobs is not None:
            logprobs, tops = scored
            for i, t in enumerate(self.prompt):
                lp, top = (None, None) if i == 0 else (logprobs[i - 1], tops[i - 1])
                self.logprobs.add(t, lp, top, decode([t]))
        return text

    def take(self, ev) -> str:
        """Feed one engine event; returns the new text (nothing after a stop string)."""
        if self.finish is not None:
            return ""
        new = ""
        if generation.has_token(ev) and not self.stop.stopped:
            piece = self.detok.push(ev.token)
            self.tokens.append(ev.token)
            if self.logprobs is not None:
                self.logprobs.add(ev.token, ev.logprob, ev.top_logprobs, piece)
            new, _ = self.stop.push(piece)
        if ev.finish_reason is not None or self.stop.stopped:
            if ev.finish_reason == "error":
                raise APIError(500, "The engine failed while generating this request.")
            if not self.stop.stopped:
                new += self.stop.push(self.detok.flush())[0] + self.stop.flush()
            self.finish = _finish_reason(ev.finish_reason, self.stop.stopped)
        self.text += new
        return new


def _finish_reason(engine_reason: str | None, stop_string: bool) -> str:
    if stop_string:
        return "stop"
    if engine_reason == "cancelled":  # ended by the engine (the server's shutdown)
        return generation.ABORT
    return "length" if engine_reason == "length" else "stop"


def _score(state, prompt: list[int], k: int, adapter: str | None):
    """(log p of each prompt token after the first, the k most likely at each position),
    under the request's adapter."""
    if len(prompt) < 2:
        return [], []
    engine = state.engine
    logprobs = engine.score(prompt, adapter)
    if not k:
        return logprobs, [[] for _ in logprobs]
    tops = engine.top_logprobs(prompt, k, adapter)
    # The prompt token among the alternatives carries the very number token_logprobs
    # reports (the two forward passes may differ in the last bit), so "is it the most
    # likely token?" compares equal numbers.
    return logprobs, [
        [(t, lp if t != nxt else chosen) for t, lp in top]
        for top, nxt, chosen in zip(tops, prompt[1:], logprobs)
    ]


async def _prompt_scores(state, req, prompts, adapter) -> list:
    if not (req.echo and req.logprobs is not None):
        return [None] * len(prompts)
    return [await asyncio.to_thread(_score, state, p, req.logprobs, adapter) for p in prompts]


def _params(state, req, prompts, adapter):
    out = []
    for p in prompts:
        max_tokens = generation.check_length(state, len(p), req.max_tokens, "max_tokens")
        out += generation.choice_params(req, max_tokens, TEXT_STOP_IDS, req.logprobs or 0, adapter)
    return out


def _submit_all(state, prompts, params, n) -> list:
    handles = []
    try:
        for i, p in enumerate(prompts):
            handles += generation.submit(state, p, params[i * n : (i + 1) * n])
    except APIError:
        for h in handles:
            h.cancel()
        raise
    return handles


async def _run(state, handles, choices, start):
    async for i, ev in generation.merged(handles, state.metrics, start):
        choices[i].take(ev)
        if choices[i].finish is not None:
            handles[i].cancel()
    return choices


def _choice_dict(i: int, c: _Choice, echoed: str, with_prompt_ids: bool) -> dict:
    return {
        "index": i,
        "text": echoed + c.text,
        "logprobs": None if c.logprobs is None else c.logprobs.dict(),
        "finish_reason": c.finish,
        "token_ids": c.tokens,
        **({"prompt_token_ids": c.prompt} if with_prompt_ids else {}),
    }


async def _stream(state, req, rid, handles, choices, echoes, start):
    created = int(time.time())

    def chunk(i, text, finish=None, logprobs=None, token_ids=()):
        c = {
            "index": i,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": finish,
            "token_ids": list(token_ids),
        }
        return sse(
            {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": req.model,
                "choices": [c],
            }
        )

    sent = [0] * len(choices)  # tokens already sent, per choice
    sent_lp = [len(c.logprobs.tokens) if c.logprobs else 0 for c in choices]  # after echo
    for i, text in enumerate(echoes):
        if text:
            yield chunk(i, text)
    try:
        async for i, ev in generation.merged(handles, state.metrics, start):
            c = choices[i]
            text = c.take(ev)
            lp = c.logprobs.dict(sent_lp[i]) if c.logprobs else None
            sent_lp[i] = len(c.logprobs.tokens) if c.logprobs else 0
            if text or c.finish or len(c.tokens) > sent[i]:
                yield chunk(i, text, c.finish, lp, c.tokens[sent[i] :])
            sent[i] = len(c.tokens)
            if c.finish:
                handles[i].cancel()
    except APIError as e:
        yield sse(e.body())
    if req.stream_options and req.stream_options.include_usage:
        n_in, n_out = sum(len(c.prompt) for c in choices), sum(len(c.tokens) for c in choices)
        yield sse(
            {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": req.model,
                "choices": [],
                "usage": usage(n_in, n_out),
            }
        )
    yield SSE_DONE


def register(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        start = time.perf_counter()
        adapter = generation.check_model(state, req.model)
        raw = req.prompts()
        if req.max_tokens:
            many = f"{len(raw)} prompt(s) x n={req.n}"
            param = "prompt" if len(raw) > 1 else "n"
            generation.check_capacity(state, len(raw) * req.n, many, param=param)
        prompts = [_prompt_ids(state, p, i, req.max_tokens) for i, p in enumerate(raw)]
        params = _params(state, req, prompts, adapter) if req.max_tokens else []
        scores = await _prompt_scores(state, req, prompts, adapter)
        choices = [_Choice(req, p) for p in prompts for _ in range(req.n)]
        echoes = [c.echo(scores[k // req.n]) if req.echo else "" for k, c in enumerate(choices)]
        handles = _submit_all(state, prompts, params, req.n) if params else []
        rid = generation.request_id("cmpl")
        if req.stream:
            body = _stream(state, req, rid, handles, choices, echoes, start)
            return generation.EngineStream(body, handles)
        if handles:
            await generation.unless_disconnected(
                request, _run(state, handles, choices, start), handles
            )
        if any(c.finish == generation.ABORT for c in choices):
            raise errors.shutting_down(1.0, ended=True)
        for c in choices:
            c.finish = c.finish or "length"
        return {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": req.model,
            "choices": [
                _choice_dict(i, c, echoes[i], req.return_token_ids) for i, c in enumerate(choices)
            ],
            "usage": usage(
                sum(len(p) for p in prompts) * req.n, sum(len(c.tokens) for c in choices)
            ),
        }
