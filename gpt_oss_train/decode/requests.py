"""The JSONL modes of `decode`: `generate` (one completion per request line) and
`score` (per-token log-probabilities of given text), plus `--data` evaluation.

Each input line is parsed on its own: a line that cannot run becomes an
{"index", "error"} record and the others still run. See cli.py for the formats.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from typing import Any, Iterable

import jax
import numpy as np
from absl import logging

from gpt_oss_train import sharding
from gpt_oss_train.errors import json_error
from gpt_oss_train.inference import scoring
from gpt_oss_train.inference.adapters import UnknownAdapter, adapter_slot
from gpt_oss_train.inference.generate import Generator, cache_length
from gpt_oss_train.inference.loading import (
    TEXT_STOP_IDS,
    DecodeError,
    LoadedModel,
    Options,
    batch_rows,
    cache_limit,
    completion_text,
    prefill_chunk_for,
    stop_slots,
    tokenizer,
)
from gpt_oss_train.inference.scoring import score_batch
from gpt_oss_train.io import tokenizer as tok_lib
from gpt_oss_train.training import data as data_lib
from gpt_oss_train.training import evaluate as evaluate_lib
from gpt_oss_train.training import steps


class LineError(ValueError):
    """One input line that cannot run; the others still do."""


@dataclasses.dataclass(frozen=True)
class Request:
    index: int
    kind: str  # "tokens" | "prompt" | "messages"
    prompt: tuple[int, ...]
    stop_ids: tuple[int, ...]
    max_new_tokens: int
    seed: int
    adapter: int = 0  # the stacked adapter slot it uses (0: none; see inference/adapters.py)


def _load_line(raw: bytes) -> dict:
    try:
        obj = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise LineError(f"not valid UTF-8 ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise LineError(json_error(e)) from None
    if not isinstance(obj, dict):
        raise LineError(f"expected a JSON object, got {type(obj).__name__}")
    return obj


def _int(obj: dict, key: str, default: int, lo: int, hi: int | None = None) -> int:
    v = obj.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v >= hi):
        bound = f"[{lo}, {hi})" if hi is not None else f">= {lo}"
        raise LineError(f'"{key}" must be an integer {bound}, got {v!r}')
    return v


def _check_ids(ids: Any, what: str, vocab_size: int) -> tuple[int, ...]:
    if not isinstance(ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in ids
    ):
        raise LineError(f"{what} must be a list of integer token ids")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise LineError(
            f"{what} has ids {bad[:3]} outside this model's vocabulary [0, {vocab_size})"
        )
    return tuple(ids)


def _text_ids(text: Any, key: str, vocab_size: int) -> tuple[int, ...]:
    if not isinstance(text, str):
        raise LineError(f'"{key}" must be a string, got {type(text).__name__}')
    if not text:
        raise LineError(f'empty "{key}"')
    ids = tokenizer().encode(text)
    if max(ids) >= vocab_size:  # a test model with a toy vocabulary cannot read real text
        raise LineError(
            f"this model's vocabulary has {vocab_size} ids; text needs the "
            f"o200k_harmony vocabulary ({tok_lib.VOCAB_SIZE})"
        )
    return tuple(ids)


def parse_generate_line(
    index: int,
    raw: bytes,
    *,
    vocab_size: int,
    limit: int,
    opts: Options,
    adapters: tuple[str, ...] = (),
    stacked: bool = False,
) -> Request:
    """One input line -> a Request, or LineError saying what is wrong with it."""
    obj = _load_line(raw)
    given = [k for k in ("tokens", "prompt", "messages") if k in obj]
    if len(given) != 1:
        raise LineError(
            'give exactly one of "tokens", "prompt" or "messages"'
            + (f" (got {given})" if given else "")
        )
    kind = given[0]
    if kind == "tokens":
        prompt = _check_ids(obj["tokens"], '"tokens"', vocab_size)
        if not prompt:
            raise LineError('empty "tokens"')
        stop_ids = TEXT_STOP_IDS
    elif kind == "prompt":
        prompt, stop_ids = _text_ids(obj["prompt"], "prompt", vocab_size), TEXT_STOP_IDS
    else:
        try:
            prompt = tuple(tokenizer().render_chat(obj["messages"], opts.reasoning_effort))
        except ValueError as e:
            raise LineError(f'"messages": {e}') from None
        if max(prompt) >= vocab_size:
            raise LineError(
                f"this model's vocabulary has {vocab_size} ids; chats need the "
                f"o200k_harmony vocabulary ({tok_lib.VOCAB_SIZE})"
            )
        stop_ids = tuple(sorted(tok_lib.Tokenizer.stop_ids))
    if "stop_ids" in obj:
        stop_ids = tuple(sorted(set(_check_ids(obj["stop_ids"], '"stop_ids"', vocab_size))))
    max_new = _int(obj, "max_new_tokens", opts.max_new_tokens, 1)
    seed = _int(obj, "seed", (opts.seed + index) % 2**32, 0, 2**32)
    if len(prompt) + 1 > limit:
        raise LineError(
            f"the prompt has {len(prompt)} tokens but the cache holds {limit} "
            "positions (--max_cache_len, else the model's max_position_embeddings) "
            "and at least one generated token must fit"
        )
    try:
        slot = adapter_slot(obj.get("adapter"), adapters, stacked)
    except UnknownAdapter as e:
        raise LineError(str(e)) from None
    return Request(index, kind, prompt, stop_ids, max_new, seed, slot)


def json_safe(obj):
    """`obj` with every non-finite float replaced by None: a model whose weights overflow
    gives NaN log-probabilities, and bare NaN is not JSON (json.dumps writes it anyway)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def perplexity(mean_nll: float) -> float:
    """exp(mean_nll); inf where it overflows (a float, then null in JSON)."""
    try:
        return math.exp(mean_nll)
    except OverflowError:
        return math.inf


