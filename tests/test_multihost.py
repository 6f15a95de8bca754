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
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH_TIMEOUT_S = 600  # two processes compile on two cores; a hang is killed

pytestmark = [
    pytest.mark.full,  # several jax.distributed processes
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
        [sys.executable, "-m", "gpt_oss_train.tools.pretokenize", f"--source={corpus}",
         f"--output={pretokenized}"],
        cwd=ROOT, check=True, capture_output=True, env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )  # fmt: skip
    results = {}
    for n in (1, 2):
        out = tmp_path / f"eval{n}.json"
        _run(n, "gpt_oss_train.decode", f"--checkpoint={tiny_checkpoint}", "--mode=score",
             f"--data={pretokenized}", "--num_batches=2", "--batch_size=8", "--seq_len=32",
             "--dtype=float32", f"--output={out}")  # fmt: skip
        results[n] = json.loads(out.read_text())
    assert results[2]["tokens"] == results[1]["tokens"] > 8 * 32, results
    assert results[2]["loss"] == pytest.approx(results[1]["loss"], rel=1e-6), results
    assert 3 < results[1]["loss"] < 8  # a random model over a 300-id vocabulary: ~ln 300


def test_grpo_on_two_processes_gives_one_process_rewards_and_losses(tmp_path):
    narrow = dict(hidden_size=16, num_heads=2, num_kv_heads=1, head_dim=8, intermediate_size=16)
    args = ["gpt_oss_train.train", "--config=configs/grpo.py", "--config.train.steps=3",
            "--config.train.global_batch_size=8", "--config.rl.max_new_tokens=16",
            "--config.train.log_every=1", "--config.checkpoint.every=0",
            *(f"--config.model.{k}={v}" for k, v in narrow.items())]  # fmt: skip
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
