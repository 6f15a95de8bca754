"""Run files on a local disk and in a bucket through one API (gpt_oss_train.io.storage), and
the workdir lock (gpt_oss_train.io.workdir_lock), against a local GCS emulator (the
`gcs_bucket` fixture in conftest.py).

Each storage behaviour is checked on both kinds of root with the same test; bytes read back
are compared with bytes built here in Python. Orbax checkpoints to gs:// are in
test_storage_checkpoint.py.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from google.cloud import storage as gcs
from support import ROOT
from tensorboard.backend.event_processing import event_accumulator
from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.summary.writer.record_writer import RecordWriter

from gpt_oss_train.io import storage
from gpt_oss_train.io import workdir_lock as wl


@pytest.fixture(params=["local", pytest.param("gcs", marks=pytest.mark.full)])
def root(request, tmp_path):
    """An empty run folder: a local path, or a gs:// folder on the emulator."""
    if request.param == "local":
        return str(tmp_path / "run")
    return request.getfixturevalue("gcs_dir")


# ----------------------------------------------------------------------------- paths


def test_normalize_keeps_urls_and_makes_local_paths_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # The bug this replaces: os.path.abspath makes a URL a local folder.
    assert os.path.abspath("gs://b/run") == os.path.join(str(tmp_path), "gs:/b/run")
    assert storage.normalize("gs://b/run") == "gs://b/run"
    assert storage.normalize("gs://b/run/") == "gs://b/run"
    assert storage.normalize("s3://b/a/b") == "s3://b/a/b"
    assert storage.normalize("runs/x") == os.path.join(str(tmp_path), "runs", "x")
    assert storage.normalize("runs/x/../y") == os.path.join(str(tmp_path), "runs", "y")
    assert storage.normalize("~/x") == os.path.join(os.path.expanduser("~"), "x")
    assert storage.normalize("file:///tmp/a") == "/tmp/a"


def test_is_remote_and_join():
    assert storage.is_remote("gs://b/run") and storage.is_remote("hf://org/model")
    assert not storage.is_remote("/tmp/run")
    assert not storage.is_remote("runs/gs:/b")
    assert not storage.is_remote("file:///tmp/run")
    assert storage.join("gs://b/run/", "checkpoints", "12") == "gs://b/run/checkpoints/12"
    assert storage.join("/w", "checkpoints") == "/w/checkpoints"
    assert storage.dirname("gs://b/run/metrics.jsonl") == "gs://b/run"
    assert storage.basename("gs://b/run/metrics.jsonl") == "metrics.jsonl"


# ----------------------------------------------------------------------------- files


def test_files_listing_and_removal(root):
    storage.makedirs(root)
    storage.write_atomic(storage.join(root, "a.json"), '{"x": 1}')
    storage.write_atomic(storage.join(root, "sub", "b.bin"), bytes(range(256)))
    with storage.open(storage.join(root, "sub", "c.txt"), "w") as f:
        f.write("héllo\n")
    assert storage.exists(root) and storage.isdir(storage.join(root, "sub"))
    assert storage.listdir(root) == ["a.json", "sub"]
    assert storage.listdir(storage.join(root, "sub")) == ["b.bin", "c.txt"]
    assert storage.glob(root, "sub/*.txt") == [storage.join(root, "sub", "c.txt")]
    assert json.loads(storage.read_text(storage.join(root, "a.json"))) == {"x": 1}
    assert storage.read_bytes(storage.join(root, "sub", "b.bin")) == bytes(range(256))
    assert storage.read_text(storage.join(root, "sub", "c.txt")) == "héllo\n"

    storage.write_atomic(storage.join(root, "a.json"), '{"x": 2}')  # replaced whole
    assert json.loads(storage.read_text(storage.join(root, "a.json"))) == {"x": 2}
    assert storage.listdir(root) == ["a.json", "sub"]  # no temporary file left behind

    storage.remove(storage.join(root, "a.json"))
    storage.remove(storage.join(root, "a.json"), missing_ok=True)
    assert not storage.exists(storage.join(root, "a.json"))
    storage.rmtree(storage.join(root, "sub"))
    assert not storage.exists(storage.join(root, "sub", "b.bin"))
    with pytest.raises(FileNotFoundError):
        storage.listdir(storage.join(root, "sub"))


def test_file_sizes_and_move(root):
    """The size listing checkpoint verification compares, and moving a folder aside."""
    storage.write_atomic(storage.join(root, "7", "a.json"), "{}")
    storage.write_atomic(storage.join(root, "7", "d", "blob"), bytes(1000))
    assert storage.file_sizes(storage.join(root, "7")) == {"a.json": 2, "d/blob": 1000}
    storage.move(storage.join(root, "7"), storage.join(root, "aside", "7"))
    assert storage.listdir(root) == ["aside"]
    assert storage.file_sizes(storage.join(root, "aside")) == {"7/a.json": 2, "7/d/blob": 1000}
    storage.write_atomic(storage.join(root, "8", "x"), "1")
    with pytest.raises(FileExistsError):
        storage.move(storage.join(root, "8"), storage.join(root, "aside", "7"))


