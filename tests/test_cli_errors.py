"""Every mistake a user can make on the train command line or in its data is reported by the
real CLI in one line naming the thing, with exit status 2, before any work: no traceback,
and no workdir (so no empty checkpoints/) left behind. The cases run as subprocesses, a
few at a time, and each parametrized test checks one of them."""

import concurrent.futures
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _data(folder):
    """The broken data files the cases point at; returns {name: path}."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (folder / "empty").mkdir()
    (folder / "empty" / "a.txt").write_text("")
    (folder / "bad.jsonl").write_text('{"text": "fine"}\n{"text": \n')
    (folder / "control.jsonl").write_text('{"text": "a\tb"}\n')  # a raw tab inside a string
    chat = [{"role": "human", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    (folder / "role.jsonl").write_text(json.dumps({"messages": chat}) + "\n")
    pq.write_table(pa.table({"body": ["a", "b"]}), folder / "no_text.parquet")
    return {p.name: str(p) for p in folder.iterdir()}


# name -> (command-line overrides, fragment of the one line); {name} is a data file.
GRPO = ["--config.train.objective=grpo", "--config.data.source=chat:data/sample_prompts.jsonl",
        "--config.train.seq_len=128", "--config.rl.max_prompt_tokens=96",
        "--config.rl.max_new_tokens=32"]  # fmt: skip
CASES = {
    "unknown field": (
        ["--config.train.stepz=3"],
        "--config.train.stepz=3: no config field 'stepz'",
    ),
    "mistyped value": (["--config.train.steps=ten"], "--config.train.steps=ten"),
    "seq_len 0": (["--config.train.seq_len=0"], "config.train.seq_len: must be > 1"),
    "negative learning rate": (["--config.train.learning_rate=-1"], "config.train.learning_rate"),
    "batch not divisible": (
        ["--config.train.global_batch_size=3"],  # on 2 devices
        "config.train.global_batch_size=3 must be a multiple of 2",
    ),
    "mesh vs devices": (["--config.mesh.fsdp=3"], "config.mesh"),
    "heads vs kv heads": (["--config.model.num_kv_heads=3"], "not divisible by num_kv_heads=3"),
    "non-finite limit": (["--config.train.max_nonfinite_steps=0"], "max_nonfinite_steps"),
    "negative capacity": (["--config.moe_capacity_factor=-1.0"], "config.moe_capacity_factor"),
    "unknown kernel": (
        ["--config.kernels.attention=nope"],
        "config.kernels.attention: 'nope' is not one of ('auto', 'xla', 'blockwise'",
    ),
    "kernel of another platform": (
        ["--config.kernels.attention=splash"],
        "config.kernels.attention='splash' runs on ['tpu'], not on this program's cpu",
    ),
    "missing file": (["--config.data.source={nope.txt}"], "no such file or directory"),
    "empty corpus": (["--config.data.source={empty}"], "the corpus is empty"),
    "malformed JSONL line": (
        ["--config.data.source={bad.jsonl}"],
        "bad.jsonl:2: not valid JSON (Expecting value at column 1)",
    ),
    "control character": (
        ["--config.data.source={control.jsonl}"],
        "control.jsonl:1: not valid JSON (Invalid control character at column 12)",
    ),
    "unknown chat role": (["--config.data.source={role.jsonl}"], "unknown role 'human'"),
    "parquet without text": (["--config.data.source={no_text.parquet}"], "no 'text' column"),
    "glob matching nothing": (["--config.data.source={empty}/*.jsonl"], "matches no files"),
    # GRPO: before the first rollout
    "grpo reward not found": (
        [*GRPO, "--config.rl.rewards=no_such_module:fn"],
        "config.rl.rewards",
    ),
    "grpo prompt too long": (
        [
            *GRPO,
            "--config.rl.rewards=whitespace",
            "--config.rl.max_prompt_tokens=20",
            "--config.rl.max_new_tokens=108",
        ],
        "the prompt is",
    ),  # fmt: skip
}


def _run(case, workdir, files):
    overrides, _ = CASES[case]
    files = dict(files, **{"nope.txt": os.path.join(os.path.dirname(workdir), "nope.txt")})
    args = []
    for o in overrides:
        for name, path in files.items():
            o = o.replace("{" + name + "}", path)
        args.append(o)
    env = dict(
        os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2"
    )
    cmd = [sys.executable, "-m", "gpt_oss_train.train", "--config=configs/cpu_tiny.py",
           f"--workdir={workdir}", "--config.train.eval_every=0", *args]  # fmt: skip
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every case's (workdir, CompletedProcess), run 3 at a time (most of each is
    importing JAX)."""
    files = _data(tmp_path_factory.mktemp("data"))
    root = tmp_path_factory.mktemp("runs")
    workdirs = {case: str(root / f"run{i}") for i, case in enumerate(CASES)}
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = {c: pool.submit(_run, c, workdirs[c], files) for c in CASES}
        return {c: (workdirs[c], f.result()) for c, f in futures.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_train_cli_reports_a_user_error_in_one_line(case, results):
    workdir, r = results[case]
    assert r.returncode == 2, r.stderr[-3000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr[-3000:]
    assert CASES[case][1] in lines[0]
    assert " at at " not in lines[0]
    assert not os.path.exists(workdir), os.listdir(workdir)  # nothing left behind


SHIPPED = [(name, None) for name in sorted(os.listdir(os.path.join(ROOT, "configs")))] + [
    ("tpu_v5e_lora.py", "gpt-oss-120b"), ("tpu_v5p.py", "gpt-oss-20b"),
    ("tpu_v6e.py", "gpt-oss-120b"), ("tpu_v5e.py", "gpt-oss-120b"),
    ("tpu_grpo.py", "v5e"), ("tpu_v5e_serve.py", "gpt-oss-20b"),
]  # fmt: skip


@pytest.mark.parametrize("name,arg", SHIPPED)
def test_every_shipped_config_passes_validation(name, arg):
    from gpt_oss_train import config as config_lib

    c = config_lib.from_file(os.path.join(ROOT, "configs", name), arg)
    config_lib.validate(c)
