"""Decode throughput: time to first token, prefill and decode tokens/s, and the same
for transformers' `generate` on the same weights in the same run.

Used by `decode --mode=benchmark` (a checkpoint) and `tools/bench_model.py --mode=decode`
(random weights of any shape). Every figure is a median over repeats after a warm-up
that compiles; decode is timed apart from prefill. `summarize_trace` reads a JAX
profiler trace of such a run: where the device time went, kernel by kernel.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import statistics
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from gpt_oss_train.inference.generate import cache_length
from gpt_oss_train.inference.loading import DecodeError, cache_limit, prefill_chunk_for


def benchmark_prompts(vocab_size: int, batch: int, length: int, seed: int) -> list[list[int]]:
    return np.random.RandomState(seed).randint(0, vocab_size, (batch, length)).tolist()


def _median_ms(xs):
    return 1000 * statistics.median(xs)


def benchmark(
    model,
    *,
    batch_sizes: Sequence[int],
    prompt_lengths: Sequence[int],
    max_new_tokens: int,
    repeats: int,
    opts,
) -> list[dict]:
    """Per (batch, prompt length): after one warm-up (compilation), the medians over
    `repeats` runs of time to first token, prefill tokens/s and decode tokens/s.
    `model` is a loading.LoadedModel, `opts` loading.Options."""

    limit = cache_limit(model.cfg.max_position_embeddings, opts)
    md = model.md
    # Greedy first token from the prompt's last hidden state: the time to first token is
    # prefill + this, without the decode loop's feeding of that token back.
    first_token = jax.jit(lambda p, h: jnp.argmax(md.bind(p).logits(h[:, None])[:, 0], -1))
    rows = []
    for length in prompt_lengths:
        max_len = cache_length(length + max_new_tokens)
        if max_len > limit:
            raise DecodeError(
                f"--prompt_lengths={length} with --max_new_tokens={max_new_tokens} "
                f"needs a cache of {max_len}, over the limit of {limit}"
            )
        gen = model.generator(prefill_chunk_for(opts.prefill_chunk, length), opts.int8_kv_cache)
        for batch in batch_sizes:
            prompts = benchmark_prompts(model.cfg.vocab_size, batch, length, opts.seed)

            def once():
                t0 = time.perf_counter()
                cache, last, lengths = gen.prefill(prompts, max_len)
                jax.block_until_ready(last)
                t1 = time.perf_counter()
                jax.block_until_ready(first_token(model.params, last))
                t2 = time.perf_counter()
                outs = gen.decode(
                    cache,
                    last,
                    lengths,
                    max_len=max_len,
                    max_new_tokens=max_new_tokens,
                    stop_ids=[],
                )
                t3 = time.perf_counter()
                assert all(len(o["tokens"]) == max_new_tokens for o in outs)
                return t1 - t0, t2 - t0, t3 - t2

            with model.scope():
                once()  # compiles
                prefill, ttft, dec = zip(*[once() for _ in range(repeats)])
            rows.append(
                {
                    "batch": batch,
                    "prompt_len": length,
                    "new_tokens": max_new_tokens,
                    "ttft_ms": _median_ms(ttft),
                    "prefill_tok_s": batch * length / statistics.median(prefill),
                    "decode_tok_s": batch * max_new_tokens / statistics.median(dec),
                }
            )
            logging.info("benchmark %s", rows[-1])
    return rows


def hf_benchmark(
    path: str,
    cases: Sequence[tuple[int, int, list[list[int]]]],
    *,
    dtype: str,
    max_new_tokens: int,
    repeats: int,
) -> list[dict]:
    """transformers' GptOssForCausalLM.generate, greedy, on (batch, length, prompts) cases:
    time to first token = generate(1 token); decode tokens/s from the time the other
    max_new_tokens - 1 tokens add."""
    # lazy: start-up (torch and transformers take seconds; only --compare_hf uses them)
    import torch
    import transformers

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    model = transformers.GptOssForCausalLM.from_pretrained(path, dtype=torch_dtype).eval()
    logging.info(
        "transformers %s, attention %s, %d torch threads",
        transformers.__version__,
        model.config._attn_implementation,
        torch.get_num_threads(),
    )

    def run(ids, n):
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )
        assert out.shape[1] == ids.shape[1] + n
        return time.perf_counter() - t0

    rows = []
    for batch, length, prompts in cases:
        ids = torch.tensor(prompts, dtype=torch.long)
        run(ids, 1)  # warm-up
        run(ids, max_new_tokens)
        one, full = zip(*[(run(ids, 1), run(ids, max_new_tokens)) for _ in range(repeats)])
        decode_s = max(statistics.median(full) - statistics.median(one), 1e-9)
        rows.append(
            {
                "batch": batch,
                "prompt_len": length,
                "hf_ttft_ms": _median_ms(one),
                "hf_decode_tok_s": batch * (max_new_tokens - 1) / decode_s,
            }
        )
        logging.info("hf benchmark %s", rows[-1])
    return rows


BENCH_COLUMNS = (
    "batch",
    "prompt_len",
    "new_tokens",
    "ttft_ms",
    "prefill_tok_s",
    "decode_tok_s",
    "hf_ttft_ms",
    "hf_decode_tok_s",
)


def format_table(rows: list[dict]) -> str:
    cols = [c for c in BENCH_COLUMNS if any(c in r for r in rows)]
    cell = lambda v: "-" if v is None else f"{v:.1f}" if isinstance(v, float) else str(v)
    table = [cols] + [[cell(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in table)


def _device_events(events) -> list[dict]:
    names = {
        e["pid"]: e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    device_pids = {pid for pid, name in names.items() if name.startswith("/device:")}
    return [e for e in events if e.get("ph") == "X" and e.get("pid") in device_pids]


def _cpu_op_events(events) -> list[dict]:
    """XLA:CPU's ops: events of its Eigen worker threads, without the executor's own
    spans (which contain the ops)."""
    threads = {
        (e["pid"], e.get("tid"))
        for e in events
        if e.get("ph") == "M"
        and e.get("name") == "thread_name"
        and "XLAEigen" in e.get("args", {}).get("name", "")
    }
    return [
        e
        for e in events
        if e.get("ph") == "X"
        and (e.get("pid"), e.get("tid")) in threads
        and not e["name"].startswith(("ThunkExecutor", "SlinkyThreadPool", "end: "))
    ]


def _self_times(events) -> list[float]:
    """Each event's duration less that of the events nested directly in it on its
    thread (a CPU `while` op's span contains its body's ops)."""
    own = [float(e.get("dur", 0.0)) for e in events]
    by_thread = collections.defaultdict(list)
    for i, e in enumerate(events):
        by_thread[(e.get("pid"), e.get("tid"))].append(i)
    for idx in by_thread.values():
        idx.sort(key=lambda i: (events[i]["ts"], -own[i]))
        open_spans = []  # indices of the events enclosing the current one
        for i in idx:
            start = events[i]["ts"]
            while open_spans and _end(events[open_spans[-1]]) <= start:
                open_spans.pop()
            if open_spans:
                own[open_spans[-1]] -= float(events[i].get("dur", 0.0))
            open_spans.append(i)
    return own


def _end(e) -> float:
    return e["ts"] + e.get("dur", 0.0)


def summarize_trace(trace_dir: str, steps: int, top: int = 15) -> dict:
    """Device time by kernel from the Perfetto trace `jax.profiler.trace` wrote: total
    busy time, kernel launches per step, and the `top` kernels by total time. Device
    events are those of processes named /device:... (GPU streams, TPU cores); a CPU run
    has none, and its XLA ops (thunks on the XLA:CPU worker threads) stand in for them,
    summed over the threads (busy time can exceed the span)."""
    paths = sorted(
        glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    )
    if not paths:
        return {"trace": trace_dir, "error": "no perfetto_trace.json.gz written"}
    with gzip.open(paths[-1]) as f:
        events = json.load(f)["traceEvents"]
    kernels = _device_events(events) or _cpu_op_events(events)
    if not kernels:
        return {"trace": paths[-1], "error": "no device or XLA:CPU op events"}
    total = collections.Counter()
    count = collections.Counter()
    for e, own in zip(kernels, _self_times(kernels)):
        total[e["name"]] += own
        count[e["name"]] += 1
    span = max(_end(e) for e in kernels) - min(e["ts"] for e in kernels)
    busy = sum(total.values())
    return {
        "trace": paths[-1],
        "device_span_ms": span / 1e3,
        "device_busy_ms": busy / 1e3,
        "busy_share": busy / span if span else None,
        "events": len(kernels),
        "events_per_step": len(kernels) / steps,
        "top": [
            {"name": n[:120], "ms": t / 1e3, "count": count[n], "share": t / busy}
            for n, t in total.most_common(top)
        ],
    }
