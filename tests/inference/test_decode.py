"""Tests for gpt_oss_train.decode: generate / score / chat / benchmark on tiny models.

Two checkpoints: a random Hugging Face model saved by transformers (the reference for
log-probabilities), and an Orbax workdir written by `train` on a cpu_tiny-like config
(decode must load it with no flags). Both use the real 201,088-id vocabulary so the
real tokenizer's text and chats can be fed to them. The CLI is run as a subprocess where
the command line itself is under test; everything else runs in-process.
"""

import dataclasses
import io
import json
import math
import subprocess
import sys

import jax
import numpy as np
import pytest
from support import ROOT

from gpt_oss_train.decode import chat, requests
from gpt_oss_train.inference import loading
from gpt_oss_train.inference.generate import Generator, SamplingParams
from gpt_oss_train.io.tokenizer import Tokenizer
from gpt_oss_train.training.objectives import make_loss_fn

pytestmark = pytest.mark.full  # the decode CLI end to end: minutes

VOCAB = 201088


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, random_hf_model):
    """A random HF model (the shared tiny shape with the real vocabulary, for the real
    tokenizer, and 2 layers); tests using it skip where transformers is not installed."""
    model = random_hf_model(seed=0, vocab_size=VOCAB, num_hidden_layers=2)
    path = tmp_path_factory.mktemp("hf") / "tiny"
    model.save_pretrained(path)
    return str(path), model


@pytest.fixture(scope="module")
def hf_model(hf_dir):
    return loading.load_model(hf_dir[0], dtype="float32")


@pytest.fixture(scope="module")
def workdir(cpu_tiny_run):
    """A run of configs/cpu_tiny.py, shortened to 3 steps (cached across test runs)."""
    return cpu_tiny_run


def _jsonl(*objs) -> bytes:
    return "".join((o if isinstance(o, str) else json.dumps(o)) + "\n" for o in objs).encode()


