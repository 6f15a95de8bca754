"""Time one MoE layer's expert computation at decode batch sizes, by expert back-end.

  # gpt-oss-20b experts (32 x 2880 -> 2 x 2880 -> 2880, top-4): today's bf16 path
  # (`moe.ragged_experts`: gathered below t*k <= E/4, grouped matmuls above), the decode
  # kernel over the chosen experts' tiles with bf16 contraction-minor weights
  # (kernels/gpu/decode_experts.py), and the same kernel on MXFP4 weights (mxfp4_experts.py);
  # 16 routings per compiled call
  python -m gpt_oss_train.tools.bench_moe_decode --batch_sizes=1,2,8,64 --impls=ragged,tiled,mxfp4

Prints one JSON object per (batch, back-end): microseconds per layer, the distinct experts
the routings touch, and the bandwidth on those experts' bytes (each read once: the bound a
decode kernel should approach). Weights are random (values do not change the timing);
tests/test_mxfp4_experts.py checks the numbers. --interpret: Pallas interpret mode, for a
CPU smoke test with tiny shapes (not a timing).
"""

from __future__ import annotations

import json
import time

from absl import app, flags

_BATCH_SIZES = flags.DEFINE_list("batch_sizes", ["1", "8", "64"], "Tokens per decode step.")
_IMPLS = flags.DEFINE_list(
    "impls", ["ragged", "tiled", "mxfp4"], "ragged | tiled (both bf16 weights) | mxfp4."
)
_EXPERTS = flags.DEFINE_integer("experts", 32, "Experts.")
_TOP_K = flags.DEFINE_integer("top_k", 4, "Experts per token.")
_HIDDEN = flags.DEFINE_integer("hidden", 2880, "Hidden size D.")
_FFN = flags.DEFINE_integer("intermediate", 2880, "Expert hidden size F.")
_ROUTINGS = flags.DEFINE_integer("routings", 16, "Layers (routings) per compiled call.")
_STEPS = flags.DEFINE_integer("steps", 10, "Timed calls (after one warm-up call).")
_INTERPRET = flags.DEFINE_bool("interpret", False, "Pallas interpret mode (CPU smoke test).")


def _weights(impl: str, key):
    """Random expert weights in the back-end's layout, and the bytes one expert occupies."""
    import jax
    import jax.numpy as jnp

    from gpt_oss_train.kernels.gpu import decode_experts
    from gpt_oss_train.kernels.gpu import mxfp4_experts as mx
    from gpt_oss_train.model import moe

    e, d, f = _EXPERTS.value, _HIDDEN.value, _FFN.value
    keys = jax.random.split(key, 4)
    if impl in ("ragged", "tiled"):
        normal = lambda k, shape: (jax.random.normal(k, shape, jnp.float32) * 0.02).astype(
            jnp.bfloat16
        )
        w = moe.ExpertWeights(
            normal(keys[0], (e, d, f)), jnp.zeros((e, f), jnp.bfloat16),
            normal(keys[1], (e, d, f)), jnp.zeros((e, f), jnp.bfloat16),
            normal(keys[2], (e, f, d)), jnp.zeros((e, d), jnp.bfloat16),
        )  # fmt: skip
        return (w if impl == "ragged" else decode_experts.to_contraction_minor(w)), 3 * d * f * 2

    def matrix(k, out, inp):
        groups = -(-(inp // 32) // mx.GROUP_TILE) * mx.GROUP_TILE
        codes = jax.random.randint(k, (e, out, groups * 16), 0, 256).astype(jnp.uint8)
        scales = jnp.full((e, out, groups), 120, jnp.uint8)  # 2^-7: weights ~0.01-0.05
        return mx.MXFP4Matrix(codes, scales)

    w = decode_experts.DecodeExperts(
        matrix(keys[0], 2 * f, d), jnp.zeros((e, 2 * f)), matrix(keys[1], d, f), jnp.zeros((e, d))
    )
    return w, 3 * d * f // 2 + 3 * d * f // 32


def _layer(impl: str):
    import functools

    import jax.numpy as jnp

    from gpt_oss_train.kernels.gpu import decode_experts
    from gpt_oss_train.kernels.gpu import mxfp4_experts as mx
    from gpt_oss_train.model import moe

    kw = dict(limit=7.0, alpha=1.702, dtype=jnp.bfloat16)
    if impl == "ragged":
        return functools.partial(moe.ragged_experts, **kw)
    if impl == "tiled":
        return functools.partial(decode_experts.dense_ffn, interpret=_INTERPRET.value, **kw)
    if impl == "mxfp4":
        return functools.partial(mx.mxfp4_ffn, interpret=_INTERPRET.value, **kw)
    raise app.UsageError(f"--impls: unknown back-end {impl!r}; use ragged, tiled or mxfp4")


def bench(impl: str, batch: int):
    import jax
    import jax.numpy as jnp
    import numpy as np

    layer = _layer(impl)
    w, expert_bytes = _weights(impl, jax.random.key(0))
    e, k, r = _EXPERTS.value, _TOP_K.value, _ROUTINGS.value
    rng = np.random.RandomState(batch)
    idx = np.stack([[rng.choice(e, k, replace=False) for _ in range(batch)] for _ in range(r)])
    x = jax.random.normal(jax.random.key(1), (batch, _HIDDEN.value), jnp.bfloat16)
    gates = jnp.full((batch, k), 1.0 / k, jnp.float32)

    @jax.jit
    def layers(x, idx_rtk, w):  # r layers in one call: the per-call overhead amortizes
        def one(x, idx_tk):
            return layer(x, gates, idx_tk, w).astype(x.dtype), None

        return jax.lax.scan(one, x, idx_rtk)[0]

    idx = jnp.asarray(idx, jnp.int32)
    jax.block_until_ready(layers(x, idx, w))
    t0 = time.perf_counter()
    for _ in range(_STEPS.value):
        out = layers(x, idx, w)
    jax.block_until_ready(out)
    seconds = (time.perf_counter() - t0) / _STEPS.value / r
    distinct = np.mean([len(np.unique(np.asarray(i))) for i in idx])
    return dict(
        impl=impl,
        batch=batch,
        us_per_layer=round(seconds * 1e6, 1),
        distinct_experts=float(distinct),
        tb_per_s=round(distinct * expert_bytes / seconds / 1e12, 3),
    )


def main(argv):
    del argv
    import jax

    for batch in (int(b) for b in _BATCH_SIZES.value):
        for impl in _IMPLS.value:
            record = dict(device=jax.devices()[0].device_kind, **bench(impl, batch))
            print(json.dumps(record), flush=True)


if __name__ == "__main__":
    app.run(main)
