"""A serving round's device calls: what the engine's scheduler decides, as data.

The scheduler (engine_loop.py) runs on process 0 alone. Each round it turns its decisions
(the requests admitted to which slots with which cached prefix, the prefill chunk and the
blocks it saves, the rows of the decode step with their tokens, positions, sampling
settings, seeds and adapters) into a list of `Call`s: an operation of `EngineSteps` and
its host inputs. On several processes the list goes to the others as one message
(`encode`, then hosts.Link) and every process runs the same calls on its shards
(`EngineLoop.apply`); a follower holds no scheduler state at all, so it cannot drift
from process 0. A cancelled request simply has no call in the next round.

The encoding is a JSON header (each call's operation, static sizes and the dtype and
shape of its arrays) followed by the arrays' bytes: no pickle crosses the wire.
"""

from __future__ import annotations

import dataclasses
import json
import struct

import numpy as np

from gpt_oss_train.inference.sampling import SamplingRows

OPS = ("admit", "prefill", "save", "decode", "score", "top")
_LENGTH = struct.Struct("!I")


@dataclasses.dataclass
class Call:
    """One EngineSteps operation (OPS) with its host inputs after the device state
    (params, cache, pool), and its static sizes (rows, context)."""

    op: str
    args: tuple
    static: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Round:
    """The calls of one round; `end`: process 0 has no more work for now (the others
    return from Engine.follow)."""

    calls: list[Call] = dataclasses.field(default_factory=list)
    end: bool = False


def _array_spec(a) -> tuple[dict, bytes]:
    a = np.asarray(a)  # (not ascontiguousarray: it makes a scalar 1-d)
    return {"dtype": a.dtype.str, "shape": list(a.shape)}, a.tobytes()


def encode(round_: Round) -> bytes:
    header, blobs = {"end": round_.end, "calls": []}, []
    for call in round_.calls:
        assert call.op in OPS, call.op
        args = []
        for arg in call.args:
            if isinstance(arg, SamplingRows):
                specs = []
                for field in arg:
                    spec, blob = _array_spec(field)
                    specs.append(spec)
                    blobs.append(blob)
                args.append({"sampling": specs})
            else:
                spec, blob = _array_spec(arg)
                args.append(spec)
                blobs.append(blob)
        header["calls"].append({"op": call.op, "static": call.static, "args": args})
    head = json.dumps(header).encode()
    return _LENGTH.pack(len(head)) + head + b"".join(blobs)


def decode(data: bytes) -> Round:
    (n,) = _LENGTH.unpack_from(data)
    header = json.loads(data[_LENGTH.size : _LENGTH.size + n])
    offset = _LENGTH.size + n

    def take(spec):
        nonlocal offset
        dtype = np.dtype(spec["dtype"])
        size = int(np.prod(spec["shape"], dtype=np.int64)) * dtype.itemsize
        a = np.frombuffer(data, dtype, count=size // dtype.itemsize, offset=offset)
        offset += size
        return a.reshape(spec["shape"])

    calls = []
    for c in header["calls"]:
        args = tuple(
            SamplingRows(*(take(s) for s in spec["sampling"])) if "sampling" in spec else take(spec)
            for spec in c["args"]
        )
        calls.append(Call(c["op"], args, c["static"]))
    return Round(calls, header["end"])
