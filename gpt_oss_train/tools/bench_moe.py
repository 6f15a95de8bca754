"""Microbenchmarks of the MoE's expert computation: the grouped matmul kernels and expert
layer, forward and forward + backward, against the floor (one dense matmul of the same
rows); one layer's experts at decode sizes by path; and the decode expert kernels.

  # grouped matmul [rows, hidden] x [experts, hidden, expert_hidden], rows routed top-k
  python -m gpt_oss_train.tools.bench_moe --rows=8192 --hidden=768 --expert_hidden=768 \
      --experts=8,32,128 --tiles=128:128,64:16

  # decode-sized batches: gathered, grouped, pairwise and CPU-kernel paths, per token count
  python -m gpt_oss_train.tools.bench_moe --mode=decode --experts=32 --tokens=1,2,4,8,16

  # the decode expert kernels at gpt-oss-20b's experts (32 x 2880 -> 2 x 2880 -> 2880,
  # top-4): today's bf16 path (`moe.ragged_experts`: gathered below t*k <= E/4, grouped
  # matmuls above), the decode kernel over the chosen experts' tiles with bf16
  # contraction-minor weights (kernels/gpu/decode_experts.py), and the same kernel on
  # MXFP4 weights (mxfp4_experts.py); 16 routings per compiled call
  python -m gpt_oss_train.tools.bench_moe --mode=decode_kernels --tokens=1,2,8,64 \
      --impls=ragged,tiled,mxfp4

--mode=kernels|layer|decode: rows are (token, choice) pairs of random top-k routings
(tokens = rows / k), sorted by expert as the MoE sorts them. Every time is the best of
--repeats after a compiling call.

--mode=decode_kernels: microseconds per layer (the mean of --steps calls of --routings
layers each, after a warm-up call), the distinct experts the routings touch, and the
bandwidth on those experts' bytes (each read once: the bound a decode kernel should
approach). Weights are random (values do not change the timing);
tests/kernels/test_mxfp4_experts.py checks the numbers. Unless given, --hidden, --expert_hidden,
--experts and --tokens are gpt-oss-20b's decode shapes (DECODE_KERNELS_DEFAULTS), not the
CPU-sized defaults of the other modes. --interpret: Pallas interpret mode, for a CPU
smoke test with tiny shapes (not a timing).

Prints one JSON record per measurement and a table.
"""

from __future__ import annotations

import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from gpt_oss_train import errors, runtime, sharding
from gpt_oss_train.arrays.layer_views import LayerView
from gpt_oss_train.kernels import Kernels
from gpt_oss_train.kernels.gpu import decode_experts
from gpt_oss_train.kernels.gpu import mxfp4_experts as mx
from gpt_oss_train.kernels.tpu import ragged_dot
from gpt_oss_train.kernels.xla import experts as xla_experts
from gpt_oss_train.kernels.xla import grouped_matmul as gm
from gpt_oss_train.kernels.xla.experts import glu
from gpt_oss_train.model import moe, streamed_weights

MODES = ["kernels", "layer", "decode", "decode_kernels"]
_MODE = flags.DEFINE_enum("mode", "kernels", MODES, "What to time.")
_ROWS = flags.DEFINE_integer("rows", 8192, "kernels/layer: (token, expert) rows.")
_HIDDEN = flags.DEFINE_integer(
    "hidden", 768, "Model dimension (contraction of x @ w); decode_kernels: 2880 unless given."
)
_EXPERT_HIDDEN = flags.DEFINE_integer(
    "expert_hidden", 768, "Expert hidden dimension; decode_kernels: 2880 unless given."
)
_EXPERTS = flags.DEFINE_list(
    "experts", ["8", "32", "128"], "Expert counts; decode_kernels: 32 unless given."
)
_K = flags.DEFINE_integer("k", 4, "Experts per token.")
_TILES = flags.DEFINE_list(
    "tiles", [], "kernels: tiles (big:small rows) to try besides the default, e.g. 128:32."
)
_RAGGED_MAX = flags.DEFINE_integer(
    "ragged_dot_max_experts", 32, "Time lax.ragged_dot only up to this many experts (slow)."
)
_TOKENS = flags.DEFINE_list(
    "tokens",
    ["1", "2", "4", "8", "16"],
    "decode, decode_kernels: tokens per step (decode_kernels: 1,8,64 unless given).",
)
_REPEATS = flags.DEFINE_integer(
    "repeats", 3, "kernels, layer, decode: timed calls per case (best is kept)."
)
_CLOCK = flags.DEFINE_enum(
    "clock", "wall", ["wall", "cpu"], "kernels, layer, decode: what a time is (see best_times)."
)
_DTYPE = flags.DEFINE_enum(
    "dtype",
    "float32",
    ["float32", "bfloat16"],
    "kernels, decode: x and w dtype (the compute dtype; decode: also the stacked weights).",
)
_IMPLS = flags.DEFINE_list(
    "impls",
    ["ragged", "tiled", "mxfp4"],
    "decode_kernels: ragged | tiled (both bf16 weights) | mxfp4.",
)
_ROUTINGS = flags.DEFINE_integer(
    "routings", 16, "decode_kernels: layers (routings) per compiled call."
)
_STEPS = flags.DEFINE_integer(
    "steps", 10, "decode_kernels: timed calls (after one warm-up call), averaged."
)
_INTERPRET = flags.DEFINE_bool(
    "interpret", False, "decode_kernels: Pallas interpret mode (CPU smoke test)."
)

