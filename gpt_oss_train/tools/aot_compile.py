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
programs and the memory of both phases (aot/serving.py, aot/grpo.py).

`--topology` is `<chip>:<shape>` as libtpu names it: v5e:16x16 (256 chips), v6e:8x8,
v5p:4x4x4, ... It compiles exactly what `train.py` runs (steps.make_train_step,
the config's optimizer, parameter / optimizer-state / batch shardings, donated state),
then prints the per-device memory XLA will allocate against the chip's HBM, the compiled
FLOPs per device against the model-FLOPs estimate (flops.training_flops_per_token), and
"fits" or "does not fit". Exits 1 when it does not fit, so scripts can gate on it.

Reading the FLOPs: XLA's cost analysis counts the body of a loop once, so with
scan_layers it covers one layer block (of num_layers / 2) and with grad_accum_steps one
microbatch; it also counts lax.ragged_dot as if every row met every local expert. The
"step model" section reads the optimized HLO instead (aot/step_model.py): loop bodies
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

import sys

from absl import app, flags

from gpt_oss_train import errors
from gpt_oss_train.aot import tpu


def _define_flags():
    """Defined when run as a program only, so tests can import this module beside
    gpt_oss_train.train (which defines its own --config)."""
    # lazy: these load JAX, after tpu.offline_environment() has set its environment
    from gpt_oss_train.aot import check
    from gpt_oss_train.config import BASE_FORMATS

    errors.define_config_flag("config", "configs/tpu_v5e.py", "Config file.")
    flags.DEFINE_string(
        "topology", "v5e:16x16", "TPU slice as libtpu names it: v5e:16x16, v6e:8x8, v5p:4x4x4"
    )
    flags.DEFINE_integer("num_slices", 1, "Slices joined over DCN (multi-slice).")
    flags.DEFINE_float(
        "host_gbps",
        0.0,
        "Charge host-offload transfers at this many GB/s a chip in the step's bounds "
        "(0: no chip page states one; the upper bound is then unknown when a step offloads).",
    )
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
        check.PROGRAMS,
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


def main(argv):
    del argv
    from gpt_oss_train.aot import check, report, serving, step_model  # lazy: as above

    f = flags.FLAGS
    config = f["config"].value
    if f.program in serving.ENGINE_PROGRAMS:
        slots = f.slots or config.train.global_batch_size
        context = f.context or config.train.seq_len
        shape = serving.Shape(slots, context, min(f.prefill_chunk, context), f.int8_kv_cache)
    else:
        shape = None
    r = check.run(
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
    if f.host_gbps:
        for part in [r, *(v for v in r.values() if isinstance(v, dict) and "estimate" in v)]:
            step_model.charge_host(part, f.host_gbps)
    report.emit(r, report.text(r), f.json)
    if r["fits"] is False:
        sys.exit(1)


def _bare_json_to_stdout(argv: list[str]) -> list[str]:
    """A bare `--json` (last, or followed by another flag) means `--json=-`."""
    return [
        "--json=-" if a == "--json" and (i + 1 == len(argv) or argv[i + 1].startswith("-")) else a
        for i, a in enumerate(argv)
    ]


if __name__ == "__main__":
    tpu.offline_environment()
    _define_flags()
    app.run(main, argv=_bare_json_to_stdout(sys.argv), flags_parser=errors.parse_flags)
