"""Decoding with LoRA adapters beside the base (never merged): the CLI's --adapter equals
the merged export, several adapters serve the rows that name them in one batch, and an
adapter that does not fit is a one-line error."""

import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file
from support import ROOT

from gpt_oss_train import config as config_lib
from gpt_oss_train.decode import requests
from gpt_oss_train.inference import loading
from gpt_oss_train.io import hf, lora_export
from gpt_oss_train.io import peft as peft_io
from gpt_oss_train.model import lora
from gpt_oss_train.model.transformer import ModelDef

pytestmark = pytest.mark.full  # decoding with trained adapters: tens of seconds

PROMPTS = [[5, 6, 7, 8, 9, 10], [101, 102], [3, 1, 4, 1, 5, 9, 2, 6]]


@pytest.fixture(scope="module")
def folders(random_hf_model, tmp_path_factory):
    """A random tiny HF base and two PEFT adapters with different ranks and targets."""
    root = tmp_path_factory.mktemp("lora_decode")
    random_hf_model(seed=1, intermediate_size=32).save_pretrained(str(root / "base"))
    arch = hf.HFCheckpoint(str(root / "base")).model_config
    for i, (targets, rank) in enumerate([(("q", "v", "gate_up", "down"), 4), (("o", "router"), 2)]):
        spec = lora.LoraSpec(rank, 2.0 * rank, targets)
        cfg = config_lib.ModelConfig(**arch).replace(lora=spec)
        shapes = lora.split(ModelDef(cfg).abstract_params())[1]
        rng = np.random.RandomState(i)
        tree = jax.tree.map(lambda a: 0.3 * rng.standard_normal(a.shape).astype(np.float32), shapes)
        peft_io.save_peft(str(root / f"ad{i}"), spec, tree, arch["num_layers"])
    return root, arch


def runtime():
    c = loading.default_runtime_config()
    c.dtype = "float32"
    return c


def generate(model, lines):
    data = "\n".join(json.dumps(line) for line in lines).encode()
    opts = loading.Options(max_new_tokens=8, batch_size=4, prefill_chunk=16)
    return requests.run_generate(model, data, opts)


def test_decode_cli_with_adapter_equals_the_merged_export(folders, tmp_path):
    root, arch = folders
    adapter = peft_io.load_peft(str(root / "ad0"), arch)
    merged = str(tmp_path / "merged")
    ckpt = hf.HFCheckpoint(str(root / "base"))
    lora_export.save_merged(merged, arch, *adapter, ckpt.read, dtype="float32")
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"tokens": p}) + "\n" for p in PROMPTS))
    outs = {}
    for name, extra in (("adapter", [f"--adapter={root / 'ad0'}"]), ("merged", [])):
        base = merged if name == "merged" else str(root / "base")
        cmd = [
            sys.executable,
            "-m",
            "gpt_oss_train.decode",
            f"--checkpoint={base}",
            *extra,
            f"--input={inp}",
            f"--output={tmp_path / name}.jsonl",
            "--max_new_tokens=8",
            "--dtype=float32",
            "--config.mesh.fsdp=1",
            "--prefill_chunk=16",
        ]
        env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="", PYTHONPATH=ROOT)
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
        outs[name] = [json.loads(line) for line in open(tmp_path / f"{name}.jsonl")]
    base_model = loading.load_model(str(root / "base"), runtime())
    plain = generate(base_model, [{"tokens": p} for p in PROMPTS])
    for a, m, p in zip(outs["adapter"], outs["merged"], plain):
        assert a["tokens"] == m["tokens"]
        np.testing.assert_allclose(a["logprobs"], m["logprobs"], atol=1e-4)
    assert any(a["tokens"] != p["tokens"] for a, p in zip(outs["adapter"], plain))


