"""A step-time model of a compiled XLA program, read from its optimized HLO text
(`compiled.as_text()`; read as libtpu and XLA:CPU print it).

    acct = step_model.account(compiled.as_text(), step_model.MeshSpec.from_jax(mesh))
    step_model.estimate(acct, hardware.chip(device_kind), model_flops=..., tokens=...)

`account` walks the program as it runs, per chip and per step:
  - every computation and what each instruction calls (fusion `calls=`, while
    `body=`/`condition=`, conditional branches, `call`, async wrappers); a while loop
    multiplies what its body does by its trip count: XLA's `known_trip_count` where it
    printed one (CPU does), else the count read from the loop's own condition when it has
    the counted form `i = c0; i < N; i += s` (libtpu prints no known_trip_count), else 1,
    with a note saying so;
  - FLOPs of dot and convolution instructions from their shapes, inside fusions too
    (2 x output elements x contracted size; a convolution counts only the window positions
    that land on its input, not on padding), and of the custom calls with a costing hook
    (hlo_costs.CUSTOM_CALL_FLOPS) or, failing one, a cost estimate the Pallas kernel
    declared; other custom calls are listed as not costed;
  - an estimate of HBM bytes: operands + results of the instructions that run at the top
    of a computation (a fusion's operands and result cross HBM, its insides do not),
    counting only arrays in the default memory space (TPU marks on-chip VMEM `S(1)`), a
    dynamic slice as the bytes it reads and an in-place update as the bytes it writes;
    transfers to and from host memory (`S(5)`, offloaded arrays) are summed apart;
  - every collective, counted once (async -start/-done pairs, TPU's async collective
    fusions and its reduce-scatter fusion hold one collective in several instructions; a
    multi-slice program crosses slices with send/recv pairs; those libtpu offloads to
    the SparseCores sit in computations an async call-start runs), with its result
    bytes, group size, the mesh axes its groups span, whether it crosses slices, how
    often it runs, and its link bytes per chip under a ring model.

`estimate` turns the account into a step time with one overlap assumption: compute (at
the chip's bf16 peak) and HBM traffic (at its bandwidth) overlap, so the slower of the
two counts; collectives are added after, not overlapped (at ICI bandwidth within a
slice, DCN across slices). Beside that single estimate, for comparing programs, it gives
the bounds a user can plan with: the lower one if everything overlapped perfectly (the
slowest of compute, HBM, the links and the host transfers), the upper one if nothing did
(their sum). Host-offload transfers are charged only at a bandwidth the caller states
(no chip page publishes one); without it the upper bound is unknown. docs/AOT.md states
the model's blind spots.
"""

from __future__ import annotations

import dataclasses
import re

from gpt_oss_train import hardware
from gpt_oss_train.aot import hlo_costs
from gpt_oss_train.aot.hlo_text import Computation, Inst, MeshSpec, Module, nbytes, parse
from gpt_oss_train.kernels.xla.expert_parallel import OVERFLOW_SCOPE

# ----------------------------------------------------------------------------- the account


@dataclasses.dataclass
class CustomCall:
    kernel: str
    operand_bytes: float
    result_bytes: float
    runs: float
    flops: float | None  # per run; None: not costed


@dataclasses.dataclass
class StepAccount:
    """Per chip, per step. flops includes the costed custom calls (custom_call_flops)."""

    flops: float = 0.0
    custom_call_flops: float = 0.0
    hbm_bytes: float = 0.0
    host_bytes: float = 0.0  # between HBM and host memory (offloaded arrays), both ways
    collectives: list[hlo_costs.Collective] = dataclasses.field(default_factory=list)
    custom_calls: list[CustomCall] = dataclasses.field(default_factory=list)
    loops: list[hlo_costs.Loop] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    traffic: list[Traffic] = dataclasses.field(default_factory=list)  # largest first
    # The same program with its routing-dependent rounds counted (OVERFLOW_SCOPE's
    # conditionals), where it has any: the upper bound's account. None: nothing left out.
    every_round: StepAccount | None = None


@dataclasses.dataclass
class Traffic:
    """One instruction's HBM bytes over the step (read + written, times its runs)."""

    bytes: float
    runs: float
    opcode: str
    shape: str
    source: str  # the JAX operation it came from (XLA's op_name), "" if none


