"""Time training steps or decoding on random weights of any shape, on whatever devices
JAX sees. No checkpoint and no data needed: a capacity-planning tool.

  # training step: step time, tokens/s/device, TFLOP/s/device, MFU, peak device memory
  python tools/benchmark.py --mode=train --config=configs/gpu_h100.py \
      --config.model.num_layers=2 --config.train.global_batch_size=4

  # decoding: prefill and decode tokens/s at each batch size, and the share of the
  # memory bandwidth the decode steps use (active weight bytes read per step / time)
  python tools/benchmark.py --mode=decode --config=configs/gpu_h100.py \
      --batch_sizes=1,8 --prompt_len=128 --new_tokens=64

  # where a decode step's device time goes: add --profile_dir=DIR (a JAX profiler trace
  # per batch size, summarized as kernels by total time and launches per step)

Prints one JSON object per measurement (and a table), so results can be collected.
"""

from __future__ import annotations

import json
import os
import sys
import time

from absl import app, flags
from ml_collections import config_flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_CONFIG = config_flags.DEFINE_config_file("config", "configs/cpu_tiny.py", "Config file.")
_MODE = flags.DEFINE_enum("mode", "train", ["train", "decode"], "What to time.")
_STEPS = flags.DEFINE_integer("steps", 5, "Timed training steps (after one warm-up step).")
_BATCH_SIZES = flags.DEFINE_list("batch_sizes", ["1", "8"], "Decode batch sizes.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 128, "Decode prompt length.")
_NEW_TOKENS = flags.DEFINE_integer("new_tokens", 64, "Tokens generated per sequence.")
_INT8 = flags.DEFINE_bool("int8_weights", False, "Decode with int8 weight-only weights.")
_PROFILE_DIR = flags.DEFINE_string(
    "profile_dir",
    "",
    "Decode: after timing, trace one more generate call per batch size with the JAX "
    "profiler into this folder and print where the device time went (kernels by total "
    "time, launches per decode step).",
)
_PEAK_BW = flags.DEFINE_float(
    "peak_bandwidth",
    0.0,
    "Device memory bandwidth in bytes/s, for the decode "
    "bandwidth share (0: look up H100/H200/TPU figures).",
)


def _emit(record: dict):
    print(json.dumps(record), flush=True)


def _memory_gb(device) -> float | None:
    stats = device.memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return None if peak is None else peak / 2**30


def bench_train(config):
    import jax
    import numpy as np

    from gpt_oss_train import hardware
    from gpt_oss_train.training import flops
    from gpt_oss_train.training import state as state_lib

    setup = state_lib.build(config)  # what train.py runs
    t, mc = config.train, setup.model_cfg
    state = setup.init_state()
    rng = np.random.RandomState(0)
    b, s = t.global_batch_size, t.seq_len
    batch = {
        "inputs": rng.randint(0, mc.vocab_size, (b, s)),
        "targets": rng.randint(0, mc.vocab_size, (b, s)),
        "positions": np.tile(np.arange(s), (b, 1)),
        "segment_ids": np.ones((b, s)),
        "loss_mask": np.ones((b, s)),
    }
    batch = jax.device_put({k: v.astype(np.int32) for k, v in batch.items()}, setup.batch_sharding)
    with setup.scope():
        t0 = time.perf_counter()
        state, out = setup.train_step(state, batch)
        jax.block_until_ready(out)
        compile_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(_STEPS.value):
            state, out = setup.train_step(state, batch)
        jax.block_until_ready(out)
        dt = (time.perf_counter() - t0) / _STEPS.value
    kind = jax.devices()[0].device_kind
    perf = flops.throughput_metrics(
        step_time_s=dt,
        tokens_per_step=b * s,
        num_devices=jax.device_count(),
        flops_per_token=flops.training_flops_per_token(mc, s)["total"],
        peak=hardware.peak_flops(kind, t.peak_flops_per_device or None),
    )
    _emit(
        {
            "mode": "train",
            "device": kind,
            "devices": jax.device_count(),
            "layers": mc.num_layers,
            "experts": mc.num_experts,
            "hidden": mc.hidden_size,
            "batch": b,
            "seq_len": s,
            "moe_impl": mc.moe_impl,
            "attention_impl": mc.attention_impl,
            "remat": mc.remat_policy,
            "compile_s": round(compile_s, 1),
            "loss": float(out["loss"]),
            "peak_memory_gb": _memory_gb(jax.devices()[0]),
            **{k.split("/")[-1]: v for k, v in perf.items()},
        }
    )


def active_weight_bytes(mc, bytes_per_weight: float) -> float:
    """Weights one decode step must read for one token: attention, router, k experts per
    layer, the unembedding ("active" parameters leave out the embedding, a one-row gather)."""
    from gpt_oss_train.model import parameters

    return parameters.counts(mc)["active"] * bytes_per_weight


def bench_decode(config):
    """decode's benchmark (benchmarking.py) on random weights, plus the share of the
    memory bandwidth the decode steps reach (active weight bytes per step / step time)."""
    import jax
    import numpy as np

    from gpt_oss_train import hardware
    from gpt_oss_train.inference import benchmarking, loading

    model = loading.random_model(config, int8_weights=_INT8.value)
    mc = model.cfg
    kind = jax.devices()[0].device_kind
    bw = hardware.hbm_bandwidth(kind, _PEAK_BW.value)
    opts = loading.Options(max_new_tokens=_NEW_TOKENS.value, prefill_chunk=512)
    rows = benchmarking.benchmark(
        model,
        batch_sizes=[int(b) for b in _BATCH_SIZES.value],
        prompt_lengths=[_PROMPT_LEN.value],
        max_new_tokens=_NEW_TOKENS.value,
        repeats=3,
        opts=opts,
    )
    if _PROFILE_DIR.value:
        _profile_decode(model, opts)
    wbytes = 1 if _INT8.value else np.dtype(mc.param_dtype).itemsize
    for row in rows:
        step_s = row["batch"] * 1.0 / row["decode_tok_s"]
        record = {
            "mode": "decode",
            "device": kind,
            "devices": jax.device_count(),
            "layers": mc.num_layers,
            "experts": mc.num_experts,
            "param_dtype": mc.param_dtype,
            "int8_weights": _INT8.value,
            **row,
            "ms_per_step": step_s * 1e3,
        }
        if bw:
            record["active_weight_bw_share"] = (
                active_weight_bytes(mc, wbytes) / step_s / (bw * jax.device_count())
            )
        _emit(record)


def _profile_decode(model, opts):
    """One traced generate call per batch size (already compiled by the benchmark)."""
    import jax

    from gpt_oss_train.inference import benchmarking, loading
    from gpt_oss_train.inference.generate import cache_length

    length, new = _PROMPT_LEN.value, _NEW_TOKENS.value
    gen = model.generator(loading.prefill_chunk_for(opts.prefill_chunk, length), False)
    for batch in [int(b) for b in _BATCH_SIZES.value]:
        prompts = benchmarking.benchmark_prompts(model.cfg.vocab_size, batch, length, opts.seed)
        out_dir = os.path.join(_PROFILE_DIR.value, f"batch{batch}")
        with model.scope(), jax.profiler.trace(out_dir, create_perfetto_trace=True):
            cache, last, lengths = gen.prefill(prompts, cache_length(length + new))
            # decode returns host values: the call has finished when it returns
            gen.decode(
                cache,
                last,
                lengths,
                max_len=cache_length(length + new),
                max_new_tokens=new,
                stop_ids=[],
            )
        _emit({"mode": "profile", "batch": batch, **benchmarking.summarize_trace(out_dir, new)})


def main(argv):
    del argv
    config = _CONFIG.value
    if _MODE.value == "train":
        bench_train(config)
    else:
        bench_decode(config)


if __name__ == "__main__":
    app.run(main)
