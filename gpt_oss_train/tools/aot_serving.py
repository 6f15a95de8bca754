"""The serving engine's programs compiled for a TPU slice from this CPU (aot_compile's
--program=decode|prefill|grpo): the same memory verdict and step model as the train step.

  decode   one token for each of `slots` rows, every row at position `context` - 1: the
           step that bounds a full batch (inference/engine_steps.py's decode)
  prefill  one `chunk` of one slot's prompt, ending at position `context` - 1

A GRPO run's phases (aot_compile --program=grpo compiles its learner step beside the
engine's programs on the trained weights): what stays resident across them, the engine's
KV cache while the learner runs and the optimizer state while the engine samples, and a
rollout's time from the step model.

Serving weights are config.model's in config.param_dtype, or with --weights in one of the
frozen-base forms (model/frozen_base.py: bfloat16, int8, mxfp4 - the published
checkpoints' packed experts, decoded inside the layer scan); adapters are not compiled.
The KV cache and every weight are placed by config.logical_axis_rules as the engine
places them.
"""

from __future__ import annotations

import dataclasses
import time

from gpt_oss_train.tools import compiled_step

GiB = 2**30
ENGINE_PROGRAMS = ("decode", "prefill")


@dataclasses.dataclass(frozen=True)
class Shape:
    """What the engine is sized for (EngineOptions' fields of the same names)."""

    slots: int
    context: int
    chunk: int
    int8_kv_cache: bool = False


def serving_model(config, devices, weights: str):
    """(ModelDef, mesh, rules, abstract params) of config.model served on `devices`, the
    weights in frozen-base form `weights` ("param_dtype": as config.param_dtype)."""
    from gpt_oss_train import architecture, sharding
    from gpt_oss_train import config as config_lib
    from gpt_oss_train.model import frozen_base
    from gpt_oss_train.model.transformer import ModelDef

    config_lib.validate(config)
    rules = sharding.validate_rules(config.logical_axis_rules)
    mesh = sharding.make_mesh(config.mesh, config.mesh_dcn, devices=devices)
    platform = sharding.platform(mesh)
    arch = architecture.validate(config_lib.model_arch(config))
    md = ModelDef(config_lib.ModelConfig.from_config(config, arch, platform).replace(lora=None))
    md.cfg.kernels.check(platform)
    params = md.abstract_params(mesh, rules)
    if weights != "param_dtype":
        params = frozen_base.abstract(params, weights, mesh, rules)
    return md, mesh, rules, params


def lower(md, mesh, rules, params, program: str, shape: Shape):
    """(the abstract KV cache, `program` lowered for the mesh)."""
    import jax
    import jax.numpy as jnp

    from gpt_oss_train import sharding
    from gpt_oss_train.inference import engine as engine_lib
    from gpt_oss_train.inference.engine_steps import EngineSteps
    from gpt_oss_train.inference.sampling import SamplingRows
    from gpt_oss_train.model import kv_cache

    steps = EngineSteps(
        md,
        max_slots=shape.slots,
        max_context=shape.context,
        prefill_chunk=shape.chunk,
        int8_kv_cache=shape.int8_kv_cache,
        block=engine_lib.PREFIX_BLOCK,
        pool_blocks=0,
        top_logprobs=engine_lib.EngineOptions.max_logprobs,
    )
    with sharding.use_mesh(mesh, rules):
        shapes = jax.eval_shape(steps.new_cache)
        cache = jax.tree.map(
            lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
            shapes,
            kv_cache.shardings(shapes, mesh, rules),
        )
        i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
        f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)

        def rows(n):
            settings = SamplingRows(f32(n), i32(n), f32(n), jax.ShapeDtypeStruct((n,), jnp.uint32),
                                    i32(n))  # fmt: skip
            return settings, jax.ShapeDtypeStruct((n,), jnp.bool_), i32(n)

        if program == "decode":
            settings, want_top, adapter_ids = rows(shape.slots)
            lowered = steps.decode.lower(
                params, cache, i32(shape.slots), i32(shape.slots), settings, want_top,
                adapter_ids, rows=shape.slots, context=shape.context,
            )  # fmt: skip
        else:
            settings, want_top, adapter_ids = rows(1)
            lowered = steps.prefill.lower(
                params, cache, i32(), i32(1, shape.chunk), i32(1, shape.chunk), i32(),
                settings, want_top, adapter_ids, context=shape.context,
            )  # fmt: skip
    return cache, lowered


def figures(md, mesh, rules, params, cache, program: str, shape: Shape, devices) -> dict:
    """The program's model side: sizes, and the model FLOPs and tokens of one call."""
    from gpt_oss_train.model import parameters
    from gpt_oss_train.training import flops

    tokens = shape.slots if program == "decode" else shape.chunk
    counts = parameters.counts(md.cfg)
    return {
        "program": program,
        "shape": dataclasses.asdict(shape),
        "mesh": dict(mesh.shape),
        "devices": len(devices),
        "device_kind": devices[0].device_kind,
        "params_total": counts["total"],
        "params_active": counts["active"],
        "weights_bytes_per_device": compiled_step.bytes_per_device(params),
        "kv_cache_bytes_per_device": compiled_step.bytes_per_device(cache),
        "tokens_per_step": tokens,
        "loop_trips": {"layer_blocks": md.cfg.num_blocks if md.cfg.scan_layers else 1},
        # Every token against the whole context: decode at the last position of the
        # cache, the prefill chunk ending there (an upper bound on its attention).
        "model_flops_per_device": (
            flops.decode_flops_per_token(md.cfg, shape.context) * tokens / len(devices)
        ),
        "ragged_rows": compiled_step.ragged_rows(md.cfg.moe_impl, mesh, rules),
    }


