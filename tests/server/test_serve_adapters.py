"""LoRA adapters in the serving engine and the HTTP server, beside the base (never
merged): each request's tokens equal decode's run of its prompt alone with the same
adapter (decode --adapter=DIR, i.e. a model carrying only that adapter), whatever other
adapters share its decode steps; the prefix cache never hands one adapter's KV to
another; an adapter that is not loaded is refused; the `openai` client picks an adapter
by `model`.

A tiny random Hugging Face base (2 layers, float32, one device) and two random PEFT
adapters of different ranks and targets; one engine with both (4 slots of 64 positions,
16-token chunks) serves most tests, so its shapes compile once.
"""

import json
import os
import subprocess
import sys
import threading

import jax
import numpy as np
import pytest
from support import ROOT

from gpt_oss_train import config as config_lib
from gpt_oss_train.decode import requests
from gpt_oss_train.inference import adapters as adapters_lib
from gpt_oss_train.inference import loading, scoring
from gpt_oss_train.inference.engine import Engine, RequestParams, RequestRejected
from gpt_oss_train.inference.server.app import create_app
from gpt_oss_train.inference.server.local import ThreadServer
from gpt_oss_train.io import hf
from gpt_oss_train.io import peft as peft_io
from gpt_oss_train.model import lora
from gpt_oss_train.model.transformer import ModelDef

pytestmark = pytest.mark.full  # servers with adapters: tens of seconds

OPTIONS = dict(max_slots=4, max_context=64, prefill_chunk=16, prefix_cache_tokens=256)
DECODE = loading.Options(batch_size=1, prefill_chunk=16)  # decode's run of one prompt
# The last prompt, two whole prefix-cache blocks long, is kept for the prefix-cache test.
PROMPTS = [[5, 6, 7, 8, 9, 10], [101, 102], list(range(40, 77)), list(range(120, 157))]
ADAPTERS = {"a": (("q", "v", "gate_up", "down"), 4), "b": (("o", "router"), 2)}


def _random_adapter(folder, arch, targets, rank, seed):
    """A PEFT folder holding a LoRA adapter with every factor random (B too, so it acts)."""
    spec = lora.LoraSpec(rank, 2.0 * rank, targets)
    model_cfg = config_lib.ModelConfig(**arch).replace(lora=spec)
    rng = np.random.RandomState(seed)
    shapes = lora.split(ModelDef(model_cfg).abstract_params())[1]
    factors = jax.tree.map(lambda s: rng.normal(0, 0.3, s.shape).astype(np.float32), shapes)
    peft_io.save_peft(str(folder), spec, factors, arch["num_layers"])


@pytest.fixture(scope="module")
def folders(random_hf_model, tmp_path_factory):
    """{"base": tiny HF folder, "a": adapter folder, "b": adapter folder}."""
    root = tmp_path_factory.mktemp("serve_adapters")
    random_hf_model(seed=5, num_hidden_layers=2, intermediate_size=32).save_pretrained(
        str(root / "tiny")
    )
    arch = hf.HFCheckpoint(str(root / "tiny")).model_config
    out = {"base": str(root / "tiny")}
    for seed, (name, (targets, rank)) in enumerate(ADAPTERS.items()):
        _random_adapter(root / f"adapter_{name}", arch, targets, rank, seed)
        out[name] = str(root / f"adapter_{name}")
    return out


def _load(folders, adapters=()):
    return loading.load_model(
        folders["base"], dtype="float32", devices=jax.devices()[:1], adapters=adapters
    )


@pytest.fixture(scope="module")
def alone(folders):
    """decode --mode=generate (8 new tokens) of each prompt alone, by adapter (None: the
    base), each on a model carrying only that adapter, unstacked."""
    data = "".join(json.dumps({"tokens": p, "max_new_tokens": 8}) + "\n" for p in PROMPTS)
    out = {}
    for name in (None, *ADAPTERS):
        model = _load(folders, [("", folders[name])] if name else [])
        out[name] = requests.run_generate(model, data.encode(), DECODE)
    return out


@pytest.fixture(scope="module")
def engine(folders):
    """Both adapters, named, stacked: requests pick "a", "b" or None (the base)."""
    named = [(name, folders[name]) for name in ADAPTERS]
    eng = Engine.from_checkpoint(
        folders["base"],
        dtype="float32",
        devices=jax.devices()[:1],
        compilation_cache=False,
        adapters=named,
        **OPTIONS,
    )
    with eng:
        yield eng


def _assert_same(completion, ref):
    assert completion.tokens == ref["tokens"]
    np.testing.assert_allclose(completion.logprobs, ref["logprobs"], atol=1e-4)