def test_several_adapters_each_row_gets_the_one_it_names(folders):
    root, _ = folders
    rt = runtime()
    both = loading.load_model(
        str(root / "base"), rt, adapters=[("a", str(root / "ad0")), ("b", str(root / "ad1"))]
    )
    assert both.adapters == ("a", "b") and both.cfg.lora.adapters == 3
    lines = [
        {"tokens": PROMPTS[0], "adapter": "a"},
        {"tokens": PROMPTS[1]},
        {"tokens": PROMPTS[2], "adapter": "b"},
        {"tokens": PROMPTS[0], "adapter": "b"},
        {"tokens": PROMPTS[1], "adapter": "nope"},
    ]
    got = generate(both, lines)
    assert got[4]["error"].startswith("line 5: \"adapter\": 'nope' is not loaded")
    alone = {
        name: generate(
            loading.load_model(str(root / "base"), rt, adapters=[("", str(root / d))] if d else []),
            [{"tokens": p} for p in PROMPTS],
        )
        for name, d in (("a", "ad0"), ("b", "ad1"), (None, ""))
    }
    for line, out in zip(lines[:4], got[:4]):
        want = alone[line.get("adapter")][PROMPTS.index(line["tokens"])]
        assert out["tokens"] == want["tokens"], line
        np.testing.assert_allclose(out["logprobs"], want["logprobs"], atol=1e-4)
    assert alone["a"][0]["tokens"] != alone[None][0]["tokens"] != alone["b"][0]["tokens"]


def _broken_copy(root, tmp_path, edit, arch):
    bad = tmp_path / "bad"
    shutil.copytree(root / "ad0", bad)
    cfg = json.loads((bad / "adapter_config.json").read_text())
    edit(cfg, bad, arch)
    (bad / "adapter_config.json").write_text(json.dumps(cfg))
    return str(bad)


def _other_base_adapter(cfg, folder, arch):
    """Replace the tensors by those of an adapter for a model of hidden size 32."""
    spec = peft_io.read_spec(str(folder))
    arch = {**arch, "hidden_size": 32}
    cfg = config_lib.ModelConfig(**arch).replace(lora=spec)
    shapes = lora.split(ModelDef(cfg).abstract_params())[1]
    tree = jax.tree.map(lambda a: np.zeros(a.shape, np.float32), shapes)
    save_file(
        peft_io.to_peft_tensors(spec, tree, arch["num_layers"]),
        str(folder / peft_io.WEIGHTS_FILE),
    )


BAD_ADAPTERS = [
    # rank: the config says 8, the tensors are rank 4
    (
        lambda c, f, a: c.update(r=8),
        r"lora_A.weight has shape \[4, 64\], but rank 8 on this base needs \[8, 64\]",
    ),
    # targets: the tensors hold more than the config names
    (lambda c, f, a: c.update(target_modules=["q_proj"]), r"tensor '.*' is not one a 4-layer"),
    (lambda c, f, a: c.update(target_modules=["lm_head"]), r"names 'lm_head', which gpt-oss LoRA"),
    (lambda c, f, a: c.update(use_dora=True), r"use_dora=True is not supported"),
    # base: an adapter for hidden size 32 on a base of 64
    (_other_base_adapter, r"has shape \[4, 32\], but rank 4 on this base needs \[4, 64\]"),
]


@pytest.mark.parametrize("edit,match", BAD_ADAPTERS)
def test_adapters_that_do_not_fit_are_one_line_errors(folders, tmp_path, edit, match):
    root, arch = folders
    bad = _broken_copy(root, tmp_path, edit, arch)
    with pytest.raises(peft_io.AdapterError, match=match) as e:
        loading.load_model(str(root / "base"), runtime(), adapters=[("", bad)])
    assert "\n" not in str(e.value)
    if edit is _other_base_adapter:  # the CLI: exit 2, one line, before any compile
        inp = tmp_path / "in.jsonl"
        inp.write_text(json.dumps({"tokens": [1, 2]}) + "\n")
        cmd = [
            sys.executable,
            "-m",
            "gpt_oss_train.decode",
            f"--checkpoint={root / 'base'}",
            f"--adapter={bad}",
            f"--input={inp}",
            "--config.mesh.fsdp=1",
        ]
        env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="", PYTHONPATH=ROOT)
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        assert done.returncode == 2
        assert done.stderr.strip().splitlines()[-1].startswith("error: "), done.stderr[-1000:]
