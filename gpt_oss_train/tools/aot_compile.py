"""Compile the real training step for a TPU slice from this machine, with no TPU attached,
and say whether it fits in the chips' memory: the check to run before booking a pod.

  pip install -e '.[tpu]'       # libtpu: the TPU compiler, usable without TPU hardware
  python -m gpt_oss_train.tools.aot_compile --config=configs/tpu_v5e.py --topology=v5e:16x16
  python -m gpt_oss_train.tools.aot_compile \
      --config=configs/tpu_v5e.py:gpt-oss-120b --topology=v5p:8x8x8 \
      --config.mesh.expert=16 --config.train.global_batch_size=512
  python -m gpt_oss_train.tools.aot_compile --config=configs/tpu_v5e.py --topology=v5e:16x16 \
      --num_slices=2                # multi-slice: config.mesh_dcn splits over the slices

`--program=decode|prefill` compiles the serving engine's decode step or prefill chunk
instead, and `--program=grpo` a GRPO config's learner step with its rollout engine's
programs and the memory of both phases (tools/aot_serving.py).

`--topology` is `<chip>:<shape>` as libtpu names it: v5e:16x16 (256 chips), v6e:8x8,
v5p:4x4x4, ... It compiles exactly what `train.py` runs (steps.make_train_step,
the config's optimizer, parameter / optimizer-state / batch shardings, donated state),
then prints the per-device memory XLA will allocate against the chip's HBM, the compiled
FLOPs per device against the model-FLOPs estimate (flops.training_flops_per_token), and
"fits" or "does not fit". Exits 1 when it does not fit, so scripts can gate on it.

Reading the FLOPs: XLA's cost analysis counts the body of a loop once, so with
scan_layers it covers one layer block (of num_layers / 2) and with grad_accum_steps one
microbatch; it also counts lax.ragged_dot as if every row met every local expert. The
"step model" section reads the optimized HLO instead (tools/step_model.py): loop bodies
times their trip counts, HBM bytes, every collective by kind and by the mesh axes it
spans, the Pallas kernels XLA cannot cost, and the step time, tokens/s and MFU those imply
on the chip; docs/AOT.md says how to read it and what it leaves out. `--json=-` prints
the whole result as one JSON object.

It runs with JAX_PLATFORMS=cpu (set or not): the TPU devices are compile-only
descriptions from libtpu, never initialised as a backend. LIBTPU_INIT_ARGS is honoured
(default: the 64 MiB scoped VMEM limit the launch scripts give the pod), so pass the same
XLA flags the pod run will use, and
compile with the libtpu release the pod will run: releases differ by GiBs on one step.
A full gpt-oss-20b step takes 4-6 minutes and ~6 GB of RAM to compile on 2 CPU cores.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import sys
import textwrap
import time

from absl import app, flags
from ml_collections import config_flags

from gpt_oss_train.tools import aot_serving, compiled_step

GiB = 2**30
PROGRAMS = ("train", "decode", "prefill", "grpo")


def offline_tpu_environment():
    """Set before libtpu loads (and JAX_PLATFORMS before JAX picks its backends: the CLI
    calls this first). Off a TPU VM, libtpu would otherwise ask the GCE metadata server
    for the accelerator type and worker names, fail, and log errors; these are only
    defaults (a TPU VM's own environment wins), and the accelerator type named here does
    not constrain the topology compiled for. JAX_PLATFORMS=cpu keeps a TPU VM's own chips
    free: nothing here runs on them, which is also why several compiles may load libtpu at
    once (it otherwise holds /tmp/libtpu_lockfile and refuses a second process). Not done
    at import: an importing process (a test) keeps its environment."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    # The same on-chip scratch limit launch/tpu_pod.sh and launch/xpk.sh give the pod, so
    # this check compiles what the pod will run.
    os.environ.setdefault("LIBTPU_INIT_ARGS", "--xla_tpu_scoped_vmem_limit_kib=65536")


def topology_devices(topology: str, num_slices: int = 1) -> list:
    """Compile-only TPU devices of `topology` (num_slices copies of it over DCN)."""
    offline_tpu_environment()
    try:
        import libtpu  # noqa: F401  (only to give a clear message when it is missing)
    except ImportError:
        raise SystemExit(
            "gpt_oss_train.tools.aot_compile needs libtpu, the TPU compiler: "
            "pip install -e '.[tpu]'"
        ) from None
    from jax.experimental import topologies

    kwargs = {"num_slices": num_slices} if num_slices > 1 else {}
    try:
        try:
            desc = topologies.get_topology_desc(topology_name=topology, platform="tpu", **kwargs)
        except Exception as e:
            if "chips_per_host_bounds" not in str(e):
                raise
            # A slice smaller than one host's default 2x2 chips (v5e:1x1, v5e:2x1): one
            # host holds it all.
            dims = [int(d) for d in topology.split(":")[-1].split("x")]
            kwargs["chips_per_host_bounds"] = (dims + [1, 1])[:3]
            desc = topologies.get_topology_desc(topology_name=topology, platform="tpu", **kwargs)
    except Exception as e:
        raise SystemExit(
            f"--topology={topology}: libtpu cannot describe it ({e}). Use "
            "<chip>:<shape>, e.g. v5e:16x16, v6e:8x8, v5p:4x4x4"
        ) from None
    return list(desc.devices)


def lower_train_step(config, devices):
    """(the training setup, train.py's step lowered for `devices`): the same builder,
    shardings and donated state train.py uses, from abstract values (nothing allocated)."""
    from gpt_oss_train.training import state as state_lib

    setup = state_lib.build(config, devices=devices)
    with setup.scope():
        return setup, setup.train_step.lower(setup.abstract_state, setup.abstract_batch())


def largest_arguments(setup, n: int) -> list[tuple[int, str]]:
    """The n largest per-device argument arrays of the step, (bytes, "path shape dtype"):
    named from the trees the step is called with (state, and a LoRA run's frozen base)."""
    import jax

    trees = {"state": setup.abstract_state}
    if setup.frozen is not None:
        trees["frozen"] = setup.frozen.abstract
    rows = []
    for key_path, a in jax.tree_util.tree_leaves_with_path(trees):
        name = "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in key_path)
        shard = a.sharding.shard_shape(a.shape)
        rows.append((compiled_step.bytes_per_device(a), f"{name} {a.dtype}{list(shard)}"))
    return sorted(rows, key=lambda r: -r[0])[:n]


def _state_figures(setup, devices) -> dict:
    """The state's bytes per device against an even split over the mesh axes that shard
    any parameter: the gap is state left replicated, by rules that leave an axis out for
    some weights or by dims an axis does not divide (sharding.fit_spec drops it)."""
    import jax

    from gpt_oss_train.model import parameters
    from gpt_oss_train.training import flops

    abstract = setup.abstract_state
    leaves = jax.tree.leaves({"params": abstract["params"], "opt_state": abstract["opt_state"]})
    state_bytes = sum(a.size * a.dtype.itemsize for a in leaves)
    state_per_device = compiled_step.bytes_per_device(leaves)
    param_axes = {
        ax
        for s in jax.tree.leaves(setup.state_shardings["params"])
        for entry in s.spec
        if entry is not None
        for ax in ((entry,) if isinstance(entry, str) else entry)
    }
    mc, t = setup.model_cfg, setup.config.train
    counts = parameters.counts(mc)
    tokens = t.global_batch_size * t.seq_len
    frozen = setup.frozen.abstract if setup.frozen is not None else {}
    return {
        "state_bytes_per_device": state_per_device,
        # LoRA: the frozen base, an argument of the step beside the (adapter) state
        "frozen_format": setup.frozen.format if setup.frozen is not None else None,
        "frozen_bytes_per_device": compiled_step.bytes_per_device(frozen),
        "params_trainable": sum(a.size for a in jax.tree.leaves(abstract["params"])),
        "state_bytes_even_split": state_bytes / math.prod(setup.mesh.shape[a] for a in param_axes),
        "state_split_axes": sorted(param_axes),
        "mesh": dict(setup.mesh.shape),
        "devices": len(devices),
        "device_kind": devices[0].device_kind,
        "params_total": counts["total"],
        "params_active": counts["active"],
        "tokens_per_step": tokens,
        "loop_trips": {
            "layer_blocks": mc.num_blocks if mc.scan_layers else 1,
            "microbatches": t.grad_accum_steps,
        },
        "model_flops_per_device": (
            flops.training_flops_per_token(mc, t.seq_len)["total"] * tokens / len(devices)
        ),
    }


def compile_train_step(config, devices, dump_dir: str | None = None, lowered_step=None) -> dict:
    """Lowers (unless `lowered_step` gives lower_train_step's result) and compiles
    train.py's step for `devices`; returns its per-device figures (with "error" set, and
    no memory breakdown, when XLA finds it does not fit)."""
    t0 = time.perf_counter()
    setup, lowered = lowered_step or lower_train_step(config, devices)
    info = _state_figures(setup, devices)
    info["ragged_rows"] = compiled_step.ragged_rows(config.moe_impl, setup.mesh, setup.rules)
    info["top_arguments"] = [
        f"{b / 2**20:10.1f}MiB  {what}" for b, what in largest_arguments(setup, 6)
    ]
    info["lower_s"] = time.perf_counter() - t0
    return compiled_step.compile_lowered(info, lowered, setup.mesh, setup.rules, dump_dir)


def compile_grpo(config, devices, dump_dir: str | None) -> dict:
    """The learner's train step and the rollout engine's decode and prefill on the same
    mesh and weights (LoRA: the frozen base with the trained adapters), and the memory of
    the two phases of a GRPO step."""
    from gpt_oss_train import rollouts
    from gpt_oss_train.model import lora

    if config.train.objective != "grpo":
        raise SystemExit("--program=grpo: the config's train.objective must be 'grpo'")
    t0 = time.perf_counter()
    setup, lowered = lower_train_step(config, devices)
    lower_s = time.perf_counter() - t0
    learner = compile_train_step(config, devices, dump_dir, (setup, lowered))
    learner["lower_s"] += lower_s
    state = setup.abstract_state
    policy = state["params"]
    if setup.frozen is not None:
        policy = lora.merge(setup.frozen.abstract, policy)
    opts = rollouts.engine_options(config)
    shape = aot_serving.Shape(opts.max_slots, opts.max_context, opts.prefill_chunk)
    out = {"learner": learner}
    for program in aot_serving.ENGINE_PROGRAMS:
        t0 = time.perf_counter()
        cache, lowered = aot_serving.lower(
            setup.model_def, setup.mesh, setup.rules, policy, program, shape
        )
        info = aot_serving.figures(
            setup.model_def, setup.mesh, setup.rules, policy, cache, program, shape, devices
        )
        info["weights"] = setup.frozen.format if setup.frozen is not None else "trained"
        info["lower_s"] = time.perf_counter() - t0
        out[program] = compiled_step.compile_lowered(
            info, lowered, setup.mesh, setup.rules, dump_dir
        )
    # Resident beside the engine's step: the optimizer state and a full fine-tuning run's
    # reference copy (the policy's own weights are its arguments).
    beside = compiled_step.bytes_per_device(state["opt_state"])
    if setup.reference is not None:
        beside += compiled_step.bytes_per_device(setup.reference.abstract)
    out["phases"] = aot_serving.phases(out, beside)
    out["rollout_estimate"] = aot_serving.rollout_estimate(out, config)
    return out


def verdict(r: dict, hbm_override_gib: float = 0.0) -> dict:
    """Adds hbm_bytes and fits (None when the chip's HBM is unknown)."""
    from gpt_oss_train import hardware

    r["hbm_bytes"] = hardware.hbm_bytes(r["device_kind"], hbm_override_gib)
    if r["error"]:
        r["fits"] = False
    elif r["hbm_bytes"] is None:
        r["fits"] = None
    else:
        r["fits"] = r["total_bytes"] <= r["hbm_bytes"]
    return r


def memory_report(
    dump_dir: str, n: int, module: str = "jit_train_step"
) -> tuple[int | None, list[str]]:
    """(bytes of all HBM buffers added up, the n largest with the values sharing each)
    from XLA's memory-usage report, which it writes even when the program does not fit.
    Buffers live at different times share memory, so the sum exceeds the peak. Only the
    report's first table, the temporaries: the tables after it are one allocation each
    (the arguments, already listed apart), not buffers the program adds."""
    import glob

    reports = sorted(glob.glob(os.path.join(dump_dir, f"*{module}*memory-usage-report.txt")))
    if not reports:
        return None, []
    units = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
    total, rows = None, []
    with open(reports[-1]) as f:
        for line in f:
            if line.startswith("Memory Space:") and total is not None:
                break  # only the first space, "default": HBM (the others are on-chip scratch)
            if line.startswith("Total bytes:"):
                total = int(line.split()[2])
            # "cumulative (pct); size; offset; used_by_n_values; shapes_list"
            parts = [p.strip() for p in line.split(";")]
            if not line.strip() and rows:
                break  # the end of the temporaries' table
            if len(parts) == 5 and parts[0].endswith("%)"):
                number = parts[1].rstrip("KMGiB")
                size = float(number) * units[parts[1][len(number) :]]
                shapes = parts[4] if len(parts[4]) <= 110 else parts[4][:107] + "..."
                rows.append((size, f"{parts[1]:>10}  {shapes}"))
    rows.sort(key=lambda r: -r[0])
    return total, [text for _, text in rows[:n]]


def _setup_lines(r: dict) -> list[str]:
    """The target, compiler, model, timings and state sizes: known even when XLA failed."""
    lines = [
        f"target      {r['devices']} x {r['device_kind']} ({r['topology']}"
        + (f" x {r['num_slices']} slices" if r["num_slices"] > 1 else "")
        + f"), mesh {r['mesh']}",
        f"compiler    libtpu {r['libtpu_version']}"
        + (f", LIBTPU_INIT_ARGS={r['libtpu_init_args']}" if r["libtpu_init_args"] else ""),
        f"model       {r['params_total'] / 1e9:.2f}B params ({r['params_active'] / 1e9:.2f}B "
        f"active), {r['tokens_per_step']} tokens/step",
        f"time        lower {r['lower_s']:.1f} s, compile {r['compile_s']:.1f} s",
        f"state       params + optimizer state {r['state_bytes_per_device'] / GiB:.2f} GiB per "
        f"device ({r['state_bytes_even_split'] / GiB:.2f} GiB if split evenly over "
        f"{' x '.join(r['state_split_axes']) or 'nothing'})",
    ]
    if r.get("frozen_format"):
        lines.append(
            f"frozen base {r['frozen_bytes_per_device'] / GiB:.2f} GiB per device "
            f"({r['frozen_format']}; an argument of the step, not donated); "
            f"{r['params_trainable'] / 1e6:.1f}M adapter params train"
        )
    excess = r["state_bytes_per_device"] - r["state_bytes_even_split"]
    if excess > 0.5 * r["state_bytes_even_split"] and excess > 2**26:
        lines.append(
            "            (some weights are replicated over one of those axes: see "
            "logical_axis_rules, and sharding.fit_spec for dims an axis does not divide)"
        )
    return lines


def _compiled_lines(r: dict) -> list[str]:
    """XLA's error, or the compiled step's memory per device and its flops."""
    if r["error"]:
        return [f"XLA         {r['error']}"]
    g = lambda b: f"{b / GiB:8.2f} GiB"
    hbm = r["hbm_bytes"]
    lines = [
        "memory per device:",
        f"  arguments {g(r['arguments_bytes'])}   "
        + (
            "weights, KV cache, inputs"
            if "program" in r
            else "params, optimizer state, batch"
            + (", frozen base" if r.get("frozen_format") else "")
        ),
        f"  outputs   {g(r['outputs_bytes'])}   of which {r['aliased_bytes'] / GiB:.2f} GiB "
        "reuse the donated arguments",
        f"  temps     {g(r['temp_bytes'])}   activations, "
        + (
            "decoded or gathered weights, copies"
            if "program" in r
            else "gradients, gathered weights"
        ),
        f"  code      {g(r['code_bytes'])}",
        f"  peak      {g(r['peak_bytes'])}   XLA's peak of the buffers live at once",
        f"  total     {g(r['total_bytes'])}   arguments + outputs - reused + temps + code"
        + (f" = {100 * r['total_bytes'] / hbm:.0f}% of {hbm / GiB:g} GiB" if hbm else ""),
    ]
    model, flops = r["model_flops_per_device"], r["compiled_flops_per_device"]
    lines.append(
        f"flops/step  per device: model estimate {model:.3e}"
        + (f", XLA cost analysis {flops:.3e} ({flops / model:.2f}x)" if flops else "")
    )
    trips = r["loop_trips"]
    loops = [f"1 of {n} {what}" for what, n in trips.items() if n > 1]
    if flops and loops:
        lines.append(
            f"            (XLA counts loop bodies once: {', '.join(loops).replace('_', ' ')})"
        )
    return lines


def _size(b: float) -> str:
    """Bytes in the largest binary unit that keeps a whole number in front."""
    for unit, scale in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= scale:
            return f"{b / scale:.2f} {unit}"
    return f"{b:.0f} B"


def _step_lines(r: dict) -> list[str]:
    """The step model's account of the compiled HLO, per device and step (loop bodies
    times their trip counts), beside the model's FLOPs."""
    m = r["step_model"]
    costed = m["custom_call_flops"]
    loops = ", ".join(f"{lp['trip_count'] or '?'} trips ({lp['source']})" for lp in m["loops"])
    lines = [
        "step model  per device and step, from the optimized HLO, loops x their trip counts:",
        f"  flops     HLO {m['flops']:.3e} = {m['flops'] / r['model_flops_per_device']:.2f}x "
        "the model estimate" + (f" ({costed:.3e} of it in costed custom calls)" if costed else ""),
        f"  HBM       {_size(m['hbm_bytes'])} read + written (estimate)",
    ]
    if m.get("host_bytes"):
        lines.append(f"  host      {_size(m['host_bytes'])} to and from host memory (offloaded)")
    return (
        lines
        + [f"  loops     {loops or 'none'}"]
        + _collective_lines(m)
        + _custom_call_lines(m)
        + _traffic_lines(m)
        + _estimate_lines(r["estimate"])
        + [f"  note      {n}" for n in m["notes"]]
    )


def _collective_lines(m: dict) -> list[str]:
    """Collectives summed by kind and by the mesh axes they span, per step."""
    lines = []
    for title, key in (("kind", "collectives_by_kind"), ("mesh axes", "collectives_by_axes")):
        lines.append(
            f"  collectives by {title} (runs; result bytes; bytes each chip sends, ring model):"
        )
        lines += [
            f"    {name:22s} {row['runs']:6.0f}  {_size(row['result_bytes']):>11}  "
            f"{_size(row['link_bytes']):>11}"
            for name, row in m[key].items()
        ] or ["    none"]
    return lines


def _custom_call_lines(m: dict) -> list[str]:
    """Custom calls (Pallas kernels) by name: XLA counts no FLOPs for them."""
    if not m["custom_calls"]:
        return []
    return ["  custom calls (runs; operand bytes; result bytes; FLOPs):"] + [
        f"    {name[:40]:40s} {row['runs']:6.0f}  {_size(row['operand_bytes']):>11}  "
        f"{_size(row['result_bytes']):>11}  "
        + (f"{row['flops']:.3e}" if row["flops"] is not None else "not costed")
        for name, row in m["custom_calls"].items()
    ]


def _traffic_lines(m: dict) -> list[str]:
    """The instructions that move the most HBM bytes in a step, with the JAX operation
    each came from: where the HBM term of the estimate goes."""
    rows = m.get("traffic") or []
    if not rows:
        return []
    lines = ["  HBM traffic, largest instructions (bytes a step; runs; opcode; shape; source):"]
    for t in rows:
        shape = re.sub(r"\{[^{}]*\}", "", t["shape"])[:44]  # without layouts
        source = t["source"].split("/")[-3:] if t["source"] else ["?"]
        lines.append(f"    {_size(t['bytes']):>11} {t['runs']:5.0f}  {t['opcode'][:14]:14s} "
                     f"{shape:44s} {'/'.join(source)[-60:]}")  # fmt: skip
    return lines


def _estimate_lines(e: dict) -> list[str]:
    """The step time the account implies on this chip, and the assumption behind it."""
    ms = lambda x: "?" if x is None else f"{1e3 * x:.2f}"
    if "compute_s" not in e:
        return [f"  estimate  {n}" for n in e["notes"]]
    lines = [
        f"  estimate  step {ms(e['step_s'])} ms = max(compute {ms(e['compute_s'])}, "
        f"HBM {ms(e['hbm_s'])}) + ICI {ms(e['ici_s'])} + DCN {ms(e['dcn_s'])} ms"
    ]
    if e["step_s"]:
        lines.append(
            f"            {e['tokens_per_s_per_chip']:.0f} tokens/s per chip, MFU "
            f"{100 * e['mfu']:.1f}% (model FLOPs / step time / peak)"
        )
    wrapped = textwrap.wrap(f"({e['assumption']})", 80)
    lines += ["            " + line for line in wrapped]
    return lines + [f"  note      {n}" for n in e["notes"]]


def _verdict_line(r: dict) -> str:
    """Whether the step fits in the chip's HBM, or why that is unknown."""
    if r["fits"] is None:
        return "verdict     unknown HBM size for this chip: pass --hbm_gib"
    if r["fits"]:
        return (
            f"verdict     fits ({r['total_bytes'] / GiB:.2f} GiB <= {r['hbm_bytes'] / GiB:g} GiB)"
        )
    if not r["error"]:
        return (
            f"verdict     does not fit ({r['total_bytes'] / GiB:.2f} GiB > "
            f"{r['hbm_bytes'] / GiB:g} GiB)"
        )
    if "HbmOom" in r["error"] or "memory on HBM" in r["error"]:
        return f"verdict     does not fit ({_needed(r['error'])})"
    if "VmemOom" in r["error"]:
        # One kernel's on-chip scratch, not HBM: the step may fit once that kernel compiles,
        # e.g. with LIBTPU_INIT_ARGS=--xla_tpu_scoped_vmem_limit_kib=<more than its need>.
        return (
            "verdict     does not compile: one kernel needs more scoped VMEM than the "
            "limit (see XLA's message); HBM use is unknown until it compiles"
        )
    return "verdict     does not compile: XLA ran out of memory (see its message)"


def report(r: dict) -> str:
    lines = _setup_lines(r) + _compiled_lines(r)
    if r.get("step_model"):
        lines += _step_lines(r)
    elif r.get("step_model_error"):
        lines.append(f"step model  could not read the program: {r['step_model_error']}")
    if r.get("top_arguments"):
        lines.append("largest arguments per device (state, frozen base):")
        lines += ["  " + row for row in r["top_arguments"]]
    lines += _buffer_lines(r) + [_verdict_line(r)]
    return "\n".join(lines)


def _buffer_lines(r: dict) -> list[str]:
    if not r.get("top_buffers"):
        return []
    return [
        "largest HBM buffers (XLA memory-usage report; each row is one buffer and",
        "the values that take turns in it):",
    ] + ["  " + row for row in r["top_buffers"]]


def _needed(error: str) -> str:
    """'17.09 GiB > 15.75 GiB usable' from XLA's out-of-memory message (its wording
    differs between libtpu releases), or the message itself."""
    import re

    for pattern in (
        r"\(([\d.]+)G\) exceeds available HBM \(([\d.]+)G\)",
        r"Used ([\d.]+)G of ([\d.]+)G hbm",
    ):
        m = re.search(pattern, error)
        if m:
            return f"{m.group(1)} GiB > {m.group(2)} GiB usable"
    return error


def run(
    config,
    topology: str,
    num_slices: int = 1,
    hbm_override_gib: float = 0.0,
    num_top_buffers: int = 0,
    dump_dir: str = "",
    program: str = "train",
    shape=None,
    weights: str = "param_dtype",
) -> dict:
    """Compiles `program` (PROGRAMS) for the topology: its result, with the verdict; for
    "grpo", {"learner", "decode", "prefill": each program's result, "phases", ...}."""
    import tempfile

    if num_slices > 1 and all(v == 1 for v in config.mesh_dcn.values()):
        # Multi-slice with no DCN split given: data parallelism across slices is the usual
        # choice (only the gradient reduction crosses the slow links, once per step).
        config.mesh_dcn.data = num_slices
        print(f"config.mesh_dcn.data={num_slices} (one data-parallel replica per slice)")
    dcn = math.prod(config.mesh_dcn.values())
    if dcn != num_slices:
        raise SystemExit(
            f"config.mesh_dcn {dict(config.mesh_dcn)} splits {dcn} ways but "
            f"--num_slices={num_slices}: make its product the number of slices"
        )
    devices = topology_devices(topology, num_slices)
    with contextlib.ExitStack() as stack:
        dump = dump_dir or (
            stack.enter_context(tempfile.TemporaryDirectory(prefix="aot_compile_"))
            if num_top_buffers
            else None
        )
        if program == "train":
            results = {"train_step": compile_train_step(config, devices, dump)}
            out = results["train_step"]
        elif program == "grpo":
            out = compile_grpo(config, devices, dump)
            results = {"train_step": out["learner"], "_decode": out["decode"],
                       "_prefill": out["prefill"]}  # fmt: skip
        else:
            out = aot_serving.compile_program(config, devices, program, shape, weights, dump)
            results = {f"_{program}": out}
        from importlib import metadata

        for name, r in results.items():
            r["buffers_sum_bytes"], r["top_buffers"] = (
                memory_report(dump, num_top_buffers, f"jit_{name}")
                if num_top_buffers
                else (None, [])
            )
            # The compiler's version matters: libtpu releases differ by GiBs on one step.
            r.update(
                topology=topology,
                num_slices=num_slices,
                libtpu_version=metadata.version("libtpu"),
                libtpu_init_args=os.environ.get("LIBTPU_INIT_ARGS", ""),
            )
            verdict(r, hbm_override_gib)
    if program == "grpo":
        hbm = out["learner"]["hbm_bytes"]
        peak = max(out["phases"].values(), default=None)
        out["fits"] = None if hbm is None or peak is None else peak <= hbm
        if any(out[p]["error"] for p in ("learner", "decode", "prefill")):
            out["fits"] = False
    return out


def full_report(r: dict) -> str:
    """The report of what run() returned, for any program."""
    if "learner" in r:
        parts = [report(r["learner"]), serving_report(r["decode"]), serving_report(r["prefill"])]
        hbm = r["learner"]["hbm_bytes"]
        return "\n\n".join(parts + ["\n".join(aot_serving.grpo_lines(r, hbm))])
    return serving_report(r) if "program" in r else report(r)


def serving_report(r: dict) -> str:
    """An engine program's report: as the train step's, with its own setup lines."""
    lines = aot_serving.setup_lines(r) + _compiled_lines(r)
    if r.get("step_model"):
        lines += _step_lines(r) + aot_serving.decode_line(r)
    elif r.get("step_model_error"):
        lines.append(f"step model  could not read the program: {r['step_model_error']}")
    lines += _buffer_lines(r) + [_verdict_line(r)]
    return "\n".join(lines)


def _define_flags():
    """Defined when run as a program only, so tests can import this module beside
    gpt_oss_train.train (which defines its own --config)."""
    from gpt_oss_train.config import BASE_FORMATS

    config_flags.DEFINE_config_file("config", "configs/tpu_v5e.py", "Config file.")
    flags.DEFINE_string(
        "topology", "v5e:16x16", "TPU slice as libtpu names it: v5e:16x16, v6e:8x8, v5p:4x4x4"
    )
    flags.DEFINE_integer("num_slices", 1, "Slices joined over DCN (multi-slice).")
    flags.DEFINE_float(
        "hbm_gib", 0.0, "Memory per device in GiB (0: the chip's HBM from the table)."
    )
    flags.DEFINE_string(
        "json",
        "",
        "Also write the numbers to this JSON file; '-' (or a bare --json): print only the "
        "JSON object on stdout (the report goes to stderr).",
    )
    flags.DEFINE_string(
        "dump_dir",
        "",
        "Keep XLA's dump of the compiled step here (HLO, buffer assignment, "
        "memory-usage report); by default it goes to a temporary folder, then away.",
    )
    flags.DEFINE_enum(
        "program",
        "train",
        PROGRAMS,
        "train: train.py's step; decode / prefill: the serving engine's decode step and "
        "prefill chunk (--slots, --context, --prefill_chunk, --weights); grpo: a GRPO "
        "config's learner step and its rollout engine's programs, with both phases' memory.",
    )
    flags.DEFINE_integer("slots", 0, "decode/prefill: decode rows (0: train.global_batch_size).")
    flags.DEFINE_integer("context", 0, "decode/prefill: positions per slot (0: train.seq_len).")
    flags.DEFINE_integer("prefill_chunk", 256, "prefill: tokens per chunk.")
    flags.DEFINE_enum(
        "weights",
        "param_dtype",
        list(BASE_FORMATS),
        "decode/prefill: the weights' form (model/frozen_base.py; mxfp4: the experts kept "
        "packed as the published checkpoints store them, other matrices bfloat16).",
    )
    flags.DEFINE_bool("int8_kv_cache", False, "decode/prefill: an int8 KV cache.")
    flags.DEFINE_integer(
        "top_buffers",
        10,
        "Print this many rows of XLA's memory-usage report (the largest "
        "allocations at peak; 0: skip the dump it needs).",
    )


def emit(r: dict, text: str, json_flag: str) -> None:
    """The report, then the result as one JSON line (and to the --json file). --json=-:
    stdout is only that JSON object, for scripts; the report goes to stderr."""
    print(text, file=sys.stderr if json_flag == "-" else sys.stdout)
    print(json.dumps(r, default=str), flush=True)
    if json_flag and json_flag != "-":
        with open(json_flag, "w") as out:
            json.dump(r, out, indent=2, default=str)


def main(argv):
    del argv
    f = flags.FLAGS
    config = f["config"].value
    if f.program in aot_serving.ENGINE_PROGRAMS:
        slots = f.slots or config.train.global_batch_size
        context = f.context or config.train.seq_len
        shape = aot_serving.Shape(slots, context, min(f.prefill_chunk, context), f.int8_kv_cache)
    else:
        shape = None
    r = run(
        config,
        f.topology,
        f.num_slices,
        f.hbm_gib,
        f.top_buffers,
        f.dump_dir,
        f.program,
        shape,
        f.weights,
    )
    emit(r, full_report(r), f.json)
    if r["fits"] is False:
        sys.exit(1)


def _bare_json_to_stdout(argv: list[str]) -> list[str]:
    """A bare `--json` (last, or followed by another flag) means `--json=-`."""
    return [
        "--json=-" if a == "--json" and (i + 1 == len(argv) or argv[i + 1].startswith("-")) else a
        for i, a in enumerate(argv)
    ]


if __name__ == "__main__":
    offline_tpu_environment()
    _define_flags()
    app.run(main, argv=_bare_json_to_stdout(sys.argv))
