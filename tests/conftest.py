"""Every test runs on the CPU with 8 fake devices, so meshes of up to 8 can be tested, and
with the Hugging Face hub switched off: the suite never downloads anything."""

import atexit
import contextlib
import ctypes
import functools
import glob
import hashlib
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid

import pytest
from support import ROOT, references
from support import mxfp4_reference as mxfp4_ref

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
os.environ["HF_HUB_OFFLINE"] = "1"
# One persistent compilation cache for the test run, subprocesses included: many tests build
# the same tiny train step (several runs of one config, a CLI run and its resume).
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="gpt_oss_train_jax_cache.")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
os.environ["TRANSFORMERS_OFFLINE"] = "1"
# A crash in native code (a subprocess under test included) prints every thread's Python
# stack to stderr, which the tests show when a command fails.
os.environ.setdefault("PYTHONFAULTHANDLER", "1")
# A developer's serving key would make every test server ask for it.
os.environ.pop("GPT_OSS_TRAIN_API_KEY", None)


# Builders shared by several test modules: fixtures, so no test module imports another.
# Fixtures import the package (jax, the server stack) in their bodies: collecting the
# tests imports none of it.


def _cpu_kernel_reason(name: str) -> str | None:
    """None where kernels/cpu/<name>.py can run here (built now, or found built), else why
    not. Called from fixtures and the summary, never at collection: collecting the tests
    compiles nothing."""
    return importlib.import_module(f"gpt_oss_train.kernels.cpu.{name}").unavailable()


@pytest.fixture(scope="session")
def cpu_kernel():
    """require(name) -> the module gpt_oss_train.kernels.cpu.<name>, built; the test is
    skipped with the reason ("no avx512_bf16", "no C++ compiler", ...) where it cannot run."""

    def require(name: str):
        reason = _cpu_kernel_reason(name)
        if reason:
            pytest.skip(f"CPU kernel {name}: {reason}")
        return importlib.import_module(f"gpt_oss_train.kernels.cpu.{name}")

    return require


# ----------------------------------------------------------------------------- tiers
#
# The default tier (`python -m pytest`) checks the numbers (against transformers, PEFT,
# float64), the model, the MoE, the loss, every kernel at small shapes, config errors, one
# train + resume and one server round trip, in minutes. Tests marked `full` (whole modules:
# multi-process jobs, the GCS emulator, server load, the trained Harmony model, LoRA
# training, AOT; single tests that take tens of seconds) run with `--full` too. The other
# markers (pyproject.toml) say what a test needs: `gpu`, `tpu` (libtpu), `multiprocess`.


def pytest_addoption(parser):
    parser.addoption(
        "--full", action="store_true", help="also run the full tier (tests marked `full`)"
    )


# Fixtures only the full tier may use: a GCS emulator process, a model trained for minutes.
# A test that uses one (directly or through another fixture) must be marked `full` itself.
FULL_TIER_FIXTURES = ("gcs_bucket", "harmony_checkpoint")


def _marks_broken(items) -> list[str]:
    """What breaks the marking rules: a heavy fixture in a test not marked `full`; a `gpu`
    test marked `full` (`pytest -m gpu` without --full would deselect it)."""
    broken = []
    for item in items:
        full = item.get_closest_marker("full") is not None
        heavy = [f for f in FULL_TIER_FIXTURES if f in getattr(item, "fixturenames", ())]
        if heavy and not full:
            broken.append(f"{item.nodeid} uses {', '.join(heavy)} but is not marked `full`")
        if full and item.get_closest_marker("gpu") is not None:
            broken.append(f"{item.nodeid} is marked both `gpu` and `full`")
    return broken


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    """A module whose tests break the marking rules fails to collect, in every tier and in
    every xdist worker, naming each test and what to mark."""
    report = yield
    if report.passed and isinstance(collector, (pytest.Module, pytest.Class)):
        broken = _marks_broken(x for x in report.result if isinstance(x, pytest.Item))
        if broken:
            report.outcome = "failed"
            report.longrepr = (
                "tests marked wrongly (mark each @pytest.mark.full, or the module with "
                "`pytestmark`; a GPU test stays out of the full tier):\n  " + "\n  ".join(broken)
            )
    return report


