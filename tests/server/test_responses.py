"""POST /v1/responses and GET /v1/responses/{id} with the official `openai` client.

Without a model: input items render as the same conversation written by hand as Harmony
dicts (the tokenizer's render is the reference), and a completion rendered from Harmony
dicts streams into the output items and events harmony's own parse of it gives; the
response store evicts the oldest first.

Default tier, a real server (uvicorn on a loopback port) over an engine on a random
gpt-oss with the real vocabulary and a bigram path written into its weights, so that it
answers every prompt with a known final message: the prompt each request hands the
engine (recorded) is the reference render of its conversation (reasoning effort,
instructions, tools, previous_response_id or the same items sent back), the output is
the parse of the engine's own tokens, max_output_tokens makes it incomplete, a stream's
events come in order and rebuild the whole response, and errors are OpenAI's JSON.

Full tier, the trained Harmony model (tests/support/harmony_model.py): reasoning effort
changes the memorised reasoning; a function tool round trip (function_call out,
function_call_output in, the memorised final answer), whole and streamed.
"""

import json
import types
import urllib.request

import pytest

openai = pytest.importorskip("openai")

import jax
import numpy as np
from support import harmony_model as hm
from support import random_models

from gpt_oss_train.inference.engine import Engine, RequestParams
from gpt_oss_train.inference.server import responses_items
from gpt_oss_train.inference.server.app import create_app
from gpt_oss_train.inference.server.chat_routes import CHAT_STOP_IDS
from gpt_oss_train.inference.server.harmony_stream import ChatStream
from gpt_oss_train.inference.server.local import ThreadServer
from gpt_oss_train.inference.server.responses_request import ResponsesRequest
from gpt_oss_train.inference.server.responses_store import ResponseStore, Stored
from gpt_oss_train.io import tokenizer as tok_lib

TOKENIZER = tok_lib.Tokenizer()
MODEL = "tiny-random"
MAX_CONTEXT = 512
ARGS = '{"city": "Paris", "unit": "celsius"}'
WEATHER = hm.WEATHER_TOOL  # chat's form, as the tokenizer takes it
WEATHER_FN = {"type": "function", **hm.WEATHER_TOOL["function"]}  # the Responses form


def _user(text):
    return {"role": "user", "content": text}


def _completion_ids(messages, reply, effort="medium", tools=None):
    ids, _ = TOKENIZER.render_chat_for_training(messages + reply, effort, tools)
    return ids[len(TOKENIZER.render_chat(messages, effort, tools)) :]


# ----------------------------------------------------------------------- without a model


def _part(kind, text, **extra):
    return {"type": kind, "text": text, **extra}


def test_input_items_render_as_the_same_harmony_conversation():
    answer = [_part("output_text", "Hello.", annotations=[])]
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather"}
    req = ResponsesRequest.model_validate(
        {
            "model": "m",
            "instructions": "Use metric units.",
            "reasoning": {"effort": "low"},
            "tools": [WEATHER_FN],
            "input": [
                {"role": "system", "content": "You are terse."},
                {"type": "message", "role": "user", "content": [_part("input_text", "Hi")]},
                {
                    "type": "reasoning",
                    "summary": [],
                    "content": [_part("reasoning_text", "Greet.")],
                },
                {"role": "assistant", "content": answer, "id": "msg_1", "status": "completed"},
                _user("Weather in Paris?"),
                {"type": "reasoning", "summary": [_part("summary_text", "Call it.")]},
                {"type": "message", "role": "assistant", "content": "Checking."},
                {**call, "arguments": ARGS, "id": "fc_1", "status": "completed"},
                {"type": "function_call_output", "call_id": "call_1", "output": '{"temp": 18}'},
            ],
        }
    )
    got = TOKENIZER.render_chat(
        responses_items.harmony_messages(req.items, req.instructions),
        req.effort,
        responses_items.render_tools(req),
    )
    call = {"role": "assistant", "channel": "commentary", "recipient": "functions.get_weather"}
    expected = TOKENIZER.render_chat(
        [
            {"role": "system", "content": "You are terse."},
            {"role": "developer", "content": "Use metric units."},
            _user("Hi"),
            {"role": "assistant", "channel": "analysis", "content": "Greet."},
            {"role": "assistant", "channel": "final", "content": "Hello."},
            _user("Weather in Paris?"),
            {"role": "assistant", "channel": "analysis", "content": "Call it."},
            {"role": "assistant", "channel": "commentary", "content": "Checking."},
            {**call, "content_type": "<|constrain|>json", "content": ARGS},
            {"role": "tool", "name": "functions.get_weather", "content": '{"temp": 18}'},
        ],
        "low",
        [WEATHER],
    )
    assert got == expected
    text = TOKENIZER.decode(got)
    assert "Reasoning: low" in text and "type get_weather" in text
    assert "Greet." not in text and "Call it." in text  # a finished turn's reasoning drops
    for t in responses_items.prompt_texts(req.items, req):  # the length bound's texts
        assert t in text


