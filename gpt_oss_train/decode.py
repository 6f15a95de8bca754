"""Use a trained or converted GPT-OSS model: generate, score, chat, benchmark.

    python -m gpt_oss_train.decode --checkpoint=DIR --mode=generate --input=in.jsonl \
        --output=out.jsonl [--config=configs/<name>.py] [--dtype=float32] ...

--checkpoint is an Orbax checkpoint written by `train` (its workdir, the checkpoints/
folder or one step folder) or by tools/convert_checkpoint.py, or a Hugging Face gpt-oss
folder (config.json + safetensors). The architecture always comes from the checkpoint;
--config only sets how to run it (mesh, dtype, moe_impl, attention_impl, ...). Without
--config the runtime is this file's `get_config()`, so `--config.mesh.tensor=2` works
with no config file too.

Modes

  generate  --input=JSONL --output=JSONL. One request per line, one of
              {"tokens": [ids]}          ids as they are
              {"prompt": "text"}         raw text continuation
              {"messages": [...]}        a Harmony chat (Tokenizer.render_chat), the
                                         model writes the next assistant turn
            optional per line: "max_new_tokens", "seed" (default --seed + index) and
            "stop_ids" (default: Tokenizer.stop_ids for chats; <|endoftext|> and them
            for tokens/prompt). Output, one line per non-blank input line, in input order:
              {"index", "tokens" (generated ids, a final stop id included), "logprobs"
               (of each generated id, temperature 1), "text" (decoded tokens without the
               final stop id), "messages" (chats: Tokenizer.parse_completion),
               "stop_reason" ("stop" | "length"), "timing": {"prefill_s", "total_s",
               "tokens_per_s", "batch_rows"}}
            prefill_s and total_s are those of the batch the line ran in (the first
            batch includes compilation); tokens_per_s is the line's tokens / total_s.
            A line that cannot run gives {"index", "error": "line N: ..."} and a
            warning; the others still run.
  score     --input=JSONL: lines {"tokens": [ids]} or {"text": "..."} (encoded with no
            end-of-text added) -> {"index", "num_tokens", "logprobs" (n-1 values,
            log p(t[i+1] | t[:i+1]), float32 logits), "sum_logprob", "perplexity"
            (exp of minus the mean)}.
            --data=SPEC (any training source): mean next-token loss and perplexity over
            --num_batches batches of --batch_size x --seq_len from its "eval" split.
  chat      Harmony chat on stdin/stdout (chat.py). /reset clears the history, /exit or
            EOF ends. The final channel streams as it is generated; analysis and
            commentary only with --show_analysis (dimmed on a terminal).
  benchmark --batch_sizes=1,4 --prompt_lengths=16,128 --max_new_tokens=32 --repeats=3:
            (benchmarking.py) random prompts, greedy, exactly max_new_tokens (no stop
            ids); per case, after a warm-up, medians of: time to first token (prefill +
            first token), prefill tokens/s, decode tokens/s (batch * new tokens / decode
            time).
            --compare_hf (HF folders): transformers' GptOssForCausalLM.generate on the
            same weights and prompts, in the same run.

Index i of an output line is the 0-based line number of the input; error messages name
the 1-based line ("line i+1"), as editors count. Exit code: 0 if any line succeeded (or
there was none), 1 if every line failed, 2 for an unusable checkpoint, flag or config.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import sys
import time
from typing import Any, Iterable, Sequence

import jax
import numpy as np
from absl import app, flags, logging

from gpt_oss_train import config as config_lib
from gpt_oss_train import runtime, sharding
from gpt_oss_train.inference.generate import Generator, SamplingParams, cache_length
from gpt_oss_train.io import tokenizer as tok_lib
from gpt_oss_train.model.transformer import DTYPES, ModelDef
from gpt_oss_train.training import checkpoint as ckpt_lib
from gpt_oss_train.training import loss as loss_lib

# Raw text ends on <|endoftext|> as well as Harmony's end-of-turn ids (HF's eos ids).
TEXT_STOP_IDS = tuple(sorted({tok_lib.ENDOFTEXT_ID, *tok_lib.Tokenizer.stop_ids}))
MODES = ("generate", "score", "chat", "benchmark")


class DecodeError(ValueError):
    """A flag, input or checkpoint that cannot be used; the message says which and why."""


class LineError(ValueError):
    """One input line that cannot run; the others still do."""


def get_config():
    """The runtime used without --config: no remat (nothing is differentiated), ragged MoE,
    XLA attention, scanned layers, the default mesh (FSDP over the local devices)."""
    c = config_lib.default_config()
    c.remat_policy = "none"
    c.moe_impl = "ragged"
    c.attention_impl = "xla"
    c.scan_layers = True
    return c


@dataclasses.dataclass(frozen=True)
class Options:
    """The run-time knobs shared by the modes (the CLI fills it from flags)."""

    max_new_tokens: int = 256
    sampling: SamplingParams = SamplingParams()
    seed: int = 0
    batch_size: int = 8
    prefill_chunk: int = 256
    int8_kv_cache: bool = False
    reasoning_effort: str = "medium"
    max_cache_len: int = 0  # 0: the model's max_position_embeddings
    show_analysis: bool = False


@functools.cache
def _tokenizer() -> tok_lib.Tokenizer:
    return tok_lib.Tokenizer()


# ----------------------------------------------------------------------------- loading


def checkpoint_kind(path: str) -> str:
    """'orbax' or 'hf'; anything else is refused here, before any compute."""
    if not path:
        raise DecodeError("--checkpoint is required: an Orbax checkpoint or a Hugging Face folder")
    if not os.path.isdir(path):
        raise DecodeError(f"--checkpoint={path}: no such folder")
    if ckpt_lib.is_orbax_checkpoint(path):
        return "orbax"
    if os.path.isfile(os.path.join(path, "config.json")):
        return "hf"
    raise DecodeError(
        f"--checkpoint={path} is neither an Orbax checkpoint written by gpt_oss_train (a "
        "training workdir, its checkpoints/ folder, or a step folder with a model_config "
        "item) nor a Hugging Face gpt-oss folder (config.json + *.safetensors)"
    )


def read_architecture(path: str, kind: str) -> dict:
    from gpt_oss_train.io import hf

    try:
        arch = (
            ckpt_lib.read_model_config(path)
            if kind == "orbax"
            else hf.HFCheckpoint(path).model_config
        )
        config_lib.validate_model(arch)
    except (ValueError, OSError) as e:
        raise DecodeError(f"--checkpoint={path}: {e}") from None
    return arch


@dataclasses.dataclass
class LoadedModel:
    md: ModelDef
    params: Any
    mesh: jax.sharding.Mesh
    rules: tuple
    kind: str  # "orbax" | "hf"
    path: str
    loss_chunk: int  # positions per chunk of the vocabulary projection when scoring
    _compiled: dict = dataclasses.field(default_factory=dict)

    @property
    def cfg(self):
        return self.md.cfg

    def generator(self, prefill_chunk: int, int8_kv_cache: bool, on_token=None) -> Generator:
        """One Generator per setting, kept: its compiled prefill/decode are reused by later
        calls on this model (chat turns, repeated runs in one process)."""
        key = ("generator", prefill_chunk, int8_kv_cache, on_token)
        if key not in self._compiled:
            self._compiled[key] = Generator(
                self.md,
                self.params,
                prefill_chunk=prefill_chunk,
                int8_kv_cache=int8_kv_cache,
                on_token=on_token,
            )
        return self._compiled[key]

    def scorer(self):
        """The jitted scoring function (see `_score_fn`), kept like the generators."""
        if "scorer" not in self._compiled:
            self._compiled["scorer"] = _score_fn(self)
        return self._compiled["scorer"]

    def scope(self):
        """Model calls trace under this: activations are constrained to the mesh."""
        return sharding.use_mesh(self.mesh, self.rules)


def runtime_config(config=None, dtype: str | None = None):
    config = get_config() if config is None else config
    if dtype:
        config = config.copy_and_resolve_references()
        config.dtype = dtype
    config_lib.validate(config)
    return config


def load_model(
    path: str, config=None, *, dtype: str | None = None, int8_weights: bool = False
) -> LoadedModel:
    """The checkpoint's parameters, placed on the mesh of the runtime config."""
    config = runtime_config(config, dtype)
    kind = checkpoint_kind(path)
    arch = read_architecture(path, kind)
    md = ModelDef(config_lib.ModelConfig.from_config(config, arch))
    rules = sharding.validate_rules(config.logical_axis_rules)
    mesh = sharding.make_mesh(config.mesh, config.mesh_dcn, devices=jax.local_devices())
    abstract = md.abstract_params(mesh, rules)
    logging.info(
        "Loading %s checkpoint %s: compute %s, mesh %s", kind, path, md.cfg.dtype, dict(mesh.shape)
    )
    try:
        if kind == "orbax":
            params = ckpt_lib.load_params(path, abstract)[0]
        else:
            from gpt_oss_train.io import hf

            params = hf.load_sharded(path, abstract)
    except (ValueError, OSError) as e:
        raise DecodeError(f"--checkpoint={path}: {e}") from None
    model = LoadedModel(
        md, params, mesh, rules, kind, os.path.abspath(path), config.train.loss_chunk_size
    )
    if int8_weights:
        from gpt_oss_train.model import quantize

        with model.scope():
            model.params = jax.jit(quantize.quantize_params)(params)
    return model


