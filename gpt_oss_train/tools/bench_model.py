"""Time training steps or decoding on random weights of any shape, on whatever devices
JAX sees. No checkpoint and no data needed: a capacity-planning tool.

  # training step: step time, tokens/s/device, TFLOP/s/device, MFU, peak device memory
  python -m gpt_oss_train.tools.bench_model --mode=train --config=configs/gpu_h100.py \
      --config.model.num_layers=2 --config.train.global_batch_size=4

  # decoding: prefill and decode tokens/s at each batch size, and the share of the
  # memory bandwidth the decode steps use (active weight bytes read per step / time)
  python -m gpt_oss_train.tools.bench_model --mode=decode --config=configs/gpu_h100.py \
      --batch_sizes=1,8 --prompt_len=128 --new_tokens=64

  # LoRA / QLoRA: the same step with the base frozen (config.lora), e.g. rank-16
  # adapters on an MXFP4 base; records carry lora_rank and base_format
  python -m gpt_oss_train.tools.bench_model --mode=train --config=configs/cpu_bench.py \
      --config.lora.rank=16 --config.lora.base_format=mxfp4

  # where a decode step's device time goes: add --profile_dir=DIR (a JAX profiler trace
  # per batch size, summarized as kernels by total time and launches per step)

  # against transformers on the same shape, in the same run (each side in its own
  # process, so each peak RSS is its own): training with torch AdamW (its best of
  # float32 and bfloat16 autocast), or prefill + generate on the same random weights
  python -m gpt_oss_train.tools.bench_model --mode=train --config=configs/cpu_bench.py --compare_hf
  python -m gpt_oss_train.tools.bench_model --mode=decode --config=configs/cpu_bench.py \
      --compare_hf --batch_sizes=1,16 --prompt_len=128 --new_tokens=32

  # cost per training token as the expert count grows (top-k fixed), one process each
  python -m gpt_oss_train.tools.bench_model --mode=train --config=configs/cpu_bench.py \
      --sweep_experts=8,32,128 --config.model.num_layers=2

Prints one JSON object per measurement (and a table), so results can be collected. On a
CPU the decode records' bandwidth share uses this machine's read bandwidth, measured in
the same run (a jitted sum over a 1 GiB array). Flags are passed on to the processes a
comparison starts: give them as --flag=value.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from gpt_oss_train import config as config_lib
from gpt_oss_train import errors, hardware, hosts, runtime, sharding
from gpt_oss_train.decode import benchmarking
from gpt_oss_train.inference import loading
from gpt_oss_train.inference.generate import cache_length
from gpt_oss_train.io import hf
from gpt_oss_train.model import parameters
from gpt_oss_train.training import flops
from gpt_oss_train.training import state as state_lib

_CONFIG = errors.define_config_flag("config", "configs/cpu_tiny.py", "Config file.")
_MODE = flags.DEFINE_enum("mode", "train", ["train", "decode"], "What to time.")
_STEPS = flags.DEFINE_integer(
    "steps", 5, "Timed training steps (after one warm-up step); 0: compile only (memory)."
)
_BATCH_SIZES = flags.DEFINE_list("batch_sizes", ["1", "8"], "Decode batch sizes.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 128, "Decode prompt length.")
_NEW_TOKENS = flags.DEFINE_integer("new_tokens", 64, "Tokens generated per sequence.")
_INT8 = flags.DEFINE_bool("int8_weights", False, "Decode with int8 weight-only weights.")
_PROFILE_DIR = flags.DEFINE_string(
    "profile_dir",
    "",
    "After timing, trace one more training step (train) or generate call per batch size "
    "(decode) with the JAX profiler into this folder and print where the device time "
    "went (kernels, or XLA:CPU ops, by total time; launches per step).",
)
_COMPARE_HF = flags.DEFINE_bool(
    "compare_hf",
    False,
    "Also time transformers on the same shape (train: same batch, torch AdamW, float32 "
    "and bfloat16 autocast; decode: generate on the same random weights), in this run.",
)
_HF_DTYPES = flags.DEFINE_list(
    "hf_dtypes",
    [],
    "--compare_hf: transformers runs to take the best of (default: float32, plus bfloat16 "
    "where the hardware multiplies it natively; emulated it is 10-60x slower on a CPU).",
)
_SWEEP_EXPERTS = flags.DEFINE_list(
    "sweep_experts", [], "train: rerun with each of these expert counts (one process each)."
)
_SAVE_HF = flags.DEFINE_string(
    "save_hf", "", "decode: after timing, write the random weights as an HF folder here."
)
_PEAK_BW = flags.DEFINE_float(
    "peak_bandwidth",
    0.0,
    "Device memory bandwidth in bytes/s, for the decode "
    "bandwidth share (0: look up H100/H200/TPU figures; measure it on a CPU).",
)


def _emit(record: dict):
    if jax.process_index() == 0:  # on several processes, every one times the same steps
        print(json.dumps(record), flush=True)


def _memory_gb(device) -> float | None:
    stats = device.memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return None if peak is None else peak / 2**30


def compiled_memory_gb(compiled) -> float:
    """One device's memory for the compiled step by XLA's analysis: its arguments,
    outputs and temporaries (aliased donations counted once). The figure a CPU gives,
    where devices keep no allocation statistics; on a TPU it bounds the allocator's peak."""
    m = compiled.memory_analysis()
    used = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
    return (used + m.temp_size_in_bytes) / 2**30


