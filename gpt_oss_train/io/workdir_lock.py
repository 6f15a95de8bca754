"""One run per workdir: the file `<workdir>/workdir.lock`, held for the run's life.

    with WorkdirLock(workdir):   # WorkdirLockedError, one line naming the holder, if taken
        ...train...

Two trainers on one workdir would delete each other's checkpoints, so the second one must
be refused before it does any work. How the lock is held depends on where the workdir is:

- A local folder: the file is locked with flock(2). The kernel drops the lock when the
  holder dies, kill -9 included, so a lock left by a dead run is simply taken (and the
  record it left is logged). Network filesystems that emulate flock across machines
  (NFSv4) work; one that cannot lock at all is reported as an error.
- gs://: an object created only if absent (generation precondition `ifGenerationMatch=0`:
  of two creators exactly one wins). The holder rewrites it every `heartbeat_s`, each write
  conditional on its own last generation. A lock whose heartbeat is older than its lease,
  or whose holder process is gone from this very machine, is stale and is taken over by a
  write conditional on the stale generation, so of two takers one wins. A holder that finds
  its lock taken over (it stalled past its lease) is told by `check()`. Hosts' clocks must
  agree to well within the lease (NTP does).

Multi-process jobs: only process 0 takes the lock (`acquire_for_job`) and the others learn
the outcome, so the whole job refuses together; other processes never touch the file.

The file is JSON: host, pid, started (UTC), heartbeat (Unix seconds), lease_s, token (one
per holder), process_scope (host, boot and pid namespace: where a pid names one process).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import threading
import time
import uuid
from typing import Callable

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from gpt_oss_train.errors import UserError
from gpt_oss_train.io import storage

LOCK_NAME = "workdir.lock"
DEFAULT_LEASE_S = 300.0


class WorkdirLockError(UserError):
    """The workdir lock cannot be taken or was lost; the message is one line (exit 2)."""


class WorkdirLockedError(WorkdirLockError):
    """Another live run holds the workdir."""


class WorkdirLockLostError(WorkdirLockError):
    """Another run took over this run's lock (possible only on object storage)."""


class _Held(Exception):
    def __init__(self, record: dict):
        self.record = record


# ----------------------------------------------------------------------------- who holds it


def process_scope() -> str:
    """Where a pid names one process: the host, its boot, and the pid namespace."""

    def read(path, how):
        try:
            return how(path)
        except OSError:
            return ""

    boot = read("/proc/sys/kernel/random/boot_id", lambda p: open(p).read().strip())
    return f"{socket.gethostname()}/{boot}/{read('/proc/self/ns/pid', os.readlink)}"


def _pid_alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, TypeError, ValueError):
        return True  # someone else's live process, or no usable pid: assume alive
    return True


def _describe(record: dict) -> str:
    if not record:
        return "a run that is just starting"
    return (
        f"host {record.get('host', '?')}, pid {record.get('pid', '?')}, "
        f"started {record.get('started', '?')}"
    )


def _parse(data: bytes) -> dict:
    try:
        record = json.loads(data.decode("utf-8")) if data else {}
    except (UnicodeDecodeError, json.JSONDecodeError):
        return {"unreadable": True}
    return record if isinstance(record, dict) else {"unreadable": True}


# ----------------------------------------------------------------------------- local: flock


def _unusable(workdir: str, e: OSError) -> str:
    """Why a local workdir cannot hold its lock file, in one line naming it and the fix."""
    if os.path.lexists(workdir) and not os.path.isdir(workdir):
        return f"workdir {workdir} is a file, not a folder; use another --workdir (it is untouched)"
    if isinstance(e, NotADirectoryError):
        above = os.path.dirname(workdir)
        while above != os.path.dirname(above) and not os.path.lexists(above):
            above = os.path.dirname(above)
        return f"workdir {workdir}: {above} is a file, not a folder; use another --workdir"
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        if not os.path.isdir(workdir):
            return (
                f"workdir {workdir} cannot be created ({e.strerror}: {e.filename or workdir}); "
                "use another --workdir"
            )
        return (
            f"workdir {workdir} is not writable ({e.strerror}: {e.filename or workdir}); make "
            "it writable or use another --workdir"
        )
    return (
        f"workdir {workdir}: cannot write its lock file {LOCK_NAME} ({e.strerror or e}); fix "
        "that or use another --workdir"
    )


