"""What this machine can do, and the process-wide JAX setup that follows from it.

fast_bfloat16(platform)   does the hardware multiply bfloat16 natively?
resolve_dtype(name, platform)
                          config.dtype "auto" -> "bfloat16" or "float32" there
inference_compiler_options(platform)
                          XLA options of inference's jitted prefill and decode functions
setup_compilation_cache() JAX's persistent compilation cache, on by default, so a
                          second run of the same command skips compiling
reuse_freed_memory()      keep large freed buffers in the process for reuse (glibc)
setup_process(platform)   what every command (train, decode, serve, tools) runs first:
                          the cache, on a CPU the reuse of freed buffers, and every
                          thread's Python stack on a native crash

The platform is always the one of the mesh the program runs on (sharding.platform), so
an ahead-of-time compile for a TPU on a CPU host resolves "auto" for the TPU.
"""

from __future__ import annotations

import ctypes
import faulthandler
import functools
import os
import platform as platform_lib

import jax
from absl import logging

# x86 CPU flags (Linux /proc/cpuinfo) of native bfloat16 matmul units: AMX tiles (Intel
# Sapphire Rapids and later) and AVX512-BF16 (Cooper Lake, AMD Zen 4 and later). Without
# them XLA converts bfloat16 to float32 around every product: slower than float32.
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")

CACHE_ENV = "GPT_OSS_TRAIN_COMPILATION_CACHE"
CACHE_OFF = ("", "off", "0", "false", "none")


@functools.cache
def cpu_flags(path: str = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU's feature flags (empty where /proc/cpuinfo does not exist)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def fast_bfloat16(platform: str, flags: frozenset[str] | None = None) -> bool:
    """True on GPUs and TPUs, and on CPUs with AMX or AVX512-BF16 (`flags`: the CPU's,
    default read from /proc/cpuinfo)."""
    if platform != "cpu":
        return True
    return any(f in (cpu_flags() if flags is None else flags) for f in BF16_CPU_FLAGS)


def resolve_dtype(name: str, platform: str) -> str:
    """A config dtype with "auto" replaced by the fastest matmul dtype on `platform`."""
    if name != "auto":
        return name
    return "bfloat16" if fast_bfloat16(platform) else "float32"


def inference_compiler_options(platform: str) -> dict:
    """On a CPU, no while-loop-invariant code motion: XLA:CPU hoists the conversion or
    bit copy of a bfloat16 weight stack that a loop slices out of its loops, so each
    prefill chunk copied every expert of every layer before computing (docs/PERFORMANCE.md,
    "What XLA:CPU does slowly"); with the pass off only the slices used are read. Elsewhere none."""
    if platform != "cpu":
        return {}
    return {"xla_disable_hlo_passes": "while-loop-invariant-code-motion"}


def compilation_cache_dir() -> str | None:
    """$GPT_OSS_TRAIN_COMPILATION_CACHE if set ("" or "off": no cache), else
    $XDG_CACHE_HOME/gpt_oss_train/jax (~/.cache/gpt_oss_train/jax)."""
    value = os.environ.get(CACHE_ENV)
    if value is not None:
        return None if value.strip().lower() in CACHE_OFF else os.path.expanduser(value)
    return user_cache_dir("jax")


def user_cache_dir(name: str) -> str:
    """$XDG_CACHE_HOME/gpt_oss_train/NAME (~/.cache/gpt_oss_train/NAME)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "gpt_oss_train", name)


def setup_compilation_cache() -> str | None:
    """Points JAX's persistent compilation cache at compilation_cache_dir(), unless the
    user configured one already (JAX_COMPILATION_CACHE_DIR). Returns the folder in use."""
    if jax.config.jax_compilation_cache_dir:
        return jax.config.jax_compilation_cache_dir
    path = compilation_cache_dir()
    if path is None:
        return None
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:  # a read-only home: run without the cache rather than fail
        logging.warning("compilation cache disabled: cannot create %s (%s)", path, e)
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    # Cache every program that took a moment to compile (JAX's default is 1 s).
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    return path


# glibc's mallopt parameters (malloc.h) and the size up to which freed buffers are kept.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
KEEP_FREED_BYTES = 1 << 30


def reuse_freed_memory() -> bool:
    """Linux with glibc: buffers up to KEEP_FREED_BYTES come from, and go back to, the
    process's heap. By default glibc maps anything over 32 MB (its largest dynamic
    threshold) with mmap and unmaps it when freed, so a CPU training step's large
    temporaries (a 32-expert layer's weight gradient is 75 MB at the benchmark's shape)
    were faulted in and zeroed page by page on every step, which doubled the time of a
    weight-gradient kernel (docs/PERFORMANCE.md, "Page faults"). Bigger buffers
    (checkpoint shards) still go back to the system. Returns whether the setting took."""
    if platform_lib.system() != "Linux" or platform_lib.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return all(
            libc.mallopt(p, ctypes.c_int(KEEP_FREED_BYTES)) == 1
            for p in (_M_MMAP_THRESHOLD, _M_TRIM_THRESHOLD)
        )
    except (OSError, AttributeError):
        return False


def setup_process(platform: str) -> None:
    """What every command runs before its work: JAX's persistent compilation cache and,
    where the program runs on a CPU, the reuse of large freed buffers (a CPU workaround:
    an accelerator's buffers are not the host heap's)."""
    # A crash in native code (a CPU kernel, XLA, TensorStore) prints every Python thread's
    # stack to stderr before the process dies: which step, save or request was under way
    # (a core dump, where enabled, then names the native frame).
    if not faulthandler.is_enabled():
        try:
            faulthandler.enable(all_threads=True)
        except (AttributeError, ValueError, OSError):  # stderr with no file (captured)
            pass
    setup_compilation_cache()
    if platform == "cpu":
        reuse_freed_memory()