_OP_NAME = re.compile(r'op_name="([^"]*)"')
TOP_TRAFFIC = 12  # instructions kept in the account, largest first


def _custom_call(comp: Computation, inst: Inst, runs: float, ragged_rows: float) -> CustomCall:
    name = hlo_costs.kernel_name(inst)
    hook = hlo_costs.CUSTOM_CALL_FLOPS.get(name)
    operands = sum(nbytes(comp.insts[o].shape) for o in inst.operands)
    flops = hook(comp, inst) if hook else None
    if flops is None:
        flops = hlo_costs.declared_flops(inst)
    if flops is not None and name in hlo_costs.RAGGED_KERNELS:
        flops *= ragged_rows
    return CustomCall(name, operands, nbytes(inst.shape), runs, flops)


def account(
    hlo: str | Module, mesh: MeshSpec | None = None, ragged_rows: float = 1.0
) -> StepAccount:
    """What one step of the program does per chip (module docstring). `ragged_rows`: the
    share of a ragged dot's rows that hold data (its FLOPs are counted for those only):
    buffers sized for the worst routing hold 1/expert-shards of their rows on average.

    The MoE's rounds past the first (conditionals under OVERFLOW_SCOPE) run only when a
    shard's pairs exceed one round's capacity, which balanced routing does not: they are
    left out here and counted in `every_round`, the upper bound's account."""
    module = hlo if isinstance(hlo, Module) else parse(hlo)
    acct = _account(module, mesh, ragged_rows, OVERFLOW_SCOPE)
    rounds = (i for c in module.computations.values() for i in c.insts.values())
    if any(hlo_costs.skips(inst, OVERFLOW_SCOPE) for inst in rounds):
        acct.every_round = _account(module, mesh, ragged_rows, None)
        acct.notes.append(
            f"rounds past the first ({OVERFLOW_SCOPE}): left out of the estimate and the "
            "lower bound (balanced routing fits one round), counted in the upper bound"
        )
    return acct


def _account(module: Module, mesh, ragged_rows: float, skip_scope: str | None) -> StepAccount:
    runs, fused, loops, notes = hlo_costs.runs_of(module, skip_scope)
    acct = StepAccount(loops=loops, notes=notes)
    for name, times in runs.items():
        comp = module.computations[name]
        for inst in comp.insts.values():
            if inst.opcode in ("dot", "ragged-dot"):
                share = ragged_rows if inst.opcode == "ragged-dot" else 1.0
                acct.flops += times * share * hlo_costs.dot_flops(comp, inst)
            elif inst.opcode == "convolution":
                acct.flops += times * hlo_costs.conv_flops(comp, inst)
            elif inst.opcode == "custom-call" and not hlo_costs.is_xla_marker(inst):
                call = _custom_call(comp, inst, times, ragged_rows)
                acct.custom_calls.append(call)
                acct.custom_call_flops += times * (call.flops or 0.0)
            if name not in fused:
                moved = times * hlo_costs.hbm_bytes(module, comp, inst)
                acct.hbm_bytes += moved
                if moved:
                    source = _OP_NAME.search(inst.attrs)
                    acct.traffic.append(
                        Traffic(
                            moved, times, inst.opcode, inst.shape, source.group(1) if source else ""
                        )
                    )
            acct.host_bytes += times * hlo_costs.host_bytes(comp, inst)
            coll = hlo_costs.collective(module, comp, inst, mesh, times)
            if coll:
                acct.collectives.append(coll)
    acct.flops += acct.custom_call_flops
    acct.traffic = sorted(acct.traffic, key=lambda t: -t.bytes)[:TOP_TRAFFIC]
    if ragged_rows != 1.0:
        notes.append(
            f"ragged dots: FLOPs of {ragged_rows:.3g} of their rows (those that hold data "
            "under balanced routing); their bytes count every row"
        )
    offloaded = [c for c in acct.collectives if c.sparse_core]
    if offloaded:
        sent = sum(c.runs * c.link_bytes for c in offloaded) / 2**30
        notes.append(
            f"{len(offloaded)} collective(s) run on the SparseCores ({sent:.1f} GiB sent a "
            "step), beside the TensorCores' work; charged like the others"
        )
    uncosted = {c.kernel for c in acct.custom_calls if c.flops is None}
    if uncosted:
        notes.append(f"custom calls not costed (no FLOPs counted): {', '.join(sorted(uncosted))}")
    return acct


