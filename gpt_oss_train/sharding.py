"""Meshes and logical axes.

Model code names the axes of its arrays logically (`('batch', 'length', 'act_embed')`);
`config.logical_axis_rules` says which mesh axes each name shards over. This module is the
only place those two meet: it builds the mesh, turns logical names into PartitionSpecs,
and constrains activations inside the model when a mesh is active.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import os
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gpt_oss_train.errors import ConfigError

Rules = tuple[tuple[str, Any], ...]

# The mesh axes, outermost first. Parameters and activations never name them: logical
# axis rules (config.logical_axis_rules) map logical names onto these. `context` splits
# every activation's sequence (kernels/xla/context_parallel.py says how attention crosses it).
MESH_AXES = ("data", "fsdp", "context", "tensor", "expert")


def resolve_axis_sizes(
    sizes: dict[str, int], num_devices: int, what: str = "mesh"
) -> tuple[int, ...]:
    """Mesh sizes in MESH_AXES order, with the one -1 filled so the product is num_devices
    (an axis `sizes` leaves out has size 1)."""
    values = [int(sizes.get(ax, 1)) for ax in MESH_AXES]
    known = math.prod(v for v in values if v != -1)
    if -1 in values:
        if num_devices % known:
            raise ConfigError(
                f"config.{what}: the fixed axes multiply to {known}, which does not divide the "
                f"{num_devices} devices; change the sizes so the -1 axis gets a whole number"
            )
        values[values.index(-1)] = num_devices // known
    if math.prod(values) != num_devices:
        raise ConfigError(
            f"config.{what}: {dict(zip(MESH_AXES, values))} uses {math.prod(values)} devices but "
            f"{num_devices} are available; make the product equal the device count or set "
            "one axis to -1"
        )
    return tuple(values)


def make_mesh(
    mesh_sizes: dict[str, int],
    dcn_sizes: dict[str, int] | None = None,
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """The device mesh with axes MESH_AXES (data, fsdp, context, tensor, expert).

    `mesh_sizes` is per slice (ICI); `dcn_sizes` splits across slices (multi-slice TPU) and
    is multiplied in, with the hybrid mesh keeping fast ICI axes inside a slice.
    """
    devices = list(jax.devices() if devices is None else devices)
    dcn = tuple(int((dcn_sizes or {}).get(ax, 1)) for ax in MESH_AXES)
    num_slices = math.prod(dcn)
    if len(devices) % num_slices:
        raise ConfigError(
            f"config.mesh_dcn: {num_slices} slices do not divide {len(devices)} devices"
        )
    ici = resolve_axis_sizes(dict(mesh_sizes), len(devices) // num_slices, "mesh")
    if num_slices > 1:
        # Splitting physical axes is what lets e.g. fsdp=32 x expert=8 lie on a 16x16 slice
        # (32 = 16 x 2); without it every such mesh fails here, with no fallback.
        grid = mesh_utils.create_hybrid_device_mesh(
            ici, dcn, devices=devices, allow_split_physical_axes=True
        )
    else:
        try:
            grid = mesh_utils.create_device_mesh(ici, devices=devices)
        except Exception:  # CPU or unusual topologies: plain order is as good as any
            grid = np.array(devices).reshape(ici)
    # Auto axes: XLA propagates shardings between the constraints we place.
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def _freeze(rules) -> tuple:
    return tuple(
        (r[0], r[1] if r[1] is None or isinstance(r[1], str) else tuple(r[1]))
        if isinstance(r, (tuple, list)) and len(r) == 2
        else r
        for r in rules
    )


def validate_rules(rules: Rules, mesh_axes: Sequence[str] = MESH_AXES) -> Rules:
    """Normalises rules to ((name, tuple_of_mesh_axes), ...) and rejects unknown axes."""
    return _validate_rules(_freeze(rules), tuple(mesh_axes))


@functools.lru_cache(maxsize=64)
def _validate_rules(rules: Rules, mesh_axes: tuple[str, ...]) -> Rules:
    out = []
    seen = set()
    for rule in rules:
        if len(rule) != 2:
            raise ConfigError(
                f"config.logical_axis_rules: {rule!r} is not a (name, mesh_axes) pair"
            )
        name, axes = rule
        if name in seen:
            raise ConfigError(f"config.logical_axis_rules: {name!r} appears twice")
        seen.add(name)
        if axes is None:
            axes = ()
        elif isinstance(axes, str):
            axes = (axes,)
        axes = tuple(axes)
        for ax in axes:
            if ax not in mesh_axes:
                raise ConfigError(
                    f"config.logical_axis_rules: {name!r} maps to unknown mesh axis "
                    f"{ax!r}; mesh axes are {tuple(mesh_axes)}"
                )
        out.append((name, axes))
    return tuple(out)


def logical_to_spec(names: Sequence[str | None], rules: Rules) -> P:
    """PartitionSpec for an array whose dims carry `names`. Errors if two dims would share
    a mesh axis, or a name has no rule."""
    table = dict(validate_rules(rules))
    used: dict[str, str] = {}
    spec = []
    for name in names:
        if name is None:
            spec.append(None)
            continue
        if name not in table:
            raise ConfigError(
                f"config.logical_axis_rules: no rule for logical axis {name!r} "
                f"(array axes {tuple(names)}); add ({name!r}, None) to replicate it"
            )
        axes = table[name]
        for ax in axes:
            if ax in used:
                raise ConfigError(
                    f"config.logical_axis_rules: array axes {tuple(names)} map both "
                    f"{used[ax]!r} and "
                    f"{name!r} to mesh axis {ax!r}; one array cannot shard two dims over one axis"
                )
            used[ax] = name
        spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return P(*spec)


# The mesh and rules the model constrains activations with. Set by `use_mesh` around
# tracing; with none set, `constrain` is a no-op (single-device tests need nothing).
_ACTIVE: contextvars.ContextVar[tuple[Mesh, Rules] | None] = contextvars.ContextVar(
    "gpt_oss_train_active_mesh", default=None
)


@contextlib.contextmanager
def use_mesh(mesh: Mesh, rules: Rules):
    rules = validate_rules(rules, mesh.axis_names)
    token = _ACTIVE.set((mesh, rules))
    try:
        with jax.set_mesh(mesh):
            yield
    finally:
        _ACTIVE.reset(token)


def active() -> tuple[Mesh, Rules] | None:
    return _ACTIVE.get()


def device(mesh: Mesh | None = None) -> jax.Device:
    """A device of the computation being traced: `mesh`'s, else the active mesh's (which,
    when compiling ahead of time for a TPU topology, are the target's devices), else the
    default one."""
    ctx = _ACTIVE.get()
    if mesh is None and ctx is not None:
        mesh = ctx[0]
    return mesh.devices.flat[0] if mesh is not None else jax.devices()[0]


def platform(mesh: Mesh | None = None) -> str:
    """The platform a program runs on ("cpu", "gpu", "tpu"): the one place it is read.
    Kernel choices, dtype resolution and process setup all ask this, not jax.devices()."""
    return device(mesh).platform


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Pins an activation's sharding by logical names (a no-op without an active mesh, and
    inside shard_map, where each device holds its own block)."""
    ctx = _ACTIVE.get()
    if ctx is None or inside_shard_map():
        return x
    mesh, rules = ctx
    spec = logical_to_spec(names, rules)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, fit_spec(spec, x.shape, mesh)))