def pytest_collection_modifyitems(config, items):
    if config.getoption("--full"):
        return
    full = [item for item in items if item.get_closest_marker("full") is not None]
    if full:
        config.hook.pytest_deselected(items=full)
        items[:] = [item for item in items if item.get_closest_marker("full") is None]
    config._gpt_oss_train_full_tier = len(full)
    if hasattr(config, "workeroutput"):  # an xdist worker: tell the controller
        config.workeroutput["full_tier"] = len(full)


# ----------------------------------------------------------------------------- orphans
#
# A process a test starts (the GCS emulator, a server, a trainer) outlives a worker that
# crashes, and would run on after the test run, holding whatever waits for the run's
# processes to end. The controlling pytest process adopts such orphans (a Linux child
# subreaper) and stops them when the run ends.

_PR_SET_CHILD_SUBREAPER = 36


def _is_controller(config) -> bool:
    return not hasattr(config, "workerinput")


def pytest_configure(config):
    if _is_controller(config) and sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _children(pid: int) -> list[int]:
    """The pids of `pid`'s living children (Linux /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after the command's name
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":  # ppid; a zombie needs no stop
            found.append(int(entry))
    return found


def pytest_unconfigure(config):
    """Stops every process still a child of the controller once the run is over: the xdist
    workers have exited by now, so what is left is an orphan."""
    if not (_is_controller(config) and sys.platform.startswith("linux")):
        return
    left = _children(os.getpid())
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    for pid in left:  # reap them
        while time.monotonic() < deadline:
            try:
                if os.waitpid(pid, os.WNOHANG)[0]:
                    break
            except ChildProcessError:  # reaped already
                break
            time.sleep(0.05)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """xdist's controller: each worker collected every test, so each tells the same count."""
    count = getattr(node, "workeroutput", {}).get("full_tier")
    if count is not None:
        node.config._gpt_oss_train_full_tier = count


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Which tier ran; which CPU kernels this machine built (and so the tests ran) and
    which it could not, with why. Tests that needed a missing kernel are in the skip list
    above with the reason."""
    from gpt_oss_train.kernels.cpu import SOURCES

    left = getattr(config, "_gpt_oss_train_full_tier", 0)
    terminalreporter.write_sep("-", "test tier")
    if config.getoption("--full"):
        terminalreporter.write_line("full tier (--full): every test")
    else:
        terminalreporter.write_line(
            f"default tier: {left} tests of the full tier not run "
            "(python -m pytest --full runs them)"
        )
    if config.option.collectonly:
        return  # collecting builds nothing

    built, missing = [], []
    for name in SOURCES:
        reason = _cpu_kernel_reason(name)
        (missing.append(f"{name} ({reason})") if reason else built.append(name))
    terminalreporter.write_sep("-", "CPU kernels")
    terminalreporter.write_line(f"built and tested: {', '.join(built) or 'none'}")
    terminalreporter.write_line(
        f"not available here (XLA reference tested instead): {', '.join(missing) or 'none'}"
    )


@pytest.fixture(scope="session")
def hf_tiny_config():
    """factory(**overrides) -> a tiny transformers GptOssConfig (4 layers of width 64, 4
    experts top-2, window 8, a 300-id vocabulary, eager attention)."""
    transformers = pytest.importorskip("transformers")

    def make(**kw):
        args = dict(
            vocab_size=300,
            hidden_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            intermediate_size=64,
            sliding_window=8,
            max_position_embeddings=4096,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=150000.0,
                factor=32.0,
                original_max_position_embeddings=4096,
                beta_fast=32.0,
                beta_slow=1.0,
                truncate=False,
            ),
            attn_implementation="eager",
        )
        args.update(kw)
        return transformers.GptOssConfig(**args)

    return make


@pytest.fixture(scope="session")
def random_hf_model(hf_tiny_config):
    """factory(seed=0, **config_overrides) -> a transformers GptOssForCausalLM with every
    weight random, biases, sinks and norm scales included (so none is trivially 0 or 1)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

    def make(seed=0, **kw):
        torch.manual_seed(seed)
        model = transformers.GptOssForCausalLM(hf_tiny_config(**kw)).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        return model

    return make


