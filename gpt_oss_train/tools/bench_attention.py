"""Time one attention layer's forward + backward by back-end, on random bf16 inputs.

  # gpt-oss-20b heads (64 query / 8 KV, head_dim 64), one 8192-token sequence, the banded
  # (128) and the full layer, blockwise vs the Pallas flash kernel:
  python -m gpt_oss_train.tools.bench_attention --seq_lens=8192 --windows=128,0 \
      --impls=blockwise,flash

  # does a 32768-token layer fit? (an out-of-memory error is reported, not raised)
  python -m gpt_oss_train.tools.bench_attention --seq_lens=32768 --windows=128,0 \
      --impls=blockwise,flash

  # tile tuning: --flash_blocks=q,k,bwd_q,bwd_k[,num_warps,num_stages]
  python -m gpt_oss_train.tools.bench_attention --impls=blockwise,flash \
      --flash_blocks=128,64,64,64,4,3

Prints one JSON object per (sequence, window, back-end): milliseconds per forward +
backward, model TFLOP/s (visible query-key pairs only), the compiled call's temporaries +
outputs (XLA's memory analysis), and the largest
difference from the first back-end's output and gradients. --interpret runs the Pallas
kernels in interpret mode (any platform, slow: a smoke test, not a timing).
"""

from __future__ import annotations

import json
import time
from contextlib import nullcontext

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from gpt_oss_train import errors
from gpt_oss_train.kernels import Kernels
from gpt_oss_train.kernels.gpu import flash_attention as flash
from gpt_oss_train.kernels.gpu import interpret

_SEQ_LENS = flags.DEFINE_list("seq_lens", ["8192"], "Sequence lengths.")
_WINDOWS = flags.DEFINE_list("windows", ["128", "0"], "Band widths; 0 = full causal layer.")
_IMPLS = flags.DEFINE_list(
    "impls", ["blockwise", "flash"], "Implementations of the `attention` kernel op (xla, cpu, ...)."
)
_BATCH = flags.DEFINE_integer("batch", 1, "Sequences per call.")
_HEADS = flags.DEFINE_integer("heads", 64, "Query heads.")
_KV_HEADS = flags.DEFINE_integer("kv_heads", 8, "Key/value heads.")
_HEAD_DIM = flags.DEFINE_integer("head_dim", 64, "Head dimension.")
_BLOCK = flags.DEFINE_integer("block", 512, "Query block of the blockwise back-end.")
_STEPS = flags.DEFINE_integer("steps", 10, "Timed calls (after one warm-up call).")
_INTERPRET = flags.DEFINE_bool("interpret", False, "Pallas interpret mode (CPU smoke test).")
_FLASH_BLOCKS = flags.DEFINE_list(
    "flash_blocks",
    [],
    "flash tiles q,k,bwd_q,bwd_k[,num_warps,num_stages] (powers of two >= 16; default: "
    "flash_attention.Blocks()), for tuning.",
)


def visible_pairs(seq: int, window: int | None) -> int:
    """Query-key pairs a causal (optionally banded) layer computes, the query's own key
    included: sum over i of min(i + 1, window)."""
    if window is None or window >= seq:
        return seq * (seq + 1) // 2
    return window * (window + 1) // 2 + (seq - window) * window


def _layer_fn(impl: str, window, positions, segments):
    def attend(q, k, v, sinks):
        if impl == "flash" and _FLASH_BLOCKS.value:  # the kernel itself, with these tiles
            blocks = flash.Blocks(*(int(b) for b in _FLASH_BLOCKS.value))
            return flash.flash_attention(q, k, v, sinks, positions, segments, window, blocks=blocks)
        return Kernels.of(attention=impl).attention(
            q,
            k,
            v,
            sinks,
            positions=positions,
            segment_ids=segments,
            window=window,
            block=_BLOCK.value,
        )

    def loss(q, k, v, sinks, cot):
        return jnp.sum(attend(q, k, v, sinks).astype(jnp.float32) * cot)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))


def bench_one(seq: int, window, impl: str, args, positions, segments):
    """(record, outputs) for one back-end; outputs None if it ran out of memory."""
    fn = _layer_fn(impl, window, positions, segments)
    record = dict(impl=impl, seq_len=seq, window=window or None, batch=_BATCH.value)
    if impl == "flash" and _FLASH_BLOCKS.value:
        record["flash_blocks"] = ",".join(_FLASH_BLOCKS.value)
    try:
        t0 = time.perf_counter()
        compiled = fn.lower(*args).compile()
        record["compile_s"] = round(time.perf_counter() - t0, 2)
        memory = compiled.memory_analysis()
        if memory is not None:  # XLA's plan for this executable: temporaries + outputs
            used = memory.temp_size_in_bytes + memory.output_size_in_bytes
            record["temp_and_output_gb"] = round(used / 2**30, 3)
        outs = jax.block_until_ready(compiled(*args))  # warm-up
        t0 = time.perf_counter()
        for _ in range(_STEPS.value):
            outs = compiled(*args)
        jax.block_until_ready(outs)
    except Exception as e:  # an out-of-memory error is a result here, not a failure
        if "RESOURCE_EXHAUSTED" not in str(e) and "out of memory" not in str(e).lower():
            raise
        record["error"] = "out of memory"
        return record, None
    seconds = (time.perf_counter() - t0) / _STEPS.value
    # forward 2 matmuls, backward 5 (dV, dP, dQ, dK and the recomputed scores): 2 FLOPs each
    flops = 2 * 7 * _BATCH.value * _HEADS.value * _HEAD_DIM.value * visible_pairs(seq, window)
    record.update(ms=round(seconds * 1e3, 3), model_tflops=round(flops / seconds / 1e12, 3))
    return record, outs


def main(argv):
    del argv
    b, n, kh, h = _BATCH.value, _HEADS.value, _KV_HEADS.value, _HEAD_DIM.value
    device = jax.devices()[0].device_kind
    for seq in (int(s) for s in _SEQ_LENS.value):
        keys = jax.random.split(jax.random.key(0), 5)
        q = jax.random.normal(keys[0], (b, seq, n, h), jnp.bfloat16)
        k = jax.random.normal(keys[1], (b, seq, kh, h), jnp.bfloat16)
        v = jax.random.normal(keys[2], (b, seq, kh, h), jnp.bfloat16)
        sinks = jax.random.normal(keys[3], (n,), jnp.float32)
        cot = jax.random.normal(keys[4], (b, seq, n, h), jnp.float32)
        positions = jnp.tile(jnp.arange(seq, dtype=jnp.int32), (b, 1))
        segments = jnp.ones((b, seq), jnp.int32)
        for window in (int(w) or None for w in _WINDOWS.value):
            first = None
            for impl in _IMPLS.value:
                with interpret.interpret_mode() if _INTERPRET.value else nullcontext():
                    record, outs = bench_one(
                        seq, window, impl, (q, k, v, sinks, cot), positions, segments
                    )
                if outs is not None and first is None:
                    first = (impl, outs)
                elif outs is not None:
                    diffs = [
                        float(np.abs(np.asarray(a, np.float32) - np.asarray(c, np.float32)).max())
                        for a, c in zip(jax.tree.leaves(first[1]), jax.tree.leaves(outs))
                    ]
                    record[f"max_diff_vs_{first[0]}"] = dict(
                        zip(("loss", "dq", "dk", "dv", "dsinks"), diffs)
                    )
                print(json.dumps(dict(device=device, **record)), flush=True)


if __name__ == "__main__":
    app.run(main, flags_parser=errors.parse_flags)
