"""runtime.py: the per-platform dtype choice, the compilation cache's folder and the
process setup (the reuse of freed buffers on CPUs only)."""

import os
import platform
import subprocess
import sys

import pytest
from support import ROOT

from gpt_oss_train import config as config_lib
from gpt_oss_train import runtime, sharding


def test_cpu_flags_are_read_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 amx_bf16 amx_tile\nbugs\t: x\n")
    assert {"avx2", "amx_bf16"} <= runtime.cpu_flags(str(info))
    assert runtime.cpu_flags(str(tmp_path / "missing")) == frozenset()


@pytest.mark.parametrize(
    "platform,flags,want",
    [
        ("cpu", {"avx2", "fma"}, "float32"),  # Zen 3, older Xeons: no bf16 units
        ("cpu", {"avx2", "avx512f", "avx512_bf16"}, "bfloat16"),  # Zen 4, Cooper Lake
        ("cpu", {"avx2", "amx_bf16", "amx_tile"}, "bfloat16"),  # Sapphire Rapids
        ("gpu", set(), "bfloat16"),
        ("tpu", set(), "bfloat16"),
    ],
)
def test_auto_dtype_is_bfloat16_only_with_native_bfloat16_matmuls(platform, flags, want):
    fast = runtime.fast_bfloat16(platform, frozenset(flags))
    assert ("bfloat16" if fast else "float32") == want


def test_explicit_dtypes_win_and_model_configs_get_a_concrete_one():
    assert runtime.resolve_dtype("float32", "tpu") == "float32"
    assert runtime.resolve_dtype("bfloat16", "cpu") == "bfloat16"
    assert runtime.resolve_dtype("auto", "tpu") == "bfloat16"
    assert runtime.resolve_dtype("auto", "gpu") == "bfloat16"
    c = config_lib.default_config()
    assert c.dtype == "auto"
    config_lib.validate(c)
    here = "bfloat16" if runtime.fast_bfloat16(sharding.platform()) else "float32"
    assert sharding.platform() == "cpu"
    assert config_lib.ModelConfig.from_config(c).dtype == here
    # an ahead-of-time compile for a TPU on this host resolves "auto" for the TPU
    assert config_lib.ModelConfig.from_config(c, platform="tpu").dtype == "bfloat16"
    c.dtype = "bf16"
    with pytest.raises(config_lib.ConfigError, match="config.dtype"):
        config_lib.validate(c)


def test_the_platform_is_a_required_argument():
    """No function guesses the platform from the machine: the caller names the one its
    program runs on (sharding.platform())."""
    for fn in (runtime.fast_bfloat16, runtime.inference_compiler_options, runtime.setup_process):
        with pytest.raises(TypeError):
            fn()
    with pytest.raises(TypeError):
        runtime.resolve_dtype("auto")


def test_inference_compiler_options_are_a_cpu_workaround():
    assert runtime.inference_compiler_options("cpu") == {
        "xla_disable_hlo_passes": "while-loop-invariant-code-motion"
    }
    assert runtime.inference_compiler_options("gpu") == {}
    assert runtime.inference_compiler_options("tpu") == {}


@pytest.mark.parametrize("platform,reuses", [("cpu", True), ("gpu", False), ("tpu", False)])
def test_setup_process_reuses_freed_memory_only_on_a_cpu(monkeypatch, platform, reuses):
    calls = []
    monkeypatch.setattr(runtime, "setup_compilation_cache", lambda: calls.append("cache"))
    monkeypatch.setattr(runtime, "reuse_freed_memory", lambda: calls.append("reuse") or True)
    runtime.setup_process(platform)
    assert calls == (["cache", "reuse"] if reuses else ["cache"])


def test_compilation_cache_folder(monkeypatch, tmp_path):
    monkeypatch.delenv(runtime.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert runtime.compilation_cache_dir() == str(tmp_path / "gpt_oss_train" / "jax")
    monkeypatch.setenv(runtime.CACHE_ENV, "off")
    assert runtime.compilation_cache_dir() is None
    monkeypatch.setenv(runtime.CACHE_ENV, "")
    assert runtime.compilation_cache_dir() is None
    monkeypatch.setenv(runtime.CACHE_ENV, str(tmp_path / "mine"))
    assert runtime.compilation_cache_dir() == str(tmp_path / "mine")


def test_compiled_programs_land_in_the_cache(tmp_path):
    """A fresh process that sets the cache up writes what it compiles there."""
    code = (
        "import jax, jax.numpy as jnp\n"
        "from gpt_oss_train import runtime\n"
        "print(runtime.setup_compilation_cache())\n"
        "jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)\n"
        "jax.jit(lambda x: jnp.sin(x) @ x)(jnp.ones((4, 4))).block_until_ready()\n"
    )
    cache = tmp_path / "cache"
    env = dict(os.environ, JAX_PLATFORMS="cpu", **{runtime.CACHE_ENV: str(cache)})
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == str(cache)
    assert any(cache.iterdir())


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="a glibc setting")
def test_large_freed_buffers_stay_in_the_heap_for_reuse():
    """glibc's own accounting (mallinfo2): by default a 100 MB buffer is a fresh mapping,
    unmapped when freed (faulted in and zeroed again on the next step); after
    reuse_freed_memory it comes from the heap and its pages stay there once freed. A
    process set up for a CPU program does that; one set up for an accelerator does not."""
    code = (
        "import ctypes, sys\n"
        "import numpy as np\n"
        "from gpt_oss_train import runtime\n"
        "if sys.argv[1] == 'on':\n"
        "    assert runtime.reuse_freed_memory()\n"
        "elif sys.argv[1] != 'off':\n"
        "    runtime.setup_process(sys.argv[1])\n"
        "class Info(ctypes.Structure):\n"
        "    _fields_ = [(n, ctypes.c_size_t) for n in ('arena ordblks smblks hblks hblkhd '\n"
        "                'usmblks fsmblks uordblks fordblks keepcost').split()]\n"
        "libc = ctypes.CDLL('libc.so.6')\n"
        "libc.mallinfo2.restype = Info\n"
        "a = np.ones(100 << 20, np.uint8)\n"
        "mapped = libc.mallinfo2().hblkhd\n"
        "del a\n"
        "print(mapped >> 20, libc.mallinfo2().fordblks >> 20)\n"
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    mib = {}
    for mode in ("off", "on", "cpu", "gpu"):
        r = subprocess.run(
            [sys.executable, "-c", code, mode], cwd=ROOT, env=env, capture_output=True, text=True
        )
        assert r.returncode == 0, r.stderr[-2000:]
        mib[mode] = [int(v) for v in r.stdout.split()[-2:]]  # (mapped, free in heap) MiB
    for mode in ("off", "gpu"):
        assert mib[mode][0] >= 100 and mib[mode][1] < 100, mib
    for mode in ("on", "cpu"):
        assert mib[mode][0] < 100 <= mib[mode][1], mib
