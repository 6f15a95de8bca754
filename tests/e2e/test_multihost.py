"""decode and GRPO as two real JAX processes (jax.distributed, gloo), 4 CPU devices each,
started by launch/local.sh as a user would, against the same commands on one process
with all 8 devices: the same mesh, so the same results, and one output file.

What it shows that one process cannot: process 0 alone reads the input and sends it to
the other (hosts.Link), every process runs the same compiled programs on the global mesh,
the sampled tokens come back whole to process 0 (sharding.host_readable), process 0
alone writes; GRPO's rollouts scheduled by process 0 and run by both (Engine.follow),
with the same rewards and losses.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
import pytest
from support import ROOT
from support import harmony_model as hm

from gpt_oss_train.inference import loading, scoring
from gpt_oss_train.io import tokenizer as tok_lib
from gpt_oss_train.tools import convert_checkpoint

LAUNCH_TIMEOUT_S = 600  # two processes compile on two cores; a hang is killed

pytestmark = [
    pytest.mark.full,  # several jax.distributed processes
    pytest.mark.multiprocess,
    pytest.mark.skipif(sys.platform == "win32", reason="launch/local.sh is bash"),
]


def _run(processes: int, *args: str) -> str:
    """`python -m gpt_oss_train.<args>` on 8 CPU devices: one process, or `processes`
    processes of 8 / processes devices each through launch/local.sh. Returns the output;
    fails the test on a non-zero exit."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", *args]
    if processes == 1:
        env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    else:
        env.update(XLA_FLAGS="", DEVICES_PER_PROCESS=str(8 // processes))
        cmd = ["bash", os.path.join(ROOT, "launch", "local.sh"), str(processes), *cmd]
    done = subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, f"{processes} process(es): exit {done.returncode}\n{out[-6000:]}"
    return out


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory, random_hf_model):
    path = tmp_path_factory.mktemp("multihost") / "hf"
    random_hf_model(seed=3).save_pretrained(path)
    return str(path)


def _jsonl(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_decode_generate_and_score_on_two_processes_equal_one(tmp_path, tiny_checkpoint):
    lines = [
        {"tokens": [5, 17, 29, 41, 53, 65, 77], "max_new_tokens": 12},
        {"tokens": [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9]},
        {"tokens": [250, 12]},
        {"tokens": [299, 300]},  # refused (300 is outside the vocabulary): the rest runs
        {"tokens": [7] * 40, "seed": 11},
    ]
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json.dumps(x) + "\n" for x in lines))
    common = ["--dtype=float32", "--max_new_tokens=10", "--temperature=0.7", "--seed=5"]
    outputs = {}
    for mode in ("generate", "score"):
        for n in (1, 2):
            out = tmp_path / f"{mode}{n}.jsonl"
            flags = [f"--mode={mode}", f"--input={requests}", f"--output={out}", *common]
            log = _run(n, "gpt_oss_train.decode", f"--checkpoint={tiny_checkpoint}", *flags)
            if n == 2:  # both processes ran the job, and one of them wrote
                assert "[0] " in log and "[1] " in log, log[-3000:]
            outputs[mode, n] = _jsonl(out)
    for mode in ("generate", "score"):
        one, two = outputs[mode, 1], outputs[mode, 2]
        assert [r["index"] for r in two] == list(range(len(lines))), two  # once, in order
        assert "error" in two[3] and "outside" in two[3]["error"]
        for a, b in zip(one, two):
            assert a.keys() == b.keys()
            if "error" in a:
                assert a == b
                continue
            if mode == "generate":  # sampled at temperature 0.7: the same seeds, same tokens
                assert a["tokens"] == b["tokens"] and len(a["tokens"]) > 1, (a, b)
            np.testing.assert_allclose(b["logprobs"], a["logprobs"], rtol=1e-6, atol=1e-6)