def peak_rss_gb() -> float:
    """This process's peak resident memory (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def measure_read_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes/s a jitted sum reads from a float32 array of `gib` GiB (best of `repeats`):
    the bound a batch-1 decode step, which reads each active weight once, runs against."""
    rows = int(gib * 2**30 / 4 / 4096)
    a = jnp.ones((rows, 4096), jnp.float32)
    total = jax.jit(lambda a: jnp.sum(jnp.sum(a, axis=1)))
    jax.block_until_ready(total(a))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(total(a))
        best = min(best, time.perf_counter() - t0)
    return a.size * 4 / best


def bench_train(config):
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
        step = setup.train_step.lower(state, batch).compile()
        compile_s = time.perf_counter() - t0
        timed = {}
        if _STEPS.value:  # 0: compile only, for the memory figure
            timed = _time_train_steps(setup, step, state, batch)
    kind = jax.devices()[0].device_kind
    record = {
        "mode": "train",
        "device": kind,
        "devices": jax.device_count(),
        "mesh": {ax: n for ax, n in setup.mesh.shape.items() if n > 1},
        "layers": mc.num_layers,
        "experts": mc.num_experts,
        "hidden": mc.hidden_size,
        "batch": b,
        "seq_len": s,
        "moe_impl": mc.moe_impl,
        "kernels": mc.kernels.describe(sharding.platform(setup.mesh)),
        "remat": mc.remat_policy,
        # LoRA: the adapters' rank and the frozen base's format (0 / None: full FT)
        "lora_rank": mc.lora.rank if mc.lora else 0,
        "base_format": setup.frozen.format if setup.frozen else None,
        "side": "jax",
        "dtype": mc.dtype,
        "compile_s": round(compile_s, 1),
        "compiled_memory_gb": compiled_memory_gb(step),
    }
    if timed:
        dt = timed.pop("step_s")
        perf = flops.throughput_metrics(
            step_time_s=dt,
            tokens_per_step=b * s,
            num_devices=jax.device_count(),
            flops_per_token=flops.training_flops_per_token(mc, s)["total"],
            peak=hardware.peak_flops(kind, t.peak_flops_per_device or None),
        )
        record.update(
            timed,
            peak_memory_gb=_memory_gb(jax.local_devices()[0]),
            peak_rss_gb=peak_rss_gb(),
            tokens_per_sec=b * s / dt,
            **{k.split("/")[-1]: v for k, v in perf.items()},
        )
    _emit(record)


