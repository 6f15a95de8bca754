"""Structured outputs and forced tool calls through the real `openai` client, on a random
model of the real vocabulary (tests/support/random_models.py): nothing but the grammar can
make its output valid, so every answer that parses and validates with `jsonschema` (the
independent reference) is the grammar's doing. Sampled at temperature 1."""

import concurrent.futures
import json

import jax
import jsonschema
import openai
import pytest
from support import random_models, schemas
from support.runners import served

MODEL = "random"
PERSON = schemas.PERSON
WEATHER, SEARCH = schemas.chat_tool(schemas.WEATHER), schemas.chat_tool(schemas.SEARCH)
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, SEARCH)}
ASK = [{"role": "user", "content": "Tell me about a person."}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    config = random_models.harmony_vocab_config()
    folder = tmp_path_factory.mktemp("structured") / "random"
    checkpoint = random_models.save_checkpoint(
        folder, config, random_models.random_params(config, 1)
    )
    one_device = jax.devices()[:1]  # (8 fake devices on 2 cores would time the collectives)
    with served(
        checkpoint, max_slots=8, max_context=768, model_name=MODEL, devices=one_device
    ) as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _person(client, seed):
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": PERSON, "strict": True},
    }
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, response_format=fmt, temperature=1.0, max_tokens=512, seed=seed
    )
    return reply.choices[0]


def _forced_call(client, seed, choice):
    reply = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, SEARCH],
        tool_choice=choice,
        temperature=1.0,
        max_tokens=512,
        seed=seed,
    )
    return reply.choices[0]


def _check_person(choice):
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), PERSON)


def _check_call(choice, name=None):
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name in PARAMETERS and name in (None, call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def _concurrently(fn, n):
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        return list(pool.map(fn, range(n)))


def test_json_schema_answers_and_forced_calls_validate(client):
    # (json_object, any object, is walked in tests/inference/test_constraints.py: its keys
    # have no bound, which a random model's draws can stretch to max_tokens)
    for choice in _concurrently(lambda i: _person(client, i), 4):
        _check_person(choice)
    for i, choice in enumerate(_concurrently(lambda i: _forced_call(client, i, "required"), 2)):
        _check_call(choice)
    named = {"type": "function", "function": {"name": "search"}}
    _check_call(_forced_call(client, 7, named), "search")


def test_the_responses_api_takes_the_same_constraints(client):
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    reply = client.responses.create(
        model=MODEL, input="A person?", text={"format": fmt}, temperature=1.0, max_output_tokens=512
    )
    assert reply.status == "completed" and reply.text.format.type == "json_schema"
    jsonschema.validate(json.loads(reply.output_text), PERSON)
    tools = [
        {"type": "function", **WEATHER["function"]},
        {"type": "function", **SEARCH["function"]},
    ]
    reply = client.responses.create(
        model=MODEL, input="Weather?", tools=tools, temperature=1.0, max_output_tokens=512,
        tool_choice={"type": "function", "name": "get_weather"},
    )  # fmt: skip
    (call,) = [item for item in reply.output if item.type == "function_call"]
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), PARAMETERS["get_weather"])


def test_constraints_that_cannot_hold_are_400_naming_the_field(client):
    weather_only = dict(tools=[WEATHER])
    nope = {"type": "function", "function": {"name": "nope"}}
    no_schema = {"type": "json_schema", "json_schema": {"name": "x"}}
    cases = [
        (dict(response_format={"type": "yaml"}), "response_format"),
        (dict(response_format=no_schema), "response_format"),
        (dict(tool_choice="required"), "tool_choice"),  # no tools
        (dict(**weather_only, tool_choice=nope), "tool_choice"),
        (
            dict(**weather_only, tool_choice="required", response_format={"type": "json_object"}),
            "tool_choice",
        ),
    ]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, **extra)
        assert caught.value.body["param"] == param, (extra, caught.value.body)


@pytest.mark.full
def test_fifty_schema_answers_and_twenty_forced_calls_all_validate(client):
    """The issue's acceptance counts: 50 json_schema requests and 20 forced calls, 8 at a
    time, within max_tokens=512."""
    for choice in _concurrently(lambda i: _person(client, 100 + i), 50):
        _check_person(choice)
    for choice in _concurrently(lambda i: _forced_call(client, 200 + i, "required"), 20):
        _check_call(choice)
