"""Compile the real training step for a TPU slice from this machine, with no TPU attached,
and say whether it fits in the chips' memory: the check to run before booking a pod.

  pip install -e '.[tpu]'       # libtpu: the TPU compiler, usable without TPU hardware
  python tools/aot_compile.py --config=configs/tpu_v5e.py --topology=v5e:16x16
  python tools/aot_compile.py --config=configs/tpu_v5e.py:gpt-oss-120b \
      --topology=v5p:8x8x8 --config.mesh.expert=16
  python tools/aot_compile.py --config=configs/tpu_v5e.py --topology=v5e:16x16 \
      --num_slices=2                # multi-slice: config.mesh_dcn splits over the slices

`--topology` is `<chip>:<shape>` as libtpu names it: v5e:16x16 (256 chips), v6e:8x8,
v5p:4x4x4, v4:2x2x2, ... It compiles exactly what `train.py` runs (steps.make_train_step,
the config's optimizer, parameter / optimizer-state / batch shardings, donated state),
then prints the per-device memory XLA will allocate against the chip's HBM, the compiled
FLOPs per device against the model-FLOPs estimate (metrics.training_flops_per_token), and
"fits" or "does not fit". Exits 1 when it does not fit, so scripts can gate on it.

It runs with JAX_PLATFORMS=cpu (set or not): the TPU devices are compile-only
descriptions from libtpu, never initialised as a backend.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time

# Set before libtpu loads. With no TPU VM around, libtpu would otherwise ask the GCE
# metadata server for the accelerator type and worker names (a network probe that fails
# here and logs errors); these are only defaults, a real TPU VM's own values win. The
# accelerator type does not constrain the topology compiled for.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_CONFIG = config_flags.DEFINE_config_file("config", "configs/tpu_v5e.py", "Config file.")
_TOPOLOGY = flags.DEFINE_string("topology", "v5e:16x16",
                                "TPU slice as libtpu names it: v5e:16x16, v6e:8x8, v5p:4x4x4")
_NUM_SLICES = flags.DEFINE_integer("num_slices", 1, "Slices joined over DCN (multi-slice).")
_HBM_GIB = flags.DEFINE_float("hbm_gib", 0.0,
                              "Memory per device in GiB (0: the chip's HBM from the table).")
_JSON = flags.DEFINE_string("json", "", "Also write the numbers to this JSON file.")
_TOP_BUFFERS = flags.DEFINE_integer(
    "top_buffers", 10, "Print this many rows of XLA's memory-usage report (the largest "
    "allocations at peak; 0: skip the dump it needs).")

GiB = 2**30

# HBM per device (one JAX device per chip on all of these), from cloud.google.com/tpu/docs
# system-architecture pages. Matched as substrings of device_kind, most specific first:
# v5e reports "TPU v5 lite", v5p plain "TPU v5" (or "TPU v5p").
HBM_GIB = (("TPU v6 lite", 32.0), ("TPU v6e", 32.0), ("TPU v5 lite", 16.0),
           ("TPU v5e", 16.0), ("TPU v5p", 95.0), ("TPU v5", 95.0), ("TPU v4", 32.0),
           ("TPU7x", 192.0))


def hbm_bytes(device_kind: str, override_gib: float = 0.0) -> float | None:
  if override_gib > 0:
    return override_gib * GiB
  for name, gib in HBM_GIB:
    if name.lower() in device_kind.lower():
      return gib * GiB
  return None


def topology_devices(topology: str, num_slices: int = 1) -> list:
  """Compile-only TPU devices of `topology` (num_slices copies of it over DCN)."""
  try:
    import libtpu  # noqa: F401  (only to give a clear message when it is missing)
  except ImportError:
    raise SystemExit("tools/aot_compile.py needs libtpu, the TPU compiler: "
                     "pip install -e '.[tpu]'") from None
  from jax.experimental import topologies
  kwargs = {"num_slices": num_slices} if num_slices > 1 else {}
  try:
    desc = topologies.get_topology_desc(topology_name=topology, platform="tpu", **kwargs)
  except Exception as e:
    raise SystemExit(f"--topology={topology}: libtpu cannot describe it ({e}). Use "
                     "<chip>:<shape>, e.g. v5e:16x16, v6e:8x8, v5p:4x4x4") from None
  return list(desc.devices)


@contextlib.contextmanager
def _target_devices(devices):
  """Makes `jax.devices()` answer with the target TPU devices while the step is traced.

  Model code asks `jax.devices()[0].platform` which kernels it may use (splash attention
  on TPU, Mosaic GPU matmuls on Hopper); in a cross-compile that is the CPU running this
  script, not the chips compiled for, so the answer would be wrong (splash would refuse).
  Scoped to tracing only.
  """
  import jax
  original = jax.devices
  target = list(devices)

  def patched(backend=None):
    return list(target) if backend in (None, "tpu") else original(backend)

  jax.devices = patched
  try:
    yield
  finally:
    jax.devices = original


def compile_train_step(config, devices, dump_dir: str | None = None) -> dict:
  """Lowers and compiles train.py's step for `devices`. Returns the figures of `analyse`
  (with "error" set, and no memory breakdown, when XLA finds it does not fit)."""
  import jax
  import jax.numpy as jnp
  from gpt_oss_train import config as config_lib, metrics, sharding, steps
  from gpt_oss_train.model import ModelDef

  config_lib.validate(config)
  t = config.train
  model_cfg = config_lib.ModelConfig.from_config(config)
  rules = sharding.validate_rules(config.logical_axis_rules)
  mesh = sharding.make_mesh(config.mesh, config.mesh_dcn, devices=devices)
  divisor = sharding.batch_divisor(mesh, rules) * t.grad_accum_steps
  if t.global_batch_size % divisor:
    raise config_lib.ConfigError(
        f"config.train.global_batch_size={t.global_batch_size} must be a multiple of "
        f"{divisor} (the batch shards x grad_accum_steps)")
  model_def = ModelDef(model_cfg)
  tx, schedule = steps.make_optimizer(t)

  # The same shardings and abstract values train.py builds, with no array allocated.
  # Built outside the mesh context: optax creates its step counters eagerly, and under
  # a mesh of compile-only devices an eager op has nowhere to run.
  param_sh = model_def.shardings(mesh, rules)
  abstract_params = model_def.abstract_params(mesh, rules)
  opt_sh = steps.opt_state_shardings(tx, abstract_params, param_sh, mesh)
  abstract_opt = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                              jax.eval_shape(tx.init, abstract_params), opt_sh)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  state_sh = {"step": replicated, "params": param_sh, "opt_state": opt_sh}
  state = {"step": jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated),
           "params": abstract_params, "opt_state": abstract_opt}
  batch_sh = sharding.batch_sharding(mesh, rules, 2)
  # data.global_batch's keys and dtype.
  batch = {k: jax.ShapeDtypeStruct((t.global_batch_size, t.seq_len), jnp.int32,
                                   sharding=batch_sh)
           for k in ("inputs", "targets", "positions", "segment_ids", "loss_mask")}

  counts = metrics.param_counts(model_cfg)
  tokens = t.global_batch_size * t.seq_len
  info = {
      "mesh": dict(mesh.shape), "devices": len(devices),
      "device_kind": devices[0].device_kind,
      "params_total": counts["total"], "params_active": counts["active"],
      "tokens_per_step": tokens,
      "model_flops_per_device": (metrics.training_flops_per_token(model_cfg, t.seq_len)["total"]
                                 * tokens / len(devices)),
  }
  with sharding.use_mesh(mesh, rules):
    step = jax.jit(steps.make_train_step(model_def, tx, schedule, t),
                   in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, None),
                   donate_argnums=0)
    t0 = time.perf_counter()
    with _target_devices(devices):
      lowered = step.lower(state, batch)
    info["lower_s"] = time.perf_counter() - t0
    # The dump holds XLA's memory-usage report, which it writes even when the program
    # does not fit: the only way to see what filled the memory in that case.
    options = {"xla_dump_to": dump_dir, "xla_dump_hlo_pass_re": "NONE"} if dump_dir else {}
    t0 = time.perf_counter()
    try:
      compiled = lowered.compile(compiler_options=options)
    except jax.errors.JaxRuntimeError as e:
      info["compile_s"] = time.perf_counter() - t0
      if "RESOURCE_EXHAUSTED" not in str(e):
        raise
      # XLA's own verdict, e.g. "HLO temporaries (17.09G) exceeds available HBM (15.75G)".
      info["error"] = str(e).splitlines()[0]
      return _finish(info, None)
    info["compile_s"] = time.perf_counter() - t0
  return _finish(info, compiled)


def _finish(info: dict, compiled) -> dict:
  info.setdefault("error", None)
  if compiled is None:
    return info
  mem = compiled.memory_analysis()
  info.update(arguments_bytes=mem.argument_size_in_bytes,
              outputs_bytes=mem.output_size_in_bytes,
              aliased_bytes=mem.alias_size_in_bytes,   # donated state reused by the outputs
              temp_bytes=mem.temp_size_in_bytes,
              code_bytes=mem.generated_code_size_in_bytes)
  info["total_bytes"] = (info["arguments_bytes"] + info["outputs_bytes"]
                         - info["aliased_bytes"] + info["temp_bytes"] + info["code_bytes"])
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):  # older jax: one dict per partition
    cost = cost[0] if cost else {}
  info["compiled_flops_per_device"] = (cost or {}).get("flops")
  return info


def verdict(r: dict, hbm_override_gib: float = 0.0) -> dict:
  """Adds hbm_bytes and fits (None when the chip's HBM is unknown)."""
  r["hbm_bytes"] = hbm_bytes(r["device_kind"], hbm_override_gib)
  if r["error"]:
    r["fits"] = False
  elif r["hbm_bytes"] is None:
    r["fits"] = None
  else:
    r["fits"] = r["total_bytes"] <= r["hbm_bytes"]
  return r


def top_buffers(dump_dir: str, n: int) -> list[str]:
  """The first n rows of XLA's memory-usage report: the largest live allocations at the
  peak, with the shapes sharing each one."""
  import glob
  reports = sorted(glob.glob(os.path.join(dump_dir, "*jit_train_step*memory-usage-report.txt")))
  if not reports:
    return []
  units = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
  rows = []
  with open(reports[-1]) as f:
    for line in f:
      if line.startswith("Memory Space:") and rows:
        break  # only the first space, "default": HBM (the others are on-chip scratch)
      # "cumulative (pct); size; offset; used_by_n_values; shapes_list"
      parts = [p.strip() for p in line.split(";")]
      if len(parts) == 5 and parts[0].endswith("%)"):
        number = parts[1].rstrip("KMGiB")
        size = float(number) * units[parts[1][len(number):]]
        shapes = parts[4] if len(parts[4]) <= 110 else parts[4][:107] + "..."
        rows.append((size, f"{parts[1]:>10}  {shapes}"))
  rows.sort(key=lambda r: -r[0])
  return [text for _, text in rows[:n]]


def report(r: dict) -> str:
  g = lambda b: f"{b / GiB:8.2f} GiB"
  lines = [
      f"target      {r['devices']} x {r['device_kind']}, mesh {r['mesh']}",
      f"model       {r['params_total'] / 1e9:.2f}B params ({r['params_active'] / 1e9:.2f}B "
      f"active), {r['tokens_per_step']} tokens/step",
      f"time        lower {r['lower_s']:.1f} s, compile {r['compile_s']:.1f} s",
  ]
  if r["error"]:
    lines.append(f"XLA         {r['error']}")
  else:
    hbm = r["hbm_bytes"]
    lines += [
        "memory per device:",
        f"  arguments {g(r['arguments_bytes'])}   params, optimizer state, batch",
        f"  outputs   {g(r['outputs_bytes'])}   of which {r['aliased_bytes'] / GiB:.2f} GiB "
        "reuse the donated arguments",
        f"  temps     {g(r['temp_bytes'])}   activations, gradients, gathered weights",
        f"  code      {g(r['code_bytes'])}",
        f"  total     {g(r['total_bytes'])}   arguments + outputs - reused + temps + code"
        + (f" = {100 * r['total_bytes'] / hbm:.0f}% of {hbm / GiB:.0f} GiB" if hbm else ""),
    ]
    model, flops = r["model_flops_per_device"], r["compiled_flops_per_device"]
    lines.append(f"flops/step  per device: model estimate {model:.3e}"
                 + (f", XLA cost analysis {flops:.3e} ({flops / model:.2f}x)" if flops else ""))
  if r.get("top_buffers"):
    lines.append("largest allocations at the peak (XLA memory-usage report):")
    lines += ["  " + row for row in r["top_buffers"]]
  if r["fits"] is None:
    lines.append("verdict     unknown HBM size for this chip: pass --hbm_gib")
  elif r["fits"]:
    lines.append(f"verdict     fits ({r['total_bytes'] / GiB:.2f} GiB <= "
                 f"{r['hbm_bytes'] / GiB:.0f} GiB)")
  elif r["error"]:
    lines.append(f"verdict     does not fit ({_needed(r['error'])})")
  else:
    lines.append(f"verdict     does not fit ({r['total_bytes'] / GiB:.2f} GiB > "
                 f"{r['hbm_bytes'] / GiB:.0f} GiB)")
  return "\n".join(lines)


def _needed(error: str) -> str:
  """'17.09G > 15.75G' from XLA's out-of-memory message, or the message itself."""
  import re
  m = re.search(r"\(([\d.]+)G\) exceeds available HBM \(([\d.]+)G\)", error)
  return f"{m.group(1)} GiB > {m.group(2)} GiB usable" if m else error


def run(config, topology: str, num_slices: int = 1, hbm_override_gib: float = 0.0,
        num_top_buffers: int = 0) -> dict:
  import tempfile
  if num_slices > 1 and all(v == 1 for v in config.mesh_dcn.values()):
    # Multi-slice with no DCN split given: data parallelism across slices is the usual
    # choice (only the gradient reduction crosses the slow links, once per step).
    config.mesh_dcn.data = num_slices
    print(f"config.mesh_dcn.data={num_slices} (one data-parallel replica per slice)")
  devices = topology_devices(topology, num_slices)
  with tempfile.TemporaryDirectory(prefix="aot_compile_") as dump:
    r = compile_train_step(config, devices, dump if num_top_buffers else None)
    r["top_buffers"] = top_buffers(dump, num_top_buffers) if num_top_buffers else []
  r.update(topology=topology, num_slices=num_slices)
  return verdict(r, hbm_override_gib)


def main(argv):
  del argv
  r = run(_CONFIG.value, _TOPOLOGY.value, _NUM_SLICES.value, _HBM_GIB.value,
          _TOP_BUFFERS.value)
  print(report(r))
  print(json.dumps(r), flush=True)
  if _JSON.value:
    with open(_JSON.value, "w") as f:
      json.dump(r, f, indent=2)
  if r["fits"] is False:
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