def host_readable(tree):
    """Outputs the host reads (sampled tokens, log-probabilities), whole on every device:
    on several processes a process can read an array only if it holds all of it."""
    return jax.tree.map(lambda x: constrain(x, (None,) * x.ndim), tree)


def fit_spec(spec: P, shape: Sequence[int], mesh: Mesh) -> P:
    """Drops mesh axes from dims they do not divide (e.g. batch 1 at decode time, or 8 KV
    heads on a 16-way tensor axis), keeping the largest prefix of axes that divides."""
    out = []
    for dim, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        if axes is None:
            out.append(None)
            continue
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        kept = []
        for ax in axes:
            if dim % (math.prod(mesh.shape[a] for a in kept) * mesh.shape[ax]) == 0:
                kept.append(ax)
        out.append(spec_entry(tuple(kept)))
    return P(*out)


def batch_sharding(mesh: Mesh, rules: Rules, ndim: int = 2) -> NamedSharding:
    """Sharding of a [batch, length, ...] input array."""
    return NamedSharding(mesh, logical_to_spec(("batch",) + (None,) * (ndim - 1), rules))


def batch_divisor(mesh: Mesh, rules: Rules) -> int:
    """How many ways the batch dimension is split: global batch must be a multiple."""
    spec = logical_to_spec(("batch",), rules)[0]
    axes = () if spec is None else (spec,) if isinstance(spec, str) else spec
    return math.prod(mesh.shape[a] for a in axes)


def initialize_distributed():
    """Joins the processes of a multi-host job before any JAX computation.

    TPU pods and SLURM/Open MPI are detected by JAX itself. Anywhere else (GPU clusters,
    N local CPU processes, GKE JobSets) the launcher exports JAX_COORDINATOR_ADDRESS
    (host:port), JAX_PROCESS_COUNT and JAX_PROCESS_ID. A single process does nothing.
    """
    addr = os.environ.get("JAX_COORDINATOR_ADDRESS")
    count = int(os.environ.get("JAX_PROCESS_COUNT", "1"))
    if addr and count > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=addr,
            num_processes=count,
            process_id=int(os.environ["JAX_PROCESS_ID"]),
            initialization_timeout=300,
        )
    elif os.environ.get("TPU_WORKER_HOSTNAMES") or os.environ.get("MEGASCALE_COORDINATOR_ADDRESS"):
        jax.distributed.initialize()


