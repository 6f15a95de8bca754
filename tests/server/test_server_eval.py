"""lm-evaluation-harness against the server, offline, on the tasks in evals/tiny_harmony/:
log-likelihoods through `local-completions` (echo + logprobs) equal decode's score of the
same text to 1e-5, and `local-chat-completions` answers through the Harmony chat."""

import json
import os

import numpy as np
import pytest

lm_eval = pytest.importorskip("lm_eval")

from lm_eval.tasks import TaskManager
from support import ROOT

from gpt_oss_train.decode import requests
from gpt_oss_train.inference import loading
from gpt_oss_train.io import tokenizer as tok_lib

pytestmark = pytest.mark.full  # lm-evaluation-harness over the trained Harmony model

MODEL = "tiny-harmony"


@pytest.fixture(scope="module")
def server(harmony_server):
    return harmony_server


def _evaluate(model: str, model_args: dict, task: str, **kw) -> dict:
    return lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[task],
        task_manager=TaskManager(include_path=os.path.join(ROOT, "evals")),
        log_samples=True,
        **kw,
    )


def test_loglikelihood_equals_decode_score(server, harmony_checkpoint, monkeypatch):
    monkeypatch.chdir(ROOT)  # the task's data_files are relative to the repository
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    out = _evaluate(
        "local-completions",
        {
            "base_url": server.url + "/v1/completions",
            "model": MODEL,
            "tokenizer": harmony_checkpoint,  # its tokenizer.json, offline
            "tokenizer_backend": "huggingface",
            "tokenized_requests": True,
            "max_retries": 1,
        },
        "tiny_harmony_loglik",
    )
    samples = out["samples"]["tiny_harmony_loglik"]
    assert len(samples) == 4
    tok = tok_lib.Tokenizer()
    texts = [s["doc"]["context"] + s["doc"]["continuation"] for s in samples]
    lines = "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()
    model = loading.load_model(harmony_checkpoint, dtype="float32")
    scores = requests.run_score(model, lines, loading.Options())
    for s, ref in zip(samples, scores):
        n_context = len(tok.encode(s["doc"]["context"]))
        expected = float(np.sum(ref["logprobs"][n_context - 1 :], dtype=np.float64))
        got = s["resps"][0][0][0]
        # float32 sums of ~100 log-probabilities, batched by the server and alone here: a
        # few units in the last place apart (the value's own ulp is ~8e-6)
        assert got == pytest.approx(expected, rel=1e-6, abs=1e-5)
    assert np.isfinite(out["results"]["tiny_harmony_loglik"]["perplexity,none"])


def test_generate_until_through_chat(server, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    out = _evaluate(
        "local-chat-completions",
        {
            "base_url": server.url + "/v1/chat/completions",
            "model": MODEL,
            "tokenizer_backend": None,
            "tokenized_requests": False,
            "max_retries": 1,
        },
        "tiny_harmony_chat",
        apply_chat_template=True,
    )
    samples = out["samples"]["tiny_harmony_chat"]
    assert [s["resps"][0][0] for s in samples] == [s["doc"]["answer"] for s in samples]
    assert out["results"]["tiny_harmony_chat"]["exact_match,none"] == 1.0
