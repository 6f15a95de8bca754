"""tools.gpu_suite: its dry run (every step at tiny shapes on the CPU, as the GPU run takes
them), the rule that proposes each operation's `auto` from the kernels' measurements, and
which carried wheels a machine installs."""

import json
import math
import os
import subprocess
import sys
import time

import pytest
from support import ROOT

from gpt_oss_train.tools import gpu_suite
from gpt_oss_train.tools.gpu_suite_report import TOLERANCE, propose_auto

# The steps the suite is for (the list); the train step runs once more for each
# GPU implementation of attention and grouped_matmul the registry holds.
STEPS = ["kernels", "gpu_tests", "attention", "decode_experts", "train_xla"]
STEPS += ["decode_bfloat16", "decode_mxfp4", "engine"]
# A figure each step must have measured (names as the step writes them).
HEADLINE = {
    "kernels": "attention_flash_ms",
    "gpu_tests": "tests",
    "attention": "flash_w32_ms",
    "decode_experts": "mxfp4_b1_us",
    "train_xla": "tokens_per_sec",
    "decode_bfloat16": "b2_decode_tok_s",
    "decode_mxfp4": "b2_decode_tok_s",
    "engine": "tok_s",
}


def _record(op, case, impl, ms, rel_err=0.0, runs=None):
    return dict(op=op, case=case, impl=impl, runs=runs or impl, ms=ms, rel_err=rel_err)


def test_a_gpu_kernel_is_proposed_only_when_faster_and_within_tolerance():
    records = [
        # attention: flash faster in both cases and within tolerance -> flash
        _record("attention", "w128", "xla", 10.0),
        _record("attention", "w128", "blockwise", 4.0, 0.003),  # not a GPU kernel
        _record("attention", "w128", "flash", 5.0, 0.004),
        _record("attention", "full", "xla", 20.0),
        _record("attention", "full", "flash", 12.0, 0.004),
        # moe_decode: faster, but wrong at one batch -> the reference stays
        _record("moe_decode", "b1", "xla", 1.0),
        _record("moe_decode", "b1", "pallas_gpu", 0.2, 0.001),
        _record("moe_decode", "b64", "xla", 2.0),
        _record("moe_decode", "b64", "pallas_gpu", 0.5, 4 * TOLERANCE),
        # grouped_matmul: within tolerance but slower in total -> the reference stays
        _record("grouped_matmul", "8192", "xla", 3.0),
        _record("grouped_matmul", "8192", "mosaic_gpu", 3.5, 0.001),
    ]
    got = propose_auto(records)
    assert {op: p["choice"] for op, p in got.items()} == {
        "attention": "flash",
        "moe_decode": "xla",
        "grouped_matmul": "xla",
    }
    assert "1.76x faster" in got["attention"]["why"]  # 30 ms against 17
    assert "error 0.0625 > 0.0156 at b64" in got["moe_decode"]["why"]
    assert "slower" in got["grouped_matmul"]["why"]
    assert got["grouped_matmul"]["today"] == "mosaic_gpu"  # the registry's GPU default


def test_a_kernel_that_declined_or_failed_is_not_proposed():
    """A kernel that left the reference in its place measured the reference; one that
    failed, or was not measured at every case, measured nothing to decide on."""
    declined = [
        _record("grouped_matmul", "a", "xla", 3.0),
        _record("grouped_matmul", "a", "mosaic_gpu", 2.0, runs="xla"),
    ]
    failed = [
        _record("attention", "a", "xla", 3.0),
        _record("attention", "b", "xla", 3.0),
        dict(op="attention", case="a", impl="flash", error="RESOURCE_EXHAUSTED"),
        _record("attention", "b", "flash", 1.0),
    ]
    missing = [
        _record("moe_decode", "a", "xla", 3.0),
        _record("moe_decode", "b", "xla", 3.0),
        _record("moe_decode", "a", "pallas_gpu", 1.0),
    ]
    got = propose_auto(declined + failed + missing)
    assert {op: p["choice"] for op, p in got.items()} == {
        "grouped_matmul": "xla",
        "attention": "xla",
        "moe_decode": "xla",
    }
    assert "declined the operands at a (xla ran)" in got["grouped_matmul"]["why"]
    assert "failed at a: RESOURCE_EXHAUSTED" in got["attention"]["why"]
    assert "not measured at b" in got["moe_decode"]["why"]


