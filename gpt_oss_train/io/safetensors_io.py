"""The safetensors file format, read and written with numpy alone.

A file is an 8-byte little-endian header length, a JSON header mapping each tensor name to
its dtype, shape and [begin, end) byte offsets in the data that follows, then the data.
``read_header`` parses and validates a header (offsets consistent with dtype and shape,
nothing past the end of the file) so a truncated or corrupt file fails with its name;
``write_safetensors`` writes a file one tensor at a time, so a writer never holds more
than one tensor. ``read_part`` copies one box of a tensor out of a memory-mapped file:
only those bytes are read.
"""

from __future__ import annotations

import json
import math
import os
import struct
from typing import Any, Callable

import ml_dtypes
import numpy as np

from gpt_oss_train.errors import UserError

__all__ = [
    "ST_DTYPES",
    "FLOAT_DTYPES",
    "TensorInfo",
    "read_header",
    "map_file",
    "read_part",
    "write_safetensors",
]

# safetensors dtype names.
ST_DTYPES = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "U8": np.dtype("u1"),
    "I8": np.dtype("i1"),
    "I16": np.dtype("<i2"),
    "U16": np.dtype("<u2"),
    "I32": np.dtype("<i4"),
    "U32": np.dtype("<u4"),
    "I64": np.dtype("<i8"),
    "U64": np.dtype("<u8"),
    "BOOL": np.dtype("?"),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


class SafetensorsError(UserError):
    """A safetensors file that is truncated or corrupt; the message names the file."""


class TensorInfo:
    """Where one tensor lies: its file, safetensors dtype name, shape, data byte range
    [begin, end) and where the file's data starts (`data_start`, the header's end)."""

    __slots__ = ("name", "file", "dtype", "shape", "begin", "end", "data_start")

    def __init__(self, name, file, dtype, shape, begin, end, data_start=0):
        self.name, self.file, self.dtype, self.shape = name, file, dtype, shape
        self.begin, self.end, self.data_start = begin, end, data_start


def read_header(fpath: str) -> tuple[dict[str, TensorInfo], int]:
    """Parse and validate a safetensors header; returns (tensors, data start offset)."""
    try:
        size = os.path.getsize(fpath)
    except OSError as e:
        raise FileNotFoundError(f"safetensors file {fpath} cannot be read: {e}") from None
    with open(fpath, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise SafetensorsError(
                f"safetensors file {fpath} is truncated or corrupt ({size} bytes, no header)"
            )
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
            raise SafetensorsError(
                f"safetensors file {fpath} is truncated or corrupt: header length "
                f"{n} runs past the end of the file ({size} bytes)"
            )
        raw = f.read(n)
    try:
        hdr = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorsError(f"safetensors file {fpath} has a corrupt header ({e})") from None
    if not isinstance(hdr, dict):
        raise SafetensorsError(f"safetensors file {fpath} has a corrupt header (not a JSON object)")
    data_len = size - 8 - n
    out: dict[str, TensorInfo] = {}
    max_end = 0
    for name, info in hdr.items():
        if name == "__metadata__":
            continue
        try:
            st, shape, (b, e) = (
                info["dtype"],
                tuple(int(s) for s in info["shape"]),
                info["data_offsets"],
            )
        except (KeyError, TypeError, ValueError):
            raise SafetensorsError(
                f"safetensors file {fpath}: corrupt header entry for {name!r}"
            ) from None
        if st not in ST_DTYPES:
            raise SafetensorsError(
                f"safetensors file {fpath}: tensor {name!r} has unsupported dtype {st}"
            )
        nbytes = math.prod(shape) * ST_DTYPES[st].itemsize
        if not (0 <= b <= e) or e - b != nbytes:
            raise SafetensorsError(
                f"safetensors file {fpath}: tensor {name!r} has data_offsets {[b, e]} "
                f"inconsistent with {st} {list(shape)}"
            )
        if e > data_len:
            raise SafetensorsError(
                f"safetensors file {fpath} is truncated: tensor {name!r} ends at byte "
                f"{8 + n + e} but the file has {size} bytes"
            )
        max_end = max(max_end, e)
        out[name] = TensorInfo(name, fpath, st, shape, b, e, 8 + n)
    if max_end != data_len:
        raise SafetensorsError(
            f"safetensors file {fpath} is corrupt: {data_len} data bytes but the "
            f"header describes {max_end}"
        )
    return out, 8 + n


def map_file(fpath: str) -> np.ndarray:
    """A whole file mapped read-only (uint8): nothing is read until a part is copied."""
    return np.memmap(fpath, dtype=np.uint8, mode="r")


def read_part(mapped: np.ndarray, info: TensorInfo, index: tuple) -> np.ndarray:
    """The box `index` (a tuple of slices, steps allowed) of tensor `info`, copied out of
    its file as mapped by `map_file`: the pages under it are all that is read."""
    start = info.data_start + info.begin
    whole = mapped[start : start + info.end - info.begin].view(ST_DTYPES[info.dtype])
    return np.array(whole.reshape(info.shape)[index])


def write_safetensors(
    fpath: str,
    entries: list[tuple[str, str, tuple[int, ...]]],
    produce: Callable[[str], np.ndarray],
) -> None:
    """Write a safetensors file tensor by tensor: the header is built from the declared
    (name, dtype, shape) entries, then produce(name) is called once per tensor in order."""
    header: dict[str, Any] = {}
    off = 0
    for name, st, shape in entries:
        nb = math.prod(shape) * ST_DTYPES[st].itemsize
        header[name] = {"dtype": st, "shape": list(shape), "data_offsets": [off, off + nb]}
        off += nb
    header["__metadata__"] = {"format": "pt"}
    hb = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hb += b" " * ((-len(hb)) % 8)
    with open(fpath, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for name, st, shape in entries:
            a = produce(name)
            dt = ST_DTYPES[st]
            if a.dtype != dt or a.shape != tuple(shape):
                raise AssertionError(
                    f"internal: {name} produced {a.dtype} {a.shape}, declared {dt} {shape}"
                )
            f.write(np.ascontiguousarray(a).reshape(-1).view(np.uint8).data)
        f.flush()
        os.fsync(f.fileno())