def _cli(*args, stdin=None, timeout=170):
    return subprocess.run(
        [sys.executable, "-m", "gpt_oss_train.decode", *args],
        cwd=ROOT,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# One prefill chunk, cache bucket and length for most tests: every new shape compiles
# (seconds each on a small CPU), so tests share them where what they check allows.
OPTS = loading.Options(max_new_tokens=6, batch_size=4, prefill_chunk=16)


# ----------------------------------------------------------------------------- generate


def test_generate_three_kinds_in_order(hf_model):
    tok = Tokenizer()
    lines = _jsonl(
        {"tokens": [10, 20, 30, 40, 50]},
        {"prompt": "The capital of France is"},
        {"messages": [{"role": "user", "content": "Hi there"}]},
        {"tokens": [7, 8]},
    )
    recs = requests.run_generate(hf_model, lines, OPTS)
    assert [r["index"] for r in recs] == [0, 1, 2, 3]
    for r in recs:
        assert "error" not in r
        assert set(r) >= {"tokens", "logprobs", "text", "stop_reason", "timing"}
        assert r["stop_reason"] == "length" and len(r["tokens"]) == len(r["logprobs"]) == 6
        assert all(0 <= t < VOCAB for t in r["tokens"]) and max(r["logprobs"]) <= 0
        assert r["text"] == tok.decode(r["tokens"])
        assert set(r["timing"]) == {"prefill_s", "total_s", "tokens_per_s", "batch_rows"}
        assert 0 < r["timing"]["prefill_s"] < r["timing"]["total_s"]
    assert recs[2]["messages"] == tok.parse_completion(recs[2]["tokens"])
    assert "messages" not in recs[0] and "messages" not in recs[1]


def test_generated_logprobs_match_a_full_forward(hf_model):
    """The cached decode path gives the same numbers as scoring prompt + completion."""
    prompt = list(range(100, 120))  # 20 > sliding window 8: the ring cache wraps
    rec = requests.run_generate(hf_model, _jsonl({"tokens": prompt}), OPTS)[0]
    full = prompt + rec["tokens"]
    scored = requests.run_score(hf_model, _jsonl({"tokens": full}), OPTS)[0]["logprobs"]
    np.testing.assert_allclose(scored[len(prompt) - 1 :], rec["logprobs"], atol=1e-4)


def test_stops_on_a_stop_token(hf_model):
    line = {"tokens": [3, 1, 4, 1, 5, 9, 2, 6]}
    free = requests.run_generate(hf_model, _jsonl(line), OPTS)[0]
    stop = free["tokens"][2]
    cut = free["tokens"].index(stop) + 1
    stopped = requests.run_generate(hf_model, _jsonl(dict(line, stop_ids=[stop])), OPTS)[0]
    assert stopped["stop_reason"] == "stop"
    assert stopped["tokens"] == free["tokens"][:cut]
    assert stopped["text"] == Tokenizer().decode(free["tokens"][: cut - 1])  # stop id not in text


def test_per_line_seed_and_sampling(hf_model):
    opts = dataclasses.replace(OPTS, sampling=SamplingParams(temperature=1.0))
    recs = requests.run_generate(
        hf_model, _jsonl(*[{"tokens": [1, 2, 3], "seed": s} for s in (5, 5, 6)]), opts
    )
    assert recs[0]["tokens"] == recs[1]["tokens"]  # same seed: same sample, wherever it sits
    assert recs[0]["tokens"] != recs[2]["tokens"]


def test_bad_lines_get_errors_and_the_rest_runs(hf_model):
    opts = dataclasses.replace(OPTS, max_cache_len=256)
    lines = _jsonl(
        {"tokens": [1, 2, 3]},
        '{"tokens": [1, 2,',
        {"prompt": ""},
        {"tokens": list(range(300))},
        {"messages": [{"role": "wizard", "content": "hi"}]},
        {"tokens": [1, VOCAB]},
        {"text": "score-mode key"},
        "",
        {"prompt": "still fine"},
    )
    recs = requests.run_generate(hf_model, lines, opts)
    by_index = {r["index"]: r for r in recs}
    assert sorted(by_index) == [0, 1, 2, 3, 4, 5, 6, 8]  # the blank line 7 has no output
    assert len(by_index[0]["tokens"]) == 6 and len(by_index[8]["tokens"]) == 6
    expected = {
        1: ("line 2:", "not valid JSON"),
        2: ("line 3:", 'empty "prompt"'),
        3: ("line 4:", "300 tokens but the cache holds 256"),
        4: ("line 5:", "role 'wizard'"),
        5: ("line 6:", f"[{VOCAB}] outside"),
        6: ("line 7:", 'exactly one of "tokens", "prompt" or "messages"'),
    }
    for i, (where, what) in expected.items():
        assert by_index[i]["error"].startswith(where) and what in by_index[i]["error"], by_index[i]
    assert requests.exit_code(recs) == 0
    assert requests.exit_code([by_index[1], by_index[2]]) == 1


def test_int8_weights_and_kv_cache(hf_dir, hf_model):
    q = loading.load_model(hf_dir[0], dtype="float32", int8_weights=True)
    opts = loading.Options(max_new_tokens=5, batch_size=2, int8_kv_cache=True)
    rec = requests.run_generate(q, _jsonl({"tokens": [1, 2, 3, 4]}), opts)[0]
    assert len(rec["tokens"]) == 5
    line = _jsonl({"tokens": list(range(1, 30))})
    exact = requests.run_score(hf_model, line, OPTS)[0]["logprobs"]
    approx = requests.run_score(q, line, OPTS)[0]["logprobs"]
    np.testing.assert_allclose(approx, exact, atol=0.05)  # int8: close, not equal
    assert not np.allclose(approx, exact, atol=1e-6)  # and really quantized


# ----------------------------------------------------------------------------- score


def test_score_matches_transformers(hf_dir, hf_model):
    import torch

    ids = [int(t) for t in np.random.RandomState(0).randint(0, VOCAB, 24)]
    text = "Scoring a sentence with the real tokenizer."
    recs = requests.run_score(
        hf_model, _jsonl({"tokens": ids}, {"text": text}, {"tokens": [5]}), OPTS
    )
    assert "at least 2 tokens" in recs[2]["error"]
    for rec, seq in ((recs[0], ids), (recs[1], Tokenizer().encode(text))):
        with torch.no_grad():
            logits = hf_dir[1](torch.tensor([seq])).logits[0].double()
        ref = torch.log_softmax(logits, -1)[torch.arange(len(seq) - 1), seq[1:]].numpy()
        assert rec["num_tokens"] == len(seq) and len(rec["logprobs"]) == len(seq) - 1
        np.testing.assert_allclose(rec["logprobs"], ref, atol=1e-4)
        assert rec["sum_logprob"] == pytest.approx(ref.sum(), abs=1e-3)
        assert rec["perplexity"] == pytest.approx(math.exp(-ref.mean()), rel=1e-4)


def test_score_of_text_equals_training_loss(workdir):
    model = loading.load_model(workdir, dtype="float32")
    text = "def add(a, b):\n    return a + b\n"
    rec = requests.run_score(model, _jsonl({"text": text}), OPTS)[0]
    ids = np.asarray(Tokenizer().encode(text), np.int32)
    n = len(ids) - 1
    batch = {
        "inputs": ids[None, :-1],
        "targets": ids[None, 1:],
        "positions": np.arange(n, dtype=np.int32)[None],
        "segment_ids": np.ones((1, n), np.int32),
        "loss_mask": np.ones((1, n), np.int32),
    }
    loss_fn = make_loss_fn(model.md, loading.default_runtime_config().train)
    with model.scope():
        _, stats = jax.jit(loss_fn)(model.params, batch)
    assert float(stats["tokens"]) == n
    np.testing.assert_allclose(-np.mean(rec["logprobs"]), float(stats["nll"]) / n, rtol=1e-5)


def test_score_data_cli_prints_a_finite_loss(workdir, tmp_path):
    out = tmp_path / "eval.json"
    r = _cli(
        f"--checkpoint={workdir}",
        "--mode=score",
        "--data=stdlib",
        "--num_batches=2",
        "--batch_size=8",
        "--seq_len=32",
        "--dtype=float32",
        f"--output={out}",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "eval loss" in r.stdout and "perplexity" in r.stdout
    result = json.loads(out.read_text())
    assert result["batches"] == 2 and result["tokens"] > 0
    assert 0 < result["loss"] < 20 and math.isclose(result["perplexity"], math.exp(result["loss"]))


# ----------------------------------------------------------------------------- CLI


def test_cli_generates_from_a_training_workdir_with_no_flags(workdir, tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_bytes(_jsonl({"prompt": "import os"}, "{oops", {"tokens": [1, 2, 3]}))
    r = _cli(f"--checkpoint={workdir}", f"--input={src}", f"--output={dst}", "--max_new_tokens=5")
    assert r.returncode == 0, r.stderr[-3000:]
    recs = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [x["index"] for x in recs] == [0, 1, 2]
    assert len(recs[0]["tokens"]) == 5 and len(recs[2]["tokens"]) == 5
    assert isinstance(recs[0]["text"], str)
    assert "line 2: not valid JSON" in recs[1]["error"]
    assert "line 2: not valid JSON" in r.stderr  # warned too


def test_cli_rejects_a_folder_that_is_no_checkpoint(tmp_path):
    folder = tmp_path / "not_a_model"
    folder.mkdir()
    (folder / "notes.txt").write_text("hello")
    src = tmp_path / "in.jsonl"
    src.write_bytes(_jsonl({"tokens": [1]}))
    r = _cli(f"--checkpoint={folder}", f"--input={src}", f"--output={tmp_path / 'o.jsonl'}")
    assert r.returncode == 2
    assert str(folder) in r.stderr and "neither an Orbax checkpoint" in r.stderr
    assert not (tmp_path / "o.jsonl").exists()


def test_cli_chat_replies_and_exits(hf_dir):
    r = _cli(
        f"--checkpoint={hf_dir[0]}",
        "--mode=chat",
        "--max_new_tokens=6",
        "--dtype=float32",
        stdin="hello\n/exit\nnot read\n",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    replies = [line for line in r.stdout.splitlines() if line.startswith("assistant> ")]
    assert len(replies) == 1 and replies[0].strip() != "assistant>"


def test_chat_keeps_history_and_resets(hf_model, monkeypatch):
    prompts = []
    original = Generator.generate

    def spy(self, prompts_, **kw):
        prompts.append(list(prompts_[0]))
        return original(self, prompts_, **kw)

    monkeypatch.setattr(Generator, "generate", spy)
    out = io.StringIO()
    opts = dataclasses.replace(OPTS, show_analysis=True)
    rc = chat.run_chat(hf_model, opts, io.StringIO("hello\nagain\n/reset\nfresh\n"), out)
    assert rc == 0 and out.getvalue().count("assistant> ") == 3
    assert "(conversation cleared)" in out.getvalue()
    first, second, third = prompts
    tok = Tokenizer()
    # The second turn's prompt holds the first turn, the reply and the new message.
    assert second[: len(first)] == first and "again" in tok.decode(second[len(first) :])
    assert "hello" not in tok.decode(third) and "fresh" in tok.decode(third)


def test_reply_stream_prints_channels():
    tok = Tokenizer()
    enc = lambda s: tok.encode(s)
    reply = [
        200005,
        *enc("analysis"),
        200008,
        *enc("thinking"),
        200007,
        200006,
        *enc("assistant"),
        200005,
        *enc("final"),
        200008,
        *enc("Paris."),
        200002,
    ]

    def stream(out, **kw):
        s = chat.ReplyStream(tok, out, **kw)
        for t in reply:
            s.feed(t)
        return s.finish()

    hidden, shown, dim = io.StringIO(), io.StringIO(), io.StringIO()
    msgs = stream(hidden, show_analysis=False, tty=False)
    stream(shown, show_analysis=True, tty=False)
    stream(dim, show_analysis=True, tty=True)
    assert [m["channel"] for m in msgs] == ["analysis", "final"]
    assert hidden.getvalue() == "Paris.\n"
    assert shown.getvalue() == "[analysis] thinking\nParis.\n"
    assert dim.getvalue() == "\x1b[2mthinking\x1b[0m\nParis.\n"


def test_cli_benchmark_table_with_hf(hf_dir, tmp_path):
    out = tmp_path / "bench.json"
    r = _cli(
        f"--checkpoint={hf_dir[0]}",
        "--mode=benchmark",
        "--batch_sizes=1,2",
        "--prompt_lengths=8",
        "--max_new_tokens=4",
        "--repeats=1",
        "--dtype=float32",
        "--compare_hf",
        f"--output={out}",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    header, *rows = [line.split() for line in r.stdout.strip().splitlines()[-3:]]
    assert header == [
        "batch",
        "prompt_len",
        "new_tokens",
        "ttft_ms",
        "prefill_tok_s",
        "decode_tok_s",
        "hf_ttft_ms",
        "hf_decode_tok_s",
    ]
    assert [row[:3] for row in rows] == [["1", "8", "4"], ["2", "8", "4"]]
    assert all(float(v) > 0 for row in rows for v in row[3:])
    saved = json.loads(out.read_text())
    assert [s["batch"] for s in saved] == [1, 2] and all(s["decode_tok_s"] > 0 for s in saved)


def test_chat_streams_tokens_while_generating(hf_model, monkeypatch):
    """Tokens reach the printer from inside the compiled loop, before generate returns."""
    events = []
    original_generate, original_feed = Generator.generate, chat.ReplyStream.feed

    def generate(self, *a, **kw):
        out = original_generate(self, *a, **kw)
        events.append("returned")
        return out

    def feed(self, token):
        events.append("token")
        return original_feed(self, token)

    monkeypatch.setattr(Generator, "generate", generate)
    monkeypatch.setattr(chat.ReplyStream, "feed", feed)
    opts = dataclasses.replace(OPTS, max_new_tokens=6)
    assert chat.run_chat(hf_model, opts, io.StringIO("hi\n"), io.StringIO()) == 0
    assert events.count("token") >= 1 and events[-1] == "returned"
    assert "returned" not in events[:-1]
