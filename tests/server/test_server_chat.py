"""The official `openai` client against a real server (uvicorn on a loopback port) serving
a tiny gpt-oss trained to write known Harmony (tests/support/harmony_model.py): chat whole and
streamed, reasoning effort, a tool call round trip, stop strings, logprobs, and
/v1/completions with echo, each checked against the tokenizer's own render and parse or
against decode's generate / score on the same checkpoint."""

import json
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

openai = pytest.importorskip("openai")

import jax
from support import harmony_model as hm

from gpt_oss_train.decode import requests
from gpt_oss_train.inference import loading
from gpt_oss_train.io import tokenizer as tok_lib

pytestmark = pytest.mark.full  # the trained Harmony model (a few minutes, once per machine)

TOKENIZER = tok_lib.Tokenizer()
MODEL = "tiny-harmony"
GREEDY = {"temperature": 0, "extra_body": {"return_token_ids": True}}


@pytest.fixture(scope="module")
def server(harmony_server):
    return harmony_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference(harmony_checkpoint):
    """decode's model on the same folder, one device: the numbers the server must give."""
    return loading.load_model(harmony_checkpoint, dtype="float32", devices=jax.devices()[:1])


def _example(i):
    prompt, tools, effort, reply = hm.EXAMPLES[i]
    return prompt, tools, effort, reply


def _extra(obj, key):
    return (obj.model_extra or {}).get(key)


@pytest.mark.parametrize("index", [0, 1])  # the same question at low and high effort
def test_chat_reasoning_effort_reaches_the_prompt_and_the_answer(client, index):
    prompt, _, effort, reply = _example(index)
    resp = client.chat.completions.create(
        model=MODEL, messages=prompt, reasoning_effort=effort, **GREEDY
    )
    choice = resp.choices[0]
    assert choice.message.content == reply[1]["content"]
    assert _extra(choice.message, "reasoning_content") == reply[0]["content"]
    assert choice.finish_reason == "stop"
    rendered = TOKENIZER.render_chat(prompt, effort)
    assert _extra(resp, "prompt_token_ids") == rendered
    assert f"Reasoning: {effort}" in TOKENIZER.decode(rendered)
    target = hm.encoded_examples(TOKENIZER)[index][1]
    assert _extra(choice, "token_ids") == target
    assert resp.usage.prompt_tokens == len(rendered)
    assert resp.usage.completion_tokens == len(target)


def test_chat_stream_sends_reasoning_and_content_token_by_token(client):
    prompt, _, effort, reply = _example(1)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=prompt,
        reasoning_effort=effort,
        stream=True,
        stream_options={"include_usage": True},
        temperature=0,
    )
    reasoning, content, finish, usage = [], [], None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            if _extra(c.delta, "reasoning_content"):
                reasoning.append(_extra(c.delta, "reasoning_content"))
            if c.delta.content:
                content.append(c.delta.content)
            finish = c.finish_reason or finish
    assert "".join(reasoning) == reply[0]["content"]
    assert "".join(content) == reply[1]["content"]
    assert len(reasoning) > 5 and len(content) > 3
    assert finish == "stop"
    assert usage.completion_tokens == len(hm.encoded_examples(TOKENIZER)[1][1])


def _streamed_tool_calls(stream):
    """{index: {"id", "name", "arguments", "pieces"}} from tool-call deltas, OpenAI-style."""
    calls, finish = {}, None
    for chunk in stream:
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for tc in c.delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"arguments": "", "pieces": 0})
                if tc.id:
                    call["id"], call["name"] = tc.id, tc.function.name
                if tc.function and tc.function.arguments:
                    call["arguments"] += tc.function.arguments
                    call["pieces"] += 1
    return calls, finish


def test_tool_call_round_trip(client):
    prompt, tools, _, _ = _example(4)
    resp = client.chat.completions.create(model=MODEL, messages=prompt, tools=tools, **GREEDY)
    msg = resp.choices[0].message
    assert resp.choices[0].finish_reason == "tool_calls"
    assert msg.content is None
    (call,) = msg.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == json.loads(hm.WEATHER_ARGS)
    assert _extra(msg, "reasoning_content") == hm.WEATHER_ANALYSIS["content"]

    stream = client.chat.completions.create(
        model=MODEL, messages=prompt, tools=tools, stream=True, temperature=0
    )
    calls, finish = _streamed_tool_calls(stream)
    assert finish == "tool_calls" and list(calls) == [0]
    assert calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert calls[0]["pieces"] > 5  # the arguments really stream
    assert calls[0]["arguments"] == hm.WEATHER_ARGS

    # The second turn: the assistant's call (with its reasoning) and the tool's answer.
    turn = prompt + [
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": _extra(msg, "reasoning_content"),
            "tool_calls": [call.model_dump()],
        },
        {"role": "tool", "tool_call_id": call.id, "content": hm.WEATHER_RESULT},
    ]
    resp2 = client.chat.completions.create(model=MODEL, messages=turn, tools=tools, **GREEDY)
    expected_prompt, _, _, reply2 = _example(5)
    assert _extra(resp2, "prompt_token_ids") == TOKENIZER.render_chat(
        expected_prompt, "medium", tools
    )
    assert resp2.choices[0].message.content == reply2[0]["content"]
    assert resp2.choices[0].finish_reason == "stop"