@pytest.fixture(scope="session")
def read_hf_tree():
    """read(path) -> (architecture, nested dict of float32 numpy arrays) of a whole (small)
    Hugging Face checkpoint, through the project's reader (support/hf_tree.py)."""
    from support import hf_tree

    return hf_tree.read_hf_tree


@pytest.fixture(scope="session")
def mxfp4_reference():
    """(fp4(code) -> float, dequantize(blocks, scales) -> float64 [..., in, out]): MXFP4
    decoded from the OCP spec's bit fields by loops, independent of arrays/mxfp4.py
    (support/mxfp4_reference.py)."""
    return mxfp4_ref.fp4, mxfp4_ref.dequantize


NARROW_MODEL = dict(hidden_size=16, num_heads=2, num_kv_heads=1, head_dim=8, intermediate_size=16)


@pytest.fixture(scope="session")
def small_config():
    """factory(**train_overrides) -> configs/cpu_tiny.py narrowed to width 16 (the real
    201,088-id vocabulary, so real text trains), 4 steps of 8 x 16 tokens, a checkpoint
    every 2 steps (keep 3), 64 stdlib documents: a step takes well under a second."""
    from gpt_oss_train import config as config_lib

    def make(**train):
        c = config_lib.from_file(os.path.join(ROOT, "configs", "cpu_tiny.py"))
        c.model.update(NARROW_MODEL)
        c.train.update(dict(steps=4, seq_len=16, log_every=1, eval_every=0), **train)
        c.checkpoint.update(every=2, keep=3)
        c.data.max_docs = 64
        return c

    return make


def _sources_hash() -> str:
    """The package's Python sources and configs: a cached run is reused only while none of
    the code that made it has changed."""
    h = hashlib.sha256()
    paths = glob.glob(os.path.join(ROOT, "gpt_oss_train", "**", "*.py"), recursive=True)
    for path in sorted(paths + glob.glob(os.path.join(ROOT, "configs", "*.py"))):
        h.update(os.path.relpath(path, ROOT).encode() + b"\0")
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


@pytest.fixture(scope="session")
def cpu_tiny_run():
    """An Orbax workdir of configs/cpu_tiny.py trained 3 steps (8 x 32 tokens), trained once
    per version of the code and kept under the temp dir, keyed by the sources' hash."""

    from gpt_oss_train import config as config_lib
    from gpt_oss_train import train

    root = os.path.join(tempfile.gettempdir(), "gpt_oss_train_test_cache")
    folder = os.path.join(root, f"cpu_tiny_run_{_sources_hash()}")
    if not os.path.isdir(os.path.join(folder, "checkpoints")):
        config = config_lib.from_file(os.path.join(ROOT, "configs", "cpu_tiny.py"))
        config.train.update(steps=3, global_batch_size=8, seq_len=32, eval_every=0, log_every=1)
        config.checkpoint.update(every=0)
        os.makedirs(root, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix="cpu_tiny_run.", dir=root)
        assert train.train(config, tmp)["step"] == 3
        try:
            os.replace(tmp, folder)
        except OSError:  # another xdist worker finished the same run first
            shutil.rmtree(tmp)
    return folder


@pytest.fixture(scope="session")
def train_cli():
    """factory(workdir, *overrides) -> (command, env): the user's train command with
    small_config's model and data settings, on one CPU device."""

    def make(workdir, *overrides):
        narrow = [f"--config.model.{k}={v}" for k, v in NARROW_MODEL.items()]
        cmd = [
            sys.executable,
            "-m",
            "gpt_oss_train.train",
            "--config=configs/cpu_tiny.py",
            f"--workdir={workdir}",
            "--config.train.seq_len=16",
            "--config.train.log_every=1",
            "--config.train.eval_every=0",
            "--config.data.max_docs=64",
            *narrow,
            *overrides,
        ]
        return cmd, dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")

    return make


