"""The GPU suite's own measurements (tools/gpu_suite.py starts each in a process of its
own; one JSON record a line on stdout). Not a command to run by hand: its argument is the
JSON the suite writes, so that every shape lives in the suite's one table.

  env           the devices, jax / jaxlib and the project's packages, as the steps see them
  kernels       the implementations the suite names of attention, grouped_matmul and
                moe_decode (those that run on a GPU), each against the op's XLA reference
                on the same random operands: the largest difference of its outputs (and
                gradients) relative to the reference's largest magnitude, and the mean
                time of a call
  decode_model  the whole model on random weights, bfloat16 or with the experts in MXFP4
                (as the published checkpoints keep them), through decode's benchmark
  interpret     another tool run as its __main__ with the Pallas GPU kernels in interpret
                mode: how the CPU dry run takes the GPU kernels' paths

    python -m gpt_oss_train.tools.gpu_suite_steps kernels '{"interpret": true, ...}'
    python -m gpt_oss_train.tools.gpu_suite_steps interpret gpt_oss_train.tools.bench_model ...
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import platform
import runpy
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from gpt_oss_train import config as config_lib
from gpt_oss_train import runtime, sharding
from gpt_oss_train.arrays import mxfp4_array
from gpt_oss_train.decode import benchmarking
from gpt_oss_train.inference import loading
from gpt_oss_train.kernels import Kernels, registry
from gpt_oss_train.kernels.gpu import interpret
from gpt_oss_train.model import frozen_base, moe

# The project's packages whose versions env reports (the GPU image brings its own).
PACKAGES = (
    "jax",
    "jaxlib",
    "jax-cuda13-plugin",
    "flax",
    "optax",
    "orbax-checkpoint",
    "numpy",
    "ml-dtypes",
    "grain",
    "ml-collections",
    "pytest",
)
LIMIT, ALPHA = 7.0, 1.702  # gpt-oss's SwiGLU clamp and slope


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


# ----------------------------------------------------------------------------- env


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def env(_: dict) -> None:
    devices = jax.devices()
    emit(
        dict(
            python=platform.python_version(),
            platform=devices[0].platform,
            devices=[d.device_kind for d in devices],
            compute_capability=getattr(devices[0], "compute_capability", None),
            packages={p: _version(p) for p in PACKAGES},
        )
    )


# ----------------------------------------------------------------------------- kernels


def rel_err(got, ref) -> float:
    """The largest difference over the leaves, each relative to its reference's largest
    magnitude (the GPU tests' measure: bf16 rounds to 2^-8 of a value)."""
    worst = 0.0
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
        worst = max(worst, float(np.abs(g - r).max()) / (float(np.abs(r).max()) or 1.0))
    return worst


def _with_grads(f, cotangent):
    """jit(args -> (f(args), the gradients of <f(args), cotangent>)): fwd + bwd."""

    def run(*args):
        y, vjp = jax.vjp(f, *args)
        return y, vjp(cotangent)

    return jax.jit(run)


def _mean_ms(fn, args, calls: int):
    """(the first call's outputs, after compiling; ms a call over `calls` more)."""
    out = jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    for _ in range(calls):
        last = fn(*args)
    jax.block_until_ready(last)
    return out, (time.perf_counter() - t0) / calls * 1e3


def _normal(key, shape, dtype, scale=1.0):
    return (scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def attention_cases(s: dict):
    """(case, runner(impl) -> (jitted fn, args, the implementation that runs)) per window."""
    b, t, n, kh, h = s["batch"], s["seq_len"], s["heads"], s["kv_heads"], s["head_dim"]
    keys = jax.random.split(jax.random.key(0), 5)
    q = _normal(keys[0], (b, t, n, h), jnp.bfloat16)
    k = _normal(keys[1], (b, t, kh, h), jnp.bfloat16)
    v = _normal(keys[2], (b, t, kh, h), jnp.bfloat16)
    sinks = _normal(keys[3], (n,), jnp.float32)
    cot = _normal(keys[4], (b, t, n, h), jnp.bfloat16)
    positions = jnp.tile(jnp.arange(t, dtype=jnp.int32), (b, 1))
    segments = jnp.ones((b, t), jnp.int32)
    for window in s["windows"]:

        def runner(impl, window=window):
            kernels = Kernels.of(attention=impl)
            f = lambda q, k, v, sinks: kernels.attention(
                q,
                k,
                v,
                sinks,
                positions=positions,
                segment_ids=segments,
                window=window,
                block=s["block"],
            )
            return _with_grads(f, cot), (q, k, v, sinks), kernels.impl("attention").name

        yield f"seq {t} window {window or 'full'}", runner


def grouped_matmul_cases(s: dict):
    m, k, n, g = s["rows"], s["hidden"], s["out"], s["experts"]
    keys = jax.random.split(jax.random.key(1), 4)
    x = _normal(keys[0], (m, k), jnp.bfloat16)
    w = _normal(keys[1], (g, k, n), jnp.bfloat16, 0.02)
    sizes = jnp.bincount(jax.random.randint(keys[2], (m,), 0, g), length=g).astype(jnp.int32)
    cot = _normal(keys[3], (m, n), jnp.float32)

    def runner(impl):
        kernels = Kernels.of(grouped_matmul=impl)
        chosen = kernels.impl("grouped_matmul")
        runs = chosen.name if chosen.takes(x, w, sizes) else registry.REFERENCE
        f = lambda x, w: kernels.grouped_matmul(x, w, sizes)
        return _with_grads(f, cot), (x, w), runs

    yield f"{m} rows x {g} experts {k}x{n}", runner


def _expert_weights(s: dict, form: str) -> moe.ExpertWeights:
    e, d, f = s["experts"], s["hidden"], s["expert_hidden"]
    keys = jax.random.split(jax.random.key(2), 3)
    mat = lambda key, shape: _normal(key, shape, jnp.float32, 0.02)
    pack = mxfp4_array.quantize if form == "mxfp4" else lambda a: a.astype(jnp.bfloat16)
    gate, up = pack(mat(keys[0], (e, d, f))), pack(mat(keys[1], (e, d, f)))
    down = pack(mat(keys[2], (e, f, d)))
    zeros = lambda *shape: jnp.zeros(shape, jnp.bfloat16)
    return moe.ExpertWeights(gate, zeros(e, f), up, zeros(e, f), down, zeros(e, d))


def moe_decode_cases(s: dict):
    """The model's expert path (moe.ragged_experts) with each moe_decode choice: where
    one declines the batch, the next runs (the reference, then the grouped matmuls)."""
    for form in s["forms"]:
        w = _expert_weights(s, form)
        for t in s["tokens"]:
            keys = jax.random.split(jax.random.key(t), 2)
            x = _normal(keys[0], (t, s["hidden"]), jnp.bfloat16)
            idx = jax.lax.top_k(jax.random.normal(keys[1], (t, s["experts"])), s["k"])[1]
            gates = jnp.full((t, s["k"]), 1.0 / s["k"], jnp.float32)
            common = dict(limit=LIMIT, alpha=ALPHA, dtype=jnp.bfloat16)

            def runner(impl, x=x, idx=idx, gates=gates, w=w):
                kernels = Kernels.of(moe_decode=impl)
                layer = lambda x, w: moe.ragged_experts(x, gates, idx, w, kernels=kernels, **common)
                fn = jax.jit(layer)
                runs = "grouped"
                for chosen in (kernels.impl("moe_decode"), registry.OPS["moe_decode"].reference):
                    if chosen.takes(x, gates, idx, w, **common):
                        runs = chosen.name
                        break
                return fn, (x, w), runs

            yield f"{form} batch {t}", runner


CASES = {
    "attention": attention_cases,
    "grouped_matmul": grouped_matmul_cases,
    "moe_decode": moe_decode_cases,
}


def kernels(spec: dict) -> None:
    """One record per (op, case, implementation): ms a call, rel_err against the XLA
    reference, and which implementation ran (a kernel that declines the operands leaves
    the reference in its place). A failure (out of memory, a kernel that does not
    compile) is that record's `error`, and the others go on."""
    runtime.setup_process(sharding.platform())
    mode = interpret.interpret_mode() if spec["interpret"] else contextlib.nullcontext()
    with mode:
        for op, cases in CASES.items():
            for case, runner in cases(spec[op]):
                ref = None  # the reference's outputs: spec["impls"][op] names it first
                for i, impl in enumerate(spec["impls"][op]):
                    record = dict(op=op, case=case, impl=impl)
                    try:
                        fn, args, runs = runner(impl)
                        out, ms = _mean_ms(fn, args, spec["calls"])
                    except Exception as e:  # a result to report, not a reason to stop
                        emit(dict(record, error=f"{type(e).__name__}: {str(e)[:300]}"))
                        continue
                    ref = out if i == 0 else ref
                    err = None if ref is None else rel_err(out, ref)
                    emit(dict(record, runs=runs, ms=ms, rel_err=err))


# ----------------------------------------------------------------------------- decode_model


def _to_mxfp4(model) -> None:
    """The random model's experts packed as MXFP4 on the devices (the dense ones donated),
    as `decode --weights=mxfp4` keeps a checkpoint's. Before anything is compiled for it."""
    md, mesh, rules = model.md, model.mesh, model.rules
    packed = frozen_base.abstract(md.abstract_params(mesh, rules), "mxfp4", mesh, rules)
    with sharding.use_mesh(mesh, rules):
        model.params = frozen_base.place(model.params, "mxfp4", packed)


def decode_model(spec: dict) -> None:
    """decode's benchmark (TTFT, prefill and decode tokens/s per batch size) of the
    config's model on random weights in spec["weights"]: bfloat16 or mxfp4."""
    config = config_lib.from_file(spec["config"])
    config.update_from_flattened_dict(spec["overrides"])
    runtime.setup_process(sharding.platform())
    model = loading.random_model(config, devices=jax.devices()[:1])
    if spec["weights"] == "mxfp4":
        _to_mxfp4(model)
    rows = benchmarking.benchmark(
        model,
        batch_sizes=spec["batch_sizes"],
        prompt_lengths=[spec["prompt_len"]],
        max_new_tokens=spec["new_tokens"],
        repeats=spec["repeats"],
        opts=loading.Options(max_new_tokens=spec["new_tokens"], prefill_chunk=512),
    )
    common = dict(
        device=jax.devices()[0].device_kind,
        weights=spec["weights"],
        layers=model.cfg.num_layers,
        weight_gb=frozen_base.nbytes(model.params) / 2**30,
    )
    for row in rows:
        emit(dict(common, **row))


# ----------------------------------------------------------------------------- interpret


def run_interpreted(module: str, argv: list[str]) -> None:
    """`module` as its __main__ with argv, the Pallas GPU kernels in interpret mode (the
    mode is this thread's: it holds where the tools trace their steps)."""
    sys.argv = [module, *argv]
    with interpret.interpret_mode():
        runpy.run_module(module, run_name="__main__", alter_sys=True)


STEPS = {"env": env, "kernels": kernels, "decode_model": decode_model}


def main(argv: list[str]) -> None:
    if argv[:1] == ["interpret"]:
        run_interpreted(argv[1], argv[2:])
    else:
        STEPS[argv[0]](json.loads(argv[1]) if len(argv) > 1 else {})


if __name__ == "__main__":
    main(sys.argv[1:])