def _run_stream(ids):
    """(items, events, reasoning tokens) of generated ids, as the route builds them."""
    stream, output = ChatStream(), responses_items.OutputItems()
    events = [e for t in ids for d in stream.feed(t) for e in output.add(d)]
    events += [e for d in stream.finish() for e in output.add(d)] + output.close()
    return output.items, events, stream.reasoning_tokens


def _assert_event_grammar(events):
    """Each output item: added, [content part added], deltas, the text / arguments done,
    [content part done], item done; indices and ids agree; deltas sum to the done text.
    Returns {output_index: the concatenated deltas}."""
    texts, i = {}, 0
    while i < len(events):
        added = events[i]
        assert added["type"] == "response.output_item.added", added
        item, index = added["item"], added["output_index"]
        assert index == len(texts) and item["status"] == "in_progress"
        call = item["type"] == "function_call"
        kind = {"reasoning": "reasoning_text", "message": "output_text"}.get(item["type"])
        j = i + 1
        if not call:
            assert events[j]["type"] == "response.content_part.added"
            assert events[j]["part"]["text"] == ""
            j += 1
        delta_type = f"response.{'function_call_arguments' if call else kind}.delta"
        pieces = []
        while events[j]["type"] == delta_type:
            pieces.append(events[j]["delta"])
            j += 1
        done = events[j]
        assert done["type"] == delta_type.replace(".delta", ".done"), done
        assert done[("arguments" if call else "text")] == "".join(pieces)
        j += 1
        if not call:
            assert events[j]["type"] == "response.content_part.done"
            assert events[j]["part"]["text"] == "".join(pieces)
            j += 1
        assert events[j]["type"] == "response.output_item.done"
        whole = events[j]["item"]
        got = whole["arguments"] if call else whole["content"][0]["text"]
        assert got == "".join(pieces) and whole["status"] != "in_progress"
        for e in events[i : j + 1]:
            assert e["output_index"] == index
            assert e.get("item_id", item["id"]) == item["id"] == e.get("item", item)["id"]
        texts[index] = "".join(pieces)
        i = j + 1
    return texts


def test_generated_channels_become_output_items_as_harmony_parses_them():
    reply = [
        {"role": "assistant", "channel": "analysis", "content": "Think it over, twice."},
        {"role": "assistant", "channel": "final", "content": "Hello there, friend!"},
    ]
    ids = _completion_ids([_user("Hi")], reply)
    parsed = TOKENIZER.parse_completion(ids)
    items, events, reasoning_tokens = _run_stream(ids)
    assert [it["type"] for it in items] == ["reasoning", "message"]
    assert items[0]["content"] == [{"type": "reasoning_text", "text": parsed[0]["content"]}]
    assert items[0]["summary"] == []
    assert items[1]["role"] == "assistant"
    assert items[1]["content"] == [
        {"type": "output_text", "text": parsed[1]["content"], "annotations": []}
    ]
    assert all(it["status"] == "completed" for it in items)
    assert items[0]["id"].startswith("rs_") and items[1]["id"].startswith("msg_")
    texts = _assert_event_grammar(events)
    assert texts == {0: "Think it over, twice.", 1: "Hello there, friend!"}
    assert sum(e["type"].endswith("output_text.delta") for e in events) > 3  # token by token
    assert reasoning_tokens == len(TOKENIZER.encode("Think it over, twice."))