def error_record(index: int, message: str) -> dict:
    msg = f"line {index + 1}: {message}"
    logging.warning("%s", msg)
    return {"index": index, "error": msg}


def _parse_lines(data: bytes, parse) -> tuple[dict[int, dict], list[tuple[int, Any]]]:
    """parse(index, raw line) over the non-blank lines: ({index: error record} for the
    lines it refused, [(index, parsed)] for the others)."""
    errors, parsed = {}, []
    for i, raw in enumerate(data.split(b"\n")):
        if not raw.strip():
            continue
        try:
            parsed.append((i, parse(i, raw)))
        except LineError as e:
            errors[i] = error_record(i, str(e))
    return errors, parsed


def _batches(requests: list[Request], batch_size: int) -> Iterable[list[Request]]:
    """Requests with the same settings together, similar lengths in one batch (less
    padding); output order is restored by index."""
    groups: dict[tuple, list[Request]] = {}
    for r in requests:
        groups.setdefault((r.max_new_tokens, r.stop_ids), []).append(r)
    for group in groups.values():
        group.sort(key=lambda r: len(r.prompt))
        for i in range(0, len(group), batch_size):
            yield group[i : i + batch_size]


def _generate_batch(
    gen: Generator, model: LoadedModel, batch: list[Request], limit: int, opts: Options
) -> list[dict]:
    rows = batch_rows(len(batch), opts.batch_size)
    # Padding rows repeat the first request, so they stop when it does.
    prompts = [r.prompt for r in batch] + [batch[0].prompt] * (rows - len(batch))
    seeds = [r.seed for r in batch] + [batch[0].seed] * (rows - len(batch))
    adapter_ids = [r.adapter for r in batch] + [batch[0].adapter] * (rows - len(batch))
    max_new = batch[0].max_new_tokens
    max_len = min(cache_length(max(map(len, prompts)) + max_new), limit)
    start = time.perf_counter()
    with model.scope():
        cache, last, lengths = gen.prefill(prompts, max_len, adapter_ids)
        jax.block_until_ready(last)
        prefill_s = time.perf_counter() - start
        outs = gen.decode(
            cache,
            last,
            lengths,
            max_len=max_len,
            max_new_tokens=max_new,
            stop_ids=stop_slots(batch[0].stop_ids),
            sampling=opts.sampling,
            seeds=seeds,
            adapter_ids=adapter_ids,
        )
    total_s = time.perf_counter() - start
    records = []
    for r, out in zip(batch, outs):
        rec = {
            "index": r.index,
            "tokens": out["tokens"],
            "logprobs": out["logprobs"],
            "text": completion_text(out["tokens"], out["stop_reason"]),
        }
        if r.kind == "messages":
            rec["messages"] = tokenizer().parse_completion(out["tokens"])
        rec["stop_reason"] = out["stop_reason"]
        rec["timing"] = {
            "prefill_s": prefill_s,
            "total_s": total_s,
            "tokens_per_s": len(out["tokens"]) / total_s,
            "batch_rows": rows,
        }
        records.append(rec)
    return records


