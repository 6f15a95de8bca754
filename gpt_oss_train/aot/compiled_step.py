"""A lowered program compiled for a TPU slice, and what the compiled program says: XLA's
memory figures per chip, its cost analysis, and the step model's account and estimate
(step_model.py). Shared by every program the AOT check compiles (the train step, the
serving engine's steps) and by MaxText's step (maxtext.py), so all read alike.

`info` carries the model's side of a program: device_kind, devices, the model FLOPs and
tokens per step and chip (model_flops_per_device, tokens_per_step), and the share of a
grouped matmul's rows that hold data (ragged_rows).
"""

from __future__ import annotations

import math
import time

import jax

from gpt_oss_train import hardware, sharding
from gpt_oss_train.aot import hlo_text, step_model


def bytes_per_device(tree) -> int:
    """Bytes of one device's shards of an array or a tree of (abstract) sharded arrays."""
    return sum(
        math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(tree)
    )


def ragged_rows(moe_impl: str, mesh, rules, capacity_factor: float = 0.0) -> float:
    """The share of a grouped matmul's rows that hold data under balanced routing: expert
    parallelism sizes them for the worst routing (every pair on one shard), 1/expert of
    them holding data, or with a capacity (config.moe_capacity_factor) for that multiple
    of a shard's balanced share, 1/capacity_factor of them (the first round's)."""
    if moe_impl != "sharded":
        return 1.0
    exp_axes = sharding.spec_axes(sharding.logical_to_spec(("exp",), rules)[0])
    shards = math.prod(mesh.shape[a] for a in exp_axes)
    return min(1.0, 1.0 / (min(capacity_factor, shards) if capacity_factor > 0 else shards))


def compile_lowered(info: dict, lowered, mesh, rules, dump_dir: str | None) -> dict:
    """Compiles a lowered program under the mesh it was lowered for and adds its memory
    and step-model figures to `info` (which holds the model's side: device_kind, devices,
    model_flops_per_device, tokens_per_step, ragged_rows); with "error" set, and no memory
    breakdown, when XLA finds it does not fit."""
    # The dump holds XLA's memory-usage report, which it writes even when the program does
    # not fit: the only way to see what filled the memory in that case.
    options = {"xla_dump_to": dump_dir, "xla_dump_hlo_pass_re": "NONE"} if dump_dir else {}
    t0 = time.perf_counter()
    try:
        with sharding.use_mesh(mesh, rules):
            compiled = lowered.compile(compiler_options=options)
    except jax.errors.JaxRuntimeError as e:
        info["compile_s"] = time.perf_counter() - t0
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        # XLA's own verdict, e.g. "HLO temporaries (17.09G) exceeds available HBM (15.75G)",
        # or an on-chip scratch (VMEM) overflow of one kernel.
        info["error"] = " ".join(str(e).split())[:800]
        return finish(info, None, mesh)
    info["compile_s"] = time.perf_counter() - t0
    return finish(info, compiled, mesh)


def finish(info: dict, compiled, mesh) -> dict:
    """`info` with the compiled program's memory, cost analysis and step model (None: it
    did not compile, and info["error"] says why)."""
    info.setdefault("error", None)
    if compiled is None:
        return info
    mem = compiled.memory_analysis()
    info.update(
        arguments_bytes=mem.argument_size_in_bytes,
        outputs_bytes=mem.output_size_in_bytes,
        aliased_bytes=mem.alias_size_in_bytes,  # donated state reused by the outputs
        temp_bytes=mem.temp_size_in_bytes,
        code_bytes=mem.generated_code_size_in_bytes,
        peak_bytes=mem.peak_memory_in_bytes,
    )
    info["total_bytes"] = (
        info["arguments_bytes"]
        + info["outputs_bytes"]
        - info["aliased_bytes"]
        + info["temp_bytes"]
        + info["code_bytes"]
    )
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older jax: one dict per partition
        cost = cost[0] if cost else {}
    info["compiled_flops_per_device"] = (cost or {}).get("flops")
    try:
        info.update(step_model_figures(info, compiled, mesh))
    except Exception as e:  # a form of HLO the reader does not know: keep the memory figures
        info["step_model_error"] = f"{type(e).__name__}: {e}"
    return info


def step_model_figures(info: dict, compiled, mesh) -> dict:
    """The step-time model (step_model.py) of the compiled step, per device: the
    HLO's FLOPs, HBM bytes, collectives and custom calls with loop trip counts applied,
    and the step time, tokens/s and MFU they imply on this chip."""
    acct = step_model.account(
        compiled.as_text(), hlo_text.MeshSpec.from_jax(mesh), ragged_rows=info["ragged_rows"]
    )
    return {
        "step_model": step_model.summary(acct),
        "estimate": step_model.estimate(
            acct,
            hardware.chip(info["device_kind"]),
            model_flops=info["model_flops_per_device"],
            tokens=info["tokens_per_step"] / info["devices"],
        ),
    }