# --mode=decode_kernels, for each of these flags not given: gpt-oss-20b's experts at
# decode batch sizes, the shapes the GPU decode kernels are built for (the other modes'
# defaults are sized for a CPU).
DECODE_KERNELS_DEFAULTS = {
    "hidden": 2880,
    "expert_hidden": 2880,
    "experts": ["32"],
    "tokens": ["1", "8", "64"],
}


def value(flag):
    """The flag's value, or its --mode=decode_kernels default (DECODE_KERNELS_DEFAULTS)."""
    if _MODE.value == "decode_kernels" and not flag.present:
        return DECODE_KERNELS_DEFAULTS.get(flag.name, flag.value)
    return flag.value


def best_times(calls: dict) -> dict:
    """{name: (fn, args)} -> {name: best seconds}. Calls are compiled first, then timed
    round-robin, so load from other processes falls on every case alike. --clock=cpu
    counts this process's CPU seconds instead of wall seconds: on a shared machine
    they move less with other jobs' load (but count threads spinning while they wait)."""
    clock = time.process_time if _CLOCK.value == "cpu" else time.perf_counter
    for fn, args in calls.values():
        jax.block_until_ready(fn(*args))
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(_REPEATS.value):
        for name, (fn, args) in calls.items():
            t0 = clock()
            jax.block_until_ready(fn(*args))
            best[name] = min(best[name], clock() - t0)
    return best


def routing(tokens: int, experts: int, seed: int = 0):
    """Top-k of random logits: (weights [T, k] float32, experts [T, k] int32)."""
    logits = jax.random.normal(jax.random.key(seed), (tokens, experts))
    top, idx = jax.lax.top_k(logits, _K.value)
    return jax.nn.softmax(top, axis=-1), idx


def expert_weights(experts: int, d: int, f: int, seed: int = 1):
    keys = jax.random.split(jax.random.key(seed), 3)
    mat = lambda key, shape: 0.02 * jax.random.normal(key, shape, jnp.float32)
    return moe.ExpertWeights(
        wi_gate=mat(keys[0], (experts, d, f)),
        bi_gate=jnp.zeros((experts, f)),
        wi_up=mat(keys[1], (experts, d, f)),
        bi_up=jnp.zeros((experts, f)),
        wo=mat(keys[2], (experts, f, d)),
        bo=jnp.zeros((experts, d)),
    )


def _time_fwd_and_vjp(cases: dict, x, w, experts: int) -> list[dict]:
    """Each case jitted forward, and forward + backward (a vjp with a fixed cotangent);
    times relative to the first case (the floor)."""
    calls = {}
    for name, fn in cases.items():
        out = jax.eval_shape(fn, x, w)  # float32 or the operands' dtype, per kernel
        ct = jax.random.normal(jax.random.key(2), out.shape).astype(out.dtype)
        calls[(name, "fwd")] = (jax.jit(fn), (x, w))
        vjp = jax.jit(lambda x, w, ct, fn=fn: jax.vjp(fn, x, w)[1](ct))
        calls[(name, "vjp")] = (vjp, (x, w, ct))
    t = best_times(calls)
    floor = next(iter(cases))
    return [
        dict(
            experts=experts,
            kernel=name,
            fwd_ms=t[(name, "fwd")] * 1e3,
            fwd_bwd_ms=t[(name, "vjp")] * 1e3,
            fwd_bwd_vs_floor=t[(name, "vjp")] / t[(floor, "vjp")],
        )
        for name in cases
    ]


