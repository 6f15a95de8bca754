"""`python -m gpt_oss_train.serve` starting up, as a user runs it (a subprocess serving a
tiny random Hugging Face model of 2048 positions on a loopback port): without
--max_context it serves the model's 2048 positions (the 4096 default would not fit the
model) and says so in one log line; a --max_context beyond the model is one error line
and exit 2, before any loading; a key in $GPT_OSS_TRAIN_API_KEY guards /v1/*; listening
beyond loopback without a key is warned of."""

import os
import signal
import subprocess
import sys

import pytest

openai = pytest.importorskip("openai")

from gpt_oss_train import serve  # noqa: E402
from gpt_oss_train.inference.loading import DecodeError  # noqa: E402
from gpt_oss_train.inference.server import local  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEY = "sk-start-3e9d1f7a"
POSITIONS = 2048


@pytest.fixture(scope="module")
def tiny(random_hf_model, tmp_path_factory):
    """A 2-layer random gpt-oss (300-id vocabulary) whose config says 2048 positions."""
    folder = tmp_path_factory.mktemp("serve_start") / "tiny2048"
    rope = dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0,
                beta_slow=1.0, truncate=False, original_max_position_embeddings=64)  # fmt: skip
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
    cmd = [sys.executable, "-m", "gpt_oss_train.serve", f"--checkpoint={tiny}",
           f"--port={port}", "--max_slots=1", "--dtype=float32"]  # fmt: skip
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
    cmd = [sys.executable, "-m", "gpt_oss_train.serve", f"--checkpoint={tiny}",
           "--max_context=4096", "--host=0.0.0.0", "--port=0"]  # fmt: skip
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
