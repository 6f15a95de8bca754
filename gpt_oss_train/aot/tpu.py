"""TPU devices with no TPU attached: libtpu describes a slice's chips as compile-only
devices, so a CPU machine compiles for a pod it has not booked. Also the compiler's
identity each result carries, since libtpu releases differ by GiBs on one step."""

from __future__ import annotations

import os
from importlib import metadata


def offline_environment():
    """Set before libtpu loads (and JAX_PLATFORMS before JAX picks its backends: the CLI
    calls this first). Off a TPU VM, libtpu would otherwise ask the GCE metadata server
    for the accelerator type and worker names, fail, and log errors; these are only
    defaults (a TPU VM's own environment wins), and the accelerator type named here does
    not constrain the topology compiled for. JAX_PLATFORMS=cpu keeps a TPU VM's own chips
    free: nothing here runs on them, which is also why several compiles may load libtpu at
    once (it otherwise holds /tmp/libtpu_lockfile and refuses a second process). Not done
    at import: an importing process (a test) keeps its environment."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    # The same on-chip scratch limit launch/tpu_pod.sh and launch/xpk.sh give the pod, so
    # this check compiles what the pod will run.
    os.environ.setdefault("LIBTPU_INIT_ARGS", "--xla_tpu_scoped_vmem_limit_kib=65536")


def devices(topology: str, num_slices: int = 1) -> list:
    """Compile-only TPU devices of `topology` (num_slices copies of it over DCN)."""
    offline_environment()
    try:
        # lazy: optional dependency (the `tpu` extra), imported only to give a clear message
        # when it is missing
        import libtpu  # noqa: F401
    except ImportError:
        raise SystemExit(
            "gpt_oss_train.tools.aot_compile needs libtpu, the TPU compiler: "
            "pip install -e '.[tpu]'"
        ) from None
    # lazy: JAX after offline_environment(): the commands (tools/aot_compile.py,
    # tools/maxtext_compile.py) import this module before anything loads JAX
    from jax.experimental import topologies

    kwargs = {"num_slices": num_slices} if num_slices > 1 else {}
    try:
        try:
            desc = topologies.get_topology_desc(topology_name=topology, platform="tpu", **kwargs)
        except Exception as e:
            if "chips_per_host_bounds" not in str(e):
                raise
            # A slice smaller than one host's default 2x2 chips (v5e:1x1, v5e:2x1): one
            # host holds it all.
            dims = [int(d) for d in topology.split(":")[-1].split("x")]
            kwargs["chips_per_host_bounds"] = (dims + [1, 1])[:3]
            desc = topologies.get_topology_desc(topology_name=topology, platform="tpu", **kwargs)
    except Exception as e:
        raise SystemExit(
            f"--topology={topology}: libtpu cannot describe it ({e}). Use "
            "<chip>:<shape>, e.g. v5e:16x16, v6e:8x8, v5p:4x4x4"
        ) from None
    return list(desc.devices)


def target(topology: str, num_slices: int) -> dict:
    """The slice and the compiler a result was compiled with (libtpu's version and the
    LIBTPU_INIT_ARGS it read), as every result records them."""
    return dict(
        topology=topology,
        num_slices=num_slices,
        libtpu_version=metadata.version("libtpu"),
        libtpu_init_args=os.environ.get("LIBTPU_INIT_ARGS", ""),
    )
