"""The serving engine (inference/engine.py) against decode's own modes on a tiny random
Hugging Face model (float32): greedy completions under concurrent load, seeded sampling,
prefix-cache hits, cancellation, refusals, a step that fails, sharded serving, scoring.

One engine (4 slots of 64 positions, 16-token chunks) serves most tests, so its shapes
compile once; the references come from `requests.run_generate` / `run_score`, i.e.
`decode --mode=generate|score`, one prompt per batch.
"""

import asyncio
import dataclasses
import json
import threading
import time

import jax
import numpy as np
import pytest

from gpt_oss_train.decode import requests
from gpt_oss_train.inference import loading
from gpt_oss_train.inference.engine import (
    NO_TOKEN,
    Engine,
    RequestParams,
    RequestRejected,
)
from gpt_oss_train.inference.generate import SamplingParams
from gpt_oss_train.io.tokenizer import Tokenizer

VOCAB = 300
OPTIONS = dict(max_slots=4, max_context=64, prefill_chunk=16, prefix_cache_tokens=256)
# decode's settings for the same shapes: one prompt per batch, 16-token chunks
DECODE = loading.Options(batch_size=1, prefill_chunk=16)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, random_hf_model):
    path = tmp_path_factory.mktemp("hf_engine") / "tiny"
    random_hf_model(seed=3, num_hidden_layers=2).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def model(hf_dir):
    return loading.load_model(hf_dir, dtype="float32", devices=jax.devices()[:1])


@pytest.fixture(scope="module")
def engine(model):
    with Engine.from_model(model, **OPTIONS) as e:
        yield e


def _decode(model, prompts, max_tokens, opts=DECODE, seeds=None):
    """decode --mode=generate of each prompt alone: tokens and logprobs per prompt."""
    lines = [
        {"tokens": list(p), "max_new_tokens": m, **({"seed": seeds[i]} if seeds else {})}
        for i, (p, m) in enumerate(zip(prompts, max_tokens))
    ]
    data = "".join(json.dumps(x) + "\n" for x in lines).encode()
    return requests.run_generate(model, data, opts)


def _prompts(seed, lengths):
    rng = np.random.RandomState(seed)
    return [rng.randint(0, VOCAB, n).tolist() for n in lengths]


def _assert_same(completions, refs):
    for c, r in zip(completions, refs):
        assert c.tokens == r["tokens"]
        np.testing.assert_allclose(c.logprobs, r["logprobs"], atol=1e-5)


def test_concurrent_greedy_completions_equal_decode_alone(engine, model):
    """Ten clients submit at random times (mixed prompt lengths, some longer than a
    chunk, the window and the ring; two lengths of output): each completion equals
    decode's run of its prompt alone, whatever it was batched with."""
    rng = np.random.RandomState(0)
    prompts = _prompts(1, rng.randint(1, 50, 10))
    max_tokens = [int(m) for m in rng.choice([3, 9], 10)]
    delays = rng.uniform(0, 0.3, 10)
    out = [None] * 10

    def client(i):
        time.sleep(delays[i])
        out[i] = engine.submit(prompts[i], RequestParams(max_tokens=max_tokens[i])).result()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    _assert_same(out, _decode(model, prompts, max_tokens))
    assert all(c.finish_reason == "length" for c in out)
    assert [len(c.tokens) for c in out] == max_tokens


def test_stop_id_ends_the_request_after_emitting_it(engine):
    prompt = _prompts(2, [12])[0]
    free = engine.submit(prompt, RequestParams(max_tokens=8)).result()
    stop = free.tokens[2]
    got = engine.submit(prompt, RequestParams(max_tokens=8, stop_ids=(stop,))).result()
    assert got.finish_reason == "stop"
    assert got.tokens == free.tokens[: free.tokens.index(stop) + 1]


def test_seeded_sampling_ignores_the_rest_of_the_batch(engine, model):
    params = RequestParams(max_tokens=8, temperature=1.0, top_k=50, top_p=0.9, seed=11)
    prompt = _prompts(3, [20])[0]
    alone = engine.submit(prompt, params).result()
    others = [
        engine.submit(p, dataclasses.replace(params, seed=i))
        for i, p in enumerate(_prompts(4, [5, 30, 9]))
    ]
    batched = engine.submit(prompt, params).result()
    assert batched.tokens == alone.tokens and batched.seed == 11
    other_seed = engine.submit(prompt, dataclasses.replace(params, seed=12)).result()
    assert other_seed.tokens != alone.tokens
    for h in others:
        h.result()
    # decode with the same settings and seed draws the same tokens
    opts = dataclasses.replace(DECODE, sampling=SamplingParams(1.0, 50, 0.9))
    _assert_same([alone], _decode(model, [prompt], [8], opts, seeds=[11]))