def compile_program(
    config, devices, program: str, shape: Shape, weights: str, dump_dir: str | None
) -> dict:
    """Lowers and compiles the engine's `program` for `devices`; its figures per device."""
    t0 = time.perf_counter()
    md, mesh, rules, params = serving_model(config, devices, weights)
    cache, lowered = lower(md, mesh, rules, params, program, shape)
    info = figures(md, mesh, rules, params, cache, program, shape, devices)
    info["weights"] = weights if weights != "param_dtype" else config.param_dtype
    info["lower_s"] = time.perf_counter() - t0
    return compiled_step.compile_lowered(info, lowered, mesh, rules, dump_dir)


def phases(r: dict, beside_engine: int) -> dict:
    """Bytes per device of a GRPO step's two phases: the learner's step with the engine's
    KV cache kept, and each engine program with the optimizer state (`beside_engine`)."""
    learner, decode, prefill = r["learner"], r["decode"], r["prefill"]
    if any(p["error"] for p in (learner, decode, prefill)):
        return {}
    cache = decode["kv_cache_bytes_per_device"]
    return {
        "learning": learner["total_bytes"] + cache,
        "rollout": max(decode["total_bytes"], prefill["total_bytes"]) + beside_engine,
        "kv_cache": cache,
        "beside_engine": beside_engine,
    }


def rollout_estimate(r: dict, config) -> dict:
    """A rollout's seconds from the step model: every row's prompt prefilled one chunk a
    call (the engine prefills one slot at a time), then max_new_tokens decode steps of
    the whole batch at the longest context (an upper bound: contexts grow from the
    prompt's end)."""
    rl = config.rl
    step = lambda p: (r[p].get("estimate") or {}).get("step_s")
    prefill_s, decode_s = step("prefill"), step("decode")
    if prefill_s is None or decode_s is None:
        return {}
    chunks = -(-rl.max_prompt_tokens // r["prefill"]["shape"]["chunk"])
    rows = config.train.global_batch_size
    out = {"prefill_s": rows * chunks * prefill_s, "decode_s": rl.max_new_tokens * decode_s}
    out["rollout_s"] = out["prefill_s"] + out["decode_s"]
    learner_s = (r["learner"].get("estimate") or {}).get("step_s")
    if learner_s:
        out["learner_s"] = learner_s
        out["grpo_step_s"] = out["rollout_s"] + learner_s
    return out


# -- the report -----------------------------------------------------------------------------


def setup_lines(r: dict) -> list[str]:
    s = r["shape"]
    what = (
        f"decode step of {s['slots']} rows at position {s['context'] - 1}"
        if r["program"] == "decode"
        else f"prefill chunk of {s['chunk']} tokens ending at position {s['context'] - 1}"
    )
    return [
        f"target      {r['devices']} x {r['device_kind']} ({r['topology']}), mesh {r['mesh']}",
        f"compiler    libtpu {r['libtpu_version']}"
        + (f", LIBTPU_INIT_ARGS={r['libtpu_init_args']}" if r["libtpu_init_args"] else ""),
        f"program     the engine's {what}",
        f"model       {r['params_total'] / 1e9:.2f}B params ({r['params_active'] / 1e9:.2f}B "
        f"active), weights {r['weights']}",
        f"time        lower {r['lower_s']:.1f} s, compile {r['compile_s']:.1f} s",
        f"weights     {r['weights_bytes_per_device'] / GiB:.2f} GiB per device; KV cache "
        f"{r['kv_cache_bytes_per_device'] / GiB:.2f} GiB ({s['slots']} slots x "
        f"{s['context']} positions" + (", int8" if s["int8_kv_cache"] else "") + ")",
    ]


def decode_line(r: dict) -> list[str]:
    e = r.get("estimate") or {}
    if r["program"] != "decode" or not e.get("step_s"):
        return []
    rows = r["shape"]["slots"]
    return [
        f"decode      {rows / e['step_s']:.0f} tokens/s for the slice at {rows} rows "
        f"({1e3 * e['step_s']:.2f} ms a step; each row {1 / e['step_s']:.0f} tokens/s)"
    ]


def grpo_lines(r: dict, hbm: int | None) -> list[str]:
    p, est = r["phases"], r["rollout_estimate"]
    lines = ["GRPO step:"]
    if not p:
        return lines + ["  a program did not compile: no phase figures"]
    g = lambda b: f"{b / GiB:.2f} GiB"
    lines += [
        f"  learning  {g(p['learning'])} = the learner step's total + the engine's KV cache "
        f"({g(p['kv_cache'])}, kept between rollouts)",
        f"  rollout   {g(p['rollout'])} = the larger engine program's total + the optimizer "
        f"state and any reference copy ({g(p['beside_engine'])})",
    ]
    if est:
        lines.append(
            f"  estimate  rollout {est['rollout_s']:.1f} s (prefill {est['prefill_s']:.1f} s, "
            f"one slot a call; decode {est['decode_s']:.1f} s at the longest context)"
            + (
                f" + learner {est['learner_s']:.2f} s = {est['grpo_step_s']:.1f} s a step"
                if "learner_s" in est
                else ""
            )
        )
    if hbm:
        peak = max(p["learning"], p["rollout"])
        word = "fits" if peak <= hbm else "does not fit"
        lines.append(f"verdict     {word} ({g(peak)} at the larger phase, of {hbm / GiB:g} GiB)")
    return lines
