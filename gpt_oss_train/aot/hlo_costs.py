"""What each instruction of an optimized HLO program costs a chip, per run of its
computation: the loops' trip counts and how often each computation runs, FLOPs of dots,
convolutions and costed custom calls, HBM bytes, and collectives (step_model.py's
docstring says how each is counted)."""

from __future__ import annotations

import collections
import dataclasses
import math
import re

import numpy as np

from gpt_oss_train.aot.hlo_text import (
    NAME,
    Computation,
    Inst,
    MeshSpec,
    Module,
    arrays,
    dims,
    ints,
    mesh_axes,
    nbytes,
    replica_groups,
)

# ----------------------------------------------------------------------------- loops


def _through(comp: Computation, name: str) -> Inst:
    """The instruction behind copies and bitcasts, which do not change a counter's value."""
    inst = comp.insts[name]
    while inst.opcode in ("copy", "bitcast", "reshape") and inst.operands:
        inst = comp.insts[inst.operands[0]]
    return inst


def _value(comp: Computation, name: str) -> tuple[str, int] | None:
    """('const', v) for an integer constant, ('index', k) for element k of the
    computation's tuple parameter, else None."""
    inst = _through(comp, name)
    if inst.opcode == "constant" and re.fullmatch(r"-?\d+", inst.args.strip()):
        return ("const", int(inst.args))
    if inst.opcode == "get-tuple-element" and comp.insts[inst.operands[0]].opcode == "parameter":
        return ("index", int(re.search(r"index=(\d+)", inst.attrs).group(1)))
    return None


def _scalar_op(module: Module, comp: Computation, name: str, opcodes) -> tuple[Inst, list] | None:
    """(the op, its operands' values) of a compare or add, directly or as the root of a
    one-op fusion (CPU wraps scalar ops in fusions), operands resolved in `comp`."""
    inst = _through(comp, name)
    if inst.opcode == "fusion":
        inner = module.computations[_callees(inst)[0][0]]
        op = inner.insts[inner.root]
        if op.opcode not in opcodes:
            return None
        params = [
            int(inner.insts[o].args) for o in op.operands if inner.insts[o].opcode == "parameter"
        ]
        if len(params) != len(op.operands):
            return None
        return op, [_value(comp, inst.operands[p]) for p in params]
    if inst.opcode not in opcodes:
        return None
    return inst, [_value(comp, o) for o in inst.operands]


