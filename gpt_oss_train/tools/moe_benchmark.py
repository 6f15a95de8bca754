"""Microbenchmark of the MoE's grouped matmul kernels and expert layer, forward and
forward + backward, against the floor: one dense matmul of the same rows.

  # grouped matmul [rows, hidden] x [experts, hidden, expert_hidden], rows routed top-k
  python -m gpt_oss_train.tools.moe_benchmark --rows=8192 --hidden=768 --expert_hidden=768 \
      --experts=8,32,128 --tiles=128:128,64:16

  # decode-sized batches: gathered, grouped, pairwise and CPU-kernel paths, per token count
  python -m gpt_oss_train.tools.moe_benchmark --mode=decode --experts=32 --tokens=1,2,4,8,16

Rows are (token, choice) pairs of random top-k routings (tokens = rows / k), sorted by
expert as the MoE sorts them. Every time is the best of --repeats after a compiling call.
Prints one JSON record per measurement and a table.
"""

from __future__ import annotations

import json
import time

from absl import app, flags

_MODE = flags.DEFINE_enum("mode", "kernels", ["kernels", "layer", "decode"], "What to time.")
_ROWS = flags.DEFINE_integer("rows", 8192, "kernels/layer: (token, expert) rows.")
_HIDDEN = flags.DEFINE_integer("hidden", 768, "Model dimension (contraction of x @ w).")
_EXPERT_HIDDEN = flags.DEFINE_integer("expert_hidden", 768, "Expert hidden dimension.")
_EXPERTS = flags.DEFINE_list("experts", ["8", "32", "128"], "Expert counts.")
_K = flags.DEFINE_integer("k", 4, "Experts per token.")
_TILES = flags.DEFINE_list(
    "tiles", [], "kernels: tiles (big:small rows) to try besides the default, e.g. 128:32."
)
_RAGGED_MAX = flags.DEFINE_integer(
    "ragged_dot_max_experts", 32, "Time lax.ragged_dot only up to this many experts (slow)."
)
_TOKENS = flags.DEFINE_list("tokens", ["1", "2", "4", "8", "16"], "decode: tokens per step.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed calls per case (best is kept).")
_CLOCK = flags.DEFINE_enum("clock", "wall", ["wall", "cpu"], "What a time is (see best_times).")
_DTYPE = flags.DEFINE_enum(
    "dtype",
    "float32",
    ["float32", "bfloat16"],
    "kernels, decode: x and w dtype (the compute dtype; decode: also the stacked weights).",
)


def best_times(calls: dict) -> dict:
    """{name: (fn, args)} -> {name: best seconds}. Calls are compiled first, then timed
    round-robin, so load from other processes falls on every case alike. --clock=cpu
    counts this process's CPU seconds instead of wall seconds: on a shared machine
    they move less with other jobs' load (but count threads spinning while they wait)."""
    import jax

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
    import jax

    logits = jax.random.normal(jax.random.key(seed), (tokens, experts))
    top, idx = jax.lax.top_k(logits, _K.value)
    return jax.nn.softmax(top, axis=-1), idx


def expert_weights(experts: int, d: int, f: int, seed: int = 1):
    import jax
    import jax.numpy as jnp

    from gpt_oss_train.model import moe

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
    import jax

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
    import jax
    import jax.numpy as jnp

    from gpt_oss_train.kernels import Kernels
    from gpt_oss_train.kernels.tpu import ragged_dot
    from gpt_oss_train.kernels.xla import grouped_matmul as gm

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
    import jax

    from gpt_oss_train.kernels.xla.experts import glu
    from gpt_oss_train.model import moe

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
    import jax

    from gpt_oss_train import runtime, sharding
    from gpt_oss_train.arrays.layer_views import LayerView
    from gpt_oss_train.kernels import Kernels
    from gpt_oss_train.kernels.xla import experts as xla_experts
    from gpt_oss_train.model import moe, streamed_weights

    d, f, dtype = _HIDDEN.value, _EXPERT_HIDDEN.value, jax.numpy.dtype(_DTYPE.value)
    w = expert_weights(experts, d, f)
    layer = jax.numpy.int32(1)
    view = lambda a: LayerView(jax.numpy.stack([a, a]).astype(dtype), layer)
    w = w._replace(**{n: view(getattr(w, n)) for n in streamed_weights.EXPERTS})
    common = dict(limit=7.0, alpha=1.702, dtype=dtype)
    options = runtime.inference_compiler_options(sharding.platform())
    paths = {"gathered": xla_experts.gathered, "grouped": moe.grouped_experts,
             "pairwise": xla_experts.pairwise}  # fmt: skip
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


def main(argv):
    del argv
    from gpt_oss_train import runtime, sharding

    runtime.setup_process(sharding.platform())
    bench = {"kernels": bench_kernels, "layer": bench_layer, "decode": bench_decode}[_MODE.value]
    rows = []
    for e in (int(v) for v in _EXPERTS.value):
        for r in bench(e):
            r = {"mode": _MODE.value, "clock": _CLOCK.value, "rows": _ROWS.value, **r}
            if _MODE.value in ("kernels", "decode"):
                r["dtype"] = _DTYPE.value
            r["hidden"] = _HIDDEN.value
            r["expert_hidden"] = _EXPERT_HIDDEN.value
            print(json.dumps(r), flush=True)
            rows.append(r)
    cols = [c for c in rows[0] if c not in ("mode", "clock", "rows", "hidden", "expert_hidden")]
    cell = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(cell(r[c]) for c in cols) + " |")


if __name__ == "__main__":
    app.run(main)