# ----------------------------------------------------------------------------- summary and estimate


def _grouped(colls: list[hlo_costs.Collective], key) -> dict[str, dict]:
    """Collectives summed by key(collective): instructions, runs and bytes per step."""
    out = {}
    for c in colls:
        row = out.setdefault(key(c), dict(count=0, runs=0.0, result_bytes=0.0, link_bytes=0.0))
        row["count"] += 1
        row["runs"] += c.runs
        row["result_bytes"] += c.runs * c.result_bytes
        row["link_bytes"] += c.runs * c.link_bytes
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["link_bytes"]))


def _axes_key(c: hlo_costs.Collective) -> str:
    where = ",".join(c.axes) if c.axes else ("(none)" if c.axes == () else "(unknown)")
    return where + (" [DCN]" if c.dcn else "")


def _kernels(calls: list[CustomCall]) -> dict[str, dict]:
    """Custom calls summed by kernel: runs, bytes and FLOPs per step (None: not costed)."""
    out = {}
    for c in calls:
        if not c.runs:  # in a branch that does not run (the MoE's rounds past the first)
            continue
        row = out.setdefault(
            c.kernel, dict(runs=0.0, operand_bytes=0.0, result_bytes=0.0, flops=0.0)
        )
        row["runs"] += c.runs
        row["operand_bytes"] += c.runs * c.operand_bytes
        row["result_bytes"] += c.runs * c.result_bytes
        costed = c.flops is not None and row["flops"] is not None
        row["flops"] = row["flops"] + c.runs * c.flops if costed else None
    return out


def summary(acct: StepAccount) -> dict:
    """The account as plain numbers per chip per step (JSON): bytes are totals over runs."""
    return {
        "flops": acct.flops,
        "custom_call_flops": acct.custom_call_flops,
        "hbm_bytes": acct.hbm_bytes,
        "host_bytes": acct.host_bytes,
        "collectives_by_kind": _grouped(acct.collectives, lambda c: c.kind),
        "collectives_by_axes": _grouped(acct.collectives, _axes_key),
        "custom_calls": _kernels(acct.custom_calls),
        "loops": [dataclasses.asdict(lp) for lp in acct.loops],
        "traffic": [dataclasses.asdict(t) for t in acct.traffic],
        "notes": list(acct.notes),
    }


ASSUMPTION = (
    "compute (bf16 peak) and HBM traffic overlap: the slower counts; collectives are added "
    "after, not overlapped (ICI at half the chip's bidirectional bandwidth, DCN at its "
    "per-chip figure)"
)


def _collective_seconds(
    acct: StepAccount, chip: hardware.Chip
) -> tuple[float | None, float | None]:
    """(ICI seconds, DCN seconds): link bytes over the bandwidth of the links they cross;
    None where there are such bytes and no figure for those links. A ring sends one way
    around while receiving from the other, so a chip's one-way share of its ICI counts,
    split among the devices a chip shows (each sends its own share)."""
    ici = sum(c.runs * c.link_bytes for c in acct.collectives if not c.dcn)
    dcn = sum(c.runs * c.link_bytes for c in acct.collectives if c.dcn)
    n = chip.devices_per_chip
    ici_s = ici / (chip.ici_bandwidth / 2 / n) if chip.ici_bandwidth else (0.0 if not ici else None)
    dcn_s = dcn / (chip.dcn_bandwidth / n) if chip.dcn_bandwidth else (0.0 if not dcn else None)
    return ici_s, dcn_s


def _seconds(acct: StepAccount, chip: hardware.Chip) -> tuple:
    """(compute, HBM, ICI, DCN) seconds of an account on `chip` (None: no figure)."""
    hbm_s = acct.hbm_bytes / chip.hbm_bandwidth if chip.hbm_bandwidth else None
    return (acct.flops / chip.peak_flops, hbm_s, *_collective_seconds(acct, chip))


