"""The server's text and Harmony plumbing, without a model: detokenizing as tokens stream,
stop strings, OpenAI <-> Harmony messages, and streamed reasoning / content / tool-call
deltas, each against an independent reference (the text itself, str.find, harmony's own
parse of the whole completion, the tokenizer's render of hand-written Harmony dicts)."""

import base64
import json
import random

import pytest
from support import harmony_model  # the tool the trained Harmony model calls

from gpt_oss_train.inference.server import chat_format, generation, text
from gpt_oss_train.inference.server.harmony_stream import ChatStream
from gpt_oss_train.inference.server.schemas import ChatCompletionRequest
from gpt_oss_train.io import tokenizer as tok_lib

TOKENIZER = tok_lib.Tokenizer()
WEATHER = harmony_model.WEATHER_TOOL
ARGS = '{"city": "Paris", "when": ["today", "tomorrow"], "units": {"temp": "C"}}'


def test_detokenizer_streams_multibyte_text_exactly():
    s = "naïve café 東京 🙂🚀 ok\n\tend"
    ids = TOKENIZER.encode(s)
    d = text.Detokenizer()
    pieces = [d.push(t) for t in ids] + [d.flush()]
    assert "".join(pieces) == s
    assert not any("\ufffd" in p for p in pieces)  # cut characters wait for their end
    assert text.decode(ids + [tok_lib.RETURN_ID]) == s  # specials are not text
    assert text.decode([tok_lib.RETURN_ID], specials=True) == "<|return|>"


@pytest.mark.parametrize("seed", range(20))
def test_stop_matcher_equals_find_on_any_split(seed):
    rng = random.Random(seed)
    alphabet = "ab c\n"
    t = "".join(rng.choice(alphabet) for _ in range(60))
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(2)]
    cuts = sorted(rng.sample(range(1, len(t)), 12))
    pieces = [t[i:j] for i, j in zip([0, *cuts], [*cuts, len(t)])]
    m = text.StopMatcher(stops)
    out = ""
    for p in pieces:
        emitted, stopped = m.push(p)
        out += emitted
        if stopped:
            break
    out += m.flush()
    hits = [t.find(s) for s in stops if s in t]
    assert out == (t[: min(hits)] if hits else t)
    assert m.stopped == bool(hits)


def _completion_ids(messages, reply, effort="medium", tools=None):
    ids, _ = TOKENIZER.render_chat_for_training(messages + reply, effort, tools)
    return ids[len(TOKENIZER.render_chat(messages, effort, tools)) :]


def _stream(ids, stops=None):
    s = ChatStream(stops)
    deltas = [d for t in ids for d in s.feed(t)] + s.finish()
    return s, deltas


def test_stream_splits_channels_like_harmony_parse():
    user = [{"role": "user", "content": "Hi"}]
    reply = [
        {"role": "assistant", "channel": "analysis", "content": "Think it over, twice."},
        {"role": "assistant", "channel": "final", "content": "Hello there, friend!"},
    ]
    ids = _completion_ids(user, reply)
    s, deltas = _stream(ids)
    parsed = TOKENIZER.parse_completion(ids)
    assert "".join(d.reasoning for d in deltas) == parsed[0]["content"] == s.reasoning
    assert "".join(d.content for d in deltas) == parsed[1]["content"] == s.content
    assert sum(bool(d.content) for d in deltas) > 3  # token by token, not at the end
    assert s.message() == {
        "role": "assistant",
        "content": "Hello there, friend!",
        "reasoning_content": "Think it over, twice.",
    }


