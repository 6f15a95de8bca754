"""Optimized HLO text (`compiled.as_text()`, as libtpu and XLA:CPU print it) read into
computations and instructions, array shapes and their bytes, and replica groups mapped to
the mesh axes they span: what hlo_costs.py and step_model.py count from."""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

# ----------------------------------------------------------------------------- parsing


@dataclasses.dataclass
class Inst:
    name: str
    shape: str  # the result shape as printed, layouts included
    opcode: str
    operands: list[str]
    args: str  # the text inside the parentheses (a constant's literal)
    attrs: str  # everything after them


@dataclasses.dataclass
class Computation:
    name: str
    insts: dict[str, Inst]  # in program order
    root: str


@dataclasses.dataclass
class Module:
    computations: dict[str, Computation]
    entry: str
    num_devices: int


_HEADER = re.compile(r"^(ENTRY )?%([\w.\-]+) .*\{$")
_INST = re.compile(r"^\s+(ROOT )?%([\w.\-]+) = (.*)$", re.S)
NAME = re.compile(r"%([\w.\-]+)")


def _closing(text: str, i: int) -> int:
    """Index of the parenthesis closing the one at text[i]."""
    depth = 0
    for j in range(i, len(text)):
        depth += {"(": 1, ")": -1}.get(text[j], 0)
        if depth == 0:
            return j
    raise ValueError(f"unbalanced parentheses in HLO: {text[i : i + 80]!r}")


def _parse_inst(text: str) -> tuple[Inst, bool]:
    m = _INST.match(text)
    root, name, rest = bool(m.group(1)), m.group(2), m.group(3)
    end = _closing(rest, 0) + 1 if rest.startswith("(") else rest.index(" ")
    shape, rest = rest[:end], rest[end:].lstrip()
    opcode = re.match(r"[\w\-]+", rest).group(0)
    close = _closing(rest, len(opcode))
    args = rest[len(opcode) + 1 : close]
    return Inst(name, shape, opcode, NAME.findall(args), args, rest[close + 1 :]), root


def _computation(name: str, lines: list[str]) -> Computation:
    insts, root = {}, None
    for text in lines:
        inst, is_root = _parse_inst(text)
        insts[inst.name] = inst
        root = inst.name if is_root else root
    return Computation(name, insts, root)


def parse(text: str) -> Module:
    """The computations of an HLO module's text. An instruction may run over several lines
    (a kernel's metadata string does); a computation ends at a line holding only '}', or
    '}, execution_thread="..."' (work offloaded to v5p's SparseCores)."""
    comps, entry, current, lines = {}, None, None, []
    for line in text.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m:
                current, lines = m.group(2), []
                entry = current if m.group(1) else entry
        elif line == "}" or line.startswith("}, execution_thread="):
            comps[current] = _computation(current, lines)
            current = None
        elif _INST.match(line):
            lines.append(line)
        elif lines:
            lines[-1] += "\n" + line
    if entry is None:
        raise ValueError("no ENTRY computation: pass compiled.as_text() of a compiled program")
    header = text[: text.find("\n")]
    partitions = re.search(r"num_partitions=(\d+)", header)
    replicas = re.search(r"replica_count=(\d+)", header)
    devices = int(partitions.group(1) if partitions else 1) * int(
        replicas.group(1) if replicas else 1
    )
    return Module(comps, entry, devices)


# ----------------------------------------------------------------------------- shapes

_ARRAY = re.compile(r"(\w+)\[([^\]]*)\](?:\{([^}]*)\})?")
_DTYPE_BITS = {"pred": 8, "token": 0, "c64": 64, "c128": 128}


def _bits(dtype: str) -> int:
    """Bits per element: the number in the type's name (bf16, s4, f8e4m3fn, u32, f4e2m1fn)."""
    if dtype in _DTYPE_BITS:
        return _DTYPE_BITS[dtype]
    m = re.match(r"[a-z]+(\d+)", dtype)
    return int(m.group(1)) if m else 0


