"""train.py's step compiled for a TPU slice: built by the one state builder train.py uses
(training/state.py: the same step, optimizer, shardings and donated state) from abstract
values, so the memory verdict describes exactly what the pod will run. Also the state's
own figures, known before XLA compiles and kept when it finds the step does not fit."""

from __future__ import annotations

import math
import time

import jax

from gpt_oss_train.aot import compiled_step
from gpt_oss_train.model import parameters
from gpt_oss_train.training import flops
from gpt_oss_train.training import state as state_lib


def lower(config, devices):
    """(the training setup, train.py's step lowered for `devices`): the same builder,
    shardings and donated state train.py uses, from abstract values (nothing allocated)."""
    setup = state_lib.build(config, devices=devices)
    with setup.scope():
        return setup, setup.train_step.lower(setup.abstract_state, setup.abstract_batch())


def largest_arguments(setup, n: int) -> list[tuple[int, str]]:
    """The n largest per-device argument arrays of the step, (bytes, "path shape dtype"):
    named from the trees the step is called with (state, and a LoRA run's frozen base)."""
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


def compile_step(config, devices, dump_dir: str | None = None, lowered_step=None) -> dict:
    """Lowers (unless `lowered_step` gives lower's result) and compiles train.py's step
    for `devices`; returns its per-device figures (with "error" set, and no memory
    breakdown, when XLA finds it does not fit)."""
    t0 = time.perf_counter()
    setup, lowered = lowered_step or lower(config, devices)
    info = _state_figures(setup, devices)
    info["ragged_rows"] = compiled_step.ragged_rows(
        config.moe_impl, setup.mesh, setup.rules, config.moe_capacity_factor
    )
    info["top_arguments"] = [
        f"{b / 2**20:10.1f}MiB  {what}" for b, what in largest_arguments(setup, 6)
    ]
    info["lower_s"] = time.perf_counter() - t0
    return compiled_step.compile_lowered(info, lowered, setup.mesh, setup.rules, dump_dir)
