"""A local Google Cloud Storage emulator for the tests: `gcp-storage-emulator`, in memory,
plus the parts of GCS's generation semantics that it lacks and that the tests rest on.

    python tests/support/gcs_emulator.py BUCKET      # prints {"port": N}, then serves until killed

What is added, as GCS documents it:
- Preconditions on writes and deletes: `ifGenerationMatch=G` answers 412 unless the object's
  generation is G (0: the object must not exist). The workdir lock's atomic create and
  takeover rest on this, and so do TensorStore's conditional writes (OCDBT manifests).
- Preconditions on reads: `ifGenerationNotMatch=G` answers 304 when the generation is G,
  `ifGenerationMatch=G` 412 when it is not (TensorStore revalidates its cache this way).
- The `x-goog-generation` header on downloads; without it TensorStore fails a read with
  "Malformed StorageGeneration" (intermittently: only when it revalidates).
- Multipart uploads split byte-exactly. The emulator parses them with Python's email
  parser, which takes a "\r" that ends the data for part of the "\n" gcsfs puts before the
  closing boundary and drops it: one small upload in ~256 lost its last byte (a TFRecord's
  last CRC byte, so TensorBoard skipped the rest of an event file).
The emulator serves one request at a time, which makes each check-then-write atomic. A
resumable upload is checked when it starts (GCS checks when it completes; the lock and
TensorStore upload in one request).
"""

from __future__ import annotations

import json
import logging
import signal
import sys
from http import HTTPStatus

from gcp_storage_emulator import server
from gcp_storage_emulator.exceptions import NotFound
from gcp_storage_emulator.handlers import objects


def _target_object(request) -> str | None:
    """The object a request names: the route, the `name` query or the upload metadata."""
    if "object_id" in request.params:
        return request.params["object_id"]
    if "name" in request.query:
        return request.query["name"][0]
    data = request.data
    if isinstance(data, dict):
        meta = data.get("meta", data)
        if isinstance(meta, dict):
            return meta.get("name")
    return None


def _object(request, storage) -> dict | None:
    try:
        return storage.get_file_obj(request.params["bucket_name"], _target_object(request))
    except NotFound:
        return None


def _query(request, key: str) -> str | None:
    values = request.query.get(key)
    return values[0] if values else None


def _error(response, status: HTTPStatus, reason: str):
    response.status = status
    body = {"code": status.value, "message": status.phrase, "errors": [{"reason": reason}]}
    response.json({"error": body})


def _checked_write(handler):
    def write(request, response, storage, *args, **kwargs):
        wanted = _query(request, "ifGenerationMatch")
        obj = _object(request, storage)
        if wanted is not None and wanted != (obj["generation"] if obj else "0"):
            return _error(response, HTTPStatus.PRECONDITION_FAILED, "conditionNotMet")
        return handler(request, response, storage, *args, **kwargs)

    return write


def _checked_read(handler):
    def read(request, response, storage, *args, **kwargs):
        obj = _object(request, storage)
        if obj is None:
            return handler(request, response, storage, *args, **kwargs)  # its own 404
        generation = obj["generation"]
        if _query(request, "ifGenerationNotMatch") == generation:
            response.status = HTTPStatus.NOT_MODIFIED
            return None
        match = _query(request, "ifGenerationMatch")
        if match is not None and match != generation:
            return _error(response, HTTPStatus.PRECONDITION_FAILED, "conditionNotMet")
        result = handler(request, response, storage, *args, **kwargs)
        response["x-goog-generation"] = generation
        response["x-goog-metageneration"] = obj.get("metageneration", "1")
        return result

    return read


def split_multipart_related(raw: bytes, content_type: str) -> dict:
    """A `multipart/related` upload (JSON metadata, then the content) in the form the
    emulator's handlers take. The line ending that precedes a boundary belongs to it; the
    client's own line ending (gcsfs writes "\n", others "\r\n") is read off the first
    boundary line, so the content keeps every byte it was sent with."""
    boundary = b"--" + content_type.split("boundary=", 1)[1].split(";")[0].strip('"').encode()
    first = raw.index(boundary) + len(boundary)
    newline = b"\r\n" if raw[first : first + 2] == b"\r\n" else b"\n"
    parts = raw[first:].split(newline + boundary)[:-1]  # the last piece is "--" (the end)
    bodies, types = [], []
    for part in parts:
        headers, _, body = part[len(newline) :].partition(newline + newline)
        bodies.append(body)
        fields = dict(
            line.split(":", 1) for line in headers.decode().split(newline.decode()) if ":" in line
        )
        kind = {k.strip().lower(): v.strip() for k, v in fields.items()}.get("content-type", "")
        types.append(kind.split(";")[0] or "application/octet-stream")
    meta, content = bodies
    return {"meta": json.loads(meta), "content": content, "content-type": types[1]}


def exact_multipart_reads():
    """Replaces the emulator's request-body reader for `multipart/related` uploads."""
    original = server._read_data

    def read_data(handler, query):
        content_type = handler.headers.get("Content-Type") or ""
        if not content_type.startswith("multipart/related"):
            return original(handler, query)
        raw = server._decode_raw_data(server._read_raw_data(handler), handler)
        return split_multipart_related(raw, content_type) if raw else None

    server._read_data = read_data


def add_generation_semantics():
    """Wraps the emulator's object handlers, in its route table and where they call each
    other (objects.get hands media reads to objects.download)."""
    wrapped = {objects.insert: _checked_write(objects.insert)}
    for handler in (objects.delete, objects.compose):
        wrapped[handler] = _checked_write(handler)
    for handler in (objects.get, objects.download):
        wrapped[handler] = _checked_read(handler)
    server.HANDLERS = tuple(
        (route, {method: wrapped.get(h, h) for method, h in handlers.items()})
        for route, handlers in server.HANDLERS
    )
    server.objects.insert = wrapped[objects.insert]
    objects.download = wrapped[objects.download]


def main(bucket: str):
    logging.basicConfig(level=logging.CRITICAL)
    add_generation_semantics()
    exact_multipart_reads()
    emulator = server.create_server("127.0.0.1", 0, in_memory=True, default_bucket=bucket)
    emulator.start()
    print(json.dumps({"port": emulator._api._httpd.server_address[1]}), flush=True)
    signal.pause()  # serves from its thread until the fixture terminates this process


if __name__ == "__main__":
    main(sys.argv[1])