@pytest.mark.full  # the GCS emulator
def test_objects_another_writer_adds_are_seen_at_once(gcs_dir):
    """fsspec caches listings by default, and then an object written by another host (or
    by TensorStore in this process) stays invisible to exists/listdir; storage turns it off."""
    storage.write_atomic(storage.join(gcs_dir, "a"), "1")
    assert storage.listdir(gcs_dir) == ["a"] and not storage.exists(storage.join(gcs_dir, "b"))
    bucket, _, prefix = gcs_dir[len("gs://") :].partition("/")
    gcs.Client().bucket(bucket).blob(f"{prefix}/b").upload_from_string("2")
    assert storage.listdir(gcs_dir) == ["a", "b"]
    assert storage.exists(storage.join(gcs_dir, "b"))


def test_appends_grow_the_file_across_reopen(root):
    """metrics.jsonl: one line per write, flushed at once, appended to on resume."""
    path = storage.join(root, "metrics.jsonl")
    lines = [json.dumps({"step": s, "loss": 10.0 / s}) + "\n" for s in range(1, 8)]
    with storage.open(path, "a") as f:
        for line in lines[:4]:
            f.write(line)
            f.flush()
        assert storage.read_text(path) == "".join(lines[:4])  # visible before close
    with storage.open(path, "a") as f:  # a resumed run
        f.writelines(lines[4:])
    assert storage.read_text(path) == "".join(lines)
    assert storage.listdir(root) == ["metrics.jsonl"]  # no append parts left behind


def test_binary_appends_and_type_checks(root):
    path = storage.join(root, "blob.bin")
    chunks = [bytes([i]) * (i + 1) for i in range(20)]
    with storage.open(path, "ab") as f:
        for chunk in chunks:
            f.write(chunk)
            if len(chunk) % 3 == 0:
                f.flush()
        with pytest.raises(TypeError):
            f.write("text")
    assert storage.read_bytes(path) == b"".join(chunks)
    with pytest.raises(ValueError, match="mode"):
        storage.open(path, "r+")


def test_appends_keep_line_ending_bytes_at_the_end_of_each_write(root):
    """An upload whose data ends in "\r" once lost that byte on the bucket emulator (its
    multipart parser): a TFRecord's CRC byte, so TensorBoard skipped the rest of the file."""
    path = storage.join(root, "records.bin")
    chunks = [b"a\r", b"\r", b"b\n", b"\r\n", b"c\r\r", b"\n\r"]
    with storage.open(path, "ab") as f:
        for chunk in chunks:
            f.write(chunk)
            f.flush()  # each chunk its own upload
    assert storage.read_bytes(path) == b"".join(chunks)
    for i, chunk in enumerate(chunks):
        storage.write_atomic(storage.join(root, f"whole{i}"), chunk)
        assert storage.read_bytes(storage.join(root, f"whole{i}")) == chunk


def _scalar_event(step: int, wall_time: float, **values) -> event_pb2.Event:
    summary = summary_pb2.Summary(
        value=[summary_pb2.Summary.Value(tag=k, simple_value=v) for k, v in values.items()]
    )
    return event_pb2.Event(wall_time=wall_time, step=step, summary=summary)


def test_tensorboard_events_written_through_storage_read_back_by_tensorboard(root):
    """An event file appended through `storage.open(..., "ab")` (TensorBoard's RecordWriter,
    flushed after every event as MetricsWriter does) is read by TensorBoard's own loader
    from the same path, gs:// included, with no TensorFlow installed."""
    logdir = storage.join(root, "tensorboard")
    events = storage.join(logdir, "events.out.tfevents.1700000000.host.1.0")
    losses = {s: 12.0 / s for s in range(1, 11)}
    writer = RecordWriter(storage.open(events, "ab"))
    header = event_pb2.Event(wall_time=1.7e9, file_version="brain.Event:2")
    writer.write(header.SerializeToString())
    for step, loss in losses.items():
        event = _scalar_event(step, 1.7e9 + step, loss=loss, lr=1e-3 * step)
        writer.write(event.SerializeToString())
        writer.flush()
    writer.close()

    acc = event_accumulator.EventAccumulator(logdir)
    acc.Reload()
    got = {e.step: e.value for e in acc.Scalars("loss")}
    assert got == {s: float(np.float32(v)) for s, v in losses.items()}
    assert [e.value for e in acc.Scalars("lr")] == [float(np.float32(1e-3 * s)) for s in losses]


# ----------------------------------------------------------------------------- the lock


