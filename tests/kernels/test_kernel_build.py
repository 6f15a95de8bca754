"""kernels/cpu/build.py: how the C++ kernels are built, or why not.

Two processes that need the same kernel at once compile it once (a file lock; the other
loads the result); a compile past BUILD_TIMEOUT_S is abandoned with a reason that says
so; GPT_OSS_TRAIN_CPU_KERNELS=0 and a CPU without a kernel's instructions build nothing
and leave the registry's XLA references in place; collecting the kernel tests compiles
nothing. The compiler is a script ($CXX) that records its calls and runs (or stands in
for) the real one, and every build goes to a fresh cache folder ($XDG_CACHE_HOME)."""

import os
import subprocess
import sys
import time

import pytest
from support import ROOT

from gpt_oss_train import runtime
from gpt_oss_train.kernels import Kernels, registry
from gpt_oss_train.kernels.cpu import (
    SOURCES,
    build,
    glu,
    grouped_matmul,
    rows_matmul,
    self_attention,
)


@pytest.fixture
def fresh_build():
    """build.unavailable and the registry remember their answers for the process: forget
    them before a test that changes what they see, and after it (a later call builds or
    finds the library again and registers the same targets from the same file)."""
    build.unavailable.cache_clear()
    registry._unavailable.cache_clear()
    yield
    build.unavailable.cache_clear()
    registry._unavailable.cache_clear()


def _compiler_script(path, body: str, version: bool = True) -> str:
    """An executable /bin/sh script at `path` that runs `body`; with `version`, it answers
    `--version` (which build.py asks for the cache key) itself."""
    answer = f'case " $* " in *" --version "*) echo {path.name} 1.0; exit 0;; esac\n'
    path.write_text("#!/bin/sh\n" + (answer if version else "") + body + "\n")
    path.chmod(0o755)
    return str(path)


def _real_compiler() -> str:
    """The compiler build.py would use here (skips where there is none)."""
    found = build._compiler()
    if found is None:
        pytest.skip("no C++ compiler")
    return found


def _libraries(cache) -> list[str]:
    folder = cache / "gpt_oss_train" / "cpu_kernels"
    return sorted(p.name for p in folder.glob("*.so")) if folder.exists() else []


# Each process: import, say it is ready, wait for the go file, then ask for the kernel.
_RACE = """
import logging, os, sys, time
logging.basicConfig(level=logging.INFO, format="%(process)d %(message)s")
from gpt_oss_train.kernels.cpu import rows_matmul
open(sys.argv[1], "w").close()
while not os.path.exists(sys.argv[2]):
    time.sleep(0.005)
start = time.monotonic()
reason = rows_matmul.unavailable()
print("unavailable:", reason, round(time.monotonic() - start, 3))
"""


def test_two_processes_building_one_kernel_at_once_compile_it_once(tmp_path):
    real = _real_compiler()
    calls = tmp_path / "compiles"
    # Each compile is logged and takes 2 s more, so the second process arrives while the
    # first one compiles.
    cxx = _compiler_script(tmp_path / "c++", f'echo "$$" >> {calls}\nsleep 2\nexec {real} "$@"')
    env = dict(os.environ, CXX=cxx, XDG_CACHE_HOME=str(tmp_path / "cache"))
    env.pop(build.ENV, None)
    go = tmp_path / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RACE, str(tmp_path / f"ready{i}"), str(go)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"ready{i}").exists() for i in range(2)):
            assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
            assert time.monotonic() < deadline, "the processes did not start"
            time.sleep(0.01)
        go.touch()
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
    answers = [out.split("unavailable: ")[1].split() for out, _ in outs]
    assert [a[0] for a in answers] == ["None", "None"], outs
    # Both calls lasted the compile's 2 s: the second waited on the lock for the first.
    assert min(float(a[1]) for a in answers) >= 1.5, answers
    assert len(calls.read_text().split()) == 1
    logs = "".join(err for _, err in outs)
    assert logs.count("building rows_matmul.cc") == 1, logs
    libraries = _libraries(tmp_path / "cache")
    assert len(libraries) == 1 and libraries[0].startswith("rows_matmul-"), libraries