def _counted_trips(module: Module, caller: Computation, loop: Inst) -> int | None:
    """Trips of `i = c0; while i < N (or <=): i += s` read from the loop itself, or None
    when it has another form: the analysis XLA's own trip-count finder does."""
    cond, body = (module.computations[c] for c in _loop_parts(loop))
    found = _scalar_op(module, cond, cond.root, ("compare",))
    if not found:
        return None
    op, (a, b) = found
    direction = re.search(r"direction=(\w+)", op.attrs).group(1)
    if a and b and a[0] == "const" and b[0] == "index":  # N > i is i < N
        a, b, direction = b, a, {"GT": "LT", "GE": "LE"}.get(direction, "")
    if not (a and b and a[0] == "index" and b[0] == "const" and direction in ("LT", "LE")):
        return None
    k, limit = a[1], b[1] + (direction == "LE")
    init = caller.insts[loop.operands[0]]
    start = _value(caller, init.operands[k]) if init.opcode == "tuple" else None
    root = body.insts[body.root]
    step = _scalar_op(module, body, root.operands[k], ("add",)) if root.opcode == "tuple" else None
    if not (start and start[0] == "const" and step):
        return None
    values = step[1]
    if ("index", k) not in values or not any(v and v[0] == "const" and v[1] > 0 for v in values):
        return None
    s = next(v[1] for v in values if v and v[0] == "const")
    return max(0, -(-(limit - start[1]) // s))


def _loop_parts(loop: Inst) -> tuple[str, str]:
    return (
        re.search(r"condition=%([\w.\-]+)", loop.attrs).group(1),
        re.search(r"body=%([\w.\-]+)", loop.attrs).group(1),
    )


@dataclasses.dataclass
class Loop:
    name: str
    trip_count: int | None  # None: unknown, counted once
    source: str  # "xla" (known_trip_count), "condition" (read from the loop), "unknown"


def _trips(module: Module, caller: Computation, loop: Inst) -> Loop:
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', loop.attrs)
    if m:
        return Loop(loop.name, int(m.group(1)), "xla")
    n = _counted_trips(module, caller, loop)
    return Loop(loop.name, n, "condition" if n is not None else "unknown")


# ----------------------------------------------------------------------------- the call graph


def _callees(inst: Inst) -> list[tuple[str, str]]:
    """(computation, how) each instruction runs: 'body'/'condition' (a while), 'branch',
    'call' (a call, or an async call-start: work libtpu hands to the SparseCores, whose
    own instructions, collectives among them, run as written), or 'fused' (a fusion's or
    an async wrapper's insides). Reducers (to_apply of others) are scalar lambdas and are
    left out."""
    if inst.opcode == "while":
        cond, body = _loop_parts(inst)
        return [(body, "body"), (cond, "condition")]
    if inst.opcode == "conditional":
        names = re.search(r"branch_computations=\{([^}]*)\}", inst.attrs)
        found = (
            NAME.findall(names.group(1))
            if names
            else re.findall(r"(?:true|false)_computation=%([\w.\-]+)", inst.attrs)
        )
        return [(n, "branch") for n in found]
    if inst.opcode in ("fusion", "async-start", "call", "call-start"):
        m = re.search(r"\b(?:calls|to_apply)=%([\w.\-]+)", inst.attrs)
        how = "fused" if inst.opcode in ("fusion", "async-start") else "call"
        return [(m.group(1), how)] if m else []
    return []


def skips(inst: Inst, scope: str | None) -> bool:
    """A conditional made under the JAX name scope `scope` (its op_name holds it)."""
    if scope is None or inst.opcode != "conditional":
        return False
    m = re.search(r'op_name="([^"]*)"', inst.attrs)
    return bool(m) and f"/{scope}/" in f"/{m.group(1)}/"


def runs_of(
    module: Module, skip_scope: str | None = None
) -> tuple[dict[str, float], set[str], list[Loop], list[str]]:
    """(times each computation runs per step, the fused ones, the loops, notes). The
    branches of conditionals made under the name scope `skip_scope` run no times."""
    order, seen = [], set()

    def visit(name):  # post-order: callers after callees; reversed, callers first
        seen.add(name)
        for inst in module.computations[name].insts.values():
            for callee, _ in _callees(inst):
                if callee not in seen:
                    visit(callee)
        order.append(name)

    visit(module.entry)
    runs = collections.defaultdict(float, {module.entry: 1.0})
    fused, loops, notes, branches, skipped = set(), [], [], False, 0
    for name in reversed(order):
        comp = module.computations[name]
        for inst in comp.insts.values():
            trips, skip = 1, skips(inst, skip_scope)
            counted = runs[name] > 0
            branches = branches or (inst.opcode == "conditional" and not skip and counted)
            skipped += skip and counted
            if inst.opcode == "while":
                loop = _trips(module, comp, inst)
                loops.append(loop)
                trips = loop.trip_count if loop.trip_count is not None else 1
            if skip:
                trips = 0
            for callee, how in _callees(inst):
                runs[callee] += runs[name] * trips
                if how == "fused" or name in fused:
                    fused.add(callee)
    unknown = [lp.name for lp in loops if lp.trip_count is None]
    if unknown:
        names = ", ".join(unknown[:4])
        notes.append(f"{len(unknown)} loop(s) with no known trip count, counted once: {names}")
    if skipped:
        notes.append(f"{skipped} conditional(s) named {skip_scope}: not run (not counted)")
    if branches:
        notes.append("conditionals: every branch counted as if it ran (an upper bound)")
    return runs, fused, loops, notes


# ----------------------------------------------------------------------------- FLOPs


def dot_flops(comp: Computation, inst: Inst) -> float:
    """2 x output elements x the contracted size (dot and ragged-dot, whose rows each
    meet one group)."""
    lhs = dims(comp.insts[inst.operands[0]].shape)
    contracted = math.prod(lhs[d] for d in ints(inst.attrs, "lhs_contracting_dims"))
    return 2.0 * math.prod(dims(inst.shape)) * contracted


def _window_pairs(size_in, size_k, size_out, stride, pad_lo, lhs_dil, rhs_dil) -> int:
    """(output position, kernel position) pairs of one spatial dim that land on an input
    element rather than on padding or between dilated elements."""
    total, span = 0, (size_in - 1) * lhs_dil
    for k in range(size_k):
        c = k * rhs_dil - pad_lo  # input position of output 0 for this kernel tap
        lo, hi = max(0, -(c // stride)), min(size_out - 1, (span - c) // stride)
        if hi < lo:
            continue
        if lhs_dil == 1:
            total += hi - lo + 1
            continue
        total += _landing(lo, hi - lo + 1, stride, c, lhs_dil)
    return total


def _landing(lo: int, n: int, stride: int, c: int, lhs_dil: int) -> int:
    """How many j in [0, n) put (lo + j) * stride + c on a multiple of lhs_dil (an input
    element, not a hole of the dilation): the solutions of stride * j = r (mod lhs_dil)
    are one residue class modulo lhs_dil / gcd, or none. Closed form, so a weight
    gradient written as a convolution with a long dilation costs no loop over it."""
    g = math.gcd(stride, lhs_dil)
    r = -(lo * stride + c) % lhs_dil
    if r % g:
        return 0
    period = lhs_dil // g
    first = (r // g) * pow(stride // g, -1, period) % period if period > 1 else 0
    return 0 if first >= n else (n - 1 - first) // period + 1


def _window(attrs: str, n: int) -> dict[str, list]:
    m = re.search(r"window=\{([^}]*)\}", attrs)
    fields = dict(kv.split("=", 1) for kv in m.group(1).split()) if m else {}
    get = lambda key, default: (
        [p for p in fields[key].split("x")] if key in fields else [default] * n
    )
    pads = [p.split("_") for p in get("pad", "0_0")]
    return {
        "stride": [int(x) for x in get("stride", "1")],
        "pad_lo": [int(p[0]) for p in pads],
        "lhs_dil": [int(x) for x in get("lhs_dilate", "1")],
        "rhs_dil": [int(x) for x in get("rhs_dilate", "1")],
    }


def conv_flops(comp: Computation, inst: Inst) -> float:
    """2 x output batch x output features x input features per group x the valid
    (output, kernel) position pairs of each spatial dim. TPU writes batched and padded
    matmuls as convolutions, some with padded windows, so padding must not be counted."""
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", inst.attrs).groups()
    shapes = [dims(comp.insts[o].shape) for o in inst.operands[:2]] + [dims(inst.shape)]
    size = [dict(zip(lab, dims, strict=True)) for lab, dims in zip(labels, shapes, strict=True)]
    spatial = sorted(c for c in labels[2] if c.isdigit())
    w = _window(inst.attrs, len(spatial))
    pairs = math.prod(
        _window_pairs(
            size[0][d],
            size[1][d],
            size[2][d],
            w["stride"][i],
            w["pad_lo"][i],
            w["lhs_dil"][i],
            w["rhs_dil"][i],
        )
        for i, d in enumerate(spatial)
    )
    return 2.0 * size[2]["b"] * size[2]["f"] * size[1]["i"] * pairs


def _ragged_dot_kernel_flops(comp: Computation, inst: Inst) -> float | None:
    """TPU's ragged-dot kernel, lhs [m, k] x rhs [groups, k, n] -> [m, n]: each row meets
    one group, 2 m k n. None when the shapes are not that form."""
    if len(inst.operands) < 2:
        return None
    lhs, rhs = (dims(comp.insts[o].shape) for o in inst.operands[-2:])
    out = dims(inst.shape)
    if len(lhs) == 2 and len(rhs) == 3 and lhs[1] == rhs[1] and out == (lhs[0], rhs[2]):
        return 2.0 * lhs[0] * lhs[1] * rhs[2]
    return None


def _megablox_gmm_flops(comp: Computation, inst: Inst) -> float | None:
    """megablox's gmm, lhs [m, k] x rhs [groups, k, n] (or [groups, n, k]) -> [m, n]: each
    row meets one group, 2 m k n (its other operands are the groups' metadata)."""
    out = dims(inst.shape)
    shapes = [dims(comp.insts[o].shape) for o in inst.operands]
    lhs = [s for s in shapes if len(s) == 2 and s[0] == out[0]]
    rhs = [s for s in shapes if len(s) == 3 and out[-1] in s[1:]]
    if len(out) == 2 and lhs and rhs:
        return 2.0 * out[0] * lhs[0][1] * out[1]
    return None


def _megablox_tgmm_flops(comp: Computation, inst: Inst) -> float | None:
    """megablox's tgmm, lhs [k, m] (libtpu passes it [m, k]) and rhs [m, n] -> [groups,
    k, n]: each of the m rows in one group, 2 k m n."""
    out = dims(inst.shape)
    if len(out) != 3:
        return None
    _, k, n = out
    pairs = [dims(comp.insts[o].shape) for o in inst.operands]
    pairs = [s for s in pairs if len(s) == 2]
    for lhs in pairs:
        if k not in lhs:
            continue
        m = lhs[1] if lhs[0] == k else lhs[0]
        if any(rhs == (m, n) for rhs in pairs if rhs is not lhs):
            return 2.0 * k * m * n
    return None


def declared_flops(inst: Inst) -> float | None:
    """The FLOPs a Pallas kernel declares for itself (`pallas_call(cost_estimate=...)`,
    which libtpu keeps in the custom call's backend config), or None."""
    m = re.search(r'"cost_estimate":\{"flops":"(\d+)"', inst.attrs)
    return float(m.group(1)) if m else None


# Costing hooks for custom calls, by kernel name (a TPU custom call's instruction name
# without its .N suffix, else the call's target): (computation, instruction) -> FLOPs,
# or None when the shapes are not the form the hook knows.
CUSTOM_CALL_FLOPS = {
    "ragged-dot-none": _ragged_dot_kernel_flops,
    "gmm": _megablox_gmm_flops,
    "tgmm": _megablox_tgmm_flops,
}
# Kernels whose rows are grouped by expert (step_model's ragged_rows): TPU's, megablox's
# and tokamax's (which MaxText runs)
RAGGED_KERNELS = {
    "ragged-dot-none",
    "gmm",
    "tgmm",
    "gmm_megablox",
    "gmm_megablox_transpose_rhs",
    "tgmm_megablox",
}

# XLA's own bookkeeping custom calls: no kernel, no traffic of their own.
XLA_MARKERS = {
    "AllocateBuffer",
    "AssumeGatherIndicesInBound",
    "ConcatBitcast",
    "AsyncCollectiveStart",
    "AsyncCollectiveDone",
    "GatherScatterIndicesBitpacked",
    "Sharding",
    "SPMDFullToShardShape",
    "SPMDShardToFullShape",
    "LayoutConstraint",
    "SliceId",
    "ZeroCrop",  # (multi-slice)
    # (before a SparseCore call-start)
    "PrepareAsyncCallStart",
    "PrepareAsyncCallDone",
}


def is_xla_marker(inst: Inst) -> bool:
    """A custom call XLA uses for bookkeeping, not a kernel."""
    return kernel_name(inst) in XLA_MARKERS


def kernel_name(inst: Inst) -> str:
    target = re.search(r'custom_call_target="([^"]+)"', inst.attrs).group(1)
    if target != "tpu_custom_call":
        return target
    return re.sub(r"(\.(\d+|clone|sunk))+$", "", inst.name)


# ----------------------------------------------------------------------------- HBM bytes

# Instructions that move no data of their own: names for buffers, control, or a
# computation whose own instructions are counted where they run.
_NO_TRAFFIC = {
    "parameter",
    "constant",
    "tuple",
    "get-tuple-element",
    "bitcast",
    "after-all",
    "add-dependency",
    "partition-id",
    "replica-id",
    "opt-barrier",
    "while",
    "conditional",
    "call",
    "call-start",
    "call-done",
    "domain",
}
_SLICES = ("dynamic-slice", "slice", "gather")
# Updates XLA runs in place on their first operand's buffer: they write only the update.
# (A one-buffer scatter: a variadic one updates several buffers, which this reader treats
# as its last; the engine's cache writes are one buffer each.)
_IN_PLACE = ("dynamic-update-slice", "scatter")


def _users(comp: Computation) -> dict[str, list[Inst]]:
    users = collections.defaultdict(list)
    for inst in comp.insts.values():
        for o in inst.operands:
            users[o].append(inst)
    return users


def _param_read(module: Module, inner: Computation, index: int, full: float) -> float:
    """Bytes a fusion reads of operand `index`: the slices when every use slices it (a
    loop reading one layer of a weight stack; nested fusions followed), nothing where it
    is the buffer an in-place update writes into, else all of it. A value a nested
    fusion passes out as it came in (a bitcast fusion) is read by whatever uses it
    there: all of it, to be safe."""
    param = next(
        (i for i in inner.insts.values() if i.opcode == "parameter" and int(i.args) == index), None
    )
    if param is None:
        return full
    users = _users(inner)
    root = inner.insts[inner.root]
    leaves = set(root.operands) if root.opcode == "tuple" else {root.name}
    read, names, frontier = 0.0, {param.name}, [param.name]
    while frontier:
        name = frontier.pop()
        if name in leaves:
            return full
        for user in users[name]:
            if user.opcode == "bitcast":
                names.add(user.name)
                frontier.append(user.name)
            elif user.opcode in _SLICES and user.operands[0] in names:
                read += nbytes(user.shape, padded=True)
            elif user.opcode == "fusion" and user.operands.count(name) == 1:
                nested = module.computations[_callees(user)[0][0]]
                read += _param_read(module, nested, user.operands.index(name), full)
            elif not (user.opcode in _IN_PLACE and user.operands[0] in names):
                return full
    return min(read, full)


def _update_bytes(comp: Computation, inst: Inst) -> float:
    """What an in-place update writes: a dynamic-update-slice its update; a scatter its
    updates (operands: the buffer, the indices, the updates)."""
    update = inst.operands[1] if inst.opcode == "dynamic-update-slice" else inst.operands[-1]
    return nbytes(comp.insts[update].shape, padded=True)


def _written(inner: Computation, name: str, out_shape: str) -> float:
    """Bytes a fusion output writes: an in-place update writes only its update."""
    inst = _through(inner, name)
    if inst.opcode in _IN_PLACE and nbytes(out_shape, hbm_only=True):
        return _update_bytes(inner, inst)
    return nbytes(out_shape, hbm_only=True)


def _fusion_bytes(module: Module, comp: Computation, inst: Inst) -> float:
    inner = module.computations[_callees(inst)[0][0]]
    read = sum(
        _param_read(module, inner, i, nbytes(comp.insts[o].shape, hbm_only=True))
        for i, o in enumerate(inst.operands)
        if nbytes(comp.insts[o].shape, hbm_only=True)
    )
    root = inner.insts[inner.root]
    outputs = root.operands if root.opcode == "tuple" else [root.name]
    shapes = [inst.shape] if root.opcode != "tuple" else _tuple_elements(inst.shape)
    if len(shapes) != len(outputs):
        return read + nbytes(inst.shape, hbm_only=True)
    return read + sum(_written(inner, o, s) for o, s in zip(outputs, shapes, strict=True))


def _tuple_elements(shape: str) -> list[str]:
    """The top-level elements of a tuple shape, as text."""
    body, parts, depth, start = shape[1:-1], [], 0, 0
    for i, ch in enumerate(body):
        depth += {"(": 1, "{": 1, "[": 1, ")": -1, "}": -1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(body[start:i])
            start = i + 1
    return [p for p in (*parts, body[start:]) if p.strip()]


def hbm_bytes(module: Module, comp: Computation, inst: Inst) -> float:
    """HBM bytes one run of a top-level instruction reads and writes (an estimate)."""
    op = inst.opcode
    operands = lambda: sum(nbytes(comp.insts[o].shape, hbm_only=True) for o in inst.operands)
    if op in _NO_TRAFFIC or op.endswith("-update"):
        return 0.0
    if op == "custom-call" and kernel_name(inst) in XLA_MARKERS:
        return 0.0
    if op.endswith("-done"):  # the result lands at the done, the operands left at the start
        return nbytes(inst.shape, hbm_only=True)
    if op.endswith("-start") or op in ("send", "recv"):  # a recv's result lands at its done
        return operands()
    if op == "fusion":
        return _fusion_bytes(module, comp, inst)
    if op in ("dynamic-slice", "slice"):
        return 2 * nbytes(inst.shape, hbm_only=True)
    if op in _IN_PLACE:  # reads the update (and a scatter's indices), writes it in place
        return 2 * _update_bytes(comp, inst)
    return operands() + nbytes(inst.shape, hbm_only=True)


HOST_SPACE = 5  # TPU's memory space of host memory, S(5): where offloaded arrays live


def _space(shape: str) -> int:
    found = arrays(shape)
    return found[0][2] if found else 0


def host_bytes(comp: Computation, inst: Inst) -> float:
    """Bytes one run moves between HBM and host memory (host offload, as MaxText's remat
    policies ask), else 0: a copy between the two spaces, a slice read out of a buffer in
    host memory, an update written into one (sync, or the -start of the async form, whose
    result holds (operands, result, context); a copy-start's (destination, source, ...))."""
    op = inst.opcode.removesuffix("-start")
    if op not in ("copy", "dynamic-slice", "dynamic-update-slice") or not inst.operands:
        return 0.0
    source = comp.insts[inst.operands[0]].shape
    if op == "copy":  # (a copy-start's destination is its result's first array)
        spaces = {_space(source), _space(inst.shape)}
        return nbytes(source) if HOST_SPACE in spaces and len(spaces) == 2 else 0.0
    if _space(source) != HOST_SPACE:
        return 0.0
    if op == "dynamic-update-slice":
        return nbytes(comp.insts[inst.operands[1]].shape)
    async_form = inst.opcode.endswith("-start")
    return nbytes(_tuple_elements(inst.shape)[1] if async_form else inst.shape)


# ----------------------------------------------------------------------------- collectives

_COLLECTIVES = (
    "all-gather",
    "all-reduce",
    "reduce-scatter",
    "all-to-all",
    "ragged-all-to-all",
    "collective-permute",
    "collective-broadcast",
)


def link_bytes(kind: str, result_bytes: float, n: int) -> float:
    """Bytes each chip sends over links for one run, ring model (n chips in the group)."""
    if n <= 1:
        return 0.0
    factor = {
        "all-reduce": 2 * (n - 1) / n,  # reduce-scatter then all-gather
        "all-gather": (n - 1) / n,  # of the gathered result
        "reduce-scatter": n - 1,  # the result is one chip's 1/n share
        "all-to-all": (n - 1) / n,
        "ragged-all-to-all": (n - 1) / n,  # of what moves (collective()), evenly spread
        "collective-permute": 1.0,
        "collective-broadcast": (n - 1) / n,
    }.get(kind, 1.0)  # another cross-slice transfer: its bytes cross once
    return factor * result_bytes


@dataclasses.dataclass
class Collective:
    kind: str
    name: str
    result_bytes: float  # per chip, one run
    group_size: int
    axes: tuple[str, ...] | None  # mesh axes its groups span (None: no mesh given)
    dcn: bool  # a group spans slices
    runs: float  # per step: the trip counts of the loops around it
    link_bytes: float  # per chip, one run (ring model)
    sparse_core: bool = False  # offloaded to the SparseCores (libtpu's flags)


def _is_reduce_scatter_fusion(inst: Inst) -> bool:
    """TPU's reduce-scatter: a fusion of an all-reduce and the slice of the chip's share,
    in a computation XLA names all-reduce-scatter.N; one reduce-scatter, not an all-reduce."""
    return inst.opcode == "fusion" and _callees(inst)[0][0].startswith("all-reduce-scatter")


def _collective_inst(module: Module, comp: Computation, inst: Inst) -> tuple[str, Inst] | None:
    """(kind, the instruction holding the groups) if `inst` starts a collective that is
    counted here; async -done halves, and the continuation and done copies of TPU's async
    collective fusions (tagged with a chain_id, counted where AsyncCollectiveStart is), are
    not; nor is the all-reduce inside a reduce-scatter fusion."""
    if _is_reduce_scatter_fusion(inst):
        inner = module.computations[_callees(inst)[0][0]]
        reduce = [i for i in inner.insts.values() if i.opcode == "all-reduce"]
        return ("reduce-scatter", reduce[0]) if reduce else None
    kind = inst.opcode.removesuffix("-start")
    if kind not in _COLLECTIVES or comp.name.startswith("all-reduce-scatter"):
        return None
    if "chain_id=" in inst.attrs:
        root = comp.insts[comp.root]
        if not (root.opcode == "custom-call" and "AsyncCollectiveStart" in root.attrs):
            return None
    return kind, inst


def _result_shape(comp: Computation, inst: Inst) -> str:
    """A collective's result: an async -start's is the shape its -done gives."""
    if inst.opcode.endswith("-start"):
        done = inst.opcode.replace("-start", "-done")
        for other in comp.insts.values():
            if other.opcode == done and other.operands[:1] == [inst.name]:
                return other.shape
    return inst.shape


def _slice_axes(mesh: MeshSpec) -> tuple[str, ...]:
    """The mesh axes along which the slice changes: those a cross-slice transfer spans."""
    ids = np.array(mesh.slice_ids).reshape(mesh.axis_sizes)
    return tuple(a for i, a in enumerate(mesh.axis_names) if np.any(np.diff(ids, axis=i) != 0))


def _cross_slice(inst: Inst, mesh: MeshSpec | None, runs: float) -> Collective | None:
    """A multi-slice TPU program crosses slices (DCN) with send/recv pairs for the
    megascale runtime, tagged with the collective they implement: one collective over the
    slices, counted at its recv, whose result is the data the chip ends with."""
    m = re.search(r'_xla_megascale_transfer_type="(\w+)"', inst.attrs)
    if inst.opcode != "recv" or not m:
        return None
    kind = m.group(1).lower().replace("_", "-")
    size = nbytes(_tuple_elements(inst.shape)[0])
    n = len(set(mesh.slice_ids)) if mesh and mesh.slice_ids else 0  # 0: slices unknown
    axes = _slice_axes(mesh) if n else None
    return Collective(kind, inst.name, size, n, axes, True, runs, link_bytes(kind, size, n))


def collective(module, comp, inst, mesh: MeshSpec | None, runs: float) -> Collective | None:
    if inst.opcode == "recv":
        return _cross_slice(inst, mesh, runs)
    found = _collective_inst(module, comp, inst)
    if not found:
        return None
    kind, holder = found
    groups = replica_groups(holder.attrs, module.num_devices)
    size = nbytes(_result_shape(comp, inst))
    if kind == "ragged-all-to-all" and holder.operands[0] in comp.insts:
        # Its buffers are sized for the worst case; what moves depends on the routing: at
        # most the rows of the smaller of operand and output (the chip's pairs going out,
        # or coming back), counted as that, spread evenly over the group.
        size = min(size, nbytes(comp.insts[holder.operands[0]].shape))
    n = max(len(g) for g in groups)
    axes = mesh_axes(groups, mesh) if mesh else None
    dcn = bool(mesh and mesh.slice_ids) and any(
        len({mesh.slice_ids[i] for i in g if i < len(mesh.slice_ids)}) > 1 for g in groups
    )
    sparse_core = "DEVICE_TYPE_SPARSECORE" in holder.attrs
    return Collective(
        kind, inst.name, size, n, axes, dcn, runs, link_bytes(kind, size, n), sparse_core
    )