def test_prefix_cache_hit_prefills_only_the_suffix_and_changes_nothing(engine, model):
    shared = _prompts(5, [37])[0]  # two whole 16-token blocks: the ring (16) included
    first, second = shared + [1, 2, 3], shared + [7, 8, 9, 10, 11]
    engine.submit(first, RequestParams(max_tokens=4)).result()
    before = engine.stats()
    got = engine.submit(second, RequestParams(max_tokens=8)).result()
    after = engine.stats()
    assert got.cached_prompt_tokens == 32
    assert after["cached_prompt_tokens"] - before["cached_prompt_tokens"] == 32
    assert after["prefill_tokens"] - before["prefill_tokens"] == len(second) - 32
    assert after["prefill_chunks"] - before["prefill_chunks"] == 1  # 10 tokens, one chunk
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] == 1
    _assert_same([got], _decode(model, [second], [8]))  # decode never caches


def test_cancel_frees_the_slot_within_a_step(engine):
    handle = engine.submit(_prompts(6, [10])[0], RequestParams(max_tokens=50))
    events = iter(handle)
    seen = [next(events).token for _ in range(3)]
    produced = len(handle._events)  # the reader may lag the engine on a busy machine
    handle.cancel()
    rest = list(events)
    assert rest[-1].finish_reason == "cancelled" and rest[-1].token == NO_TOKEN
    result = handle.result()
    assert len(result.tokens) <= produced + 1  # at most the token of a step already running
    assert result.finish_reason == "cancelled" and result.tokens[:3] == seen
    assert engine.stats()["running"] == 0
    assert engine.submit([1, 2, 3], RequestParams(max_tokens=2)).result().finish_reason == "length"


def test_async_iteration_streams_the_same_events(engine):
    prompt = _prompts(7, [6])[0]

    async def collect():
        return [e async for e in engine.submit(prompt, RequestParams(max_tokens=5, logprobs=3))]

    events = asyncio.run(collect())
    ref = engine.submit(prompt, RequestParams(max_tokens=5)).result()
    assert [e.token for e in events] == ref.tokens
    assert [e.finish_reason for e in events] == [None] * 4 + ["length"]
    for e in events:  # the top alternatives, most likely first, include a greedy choice
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0] == (e.token, pytest.approx(e.logprob))


def test_refusals_before_queueing(model):
    engine = Engine.from_model(model, max_slots=1, max_context=64, prefill_chunk=16, max_queue=1)
    bad = [
        (list(range(60)), RequestParams(max_tokens=5), "max_context=64"),
        ([1, VOCAB], RequestParams(), "token ids in [0, 300)"),
        ([], RequestParams(), "1 or more token ids"),
        ("hello", RequestParams(), "list of integer token ids"),
        ([1], RequestParams(top_p=0.0), "top_p"),
        ([1], RequestParams(logprobs=21), "logprobs"),
        ([1], RequestParams(adapter="x"), "adapter"),
        ([1], RequestParams(logit_bias=((VOCAB, 1.0),)), "logit_bias: token ids"),
        ([1], RequestParams(logit_bias=((3, 101.0),)), "amounts must be numbers in"),
        ([1], RequestParams(frequency_penalty=2.5), "frequency_penalty"),
    ]
    for prompt, params, what in bad:
        with pytest.raises(
            RequestRejected, match=what.replace("[", r"\[").replace(")", r"\)")
        ) as e:
            engine.submit(prompt, params)
        assert e.value.status == 400
    # not started: one request fits the free slot, one the queue, the next is refused
    held = [engine.submit([1, 2], RequestParams(max_tokens=4)) for _ in range(2)]
    with pytest.raises(RequestRejected, match="queue is full") as e:
        engine.submit([1, 2], RequestParams(max_tokens=4))
    assert e.value.status == 429 and e.value.retry_after_s >= 1
    engine.stop(grace_s=0)
    assert [h.result().finish_reason for h in held] == ["cancelled", "cancelled"]
    with pytest.raises(RequestRejected, match="shutting down") as e:
        engine.submit([1, 2], RequestParams(max_tokens=4))
    assert e.value.status == 503
    assert engine.stats()["rejected"] == {400: 10, 429: 1, 503: 1}


def _hf_greedy_with_adjustments(hf_dir, prompt, n, bias, frequency, presence) -> list[int]:
    """transformers' float32 forward, adjusted in float64 numpy by OpenAI's definition:
    logit + bias - count x frequency - (count > 0) x presence, counts over generated tokens."""
    import torch
    import transformers

    hf = transformers.GptOssForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    ids, counts = list(prompt), np.zeros(VOCAB)
    for _ in range(n):
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1].double().numpy()
        for t, amount in bias:
            logits[t] += amount
        logits -= counts * frequency + (counts > 0) * presence
        ids.append(int(np.argmax(logits)))
        counts[ids[-1]] += 1
    return ids[len(prompt) :]


