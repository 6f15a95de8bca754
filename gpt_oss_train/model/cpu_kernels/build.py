"""Builds a kernel's C++ source into a shared library on first use and registers its
handlers as XLA:CPU custom-call targets.

The library is compiled for this machine's CPU (-march=native) and cached under the
user's cache folder, keyed by the source (and the headers beside it), the compiler and
the CPU's flags, so a second process loads it at once and a home folder shared by
different CPUs never loads a library built for another. Without a C++ compiler (or
with GPT_OSS_TRAIN_CPU_KERNELS=0) nothing is built and callers keep their XLA path.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading

import jax
import jax.numpy as jnp

from gpt_oss_train import runtime

ENV = "GPT_OSS_TRAIN_CPU_KERNELS"  # "0" / "off": never build, use XLA's lowering
FLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-std=c++17", "-shared", "-fPIC"]
_lock = threading.Lock()
# What the kernels read their weights and KV caches in, and the compute dtypes they stand
# in for: bfloat16 is widened to float32 as it is read (stream_rows.h); the arithmetic and
# the results are float32.
DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def _cpu_id() -> str:
    """What the library's instructions depend on: the CPU's model and feature flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() + platform.machine()


def _compiler() -> str | None:
    found = (shutil.which(name) for name in ("g++", "c++", "clang++"))
    return os.environ.get("CXX") or next((path for path in found if path), None)


def _library_path(source: str, cxx: str) -> str:
    code = b""
    for path in [source, *sorted(glob.glob(os.path.join(os.path.dirname(source), "*.h")))]:
        with open(path, "rb") as f:
            code += f.read()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(
        b"\0".join(s.encode() if isinstance(s, str) else s
                   for s in (code, version, " ".join(FLAGS), _cpu_id(), jax.ffi.include_dir()))
    ).hexdigest()[:16]  # fmt: skip
    folder = runtime.user_cache_dir("cpu_kernels")
    name = os.path.splitext(os.path.basename(source))[0]
    return os.path.join(folder, f"{name}-{key}.so")


def _compile(source: str, cxx: str, target: str) -> None:
    os.makedirs(os.path.dirname(target), exist_ok=True)
    # Built beside the target and renamed into place: a concurrent process never loads a
    # half-written library.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(target))
    os.close(fd)
    try:
        cmd = [cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", source, "-o", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


@functools.cache
def load(source_name: str, handlers: tuple[tuple[str, str], ...]) -> bool:
    """Builds (or finds) `source_name` (beside this file) and registers each (target name,
    exported symbol) for the CPU. False, logged once, where that is not possible."""
    if os.environ.get(ENV, "").strip().lower() in ("0", "off", "false", "no"):
        return False
    cxx = _compiler()
    if cxx is None:
        logging.warning("no C++ compiler found: CPU kernels off, XLA's lowering in use")
        return False
    source = os.path.join(os.path.dirname(os.path.abspath(__file__)), source_name)
    with _lock:
        try:
            target = _library_path(source, cxx)
            if not os.path.exists(target):
                logging.info("building %s -> %s", source_name, target)
                _compile(source, cxx, target)
            library = ctypes.cdll.LoadLibrary(target)
            for name, symbol in handlers:
                capsule = jax.ffi.pycapsule(getattr(library, symbol))
                jax.ffi.register_ffi_target(name, capsule, platform="cpu")
        except (OSError, RuntimeError, AttributeError) as e:
            logging.warning("CPU kernel %s unavailable, XLA's lowering in use: %s", source_name, e)
            return False
    return True