def run_generate(model: LoadedModel, data: bytes, opts: Options) -> list[dict]:
    """Every non-blank line of a JSONL file -> its output record, in input order."""
    limit, vocab = cache_limit(model.cfg.max_position_embeddings, opts), model.cfg.vocab_size
    stacked = model.cfg.lora is not None and model.cfg.lora.adapters > 0
    parse = lambda i, raw: parse_generate_line(
        i, raw, vocab_size=vocab, limit=limit, opts=opts, adapters=model.adapters, stacked=stacked
    )
    results, parsed = _parse_lines(data, parse)
    requests = [r for _, r in parsed]
    if requests:
        chunk = prefill_chunk_for(opts.prefill_chunk, max(len(r.prompt) for r in requests))
        gen = model.generator(chunk, opts.int8_kv_cache)
        for batch in _batches(requests, opts.batch_size):
            for rec in _generate_batch(gen, model, batch, limit, opts):
                results[rec["index"]] = rec
            logging.info(
                "generated %d/%d lines", sum("tokens" in r for r in results.values()), len(requests)
            )
    return [results[i] for i in sorted(results)]


def exit_code(records: list[dict]) -> int:
    """0 if any line succeeded (or there were none), 1 if every line failed."""
    return 1 if records and all("error" in r for r in records) else 0


def parse_score_line(raw: bytes, *, vocab_size: int, limit: int) -> tuple[int, ...]:
    obj = _load_line(raw)
    given = [k for k in ("tokens", "text") if k in obj]
    if len(given) != 1:
        raise LineError(
            'give exactly one of "tokens" or "text"' + (f" (got {given})" if given else "")
        )
    if given[0] == "tokens":
        ids = _check_ids(obj["tokens"], '"tokens"', vocab_size)
    else:
        ids = _text_ids(obj["text"], "text", vocab_size)
    if len(ids) < 2:
        raise LineError(
            f"scoring needs at least 2 tokens (the first is context only), got {len(ids)}"
        )
    if len(ids) > limit:
        raise LineError(
            f"{len(ids)} tokens exceed the {limit} positions this model may use "
            "(--max_cache_len, else max_position_embeddings)"
        )
    return ids


def run_score(model: LoadedModel, data: bytes, opts: Options) -> list[dict]:
    limit, vocab = cache_limit(model.cfg.max_position_embeddings, opts), model.cfg.vocab_size
    parse = lambda i, raw: parse_score_line(raw, vocab_size=vocab, limit=limit)
    results, todo = _parse_lines(data, parse)
    todo.sort(key=lambda x: len(x[1]))
    fn = scoring.job(model, "score")
    for start in range(0, len(todo), opts.batch_size):
        batch = todo[start : start + opts.batch_size]
        rows = batch_rows(len(batch), opts.batch_size)
        for (i, ids), logp in zip(batch, score_batch(model, fn, [s for _, s in batch], rows)):
            total = float(np.sum(logp, dtype=np.float64))
            results[i] = {
                "index": i,
                "num_tokens": len(ids),
                "logprobs": logp.tolist(),
                "sum_logprob": total,
                "perplexity": perplexity(-total / len(logp)),
            }
    return [results[i] for i in sorted(results)]


def evaluate_data(
    model: LoadedModel, spec: str, *, num_batches: int, batch_size: int, seq_len: int, seed: int = 0
) -> dict:
    """Mean next-token loss over the first num_batches batches of a source's eval split
    (one pass, no shuffling: the same batches every run), by training's eval step and loop."""
    divisor = sharding.batch_divisor(model.mesh, model.rules)
    if batch_size % divisor:
        raise DecodeError(
            f"--batch_size={batch_size} must be a multiple of {divisor}, the "
            "number of batch shards of the mesh"
        )
    if seq_len > model.cfg.max_position_embeddings:
        raise DecodeError(
            f"--seq_len={seq_len} exceeds the model's max_position_embeddings="
            f"{model.cfg.max_position_embeddings}"
        )
    try:
        pipeline = evaluate_lib.eval_pipeline(
            spec, seq_len=seq_len, batch_size=batch_size, seed=seed, num_epochs=1
        )
    except data_lib.DataError as e:
        raise DecodeError(f"--data={spec}: {e}") from None
    step = model.kept(
        "eval_step",
        lambda: jax.jit(steps.make_eval_step(model.md, model.config.train, objective="lm")),
    )
    with model.scope():
        batches = evaluate_lib.take(pipeline, num_batches)
        result = evaluate_lib.eval_loss(
            step, model.params, batches, model.mesh, model.rules, whole=pipeline.whole_batches
        )
    if not result["tokens"]:
        raise DecodeError(f"--data={spec}: the eval split gave no tokens to score")
    return {
        "source": spec,
        "split": "eval",
        **result,
        "perplexity": perplexity(result["loss"]),
    }