def test_logit_bias_and_penalties_in_a_shared_batch(engine, hf_dir):
    """Greedy completions with logit_bias and penalties equal transformers' forward with
    the adjustments applied by hand; +100 makes a token certain, -100 keeps it out; and
    the plain requests batched beside them keep their tokens."""
    prompts = _prompts(7, [9, 21, 14, 5])
    plain = [engine.submit(p, RequestParams(max_tokens=10)).result() for p in prompts[:2]]
    banned = plain[0].tokens[0]
    adjusted = [
        RequestParams(max_tokens=10, frequency_penalty=1.5, presence_penalty=0.5),
        RequestParams(max_tokens=10, logit_bias=((banned, -100.0), (11, 2.0))),
    ]
    handles = [engine.submit(p, RequestParams(max_tokens=10)) for p in prompts[:2]]
    handles += [engine.submit(prompts[0], adjusted[0]), engine.submit(prompts[2], adjusted[1])]
    forced = engine.submit(prompts[3], RequestParams(max_tokens=6, logit_bias=((42, 100.0),)))
    out = [h.result() for h in handles]
    forced = forced.result()
    for got, want in zip(out[:2], plain):  # (another row bucket: float rounding may move)
        assert got.tokens == want.tokens
        np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)
    want = _hf_greedy_with_adjustments(hf_dir, prompts[0], 10, (), 1.5, 0.5)
    assert out[2].tokens == want and out[2].tokens != plain[0].tokens
    want = _hf_greedy_with_adjustments(hf_dir, prompts[2], 10, ((banned, -100.0), (11, 2.0)), 0, 0)
    assert out[3].tokens == want and banned not in out[3].tokens
    assert forced.tokens == [42] * 6


def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(engine, monkeypatch):
    real, calls = engine.steps.decode, []

    def decode_once_broken(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected fault")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine.steps, "decode", decode_once_broken)
    failed = engine.submit([4, 5, 6], RequestParams(max_tokens=5)).result()
    assert failed.finish_reason == "error" and "injected fault" in failed.error
    assert len(failed.tokens) == 1  # the first token came from prefill
    ok = engine.submit([4, 5, 6], RequestParams(max_tokens=5)).result()
    assert ok.finish_reason == "length" and ok.tokens[0] == failed.tokens[0]


def test_score_equals_decode_score(engine, model):
    ids = _prompts(8, [30])[0]
    ref = requests.run_score(model, (json.dumps({"tokens": ids}) + "\n").encode(), DECODE)[0]
    np.testing.assert_allclose(engine.score(ids), ref["logprobs"], atol=1e-6)
    with pytest.raises(RequestRejected, match="2 to 64"):
        engine.score([5])


def test_chat_prompt_renders_harmony(engine):
    tok = Tokenizer()
    messages = [{"role": "user", "content": "What is the weather?"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    prompt, params = engine.chat_prompt(messages, tools=tools, reasoning_effort="high")
    assert prompt == tok.render_chat(messages, "high", tools=tools)
    assert set(params.stop_ids) == set(tok.stop_ids)
    with pytest.raises(RequestRejected) as e:  # this toy model's vocabulary has 300 ids
        engine.chat(messages, RequestParams(max_tokens=2))
    assert e.value.status == 400


@pytest.mark.full
def test_sharded_serving_gives_the_single_device_tokens(engine, hf_dir):
    """Tensor x expert parallel (tensor=2, expert=4 on 8 devices, expert-parallel MoE):
    the cache is sharded by the same rules, the tokens are those of one device."""
    config = loading.default_runtime_config()
    config.mesh.update(data=1, fsdp=1, tensor=2, expert=4)
    config.moe_impl = "sharded"
    sharded = Engine.from_checkpoint(
        hf_dir, config=config, dtype="float32", compilation_cache=False, **OPTIONS
    )
    assert sharded.model.params["blocks"]["full"]["moe"]["wi_gate"].sharding.spec[1] == "expert"
    cache_spec = sharded._loop.cache["full"].k.sharding.spec  # [layers, slots, pos, heads, dim]
    assert "expert" in cache_spec[1] and cache_spec[3] == "tensor"
    prompts = _prompts(9, [3, 20, 41])
    params = RequestParams(max_tokens=6)
    with sharded:
        got = sharded.generate(prompts, params)
    _assert_same(
        got, [dict(tokens=c.tokens, logprobs=c.logprobs) for c in engine.generate(prompts, params)]
    )
