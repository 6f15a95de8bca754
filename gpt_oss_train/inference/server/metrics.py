"""Prometheus metrics of the server, in the text format `GET /metrics` returns.

Counted by the HTTP layer as requests pass through it: requests by endpoint and status,
prompt and generated tokens, time to first token and inter-token latency (seconds, from
the request's arrival as the client sees them). Read from the engine at scrape time:
queue depth, busy decode slots, and the engine's step and prefix-cache counters.
"""

from __future__ import annotations

import time
from typing import Callable

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "gpt_oss"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# No `*_created` series next to each counter: they double the output and nobody graphs them.
prometheus_client.disable_created_metrics()


# The engine's own counters: how much prompt work the prefix cache saved, and how full
# each compiled step ran (generated tokens / decode steps = slots busy per step).
_ENGINE_COUNTERS = (
    ("prefill_tokens", "Prompt tokens computed (not taken from the prefix cache)."),
    ("cached_prompt_tokens", "Prompt tokens restored from the prefix cache."),
    ("decode_steps", "Compiled decode steps run."),
    ("prefill_chunks", "Compiled prefill chunks run."),
    ("prefix_cache_hits", "Requests that reused a cached prefix."),
)


class _EngineGauges:
    """Reads the engine's live numbers when Prometheus scrapes."""

    def __init__(self, stats: Callable[[], dict]):
        self._stats = stats

    def collect(self):
        s = self._stats()
        for name, key, doc in (
            ("queue_depth", "queue_depth", "Requests waiting for a decode slot."),
            ("running_slots", "running", "Decode slots serving a request."),
            ("max_slots", "max_slots", "Decode slots in all."),
        ):
            if key in s:
                yield GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=float(s[key]))
        for key, doc in _ENGINE_COUNTERS:
            if key in s:
                yield CounterMetricFamily(f"{PREFIX}_engine_{key}", doc, value=float(s[key]))


class Metrics:
    def __init__(self, engine_stats: Callable[[], dict]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            f"{PREFIX}_requests", "Finished requests.", ["endpoint", "status"], registry=r
        )
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens.", registry=r)
        self.generation_tokens = Counter(
            f"{PREFIX}_generation_tokens", "Generated tokens.", registry=r
        )
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "From a request's arrival to its first generated token.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            f"{PREFIX}_inter_token_latency_seconds",
            "Between consecutive generated tokens of a request.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        r.register(_EngineGauges(engine_stats))

    def text(self) -> bytes:
        return generate_latest(self.registry)


class TokenClock:
    """Times one choice's tokens into the histograms."""

    def __init__(self, metrics: Metrics, start: float):
        self._metrics, self._last = metrics, start
        self._first = True

    def tick(self) -> None:
        now = time.perf_counter()
        (self._metrics.ttft if self._first else self._metrics.itl).observe(now - self._last)
        self._metrics.generation_tokens.inc()
        self._first, self._last = False, now
