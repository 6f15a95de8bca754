"""API keys, as `vllm serve --api-key`: `create_app(..., api_key=KEY)` (what `serve
--api_key` / $GPT_OSS_TRAIN_API_KEY set) with the real `openai` client against a real
server on a loopback port. The right key gets answers (the tiny Harmony model's memorised
reply, tests/support/harmony_model.py); a wrong or missing key gets 401 in OpenAI's error JSON
(code "invalid_api_key") on every /v1/* route; /health and /metrics stay open. Also the
start-up warning for a server reachable beyond this machine without a key, and where the
key comes from."""

import json
import urllib.error
import urllib.request

import pytest

openai = pytest.importorskip("openai")

from support import harmony_model as hm

from gpt_oss_train import serve

pytestmark = pytest.mark.full  # the trained Harmony model (a few minutes, once per machine)

MODEL = "tiny-harmony"
KEY = "sk-test-5f1c0a9e2b7d4c3a8e6f"


@pytest.fixture(scope="module")
def server(serve_harmony):
    with serve_harmony(max_slots=1, max_context=256, model_name=MODEL, api_key=KEY) as s:
        yield s


def _client(server, key):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def _chat(client, **kw):
    prompt, _, effort, _ = hm.EXAMPLES[0]
    return client.chat.completions.create(
        model=MODEL, messages=prompt, reasoning_effort=effort, temperature=0, **kw
    )


def _get(url, headers=None):
    """(status, body) of a GET without the openai client (which always sends a key)."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {})) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_the_right_key_gets_a_chat_completion(server):
    reply = hm.EXAMPLES[0][3]
    resp = _chat(_client(server, KEY))
    assert resp.choices[0].message.content == reply[1]["content"]
    assert resp.choices[0].finish_reason == "stop"
    assert [m.id for m in _client(server, KEY).models.list()] == [MODEL]


@pytest.mark.parametrize("key", ["wrong", KEY[:-1], KEY + "0", KEY.upper(), " " + KEY])
def test_a_wrong_key_gets_401_in_openais_error_json(server, key):
    client = _client(server, key)
    for call in (lambda: _chat(client), lambda: _chat(client, stream=True), client.models.list):
        with pytest.raises(openai.AuthenticationError) as caught:
            call()
        assert caught.value.status_code == 401
        error = caught.value.body
        assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"
        assert error["message"].startswith("Incorrect API key provided")
        assert KEY not in error["message"] and key.strip() not in error["message"]


def test_no_key_gets_401_and_is_told_how_to_send_one(server):
    with pytest.raises(openai.AuthenticationError) as caught:
        _chat(_client(server, KEY), extra_headers={"Authorization": openai.Omit()})
    assert caught.value.status_code == 401
    assert caught.value.body["code"] == "invalid_api_key"
    assert caught.value.body["message"].startswith("You didn't provide an API key")
    assert "'Authorization: Bearer YOUR_KEY'" in caught.value.body["message"]
    for path in ("/v1/models", "/v1/completions", "/v1/no_such_route", "/v1"):
        status, body = _get(server.url + path)
        assert status == 401, (path, body)
        assert json.loads(body)["error"]["code"] == "invalid_api_key"


def test_health_and_metrics_stay_open_and_count_refusals(server):
    assert _get(server.url + "/health") == (200, '{"status":"ok"}')
    with pytest.raises(openai.AuthenticationError):
        _chat(_client(server, "wrong"))
    status, text = _get(server.url + "/metrics")
    assert status == 200
    line = next(x for x in text.splitlines() if 'endpoint="chat",status="401"' in x)
    assert float(line.split()[-1]) >= 1


@pytest.mark.parametrize(
    "host, warned",
    [
        ("127.0.0.1", False),
        ("127.0.0.2", False),  # all of 127.0.0.0/8 is loopback
        ("::1", False),
        ("[::1]", False),
        ("localhost", False),
        ("0.0.0.0", True),
        ("::", True),
        ("", True),  # every interface
        ("192.168.1.20", True),
        ("gpu-box.example.com", True),  # a name may resolve to any address
    ],
)
def test_a_server_reachable_from_elsewhere_without_a_key_is_warned_of(host, warned):
    line = serve.open_host_warning(host, None)
    assert (line is not None) == warned
    if warned:
        assert "\n" not in line and f"--host={host} " in line
        assert "--api_key" in line and "GPT_OSS_TRAIN_API_KEY" in line
    assert serve.open_host_warning(host, KEY) is None  # a key: nothing to warn of


def test_the_key_comes_from_the_flag_else_the_environment(monkeypatch):
    monkeypatch.delenv("GPT_OSS_TRAIN_API_KEY", raising=False)
    assert serve.choose_api_key(None) is None
    assert serve.choose_api_key("flag-key") == "flag-key"
    monkeypatch.setenv("GPT_OSS_TRAIN_API_KEY", "env-key")
    assert serve.choose_api_key(None) == "env-key"
    assert serve.choose_api_key("flag-key") == "flag-key"
    assert serve.choose_api_key("") is None  # --api_key= turns the key off
    monkeypatch.setenv("GPT_OSS_TRAIN_API_KEY", "")
    assert serve.choose_api_key(None) is None
