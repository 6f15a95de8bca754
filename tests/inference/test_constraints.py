"""Grammars of a Harmony turn (inference/constraints.py) walked by random tokens: whatever
the allowed token drawn at each step, the turn parses with openai-harmony's parser and its
JSON validates with `jsonschema`, the independent references."""

import json

import jax
import jsonschema
import numpy as np
import pytest
from support import random_models, schemas

from gpt_oss_train.inference import constraints, loading
from gpt_oss_train.inference.engine import Engine, RequestParams, RequestRejected
from gpt_oss_train.io import tokenizer as tok_lib

TOKENIZER = tok_lib.Tokenizer()
V = tok_lib.VOCAB_SIZE

SCHEMA, WEATHER, CLOCK = schemas.PERSON, schemas.WEATHER, schemas.CLOCK


def _walk(grammar: str, seed: int, limit: int = 400) -> list[int]:
    """Tokens drawn uniformly among those the grammar allows, until it is done."""
    rng = np.random.default_rng(seed)
    walk, row = constraints.Walk(grammar), np.zeros(constraints.mask_words(V), np.uint32)
    out = []
    while not walk.done and len(out) < limit:
        walk.fill(row)
        allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:V])
        assert len(allowed), TOKENIZER.decode(out)
        out.append(int(rng.choice(allowed)))
        walk.advance(out[-1])
    assert walk.done, TOKENIZER.decode(out)
    return out


@pytest.mark.parametrize("seed", range(12))
def test_a_json_answer_parses_and_validates_whatever_is_drawn(seed):
    tokens = _walk(constraints.json_answer(SCHEMA, max_thought_tokens=20), seed)
    messages = TOKENIZER.parse_completion(tokens)
    assert tokens[-1] == tok_lib.RETURN_ID
    assert [m["channel"] for m in messages][-1] == "final"
    if len(messages) == 2:  # an analysis message first, cut at its bound
        assert messages[0]["channel"] == "analysis"
        assert len(TOKENIZER.encode(messages[0]["content"])) <= 20 + 2
    jsonschema.validate(json.loads(messages[-1]["content"]), SCHEMA)


def test_analysis_is_left_free_up_to_its_bound():
    """Some walks open with analysis (its text any tokens), others go straight to the
    answer; without a bound (0) there is no analysis at all. (Any JSON object, schema
    None, has keys of any length: drawn uniformly they could run on, so SCHEMA here.)"""
    channels = {
        TOKENIZER.parse_completion(_walk(constraints.json_answer(SCHEMA, 30), s))[0]["channel"]
        for s in range(12)
    }
    assert channels == {"analysis", "final"}
    for seed in range(3):
        (final,) = TOKENIZER.parse_completion(_walk(constraints.json_answer(SCHEMA, 0), seed))
        assert final["channel"] == "final"
        jsonschema.validate(json.loads(final["content"]), SCHEMA)
    walk = constraints.Walk(constraints.json_answer(None, 0))  # any object: "{" and "}" fit
    final = [tok_lib.CHANNEL_ID, *TOKENIZER.encode("final"), tok_lib.MESSAGE_ID]
    for token in [*final, *TOKENIZER.encode("{}"), tok_lib.RETURN_ID]:
        walk.advance(token)
    assert walk.done


@pytest.mark.parametrize("seed", range(8))
def test_a_forced_tool_call_names_an_offered_tool_with_valid_arguments(seed):
    tokens = _walk(constraints.tool_call([WEATHER, CLOCK], None, max_thought_tokens=10), seed)
    assert tokens[-1] == tok_lib.CALL_ID
    call = TOKENIZER.parse_completion(tokens)[-1]
    assert call["channel"] == "commentary" and call["content_type"] == "<|constrain|>json"
    schema = {t["name"]: t["parameters"] for t in (WEATHER, CLOCK)}
    name = call["recipient"].removeprefix("functions.")
    jsonschema.validate(json.loads(call["content"]), schema[name])
    named = TOKENIZER.parse_completion(
        _walk(constraints.tool_call([WEATHER, CLOCK], "get_weather", 0), seed)
    )
    assert named[-1]["recipient"] == "functions.get_weather"
    jsonschema.validate(json.loads(named[-1]["content"]), WEATHER["parameters"])


