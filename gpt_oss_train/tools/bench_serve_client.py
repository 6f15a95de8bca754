"""The client side of bench_serve.py: concurrent streamed completions against an
OpenAI-compatible server on localhost, their timings, and the table and plot."""

from __future__ import annotations

import http.client
import json
import queue
import threading
import time
import urllib.parse

import numpy as np


def stream_completion(url: str, model: str, prompt: str, max_tokens: int) -> dict:
    """One streamed greedy completion: send time, chunk arrival times, completion tokens."""
    u = urllib.parse.urlparse(url)
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=3600)
    start = time.perf_counter()
    conn.request("POST", u.path, json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        raise RuntimeError(f"{url}: HTTP {r.status}: {r.read()[:300]!r}")
    times, tokens = [], 0
    for line in r:
        if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
            continue
        chunk = json.loads(line[6:])
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        # a token whose text is empty so far (part of a character) still counts; our
        # server sends its ids, other servers their text
        if any(c.get("text") or c.get("token_ids") for c in chunk.get("choices", [])):
            times.append(time.perf_counter())
    conn.close()
    return {"start": start, "times": times, "tokens": tokens or len(times)}


def run_level(url: str, model: str, reqs: list[dict], concurrency: int) -> dict:
    """`concurrency` clients take requests from one queue until it is empty."""
    todo: queue.Queue = queue.Queue()
    for r in reqs:
        todo.put(r)
    results, errors = [], []

    def client():
        while True:
            try:
                r = todo.get_nowait()
            except queue.Empty:
                return
            try:
                results.append(stream_completion(url, model, r["prompt"], r["max_tokens"]))
            except Exception as e:  # noqa: BLE001 - reported, not hidden
                errors.append(repr(e))

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, e.g. {errors[0]}")
    return summarize(results, wall)


def summarize(results: list[dict], wall: float) -> dict:
    ttft = [r["times"][0] - r["start"] for r in results if r["times"]]
    itl = [b - a for r in results for a, b in zip(r["times"], r["times"][1:])]
    pct = lambda xs, q: float(np.percentile(xs, q)) if xs else float("nan")
    return {
        "requests": len(results),
        "wall_s": wall,
        "output_tok_s": sum(r["tokens"] for r in results) / wall,
        "requests_s": len(results) / wall,
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p99_s": pct(ttft, 99),
        "itl_p50_s": pct(itl, 50),
        "itl_p99_s": pct(itl, 99),
    }


def prefix_cache_ttft(url: str, model: str, reqs: list[dict], repeats: int = 3) -> dict:
    """TTFT of a ~1,000-token prompt seen for the first time, against the same 1,000-token
    prefix with a new ending (served from the prefix cache); medians over `repeats`."""
    cold, warm = [], []
    for i in range(repeats):
        words = " ".join(r["prompt"] for r in reqs[i * 8 : i * 8 + 8]).split()
        prefix = " " + " ".join(words[:1000])
        for out, ending in ((cold, " alpha beta"), (warm, " gamma delta")):
            r = stream_completion(url, model, prefix + ending, 1)
            out.append(r["times"][0] - r["start"])
    return {
        "prefix_ttft_uncached_s": float(np.median(cold)),
        "prefix_ttft_cached_s": float(np.median(warm)),
    }


def counters(url: str) -> dict:
    """Our server's Prometheus counters (name -> value); {} for a server without them."""
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request("GET", "/metrics")
    r = conn.getresponse()
    text = r.read().decode() if r.status == 200 else ""
    conn.close()
    out = {}
    for line in text.splitlines():
        if line.startswith("gpt_oss_") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def step_profile(before: dict, after: dict, wall: float) -> dict:
    """What the engine's steps did during a run: tokens per decode step (busy slots), and
    the wall time per step (decode and prefill steps together)."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    steps = d.get("gpt_oss_engine_decode_steps_total", 0.0)
    chunks = d.get("gpt_oss_engine_prefill_chunks_total", 0.0)
    if not steps:
        return {}
    return {
        "decode_steps": steps,
        "prefill_chunks": chunks,
        "tokens_per_decode_step": d.get("gpt_oss_generation_tokens_total", 0.0) / steps,
        "ms_per_step": 1e3 * wall / (steps + chunks),
    }


def fmt(row: dict) -> str:
    return (
        f"{row['output_tok_s']:.1f} tok/s, {row['requests_s']:.2f} req/s, TTFT p50/p99 "
        f"{row['ttft_p50_s'] * 1e3:.0f}/{row['ttft_p99_s'] * 1e3:.0f} ms, ITL p50/p99 "
        f"{row['itl_p50_s'] * 1e3:.0f}/{row['itl_p99_s'] * 1e3:.0f} ms"
    )


def markdown(results: dict, levels: list[int]) -> str:
    lines = [
        "| system | concurrency | output tok/s | req/s | TTFT p50 / p99 (ms) "
        "| ITL p50 / p99 (ms) |",
        "|---|---|---|---|---|---|",
    ]
    for name, sys_res in results["systems"].items():
        for c in levels:
            r = sys_res["levels"][c]
            lines.append(
                f"| {name} | {c} | {r['output_tok_s']:.1f} | {r['requests_s']:.2f} | "
                f"{r['ttft_p50_s'] * 1e3:.0f} / {r['ttft_p99_s'] * 1e3:.0f} | "
                f"{r['itl_p50_s'] * 1e3:.0f} / {r['itl_p99_s'] * 1e3:.0f} |"
            )
    s = results["static"]
    lines.append(
        f"| decode static batch ({s['rows']} rows) | - | {s['useful_tok_s']:.1f} useful "
        f"({s['computed_tok_s']:.1f} computed) | - | - | - |"
    )
    return "\n".join(lines)


def plot(results: dict, levels: list[int], path: str) -> None:
    import matplotlib  # lazy: optional dependency (the `bench` extra; ~0.3 s to import)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: after the backend is chosen

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for name, sys_res in results["systems"].items():
        rows = [sys_res["levels"][c] for c in levels]
        axes[0].plot(levels, [r["output_tok_s"] for r in rows], "o-", label=name)
        axes[1].plot(levels, [r["ttft_p99_s"] for r in rows], "o-", label=name)
        axes[2].plot(levels, [r["itl_p99_s"] * 1e3 for r in rows], "o-", label=name)
    axes[0].axhline(results["static"]["useful_tok_s"], ls="--", c="gray", label="static batch")
    titles = ("output tokens/s", "time to first token p99 (s)", "inter-token latency p99 (ms)")
    for ax, title in zip(axes, titles):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("concurrent clients")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[1].set_yscale("log")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
