"""Everything the GPU defaults are decided from, measured in one run on a GPU machine: each
step in a process of its own under its own time limit, written as it finishes, so a run
cut short keeps every step it finished.

  # here, once: the wheels the GPU machine's image lacks, into .gpu_wheels/ (git-ignored)
  python -m gpt_oss_train.tools.gpu_suite --download_wheels

  # here, before any GPU time: every step at tiny shapes on the CPU, in a few minutes
  JAX_PLATFORMS=cpu python -m gpt_oss_train.tools.gpu_suite --dry_run --out_dir=/tmp/gpu_suite

  # on the GPU machine, from the repository root, .gpu_wheels/ carried along, OUT an
  # empty folder (the one command, under 10 minutes; docs/PERFORMANCE.md "The GPU suite"):
  PYTHONUNBUFFERED=1 python3 -m gpt_oss_train.tools.gpu_suite --out_dir=$OUT 2>&1 | tee $OUT/log.txt

The run first installs the carried wheels whose packages this Python lacks (into a
temporary folder the steps find on PYTHONPATH). Then the steps, in order; one that the
time left (--budget_minutes, counted from the start) cannot hold is "skipped: budget":

  kernels          every GPU implementation of attention, grouped_matmul and moe_decode
                   against the XLA reference: error and time (gpu_suite_steps; first, as
                   the proposed `auto` choices come from it)
  gpu_tests        pytest -m gpu, over the test files that hold GPU tests
  attention        tools.bench_attention: one gpt-oss-20b layer, fwd + bwd, by back-end
  decode_experts   tools.bench_moe --mode=decode_kernels: the decode experts, bf16 / MXFP4
  train_*          tools.bench_model --mode=train: a gpt-oss-20b-shaped step of 4 layers,
                   1 x 4096 tokens (bfloat16 parameters, so that it fits an 80 GB H100),
                   all-XLA, then each other GPU implementation of attention and
                   grouped_matmul alone: MFU
  decode_*         gpt-oss-20b on random weights, bfloat16 or MXFP4 experts, batch 1, 8,
                   64 (gpu_suite_steps)
  engine           tools.bench_engine: the serving engine's tokens/s, 16 concurrent requests

--out_dir gets env.json (device, driver, versions, the wheels installed), results.jsonl
(a line per step: status ok / failed / timeout / skipped, seconds, the command, its
figures, its records, stderr's tail when it did not end well) and summary.md (the table,
the kernels against the reference and the proposed `auto` per operation; rewritten after
every step): with the log, four files, for machines that hand back only a few.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import fnmatch
import glob
import importlib.metadata
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from typing import Callable

from absl import app, flags

from gpt_oss_train import errors
from gpt_oss_train.kernels import registry
from gpt_oss_train.tools import gpu_suite_report as report

_OUT = flags.DEFINE_string("out_dir", None, "Folder for env.json, results.jsonl, summary.md.")
_BUDGET = flags.DEFINE_float("budget_minutes", 8.0, "The whole run's time, install included.")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Every step at tiny shapes (a CPU check).")
_ONLY = flags.DEFINE_list("only", [], "Run only these steps (names or patterns: train_*).")
_WHEELS = flags.DEFINE_string("wheels", ".gpu_wheels", "The folder of carried wheels.")
_DOWNLOAD = flags.DEFINE_bool(
    "download_wheels", False, "Fill --wheels with the wheels the GPU image lacks, then exit."
)

# What the steps import that the GPU machine's image (Python 3.12, CUDA jax, flax, optax,
# orbax, pytest, ...) does not hold: the project's imports under these steps, less the
# image's package list. Downloaded at the versions installed here (those tested).
WHEELS = (
    "annotated-types",
    "array-record",
    "google-api-core",
    "google-auth",
    "google-cloud-core",
    "google-cloud-storage",
    "google-cloud-storage-control",
    "google-resumable-media",
    "googleapis-common-protos",
    "grain",
    "grpc-google-iam-v1",
    "llguidance",
    "ml-collections",
    "openai-harmony",
    "portpicker",
    "pydantic",
    "pydantic-core",
    "sniffio",
    "typing-inspection",
)
# pip matches manylinux tags exactly: the ones these wheels are built for.
_GLIBCS = ("2_17", "2_24", "2_27", "2_28", "2_31", "2_34", "2_35")
KERNEL_OPS = ("attention", "grouped_matmul", "moe_decode")  # the ops with GPU kernels
MIN_STEP_S = 20  # a step is started only with this much of the budget left


# ----------------------------------------------------------------------------- wheels


def download_wheels(folder: str) -> None:
    """The WHEELS for the GPU machine (CPython 3.12, x86-64 manylinux), one version each."""
    os.makedirs(folder, exist_ok=True)
    for old in glob.glob(os.path.join(folder, "*.whl")):
        os.remove(old)  # two versions of one package stop the whole install
    try:
        pins = [f"{name}=={importlib.metadata.version(name)}" for name in WHEELS]
    except importlib.metadata.PackageNotFoundError as e:
        raise errors.UserError(f"{e.args[0]} is not installed here: pip install -e '.[test]'")
    platforms = [f"--platform=manylinux_{g}_x86_64" for g in _GLIBCS]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
    cmd += ["--python-version=3.12", "--implementation=cp", *platforms, "-d", folder, *pins]
    if subprocess.run(cmd).returncode:
        raise errors.UserError("pip download failed (its message is above): run it again")
    size = sum(os.path.getsize(f) for f in glob.glob(os.path.join(folder, "*.whl")))
    print(f"{folder}: {len(pins)} wheels, {size / 2**20:.1f} MiB", flush=True)


def _wheel_dist(path: str) -> str:
    """The normalized distribution name of a wheel file."""
    return re.sub(r"[-_.]+", "-", os.path.basename(path).split("-")[0]).lower()


def wheels_to_install(folder: str) -> tuple[list[str], dict[str, str]]:
    """(the wheels whose package this Python lacks, {package: version kept} for those it
    holds: the image's own version matches its jax, so it stays). No folder: none."""
    install, kept = [], {}
    for path in sorted(glob.glob(os.path.join(folder, "*.whl"))):
        dist = _wheel_dist(path)
        try:
            kept[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            install.append(path)
    return install, kept


def install_wheels(folder: str) -> dict:
    """Installs what this Python lacks into a temporary folder that the steps' PYTHONPATH
    leads with (this process imports none of it); what was done, for env.json."""
    install, kept = wheels_to_install(folder)
    done = dict(wheels_installed=[os.path.basename(p) for p in install], wheels_kept=kept)
    if install:
        site = tempfile.mkdtemp(prefix="gpu_suite_site.")
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
        subprocess.run([*cmd, "--no-compile", "--target", site, *install], check=True)
        path = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = site + (os.pathsep + path if path else "")
    return done


# ----------------------------------------------------------------------------- the steps


def json_lines(stdout: str) -> list[dict]:
    """The JSON records a child printed, one a line; a line cut short by a kill is left out."""
    records = []
    for line in stdout.splitlines():
        if line.startswith("{"):
            with contextlib.suppress(json.JSONDecodeError):
                records.append(json.loads(line))
    return records


@dataclasses.dataclass(frozen=True)
class Step:
    name: str
    argv: tuple[str, ...]  # after `python`
    limit_s: float
    figures: Callable[[list[dict]], dict]  # the child's records -> {name: number}
    env: tuple[tuple[str, str], ...] = ()
    records: Callable[[str], list[dict]] = json_lines  # the child's stdout -> records


def _junit_counts(path: str) -> Callable[[str], list[dict]]:
    def read(_stdout: str) -> list[dict]:
        if not os.path.exists(path):
            return []
        s = ElementTree.parse(path).getroot()
        s = s if s.tag == "testsuite" else s.find("testsuite")
        counts = {k: int(s.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
        return [dict(counts, passed=passed)]

    return read


def _gpu_test_files() -> list[str]:
    """The test files that hold GPU tests (collecting the whole suite would import every
    test's dependencies, which the GPU machine does not all have)."""
    return sorted(f for f in glob.glob("tests/**/test_*.py", recursive=True) if _has_gpu_tests(f))


def _has_gpu_tests(path: str) -> bool:
    with open(path) as f:
        return "pytest.mark.gpu" in f.read()


# The shapes: gpt-oss-20b's on a GPU; configs/cpu_tiny.py's and the like for a dry run.
# Not formatted here and in plan(): a flag list a line reads as the command it makes
# (ruff would put each flag on a line of its own).
SHAPES = {
    "gpu": dict(
        kernels=dict(
            attention=dict(batch=1, seq_len=4096, heads=64, kv_heads=8, head_dim=64,
                           windows=[128, None], block=512),
            grouped_matmul=dict(rows=8192, hidden=2880, out=2880, experts=32),
            moe_decode=dict(forms=["bfloat16", "mxfp4"], experts=32, hidden=2880,
                            expert_hidden=2880, k=4, tokens=[1, 8, 64]),
            calls=10,
        ),
        attention=["--seq_lens=4096", "--windows=128,0", "--steps=5"],
        decode_experts=["--tokens=1,8,64", "--steps=10"],
        train=["--config=configs/gpu_h100.py", "--config.model.num_layers=4",
               "--config.param_dtype=bfloat16", "--config.train.global_batch_size=1",
               "--config.train.seq_len=4096", "--steps=3"],
        decode=dict(config="configs/gpu_h100.py", batch_sizes=[1, 8, 64], prompt_len=128,
                    new_tokens=32, repeats=3),
        engine=["--config=configs/gpu_h100.py", "--config.param_dtype=bfloat16",
                "--max_context=1024", "--prompt_max=256", "--max_tokens=64"],
    ),
    "tiny": dict(
        kernels=dict(
            attention=dict(batch=1, seq_len=64, heads=4, kv_heads=2, head_dim=16,
                           windows=[32, None], block=32),
            grouped_matmul=dict(rows=128, hidden=64, out=64, experts=4),
            moe_decode=dict(forms=["bfloat16", "mxfp4"], experts=4, hidden=64,
                            expert_hidden=64, k=2, tokens=[1, 4]),
            calls=1,
        ),
        attention=["--seq_lens=64", "--windows=32,0", "--heads=4", "--kv_heads=2",
                   "--head_dim=16", "--block=32", "--steps=1", "--interpret"],
        decode_experts=["--hidden=64", "--expert_hidden=64", "--experts=4", "--k=2",
                        "--tokens=1,4", "--routings=2", "--steps=1", "--interpret"],
        train=["--config=configs/cpu_tiny.py", "--config.train.global_batch_size=2",
               "--config.train.seq_len=32", "--steps=1"],
        decode=dict(config="configs/cpu_tiny.py", batch_sizes=[1, 2], prompt_len=8,
                    new_tokens=4, repeats=1),
        engine=["--config=configs/cpu_tiny.py", "--max_context=64", "--prompt_min=8",
                "--prompt_max=24", "--max_tokens=8", "--prefill_chunk=32"],
    ),
}  # fmt: skip


def gpu_runnable(op: str) -> list[str]:
    """The op's implementations that run on a GPU, the XLA reference first."""
    return [i.name for i in registry.OPS[op].impls if "gpu" in i.platforms]


def _train_variants() -> list[tuple[str, dict]]:
    """All-XLA, then each other GPU implementation of attention and grouped_matmul alone."""
    ops = ("attention", "grouped_matmul")
    reference = {op: registry.REFERENCE for op in ops}
    variants = [("train_xla", reference)]
    for op in ops:
        variants += [(f"train_{op}_{i}", reference | {op: i}) for i in gpu_runnable(op)[1:]]
    return variants


def plan(tiny: bool, scratch: str) -> list[Step]:
    """The steps in order, at the GPU's shapes or the dry run's (`tiny`); `scratch`: a
    folder for pytest's report."""
    s = SHAPES["tiny" if tiny else "gpu"]
    tool = lambda name, *args: ("-m", f"gpt_oss_train.tools.{name}", *args)
    own = lambda name, *args: tool("gpu_suite_steps", name, *args)
    kernels = dict(s["kernels"], interpret=tiny, impls={op: gpu_runnable(op) for op in KERNEL_OPS})
    # a dry run takes the GPU kernels in Pallas interpret mode
    traced = lambda name, *args: own("interpret", f"gpt_oss_train.tools.{name}", *args)
    junit = os.path.join(scratch, "gpu_tests.xml")
    pytest = ("-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", f"--junitxml={junit}")
    steps = [
        Step("kernels", own("kernels", json.dumps(kernels)), 150, report.kernels_figures),
        Step("gpu_tests", (*pytest, *_gpu_test_files()), 150, lambda r: r[0] if r else {},
             env=() if tiny else (("JAX_PLATFORMS", "cuda"),), records=_junit_counts(junit)),
        Step("attention", tool("bench_attention", "--impls=xla,blockwise,flash", *s["attention"]),
             90, report.attention_figures),
        Step("decode_experts", tool("bench_moe", "--mode=decode_kernels",
                                    "--impls=ragged,tiled,mxfp4", *s["decode_experts"]),
             90, report.decode_experts_figures),
    ]  # fmt: skip
    for name, choice in _train_variants():
        chosen = [f"--config.kernels.{op}={impl}" for op, impl in choice.items()]
        argv = (traced if tiny else tool)("bench_model", "--mode=train", *s["train"], *chosen)
        steps.append(Step(name, argv, 90, report.train_figures))
    bf16 = {"dtype": "bfloat16", "param_dtype": "bfloat16"}
    for weights in ("bfloat16", "mxfp4"):
        spec = dict(s["decode"], overrides=bf16, weights=weights)
        argv = own("decode_model", json.dumps(spec))
        steps.append(Step(f"decode_{weights}", argv, 150, report.decode_figures))
    engine = tool("bench_engine", *s["engine"], "--concurrency=16", "--max_slots=16",
                  "--long_prompt=0", "--prefix_tokens=0", "--skip_static")  # fmt: skip
    return steps + [Step("engine", engine, 150, report.engine_figures)]


def selected(name: str, only: list[str]) -> bool:
    return not only or any(fnmatch.fnmatch(name, pattern) for pattern in only)


# ----------------------------------------------------------------------------- running


def child_env(tiny: bool) -> dict:
    env = dict(os.environ)
    if tiny:
        env["JAX_PLATFORMS"] = "cpu"
        # one CPU device: the tiny batches are not split over a test run's eight
        flag = r"--xla_force_host_platform_device_count=\d+"
        env["XLA_FLAGS"] = re.sub(flag, "", env.get("XLA_FLAGS", "")).strip()
    else:
        # gpt-oss-20b's bfloat16 weights alone are 42 GB, over JAX's default 75% of an H100
        env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
    return env


def run_child(argv, timeout: float, env: dict) -> tuple[int | None, str, str]:
    """(exit status, or None when it ran past `timeout`; stdout; stderr). The child leads
    a process group of its own, which is killed whole when it runs over or this process is
    stopped: nothing is left holding the GPU for the next step."""
    proc = subprocess.Popen(
        [sys.executable, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        process_group=0,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, err = proc.communicate()
        return None, out, err
    finally:
        if proc.poll() is None:  # this process is being stopped (SIGTERM)
            _kill_group(proc)


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
        os.killpg(proc.pid, signal.SIGKILL)


def positive(figures: dict) -> dict:
    """The figures that are measurements: finite numbers above zero (a step leaves out
    what it did not measure, e.g. MFU on a CPU)."""
    ok = lambda v: isinstance(v, (int, float)) and math.isfinite(v) and v > 0
    return {k: v for k, v in figures.items() if ok(v)}


def run_step(step: Step, deadline: float, env: dict) -> dict:
    result = dict(step=step.name, command=shlex.join(["python", *step.argv]))
    left = deadline - time.monotonic()
    if left < MIN_STEP_S:
        return dict(result, status="skipped: budget", figures={}, records=[])
    timeout = min(step.limit_s, left)
    t0 = time.monotonic()
    rc, out, err = run_child(step.argv, timeout, env | dict(step.env))
    records = step.records(out)
    try:
        figures = positive(step.figures(records))
    except (KeyError, ValueError, TypeError):  # records cut short: the status says why
        figures = {}
    status = "timeout" if rc is None else "ok" if rc == 0 and figures else "failed"
    result |= dict(status=status, seconds=round(time.monotonic() - t0, 1), limit_s=round(timeout))
    result |= dict(figures=figures, records=records)
    if status != "ok":
        result |= dict(rc=rc, stderr_tail=err[-4000:])
    return result


def _command_output(cmd: list[str]) -> str | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def environment(tiny: bool, budget_s: float, installed: dict, env: dict) -> dict:
    """What the numbers were measured on; the device side from a child, as the steps see
    it (this process never starts a JAX backend, which would hold GPU memory)."""
    rc, out, err = run_child(("-m", "gpt_oss_train.tools.gpu_suite_steps", "env"), 120, env)
    found = json_lines(out) if rc == 0 else []
    probe = found[0] if found else {"probe_error": err[-2000:]}
    smi = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
    return dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        commit=_command_output(["git", "rev-parse", "--short", "HEAD"]) or None,
        nvidia_smi=_command_output(smi) or None,
        dry_run=tiny,
        budget_minutes=budget_s / 60,
        **installed,
        **probe,
    )


def run_suite(out_dir: str, tiny: bool, budget_s: float, only: list[str], wheels: str):
    """Installs, records the environment, runs the steps `only` selects; the results."""
    deadline = time.monotonic() + budget_s
    os.makedirs(out_dir, exist_ok=True)
    installed = install_wheels(wheels)
    print(f"gpu_suite: wheels installed {installed['wheels_installed']}", flush=True)
    env = child_env(tiny)
    info = environment(tiny, budget_s, installed, env)
    _write(os.path.join(out_dir, "env.json"), json.dumps(info, indent=1) + "\n")
    results_path = os.path.join(out_dir, "results.jsonl")
    _write(results_path, "")
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        for step in (s for s in plan(tiny, scratch) if selected(s.name, only)):
            print(f"gpu_suite: {step.name} ...", flush=True)
            results.append(run_step(step, deadline, env))
            with open(results_path, "a") as f:  # each step kept the moment it ends
                f.write(json.dumps(results[-1]) + "\n")
            _write(os.path.join(out_dir, "summary.md"), report.summary(info, results))
            r = results[-1]
            took = f" in {r['seconds']} s" if "seconds" in r else ""
            print(f"gpu_suite: {step.name} {r['status']}{took}", flush=True)
    print(report.summary(info, results), flush=True)
    return results


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _check_flags() -> None:
    if not _OUT.value:
        raise errors.UserError("--out_dir is required: the folder the results are written to")
    if _BUDGET.value <= 0:
        raise errors.UserError(f"--budget_minutes={_BUDGET.value}: give a positive time")
    if not (os.path.isdir("tests") and os.path.isdir("configs")):
        raise errors.UserError("run it from the repository root: it reads tests/ and configs/")
    names = [s.name for s in plan(_DRY_RUN.value, "")]
    for pattern in _ONLY.value:
        if not any(fnmatch.fnmatch(n, pattern) for n in names):
            raise errors.UserError(f"--only={pattern}: no such step; the steps are {names}")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    try:
        if _DOWNLOAD.value:
            return download_wheels(_WHEELS.value)
        _check_flags()
    except errors.UserError as e:
        sys.exit(errors.report(e))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # runs run_child's cleanup
    run_suite(_OUT.value, _DRY_RUN.value, _BUDGET.value * 60, _ONLY.value, _WHEELS.value)


if __name__ == "__main__":
    app.run(main, flags_parser=errors.parse_flags)
