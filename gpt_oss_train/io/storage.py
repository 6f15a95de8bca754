"""Where run files live: a local path or a URL (gs://bucket/run, or any other scheme
etils.epath handles), behind one small API, so checkpoints, metrics.jsonl, TensorBoard and the
workdir lock work the same on a laptop and on a pod whose hosts share nothing but a bucket.

Paths are plain strings. Files go through etils.epath, Orbax's own path layer: local paths
through `os`, URLs through fsspec (gcsfs for gs://), or through tf.io.gfile when TensorFlow
is installed. Orbax writes the arrays with TensorStore, which talks to GCS itself. Endpoints
and credentials come from the environment: STORAGE_EMULATOR_HOST (gcsfs,
google-cloud-storage) and TENSORSTORE_GCS_HTTP_URL (TensorStore) point them at an emulator.

What differs on object storage, and how this module hides it:
- An object appears whole when its writer closes it, never in part: `write_atomic` is a
  plain write there (locally: a temporary file renamed into place).
- Objects cannot be appended to: `open(url, "a")` buffers writes and each `flush()` adds
  them to the object (on GCS, a compose of the object and one small upload: the cost does
  not grow with the file), so metrics.jsonl and TensorBoard event files grow as on disk.
  fsspec's own "a" mode on GCS silently overwrites instead.
- Listings are never cached: fsspec caches them by default, and then an object written by
  another host, or by TensorStore in this very process, stays invisible to `exists` and
  `listdir`. (The setting is applied when this module is imported.)
"""

from __future__ import annotations

import io
import os
import posixpath
import re
import tempfile
import uuid
from typing import IO, Iterable

import fsspec
from etils import epath

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")

# Another writer (host, process, TensorStore) may add objects at any time: always ask.
for _protocol in ("gcs", "s3", "abfs"):
    fsspec.config.conf.setdefault(_protocol, {}).setdefault("use_listings_cache", False)


def is_remote(path: str | os.PathLike) -> bool:
    """A URL such as gs://bucket/run (file:// is local)."""
    path = os.fspath(path)
    return bool(_URL.match(path)) and not path.startswith("file://")


def normalize(path: str | os.PathLike) -> str:
    """The canonical form of a run path: local paths absolute (with ~ expanded, file://
    dropped), URLs unchanged but for a trailing slash. `os.path.abspath` would turn
    gs://b/run into <cwd>/gs:/b/run."""
    path = os.fspath(path)
    if path.startswith("file://"):
        path = path[len("file://") :]
    if is_remote(path):
        scheme, rest = path.split("://", 1)
        return f"{scheme}://{rest.rstrip('/')}" if rest.strip("/") else path
    return os.path.abspath(os.path.expanduser(path))


def join(path: str | os.PathLike, *parts: str) -> str:
    path = normalize(path)
    return posixpath.join(path, *parts) if is_remote(path) else os.path.join(path, *parts)


def basename(path: str | os.PathLike) -> str:
    path = normalize(path)
    return posixpath.basename(path) if is_remote(path) else os.path.basename(path)


def dirname(path: str | os.PathLike) -> str:
    path = normalize(path)
    return posixpath.dirname(path) if is_remote(path) else os.path.dirname(path)


def as_epath(path: str | os.PathLike) -> epath.Path:
    """The epath.Path for `path` (what Orbax's APIs take)."""
    return epath.Path(normalize(path))


def exists(path: str | os.PathLike) -> bool:
    return as_epath(path).exists()


def isdir(path: str | os.PathLike) -> bool:
    """A folder locally; on object storage, a prefix that has objects under it."""
    return as_epath(path).is_dir()


def makedirs(path: str | os.PathLike) -> None:
    """Creates the folder and its parents (object stores have no folders: nothing to do)."""
    if not is_remote(path):
        os.makedirs(normalize(path), exist_ok=True)


def listdir(path: str | os.PathLike) -> list[str]:
    """Sorted names of the entries directly under `path`; FileNotFoundError if none."""
    p = as_epath(path)
    if not p.is_dir():
        raise FileNotFoundError(f"{normalize(path)}: no such folder")
    return sorted(child.name for child in p.iterdir())


def glob(directory: str | os.PathLike, pattern: str) -> list[str]:
    """Sorted full paths under `directory` matching `pattern` (e.g. "*/model_config")."""
    return sorted(os.fspath(p) for p in as_epath(directory).glob(pattern))


def read_text(path: str | os.PathLike) -> str:
    return as_epath(path).read_text(encoding="utf-8")


def read_bytes(path: str | os.PathLike) -> bytes:
    return as_epath(path).read_bytes()


