"""`python -m gpt_oss_train.serve` starting up and shutting down, as a user runs it (a
subprocess serving a tiny random Hugging Face model of 2048 positions on a loopback port):
without --max_context it serves the model's 2048 positions (the 4096 default would not fit
the model) and says so in one log line; a --max_context beyond the model, or a port in
use, is one error line and exit 2, before any loading; a key in $GPT_OSS_TRAIN_API_KEY
guards /v1/* (its "Bearer" in any case, the key exactly); listening beyond loopback
without a key is warned of. On one server of 1 slot and a queue of 4: more completions
than that in one request get 400 saying the most, a body over --max_request_bytes gets
413 (by its Content-Length or as it streams in), and SIGTERM drains (/health and new
requests 503, the listener still open) and then ends the requests still running cleanly:
a stream's last chunk says "abort" before `data: [DONE]`, a whole response is a 503."""

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import types

import pytest

openai = pytest.importorskip("openai")

from support import ROOT

from gpt_oss_train import serve
from gpt_oss_train.inference.loading import DecodeError
from gpt_oss_train.inference.server import local

KEY = "sk-start-3e9d1f7a"
POSITIONS = 2048


@pytest.fixture(scope="module")
def tiny(random_hf_model, tmp_path_factory):
    """A 2-layer random gpt-oss (300-id vocabulary) whose config says 2048 positions."""
    folder = tmp_path_factory.mktemp("serve_start") / "tiny2048"
    rope = dict(
        rope_type="yarn",
        rope_theta=150000.0,
        factor=32.0,
        beta_fast=32.0,
        beta_slow=1.0,
        truncate=False,
        original_max_position_embeddings=64,
    )
    model = random_hf_model(
        seed=3,
        num_hidden_layers=2,
        intermediate_size=32,
        max_position_embeddings=POSITIONS,
        rope_parameters=rope,
    )
    model.save_pretrained(str(folder))
    return str(folder)


def _env(api_key: str | None = None) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="", PYTHONPATH=ROOT)
    env.pop("GPT_OSS_TRAIN_API_KEY", None)
    if api_key:
        env["GPT_OSS_TRAIN_API_KEY"] = api_key
    return env


@pytest.mark.full
def test_without_max_context_it_serves_the_models_positions(tiny, tmp_path):
    port = local.free_port()
    cmd = [
        sys.executable,
        "-m",
        "gpt_oss_train.serve",
        f"--checkpoint={tiny}",
        f"--port={port}",
        "--max_slots=1",
        "--dtype=float32",
    ]
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(KEY), stdout=log, stderr=log)
    try:
        url = f"http://127.0.0.1:{port}"
        local.wait_ready(url, 300, proc)  # /health answers without a key
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        (card,) = client.models.list().data
        assert card.model_extra["max_model_len"] == POSITIONS
        full = client.completions.create(model=card.id, prompt=[7] * 2040, max_tokens=8)
        assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (2040, 8)
        with pytest.raises(openai.BadRequestError, match="context holds 2048 tokens"):
            client.completions.create(model=card.id, prompt=[7] * 2041, max_tokens=8)
        stranger = openai.OpenAI(base_url=url + "/v1", api_key="guess", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            stranger.models.list()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    log = log_path.read_text()
    chosen = [line for line in log.splitlines() if "] max_context " in line]
    assert len(chosen) == 1, log[-3000:]
    assert chosen[0].endswith(
        "max_context 2048 (the model's max_position_embeddings; --max_context to change)"
    )
    assert "requires the API key of $GPT_OSS_TRAIN_API_KEY" in log
    assert KEY not in log  # the key itself is never logged
    assert "not a loopback address" not in log


def test_max_context_beyond_the_model_is_one_line_and_exit_2(tiny):
    cmd = [
        sys.executable,
        "-m",
        "gpt_oss_train.serve",
        f"--checkpoint={tiny}",
        "--max_context=4096",
        "--host=0.0.0.0",
        "--port=0",
    ]
    done = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert lines[-1] == (
        "error: --max_context=4096 exceeds the model's max_position_embeddings=2048; "
        "give at most 2048 or leave it out"
    ), lines[-3:]
    assert "Traceback" not in done.stderr
    warned = [line for line in lines if "--host=0.0.0.0 is not a loopback address" in line]
    assert len(warned) == 1 and "no API key is set" in warned[0], done.stderr[-3000:]


MODEL_HAS_FEWER = "the model's max_position_embeddings; --max_context to change"


# A table, one case a row: `# fmt: skip` keeps ruff from splitting the rows.
@pytest.mark.parametrize(
    "flag, model, expected, why",
    [
        (None, 2048, 2048, MODEL_HAS_FEWER),
        (None, 4096, 4096, "the default; the model has 4096 positions, --max_context to use more"),
        # gpt-oss: 4096 positions per slot, not 131072
        (None, 131072, 4096, "the default; the model has 131072 positions, --max_context to use "
         "more"),
        (1000, 2048, 1000, "--max_context"),
        (2048, 2048, 2048, "--max_context"),
    ],
)  # fmt: skip
def test_max_context_is_the_flag_else_the_default_or_the_models_if_fewer(
    flag, model, expected, why
):
    assert serve.choose_max_context(flag, model) == (expected, why)
    with pytest.raises(DecodeError, match=f"--max_context={model + 1} exceeds"):
        serve.choose_max_context(model + 1, model)


def test_a_port_in_use_is_one_line_and_exit_2_before_loading(tiny):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cmd = [
            sys.executable,
            "-m",
            "gpt_oss_train.serve",
            f"--checkpoint={tiny}",
            f"--port={port}",
        ]
        done = subprocess.run(
            cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300
        )
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: --port={port}: address already in use (on 127.0.0.1); stop what listens "
        "there or give another --port"
    )
    assert "Traceback" not in done.stderr
    assert "Loading hf model" not in done.stderr and "engine:" not in done.stderr


