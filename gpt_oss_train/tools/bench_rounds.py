"""What it costs a multi-host engine to send each serving round to the other processes.

    DEVICES_PER_PROCESS=4 launch/local.sh 2 python -m gpt_oss_train.tools.bench_rounds

Process 0 encodes representative rounds (inference/rounds.py) and sends each over the
job's link (hosts.Link), a few milliseconds apart so that none waits behind another; the
other processes receive and decode them. Process 0 reports its encode + send time per
round and the message size; the others the delay from process 0's send to the decoded
arrays in hand (processes on one machine share its monotonic clock; across machines run
it for the send side only). No device work is timed: the rounds' own steps are the same
on one process or many.
"""

from __future__ import annotations

import json
import time

import numpy as np
from absl import app, flags

from gpt_oss_train import errors, hosts
from gpt_oss_train.inference import rounds
from gpt_oss_train.inference.sampling import SamplingRows

_ROUNDS = flags.DEFINE_integer("rounds", 500, "Rounds sent of each kind.")
_GAP_MS = flags.DEFINE_float("gap_ms", 2.0, "Pause between rounds (ms).")


def _decode_call(rows: int) -> rounds.Call:
    settings = SamplingRows(
        np.full(rows, 0.7, np.float32),
        np.zeros(rows, np.int32),
        np.ones(rows, np.float32),
        np.arange(rows, dtype=np.uint32),
        np.arange(rows, dtype=np.int32),
        np.zeros((rows, 0), np.int32),
        np.zeros((rows, 0), np.float32),
        np.zeros((rows, 0), np.uint32),
    )
    args = (
        np.arange(rows, dtype=np.int32),
        np.arange(rows, dtype=np.int32),
        settings,
        np.zeros(rows, bool),
        np.zeros(rows, np.int32),
    )
    return rounds.Call("decode", args, {"rows": rows, "context": 4096})


def _prefill_round(rows: int, chunk: int) -> rounds.Round:
    """A request admitted, a chunk of its prompt prefilled and saved, and a decode step."""
    one = SamplingRows(
        *(np.zeros(1, dt) for dt in (np.float32, np.int32, np.float32, np.uint32, np.int32)),
        np.zeros((1, 0), np.int32),
        np.zeros((1, 0), np.float32),
        np.zeros((1, 0), np.uint32),
    )
    tokens = np.arange(chunk, dtype=np.int32)[None]
    return rounds.Round(
        [
            rounds.Call("admit", (np.int32(3), np.zeros(64, np.int32), np.int32(0))),
            rounds.Call(
                "prefill",
                (
                    np.int32(3),
                    tokens,
                    tokens,
                    np.int32(chunk - 1),
                    one,
                    np.zeros(1, bool),
                    np.zeros(1, np.int32),
                ),
                {"context": 4096},
            ),
            rounds.Call("save", (np.int32(3), np.int32(0), np.arange(chunk // 16, dtype=np.int32))),
            _decode_call(rows),
        ]
    )


CASES = {
    "decode step, 8 rows": rounds.Round([_decode_call(8)]),
    "decode step, 64 rows": rounds.Round([_decode_call(64)]),
    "admit + prefill 256 + save + decode 64": _prefill_round(64, 256),
}


def _stats(seconds: list[float]) -> dict:
    us = np.asarray(seconds) * 1e6
    return {
        "median_us": round(float(np.median(us)), 1),
        "p99_us": round(float(np.percentile(us, 99)), 1),
    }


def main(argv):
    del argv
    link = hosts.join()
    with link:
        if not link.multihost:
            raise app.UsageError("run it on several processes: launch/local.sh 2 python -m ...")
        for name, round_ in CASES.items():
            sent, received, costs, size = [], [], [], 0
            for _ in range(_ROUNDS.value):
                if link.leader:
                    t0 = time.monotonic()
                    data = rounds.encode(round_)
                    link.send(data)
                    costs.append(time.monotonic() - t0)
                    sent.append(t0)
                    size = len(data)
                    time.sleep(_GAP_MS.value / 1e3)
                else:
                    rounds.decode(link.receive())
                    received.append(time.monotonic())
            sent = json.loads(link.share(json.dumps(sent).encode() if link.leader else None))
            if link.leader:
                row = {"round": name, "bytes": size, "encode_and_send": _stats(costs)}
            else:
                delays = [r - s for r, s in zip(received, sent)]
                row = {"round": name, "process": link.index, "send_to_decoded": _stats(delays)}
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    app.run(main, flags_parser=errors.parse_flags)