def test_grammars_that_cannot_be_built_say_why():
    with pytest.raises(constraints.GrammarError, match="no tool named 'x'"):
        constraints.tool_call([WEATHER], "x", 0)
    with pytest.raises(constraints.GrammarError, match="plain word"):
        constraints.tool_call([{"name": "a b"}], None, 0)
    with pytest.raises(constraints.GrammarError):
        constraints.check(constraints.json_answer({"type": "nonsense"}, 0))
    with pytest.raises(constraints.GrammarError):
        constraints.check("start: <|no_such_token|>")


# -- in the engine: a random model of the real vocabulary ----------------------------------


@pytest.fixture(scope="module")
def engine():
    """A random gpt-oss of width 16 with the 201,088-id vocabulary: nothing but the
    grammar can make its output valid. 8 slots of 640 positions."""
    config = random_models.harmony_vocab_config()
    model = loading.random_model(config, devices=jax.devices()[:1])
    with Engine.from_model(model, max_slots=8, max_context=640, prefill_chunk=64) as e:
        yield e


PROMPT = TOKENIZER.render_chat([{"role": "user", "content": "Describe someone as JSON."}], "low")


def test_sampled_requests_under_grammars_share_a_batch_with_free_ones(engine):
    """Sampled at temperature 1, every JSON answer validates and every forced call names
    an offered tool with valid arguments; greedy requests without a grammar in the same
    batches give the tokens they give alone."""
    free = RequestParams(max_tokens=24)
    alone = engine.submit(PROMPT, free).result().tokens
    answer = constraints.json_answer(SCHEMA, max_thought_tokens=64)
    call = constraints.tool_call([WEATHER, CLOCK], None, max_thought_tokens=64)
    sampled = dict(max_tokens=512, temperature=1.0)
    handles = [
        engine.submit(PROMPT, RequestParams(**sampled, seed=i, grammar=answer)) for i in range(12)
    ]
    handles += [
        engine.submit(PROMPT, RequestParams(**sampled, seed=i, grammar=call)) for i in range(4)
    ]
    beside = [engine.submit(PROMPT, free) for _ in range(2)]
    done = [h.result() for h in handles]
    assert all(b.result().tokens == alone for b in beside)
    for c in done[:12]:
        assert c.finish_reason == "stop" and c.tokens[-1] == tok_lib.RETURN_ID, c
        jsonschema.validate(json.loads(TOKENIZER.parse_completion(c.tokens)[-1]["content"]), SCHEMA)
    for c in done[12:]:
        assert c.finish_reason == "stop" and c.tokens[-1] == tok_lib.CALL_ID, c
        message = TOKENIZER.parse_completion(c.tokens)[-1]
        tool = {"functions.get_weather": WEATHER, "functions.get_time": CLOCK}[message["recipient"]]
        jsonschema.validate(json.loads(message["content"]), tool["parameters"])


def test_a_grammar_is_refused_before_queueing_when_it_cannot_hold(engine):
    with pytest.raises(RequestRejected, match="grammar: ") as e:
        engine.submit(PROMPT, RequestParams(grammar="start: <|no_such_token|>"))
    assert e.value.status == 400


def _tokens(text_pieces) -> list[int]:
    """Ids of a completion written as text and special-token ids."""
    out = []
    for piece in text_pieces:
        out += [piece] if isinstance(piece, int) else TOKENIZER.encode(piece)
    return out


def test_with_tool_choice_auto_only_strict_tools_arguments_are_held():
    """answer_or_strict_call: a text answer passes; a strict tool's call passes with valid
    arguments and is refused at the first token that leaves its schema; another tool's
    call takes any object."""
    strict = dict(WEATHER, strict=True)
    grammar = constraints.answer_or_strict_call([strict, CLOCK], max_thought_tokens=0)
    C, M = tok_lib.CHANNEL_ID, tok_lib.MESSAGE_ID
    header = [" to=functions.get_weather", C, "commentary ", tok_lib.CONSTRAIN_ID, "json", M]
    clock = [" to=functions.get_time", C, "commentary ", tok_lib.CONSTRAIN_ID, "json", M]
    accepted = [
        [C, "final", M, "Sunny, 18 degrees.", tok_lib.RETURN_ID],
        [*header, '{"city":"Paris","unit":"C"}', tok_lib.CALL_ID],
        [*clock, '{"zone":"UTC","anything":1}', tok_lib.CALL_ID],
    ]
    for pieces in accepted:
        walk = constraints.Walk(grammar)
        for token in _tokens(pieces):
            walk.advance(token)
        assert walk.done, pieces
    walk = constraints.Walk(grammar)
    with pytest.raises(constraints.GrammarError):
        for token in _tokens([*header, '{"city":"Paris","unit":"K"}']):
            walk.advance(token)