def test_stop_string_n_and_chat_logprobs(client, reference):
    prompt, _, effort, reply = _example(0)
    resp = client.chat.completions.create(
        model=MODEL,
        messages=prompt,
        reasoning_effort=effort,
        stop=["Paris"],
        n=2,
        logprobs=True,
        top_logprobs=2,
        **GREEDY,
    )
    assert [c.message.content for c in resp.choices] == ["The capital of France is "] * 2
    assert [c.finish_reason for c in resp.choices] == ["stop", "stop"]
    # Logprobs of the generated tokens equal decode's for the same greedy tokens.
    ids = _extra(resp.choices[0], "token_ids")
    line = json.dumps({"tokens": _extra(resp, "prompt_token_ids"), "max_new_tokens": len(ids)})
    ref = requests.run_generate(reference, line.encode(), loading.Options())[0]
    assert ref["tokens"][: len(ids)] == ids
    got = [e.logprob for e in resp.choices[0].logprobs.content]
    np.testing.assert_allclose(got, ref["logprobs"][: len(ids)], atol=1e-5)
    for e in resp.choices[0].logprobs.content:  # greedy: the chosen token is the top one
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob == pytest.approx(e.logprob)


def test_completions_echo_logprobs_equal_decode_score(client, reference):
    text = "The capital of France is Paris, and the capital of Spain is"
    resp = client.completions.create(
        model=MODEL, prompt=text, max_tokens=4, echo=True, logprobs=1, temperature=0
    )
    choice = resp.choices[0]
    ids = TOKENIZER.encode(text)
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None
    assert len(lp.tokens) == len(ids) + 4 and choice.text.startswith(text)
    score = requests.run_score(reference, json.dumps({"tokens": ids}).encode(), loading.Options())
    np.testing.assert_allclose(lp.token_logprobs[1 : len(ids)], score[0]["logprobs"], atol=1e-5)
    line = json.dumps({"tokens": ids, "max_new_tokens": 4})
    ref = requests.run_generate(reference, line.encode(), loading.Options())[0]
    assert _extra(choice, "token_ids") == ref["tokens"]
    np.testing.assert_allclose(lp.token_logprobs[len(ids) :], ref["logprobs"], atol=1e-5)


def test_models_and_errors_through_the_client(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model=MODEL, prompt=[1] * 600, max_tokens=1)


def _post(url, body: bytes):
    """(status, JSON body) of a raw POST: bodies the openai client cannot send."""
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _assert_answers(client):
    """The server still serves: greedy chat gives the memorised reply."""
    prompt, _, effort, reply = _example(0)
    resp = client.chat.completions.create(
        model=MODEL, messages=prompt, reasoning_effort=effort, **GREEDY
    )
    assert resp.choices[0].message.content == reply[1]["content"]


def test_a_2mb_prompt_is_refused_before_tokenizing_and_the_server_serves_on(client):
    """No o200k token is longer than 128 bytes, so 2,000,000 bytes of text are at least
    15,625 tokens: more than the 512 positions, refused without tokenizing (the message
    gives that bound, not a token count)."""
    big = "x" * 2_000_000
    start = time.perf_counter()
    for call in (
        lambda: client.completions.create(model=MODEL, prompt=big, max_tokens=4),
        lambda: client.completions.create(model=MODEL, prompt=["hi", big], max_tokens=4),
        lambda: client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": big}]
        ),
    ):
        with pytest.raises(openai.BadRequestError) as caught:
            call()
        error = caught.value.body
        assert caught.value.status_code == 400 and error["code"] == "context_length_exceeded"
        assert "2000000 bytes of text are at least 15625 tokens" in error["message"]
        assert error["param"] in ("prompt", "messages")
    assert time.perf_counter() - start < 30
    _assert_answers(client)


def test_the_length_bound_refuses_nothing_that_fits(client):
    """65,024 spaces are 508 tokens of 128 spaces: with 4 more tokens they fill the 512
    positions exactly, so they must be served; asking for 5 more is refused up front."""
    spaces = " " * (128 * 508)
    ok = client.completions.create(model=MODEL, prompt=spaces, max_tokens=4, temperature=0)
    assert ok.usage.prompt_tokens == 508 and ok.usage.completion_tokens == 4
    with pytest.raises(openai.BadRequestError, match="at least 508 tokens and 5 more"):
        client.completions.create(model=MODEL, prompt=spaces, max_tokens=5)


def test_bodies_fastapi_refuses_itself_get_openais_error_json(server, client):
    url = server.url + "/v1/chat/completions"
    deep = b'{"model": "tiny-harmony", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    status, body = _post(url, deep)  # json.loads raises RecursionError inside FastAPI
    assert status == 400, body
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error"
    assert "nested too deeply" in body["error"]["message"]
    status, body = _post(url, b"[1, 2]")  # valid JSON, not an object
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    status, body = _post(server.url + "/v1/no_such_route", b"{}")
    assert status == 404 and body["error"]["type"] == "not_found_error"
    status, body = _post(server.url + "/v1/models", b"{}")  # GET only
    assert status == 405 and body["error"]["message"] == "Method Not Allowed"
    _assert_answers(client)