def test_a_tool_call_becomes_a_function_call_item_streamed_in_pieces():
    call = {
        "role": "assistant",
        "channel": "commentary",
        "recipient": "functions.get_weather",
        "content_type": "<|constrain|>json",
        "content": ARGS,
    }
    analysis = {"role": "assistant", "channel": "analysis", "content": "Need the tool."}
    ids = _completion_ids([_user("Weather?")], [analysis, call], tools=[WEATHER])
    items, events, reasoning_tokens = _run_stream(ids)
    assert [it["type"] for it in items] == ["reasoning", "function_call"]
    fc = items[1]
    assert fc["name"] == "get_weather" and fc["arguments"] == ARGS
    assert fc["id"].startswith("fc_") and fc["call_id"].startswith("call_")
    assert fc["status"] == "completed"
    texts = _assert_event_grammar(events)
    assert texts[1] == ARGS
    assert sum(e["type"].endswith("arguments.delta") for e in events) > 5
    assert reasoning_tokens == len(TOKENIZER.encode("Need the tool."))


def test_a_cut_short_turn_leaves_its_last_item_incomplete():
    reply = [{"role": "assistant", "channel": "analysis", "content": "A long thought here."}]
    ids = _completion_ids([_user("Hi")], reply)[:5]  # <|channel|>analysis<|message|> + 2
    stream, output = ChatStream(), responses_items.OutputItems()
    events = [e for t in ids for d in stream.feed(t) for e in output.add(d)]
    events += [e for d in stream.finish() for e in output.add(d)] + output.close("incomplete")
    assert output.items[0]["status"] == "incomplete"
    assert _assert_event_grammar(events) == {0: TOKENIZER.decode(ids[3:])}


def test_the_store_evicts_the_oldest_first_and_reading_does_not_keep_one():
    store = ResponseStore(capacity=2)
    entries = {rid: Stored({"id": rid}, (rid,)) for rid in ("a", "b", "c", "d")}
    store.put("a", entries["a"])
    store.put("b", entries["b"])
    assert store.get("a") is entries["a"]  # read: still the oldest
    store.put("c", entries["c"])
    assert store.get("a") is None and len(store) == 2
    assert store.get("b") is entries["b"] and store.get("c") is entries["c"]
    store.put("d", entries["d"])
    assert [store.get(r) for r in "abcd"] == [None, None, entries["c"], entries["d"]]
    with pytest.raises(ValueError, match="capacity"):
        ResponseStore(capacity=0)


# -------------------------------------------------------------- a random-weights server


class _Recorder:
    """The engine, recording each prompt the server submits (the rendered prompt)."""

    def __init__(self, engine):
        self._engine = engine
        self.prompts: list[list[int]] = []

    def submit(self, prompt, params):
        self.prompts.append(list(prompt))
        return self._engine.submit(prompt, params)

    def __getattr__(self, name):
        return getattr(self._engine, name)


ANSWER = "Hello there, friend!"
# What the bigram model writes after any prompt (which ends "<|start|>assistant"): a final
# message ending its turn. Each token follows from the one before alone.
HEADER = [
    *TOKENIZER.encode("assistant"),
    tok_lib.CHANNEL_ID,
    *TOKENIZER.encode("final"),
    tok_lib.MESSAGE_ID,
]


