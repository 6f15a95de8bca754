"""MaxText's train step compiled for the same TPU slice, read through the same step model
as ours: a side-by-side comparison is only fair when both programs are measured by one
ruler. MaxText's own `train_compile` builds and compiles its step (nothing of MaxText
ships here: `maxtext_src` is the `src` folder of a checkout, today's layout or an older
tag's); the compiled program it makes is taken and given the figures our own results
carry (compiled_step.finish), the model FLOPs counted as MaxText counts them
(training/flops.py)."""

from __future__ import annotations

import os
import sys

from jax.extend import backend

from gpt_oss_train import config as config_lib
from gpt_oss_train.aot import check, compiled_step, tpu
from gpt_oss_train.training import flops as flops_lib


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
        # lazy: a checkout's, importable only once sys.path holds it (nothing of it ships)
        from maxtext.trainers.pre_train import train_compile

        return train_compile, os.path.join(src, "maxtext", "configs", "base.yml")
    from MaxText import train_compile  # lazy: as above

    return train_compile, os.path.join(src, "MaxText", "configs", "base.yml")


def _tokamax_targets(device) -> None:
    """tokamax (MaxText's use_tokamax_gmm, use_tokamax_splash) picks its kernels for JAX's
    default device, which here is this host's CPU (where it has none): it is told the
    target's, as it would find on a TPU VM. Nothing else's default device changes."""
    try:
        from tokamax._src.ops import op  # lazy: optional dependency (MaxText's, if installed)
    except ImportError:
        return

    class _TargetBackend:
        def __getattr__(self, name):
            return getattr(backend, name)

        @staticmethod
        def get_default_device():
            return device

    op.backend = _TargetBackend()


def compile_maxtext(maxtext_src: str, model: str, topology: str, settings: list[str]):
    """Runs MaxText's train_compile for `topology`; returns (compiled, mesh, its config).
    base.yml, `model_name`, `compile_topology` and a synthetic dataset are filled in;
    `settings` are MaxText's own `key=value` settings."""
    tpu.offline_environment()
    train_compile, base = _train_compile_module(maxtext_src)
    captured = {}
    original_compile, original_config = train_compile.jit_and_compile, train_compile.pyconfig

    def capture(func, args, kwargs, mesh, *rest):
        compiled = original_compile(func, args, kwargs, mesh, *rest)
        captured.update(compiled=compiled, mesh=mesh)
        return compiled

    _tokamax_targets(tpu.devices(topology)[0])

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
    """The result fields of our own compiled programs (check.run's), for MaxText's
    compiled step, with the verdict."""
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
    info.update(tpu.target(topology, 1))
    return check.verdict(info)
