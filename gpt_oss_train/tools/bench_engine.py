"""Engine-level serving benchmark on random weights (no HTTP): continuous batching
against a static batch of the same requests, time to first token under load, a running
stream's inter-token latency while a long prompt is prefilled, and prefix-cache reuse.

    python -m gpt_oss_train.tools.bench_engine --config=configs/cpu_serve.py [--concurrency=1,4,16]

  throughput   at each concurrency C: C closed-loop clients send --requests_per_client
               requests each (prompt lengths uniform in [--prompt_min, --prompt_max],
               seeded; --max_tokens greedy tokens, no stop ids) through one Engine of
               --max_slots slots. The same requests in static batches of C through the
               Generator (decode --mode=generate's path, padded, one compiled loop) are
               the upper bound. Output tokens/s of both, TTFT p50/p99, ITL p50/p99.
  long prompt  one stream decodes while a --long_prompt-token prompt arrives: its
               inter-token gaps before and while the prompt is prefilled chunk by chunk.
  prefix       TTFT of a request whose --prefix_tokens-token prefix is cached vs the same
               shape uncached (medians of --repeats pairs, each with a fresh prefix).

Every timed run follows a warm-up (the engine compiles all shapes in start(); the
Generator is run once per batch size). Prints one JSON line per measurement.
"""

from __future__ import annotations

import json
import statistics
import threading
import time

import jax
import numpy as np
from absl import app, flags, logging

from gpt_oss_train import errors, runtime, sharding
from gpt_oss_train.inference import loading
from gpt_oss_train.inference.engine import Engine, RequestParams

_CONFIG = errors.define_config_flag("config", "configs/cpu_serve.py", "Model config.")
_CONCURRENCY = flags.DEFINE_list("concurrency", ["1", "4", "16"], "Client counts.")
_PER_CLIENT = flags.DEFINE_integer("requests_per_client", 2, "Requests each client sends.")
_PROMPT_MIN = flags.DEFINE_integer("prompt_min", 32, "Shortest prompt.")
_PROMPT_MAX = flags.DEFINE_integer("prompt_max", 256, "Longest prompt.")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 64, "Tokens generated per request.")
_MAX_SLOTS = flags.DEFINE_integer("max_slots", 16, "Engine decode slots.")
_MAX_CONTEXT = flags.DEFINE_integer("max_context", 2048, "Engine positions per slot.")
_CHUNK = flags.DEFINE_integer("prefill_chunk", 256, "Prefill chunk (engine and Generator).")
_LONG = flags.DEFINE_integer("long_prompt", 1024, "Prompt of the long-prompt run (0: skip).")
_PREFIX = flags.DEFINE_integer("prefix_tokens", 1000, "Cached prefix length (0: skip).")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Pairs in the prefix run.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the request lengths and prompts.")
_SKIP_STATIC = flags.DEFINE_bool("skip_static", False, "Skip the static-batch baseline.")


def _emit(record: dict):
    print(json.dumps(record), flush=True)


def _pct(xs, q):
    return float(np.percentile(xs, q)) if len(xs) else float("nan")


def _requests(vocab: int, n: int, seed: int) -> list[list[int]]:
    rng = np.random.RandomState(seed)
    lengths = rng.randint(_PROMPT_MIN.value, _PROMPT_MAX.value + 1, n)
    return [rng.randint(0, vocab, k).tolist() for k in lengths]


def _closed_loop(engine, prompts: list[list[int]], clients: int, params) -> dict:
    """`clients` threads, each sending its share of `prompts` one after the other."""
    out, lock = [], threading.Lock()

    def client(mine):
        for p in mine:
            c = engine.submit(p, params).result()
            with lock:
                out.append(c)

    threads = [threading.Thread(target=client, args=(prompts[i::clients],)) for i in range(clients)]
    before = engine.stats()["itl_s"]["count"]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    itl = engine.stats()["itl_s"]["samples"][-(engine.stats()["itl_s"]["count"] - before) :]
    ttft = [c.ttft_s for c in out]
    return dict(
        engine_tok_s=sum(len(c.tokens) for c in out) / wall,
        ttft_p50_ms=1e3 * _pct(ttft, 50),
        ttft_p99_ms=1e3 * _pct(ttft, 99),
        itl_p50_ms=1e3 * _pct(itl, 50),
        itl_p99_ms=1e3 * _pct(itl, 99),
        requests=len(out),
    )


