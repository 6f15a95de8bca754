"""gpt_oss_train.tools.aot_compile (over gpt_oss_train.aot): the real train step compiled for
a TPU slice on this CPU machine.

Needs libtpu (the `tpu` extra), which CI does not install: skipped without it.
"""

import json
import os
import subprocess
import sys

import pytest
from support import ROOT

pytestmark = [
    pytest.mark.full,  # ahead-of-time compiles for TPU topologies
    pytest.mark.tpu,  # libtpu's compiler
]

pytest.importorskip("libtpu", reason="libtpu not installed (pip install -e '.[tpu]')")


# A tiny model with the TPU config's sharding and MoE path, on a 2x2 v5e slice (4 chips:
# fsdp 2 x expert 2). XLA attention: aot_compile compiles whatever the config
# names, and the tiny shapes are what keeps this test at ~20 s.
TINY = [
    "--config.model.num_layers=2",
    "--config.model.hidden_size=64",
    "--config.model.num_heads=4",
    "--config.model.num_kv_heads=2",
    "--config.model.head_dim=16",
    "--config.model.num_experts=4",
    "--config.model.intermediate_size=64",
    "--config.model.vocab_size=1024",
    "--config.mesh.expert=2",
    "--config.train.global_batch_size=4",
    "--config.train.seq_len=128",
    "--config.kernels.attention=xla",
]


def _run(tmp_path, *extra, topology="v5e:2x2"):
    out = tmp_path / "aot.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpt_oss_train.tools.aot_compile",
            "--config=configs/tpu_v5e.py",
            f"--topology={topology}",
            f"--json={out}",
            *TINY,
            *extra,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    result = json.loads(out.read_text()) if out.exists() else None
    return proc, result