def _time_train_steps(setup, step, state, batch) -> dict:
    """One warm-up step, then --steps timed ones: the mean step time and the last loss."""
    state, out = step(state, batch)
    jax.block_until_ready(out)
    t0 = time.perf_counter()
    for _ in range(_STEPS.value):
        state, out = step(state, batch)
    jax.block_until_ready(out)
    dt = (time.perf_counter() - t0) / _STEPS.value
    if _PROFILE_DIR.value:
        _profile_train_step(setup, state, batch)
    return {"step_s": dt, "loss": float(out["loss"])}


def _profile_train_step(setup, state, batch):
    """One more (compiled) training step under the JAX profiler; prints where it went."""
    out_dir = os.path.join(_PROFILE_DIR.value, "train")
    with jax.profiler.trace(out_dir, create_perfetto_trace=True):
        jax.block_until_ready(setup.train_step(state, batch))
    _emit({"mode": "profile", **benchmarking.summarize_trace(out_dir, 1, top=25)})


def active_weight_bytes(mc, bytes_per_weight: float) -> float:
    """Weights one decode step must read for one token: attention, router, k experts per
    layer, the unembedding ("active" parameters leave out the embedding, a one-row gather)."""
    return parameters.counts(mc)["active"] * bytes_per_weight


def bench_decode(config):
    """decode's benchmark (decode/benchmarking.py) on random weights, plus the share of the
    memory bandwidth the decode steps reach (active weight bytes per step / step time)."""
    model = loading.random_model(config, int8_weights=_INT8.value)
    mc = model.cfg
    kind = jax.devices()[0].device_kind
    bw = hardware.hbm_bandwidth(kind, _PEAK_BW.value)
    if bw is None and jax.devices()[0].platform == "cpu":
        bw = measure_read_bandwidth()
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
            "side": "jax",
            "device": kind,
            "devices": jax.device_count(),
            "layers": mc.num_layers,
            "experts": mc.num_experts,
            "dtype": mc.dtype,
            "param_dtype": mc.param_dtype,
            "int8_weights": _INT8.value,
            **row,
            "ms_per_step": step_s * 1e3,
            "peak_rss_gb": peak_rss_gb(),
        }
        if bw:
            record["read_bandwidth_gb_s"] = bw / 1e9
            record["active_weight_bw_share"] = (
                active_weight_bytes(mc, wbytes) / step_s / (bw * jax.device_count())
            )
        _emit(record)
    if _SAVE_HF.value:
        hf.save_hf(_SAVE_HF.value, config_lib.model_arch(config), model.params, dtype="float32")


def _profile_decode(model, opts):
    """One traced generate call per batch size (already compiled by the benchmark)."""
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


# ----------------------------------------------------------------------------- comparisons
#
# Each side runs in a process of its own (this tool again, or bench_model_hf), so the
# peak RSS each reports is its own and neither inherits the other's threads or caches.

_PARENT_FLAGS = ("compare_hf", "nocompare_hf", "sweep_experts", "hf_dtypes")


def _child_args() -> list[str]:
    """This run's flags without the ones that start comparisons."""
    keep = lambda a: not any(a.lstrip("-").split("=")[0] == f for f in _PARENT_FLAGS)
    return [a for a in sys.argv[1:] if keep(a)]


def _run_child(tool: str, args: list[str]) -> list[dict]:
    cmd = [sys.executable, "-m", f"gpt_oss_train.tools.{tool}", *args]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
    return [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]


def _hf_runs(args: list[str]) -> list[list[dict]]:
    native_bf16 = runtime.fast_bfloat16("cpu")  # transformers runs on the CPU
    dtypes = _HF_DTYPES.value or ["float32"] + (["bfloat16"] if native_bf16 else [])
    return [_run_child("bench_model_hf", [*args, f"--dtype={d}"]) for d in dtypes]