def test_only_the_wheels_of_missing_packages_are_installed(tmp_path):
    """A package this Python holds keeps its own version (the GPU image's matches its jax)."""
    for name in ("absl_py-0.0.1-py3-none-any.whl", "no_such_package_x-1.0-py3-none-any.whl"):
        (tmp_path / name).write_bytes(b"")
    install, kept = gpu_suite.wheels_to_install(str(tmp_path))
    assert [os.path.basename(p) for p in install] == ["no_such_package_x-1.0-py3-none-any.whl"]
    assert list(kept) == ["absl-py"] and kept["absl-py"] != "0.0.1"
    assert gpu_suite.wheels_to_install(str(tmp_path / "absent")) == ([], {})


@pytest.mark.full
def test_the_dry_run_runs_every_step_on_the_cpu(tmp_path):
    out = tmp_path / "out"
    r = subprocess.run(
        [sys.executable, "-m", "gpt_oss_train.tools.gpu_suite", "--dry_run"]
        + [f"--out_dir={out}", "--budget_minutes=12"],
        cwd=ROOT,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        timeout=850,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    results = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    names = [s["step"] for s in results]
    assert names == [s.name for s in gpu_suite.plan(True, "")]
    assert set(STEPS) <= set(names) and "train_attention_flash" in names
    for s in results:
        assert s["status"] == "ok", (s["step"], s.get("stderr_tail", "")[-2000:])
        figures = s["figures"]
        assert figures and all(math.isfinite(v) and v > 0 for v in figures.values()), s
        assert HEADLINE.get(s["step"], "tokens_per_sec") in figures, (s["step"], figures)
    by_step = {s["step"]: s for s in results}
    # the GPU tests are collected and skip on a CPU
    assert by_step["gpu_tests"]["records"][0]["skipped"] == by_step["gpu_tests"]["figures"]["tests"]
    # each GPU kernel, in interpret mode, within tolerance of the reference
    for k in by_step["kernels"]["records"]:
        assert k["rel_err"] <= TOLERANCE, k
    env = json.loads((out / "env.json").read_text())
    assert env["dry_run"] and env["platform"] == "cpu" and env["packages"]["jax"]
    summary = (out / "summary.md").read_text()
    assert all(f"| {name} | ok |" in summary for name in names), summary
    assert "| attention | " in summary.split("Proposed `auto`")[1]


def test_a_step_past_its_limit_is_killed_with_its_children_and_keeps_its_records():
    """What the step printed before its limit stays (a GPU run cut short keeps every
    measurement made); the step's whole process group ends, nothing left on the GPU."""
    child = (
        "import subprocess, time; p = subprocess.Popen(['sleep', '60']);"
        'print(\'{"pid": %d, "ms": 1.5}\' % p.pid, flush=True); time.sleep(60)'
    )
    step = gpu_suite.Step("sleepy", ("-c", child), 3, lambda r: {"ms": r[0]["ms"]})
    t0 = time.monotonic()
    got = gpu_suite.run_step(step, time.monotonic() + 60, dict(os.environ))
    assert time.monotonic() - t0 < 30
    assert got["status"] == "timeout" and got["figures"] == {"ms": 1.5}
    stat = f"/proc/{got['records'][0]['pid']}/stat"
    assert not os.path.exists(stat) or open(stat).read().split()[2] == "Z"  # killed
    skipped = gpu_suite.run_step(step, time.monotonic() + gpu_suite.MIN_STEP_S - 1, {})
    assert skipped["status"] == "skipped: budget" and skipped["records"] == []