# One server for the tests below; the SIGTERM test, the last, stops it.
SLOTS, QUEUE, BODY_LIMIT, GRACE_S = 1, 4, 65536, 2


@pytest.fixture(scope="module")
def small_server(tiny, tmp_path_factory):
    """serve with 1 slot, a queue of 4, a 64 KiB body limit and a 2 s grace period."""
    port = local.free_port()
    cmd = [
        sys.executable,
        "-m",
        "gpt_oss_train.serve",
        f"--checkpoint={tiny}",
        f"--port={port}",
        f"--max_slots={SLOTS}",
        f"--max_queue={QUEUE}",
        f"--max_request_bytes={BODY_LIMIT}",
        f"--grace_period_s={GRACE_S}",
        "--dtype=float32",
    ]
    log_path = tmp_path_factory.mktemp("small_server") / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(KEY), stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        local.wait_ready(url, 300, proc)
        yield types.SimpleNamespace(proc=proc, port=port, url=url, log=log_path)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)


def _client(server, **kw):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, **kw)


def _http(server, method, path, body=None, headers=None, chunks=None):
    """(status, headers, body bytes) of one request without the openai client; `chunks`:
    send the body chunked, in these pieces."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    sent = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
    sent.update(headers or {})
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    if chunks is not None:
        conn.request(method, path, iter(chunks), sent, encode_chunked=True)
    else:
        conn.request(method, path, data, sent)
    r = conn.getresponse()
    out = r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    conn.close()
    return out


@pytest.mark.full
def test_the_bearer_scheme_is_case_insensitive_the_key_is_not(small_server):
    client = _client(small_server)
    for scheme in ("Bearer", "bearer", "BEARER", "bEaReR"):
        (card,) = client.models.list(extra_headers={"Authorization": f"{scheme} {KEY}"}).data
        assert card.id == "tiny2048"
    for sent in (f"bearer {KEY.upper()}", f"Basic {KEY}", f"bearer{KEY}"):
        with pytest.raises(openai.AuthenticationError) as caught:
            client.models.list(extra_headers={"Authorization": sent})
        assert caught.value.body["code"] == "invalid_api_key"


@pytest.mark.full
def test_more_completions_than_the_engine_holds_get_400_saying_the_most(small_server):
    client = _client(small_server)
    most = SLOTS + QUEUE
    for prompt, n in (([[5, 6]] * (most + 1), 1), ([5, 6], most + 1), ([[5, 6]] * 3, 2)):
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model="tiny2048", prompt=prompt, n=n, max_tokens=2)
        message = caught.value.body["message"]
        asked = (len(prompt) if isinstance(prompt[0], list) else 1) * n
        assert f"asks for {asked} completions" in message, message
        assert f"takes at most {most} at once" in message, message
    # what fits is served (and the queue would only refuse it with 429 while busy)
    full = client.completions.create(model="tiny2048", prompt=[[5, 6]] * most, max_tokens=2)
    assert len(full.choices) == most
    assert all(len(c.model_extra["token_ids"]) == 2 for c in full.choices)


@pytest.mark.full
def test_a_body_over_max_request_bytes_gets_413_before_it_is_read(small_server):
    body = json.dumps({"model": "tiny2048", "prompt": [5, 6], "max_tokens": 2}).encode()
    at_limit = body + b" " * (BODY_LIMIT - len(body))  # valid JSON, padded to the limit
    status, _, answer = _http(small_server, "POST", "/v1/completions", at_limit)
    assert status == 200, answer
    over = at_limit + b" "
    for chunks in (None, [over[:30000], over[30000:]]):  # Content-Length, then chunked
        status, _, answer = _http(small_server, "POST", "/v1/completions", over, chunks=chunks)
        assert status == 413, answer
        error = json.loads(answer)["error"]
        assert error["code"] == "request_too_large"
        assert error["type"] == "invalid_request_error"
        assert f"limit of {BODY_LIMIT} bytes" in error["message"]
    status, _, _ = _http(small_server, "POST", "/v1/completions", None, chunks=[at_limit])
    assert status == 200  # chunked, at the limit


def _metric(server, name) -> float:
    _, _, text = _http(server, "GET", "/metrics")
    (value,) = [line.split()[-1] for line in text.decode().splitlines() if line.startswith(name)]
    return float(value)


@pytest.mark.full
def test_logit_bias_and_penalties_through_the_client(small_server):
    """The openai client's logit_bias and penalties reach the engine: +100 makes a token
    certain, -100 keeps the greedy choice out, a penalty changes a repetitive greedy
    completion; ids outside the vocabulary and penalties out of range get 400 naming the
    field; suffix is refused, saying why (no fill-in-the-middle in gpt-oss)."""
    client = _client(small_server)
    ask = dict(model="tiny2048", prompt=[5, 6, 7], max_tokens=8, temperature=0)
    ids = lambda r: r.choices[0].model_extra["token_ids"]
    plain = ids(client.completions.create(**ask))
    assert ids(client.completions.create(**ask, logit_bias={"42": 100})) == [42] * 8
    banned = ids(client.completions.create(**ask, logit_bias={str(plain[0]): -100}))
    assert plain[0] not in banned
    penalised = ids(client.completions.create(**ask, frequency_penalty=2, presence_penalty=2))
    assert len(set(penalised)) >= len(set(plain)) and penalised != plain
    bad = (
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),
        ({"logit_bias": {"hello": 1}}, "logit_bias"),
        ({"frequency_penalty": 3}, "frequency_penalty"),
        ({"suffix": "}"}, "suffix"),
    )
    for extra, field in bad:
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(**ask, **extra)
        assert field in str(caught.value.body), caught.value.body


@pytest.mark.full
def test_sigterm_drains_then_ends_running_requests_cleanly(small_server):
    """1 slot: a stream of 4 choices of 2040 tokens each (run one after the other: many
    seconds), and behind it a whole request; SIGTERM with a 2 s grace period."""
    prompt_tokens = "gpt_oss_prompt_tokens_total "
    submitted = _metric(small_server, prompt_tokens)
    conn = http.client.HTTPConnection("127.0.0.1", small_server.port, timeout=120)
    body = {"model": "tiny2048", "prompt": [5, 6, 7], "max_tokens": 2040, "n": 4, "stream": True}
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
    conn.request("POST", "/v1/completions", json.dumps(body), headers)
    stream = conn.getresponse()
    assert stream.status == 200
    lines = [stream.readline()]  # it is generating
    whole = {}

    def send_whole():
        try:
            _client(small_server).completions.create(
                model="tiny2048", prompt=[8, 9, 10], max_tokens=2040
            )
        except openai.APIStatusError as e:
            whole["error"] = e

    behind = threading.Thread(target=send_whole)
    behind.start()
    deadline = time.monotonic() + 60
    while _metric(small_server, prompt_tokens) < submitted + 3 * 4 + 3:  # both submitted
        assert time.monotonic() < deadline
        time.sleep(0.01)
    small_server.proc.send_signal(signal.SIGTERM)

    # draining: the listener still accepts; /health and new requests get 503
    status, _, answer = _http(small_server, "GET", "/health")
    assert (status, json.loads(answer)) == (503, {"status": "shutting down"})
    for method, path, req in (
        ("POST", "/v1/completions", {**body, "n": 1, "stream": False}),
        ("GET", "/v1/models", None),
    ):
        status, headers, answer = _http(small_server, method, path, req)
        assert status == 503, answer
        assert 1 <= int(headers["retry-after"]) <= GRACE_S
        error = json.loads(answer)["error"]
        assert error["code"] == "server_shutting_down" and error["type"] == "service_unavailable"
        assert "shutting down" in error["message"]

    # after the grace period: the stream ends with "abort" chunks then [DONE]
    lines += list(stream)
    conn.close()
    events = [line[len(b"data: ") :].strip() for line in lines if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]", lines[-3:]
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    finished = {c["index"]: c["finish_reason"] for c in chunks if c["finish_reason"]}
    assert sorted(finished) == [0, 1, 2, 3], finished  # every choice got its last chunk
    assert "abort" in finished.values() and set(finished.values()) <= {"abort", "length"}
    assert sum(len(c["token_ids"]) for c in chunks) > 0  # it had been generating
    # the whole request, still queued, gets OpenAI's error JSON, not a cut connection
    behind.join(60)
    error = whole["error"]
    assert error.status_code == 503 and error.body["code"] == "server_shutting_down"
    assert "was still running when its grace period ended" in error.body["message"]
    assert int(error.response.headers["retry-after"]) >= 1

    assert small_server.proc.wait(timeout=60) == 0
    log = small_server.log.read_text()
    assert "grace period over: ending the 2 request(s) still running" in log, log[-3000:]
    assert "Traceback" not in log and "timeout graceful shutdown exceeded" not in log
    assert "Finished server process" in log