def _table(rows: list[dict], cols: list[str]) -> str:
    cell = lambda v: "-" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def compare_train(config):
    (ours,) = _run_child("bench_model", _child_args())
    t = config.train
    arch = json.dumps(config_lib.model_arch(config))
    hf_args = ["--mode=train", f"--arch={arch}", f"--batch={t.global_batch_size}"]
    hf_args += [f"--seq_len={t.seq_len}", f"--steps={_STEPS.value}"]
    theirs = [r for (r,) in _hf_runs(hf_args)]
    best = max(theirs, key=lambda r: r["tokens_per_sec"])
    cols = ["side", "dtype", "tokens_per_sec", "step_time_seconds", "peak_rss_gb"]
    print(_table([ours, *theirs], cols))
    _emit(
        {
            "mode": "compare_train",
            "speedup_vs_best_hf": ours["tokens_per_sec"] / best["tokens_per_sec"],
            "best_hf_dtype": best["dtype"],
            "rss_ratio_vs_best_hf": ours["peak_rss_gb"] / best["peak_rss_gb"],
        }
    )


def compare_decode(config):
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = os.path.join(tmp, "hf")
        ours = _run_child("bench_model", [*_child_args(), f"--save_hf={hf_dir}"])
        hf_args = ["--mode=decode", f"--hf_dir={hf_dir}", f"--prompt_len={_PROMPT_LEN.value}"]
        hf_args += [f"--batch_sizes={','.join(_BATCH_SIZES.value)}"]
        hf_args += [f"--new_tokens={_NEW_TOKENS.value}"]
        runs = _hf_runs(hf_args)
    for row in ours:
        mine = [r for run in runs for r in run if r["batch"] == row["batch"]]
        ttft = min(mine, key=lambda r: r["hf_ttft_ms"])
        dec = max(mine, key=lambda r: r["hf_decode_tok_s"])
        row.update(
            hf_ttft_ms=ttft["hf_ttft_ms"],
            hf_ttft_dtype=ttft["dtype"],
            hf_decode_tok_s=dec["hf_decode_tok_s"],
            hf_decode_dtype=dec["dtype"],
            hf_peak_rss_gb=max(r["peak_rss_gb"] for r in mine),
            ttft_speedup=ttft["hf_ttft_ms"] / row["ttft_ms"],
            decode_speedup=row["decode_tok_s"] / dec["hf_decode_tok_s"],
        )
        _emit({"mode": "compare_decode", **row})
    cols = ["batch", "ttft_ms", "hf_ttft_ms", "ttft_speedup", "decode_tok_s"]
    cols += ["hf_decode_tok_s", "decode_speedup", "active_weight_bw_share"]
    print(_table(ours, cols))


def sweep_experts(config):
    rows = []
    for e in _SWEEP_EXPERTS.value:
        (r,) = _run_child("bench_model", [*_child_args(), f"--config.model.num_experts={e}"])
        rows.append(r)
    base = rows[0]["tokens_per_sec"]
    for r in rows:
        r["ms_per_token"] = 1e3 / r["tokens_per_sec"]
        r["cost_vs_first"] = base / r["tokens_per_sec"]
        _emit({"mode": "sweep_experts", **r})
    cols = ["experts", "tokens_per_sec", "ms_per_token", "cost_vs_first", "peak_rss_gb"]
    print(_table(rows, cols))


def main(argv):
    del argv
    link = hosts.join()  # on several processes (launch/), one mesh over all their devices
    with link:
        runtime.setup_process(sharding.platform())
        if link.multihost and (_COMPARE_HF.value or _SWEEP_EXPERTS.value or _SAVE_HF.value):
            raise app.UsageError(
                "--compare_hf, --sweep_experts and --save_hf run in one process; launch "
                "them without launch/"
            )
        _run()


def _run():
    config = _CONFIG.value
    if _SAVE_HF.value and _INT8.value:
        raise app.UsageError("--save_hf writes the float weights; it cannot follow --int8_weights")
    if _SWEEP_EXPERTS.value and _MODE.value == "train":
        sweep_experts(config)
    elif _COMPARE_HF.value:
        (compare_train if _MODE.value == "train" else compare_decode)(config)
    elif _MODE.value == "train":
        bench_train(config)
    else:
        bench_decode(config)


if __name__ == "__main__":
    app.run(main, flags_parser=errors.parse_flags)