def arrays(shape: str, padded: bool = False) -> list[tuple[str, tuple[int, ...], int]]:
    """(dtype, dims, memory space) of each array in a (tuple) shape; space 0 is HBM.
    padded: dims rounded up to the layout's tile (TPU's T(8,128) pads the two most minor
    dims to 8 x 128), the size the array takes in memory and what a copy of it moves."""
    out = []
    for dtype, dims, layout in _ARRAY.findall(shape):
        space = re.search(r"S\((\d+)\)", layout or "")
        sizes = tuple(int(d) for d in re.findall(r"\d+", dims))  # "<=N" dynamic: N
        if padded and layout and ":T(" in layout:
            sizes = _tiled(sizes, layout)
        out.append((dtype, sizes, int(space.group(1)) if space else 0))
    return out


def _tiled(dims: tuple[int, ...], layout: str) -> tuple[int, ...]:
    """dims with the most minor ones (in the layout's order) rounded up to its first tile."""
    minor_to_major = [int(x) for x in layout.split(":")[0].split(",") if x]
    tile = [int(x) for x in re.search(r"T\(([\d,]+)\)", layout).group(1).split(",")]
    if len(minor_to_major) != len(dims):
        return dims
    out = list(dims)
    for t, d in zip(reversed(tile), minor_to_major, strict=False):
        out[d] = -(-out[d] // t) * t
    return tuple(out)


def nbytes(shape: str, hbm_only: bool = False, padded: bool = False) -> float:
    """Bytes of a (tuple) shape; hbm_only: of its arrays in HBM, tile-padded (what HBM
    traffic moves); else of every array, logical unless padded."""
    return sum(
        math.prod(dims) * _bits(dtype) / 8
        for dtype, dims, space in arrays(shape, padded=hbm_only or padded)
        if not (hbm_only and space != 0)
    )


def dims(shape: str) -> tuple[int, ...]:
    return arrays(shape)[0][1]


def ints(attrs: str, key: str) -> list[int]:
    m = re.search(rf"\b{key}=\{{([\d,]*)\}}", attrs)
    return [int(x) for x in m.group(1).split(",") if x] if m else []


# ----------------------------------------------------------------------------- replica groups


def _iota(dims: list[int], reshape: list[int], perm: list[int] | None) -> np.ndarray:
    """XLA's iota tile assignment `[dims]<=[reshape]T(perm)`: iota reshaped, transposed by
    perm, reshaped to dims (IotaTileAssignment)."""
    a = np.arange(math.prod(reshape)).reshape(reshape)
    return (a.transpose(perm) if perm else a).reshape(dims)


def _mesh_groups(text: str) -> list[list[int]]:
    """XLA's mesh-axes form `mesh['a'=2,'b'=4] {'a'}` (libtpu's SPMD partitioner prints
    it), with sub-axes `'a':(pre)size` and a non-iota `, device_ids=(...)`: the mesh's ids
    reshaped (each sub-axised axis split into [pre, size, rest]), the grouped dims
    transposed last in the order named, then cut into groups (MeshAxesReplicaGroupList)."""
    axes = [(n, int(s)) for n, s in re.findall(r"'?([\w.]+)'?=(\d+)", text[: text.index("]")])]
    n = math.prod(s for _, s in axes)
    ids = np.arange(n)
    if "device_ids=(" in text:
        start = text.index("device_ids=(") + len("device_ids=")
        inner = text[start + 1 : _closing(text, start)]
        # iota `[dims]<=[reshape]T(perm)`, or `[dims]T(perm)` (iota shaped dims itself)
        iota = re.match(r"\[([\d,]+)\](?:<=\[([\d,]+)\])?(?:T\(([\d,]+)\))?\)?$", inner)
        nums = lambda s: [int(x) for x in s.split(",")] if s else None
        ids = (
            _iota([n], nums(iota.group(2) or iota.group(1)), nums(iota.group(3))).ravel()
            if iota
            else np.array([int(x) for x in re.findall(r"\d+", inner)][-n:])  # the ids, last
        )
    body = text[text.rindex("{") + 1 : text.rindex("}")]
    refs = [
        (name, int(pre) if pre else None, int(size) if size else None)
        for name, pre, size in re.findall(r"'?([\w.]+)'?(?::\((\d+)\)(\d+))?", body)
    ]
    dims, grouped = [], {}
    for name, size in axes:
        mine = sorted((r[1] or 1, i) for i, r in enumerate(refs) if r[0] == name)
        prefix = 1
        for pre, i in mine:
            if pre != prefix:
                dims.append(pre // prefix)
                prefix = pre
            grouped[i] = len(dims)
            dims.append(refs[i][2] or size)
            prefix *= dims[-1]
        if prefix != size:
            dims.append(size // prefix)
    order = [d for d in range(len(dims)) if d not in grouped.values()]
    order += [grouped[i] for i in range(len(refs))]
    group = math.prod(dims[grouped[i]] for i in range(len(refs)))
    return ids.reshape(dims).transpose(order).reshape(-1, group).tolist()


def replica_groups(attrs: str, num_devices: int) -> list[list[int]]:
    """The groups of a collective's `replica_groups=` in any of XLA's three forms: explicit
    `{{0,1},{2,3}}` (`{}`: one group of all), iota `[2,4]<=[8]` / `[4,2]<=[2,4]T(1,0)`, and
    mesh axes; or a permute's `source_target_pairs=`, each pair a group. The ids are
    positions in the program's device assignment (global ids with one replica or one
    partition, the only cases JAX compiles), which JAX makes the mesh's devices in order."""
    m = re.search(r"(?:replica_groups|source_target_pairs)=\{((?:\{[\d,\s]*\},?\s*)*)\}", attrs)
    if m:
        groups = [
            [int(x) for x in g.split(",") if x.strip()]
            for g in re.findall(r"\{([^}]*)\}", m.group(1))
        ]
        return groups or [list(range(num_devices))]
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
    if m:
        perm = [int(x) for x in m.group(4).split(",")] if m.group(4) else None
        reshape = [int(x) for x in m.group(3).split(",")]
        return _iota([int(m.group(1)), int(m.group(2))], reshape, perm).tolist()
    if "replica_groups=mesh[" in attrs:
        return _mesh_groups(_mesh_text(attrs))
    if "replica_groups=" in attrs:
        where = attrs[attrs.index("replica_groups=") :]
        raise ValueError(f"replica_groups form not understood: {where[:80]!r}")
    return [list(range(num_devices))]  # none printed: all devices


def _mesh_text(attrs: str) -> str:
    """`mesh[...]` [`, device_ids=(...)`] ` {...}` from the attributes: the ids may hold
    parentheses and braces of their own, so this scans rather than matches."""
    start = attrs.index("replica_groups=mesh[") + len("replica_groups=")
    end = attrs.index("]", start) + 1
    if attrs.startswith(", device_ids=(", end):
        end = _closing(attrs, end + len(", device_ids=")) + 1
    return attrs[start : attrs.index("}", attrs.index("{", end)) + 1]


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """The device mesh a program was compiled for: axis names and sizes, and the slice of
    each device in mesh order (multi-slice; empty: one slice)."""

    axis_names: tuple[str, ...]
    axis_sizes: tuple[int, ...]
    slice_ids: tuple[int, ...] = ()

    @classmethod
    def from_jax(cls, mesh) -> MeshSpec:
        slices = tuple(getattr(d, "slice_index", 0) or 0 for d in mesh.devices.flat)
        return cls(tuple(mesh.axis_names), tuple(mesh.devices.shape), slices)


def mesh_axes(groups: list[list[int]], mesh: MeshSpec) -> tuple[str, ...] | None:
    """The mesh axes whose coordinate varies within a group (None: ids outside the mesh)."""
    n = math.prod(mesh.axis_sizes)
    if any(i >= n for g in groups for i in g):
        return None
    varying = set()
    for g in groups:
        coords = np.unravel_index(np.array(g), mesh.axis_sizes)
        varying |= {a for a, c in zip(mesh.axis_names, coords, strict=True) if len(set(c)) > 1}
    return tuple(a for a in mesh.axis_names if a in varying)