def test_compiles_for_a_tpu_slice_and_reports_memory(tmp_path):
    # A 10 MiB budget: the tiny step needs more (its code alone is ~16 MiB), so this one
    # compile checks both the figures and the "does not fit" exit.
    proc, r = _run(tmp_path, "--hbm_gib=0.01", "--top_buffers=5")
    assert r is not None, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert r["devices"] == 4 and r["device_kind"] == "TPU v5 lite", r
    assert r["mesh"] == {"data": 1, "fsdp": 2, "context": 1, "tensor": 1, "expert": 2}, r
    assert r["error"] is None, r["error"]
    # (No temp_bytes check: libtpu 0.0.42.1 keeps this tiny step's temporaries on chip,
    # in VMEM, so its HBM temporaries are 0.)
    for key in ("arguments_bytes", "outputs_bytes", "total_bytes"):
        assert r[key] > 0, (key, r)
    # The state is donated: the new state is written over the old one.
    assert r["aliased_bytes"] > 0.9 * r["outputs_bytes"], r
    # XLA's argument bytes are the shards of the state and the batch, summed here from the
    # shapes and shardings: five int32 [4, 128] arrays over 4 batch shards, the step count.
    batch_bytes = 5 * (4 // 4) * 128 * 4
    expected = r["state_bytes_per_device"] + batch_bytes + 4
    # TPU layouts pad small minor dims to whole tiles (libtpu 0.0.42.1: 1.6x here), so
    # the exact sum is a lower bound.
    assert expected <= r["arguments_bytes"] <= 4 * expected, r
    # Compiled FLOPs count remat, masked attention and the routing work the model estimate
    # leaves out, but they are of the same order.
    assert 0.5 < r["compiled_flops_per_device"] / r["model_flops_per_device"] < 20, r
    assert r["top_buffers"], r
    assert r["fits"] is False and proc.returncode == 1, proc.stdout[-2000:]
    assert "does not fit" in proc.stdout, proc.stdout[-2000:]
    # The step model read the TPU program: its loops' trip counts (2 layers in one scanned
    # block of 2 here), the FSDP collectives over the fsdp axis, an estimate on the chip.
    m = r["step_model"]
    assert m["flops"] >= 0.5 * r["model_flops_per_device"], m
    assert m["hbm_bytes"] > r["arguments_bytes"], m
    assert "all-gather" in m["collectives_by_kind"], m
    assert any("fsdp" in axes for axes in m["collectives_by_axes"]), m
    assert r["estimate"]["step_s"] > 0 and 0 < r["estimate"]["mfu"] < 1, r["estimate"]
    assert "step model" in proc.stdout and "estimate" in proc.stdout, proc.stdout[-2000:]


def test_multi_slice_mesh_splits_physical_axes():
    # fsdp=8 x expert=2 on a 4x4 slice needs a physical axis split (8 = 4 x 2); the data
    # axis must run across the two slices, so only gradients cross the slow links.
    code = """
from gpt_oss_train import sharding
from gpt_oss_train.aot import tpu
devices = tpu.devices("v5e:4x4", num_slices=2)
mesh = sharding.make_mesh(dict(data=1, fsdp=8, tensor=1, expert=2),
                          dict(data=2, fsdp=1, tensor=1, expert=1), devices=devices)
print(dict(mesh.shape))
print(sorted({d.slice_index for d in mesh.devices[0].flat}),
      sorted({d.slice_index for d in mesh.devices[1].flat}))
"""
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    shape, slices = proc.stdout.strip().splitlines()[-2:]
    assert shape == "{'data': 2, 'fsdp': 8, 'context': 1, 'tensor': 1, 'expert': 2}", proc.stdout
    assert slices == "[0] [1]", proc.stdout


def test_lora_step_takes_the_frozen_base_as_an_argument(tmp_path):
    # QLoRA: the MXFP4 base is an argument of the compiled step with its shardings, so
    # XLA's argument bytes are the adapters' state + the base's shards + the batch.
    proc, r = _run(tmp_path, "--config.lora.rank=4", "--config.lora.base_format=mxfp4")
    assert r is not None, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert r["error"] is None and r["frozen_format"] == "mxfp4", r
    batch_bytes = 5 * (4 // 4) * 128 * 4
    expected = r["state_bytes_per_device"] + r["frozen_bytes_per_device"] + batch_bytes + 4
    assert expected <= r["arguments_bytes"] <= 4 * expected, r  # tile padding: 2.4x here
    assert r["frozen_bytes_per_device"] > 2 * r["state_bytes_per_device"], r
    assert any("frozen/" in row and "blocks" in row for row in r["top_arguments"]), r
    assert "frozen base" in proc.stdout, proc.stdout[-2000:]


def test_experts_take_a_ragged_all_to_all_where_libtpu_compiles_one(tmp_path):
    """The expert_parallel op's TPU default sends each (token, choice) pair only to its
    expert's shard: a ragged all-to-all on v5p; libtpu refuses one on v5e, where the
    tokens are gathered instead."""
    kinds = {}
    for topology in ("v5p:2x2x1", "v5e:2x2"):
        proc, r = _run(tmp_path, topology=topology)
        assert r is not None and r["error"] is None, proc.stdout[-3000:] + proc.stderr[-3000:]
        kinds[topology] = r["step_model"]["collectives_by_kind"]
    assert kinds["v5p:2x2x1"]["ragged-all-to-all"]["runs"] >= 4, kinds  # 2 layers, in and out
    assert "ragged-all-to-all" not in kinds["v5e:2x2"], kinds


def test_engine_decode_compiles_with_its_cache_donated(tmp_path):
    # The serving engine's decode step over 4 slots of 128 positions with MXFP4 experts:
    # the cache is an argument updated in place, the weights are in the asked form.
    proc, r = _run(tmp_path, "--program=decode", "--weights=mxfp4", "--slots=4", "--context=128")
    assert r is not None and r["error"] is None, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert r["program"] == "decode" and r["weights"] == "mxfp4", r
    assert r["shape"] == {"slots": 4, "context": 128, "chunk": 128, "int8_kv_cache": False}, r
    # Keys and values of 2 layers (one full: 128 slots; one banded: a ring of the 128-token
    # chunk), 4 rows over the 4 chips (fsdp 2 x expert 2), 2 KV heads of 16, bfloat16.
    kv = 2 * 2 * (4 // 4) * 128 * 2 * 16 * 2
    assert kv <= r["kv_cache_bytes_per_device"] <= 2 * kv, r  # + each slot's position ids
    assert r["aliased_bytes"] >= r["kv_cache_bytes_per_device"], r  # donated, written in place
    assert r["arguments_bytes"] >= r["weights_bytes_per_device"] + r["kv_cache_bytes_per_device"]
    # One token a row: the model estimate is 4 tokens' forward at 128 keys, over 4 chips.
    assert r["tokens_per_step"] == 4, r
    assert r["estimate"]["step_s"] > 0, r["estimate"]
    assert "decode step of 4 rows" in proc.stdout and "tokens/s for the slice" in proc.stdout


def test_grpo_program_adds_up_both_phases(tmp_path):
    # A LoRA GRPO step: the learner's train step and the rollout engine's decode and
    # prefill on the base + adapters, and what each phase holds at once.
    proc, r = _run(
        tmp_path,
        "--program=grpo",
        "--config.train.objective=grpo",
        "--config.lora.rank=4",
        "--config.rl.group_size=2",
        "--config.rl.max_prompt_tokens=64",
        "--config.rl.max_new_tokens=64",
    )
    assert r is not None, proc.stdout[-3000:] + proc.stderr[-3000:]
    learner, decode, prefill, p = r["learner"], r["decode"], r["prefill"], r["phases"]
    assert all(x["error"] is None for x in (learner, decode, prefill)), r
    assert decode["shape"]["slots"] == 4 and decode["shape"]["context"] == 128, decode
    assert decode["weights"] == learner["frozen_format"] == "param_dtype", decode
    assert p["learning"] == learner["total_bytes"] + decode["kv_cache_bytes_per_device"], p
    assert p["rollout"] == max(decode["total_bytes"], prefill["total_bytes"]) + p["beside_engine"]
    assert p["beside_engine"] > 0, p  # the adapters' Adam moments stay while the engine runs
    e = r["rollout_estimate"]
    # 4 rows x one 64-token chunk each, then 64 decode steps, then the learner's step
    assert e["prefill_s"] == pytest.approx(4 * prefill["estimate"]["step_s"]), e
    assert e["decode_s"] == pytest.approx(64 * decode["estimate"]["step_s"]), e
    assert e["grpo_step_s"] == pytest.approx(e["rollout_s"] + learner["estimate"]["step_s"]), e
    assert "GRPO step:" in proc.stdout and "learning" in proc.stdout, proc.stdout[-2000:]