def bounds(
    parts: dict[str, float | None],
    host_bytes: float,
    host_bandwidth: float | None,
    upper_parts: dict[str, float | None] | None = None,
) -> dict:
    """(step_lower_s, step_upper_s, host_s): every part overlapped against none. The
    host transfers count at `host_bandwidth` (bytes/s a device, both ways together);
    without it they are left out of the lower bound (which stays a bound) and the upper
    bound is None. A part without its chip figure (None) leaves both None. `upper_parts`:
    the upper bound's own parts where they differ (every MoE round counted)."""
    host_s = host_bytes / host_bandwidth if host_bandwidth else (0.0 if not host_bytes else None)
    known = list(parts.values())
    every = list((upper_parts or parts).values())
    if any(t is None for t in known + every):
        return {"step_lower_s": None, "step_upper_s": None, "host_s": host_s}
    lower = max([*known, host_s or 0.0])
    upper = None if host_s is None else sum(every) + host_s
    return {"step_lower_s": lower, "step_upper_s": upper, "host_s": host_s}


_HOST_NOTE = "host offload moves"


def _charge(e: dict, host_bandwidth: float | None, devices_per_chip: int) -> None:
    """Sets the bounds of estimate `e`, host transfers at `host_bandwidth` bytes/s a chip
    (None: not charged), and the note that says which."""
    per_device = host_bandwidth / devices_per_chip if host_bandwidth else None
    parts = {k: e[f"{k}_s"] for k in ("compute", "hbm", "ici", "dcn")}
    e.update(bounds(parts, e["host_bytes"], per_device, e.get("every_round_s")))
    e["notes"] = [n for n in e["notes"] if not n.startswith(_HOST_NOTE)]
    if e["host_bytes"]:
        charged = (
            f"charged in the bounds at {host_bandwidth / 1e9:g} GB/s a chip (given)"
            if host_bandwidth
            else "not charged (no chip page states a host-link figure; --host_gbps "
            "states one), so no upper bound"
        )
        e["notes"].append(
            f"{_HOST_NOTE} {e['host_bytes'] / 2**30:.1f} GiB a step between HBM and host "
            f"memory; {charged}; the single estimate leaves it out"
        )


def charge_host(result: dict, host_gbps: float) -> None:
    """A compiled result's bounds (its "estimate") with the host transfers charged at
    `host_gbps` GB/s a chip (aot_compile's and maxtext_compile's --host_gbps)."""
    e = result.get("estimate") or {}
    chip = hardware.chip(result.get("device_kind", ""))
    if "compute_s" in e and chip is not None:
        _charge(e, host_gbps * 1e9, chip.devices_per_chip)


def estimate(
    acct: StepAccount,
    chip: hardware.Chip | None,
    model_flops: float | None = None,
    tokens: float | None = None,
    host_bandwidth: float | None = None,
) -> dict:
    """Step time per the overlap assumption (ASSUMPTION), with tokens/s per chip and the MFU
    it implies from `model_flops` and `tokens` per device per step (the account is a
    device's; a chip may show several), and the lower and upper bounds (`bounds`; host
    transfers at `host_bandwidth` bytes/s a chip, if given). Any part without a chip
    figure is None, and the notes say which."""
    out = {"assumption": ASSUMPTION, "notes": []}
    if chip is None:
        out["notes"].append("no figures for this chip in gpt_oss_train/hardware.py: no estimate")
        return out
    compute_s, hbm_s, ici_s, dcn_s = _seconds(acct, chip)
    out.update(compute_s=compute_s, hbm_s=hbm_s, ici_s=ici_s, dcn_s=dcn_s)
    if acct.every_round is not None:
        every = _seconds(acct.every_round, chip)
        out["every_round_s"] = dict(zip(("compute", "hbm", "ici", "dcn"), every, strict=True))
    if hbm_s is None:
        out["notes"].append("no HBM bandwidth figure for this chip: no step time")
    links = [name for name, t in (("ICI", ici_s), ("DCN", dcn_s)) if t is None]
    if links:
        out["notes"].append(
            f"no interconnect figure ({' and '.join(links)}) for this chip, whose collectives "
            "cross those links: no step time"
        )
    step = None if hbm_s is None or links else max(compute_s, hbm_s) + ici_s + dcn_s
    out["host_bytes"] = acct.host_bytes
    _charge(out, host_bandwidth, chip.devices_per_chip)
    out["step_s"] = step
    per_chip = tokens * chip.devices_per_chip if tokens else None
    out["tokens_per_s_per_chip"] = per_chip / step if step and per_chip else None
    out["mfu"] = model_flops / step / chip.peak_flops if step and model_flops else None
    return out
