"""MaxText's train step for the same TPU slice, read through the same step model as ours:
the side-by-side figures of docs/AOT.md.

  python -m gpt_oss_train.tools.maxtext_compile --maxtext=/path/to/maxtext/src \
      --model=gpt-oss-20b --topology=v5e:16x16 -- \
      per_device_batch_size=1 max_target_length=4096 dtype=bfloat16 weight_dtype=float32 \
      remat_policy=full attention=flash sparse_matmul=true megablox=true \
      ici_fsdp_parallelism=64 ici_expert_parallelism=4 allow_split_physical_axes=true \
      custom_mesh_and_rule=ep-as-dp use_ring_of_experts=true

`--maxtext` is the `src` folder of a MaxText checkout (github.com/AI-Hypercomputer/maxtext;
nothing of it ships here), today's layout or an older tag's (`src/MaxText`). Its own
`train_compile` builds and compiles the step (base.yml, `model_name`, `compile_topology`
and a synthetic dataset are filled in from the flags; the arguments after `--` are
MaxText's own `key=value` settings); this tool takes the compiled program it makes and
prints what `aot_compile` prints for ours: XLA's memory per chip, the model FLOPs
(training/flops.py counts as MaxText does), and the step model's FLOPs, HBM bytes,
collectives by kind and mesh axes, and estimated step time. `--json=-` prints the whole
result as one JSON object.
"""

from __future__ import annotations

import os
import sys

from absl import app, flags

from gpt_oss_train.tools import aot_compile, compiled_step


def maxtext_topology(topology: str) -> str:
    """'v5e:16x16' -> 'v5e-256' (MaxText names a slice by its chip count; v4, v5p and
    tpu7x count TensorCores, two a chip)."""
    chip, shape = topology.split(":")
    chips = 1
    for n in shape.split("x"):
        chips *= int(n)
    cores = 2 if chip in ("v4", "v5p", "tpu7x") else 1
    return f"{chip}-{chips * cores}"


def _train_compile_module(maxtext_src: str):
    """MaxText's train_compile and its base.yml, in either layout: today's `maxtext`
    package, or the `MaxText` one of older tags (the tpu-recipes pin such tags)."""
    src = os.path.abspath(maxtext_src)
    sys.path.insert(0, src)
    if os.path.isdir(os.path.join(src, "maxtext", "trainers")):
        from maxtext.trainers.pre_train import train_compile

        return train_compile, os.path.join(src, "maxtext", "configs", "base.yml")
    from MaxText import train_compile

    return train_compile, os.path.join(src, "MaxText", "configs", "base.yml")


def _tokamax_targets(device) -> None:
    """tokamax (MaxText's use_tokamax_gmm, use_tokamax_splash) picks its kernels for JAX's
    default device, which here is this host's CPU (where it has none): it is told the
    target's, as it would find on a TPU VM. Nothing else's default device changes."""
    try:
        from tokamax._src.ops import op
    except ImportError:
        return
    from jax.extend import backend

    class _TargetBackend:
        def __getattr__(self, name):
            return getattr(backend, name)

        @staticmethod
        def get_default_device():
            return device

    op.backend = _TargetBackend()


def compile_maxtext(maxtext_src: str, model: str, topology: str, settings: list[str]):
    """Runs MaxText's train_compile for `topology`; returns (compiled, mesh, its config)."""
    aot_compile.offline_tpu_environment()
    train_compile, base = _train_compile_module(maxtext_src)
    captured = {}
    original_compile, original_config = train_compile.jit_and_compile, train_compile.pyconfig

    def capture(func, args, kwargs, mesh, *rest):
        compiled = original_compile(func, args, kwargs, mesh, *rest)
        captured.update(compiled=compiled, mesh=mesh)
        return compiled

    _tokamax_targets(aot_compile.topology_devices(topology)[0])

    class _Config:  # the config MaxText builds from the argv below
        def initialize(self, argv, **kw):
            captured["config"] = original_config.initialize(argv, **kw)
            return captured["config"]

        def __getattr__(self, name):
            return getattr(original_config, name)

    train_compile.jit_and_compile, train_compile.pyconfig = capture, _Config()
    argv = [
        "train_compile",
        base,
        f"model_name={model}",
        f"compile_topology={maxtext_topology(topology)}",
        "compile_topology_num_slices=1",
        "dataset_type=synthetic",
        *settings,
    ]
    train_compile.main(argv)
    return captured["compiled"], captured["mesh"], captured["config"]


def account(model: str, topology: str, compiled, mesh, config) -> dict:
    """aot_compile's result fields for MaxText's compiled step."""
    from gpt_oss_train import config as config_lib
    from gpt_oss_train.training import flops as flops_lib

    arch = config_lib.model_preset(model)
    devices = mesh.devices.size
    seq = int(config.max_target_length)
    tokens = int(round(config.per_device_batch_size * devices)) * seq
    per_token = flops_lib.training_flops_per_token(arch, seq)["total"]
    expert = int(getattr(config, "ici_expert_parallelism", 1) or 1)
    info = {
        "devices": devices,
        "device_kind": mesh.devices.flat[0].device_kind,
        "mesh": dict(mesh.shape),
        "tokens_per_step": tokens,
        "model_flops_per_device": per_token * tokens / devices,
        "ragged_rows": 1.0 / expert,  # its expert buffers, like ours, hold every gathered row
        "loop_trips": {},
    }
    info = compiled_step.finish(info, compiled, mesh)
    from importlib import metadata

    info.update(
        topology=topology,
        num_slices=1,
        libtpu_version=metadata.version("libtpu"),
        libtpu_init_args=os.environ.get("LIBTPU_INIT_ARGS", ""),
    )
    return aot_compile.verdict(info)


def report(r: dict) -> str:
    lines = [
        f"target      {r['devices']} x {r['device_kind']} ({r['topology']}), mesh {r['mesh']}",
        f"compiler    libtpu {r['libtpu_version']}",
        f"program     MaxText's train step, {r['tokens_per_step']} tokens/step",
    ] + aot_compile._compiled_lines(r)
    if r.get("step_model"):
        lines += aot_compile._step_lines(r)
    lines.append(aot_compile._verdict_line(r))
    return "\n".join(lines)


def main(argv):
    del argv
    f = flags.FLAGS
    compiled, mesh, config = compile_maxtext(f.maxtext, f.model, f.topology, f.settings or [])
    r = account(f.model, f.topology, compiled, mesh, config)
    aot_compile.emit(r, report(r), f.json)


if __name__ == "__main__":
    flags.DEFINE_string("maxtext", None, "the src folder of a MaxText checkout", required=True)
    flags.DEFINE_string("model", "gpt-oss-20b", "MaxText's model_name (and our preset's)")
    flags.DEFINE_string("topology", "v5e:16x16", "TPU slice as libtpu names it")
    flags.DEFINE_string("json", "", "also write the result as JSON to this path (- : stdout)")
    flags.DEFINE_multi_string("settings", [], "MaxText key=value settings (or after --)")
    # MaxText's own key=value settings follow `--` (flags there, --helpfull, stay ours).
    if "--" in sys.argv:
        cut = sys.argv.index("--")
        head, extra = sys.argv[:cut], sys.argv[cut + 1 :]
        ours = [a for a in extra if a.startswith("--")]
        sys.argv = head + ours + [f"--settings={a}" for a in extra if not a.startswith("--")]
    app.run(main)