def test_stream_tool_call_arguments_arrive_in_many_pieces():
    user = [{"role": "user", "content": "Weather?"}]
    call = {
        "role": "assistant",
        "channel": "commentary",
        "recipient": "functions.get_weather",
        "content_type": "<|constrain|>json",
        "content": ARGS,
    }
    ids = _completion_ids(user, [call], tools=[WEATHER])
    s, deltas = _stream(ids)
    calls = [d.tool_call for d in deltas if d.tool_call]
    assert calls[0].name == "get_weather" and calls[0].id.startswith("call_")
    assert calls[0].arguments == "" and all(c.id is None for c in calls[1:])
    assert len(calls) > 10
    assert json.loads("".join(c.arguments for c in calls)) == json.loads(ARGS)
    assert s.message()["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ARGS}
    assert s.message()["content"] is None


def test_stop_string_trims_content_only():
    user = [{"role": "user", "content": "Hi"}]
    reply = [
        {"role": "assistant", "channel": "analysis", "content": "STOP is not here."},
        {"role": "assistant", "channel": "final", "content": "one two STOP three"},
    ]
    s, deltas = _stream(_completion_ids(user, reply), stops=["STOP"])
    assert s.stopped
    assert s.content == "".join(d.content for d in deltas) == "one two "
    assert s.reasoning == "STOP is not here."


def test_openai_tool_round_trip_renders_like_harmony_dicts():
    req = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "reasoning_effort": "high",
            "tools": [WEATHER],
            "messages": [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": None,
                    "reasoning_content": "Call the tool.",
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": ARGS},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 18}'},
            ],
        }
    )
    expected = TOKENIZER.render_chat(
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "channel": "analysis", "content": "Call the tool."},
            {
                "role": "assistant",
                "channel": "commentary",
                "recipient": "functions.get_weather",
                "content_type": "<|constrain|>json",
                "content": ARGS,
            },
            {"role": "tool", "name": "functions.get_weather", "content": '{"temp": 18}'},
        ],
        "high",
        [WEATHER],
    )
    got = chat_format.prompt_ids(req, TOKENIZER)
    assert got == expected
    assert "Reasoning: high" in TOKENIZER.decode(got)
    assert "type get_weather" in TOKENIZER.decode(got)


def test_tool_choice_none_hides_tools_and_unknown_call_id_is_refused():
    base = {"model": "m", "tools": [WEATHER], "messages": [{"role": "user", "content": "x"}]}
    hidden = chat_format.prompt_ids(
        ChatCompletionRequest.model_validate({**base, "tool_choice": "none"}), TOKENIZER
    )
    assert hidden == TOKENIZER.render_chat([{"role": "user", "content": "x"}])
    bad = {**base, "messages": [{"role": "tool", "tool_call_id": "nope", "content": "1"}]}
    with pytest.raises(Exception, match="tool_call_id"):
        chat_format.prompt_ids(ChatCompletionRequest.model_validate(bad), TOKENIZER)


def test_no_token_is_longer_than_the_servers_length_bound():
    """The bound the server refuses long prompts by (at least ceil(bytes / 128) tokens)
    holds only if no o200k token has more than 128 bytes: read every token of the
    vocabulary file (base64 token, rank per line)."""
    folder = tok_lib.ensure_vocab()
    lines = (folder / tok_lib.VOCAB_FILE).read_bytes().splitlines()
    longest = max(len(base64.b64decode(line.split()[0])) for line in lines if line)
    assert longest == generation.LONGEST_TOKEN_BYTES == 128
    rng = random.Random(0)
    for _ in range(50):
        t = "".join(rng.choice(" \n=x9é東🙂") * rng.randint(1, 300) for _ in range(20))
        assert len(TOKENIZER.encode(t)) >= -(-len(t.encode()) // 128)


def test_prompt_texts_are_in_the_rendered_prompt_verbatim():
    """The server's lower bound counts the bytes of prompt_texts: each must be in the
    render, once per message, and reasoning of finished turns (dropped) must not count."""
    tool = {
        "type": "function",
        "function": {**WEATHER["function"], "description": "Weather.\r\nIn C\rF.\n\nEnd"},
    }
    req = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "tools": [tool],
            "messages": [
                {"role": "system", "content": "  Terse.\n"},
                {"role": "developer", "content": "Use metric units. "},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "Weather "},
                        {"type": "text", "text": "in Paris?"},
                    ],
                },
                {
                    "role": "assistant",
                    "content": "Checking.",
                    "reasoning_content": "Dropped?",
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": ARGS},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 18}'},
                {"role": "assistant", "content": "18 C.", "reasoning_content": "Old thought."},
                {"role": "user", "content": "Thanks"},
            ],
        }
    )
    rendered = TOKENIZER.decode(chat_format.prompt_ids(req, TOKENIZER))
    texts = chat_format.prompt_texts(req)
    assert texts == [
        "  Terse.\n",
        "Use metric units. ",
        "Weather in Paris?",
        "Checking.",
        '{"temp": 18}',
        "18 C.",
        "Thanks",
        ARGS,
        "get_weather",
        "Weather.",
        "In C\rF.",
        "",
        "End",
    ]
    for t in texts:
        assert t in rendered
    assert "// In C\rF.\n// \n// End\n" in rendered  # a description line by line
    assert "Old thought." not in rendered  # why reasoning is not counted
    hidden = ChatCompletionRequest.model_validate({**req.model_dump(), "tool_choice": "none"})
    assert chat_format.prompt_texts(hidden) == texts[:8]  # tools left out of the prompt