@pytest.fixture(scope="session")
def pretokenized_corpus(tmp_path_factory):
    """A folder written by gpt_oss_train.tools.pretokenize from 80 files of Python's standard
    library (a few hundred thousand tokens), in-process."""

    from gpt_oss_train.tools import pretokenize
    from gpt_oss_train.training import sources

    corpus = tmp_path_factory.mktemp("corpus")
    for i, path in enumerate(sources._stdlib_files()[:80]):
        shutil.copy(path, corpus / f"{i:03d}.py")
    out = tmp_path_factory.mktemp("pretokenized") / "stdlib80"
    pretokenize.pretokenize(str(corpus), str(out), shard_size=30)
    return str(out)


GCS_TEST_BUCKET = "gpt-oss-train-test"


@pytest.fixture(scope="session")
def gcs_bucket(tmp_path_factory):
    """gs://<bucket> on a local GCS emulator (tests/support/gcs_emulator.py), started once.
    Its address is put where each client looks: STORAGE_EMULATOR_HOST (gcsfs, which
    etils.epath uses, and google-cloud-storage; both then go anonymous),
    TENSORSTORE_GCS_HTTP_URL (TensorStore, Orbax's array writer) and
    CLOUD_STORAGE_EMULATOR_ENDPOINT (google-cloud-cpp, which ArrayRecord reads gs:// with).
    Child processes inherit them."""
    script = os.path.join(ROOT, "tests", "support", "gcs_emulator.py")
    log = tmp_path_factory.mktemp("gcs_emulator") / "stderr.log"
    with open(log, "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, script, GCS_TEST_BUCKET],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    try:
        line = proc.stdout.readline()
        if not line:
            pytest.fail(f"the GCS emulator did not start: {log.read_text()[-2000:]}")
        url = f"http://127.0.0.1:{json.loads(line)['port']}"
        with pytest.MonkeyPatch.context() as env:
            env.setenv("STORAGE_EMULATOR_HOST", url)
            env.setenv("TENSORSTORE_GCS_HTTP_URL", url)
            env.setenv("CLOUD_STORAGE_EMULATOR_ENDPOINT", url)  # google-cloud-cpp: ArrayRecord
            # gcsfs's default file system asks the Storage Control API (not emulated) for
            # each bucket's layout; read when gcsfs is first imported.
            env.setenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
            yield f"gs://{GCS_TEST_BUCKET}"
    finally:
        proc.terminate()
        proc.wait()


@pytest.fixture
def gcs_dir(gcs_bucket):
    """A fresh, empty gs:// folder for one test."""
    return f"{gcs_bucket}/{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="session")
def expert_ffn_reference():
    """ffn(x [T, D], weights [T, k], idx [T, k], w: dict of dense expert arrays) -> the
    MoE output in float64 (limit 7, alpha 1.702 as gpt-oss; support/references.py)."""
    return references.expert_ffn


@pytest.fixture(scope="session")
def run_tool_json():
    """run(name, *args) -> the JSON records `python -m gpt_oss_train.tools.<name>` prints,
    run on the CPU as a user would (a subprocess); fails the test on a non-zero exit."""
    from support import runners

    return runners.run_tool_json


@pytest.fixture(scope="session")
def harmony_checkpoint():
    """A float32 HF folder of a tiny gpt-oss that has memorised the Harmony conversations in
    tests/support/harmony_model.py (trained once, ~3 min on 2 cores, then cached under the
    temp dir)."""
    from support import harmony_model

    return harmony_model.cached()


@pytest.fixture(scope="session")
def serve_harmony(harmony_checkpoint):
    """serve(max_slots=, max_context=, model_name=, **create_app options) -> a context
    manager serving the harmony_checkpoint model; `.url` is its address."""
    from support import runners

    return functools.partial(runners.served, harmony_checkpoint)


@pytest.fixture(scope="session")
def harmony_server(serve_harmony):
    """The harmony_checkpoint model served as "tiny-harmony", 4 slots of 512 positions."""
    with serve_harmony(max_slots=4, max_context=512) as server:
        yield server
