"""The check to run before booking a pod: compile a program for a TPU slice on this
machine, with no TPU attached, and say whether it fits in the chips' memory. One entry
for every program (train.py's step, the serving engine's decode and prefill, a GRPO
step's both phases), each result carrying its slice, its compiler and the verdict, so a
script gates on one field (`fits`) whatever it compiled."""

from __future__ import annotations

import contextlib
import glob
import math
import os
import tempfile

from gpt_oss_train import hardware
from gpt_oss_train.aot import grpo, serving, tpu, train_step

PROGRAMS = ("train", "decode", "prefill", "grpo")


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
    devices = tpu.devices(topology, num_slices)
    with contextlib.ExitStack() as stack:
        dump = dump_dir or (
            stack.enter_context(tempfile.TemporaryDirectory(prefix="aot_compile_"))
            if num_top_buffers
            else None
        )
        if program == "train":
            results = {"train_step": train_step.compile_step(config, devices, dump)}
            out = results["train_step"]
        elif program == "grpo":
            out = grpo.compile_program(config, devices, dump)
            results = {
                "train_step": out["learner"],
                "_decode": out["decode"],
                "_prefill": out["prefill"],
            }
        else:
            out = serving.compile_program(config, devices, program, shape, weights, dump)
            results = {f"_{program}": out}
        for name, r in results.items():
            r["buffers_sum_bytes"], r["top_buffers"] = (
                memory_report(dump, num_top_buffers, f"jit_{name}")
                if num_top_buffers
                else (None, [])
            )
            # The compiler's version matters: libtpu releases differ by GiBs on one step.
            r.update(tpu.target(topology, num_slices))
            verdict(r, hbm_override_gib)
    if program == "grpo":
        hbm = out["learner"]["hbm_bytes"]
        peak = max(out["phases"].values(), default=None)
        out["fits"] = None if hbm is None or peak is None else peak <= hbm
        if any(out[p]["error"] for p in ("learner", "decode", "prefill")):
            out["fits"] = False
    return out


def verdict(r: dict, hbm_override_gib: float = 0.0) -> dict:
    """Adds hbm_bytes and fits (None when the chip's HBM is unknown)."""
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