def test_lock_refuses_a_second_holder_with_one_line_naming_the_first(root):
    first = wl.WorkdirLock(root).acquire()
    with pytest.raises(wl.WorkdirLockedError) as refused:
        wl.WorkdirLock(root).acquire()
    message = str(refused.value)
    assert "\n" not in message
    assert f"pid {os.getpid()}" in message and first._record["started"] in message
    assert storage.normalize(root) in message
    assert wl.WorkdirLock(root).holder()["pid"] == os.getpid()
    first.release()
    assert wl.WorkdirLock(root).holder() is None  # released: nothing left behind
    with wl.WorkdirLock(root) as second:
        assert second.holder()["token"] == second._record["token"]


def _contend(workdir: str, n: int) -> tuple[list, list]:
    """n threads try to take the lock at the same moment: (winners, refused)."""
    barrier = threading.Barrier(n)
    won, refused = [], []

    def contend():
        lock = wl.WorkdirLock(workdir)
        barrier.wait()
        try:
            won.append(lock.acquire())
        except wl.WorkdirLockedError:
            refused.append(lock)

    threads = [threading.Thread(target=contend) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return won, refused


def test_lock_concurrent_acquirers_exactly_one_wins(root):
    storage.makedirs(root)
    won, refused = _contend(root, 4)
    assert (len(won), len(refused)) == (1, 3)
    assert won[0].holder()["token"] == won[0]._record["token"]
    won[0].release()


_HOLD_SCRIPT = """
import sys, time
from gpt_oss_train.io import workdir_lock
workdir_lock.WorkdirLock(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(600)
"""


def test_lock_left_by_a_killed_run_is_taken_over(root):
    """kill -9 leaves the lock file behind; the next run takes it (the kernel dropped the
    flock; on gs:// the holder's pid is gone from this machine) and says so."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_SCRIPT, root], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(wl.WorkdirLockedError, match=f"pid {holder.pid},"):
            wl.WorkdirLock(root).acquire()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert wl.WorkdirLock(root).holder()["pid"] == holder.pid  # still there after kill -9
    with wl.WorkdirLock(root) as lock:
        assert lock.holder()["pid"] == os.getpid()


def _other_host_record(heartbeat: float, lease_s: float = 300.0) -> str:
    return json.dumps(
        {
            "host": "other-host",
            "pid": 1,
            "started": "2026-01-01 00:00:00 UTC",
            "heartbeat": heartbeat,
            "lease_s": lease_s,
            "token": "theirs",
            "process_scope": "other-host/boot/pid:[1]",
        }
    )


@pytest.mark.full  # the GCS emulator
def test_gcs_lock_of_another_host_is_taken_over_only_after_its_lease(gcs_dir):
    lock_path = storage.join(gcs_dir, wl.LOCK_NAME)
    storage.write_atomic(lock_path, _other_host_record(heartbeat=time.time() - 10))
    with pytest.raises(wl.WorkdirLockedError, match=r"host other-host, pid 1, .*300 s old"):
        wl.WorkdirLock(gcs_dir).acquire()

    storage.write_atomic(lock_path, _other_host_record(heartbeat=time.time() - 301))
    with wl.WorkdirLock(gcs_dir) as lock:
        assert lock.holder()["token"] == lock._record["token"]


@pytest.mark.full  # the GCS emulator
def test_gcs_stale_lock_concurrent_takers_exactly_one_wins(gcs_dir):
    storage.write_atomic(
        storage.join(gcs_dir, wl.LOCK_NAME), _other_host_record(heartbeat=time.time() - 1000)
    )
    won, refused = _contend(gcs_dir, 3)
    assert (len(won), len(refused)) == (1, 2)
    assert won[0].holder()["token"] == won[0]._record["token"]
    won[0].release()


def _wait_for(condition, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


@pytest.mark.full  # the GCS emulator
def test_gcs_lock_heartbeat_renews_and_notices_a_takeover(gcs_dir):
    lock = wl.WorkdirLock(gcs_dir, lease_s=60, heartbeat_s=0.1).acquire()
    first_beat = lock.holder()["heartbeat"]
    assert _wait_for(lambda: lock.holder()["heartbeat"] > first_beat)
    lock.check()  # still ours

    # Another run takes the lock over (as it would after this one stalled past its lease).
    storage.write_atomic(lock.path, _other_host_record(heartbeat=time.time()))
    assert _wait_for(lambda: lock._lost is not None)
    with pytest.raises(wl.WorkdirLockLostError, match="other-host"):
        lock.check()
    lock.release()
    assert lock.holder()["token"] == "theirs"  # a lost lock is not deleted on release


def test_lock_unusable_storage_is_one_line(tmp_path, monkeypatch):
    with pytest.raises(wl.WorkdirLockError, match="s3://"):
        wl.WorkdirLock("s3://bucket/run")
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "missing.json"))
    with pytest.raises(wl.WorkdirLockError, match="no Google Cloud credentials") as e:
        wl.WorkdirLock("gs://bucket/run")
    assert "\n" not in str(e.value)


def test_lock_single_process_job(tmp_path):
    lock = wl.acquire_for_job(str(tmp_path))
    with pytest.raises(wl.WorkdirLockedError):
        wl.acquire_for_job(str(tmp_path))
    lock.release()