def bench_kernels(experts: int) -> list[dict]:
    rows, d, f = _ROWS.value, _HIDDEN.value, _EXPERT_HIDDEN.value
    _, idx = routing(rows // _K.value, experts)
    group_sizes = jnp.bincount(idx.reshape(-1), length=experts).astype(jnp.int32)
    x = jax.random.normal(jax.random.key(3), (rows, d)).astype(_DTYPE.value)
    w = expert_weights(experts, d, f).wi_gate.astype(_DTYPE.value)
    cases = {"floor (one dense matmul)": lambda x, w: x @ w[0]}
    if experts <= _RAGGED_MAX.value:
        cases["ragged_dot"] = lambda x, w: ragged_dot.grouped_matmul(x, w, group_sizes)
    default = gm.tile_rows(rows, experts)
    others = [gm.Tiles(*(int(v) for v in t.split(":"))) for t in _TILES.value]
    for tiles in sorted({default, *others}, reverse=True):
        name = f"tiled {tiles.big}:{tiles.small}" + (" (default)" if tiles == default else "")
        cases[name] = lambda x, w, t=tiles: gm.tiled_grouped_matmul(x, w, group_sizes, t)
    chosen = Kernels().impl("grouped_matmul")
    if chosen.name != "xla" and chosen.takes(x, w, group_sizes):
        cases[f"{chosen.name} (the platform's kernel)"] = lambda x, w: chosen.call(
            x, w, group_sizes
        )
    return _time_fwd_and_vjp(cases, x, w, experts)


def bench_layer(experts: int) -> list[dict]:
    """The whole expert computation (moe.ragged_experts: sort, three grouped matmuls,
    GLU, combine) against a dense FFN on the same rows (what the active experts cost)."""
    rows, d, f = _ROWS.value, _HIDDEN.value, _EXPERT_HIDDEN.value
    tokens = rows // _K.value
    weights, idx = routing(tokens, experts)
    w = expert_weights(experts, d, f)
    x = jax.random.normal(jax.random.key(3), (tokens, d))
    common = dict(limit=7.0, alpha=1.702, dtype=x.dtype)

    def floor(x, w):
        xr = jax.numpy.repeat(x, _K.value, axis=0)
        act = glu(xr @ w.wi_gate[0], xr @ w.wi_up[0], 7.0, 1.702)
        return (act @ w.wo[0]).reshape(tokens, _K.value, d).sum(1)

    cases = {
        "floor (dense FFN, same rows)": floor,
        "ragged (platform kernel)": lambda x, w: moe.ragged_experts(x, weights, idx, w, **common),
    }
    return _time_fwd_and_vjp(cases, x, w, experts)


def bench_decode(experts: int) -> list[dict]:
    """Forward of one MoE layer at decode sizes, its expert matrices read from a stack of
    two layers as inference streams them (arrays/layer_views.py): gathered weights,
    grouped matmul, pairs one at a time, and the CPU kernel (where it builds). The same
    routing is timed again and again, so the chosen experts may sit in the CPU's last-level
    cache at small batches (4 experts of 768 x 768 fit a 32 MB L3), which a model's layers
    never do. Compiled as inference compiles (runtime.inference_compiler_options)."""
    d, f, dtype = _HIDDEN.value, _EXPERT_HIDDEN.value, jax.numpy.dtype(_DTYPE.value)
    w = expert_weights(experts, d, f)
    layer = jax.numpy.int32(1)
    view = lambda a: LayerView(jax.numpy.stack([a, a]).astype(dtype), layer)
    w = w._replace(**{n: view(getattr(w, n)) for n in streamed_weights.EXPERTS})
    common = dict(limit=7.0, alpha=1.702, dtype=dtype)
    options = runtime.inference_compiler_options(sharding.platform())
    paths = {
        "gathered": xla_experts.gathered,
        "grouped": moe.grouped_experts,
        "pairwise": xla_experts.pairwise,
    }
    chosen = Kernels().impl("moe_decode")
    if chosen.name != "xla":
        paths[f"{chosen.name}_kernel"] = chosen.call
    out = []
    for t in (int(v) for v in _TOKENS.value):
        weights, idx = routing(t, experts)
        x = jax.random.normal(jax.random.key(3), (t, d)).astype(dtype)
        run = lambda fn: jax.jit(
            lambda x, w: fn(x, weights, idx, w, **common), compiler_options=options
        )
        calls = {name: (run(fn), (x, w)) for name, fn in paths.items()}
        best = best_times(calls)
        out.append(dict(experts=experts, tokens=t, **{f"{n}_ms": best[n] * 1e3 for n in paths}))
    return out


# ----------------------------------------------------------------------------- decode kernels


def _kernel_weights(impl: str, experts: int, key):
    """Random expert weights in the back-end's layout, and the bytes one expert occupies."""
    e, d, f = experts, value(_HIDDEN), value(_EXPERT_HIDDEN)
    keys = jax.random.split(key, 4)
    if impl in ("ragged", "tiled"):
        normal = lambda k, shape: (jax.random.normal(k, shape, jnp.float32) * 0.02).astype(
            jnp.bfloat16
        )
        w = moe.ExpertWeights(
            normal(keys[0], (e, d, f)),
            jnp.zeros((e, f), jnp.bfloat16),
            normal(keys[1], (e, d, f)),
            jnp.zeros((e, f), jnp.bfloat16),
            normal(keys[2], (e, f, d)),
            jnp.zeros((e, d), jnp.bfloat16),
        )
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


def _kernel_layer(impl: str):
    kw = dict(limit=7.0, alpha=1.702, dtype=jnp.bfloat16)
    if impl == "ragged":
        return functools.partial(moe.ragged_experts, **kw)
    if impl == "tiled":
        return functools.partial(decode_experts.dense_ffn, interpret=_INTERPRET.value, **kw)
    if impl == "mxfp4":
        return functools.partial(mx.mxfp4_ffn, interpret=_INTERPRET.value, **kw)
    raise app.UsageError(f"--impls: unknown back-end {impl!r}; use ragged, tiled or mxfp4")


def _time_decode_kernel(impl: str, experts: int, batch: int) -> dict:
    """One back-end's layer over --routings routings of `batch` tokens in one compiled
    call: microseconds a layer, distinct experts touched, bandwidth on their bytes."""
    layer = _kernel_layer(impl)
    w, expert_bytes = _kernel_weights(impl, experts, jax.random.key(0))
    e, k, r = experts, _K.value, _ROUTINGS.value
    rng = np.random.RandomState(batch)
    idx = np.stack([[rng.choice(e, k, replace=False) for _ in range(batch)] for _ in range(r)])
    x = jax.random.normal(jax.random.key(1), (batch, value(_HIDDEN)), jnp.bfloat16)
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


def bench_decode_kernels(experts: int) -> list[dict]:
    """One MoE layer's experts at decode batch sizes (--tokens), by back-end (--impls)."""
    return [
        dict(
            device=jax.devices()[0].device_kind,
            experts=experts,
            **_time_decode_kernel(impl, experts, batch),
        )
        for batch in (int(b) for b in value(_TOKENS))
        for impl in _IMPLS.value
    ]


# ----------------------------------------------------------------------------- the command

BENCHES = {
    "kernels": bench_kernels,
    "layer": bench_layer,
    "decode": bench_decode,
    "decode_kernels": bench_decode_kernels,
}


def _record(r: dict) -> dict:
    """A measurement with the settings it was taken under."""
    if _MODE.value == "decode_kernels":  # its own clock (a mean of --steps), bf16 / MXFP4
        r = {"mode": _MODE.value, **r}
    else:
        r = {"mode": _MODE.value, "clock": _CLOCK.value, "rows": _ROWS.value, **r}
    if _MODE.value in ("kernels", "decode"):
        r["dtype"] = _DTYPE.value
    r["hidden"] = value(_HIDDEN)
    r["expert_hidden"] = value(_EXPERT_HIDDEN)
    return r


def main(argv):
    del argv
    runtime.setup_process(sharding.platform())
    rows = []
    for e in (int(v) for v in value(_EXPERTS)):
        for r in BENCHES[_MODE.value](e):
            r = _record(r)
            print(json.dumps(r), flush=True)
            rows.append(r)
    cols = [c for c in rows[0] if c not in ("mode", "clock", "rows", "hidden", "expert_hidden")]
    cell = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(cell(r[c]) for c in cols) + " |")


if __name__ == "__main__":
    app.run(main, flags_parser=errors.parse_flags)
