"""The serving engine's counters and latency histograms: what `Engine.stats()` returns
and the server's Prometheus /metrics exports.

Histograms are cumulative since start-up, in Prometheus' form (count of observations
<= each bound, sum, count), and keep the latest samples for percentiles.
"""

from __future__ import annotations

import bisect
import collections
import math
import threading

# Seconds. Time to first token includes queueing and prefill; inter-token latency is the
# gap between two tokens of one request.
TTFT_BOUNDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, math.inf)
ITL_BOUNDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, math.inf)
SAMPLES_KEPT = 10_000


class Histogram:
    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * len(bounds)
        self.sum = 0.0
        self.count = 0
        self.samples: collections.deque[float] = collections.deque(maxlen=SAMPLES_KEPT)

    def observe(self, x: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, x)] += 1
        self.sum += x
        self.count += 1
        self.samples.append(x)

    def snapshot(self) -> dict:
        cumulative, total = [], 0
        for bound, n in zip(self.bounds, self.counts):
            total += n
            cumulative.append((bound, total))
        return dict(buckets=cumulative, sum=self.sum, count=self.count, samples=list(self.samples))


class EngineStats:
    """Counters the engine's thread updates and any thread reads (under one lock)."""

    COUNTERS = (
        "prompt_tokens",  # prompt tokens of admitted requests
        "prefill_tokens",  # prompt tokens actually computed (the rest came from the cache)
        "cached_prompt_tokens",  # prompt tokens restored from the prefix cache
        "generation_tokens",  # tokens generated
        "prefill_chunks",  # compiled prefill calls
        "decode_steps",  # compiled decode calls
        "prefix_cache_hits",  # admitted requests that reused at least one cached block
        "prefix_cache_misses",
        "step_errors",  # exceptions inside a step (the requests they hit end in "error")
    )

    def __init__(self):
        self.lock = threading.Lock()
        self.counters = dict.fromkeys(self.COUNTERS, 0)
        self.finished = collections.Counter()  # by finish_reason
        self.rejected = collections.Counter()  # by HTTP status
        self.ttft = Histogram(TTFT_BOUNDS)
        self.itl = Histogram(ITL_BOUNDS)
        self.latency = Histogram(TTFT_BOUNDS)  # submit -> finish

    def add(self, **counts: int) -> None:
        with self.lock:
            for k, n in counts.items():
                self.counters[k] += n

    def finish(self, reason: str, total_s: float) -> None:
        with self.lock:
            self.finished[reason] += 1
            self.latency.observe(total_s)

    def reject(self, status: int) -> None:
        with self.lock:
            self.rejected[status] += 1

    def first_token(self, ttft_s: float) -> None:
        with self.lock:
            self.ttft.observe(ttft_s)

    def next_token(self, gap_s: float) -> None:
        with self.lock:
            self.itl.observe(gap_s)

    def mean_latency_s(self, default: float) -> float:
        with self.lock:
            n = self.latency.count
            return self.latency.sum / n if n else default

    def snapshot(self, **gauges) -> dict:
        with self.lock:
            return dict(
                gauges,
                **self.counters,
                requests={k: self.finished[k] for k in ("stop", "length", "cancelled", "error")},
                rejected=dict(self.rejected),
                ttft_s=self.ttft.snapshot(),
                itl_s=self.itl.snapshot(),
                latency_s=self.latency.snapshot(),
            )