def test_a_build_past_the_time_limit_is_abandoned(tmp_path, monkeypatch, fresh_build):
    cxx = _compiler_script(tmp_path / "slow-c++", "exec sleep 60")
    monkeypatch.setenv("CXX", cxx)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(build.ENV, raising=False)
    monkeypatch.setattr(build, "BUILD_TIMEOUT_S", 1)
    start = time.monotonic()
    reason = rows_matmul.unavailable()
    assert reason == "build failed: the build took over 1 s"
    assert time.monotonic() - start < 30  # the compiler was stopped, not waited for
    assert _libraries(tmp_path / "cache") == []  # nor a half-written one left behind
    with pytest.raises(RuntimeError, match="rows_matmul.cc is unavailable: .*took over 1 s"):
        build.require("rows_matmul.cc", rows_matmul.HANDLERS)


@pytest.mark.parametrize("value", ["0", "off"])
def test_the_environment_switch_builds_nothing_and_keeps_the_references(
    tmp_path, monkeypatch, fresh_build, value
):
    calls = tmp_path / "calls"
    cxx = _compiler_script(tmp_path / "c++", f'echo "$*" >> {calls}\nexit 1')
    monkeypatch.setenv("CXX", cxx)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv(build.ENV, value)
    assert build.disabled()
    assert rows_matmul.unavailable() == "GPT_OSS_TRAIN_CPU_KERNELS=0"
    for name in SOURCES:  # a kernel whose instructions this CPU lacks says that first
        reason = __import__(f"gpt_oss_train.kernels.cpu.{name}", fromlist=["_"]).unavailable()
        assert reason == "GPT_OSS_TRAIN_CPU_KERNELS=0" or reason.startswith("no "), (name, reason)
    for op in registry.OPS:
        assert Kernels().impl(op, "cpu").name == "xla", op
    assert "grouped_matmul=xla (cpu: " in Kernels().describe("cpu")
    assert not calls.exists() and not (tmp_path / "cache").exists()


def test_a_cpu_without_the_instructions_builds_nothing(tmp_path, monkeypatch, fresh_build):
    calls = tmp_path / "calls"
    cxx = _compiler_script(tmp_path / "c++", f'echo "$*" >> {calls}\nexit 1')
    monkeypatch.setenv("CXX", cxx)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(build.ENV, raising=False)
    monkeypatch.setattr(runtime, "cpu_flags", lambda path="/proc/cpuinfo": frozenset({"avx2"}))
    assert grouped_matmul.unavailable() == "no avx512_bf16"
    assert glu.unavailable() == "no avx512_bf16"
    assert self_attention.unavailable() == "no avx512f"
    for op in ("grouped_matmul", "gated_activation", "attention"):
        assert Kernels().impl(op, "cpu").name == "xla", op
    assert not calls.exists()  # the flags are checked before the compiler is asked
    # (describe also asks for the kernels without such flags: their builds fail here)
    assert "grouped_matmul=xla (cpu: no avx512_bf16)" in Kernels().describe("cpu")
    asked = calls.read_text() if calls.exists() else ""
    for source in ("grouped_matmul.cc", "glu.cc", "self_attention.cc", "cross_entropy.cc"):
        assert source not in asked


def test_collecting_the_kernel_tests_compiles_nothing(tmp_path):
    """Tests ask for a kernel when they run (the `cpu_kernel` fixture): importing and
    collecting them neither builds a kernel nor asks the compiler anything."""
    calls = tmp_path / "calls"
    cxx = _compiler_script(tmp_path / "c++", f'echo "$*" >> {calls}\nexit 1', version=False)
    files = [
        "kernels/test_cpu_kernels.py",
        "kernels/test_glu.py",
        "kernels/test_cpu_grouped_matmul.py",
        "kernels/test_cpu_self_attention.py",
        "kernels/test_fused_adamw.py",
        "training/test_loss.py",
        "kernels/test_kernel_build.py",
    ]
    env = dict(os.environ, CXX=cxx, XDG_CACHE_HOME=str(tmp_path / "cache"))
    env.pop(build.ENV, None)
    # no terminal reporter: its summary (conftest) lists the kernels, building them
    options = ["--collect-only", "-o", "addopts=", "-p", "no:terminal", "-p", "no:cacheprovider"]
    cmd = [sys.executable, "-m", "pytest", *options, *(os.path.join("tests", f) for f in files)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert not calls.exists(), calls.read_text()
    assert not (tmp_path / "cache").exists()