def _bigram_checkpoint(folder) -> str:
    """A random gpt-oss (2 layers of width 16, the real 201,088-id vocabulary) with a path
    written into it: attention and expert outputs are zero, so each position's logits
    depend on its own token only; chain token i embeds as the unit vector i, and the
    unembedding column of token i + 1 is large along i. Greedy decoding of any prompt
    ending "<|start|>assistant" then writes ANSWER as a final message and <|return|>."""
    config = random_models.harmony_vocab_config()
    params = random_models.random_params(config)
    for block in params["blocks"].values():
        for name in ("o_kernel", "o_bias"):
            block["attn"][name][...] = 0
        for name in ("wo", "bo"):
            block["moe"][name][...] = 0
    params["final_norm"]["scale"][...] = 1
    chain = [*HEADER, *TOKENIZER.encode(ANSWER), tok_lib.RETURN_ID]
    for i, (token, after) in enumerate(zip(chain, chain[1:])):
        params["embed"]["embedding"][token] = np.eye(16)[i]
        params["unembed"]["kernel"][i, after] = 100.0
    return random_models.save_checkpoint(folder, config, params)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The bigram model in an engine of 2 slots x 512 positions, served on a loopback
    port; `.prompts` records the prompts it was handed."""
    folder = _bigram_checkpoint(tmp_path_factory.mktemp("responses") / "bigram")
    engine = Engine.from_checkpoint(
        folder,
        dtype="float32",
        devices=jax.devices()[:1],
        max_slots=2,
        max_context=MAX_CONTEXT,
        prefill_chunk=128,
    )
    engine.start()
    recorder = _Recorder(engine)
    app = create_app(
        recorder,
        tokenizer=TOKENIZER,
        model_name=MODEL,
        max_context=MAX_CONTEXT,
        vocab_size=tok_lib.VOCAB_SIZE,
    )
    try:
        with ThreadServer(app) as s:
            yield types.SimpleNamespace(url=s.url, engine=engine, prompts=recorder.prompts)
    finally:
        engine.stop(0)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _greedy(client, **kw):
    return client.responses.create(model=MODEL, temperature=0, **kw)


def test_a_response_is_the_models_turn_and_is_stored(server, client):
    resp = _greedy(client, input="Tell me a story.")
    assert isinstance(resp, openai.types.responses.Response)
    prompt = TOKENIZER.render_chat([_user("Tell me a story.")], "medium")
    assert server.prompts[-1] == prompt
    # The engine alone writes the bigram path: the server's output must be its parse.
    params = RequestParams(max_tokens=32, temperature=0.0, stop_ids=CHAT_STOP_IDS)
    tokens = server.engine.submit(prompt, params).result().tokens
    assert tokens == [*HEADER[1:], *TOKENIZER.encode(ANSWER), tok_lib.RETURN_ID]
    (item,) = resp.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert item.id.startswith("msg_") and item.content[0].annotations == []
    assert resp.output_text == item.content[0].text == ANSWER
    assert resp.id.startswith("resp_") and resp.object == "response" and resp.model == MODEL
    assert resp.status == "completed" and resp.incomplete_details is None and resp.error is None
    u = resp.usage
    n_prompt, n_out = len(prompt), len(tokens)
    assert (u.input_tokens, u.output_tokens, u.total_tokens) == (n_prompt, n_out, n_prompt + n_out)
    assert u.output_tokens_details.reasoning_tokens == 0
    assert 0 <= u.input_tokens_details.cached_tokens < n_prompt
    assert (resp.temperature, resp.top_p, resp.max_output_tokens) == (0, 1.0, None)
    assert resp.tool_choice == "auto" and resp.tools == [] and resp.reasoning.effort == "medium"
    assert resp.text.format.type == "text" and resp.parallel_tool_calls is True
    assert client.responses.retrieve(resp.id).model_dump() == resp.model_dump()
    with urllib.request.urlopen(server.url + "/metrics") as r:
        metrics = r.read().decode()
    assert 'gpt_oss_requests_total{endpoint="responses",status="200"}' in metrics


def test_max_output_tokens_cuts_the_turn_incomplete(server, client):
    resp = _greedy(client, input="Tell me a story.", max_output_tokens=6)
    # <|channel|> final <|message|> and three tokens of text
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.output_text == TOKENIZER.decode(TOKENIZER.encode(ANSWER)[:3]) == "Hello there,"
    assert resp.output[0].status == "incomplete"
    assert resp.usage.output_tokens == 6 and resp.max_output_tokens == 6


def test_a_stream_sends_the_events_in_order_and_rebuilds_the_response(server, client):
    for limit, end in ((None, "completed"), (6, "incomplete")):
        whole = _greedy(client, input="Count to ten.", max_output_tokens=limit, store=False)
        stream = _greedy(client, input="Count to ten.", max_output_tokens=limit, stream=True)
        events = [e.model_dump() for e in stream]
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
        assert events[-1]["type"] == f"response.{end}"
        assert events[0]["response"]["status"] == "in_progress"
        assert events[0]["response"]["output"] == []
        assert _assert_event_grammar(events[2:-1]) == {0: whole.output_text}
        text_deltas = [e for e in events if e["type"] == "response.output_text.delta"]
        assert len(text_deltas) == len(TOKENIZER.encode(whole.output_text))  # token by token
        final = events[-1]["response"]
        assert final["status"] == end and final["output"][0]["status"] == end
        assert final["output"][0]["content"][0]["text"] == whole.output_text
        for key in ("input_tokens", "output_tokens", "total_tokens"):
            assert final["usage"][key] == getattr(whole.usage, key)
        assert client.responses.retrieve(final["id"]).output_text == whole.output_text
        with pytest.raises(openai.NotFoundError):  # store=False: not kept
            client.responses.retrieve(whole.id)


def test_reasoning_effort_instructions_and_tools_reach_the_prompt(server, client):
    _greedy(
        client,
        input="Weather in Paris?",
        instructions="Use metric units.",
        reasoning={"effort": "low"},
        tools=[WEATHER_FN],
        max_output_tokens=1,
    )
    messages = [{"role": "developer", "content": "Use metric units."}, _user("Weather in Paris?")]
    assert server.prompts[-1] == TOKENIZER.render_chat(messages, "low", [WEATHER])
    assert "Reasoning: low" in TOKENIZER.decode(server.prompts[-1])
    resp = _greedy(
        client,
        input="Weather in Paris?",
        reasoning={"effort": "high"},
        tools=[WEATHER_FN],
        tool_choice="none",
        max_output_tokens=1,
    )
    assert server.prompts[-1] == TOKENIZER.render_chat(messages[1:], "high")  # no tools
    assert resp.reasoning.effort == "high" and resp.tool_choice == "none"
    assert resp.tools[0].name == "get_weather"  # echoed as sent


def _final(text):
    return {"role": "assistant", "channel": "final", "content": text}


def test_previous_response_id_continues_as_the_explicit_items_do(server, client):
    first = _greedy(client, input="Hi", instructions="Be brief.", max_output_tokens=4)
    second = _greedy(client, previous_response_id=first.id, input="And then?", max_output_tokens=4)
    by_id = server.prompts[-1]
    explicit = _greedy(
        client,
        input=[_user("Hi"), *first.output, _user("And then?")],  # the output items sent back
        max_output_tokens=4,
        store=False,
    )
    assert first.output_text == second.output_text == explicit.output_text == "Hello"
    # Instructions are not carried over (OpenAI's rule); the earlier answer is final.
    reference = TOKENIZER.render_chat([_user("Hi"), _final("Hello"), _user("And then?")])
    assert by_id == server.prompts[-1] == reference
    assert second.usage.input_tokens == explicit.usage.input_tokens == len(reference)
    assert explicit.usage.input_tokens_details.cached_tokens > 0  # second's prefix, reused
    assert second.previous_response_id == first.id
    _greedy(client, previous_response_id=second.id, input="Go on.", max_output_tokens=1)
    turns = [_user("Hi"), _final("Hello"), _user("And then?"), _final("Hello"), _user("Go on.")]
    assert server.prompts[-1] == TOKENIZER.render_chat(turns)


def _refused(call, status=400):
    error = openai.NotFoundError if status == 404 else openai.BadRequestError
    with pytest.raises(error) as caught:
        call()
    assert caught.value.status_code == status
    body = caught.value.body
    assert set(body) == {"message", "type", "param", "code"}
    return body


def test_unsupported_fields_get_400_naming_them_and_unknown_ids_404(server, client):
    submitted = len(server.prompts)
    ask = dict(model=MODEL, input="x", max_output_tokens=1)
    body = _refused(lambda: client.responses.create(**ask, extra_body={"bogus": 1}))
    assert body["param"] == "bogus" and "bogus" in body["message"]
    # structured outputs and forced calls that cannot hold (test_structured_outputs.py
    # has those that can)
    bad_schema = {"type": "json_schema", "name": "a", "schema": {"type": "nonsense"}}
    for fmt in (bad_schema, {"type": "json_schema", "name": "a"}, {"type": "yaml"}):
        body = _refused(lambda: client.responses.create(**ask, text={"format": fmt}))
        assert body["param"] == "text.format", body
    body = _refused(lambda: client.responses.create(**ask, tool_choice="required"))
    assert body["param"] == "tool_choice" and "needs tools" in body["message"]
    body = _refused(lambda: client.responses.create(**ask, reasoning={"summary": "auto"}))
    assert body["param"] == "reasoning.summary"
    body = _refused(lambda: client.responses.create(model=MODEL, input={"role": "user"}))
    assert body["param"] == "input"
    image = {"type": "input_image", "image_url": "http://x/a.png"}
    body = _refused(
        lambda: client.responses.create(
            model=MODEL, input=[{"role": "user", "content": [image]}], max_output_tokens=1
        )
    )
    assert body["param"] == "input[0].content[0].type"
    orphan = {"type": "function_call_output", "call_id": "call_x", "output": "1"}
    body = _refused(
        lambda: client.responses.create(
            model=MODEL, input=[_user("x"), orphan], max_output_tokens=1
        )
    )
    assert body["param"] == "input[1].call_id"
    body = _refused(lambda: client.responses.create(**ask, previous_response_id="resp_nope"), 404)
    assert body["param"] == "previous_response_id"
    assert body["code"] == "previous_response_not_found" and "resp_nope" in body["message"]
    body = _refused(lambda: client.responses.retrieve("resp_nope"), 404)
    assert "resp_nope" in body["message"]
    body = _refused(lambda: client.responses.create(**{**ask, "max_output_tokens": 600}))
    assert body["code"] == "context_length_exceeded" and body["param"] == "max_output_tokens"
    assert len(server.prompts) == submitted  # each refused before reaching the engine


# --------------------------------------------------------- the trained Harmony model


@pytest.mark.full
@pytest.mark.parametrize("index", [0, 1])  # the same question at low and high effort
def test_reasoning_effort_gives_the_memorised_reasoning(harmony_server, index):
    prompt, _, effort, reply = hm.EXAMPLES[index]
    client = openai.OpenAI(base_url=harmony_server.url + "/v1", api_key="x", max_retries=0)
    resp = client.responses.create(
        model="tiny-harmony",
        input=prompt[0]["content"],
        reasoning={"effort": effort},
        temperature=0,
    )
    assert resp.status == "completed" and resp.incomplete_details is None
    reasoning, message = resp.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == reply[0]["content"]
    assert message.type == "message" and resp.output_text == reply[1]["content"]
    head, target = hm.encoded_examples(TOKENIZER)[index]
    assert resp.usage.input_tokens == len(head) == len(TOKENIZER.render_chat(prompt, effort))
    assert resp.usage.output_tokens == len(target)
    reasoning_ids = TOKENIZER.encode(reply[0]["content"])
    assert resp.usage.output_tokens_details.reasoning_tokens == len(reasoning_ids)


@pytest.mark.full
def test_function_tool_round_trip(harmony_server):
    client = openai.OpenAI(base_url=harmony_server.url + "/v1", api_key="x", max_retries=0)
    ask = dict(model="tiny-harmony", tools=[WEATHER_FN], temperature=0)
    first = client.responses.create(input=hm.WEATHER_Q, **ask)
    assert first.status == "completed"
    reasoning, call = first.output
    assert reasoning.content[0].text == hm.WEATHER_ANALYSIS["content"]
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.arguments == hm.WEATHER_ARGS and call.call_id.startswith("call_")
    assert json.loads(call.arguments) == {"city": "Paris", "unit": "celsius"}

    events = [
        e.model_dump() for e in client.responses.create(input=hm.WEATHER_Q, stream=True, **ask)
    ]
    assert events[-1]["type"] == "response.completed"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    texts = _assert_event_grammar(events[2:-1])
    assert texts == {0: hm.WEATHER_ANALYSIS["content"], 1: hm.WEATHER_ARGS}
    assert sum(e["type"] == "response.function_call_arguments.delta" for e in events) > 5

    result = {"type": "function_call_output", "call_id": call.call_id, "output": hm.WEATHER_RESULT}
    second = client.responses.create(previous_response_id=first.id, input=[result], **ask)
    expected_prompt, _, _, reply = hm.EXAMPLES[5]
    rendered = TOKENIZER.render_chat(expected_prompt, "medium", [WEATHER])
    assert second.usage.input_tokens == len(rendered)
    assert second.status == "completed" and second.output_text == reply[0]["content"]
    assert [it.type for it in second.output] == ["message"]
    explicit = client.responses.create(input=[hm.EXAMPLES[4][0][0], *first.output, result], **ask)
    assert explicit.usage.input_tokens == len(rendered)
    assert explicit.output_text == reply[0]["content"]