# ----------------------------------------------------------------------------- inside shard_map


def spec_axes(entry) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry (None, an axis name, or a tuple of them)."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def split_axes(entry, mesh: Mesh) -> tuple[str, ...]:
    """The axes of a PartitionSpec entry that split a dimension: those of more than one
    device (a rule naming a size-1 axis, as `length` -> `context` does by default,
    splits nothing)."""
    return tuple(a for a in spec_axes(entry) if mesh.shape[a] > 1)


def spec_entry(axes: tuple[str, ...]):
    """The PartitionSpec entry of `axes` (spec_axes' inverse): None, a name, or the tuple."""
    return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


def inside_shard_map() -> bool:
    """Whether the code is being traced inside shard_map (per device, manual axes)."""
    return bool(jax.sharding.get_abstract_mesh().manual_axes)


def per_device() -> bool:
    """Whether arrays traced here are one device's own: no mesh, a one-device mesh, or
    inside shard_map. A Pallas kernel runs per device; on a wider mesh outside shard_map
    the partitioner cannot split its call."""
    ctx = _ACTIVE.get()
    return ctx is None or ctx[0].size == 1 or inside_shard_map()


def axes_size(axes: tuple[str, ...]) -> int:
    """The number of devices along the product of `axes` (inside shard_map)."""
    n = 1
    for ax in axes:
        n *= jax.lax.axis_size(ax)
    return n


def axes_index(axes: tuple[str, ...]):
    """This device's index along the product of `axes`, major to minor (inside shard_map);
    the order in which tiled collectives over `axes` lay out the devices' blocks."""
    idx = 0
    for ax in axes:
        idx = idx * jax.lax.axis_size(ax) + jax.lax.axis_index(ax)
    return idx


# libtpu (0.0.42.1) runs a reduce-scatter of more than about 256 MiB as an all-reduce of
# the whole array and a slice of it: twice the bytes on the links and a whole-size buffer
# (measured: [2880, 32768] bf16 stays a reduce-scatter, [2880, 50272] does not).
_REDUCE_SCATTER_PIECE_BYTES = 128 << 20


def reduce_scatter(x, axes: tuple[str, ...], axis: int):
    """psum_scatter of x over `axes` along `axis` (tiled; inside shard_map), in pieces
    along its last other axis small enough to stay reduce-scatters (above)."""
    if not axes:
        return x
    pieces = -(-x.size * x.dtype.itemsize // _REDUCE_SCATTER_PIECE_BYTES)
    along = max(a for a in range(x.ndim) if a != axis) if x.ndim > 1 else axis
    if pieces <= 1 or along == axis:
        return jax.lax.psum_scatter(x, axes, scatter_dimension=axis, tiled=True)
    parts = jnp.array_split(x, min(pieces, x.shape[along]), axis=along)
    scatter = lambda p: jax.lax.psum_scatter(p, axes, scatter_dimension=axis, tiled=True)
    return jnp.concatenate([scatter(p) for p in parts], axis=along)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def gather_weight(x, axes: tuple[str, ...], axis: int, dtype):
    """A weight's shards over `axes` joined along `axis` in the compute `dtype` (inside
    shard_map: FSDP's gather, at the compute dtype's bytes). Its gradient comes back
    reduce-scattered over `axes` in x's dtype: each device gets the sum for its own shard,
    half the bytes of the all-reduce shard_map's transpose of an unsplit weight makes."""
    y = x.astype(dtype)
    return jax.lax.all_gather(y, axes, axis=axis, tiled=True) if axes else y


def _gather_weight_fwd(x, axes, axis, dtype):
    return gather_weight(x, axes, axis, dtype), jnp.zeros((), x.dtype)


def _gather_weight_bwd(axes, axis, dtype, like, g):
    # Reduced in the compute dtype it was computed in, as the partitioner reduces every
    # other weight's gradient (half the bytes of a float32 reduce-scatter), then widened.
    return (reduce_scatter(g, axes, axis).astype(like.dtype),)


gather_weight.defvjp(_gather_weight_fwd, _gather_weight_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def joined(shard, whole, axes: tuple[str, ...], axis: int):
    """`whole` (this weight shard joined with the others over `axes` along `axis`, in the
    compute dtype: gather_weight's result, gathered once by the caller) for one use, inside
    shard_map; the use's gradient comes back to `shard` reduce-scattered over `axes` right
    away, so no device accumulates a whole-matrix gradient over several uses."""
    return whole


def _joined_fwd(shard, whole, axes, axis):
    return whole, jnp.zeros((), shard.dtype)


def _joined_bwd(axes, axis, like, g):
    g = reduce_scatter(g, axes, axis)
    # The barrier keeps XLA from moving the reduction out of the caller's loop (summing the
    # whole gradients first and reducing once: fewer collectives, a whole-matrix buffer).
    return jax.lax.optimization_barrier(g).astype(like.dtype), None


joined.defvjp(_joined_fwd, _joined_bwd)