def remove(path: str | os.PathLike, *, missing_ok: bool = False) -> None:
    """Deletes one file."""
    p = as_epath(path)
    if missing_ok and not p.exists():
        return
    p.unlink()


def rmtree(path: str | os.PathLike, *, missing_ok: bool = False) -> None:
    """Deletes a folder (every object under the prefix) and everything in it."""
    p = as_epath(path)
    if missing_ok and not p.exists():
        return
    p.rmtree()


def file_sizes(directory: str | os.PathLike) -> dict[str, int]:
    """{path relative to `directory` ('/'-separated): size in bytes} of every file under it."""
    directory = normalize(directory)
    if is_remote(directory):
        fs, root = fsspec.core.url_to_fs(directory)
        found = fs.find(root, detail=True)
        return {
            posixpath.relpath(name, root): int(info["size"])
            for name, info in found.items()
            if info.get("type") != "directory"
        }
    sizes = {}
    for folder, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(folder, name)
            sizes[os.path.relpath(path, directory).replace(os.sep, "/")] = os.path.getsize(path)
    return sizes


def move(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Moves a file or folder to `dst`, which must not exist (on object storage: a copy of
    each object, then its deletion)."""
    src, dst = normalize(src), normalize(dst)
    if exists(dst):
        raise FileExistsError(f"{dst} already exists")
    if not is_remote(src):
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        os.rename(src, dst)
        return
    fs, key = fsspec.core.url_to_fs(src)
    fs.mv(key, fsspec.core.url_to_fs(dst)[1], recursive=True)


def write_atomic(path: str | os.PathLike, data: str | bytes) -> None:
    """Writes a small file that readers see whole or not at all, never in part."""
    path = normalize(path)
    payload = data.encode("utf-8") if isinstance(data, str) else data
    if is_remote(path):
        as_epath(path).write_bytes(payload)  # an upload is all-or-nothing
        return
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def open(path: str | os.PathLike, mode: str = "r") -> IO:
    """A file object: "r"/"rb" read, "w"/"wb" replace (a URL's object appears on close),
    "a"/"ab" append (on a URL: added at each flush(), see the module docstring).
    Text is UTF-8."""
    if mode not in ("r", "rb", "w", "wb", "a", "ab"):
        raise ValueError(f"storage.open: mode {mode!r} is not one of r, rb, w, wb, a, ab")
    path = normalize(path)
    if not is_remote(path):
        if "r" not in mode:
            os.makedirs(os.path.dirname(path), exist_ok=True)
        return io.open(path, mode, **({} if "b" in mode else {"encoding": "utf-8"}))
    if mode.startswith("a"):
        return RemoteAppendFile(path, binary="b" in mode)
    return as_epath(path).open(mode)


class RemoteAppendFile:
    """Appends to an object: writes are buffered, and each `flush()` adds them to the
    object's end. On GCS (fsspec with `merge`) that is an upload of the new bytes to a
    temporary object composed onto the end of the file; elsewhere the object is rewritten.
    Only one writer may append to an object at a time (the workdir lock's job)."""

    def __init__(self, path: str, *, binary: bool = False):
        self.name = path
        self.binary = binary
        self._fs, self._key = fsspec.core.url_to_fs(path)
        self._pending: list[bytes] = []
        self._exists: bool | None = None
        self.closed = False

    def write(self, data: str | bytes) -> int:
        if self.closed:
            raise ValueError(f"{self.name}: write to a closed file")
        if isinstance(data, str) == self.binary:
            kind = "bytes" if self.binary else "str"
            raise TypeError(f"{self.name}: opened for {kind}, got {type(data).__name__}")
        self._pending.append(data.encode("utf-8") if isinstance(data, str) else bytes(data))
        return len(data)

    def writelines(self, lines: Iterable[str | bytes]) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        if not self._pending:
            return
        data = b"".join(self._pending)
        if self._exists is None:
            self._exists = self._fs.exists(self._key)
        if not self._exists:
            self._fs.pipe_file(self._key, data)
        elif hasattr(self._fs, "merge"):
            self._compose_onto_end(data)
        else:
            self._fs.pipe_file(self._key, self._fs.cat_file(self._key) + data)
        self._pending.clear()
        self._exists = True

    def _compose_onto_end(self, data: bytes) -> None:
        # The part's name must not look like the file (TensorBoard reads any "*tfevents*").
        part = posixpath.join(posixpath.dirname(self._key), f".append-{uuid.uuid4().hex}.part")
        self._fs.pipe_file(part, data)
        try:
            self._fs.merge(self._key, [self._key, part])
        finally:
            self._fs.rm_file(part)

    def close(self) -> None:
        if not self.closed:
            self.flush()
            self.closed = True

    def writable(self) -> bool:
        return True

    def __enter__(self) -> "RemoteAppendFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
