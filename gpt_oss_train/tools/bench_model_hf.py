"""The transformers side of `bench_model.py --compare_hf`, one process per run so its
peak RSS is its own. Not meant to be run by hand (bench_model.py passes the shape).

  --mode=train   GptOssForCausalLM (random init, the same shape) with torch AdamW on
                 random tokens: loss.backward, gradient clipping, optimizer step.
  --mode=decode  decode/benchmarking.hf_benchmark (generate) on an HF folder.

Prints one JSON record per measurement, with the process's peak RSS.
"""

from __future__ import annotations

import json
import os
import resource
import time

from absl import app, flags

from gpt_oss_train import errors
from gpt_oss_train.io.hf_config import model_dict_to_hf_config

_MODE = flags.DEFINE_enum("mode", "train", ["train", "decode"], "What to time.")
_ARCH = flags.DEFINE_string("arch", None, "train: our architecture dict, as JSON.")
_DTYPE = flags.DEFINE_enum(
    "dtype", "float32", ["float32", "bfloat16"], "float32, or bfloat16 autocast (train) / weights."
)
_BATCH = flags.DEFINE_integer("batch", 4, "train: sequences per step.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 512, "train: tokens per sequence.")
_STEPS = flags.DEFINE_integer("steps", 3, "train: timed steps after one warm-up step.")
_HF_DIR = flags.DEFINE_string("hf_dir", None, "decode: the HF folder to generate with.")
_BATCH_SIZES = flags.DEFINE_list("batch_sizes", ["1"], "decode: batch sizes.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 128, "decode: prompt length.")
_NEW_TOKENS = flags.DEFINE_integer("new_tokens", 32, "decode: tokens generated per sequence.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "decode: timed runs per case (median).")


def peak_rss_gb() -> float:
    """This process's peak resident memory (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def bench_train(arch: dict) -> dict:
    # lazy: optional dependency (torch and transformers: the `test` extra; seconds to import)
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GptOssConfig(**model_dict_to_hf_config(arch, dtype="float32"))
    model = transformers.GptOssForCausalLM(cfg).train()
    # The optimizer of configs' default train section: AdamW, clipping at 1.
    opt = torch.optim.AdamW(
        model.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1
    )
    b, s = _BATCH.value, _SEQ_LEN.value
    ids = torch.randint(0, arch["vocab_size"], (b, s))
    bf16 = _DTYPE.value == "bfloat16"

    def step() -> float:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    t0 = time.perf_counter()
    step()
    first_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(_STEPS.value):
        loss = step()
    dt = (time.perf_counter() - t0) / _STEPS.value
    return {
        "mode": "train",
        "side": "transformers",
        "dtype": _DTYPE.value,
        "attention": model.config._attn_implementation,
        "torch_threads": torch.get_num_threads(),
        "versions": f"transformers {transformers.__version__}, torch {torch.__version__}",
        "batch": b,
        "seq_len": s,
        "first_step_s": round(first_s, 2),
        "step_time_seconds": dt,
        "tokens_per_sec": b * s / dt,
        "loss": loss,
        "peak_rss_gb": peak_rss_gb(),
    }


def bench_decode() -> list[dict]:
    # lazy: JAX (which benchmarking imports) stays out of the train side's process, so the
    # peak RSS it reports is transformers' own
    from gpt_oss_train.decode import benchmarking

    with open(os.path.join(_HF_DIR.value, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    length = _PROMPT_LEN.value
    cases = [
        (b, length, benchmarking.benchmark_prompts(vocab, b, length, 0))
        for b in (int(v) for v in _BATCH_SIZES.value)
    ]
    rows = benchmarking.hf_benchmark(
        _HF_DIR.value,
        cases,
        dtype=_DTYPE.value,
        max_new_tokens=_NEW_TOKENS.value,
        repeats=_REPEATS.value,
    )
    peak = peak_rss_gb()
    return [
        {"mode": "decode", "side": "transformers", "dtype": _DTYPE.value, **r, "peak_rss_gb": peak}
        for r in rows
    ]


def main(argv):
    del argv
    if _MODE.value == "train":
        records = [bench_train(json.loads(_ARCH.value))]
    else:
        records = bench_decode()
    for r in records:
        print(json.dumps(r), flush=True)


if __name__ == "__main__":
    app.run(main, flags_parser=errors.parse_flags)
