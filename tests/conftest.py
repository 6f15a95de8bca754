"""Every test runs on the CPU with 8 fake devices, so meshes of up to 8 can be tested, and
with the Hugging Face hub switched off: the suite never downloads anything."""

import json
import os
import subprocess
import sys
import uuid

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

GCS_TEST_BUCKET = "gpt-oss-train-test"


@pytest.fixture(scope="session")
def gcs_bucket(tmp_path_factory):
    """gs://<bucket> on a local GCS emulator (tests/gcs_emulator.py), started once per session.
    Its address is put where each client looks: STORAGE_EMULATOR_HOST (gcsfs, which
    etils.epath uses, and google-cloud-storage; both then go anonymous) and
    TENSORSTORE_GCS_HTTP_URL (TensorStore, Orbax's array writer). Child processes inherit it."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gcs_emulator.py")
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
