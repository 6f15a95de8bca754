"""The serving engine's programs compiled for a TPU slice from this CPU (the AOT check's
--program=decode|prefill): the same memory verdict and step model as the train step, so
a serving deployment is sized before it is booked, as a training run is.

  decode   one token for each of `slots` rows, every row at position `context` - 1: the
           step that bounds a full batch (inference/engine_steps.py's decode)
  prefill  one `chunk` of one slot's prompt, ending at position `context` - 1

Serving weights are config.model's in config.param_dtype, or with --weights in one of the
frozen-base forms (model/frozen_base.py: bfloat16, int8, mxfp4 - the published
checkpoints' packed experts, decoded inside the layer scan); adapters are not compiled.
The KV cache and every weight are placed by config.logical_axis_rules as the engine
places them. A GRPO run compiles the same programs on its trained weights (grpo.py).
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp

from gpt_oss_train import architecture, sharding
from gpt_oss_train import config as config_lib
from gpt_oss_train.aot import compiled_step
from gpt_oss_train.inference import engine as engine_lib
from gpt_oss_train.inference.engine_steps import EngineSteps
from gpt_oss_train.inference.sampling import SamplingRows
from gpt_oss_train.model import frozen_base, kv_cache, parameters
from gpt_oss_train.model.transformer import ModelDef
from gpt_oss_train.training import flops

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
            # no logit adjustments or grammars: the program every batch without them runs
            u32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.uint32)
            settings = SamplingRows(
                f32(n), i32(n), f32(n), u32(n), i32(n), i32(n, 0), f32(n, 0), u32(n, 0)
            )
            return settings, jax.ShapeDtypeStruct((n,), jnp.bool_), i32(n)

        if program == "decode":
            settings, want_top, adapter_ids = rows(shape.slots)
            lowered = steps.decode.lower(
                params,
                cache,
                i32(shape.slots),
                i32(shape.slots),
                settings,
                want_top,
                adapter_ids,
                rows=shape.slots,
                context=shape.context,
            )
        else:
            settings, want_top, adapter_ids = rows(1)
            lowered = steps.prefill.lower(
                params,
                cache,
                i32(),
                i32(1, shape.chunk),
                i32(1, shape.chunk),
                i32(),
                settings,
                want_top,
                adapter_ids,
                context=shape.context,
            )
    return cache, lowered


def figures(md, mesh, rules, params, cache, program: str, shape: Shape, devices) -> dict:
    """The program's model side: sizes, and the model FLOPs and tokens of one call."""
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
        "ragged_rows": compiled_step.ragged_rows(
            md.cfg.moe_impl, mesh, rules, md.cfg.moe_capacity_factor
        ),
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