def test_concurrent_requests_for_two_adapters_and_the_base(engine, alone):
    """Nine requests (3 prompts x {a, b, base}) submitted together from threads share
    decode steps; each equals decode of its prompt alone with its own adapter."""
    assert engine.adapters == ("a", "b")
    jobs = [(name, i) for i in range(3) for name in ("a", None, "b")]
    out = {}

    def client(name, i):
        params = RequestParams(max_tokens=8, adapter=name)
        out[name, i] = engine.submit(PROMPTS[i], params).result()

    threads = [threading.Thread(target=client, args=job) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name, i in jobs:
        _assert_same(out[name, i], alone[name][i])
    for i in range(3):  # the adapters do change the tokens
        assert len({tuple(alone[n][i]["tokens"]) for n in (None, *ADAPTERS)}) == 3


def test_prefix_cache_is_not_shared_across_adapters(engine, alone):
    """A fresh 37-token prompt (two whole 16-token blocks) under a, b, b, the base, the
    base, a: a run takes the cached prefix only when the same adapter ran it before, and
    every run gives its own adapter's tokens."""
    prompt, ref = PROMPTS[3], {n: alone[n][3] for n in (None, *ADAPTERS)}
    runs = [("a", 0), ("b", 0), ("b", 32), (None, 0), (None, 32), ("a", 32)]
    before = engine.stats()["prefix_cache_hits"]
    for name, cached in runs:
        got = engine.submit(prompt, RequestParams(max_tokens=8, adapter=name)).result()
        assert got.cached_prompt_tokens == cached, (name, cached)
        _assert_same(got, ref[name])
    assert engine.stats()["prefix_cache_hits"] - before == 3


def test_an_adapter_that_is_not_loaded_is_refused(engine):
    for adapter, match in (("c", r"'c' is not loaded; loaded: \['a', 'b'\]"), (3, "adapter")):
        with pytest.raises(RequestRejected, match=match) as e:
            engine.submit([1, 2, 3], RequestParams(adapter=adapter))
        assert e.value.status == 400
    with pytest.raises(RequestRejected, match="'c' is not loaded"):
        engine.score([1, 2, 3], adapter="c")


def test_scores_under_an_adapter_equal_decode_with_that_adapter(engine, folders):
    """engine.score (decode --mode=score's numbers) and the echo's top alternatives
    (scoring.top_logprobs) under stacked adapter b equal a model carrying only b."""
    ids = PROMPTS[2]
    line = (json.dumps({"tokens": ids}) + "\n").encode()
    model = _load(folders, [("", folders["b"])])
    ref = requests.run_score(model, line, DECODE)[0]["logprobs"]
    np.testing.assert_allclose(engine.score(ids, adapter="b"), ref, atol=1e-4)
    assert np.abs(np.subtract(engine.score(ids), ref)).max() > 1e-3  # the base differs
    top = engine.top_logprobs(ids, 3, "b")
    top_ref = scoring.top_logprobs(model, ids, 3)
    assert [[t for t, _ in row] for row in top] == [[t for t, _ in row] for row in top_ref]
    np.testing.assert_allclose(
        [[v for _, v in row] for row in top], [[v for _, v in row] for row in top_ref], atol=1e-4
    )


def test_one_unnamed_adapter_serves_every_request(folders, alone):
    """decode's --adapter=DIR: no adapter to pick, every request (adapter None, or the
    adapter's folder name) runs with it, unstacked."""
    model = _load(folders, [("", folders["a"])])
    assert model.cfg.lora.adapters == 0
    with Engine.from_model(model, max_slots=2, max_context=64, prefill_chunk=16) as eng:
        assert eng.adapters == ()
        name = os.path.basename(folders["a"])
        for adapter in (None, name):
            got = eng.submit(PROMPTS[0], RequestParams(max_tokens=8, adapter=adapter)).result()
            _assert_same(got, alone["a"][0])
        with pytest.raises(RequestRejected, match="'b' is not loaded") as e:
            eng.submit(PROMPTS[0], RequestParams(adapter="b"))
        assert e.value.status == 400


def test_openai_client_picks_the_adapter_by_model(engine, alone):
    openai = pytest.importorskip("openai")
    app = create_app(
        engine, tokenizer=loading.tokenizer(), model_name="tiny", max_context=64, vocab_size=300
    )
    with ThreadServer(app) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        cards = client.models.list().data
        assert [m.id for m in cards] == ["tiny", "a", "b"]
        assert [(m.model_extra or {}).get("parent") for m in cards] == [None, "tiny", "tiny"]
        for model, ref in (("a", alone["a"]), ("tiny", alone[None]), ("b", alone["b"])):
            resp = client.completions.create(
                model=model, prompt=PROMPTS[0], max_tokens=8, temperature=0
            )
            assert resp.model == model
            assert resp.choices[0].model_extra["token_ids"] == ref[0]["tokens"]
        echo = client.completions.create(
            model="b", prompt=PROMPTS[2], max_tokens=0, echo=True, logprobs=1
        )
        scored = echo.choices[0].logprobs.token_logprobs
        np.testing.assert_allclose(scored[1:], engine.score(PROMPTS[2], adapter="b"), atol=1e-5)
        with pytest.raises(openai.NotFoundError, match="'tiny', 'a', 'b'"):
            client.completions.create(model="c", prompt=PROMPTS[0], max_tokens=2)


def test_adapter_flag_parsing_is_shared_and_checked():
    assert adapters_lib.parse_flag(["d1"]) == [("", "d1")]
    assert adapters_lib.parse_flag(["x=d1", "y=d2"]) == [("x", "d1"), ("y", "d2")]
    with pytest.raises(adapters_lib.AdapterError, match="several adapters need names"):
        adapters_lib.parse_flag(["d1", "y=d2"])


def test_serve_refuses_an_adapter_named_like_the_base_before_loading(folders):
    cmd = [
        sys.executable,
        "-m",
        "gpt_oss_train.serve",
        f"--checkpoint={folders['base']}",
        f"--adapter=tiny={folders['a']}",
        "--max_context=64",
        "--port=0",
    ]
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="", PYTHONPATH=ROOT)
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --adapter: 'tiny' is also the served model's name"), last
