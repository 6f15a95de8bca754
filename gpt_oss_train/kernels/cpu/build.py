"""Builds a kernel's C++ source into a shared library on first use and registers its
handlers as XLA:CPU custom-call targets.

The library is compiled for this machine's CPU (-march=native) and cached under the
user's cache folder, keyed by the source (and the headers beside it), the compiler and
the CPU's flags, so a second process loads it at once and a home folder shared by
different CPUs never loads a library built for another. Processes that need the same
library at once take turns on a file lock (one compiles, the others load its result),
and a compile that runs past BUILD_TIMEOUT_S is abandoned. Without a C++ compiler, on a
CPU without a kernel's instructions, or with GPT_OSS_TRAIN_CPU_KERNELS=0, nothing is
built: `unavailable` says why, and the registry keeps the XLA reference.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import glob
import hashlib
import logging
import os
import platform
import shutil
import signal
import subprocess
import tempfile
import threading

import jax

from gpt_oss_train import runtime

ENV = "GPT_OSS_TRAIN_CPU_KERNELS"  # "0" / "off": never build, use XLA's lowering
FLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-std=c++17", "-shared", "-fPIC"]
BUILD_TIMEOUT_S = 300  # the largest kernel builds in ~10 s on 2 cores
_lock = threading.Lock()


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
        b"\0".join(
            s.encode() if isinstance(s, str) else s
            for s in (code, version, " ".join(FLAGS), _cpu_id(), jax.ffi.include_dir())
        )
    ).hexdigest()[:16]
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
        # Its own process group, so a compile past the limit is ended with the compiler
        # processes the driver started.
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        try:
            _, stderr = proc.communicate(timeout=BUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise RuntimeError(f"the build took over {BUILD_TIMEOUT_S} s") from None
        if proc.returncode:
            logging.warning("%s failed:\n%s", " ".join(cmd), stderr[-4000:])
            errors = [ln for ln in stderr.splitlines() if "error" in ln.lower()]
            raise RuntimeError(f"{cxx}: {(errors or stderr.splitlines() or ['?'])[0]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


@contextlib.contextmanager
def _file_lock(target: str):
    """Held by one process at a time for `target`: the others wait, then find it built."""
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with open(target + ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def disabled() -> bool:
    return os.environ.get(ENV, "").strip().lower() in ("0", "off", "false", "no")


@functools.cache
def unavailable(source_name: str, handlers: tuple[tuple[str, str], ...], cpu_flag: str = ""):
    """Builds (or finds) `source_name` (beside this file) and registers each (target name,
    exported symbol) for the CPU. None when that worked; else why not (a failed build is
    logged with the compiler's output; the registry logs every reason once)."""
    if disabled():  # the user's choice first, then what the machine lacks
        return f"{ENV}=0"
    if cpu_flag and cpu_flag not in runtime.cpu_flags():
        return f"no {cpu_flag}"
    cxx = _compiler()
    if cxx is None:
        return "no C++ compiler"
    source = os.path.join(os.path.dirname(os.path.abspath(__file__)), source_name)
    with _lock:
        try:
            target = _library_path(source, cxx)
            with _file_lock(target):
                if not os.path.exists(target):
                    logging.info("building %s -> %s", source_name, target)
                    _compile(source, cxx, target)
            library = ctypes.cdll.LoadLibrary(target)
            for name, symbol in handlers:
                capsule = jax.ffi.pycapsule(getattr(library, symbol))
                jax.ffi.register_ffi_target(name, capsule, platform="cpu")
        except (OSError, RuntimeError, AttributeError) as e:
            logging.warning("CPU kernel %s unavailable, XLA's lowering in use: %s", source_name, e)
            return f"build failed: {str(e).splitlines()[0][:300]}"
    return None


def require(source_name: str, handlers, cpu_flag: str = "") -> None:
    """For the kernels' call wrappers: raise where the library is not there."""
    reason = unavailable(source_name, handlers, cpu_flag)
    if reason:
        raise RuntimeError(f"the CPU kernel {source_name} is unavailable: {reason}")