def cache_limit(max_positions: int, opts: Options) -> int:
    """The most positions a sequence may use: --max_cache_len, else the model's
    max_position_embeddings (`max_positions`)."""
    if opts.max_cache_len > max_positions:
        raise DecodeError(
            f"--max_cache_len={opts.max_cache_len} exceeds the model's "
            f"max_position_embeddings={max_positions}"
        )
    return opts.max_cache_len or max_positions


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _batch_rows(n: int, batch_size: int) -> int:
    """Rows of a compiled call for n requests: padding to a power of two (at most
    batch_size) keeps the number of compiled shapes small."""
    return min(batch_size, _pow2_at_least(n))


def prefill_chunk_for(prefill_chunk: int, longest: int) -> int:
    """A chunk no longer than the longest prompt needs: short prompts are not padded to a
    256-token chunk (prefill cost is the padded length)."""
    return min(prefill_chunk, max(16, _pow2_at_least(longest)))


# ----------------------------------------------------------------------------- generate


@dataclasses.dataclass(frozen=True)
class Request:
    index: int
    kind: str  # "tokens" | "prompt" | "messages"
    prompt: tuple[int, ...]
    stop_ids: tuple[int, ...]
    max_new_tokens: int
    seed: int


def _load_line(raw: bytes) -> dict:
    try:
        obj = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise LineError(f"not valid UTF-8 ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise LineError(f"not valid JSON ({e.msg} at column {e.colno})") from None
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
    ids = _tokenizer().encode(text)
    if max(ids) >= vocab_size:  # a test model with a toy vocabulary cannot read real text
        raise LineError(
            f"this model's vocabulary has {vocab_size} ids; text needs the "
            f"o200k_harmony vocabulary ({tok_lib.VOCAB_SIZE})"
        )
    return tuple(ids)


def parse_generate_line(
    index: int, raw: bytes, *, vocab_size: int, limit: int, opts: Options
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
            prompt = tuple(_tokenizer().render_chat(obj["messages"], opts.reasoning_effort))
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
    return Request(index, kind, prompt, stop_ids, max_new, seed)


def error_record(index: int, message: str) -> dict:
    msg = f"line {index + 1}: {message}"
    logging.warning("%s", msg)
    return {"index": index, "error": msg}


def _nonblank_lines(data: bytes) -> Iterable[tuple[int, bytes]]:
    for i, raw in enumerate(data.split(b"\n")):
        if raw.strip():
            yield i, raw


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


def stop_slots(stop_ids: Sequence[int], multiple: int = 4) -> list[int]:
    """Stop ids padded with distinct negative ids (never generated) to a multiple of 4.
    The decode loop is compiled per number of stop ids; this way Harmony's 2, raw text's
    3 and most per-line lists share one compiled loop. (Distinct, because the Generator
    drops duplicates.)"""
    ids = sorted(set(stop_ids))
    pad = -len(ids) % multiple
    return ids + list(range(-1, -pad - 1, -1))


def completion_text(tokens: list[int], stop_reason: str) -> str | None:
    body = tokens[:-1] if stop_reason == "stop" and tokens else tokens
    try:
        return _tokenizer().decode(body)
    except ValueError:  # ids the o200k_harmony vocabulary does not have (toy models)
        return None


def _generate_batch(
    gen: Generator, model: LoadedModel, batch: list[Request], limit: int, opts: Options
) -> list[dict]:
    rows = _batch_rows(len(batch), opts.batch_size)
    # Padding rows repeat the first request, so they stop when it does.
    prompts = [r.prompt for r in batch] + [batch[0].prompt] * (rows - len(batch))
    seeds = [r.seed for r in batch] + [batch[0].seed] * (rows - len(batch))
    max_new = batch[0].max_new_tokens
    max_len = min(cache_length(max(map(len, prompts)) + max_new), limit)
    start = time.perf_counter()
    with model.scope():
        cache, last, lengths = gen.prefill(prompts, max_len)
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
            rec["messages"] = _tokenizer().parse_completion(out["tokens"])
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
    limit = cache_limit(model.cfg.max_position_embeddings, opts)
    results: dict[int, dict] = {}
    requests = []
    for i, raw in _nonblank_lines(data):
        try:
            requests.append(
                parse_generate_line(i, raw, vocab_size=model.cfg.vocab_size, limit=limit, opts=opts)
            )
        except LineError as e:
            results[i] = error_record(i, str(e))
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


# ----------------------------------------------------------------------------- score


def _score_fn(model: LoadedModel):
    md, chunk, dtype = model.md, model.loss_chunk, DTYPES[model.cfg.dtype]

    def score(params, inputs, targets, positions, segment_ids):
        hidden, _, _ = md.bind(params)(inputs, positions, segment_ids)
        logp, _ = loss_lib.token_logprobs(
            hidden, params["unembed"]["kernel"], targets, chunk=chunk, dtype=dtype
        )
        return logp

    return jax.jit(score)


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


def score_batch(model: LoadedModel, fn, seqs: list[tuple[int, ...]], rows: int) -> list:
    """log p(t[i+1] | t[:i+1]) for each sequence, as float32 numpy arrays of n-1 values.
    Rows are padded (segment 0) to a power-of-two length, as training pads."""
    width = max(16, _pow2_at_least(max(len(s) - 1 for s in seqs)))
    arrays = {
        k: np.zeros((rows, width), np.int32)
        for k in ("inputs", "targets", "positions", "segment_ids")
    }
    for i, s in enumerate(seqs):
        n = len(s) - 1
        arrays["inputs"][i, :n] = s[:-1]
        arrays["targets"][i, :n] = s[1:]
        arrays["positions"][i, :n] = np.arange(n)
        arrays["segment_ids"][i, :n] = 1
    with model.scope():
        logp = jax.device_get(
            fn(
                model.params,
                arrays["inputs"],
                arrays["targets"],
                arrays["positions"],
                arrays["segment_ids"],
            )
        )
    return [logp[i, : len(s) - 1] for i, s in enumerate(seqs)]


def run_score(model: LoadedModel, data: bytes, opts: Options) -> list[dict]:
    limit = cache_limit(model.cfg.max_position_embeddings, opts)
    results: dict[int, dict] = {}
    todo = []
    for i, raw in _nonblank_lines(data):
        try:
            todo.append((i, parse_score_line(raw, vocab_size=model.cfg.vocab_size, limit=limit)))
        except LineError as e:
            results[i] = error_record(i, str(e))
    todo.sort(key=lambda x: len(x[1]))
    fn = model.scorer()
    for start in range(0, len(todo), opts.batch_size):
        batch = todo[start : start + opts.batch_size]
        rows = _batch_rows(len(batch), opts.batch_size)
        for (i, ids), logp in zip(batch, score_batch(model, fn, [s for _, s in batch], rows)):
            total = float(np.sum(logp, dtype=np.float64))
            results[i] = {
                "index": i,
                "num_tokens": len(ids),
                "logprobs": logp.tolist(),
                "sum_logprob": total,
                "perplexity": math.exp(-total / len(logp)),
            }
    return [results[i] for i in sorted(results)]


def evaluate_data(
    model: LoadedModel, spec: str, *, num_batches: int, batch_size: int, seq_len: int, seed: int = 0
) -> dict:
    """Mean next-token loss over the first num_batches batches of a source's eval split
    (one pass, no shuffling: the same batches every run), as training's evaluation."""
    from gpt_oss_train.training import data as data_lib

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
        pipeline = data_lib.make_pipeline(
            spec,
            seq_len=seq_len,
            global_batch_size=batch_size,
            seed=seed,
            shuffle=False,
            num_epochs=1,
            split="eval",
        )
    except data_lib.DataError as e:
        raise DecodeError(f"--data={spec}: {e}") from None
    md, chunk, dtype = model.md, model.loss_chunk, DTYPES[model.cfg.dtype]

    @jax.jit
    def sums(params, batch):
        hidden, _, _ = md.bind(params)(batch["inputs"], batch["positions"], batch["segment_ids"])
        nll, _, n = loss_lib.lm_loss_sums(
            hidden,
            params["unembed"]["kernel"],
            batch["targets"],
            batch["loss_mask"],
            chunk=chunk,
            dtype=dtype,
        )
        return nll, n

    nll = tokens = 0.0
    batches = 0
    with model.scope():
        for _ in range(num_batches):
            try:
                local = next(pipeline)
            except StopIteration:
                break
            a, b = jax.device_get(
                sums(model.params, data_lib.global_batch(local, model.mesh, model.rules))
            )
            nll, tokens, batches = nll + float(a), tokens + float(b), batches + 1
    if not tokens:
        raise DecodeError(f"--data={spec}: the eval split gave no tokens to score")
    loss = nll / tokens
    return {
        "source": spec,
        "split": "eval",
        "batches": batches,
        "tokens": int(tokens),
        "loss": loss,
        "perplexity": math.exp(loss),
    }


# ----------------------------------------------------------------------------- CLI


def _define_flags():
    """Defined when run as a program only, so tests can import this module beside
    gpt_oss_train.train (which defines its own --config)."""
    from ml_collections import config_flags

    config_flags.DEFINE_config_file(
        "config",
        os.path.abspath(__file__),
        "Runtime config (mesh, dtype, moe_impl, attention_impl, ...); the architecture "
        "comes from the checkpoint. Default: this file's get_config().",
    )
    flags.DEFINE_string(
        "checkpoint", None, "Orbax checkpoint / training workdir, or a Hugging Face gpt-oss folder."
    )
    flags.DEFINE_enum("mode", "generate", MODES, "What to do.")
    flags.DEFINE_string("input", None, "JSONL requests (generate, score).")
    flags.DEFINE_string(
        "output",
        None,
        "Where results go (JSONL; JSON for --data and "
        "benchmark). Default for generate/score: stdout.",
    )
    flags.DEFINE_enum(
        "dtype",
        None,
        ["float32", "bfloat16"],
        "Compute dtype (default: the "
        "config's; without --config bfloat16 where the hardware has fast bfloat16 "
        "matmuls, else float32). Parameters stay float32.",
    )
    flags.DEFINE_integer("max_new_tokens", 256, "Most tokens generated per request.")
    flags.DEFINE_float("temperature", 0.0, "Sampling temperature; 0 is greedy.")
    flags.DEFINE_integer("top_k", 0, "Sample from the k most likely tokens (0: off).")
    flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass (1: off).")
    flags.DEFINE_integer(
        "seed",
        0,
        "Sampling seed; request i uses seed + i unless its line "
        "gives one. Also the benchmark prompts' seed.",
    )
    flags.DEFINE_integer(
        "batch_size", 8, "Input lines per generate/score call; rows per batch with --data."
    )
    flags.DEFINE_integer("prefill_chunk", 256, "Most prompt tokens per prefill step.")
    flags.DEFINE_bool("int8_weights", False, "int8 weight-only quantized matmuls.")
    flags.DEFINE_bool("int8_kv_cache", False, "int8 KV cache.")
    flags.DEFINE_enum(
        "reasoning_effort",
        "medium",
        ["low", "medium", "high"],
        "Reasoning effort in the Harmony system message.",
    )
    flags.DEFINE_integer(
        "max_cache_len",
        0,
        "Most positions a sequence may use (prompt + "
        "generated); 0: the model's max_position_embeddings.",
    )
    flags.DEFINE_bool("show_analysis", False, "chat: print the analysis channel too.")
    flags.DEFINE_string(
        "data", None, "score: a training data source spec to evaluate on instead of --input."
    )
    flags.DEFINE_integer("num_batches", 8, "score --data: batches to evaluate.")
    flags.DEFINE_integer("seq_len", 1024, "score --data: tokens per row.")
    flags.DEFINE_list("batch_sizes", ["1", "4"], "benchmark: batch sizes.")
    flags.DEFINE_list("prompt_lengths", ["16", "128"], "benchmark: prompt lengths.")
    flags.DEFINE_integer("repeats", 3, "benchmark: timed runs per case (median).")
    flags.DEFINE_bool(
        "compare_hf", False, "benchmark: also time transformers on the same HF checkpoint."
    )


def _positive_ints(values: list[str], name: str) -> list[int]:
    try:
        out = [int(v) for v in values]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise DecodeError(
            f"--{name} must be a comma-separated list of positive integers, got "
            f"{','.join(values)!r}"
        )
    return out


def _check_flags(f) -> Options:
    """Every flag problem is reported here, before a checkpoint is read."""
    for name in (
        "max_new_tokens",
        "batch_size",
        "prefill_chunk",
        "repeats",
        "num_batches",
        "seq_len",
    ):
        if f[name].value < 1:
            raise DecodeError(f"--{name} must be >= 1, got {f[name].value}")
    if f.temperature < 0 or f.top_k < 0 or not 0 < f.top_p <= 1 or f.max_cache_len < 0:
        raise DecodeError(
            "need --temperature >= 0, --top_k >= 0, 0 < --top_p <= 1 and --max_cache_len >= 0"
        )
    if not 0 <= f.seed < 2**32:
        raise DecodeError(f"--seed must be in [0, 2**32), got {f.seed}")
    if f.mode == "generate" and not f.input:
        raise DecodeError("--mode=generate needs --input (JSONL of requests)")
    if f.mode == "score" and bool(f.input) == bool(f.data):
        raise DecodeError("--mode=score needs exactly one of --input (JSONL) or --data (spec)")
    if f.input and f.mode in ("generate", "score") and not os.path.isfile(f.input):
        raise DecodeError(f"--input={f.input}: no such file")
    if f.compare_hf and f.mode != "benchmark":
        raise DecodeError("--compare_hf only applies to --mode=benchmark")
    if f.output and not os.path.isdir(os.path.dirname(os.path.abspath(f.output))):
        raise DecodeError(f"--output={f.output}: its folder does not exist")
    return Options(
        max_new_tokens=f.max_new_tokens,
        sampling=SamplingParams(f.temperature, f.top_k, f.top_p),
        seed=f.seed,
        batch_size=f.batch_size,
        prefill_chunk=f.prefill_chunk,
        int8_kv_cache=f.int8_kv_cache,
        reasoning_effort=f.reasoning_effort,
        max_cache_len=f.max_cache_len,
        show_analysis=f.show_analysis,
    )


def _write_jsonl(records: list[dict], path: str | None):
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    if path:
        with open(path, "w", encoding="utf-8") as out:
            out.write(text)
    else:
        sys.stdout.write(text)


def _run(f) -> int:
    opts = _check_flags(f)
    kind = checkpoint_kind(f.checkpoint)
    if f.compare_hf and kind != "hf":
        raise DecodeError(
            f"--compare_hf needs a Hugging Face folder; {f.checkpoint} is an Orbax checkpoint"
        )
    if f.mode == "benchmark":
        batch_sizes = _positive_ints(f.batch_sizes, "batch_sizes")
        prompt_lengths = _positive_ints(f.prompt_lengths, "prompt_lengths")
    # before anything is loaded
    cache_limit(read_architecture(f.checkpoint, kind)["max_position_embeddings"], opts)
    model = load_model(f.checkpoint, f["config"].value, dtype=f.dtype, int8_weights=f.int8_weights)
    if f.mode in ("generate", "score") and f.input:
        with open(f.input, "rb") as src:
            data = src.read()
        records = (run_generate if f.mode == "generate" else run_score)(model, data, opts)
        _write_jsonl(records, f.output)
        failed = sum("error" in r for r in records)
        logging.info("%d lines done, %d failed", len(records) - failed, failed)
        return exit_code(records)
    if f.mode == "score":
        result = evaluate_data(
            model,
            f.data,
            num_batches=f.num_batches,
            batch_size=f.batch_size,
            seq_len=f.seq_len,
            seed=f.seed,
        )
        print(
            f"eval loss {result['loss']:.4f}  perplexity {result['perplexity']:.2f}  "
            f"({result['tokens']} tokens in {result['batches']} batches of {f.data})"
        )
        if f.output:
            with open(f.output, "w") as out:
                json.dump(result, out)
        return 0
    if f.mode == "chat":
        from gpt_oss_train.inference import chat

        return chat.run_chat(model, opts)
    from gpt_oss_train.inference.benchmarking import (
        benchmark,
        benchmark_prompts,
        format_table,
        hf_benchmark,
    )

    rows = benchmark(
        model,
        batch_sizes=batch_sizes,
        prompt_lengths=prompt_lengths,
        max_new_tokens=f.max_new_tokens,
        repeats=f.repeats,
        opts=opts,
    )
    if f.compare_hf:
        cases = [
            (b, n, benchmark_prompts(model.cfg.vocab_size, b, n, f.seed))
            for n in prompt_lengths
            for b in batch_sizes
        ]
        dtype = model.cfg.dtype
        del model  # free the JAX copy of the weights before torch loads its own
        hf_rows = hf_benchmark(
            f.checkpoint, cases, dtype=dtype, max_new_tokens=f.max_new_tokens, repeats=f.repeats
        )
        for r, h in zip(rows, hf_rows):
            r.update(hf_ttft_ms=h["hf_ttft_ms"], hf_decode_tok_s=h["hf_decode_tok_s"])
    print(format_table(rows))
    if f.output:
        with open(f.output, "w") as out:
            json.dump(rows, out, indent=1)
    return 0


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from gpt_oss_train.training.metrics import quiet_library_logs

    quiet_library_logs()
    runtime.setup_compilation_cache()
    try:
        return _run(flags.FLAGS)
    except (DecodeError, ckpt_lib.CheckpointError, config_lib.ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    _define_flags()
    app.run(main)