class _FlockLock:
    def __init__(self, path: str):
        self.path = path
        self._fd: int | None = None

    def acquire(self, record: dict) -> dict | None:
        """Takes the lock; returns the record a dead holder left (None if none)."""
        while True:
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                held = _parse(os.pread(fd, 1 << 16, 0))
                os.close(fd)
                raise _Held(held) from None
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    raise WorkdirLockError(
                        f"{self.path}: this filesystem cannot lock files ({e.strerror}); use a "
                        "local disk or a gs:// workdir"
                    ) from None
                raise
            # A holder unlinks the file on release: make sure ours is still the one there.
            try:
                if os.stat(self.path).st_ino != os.fstat(fd).st_ino:
                    raise FileNotFoundError
            except FileNotFoundError:
                os.close(fd)
                continue
            left = _parse(os.pread(fd, 1 << 16, 0))
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, json.dumps(record).encode("utf-8"), 0)
                os.fsync(fd)
            except OSError as e:  # a full disk: leave no lock file of this run behind
                try:
                    os.unlink(self.path)  # while locked, as release() does
                except OSError:
                    pass
                os.close(fd)
                raise WorkdirLockError(_unusable(os.path.dirname(self.path), e)) from None
            self._fd = fd
            return left or None

    def _open(self) -> int:
        """The lock file, opened for writing (its folder made first)."""
        folder = os.path.dirname(self.path)
        try:
            os.makedirs(folder, exist_ok=True)
            return os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise WorkdirLockError(_unusable(folder, e)) from None

    def refresh(self, record: dict) -> bool:
        return True  # the kernel holds a flock for as long as the process lives

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.unlink(self.path)  # before unlocking: a waiter then sees a new inode
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None


# ----------------------------------------------------------------------------- gs://: lease


class _GcsLeaseLock:
    """The lock object on GCS, written through google-cloud-storage's preconditions."""

    def __init__(self, url: str, is_stale: Callable[[dict], bool]):
        # lazy: start-up (google-cloud-storage takes ~0.4 s; only gs:// workdirs use it)
        import google.auth.exceptions
        from google.cloud import storage as gcs

        bucket, _, key = url[len("gs://") :].partition("/")
        self.path = url
        try:
            client = gcs.Client()
        except google.auth.exceptions.DefaultCredentialsError as e:
            raise WorkdirLockError(
                f"{url}: no Google Cloud credentials ({str(e).splitlines()[0][:200]}); run "
                "`gcloud auth application-default login` or set GOOGLE_APPLICATION_CREDENTIALS"
            ) from None
        self._blob = client.bucket(bucket).blob(key)
        self._is_stale = is_stale
        self._generation: int | None = None

    def _write(self, record: dict, generation: int) -> None:
        if generation is None:  # no precondition would mean an unconditional overwrite
            raise ValueError(f"{self.path}: a lock write needs a generation to match")
        self._blob.upload_from_string(
            json.dumps(record), content_type="application/json", if_generation_match=generation
        )
        self._generation = self._blob.generation

    def _read(self) -> tuple[dict, int] | None:
        """(record, generation) now, or None if there is no lock or it changed meanwhile."""
        from google.api_core import exceptions  # lazy: start-up, as in __init__

        blob = self._blob.bucket.get_blob(self._blob.name)
        if blob is None:
            return None
        generation = blob.generation  # before the download, which may reset it
        try:
            data = blob.download_as_bytes(if_generation_match=generation)
        except (exceptions.NotFound, exceptions.PreconditionFailed):
            return None
        return _parse(data), generation

    def acquire(self, record: dict) -> dict | None:
        from google.api_core import exceptions  # lazy: start-up, as in __init__

        while True:
            try:
                self._write(record, 0)
                return None
            except exceptions.PreconditionFailed:
                pass
            found = self._read()
            if found is None:
                continue  # released or rewritten meanwhile: start over
            current, generation = found
            if current.get("token") == record["token"]:  # our own create, retried
                self._generation = generation
                return None
            if not self._is_stale(current):
                raise _Held(current)
            try:
                self._write(record, generation)
                return current
            except exceptions.PreconditionFailed:
                continue  # another run took it over first: look again

    def refresh(self, record: dict) -> bool:
        """Rewrites the lock if it is still ours; False if someone took it over."""
        from google.api_core import exceptions  # lazy: start-up, as in __init__

        try:
            self._write(record, self._generation)
        except (exceptions.PreconditionFailed, exceptions.NotFound):
            return False
        return True

    def release(self) -> None:
        from google.api_core import exceptions  # lazy: start-up, as in __init__

        if self._generation is None:
            return
        try:
            self._blob.delete(if_generation_match=self._generation)
        except (exceptions.PreconditionFailed, exceptions.NotFound):
            pass  # taken over or gone: not ours to delete
        self._generation = None


# ----------------------------------------------------------------------------- the lock


