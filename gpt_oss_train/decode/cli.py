"""Use a trained or converted GPT-OSS model: generate, score, chat, benchmark.

    python -m gpt_oss_train.decode --checkpoint=DIR --mode=generate --input=in.jsonl \
        --output=out.jsonl [--config=configs/<name>.py] [--dtype=float32] ...

--checkpoint is an Orbax checkpoint written by `train` (its workdir, the checkpoints/
folder or one step folder) or by gpt_oss_train.tools.convert_checkpoint, or a Hugging Face gpt-oss
folder (config.json + safetensors). The architecture always comes from the checkpoint;
--config only sets how to run it (mesh, dtype, moe_impl, kernels, ...). Without
--config the runtime is this file's `get_config()`, so `--config.mesh.tensor=2` works
with no config file too.

Modes

  generate  --input=JSONL --output=JSONL. One request per line, one of
              {"tokens": [ids]}          ids as they are
              {"prompt": "text"}         raw text continuation
              {"messages": [...]}        a Harmony chat (Tokenizer.render_chat), the
                                         model writes the next assistant turn
            optional per line: "max_new_tokens", "seed" (default --seed + index),
            "stop_ids" (default: Tokenizer.stop_ids for chats; <|endoftext|> and them
            for tokens/prompt) and "adapter" (a NAME given to --adapter). Output,
            one line per non-blank input line, in input order:
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
  chat      Harmony chat on stdin/stdout (decode/chat.py). /reset clears the history, /exit or
            EOF ends. The final channel streams as it is generated; analysis and
            commentary only with --show_analysis (dimmed on a terminal).
  benchmark --batch_sizes=1,4 --prompt_lengths=16,128 --max_new_tokens=32 --repeats=3:
            (decode/benchmarking.py) random prompts, greedy, exactly max_new_tokens (no stop
            ids); per case, after a warm-up, medians of: time to first token (prefill +
            first token), prefill tokens/s, decode tokens/s (batch * new tokens / decode
            time).
            --compare_hf (HF folders): transformers' GptOssForCausalLM.generate on the
            same weights and prompts, in the same run.

Index i of an output line is the 0-based line number of the input; error messages name
the 1-based line ("line i+1"), as editors count. Exit code: 0 if any line succeeded (or
there was none), 1 if every line failed, 2 for an unusable checkpoint, flag or config.
An existing --output file is refused (exit 2) unless --overwrite is given.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

from absl import app, flags, logging

from gpt_oss_train import errors, hosts, logs
from gpt_oss_train.decode import benchmarking, chat, requests
from gpt_oss_train.inference import adapters as adapters_lib
from gpt_oss_train.inference import loading
from gpt_oss_train.inference.generate import SamplingParams
from gpt_oss_train.inference.loading import DecodeError, Options

MODES = ("generate", "score", "chat", "benchmark")


def get_config():
    """The runtime config without --config (this file is --config's default)."""
    return loading.default_runtime_config()


def define_flags():
    """Defined when run as a program only, so tests can import this module beside
    gpt_oss_train.train (which defines its own --config)."""
    errors.define_config_flag(
        "config",
        os.path.abspath(__file__),
        "Runtime config (mesh, dtype, moe_impl, kernels, ...); the architecture "
        "comes from the checkpoint. Default: this file's get_config().",
    )
    flags.DEFINE_string(
        "checkpoint",
        None,
        "Orbax checkpoint / training workdir, or a Hugging Face gpt-oss folder (with "
        "--adapter: default, the base the adapter was trained on).",
    )
    flags.DEFINE_list(
        "adapter",
        [],
        "LoRA adapters beside the base, unmerged: DIR (every request uses it) or "
        'NAME=DIR,NAME2=DIR2 (a request picks one with "adapter": NAME, none: the base). '
        "DIR: a PEFT adapter folder or a LoRA training workdir.",
    )
    flags.DEFINE_enum("mode", "generate", MODES, "What to do.")
    flags.DEFINE_string("input", None, "JSONL requests (generate, score).")
    flags.DEFINE_string(
        "output",
        None,
        "Where results go (JSONL; JSON for --data and "
        "benchmark). Default for generate/score: stdout. An existing file is refused "
        "unless --overwrite.",
    )
    flags.DEFINE_bool("overwrite", False, "Replace an existing --output file.")
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
    loading.define_weights_flag()
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
    _define_mode_flags()


def _define_mode_flags():
    """The flags of one mode each: chat, score --data, benchmark."""
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
    if f.compare_hf and f.mode != "benchmark":
        raise DecodeError("--compare_hf only applies to --mode=benchmark")
    # Every option but the sampling settings is the flag of the same name.
    names = [o.name for o in dataclasses.fields(Options) if o.name != "sampling"]
    sampling = SamplingParams(f.temperature, f.top_k, f.top_p)
    return Options(sampling=sampling, **{n: f[n].value for n in names})


def _check_files(f) -> None:
    """The files process 0 alone reads and writes (on a pod, they need exist there only)."""
    if f.input and f.mode in ("generate", "score") and not os.path.isfile(f.input):
        raise DecodeError(f"--input={f.input}: no such file")
    if f.output and not os.path.isdir(os.path.dirname(os.path.abspath(f.output))):
        raise DecodeError(f"--output={f.output}: its folder does not exist")
    if f.output and os.path.isdir(f.output):
        raise DecodeError(f"--output={f.output} is a folder; give a file path")
    if f.output and os.path.lexists(f.output) and not f.overwrite:
        raise DecodeError(
            f"--output={f.output} exists; pass --overwrite to replace it, or choose another path"
        )


def _write_jsonl(records: list[dict], path: str | None):
    text = "".join(
        json.dumps(requests.json_safe(r), ensure_ascii=False, allow_nan=False) + "\n"
        for r in records
    )
    if path:
        with open(path, "w", encoding="utf-8") as out:
            out.write(text)
    else:
        sys.stdout.write(text)


def _run(f, link: hosts.Link) -> int:
    """Every process runs the same program on the global mesh; process 0 alone reads
    --input (and sends it to the others) and writes the output."""
    opts = _check_flags(f)
    link.agree(lambda: _check_files(f))
    if link.multihost and f.compare_hf:
        raise DecodeError(
            "--compare_hf runs in one process (transformers' side is one host's); launch it "
            "without launch/"
        )
    adapters = adapters_lib.parse_flag(f.adapter)
    if adapters and not f.checkpoint:
        f.checkpoint = adapters_lib.base_of(adapters)
    kind = loading.checkpoint_kind(f.checkpoint)
    if f.compare_hf and kind != "hf":
        raise DecodeError(
            f"--compare_hf needs a Hugging Face folder; {f.checkpoint} is an Orbax checkpoint"
        )
    if f.mode == "benchmark":  # flag errors before anything is loaded
        _positive_ints(f.batch_sizes, "batch_sizes")
        _positive_ints(f.prompt_lengths, "prompt_lengths")
    if f.mode == "chat":
        logs.conversation_only()
    arch = loading.read_architecture(f.checkpoint, kind)
    loading.cache_limit(arch["max_position_embeddings"], opts)
    load = lambda: loading.load_model(
        f.checkpoint,
        f["config"].value,
        dtype=f.dtype,
        int8_weights=f.int8_weights,
        weights=f.weights,
        adapters=adapters,
    )
    if f.mode == "benchmark":
        return _benchmark(load, f, opts, link)
    model = load()
    if f.mode in ("generate", "score") and f.input:
        data = None
        if link.leader:
            with open(f.input, "rb") as src:
                data = src.read()
        data = link.share(data)
        run = requests.run_generate if f.mode == "generate" else requests.run_score
        records = run(model, data, opts)
        if link.leader:
            _write_jsonl(records, f.output)
        failed = sum("error" in r for r in records)
        logging.info("%d lines done, %d failed", len(records) - failed, failed)
        return requests.exit_code(records)
    if f.mode == "score":
        return _score_data(model, f, link)
    if f.mode == "chat":
        return chat.run_chat(model, opts, link=link)
    raise AssertionError(f"unhandled mode {f.mode}")


def _score_data(model, f, link: hosts.Link) -> int:
    result = requests.evaluate_data(
        model,
        f.data,
        num_batches=f.num_batches,
        batch_size=f.batch_size,
        seq_len=f.seq_len,
        seed=f.seed,
    )
    if not link.leader:
        return 0
    print(
        f"eval loss {result['loss']:.4f}  perplexity {result['perplexity']:.2f}  "
        f"({result['tokens']} tokens in {result['batches']} batches of {f.data})"
    )
    if f.output:
        with open(f.output, "w") as out:
            json.dump(requests.json_safe(result), out, allow_nan=False)
    return 0


def _benchmark(load, f, opts, link: hosts.Link) -> int:
    """Our timings, then transformers' on the same checkpoint (--compare_hf) once our copy
    of the weights is freed: `load` makes the model, so no caller keeps a reference."""
    model = load()
    batch_sizes = _positive_ints(f.batch_sizes, "batch_sizes")
    prompt_lengths = _positive_ints(f.prompt_lengths, "prompt_lengths")
    rows = benchmarking.benchmark(
        model,
        batch_sizes=batch_sizes,
        prompt_lengths=prompt_lengths,
        max_new_tokens=f.max_new_tokens,
        repeats=f.repeats,
        opts=opts,
    )
    if f.compare_hf:
        cases = [
            (b, n, benchmarking.benchmark_prompts(model.cfg.vocab_size, b, n, f.seed))
            for n in prompt_lengths
            for b in batch_sizes
        ]
        dtype = model.cfg.dtype
        del model
        hf_rows = benchmarking.hf_benchmark(
            f.checkpoint, cases, dtype=dtype, max_new_tokens=f.max_new_tokens, repeats=f.repeats
        )
        for r, h in zip(rows, hf_rows):
            r.update(hf_ttft_ms=h["hf_ttft_ms"], hf_decode_tok_s=h["hf_decode_tok_s"])
    if not link.leader:
        return 0
    print(benchmarking.format_table(rows))
    if f.output:
        with open(f.output, "w") as out:
            json.dump(rows, out, indent=1)
    return 0


def main(argv):
    return hosts.command(lambda link: _run(flags.FLAGS, link), argv)


def run():
    """The `gpt-oss-decode` console script: `python -m gpt_oss_train.decode`."""
    define_flags()
    app.run(main, flags_parser=errors.parse_flags)


if __name__ == "__main__":
    run()