def _static(model, prompts, batch: int, max_tokens: int) -> float:
    """Output tokens/s of the prompts in static batches through the Generator."""
    gen = model.generator(_CHUNK.value, False)

    def run():
        with model.scope():
            for i in range(0, len(prompts), batch):
                gen.generate(prompts[i : i + batch], max_new_tokens=max_tokens, stop_ids=[])

    run()  # compiles
    t0 = time.perf_counter()
    run()
    return len(prompts) * max_tokens / (time.perf_counter() - t0)


def bench_throughput(engine, model):
    params = RequestParams(max_tokens=_MAX_TOKENS.value)
    for c in [int(x) for x in _CONCURRENCY.value]:
        prompts = _requests(model.cfg.vocab_size, c * _PER_CLIENT.value, _SEED.value + c)
        record = dict(run="throughput", concurrency=c, **_closed_loop(engine, prompts, c, params))
        if not _SKIP_STATIC.value:
            record["static_tok_s"] = _static(model, prompts, c, _MAX_TOKENS.value)
            record["engine_vs_static"] = record["engine_tok_s"] / record["static_tok_s"]
        _emit(record)


def bench_long_prompt(engine, vocab: int):
    """A stream's gaps between tokens before and while a long prompt is prefilled."""
    rng = np.random.RandomState(_SEED.value + 1)
    stream = engine.submit(rng.randint(0, vocab, 32).tolist(), RequestParams(max_tokens=400))
    times, long_handle, long_sent = [], None, None
    for i, _ in enumerate(stream):
        times.append(time.perf_counter())
        if i == 20:
            long_sent = time.perf_counter()
            long_prompt = rng.randint(0, vocab, _LONG.value).tolist()
            long_handle = engine.submit(long_prompt, RequestParams(max_tokens=1))
        if long_handle is not None and long_handle.done and len(times) > 40:
            stream.cancel()
    long_done = long_sent + long_handle.result().ttft_s
    gaps = np.diff(times)
    before = gaps[: 20 - 1]
    during = [g for t, g in zip(times[1:], gaps) if long_sent < t <= long_done + 1e-3]
    _emit(
        dict(
            run="long_prompt",
            long_prompt=_LONG.value,
            chunk=_CHUNK.value,
            itl_before_p50_ms=1e3 * float(np.median(before)),
            itl_during_max_ms=1e3 * float(np.max(during)) if during else None,
            tokens_during=len(during),
            long_ttft_ms=1e3 * long_handle.result().ttft_s,
        )
    )


def bench_prefix(engine, vocab: int):
    rng = np.random.RandomState(_SEED.value + 2)
    params = RequestParams(max_tokens=1)
    cold, warm, cached = [], [], []
    for _ in range(_REPEATS.value):
        prefix = rng.randint(0, vocab, _PREFIX.value).tolist()
        tails = [rng.randint(0, vocab, 24).tolist() for _ in range(2)]
        first = engine.submit(prefix + tails[0], params).result()
        second = engine.submit(prefix + tails[1], params).result()
        cold.append(first.ttft_s)
        warm.append(second.ttft_s)
        cached.append(second.cached_prompt_tokens)
    _emit(
        dict(
            run="prefix",
            prefix_tokens=_PREFIX.value,
            uncached_ttft_ms=1e3 * statistics.median(cold),
            cached_ttft_ms=1e3 * statistics.median(warm),
            ratio=statistics.median(warm) / statistics.median(cold),
            cached_prompt_tokens=cached,
        )
    )


def main(argv):
    del argv
    logging.set_verbosity(logging.INFO)
    runtime.setup_process(sharding.platform())
    model = loading.random_model(_CONFIG.value, devices=jax.devices()[:1])
    engine = Engine.from_model(
        model,
        max_slots=_MAX_SLOTS.value,
        max_context=_MAX_CONTEXT.value,
        prefill_chunk=_CHUNK.value,
    )
    _emit(dict(run="memory", device=jax.devices()[0].device_kind, **engine.memory))
    t0 = time.perf_counter()
    engine.start()
    _emit(dict(run="start", compile_and_warm_s=time.perf_counter() - t0))
    bench_throughput(engine, model)
    if _LONG.value:
        bench_long_prompt(engine, model.cfg.vocab_size)
    if _PREFIX.value:
        bench_prefix(engine, model.cfg.vocab_size)
    engine.stop()


if __name__ == "__main__":
    app.run(main, flags_parser=errors.parse_flags)