class WorkdirLock:
    """Held from `acquire()` (or `with`) to `release()`; see the module docstring.

    lease_s: on object storage, how old a holder's heartbeat may get before its lock counts
    as left by a dead run; heartbeat_s (default lease_s / 5): how often the holder renews.
    """

    def __init__(
        self,
        workdir: str | os.PathLike,
        *,
        lease_s: float = DEFAULT_LEASE_S,
        heartbeat_s: float | None = None,
        clock: Callable[[], float] = time.time,
    ):
        self.workdir = storage.normalize(workdir)
        self.path = storage.join(self.workdir, LOCK_NAME)
        self.lease_s = float(lease_s)
        self.heartbeat_s = float(heartbeat_s) if heartbeat_s else self.lease_s / 5
        self._clock = clock
        self._record: dict | None = None
        self._lost: dict | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if not storage.is_remote(self.path):
            self._backend = _FlockLock(self.path)
        elif self.path.startswith("gs://"):
            self._backend = _GcsLeaseLock(self.path, self.is_stale)
        else:
            raise WorkdirLockError(
                f"{self.workdir}: no workdir lock for {self.path.split('://')[0]}:// (only "
                "local folders and gs:// can be locked atomically)"
            )

    def is_stale(self, record: dict) -> bool:
        """Whether a lock record on object storage was left by a run that is gone."""
        if record.get("process_scope") == process_scope() and not _pid_alive(record.get("pid")):
            return True
        heartbeat, lease = record.get("heartbeat"), record.get("lease_s")
        if not isinstance(heartbeat, (int, float)) or not isinstance(lease, (int, float)):
            return False  # not a record we wrote: never take it over silently
        return self._clock() - heartbeat > lease

    def acquire(self) -> "WorkdirLock":
        now = self._clock()
        record = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(now)),
            "heartbeat": now,
            "lease_s": self.lease_s,
            "token": uuid.uuid4().hex,
            "process_scope": process_scope(),
        }
        try:
            left = self._backend.acquire(record)
        except _Held as held:
            raise WorkdirLockedError(self._refusal(held.record)) from None
        if left:
            logging.warning(
                "Workdir lock %s: taking over from a run that is gone (%s)",
                self.path,
                _describe(left),
            )
        self._record = record
        if storage.is_remote(self.path):
            self._stop.clear()
            self._thread = threading.Thread(
                target=self._heartbeat, name="workdir-lock", daemon=True
            )
            self._thread.start()
        return self

    def _refusal(self, record: dict) -> str:
        message = f"workdir {self.workdir} is in use by another run ({_describe(record)})"
        if record.get("unreadable"):
            message = f"workdir {self.workdir} has a lock file this program did not write"
        if storage.is_remote(self.path) and "heartbeat" in record:
            age = self._clock() - float(record["heartbeat"])
            message += (
                f", last heartbeat {age:.0f} s ago; a run that died is taken over once its "
                f"heartbeat is {float(record.get('lease_s', self.lease_s)):.0f} s old"
            )
        return f"{message}. Stop it or use another --workdir (lock: {self.path})"

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            self._record["heartbeat"] = self._clock()
            try:
                still_ours = self._backend.refresh(self._record)
            except Exception as e:  # a network error: the next beat retries
                logging.warning("Workdir lock %s: heartbeat failed (%s)", self.path, e)
                continue
            if not still_ours:
                self._lost = self.holder() or {}
                logging.error(
                    "Workdir lock %s was taken over by %s", self.path, _describe(self._lost)
                )
                return

    def check(self) -> None:
        """Raises WorkdirLockLostError if another run took this lock over."""
        if self._lost is not None:
            raise WorkdirLockLostError(
                f"workdir {self.workdir}: another run took over the lock ({_describe(self._lost)}) "
                "after this run's heartbeat stalled; stopping so the two do not both write"
            )

    def holder(self) -> dict | None:
        """The record in the lock file now, or None if there is none."""
        try:
            return _parse(storage.read_bytes(self.path)) or None
        except FileNotFoundError:
            return None

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._record is not None and self._lost is None:
            self._backend.release()
        self._record = None

    def __enter__(self) -> "WorkdirLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def acquire_for_job(workdir: str | os.PathLike, **kwargs) -> WorkdirLock | None:
    """Process 0 takes the workdir lock and every process learns whether it could, so a
    refused job stops on all hosts at once. Returns the lock on process 0, None elsewhere.
    Call it after jax.distributed is initialised and before any expensive work."""
    lock, error = None, None
    if jax.process_index() == 0:
        try:
            lock = WorkdirLock(workdir, **kwargs).acquire()
        except WorkdirLockError as e:
            error = e
    if jax.process_count() > 1:
        refused = int(multihost_utils.broadcast_one_to_all(np.int32(error is not None)))
        if refused and error is None:
            raise WorkdirLockedError(
                f"workdir {storage.normalize(workdir)}: process 0 could not take the workdir "
                "lock (its log says why)"
            )
    if error is not None:
        raise error
    return lock