def test_decode_score_data_on_two_processes_equals_one(tmp_path, tiny_checkpoint):
    """A pretokenized source gives every process the whole global batch (each device takes
    its rows), so the batches, and the mean, are those of one process."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(12):
        corpus.joinpath(f"{i}.txt").write_text(" ".join(str(j * i % 97) for j in range(300)))
    pretokenized = tmp_path / "tokens"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "gpt_oss_train.tools.pretokenize",
            f"--source={corpus}",
            f"--output={pretokenized}",
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    results = {}
    for n in (1, 2):
        out = tmp_path / f"eval{n}.json"
        _run(
            n,
            "gpt_oss_train.decode",
            f"--checkpoint={tiny_checkpoint}",
            "--mode=score",
            f"--data={pretokenized}",
            "--num_batches=2",
            "--batch_size=8",
            "--seq_len=32",
            "--dtype=float32",
            f"--output={out}",
        )
        results[n] = json.loads(out.read_text())
    assert results[2]["tokens"] == results[1]["tokens"] > 8 * 32, results
    assert results[2]["loss"] == pytest.approx(results[1]["loss"], rel=1e-6), results
    assert 3 < results[1]["loss"] < 8  # a random model over a 300-id vocabulary: ~ln 300


def test_each_process_reads_its_half_of_the_checkpoint(tmp_path, tiny_checkpoint):
    """Loading on 2 processes of 4 devices (FSDP over 8): each reads its own devices' shards
    of the HF folder, about half of it (what every device holds, the norms, both read),
    and of an Orbax checkpoint saved on 8 devices TensorStore reads each process's chunks:
    about half too. Each says so in its 'Loaded' line."""
    orbax = str(tmp_path / "orbax")
    convert_checkpoint.hf_to_orbax(tiny_checkpoint, orbax)  # 8 devices: a chunk per shard
    requests = tmp_path / "requests.jsonl"
    requests.write_text(json.dumps({"tokens": [5, 17, 29, 41]}) + "\n")
    size = r"([\d.]+) (\w+)"
    for ckpt, took in ((tiny_checkpoint, "read"), (orbax, "holds")):
        log = _run(
            2,
            "gpt_oss_train.decode",
            f"--checkpoint={ckpt}",
            "--mode=score",
            f"--input={requests}",
            f"--output={tmp_path / 'scores.jsonl'}",
            "--overwrite",
            "--dtype=float32",
        )
        found = re.findall(rf"\[(\d)\] .*Loaded .* this process {took} {size} of {size}(.*)", log)
        assert sorted(p for p, *_ in found) == ["0", "1"], log[-3000:]
        for _, part, unit, whole, unit2, rest in found:
            assert unit == unit2, found
            assert 0.45 * float(whole) < float(part) < 0.55 * float(whole), found
            if took == "holds":
                read = re.fullmatch(rf" \(its devices' shards\); TensorStore read {size}", rest)
                assert read and read[2] == unit, found
                assert 0.3 * float(whole) < float(read[1]) < 0.6 * float(whole), found


def test_grpo_on_two_processes_gives_one_process_rewards_and_losses(tmp_path):
    narrow = dict(hidden_size=16, num_heads=2, num_kv_heads=1, head_dim=8, intermediate_size=16)
    args = [
        "gpt_oss_train.train",
        "--config=configs/grpo.py",
        "--config.train.steps=3",
        "--config.train.global_batch_size=8",
        "--config.rl.max_new_tokens=16",
        "--config.train.log_every=1",
        "--config.checkpoint.every=0",
        *(f"--config.model.{k}={v}" for k, v in narrow.items()),
    ]
    per_step = {}
    for n in (1, 2):
        workdir = tmp_path / f"run{n}"
        _run(n, *args, f"--workdir={workdir}")
        rows = _jsonl(workdir / "metrics.jsonl")
        per_step[n] = {r["step"]: (r["reward"], r["loss"]) for r in rows if "reward" in r}
    assert sorted(per_step[2]) == sorted(per_step[1]) == [1, 2, 3], per_step
    for step, (reward, loss) in per_step[1].items():
        assert per_step[2][step][0] == pytest.approx(reward, abs=1e-5), step
        assert per_step[2][step][1] == pytest.approx(loss, abs=1e-5), step
    assert len({r for r, _ in per_step[1].values()}) > 1  # the rewards change: not constant


# ---------------------------------------------------------------------------- the server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, procs, timeout_s: float = 400) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        assert all(p.poll() is None for p in procs), "a server process ended while starting"
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    pytest.fail("the 2-process server did not become healthy")


def _serve_flags(checkpoint: str, port: int) -> list[str]:
    return [
        "gpt_oss_train.serve",
        f"--checkpoint={checkpoint}",
        f"--port={port}",
        "--dtype=float32",
        "--max_slots=4",
        "--max_context=512",
        "--prefill_chunk=64",
        "--served_model_name=tiny-harmony",
        "--grace_period_s=20",
    ]


def test_serve_on_two_processes_through_the_openai_client(tmp_path, harmony_checkpoint):
    """Process 0 takes HTTP, the rounds run on both: the memorised replies of the Harmony
    model (what one process generates: tests/support/harmony_model.py checks it) come back whole
    and streamed, echo's prompt log-probs equal decode's, a storm of clients that hang up
    leaves every slot free, and SIGTERM to the launcher ends both processes with 0."""
    openai = pytest.importorskip("openai")

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="", DEVICES_PER_PROCESS="4")
    log = open(tmp_path / "serve.log", "w+")
    cmd = [
        "bash",
        os.path.join(ROOT, "launch", "local.sh"),
        "2",
        sys.executable,
        "-m",
        *_serve_flags(harmony_checkpoint, port),
    ]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        _wait_healthy(url, [proc])
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        encoded = hm.encoded_examples(tok_lib.Tokenizer())
        for i, (prompt, tools, effort, reply) in enumerate(hm.EXAMPLES[:2]):
            whole = client.chat.completions.create(
                model="tiny-harmony",
                messages=prompt,
                reasoning_effort=effort,
                temperature=0,
                extra_body={"return_token_ids": True},
            )
            choice = whole.choices[0]
            assert choice.message.content == reply[-1]["content"], choice
            assert (choice.model_extra or {}).get("token_ids") == encoded[i][1]
            stream = client.chat.completions.create(
                model="tiny-harmony",
                messages=prompt,
                reasoning_effort=effort,
                temperature=0,
                stream=True,
            )
            content = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            assert content == reply[-1]["content"]
        # echo: the prompt's log-probs, run in the engine's rounds on both processes
        ids = encoded[0][0][:24]
        echo = client.completions.create(
            model="tiny-harmony", prompt=ids, max_tokens=1, temperature=0, echo=True, logprobs=2
        )
        served = echo.choices[0].logprobs.token_logprobs[1 : len(ids)]
        model = loading.load_model(harmony_checkpoint, dtype="float32")  # one process, 8
        want = scoring.score_batch(model, scoring.job(model, "score"), [tuple(ids)], rows=1)
        np.testing.assert_allclose(served, want[0], rtol=1e-5, atol=1e-5)
        # refused on process 0 (over max_context): the others never hear of it
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="tiny-harmony", prompt=[7] * 600, max_tokens=1)

        def hang_up(i):  # a stream read a little, then closed
            stream = client.completions.create(
                model="tiny-harmony",
                prompt=ids[: 8 + i],
                max_tokens=300,
                temperature=0,
                stream=True,
            )
            for n, _ in enumerate(stream):
                if n == 2:
                    break
            stream.close()

        threads = [threading.Thread(target=hang_up, args=(i,)) for i in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        deadline, gauges = time.time() + 30, {}
        while time.time() < deadline:
            text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
            wanted = ("gpt_oss_running_slots", "gpt_oss_queue_depth")
            gauges = dict(line.split() for line in text.splitlines() if line.startswith(wanted))
            if gauges and all(float(v) == 0 for v in gauges.values()):
                break
            time.sleep(0.5)
        assert gauges and all(float(v) == 0 for v in gauges.values()), gauges
        again = client.chat.completions.create(
            model="tiny-harmony", messages=hm.EXAMPLES[0][0], reasoning_effort="low", temperature=0
        )
        assert again.choices[0].message.content == hm.EXAMPLES[0][3][-1]["content"]
        t0 = time.time()
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=90) == 0
        assert time.time() - t0 < 90
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    log.seek(0)
    out = log.read()
    assert "[0] " in out and "Server stopped (process 0 closed the link)" in out, out[-4000:]
    assert "Traceback" not in out, out[-6000:]


def test_a_killed_peer_ends_the_other_within_60_s(tiny_checkpoint, tmp_path):
    """Two processes started as a pod starts them (no launcher to clean up): the follower
    is SIGKILLed; process 0 exits 3 on its own, with one line naming it."""
    port, coordinator = _free_port(), _free_port()
    procs, logs = [], []
    for i in range(2):
        env = dict(
            os.environ,
            JAX_PLATFORMS="cpu",
            JAX_PROCESS_COUNT="2",
            JAX_PROCESS_ID=str(i),
            JAX_COORDINATOR_ADDRESS=f"localhost:{coordinator}",
            PYTHONUNBUFFERED="1",
            XLA_FLAGS="--xla_force_host_platform_device_count=4",
        )
        logs.append(open(tmp_path / f"{i}.log", "w+"))
        flags = _serve_flags(tiny_checkpoint, port)[:-1] + ["--max_context=64", "--max_slots=2"]
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", *flags],
                cwd=ROOT,
                env=env,
                stdout=logs[i],
                stderr=subprocess.STDOUT,
            )
        )
    try:
        _wait_healthy(f"http://127.0.0.1:{port}", procs)
        procs[1].kill()
        t0 = time.time()
        assert procs[0].wait(timeout=60) == 3
        assert time.time() - t0 < 60
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    logs[0].seek(0)
    out = logs[0].read()
    assert "process 1 of 2 is gone" in out, out[-3000:]
