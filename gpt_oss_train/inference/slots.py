"""The engine's decode slots on the host: which request holds which cache row, how far
its prompt is prefilled, and the inputs of the next prefill chunk and decode step.

Shapes are rounded up to buckets so few programs are compiled: decode runs rows [0, n)
with n a power of two (requests take the lowest free slot, so n stays small at low load),
full layers attend to the first `context` cache slots (context x4 per bucket), prefill
chunks are powers of two from one prefix-cache block up to the configured chunk.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools

import numpy as np

from gpt_oss_train.inference import constraints
from gpt_oss_train.inference.handles import RequestHandle, RequestParams
from gpt_oss_train.inference.sampling import SamplingRows


def _pow2_upto(lo: int, hi: int) -> list[int]:
    """lo, 2 lo, 4 lo, ... below hi, then hi."""
    out = []
    while lo < hi:
        out.append(lo)
        lo *= 2
    return out + [hi]


def row_buckets(max_slots: int) -> list[int]:
    return _pow2_upto(1, max_slots)


def chunk_buckets(prefill_chunk: int, block: int) -> list[int]:
    return _pow2_upto(block, prefill_chunk)


def context_buckets(max_context: int, smallest: int = 256) -> list[int]:
    """max_context, a quarter of it, a sixteenth, ... while at least `smallest`."""
    out = [max_context]
    while out[0] // 4 >= smallest:
        out.insert(0, out[0] // 4)
    return out


def bucket(n: int, buckets: list[int]) -> int:
    """The smallest bucket >= n (the largest if none is)."""
    return next((b for b in buckets if b >= n), buckets[-1])


@dataclasses.dataclass(eq=False)
class Active:
    """A request holding a slot."""

    handle: RequestHandle
    params: RequestParams
    seed: int
    slot: int
    order: int  # admission order: prefill goes first come, first served
    names: list[bytes]  # prefix-cache names of the prompt's whole blocks
    adapter: int = 0  # the stacked LoRA adapter slot it runs with (0: none; adapters.py)
    cached: int = 0  # prompt positions restored from the prefix cache
    prefilled: int = 0  # prompt positions in the cache so far
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
    last_token_at: float | None = None
    # How often each token was generated so far: the frequency and presence penalties'
    # counts (kept only for a request that has a penalty; updated by `generated`).
    counts: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    walk: constraints.Walk | None = None  # where the request is in its grammar, if any

    def __post_init__(self):
        if self.params.grammar is not None:
            self.walk = constraints.Walk(self.params.grammar)

    def generated(self, token: int, logprob: float, top: list) -> None:
        """Records a sampled token; raises constraints.GrammarError if it breaks the
        request's grammar (the mask makes that a bug, never the model's choice)."""
        self.tokens.append(token)
        self.logprobs.append(logprob)
        self.top_logprobs.append(top)
        if self.params.frequency_penalty or self.params.presence_penalty:
            self.counts[token] += 1
        if self.walk is not None:
            self.walk.advance(token)

    @property
    def prompt(self) -> list[int]:
        return self.handle.prompt

    @property
    def decoding(self) -> bool:
        return bool(self.tokens)

    @property
    def position(self) -> int:
        """Where the last generated token is fed back (the next decode step's position)."""
        return len(self.prompt) + len(self.tokens) - 1

    def settings(self) -> tuple:
        p = self.params
        step = len(self.tokens)
        return (p.temperature, p.top_k, p.top_p, self.seed, step, self.adjustments(), self.walk)

    def adjustments(self) -> dict[int, float]:
        """{token: amount added to its logit} for the next draw: the request's logit_bias,
        minus, for each token generated so far (the prompt's are not counted, as in
        OpenAI's and vLLM's definition), count x frequency_penalty + presence_penalty."""
        p = self.params
        out = dict(p.logit_bias)
        for token, count in self.counts.items():
            out[token] = out.get(token, 0.0) - count * p.frequency_penalty - p.presence_penalty
        return out

    def finish_reason(self, token: int) -> str | None:
        if token in self.params.stop_ids or (self.walk is not None and self.walk.done):
            return "stop"
        return "length" if len(self.tokens) >= self.params.max_tokens else None


# The widths a batch's logit adjustments are padded to (each its own compiled program, made
# when a batch first needs it): a few tokens' bias, a long completion's penalties, ...
ADJUSTMENT_WIDTHS = (16, 128, 1024, 8192, 65536, 262144)
IDLE_ROW = (0.0, 0, 1.0, 0, 0, {}, None)  # greedy, no adjustments, no grammar


def sampling_settings(rows: list[tuple], n: int) -> SamplingRows:
    """Per-row sampling settings for n rows from Active.settings() tuples (rows beyond
    the given ones: greedy). The adjustments are padded to the smallest ADJUSTMENT_WIDTHS
    entry that holds the row with the most (0 wide when no row has any); the grammar
    masks are filled now, for each row's next token (0 words when no row has a grammar)."""
    rows = list(rows) + [IDLE_ROW] * (n - len(rows))
    cols = list(zip(*rows))
    dtypes = (np.float32, np.int32, np.float32, np.uint32, np.int32)
    arrays = [np.asarray(col, dt).reshape(n) for col, dt in zip(cols[:5], dtypes)]
    most = max((len(adj) for adj in cols[5]), default=0)
    width = 0 if most == 0 else next((w for w in ADJUSTMENT_WIDTHS if w >= most), most)
    ids, by = np.zeros((n, width), np.int32), np.zeros((n, width), np.float32)
    for i, adj in enumerate(cols[5]):
        ids[i, : len(adj)] = list(adj)
        by[i, : len(adj)] = list(adj.values())
    return SamplingRows(*arrays, ids, by, _grammar_masks(cols[6]))


def _grammar_masks(walks) -> np.ndarray:
    if all(w is None for w in walks):
        return np.zeros((len(walks), 0), np.uint32)
    allowed = np.full((len(walks), constraints.mask_words()), 0xFFFFFFFF, np.uint32)
    for row, walk in zip(allowed, walks):
        if walk is not None:
            walk.fill(row)
    return allowed


class SlotTable:
    def __init__(self, max_slots: int):
        self.max_slots = max_slots
        self._free = list(range(max_slots))
        self.active: dict[int, Active] = {}
        self._order = itertools.count()

    @property
    def free(self) -> int:
        return len(self._free)

    def take(
        self, handle: RequestHandle, params: RequestParams, seed: int, names, adapter: int = 0
    ) -> Active:
        slot = heapq.heappop(self._free)
        a = Active(handle, params, seed, slot, next(self._order), names, adapter)
        self.active[slot] = a
        return a

    def release(self, a: Active) -> None:
        if self.active.get(a.slot) is a:
            del self.active[a.slot]
            heapq.heappush(self._free, a.slot)

    def next_prefill(self) -> Active | None:
        waiting = [a for a in self.active.values() if not a.decoding]
        return min(waiting, key=lambda a: a.order, default=None)

    def decoding(self) -> list[Active]:
        return sorted((a for a in self.active.values() if a.decoding), key=lambda a: a.slot)


def next_chunk(remaining: int, chunks: list[int]) -> tuple[int, int]:
    """(chunk length, prompt tokens in it) for the next prefill call: the bucket that
    holds the rest of the prompt, unless the largest bucket the rest fills plus the one
    for what is left pads less (prefill costs the padded length: 130 tokens run as
    128 + 16, not as 256)."""
    ceil = bucket(remaining, chunks)
    if remaining >= ceil or remaining < chunks[0]:
        return ceil, min(remaining, ceil)
    floor = max(c for c in chunks if c <= remaining)
    if floor + bucket(remaining - floor, chunks) < ceil:
        return floor, floor
    return ceil, remaining


def prefill_inputs(a: Active, chunks: list[int], contexts: list[int]) -> dict:
    """The next chunk of a's prompt: tokens/positions [1, chunk] (-1 past the prompt),
    the index of its last real position, its adapter [1], and the shape buckets it runs at."""
    start, prompt = a.prefilled, a.prompt
    chunk, n = next_chunk(len(prompt) - start, chunks)
    tokens = np.zeros((1, chunk), np.int32)
    positions = np.full((1, chunk), -1, np.int32)
    tokens[0, :n] = prompt[start : start + n]
    positions[0, :n] = np.arange(start, start + n)
    return dict(
        tokens=tokens,
        positions=positions,
        last=np.int32(n - 1),
        adapter_ids=np.array([a.adapter], np.int32),
        settings=sampling_settings([a.settings()], 1),
        want_top=np.array([a.params.logprobs > 0]),
        context=bucket(start + n, contexts),
        n=n,
    )


def decode_inputs(rows: list[Active], row_sizes: list[int], contexts: list[int]) -> dict:
    """tokens/positions/adapter ids [n] of one decode step over slots [0, n) (position
    -1: the slot is idle or prefilling), with n and the context the highest slot and
    position need."""
    n = bucket(max(a.slot for a in rows) + 1, row_sizes)
    tokens = np.zeros(n, np.int32)
    positions = np.full(n, -1, np.int32)
    want_top = np.zeros(n, bool)
    adapter_ids = np.zeros(n, np.int32)
    settings = [IDLE_ROW] * n
    for a in rows:
        tokens[a.slot], positions[a.slot] = a.tokens[-1], a.position
        want_top[a.slot] = a.params.logprobs > 0
        adapter_ids[a.slot] = a.adapter
        settings[a.slot] = a.settings()
    return dict(
        tokens=tokens,
        positions=positions,
        settings=sampling_settings(settings, n),
        want_top=want_top,
        adapter_ids=adapter_ids,
        rows=n,
        context=bucket(max(a.position for a in rows) + 1, contexts),
    )
