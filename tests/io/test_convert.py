"""gpt_oss_train.tools.convert_checkpoint end to end, as a user runs it (a subprocess per
command)."""

import os
import subprocess
import sys

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from gpt_oss_train.checkpoints import checkpoint

pytestmark = pytest.mark.full  # checkpoint conversion round trips


def run_tool(*args):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run(
        [sys.executable, "-m", "gpt_oss_train.tools.convert_checkpoint", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def all_tensors(folder):
    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(folder, name), "np") as f:
                for k in f.keys():
                    out[k] = f.get_tensor(k)
    return out


def folder_bytes(folder):
    """Every file under `folder` -> its bytes: what "left untouched" must preserve."""
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, folder)] = f.read()
    return out


def test_hf_to_orbax_to_hf_is_bit_exact(tmp_path, random_hf_model):
    hf_in, orbax, hf_out = tmp_path / "hf", tmp_path / "orbax", tmp_path / "hf_out"
    random_hf_model(seed=3).save_pretrained(hf_in)
    r = run_tool(f"--hf_dir={hf_in}", f"--output_dir={orbax}")
    assert r.returncode == 0, r.stderr[-2000:]
    assert checkpoint.read_model_config(str(orbax))["num_layers"] == 4
    r = run_tool(f"--orbax_dir={orbax}", f"--hf_out={hf_out}", "--dtype=float32")
    assert r.returncode == 0, r.stderr[-2000:]
    a, b = all_tensors(hf_in), all_tensors(hf_out)
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype == np.float32, k
        assert a[k].shape == b[k].shape, k
        assert a[k].tobytes() == b[k].tobytes(), f"{k} differs"


def test_converter_refuses_to_overwrite(tmp_path, random_hf_model):
    hf_in, orbax = tmp_path / "hf", tmp_path / "orbax"
    random_hf_model(seed=4).save_pretrained(hf_in)
    assert run_tool(f"--hf_dir={hf_in}", f"--output_dir={orbax}").returncode == 0
    orbax_before, hf_before = folder_bytes(orbax), folder_bytes(hf_in)
    r = run_tool(f"--hf_dir={hf_in}", f"--output_dir={orbax}")
    assert r.returncode != 0 and "already holds a checkpoint" in r.stderr
    assert folder_bytes(orbax) == orbax_before
    r = run_tool(f"--orbax_dir={orbax}", f"--hf_out={hf_in}")
    assert r.returncode != 0 and "not empty" in r.stderr
    assert folder_bytes(hf_in) == hf_before


def test_converter_names_the_missing_tensor(tmp_path, random_hf_model):
    hf_in = tmp_path / "hf"
    random_hf_model(seed=5).save_pretrained(hf_in)
    f = hf_in / "model.safetensors"
    tensors = all_tensors(hf_in)
    del tensors["model.layers.1.self_attn.sinks"]
    save_file(tensors, str(f), metadata={"format": "pt"})
    r = run_tool(f"--hf_dir={hf_in}", f"--output_dir={tmp_path / 'out'}")
    assert r.returncode != 0 and "model.layers.1.self_attn.sinks" in r.stderr
