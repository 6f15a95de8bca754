"""inference/loading.py's "model loaded" line: what THIS process read or holds of the model.

One process with 8 devices holds every shard, so it reads (HF) or holds (Orbax) the whole
model once; two processes reading about half each is tests/e2e/test_multihost.py's (full tier).
"""

import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gpt_oss_train.arrays import mxfp4_array
from gpt_oss_train.checkpoints import checkpoint
from gpt_oss_train.inference import loading, scoring
from gpt_oss_train.io import hf

LINE = re.compile(
    r"Loaded (\w+) model (\S+) in [\d.]+ s: this process (read|holds) ([\d.]+ \w+) of "
    r"([\d.]+ \w+) \(its devices' shards\)(?:; TensorStore read ([\d.]+) (\w+))?$"
)
UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def loaded_line(caplog, path, **kw):
    """The model and the one 'Loaded' line load_model logged for it."""
    with caplog.at_level(logging.INFO, logger="absl"):
        model = loading.load_model(path, dtype="float32", **kw)
    lines = [m for r in caplog.records if (m := LINE.search(r.getMessage()))]
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]
    return model, lines[0]


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory, random_hf_model):
    path = tmp_path_factory.mktemp("loading") / "hf"
    random_hf_model(seed=1).save_pretrained(path)
    return str(path)


def test_hf_line_says_the_whole_file_was_read_once(caplog, hf_folder):
    model, m = loaded_line(caplog, hf_folder)
    assert m.group(1, 2, 3) == ("hf", hf_folder, "read")
    assert m.group(4) == m.group(5)  # 8 devices, all this process's: the file once
    assert dict(model.mesh.shape)["fsdp"] == 8  # ... though FSDP shards it over 8
    float32_bytes = sum(a.nbytes for a in jax.tree.leaves(model.params))
    n, unit = m.group(5).split()
    assert float(n) * UNITS[unit] == pytest.approx(float32_bytes, rel=0.01)  # float32 file


def test_orbax_line_says_what_is_held_and_what_tensorstore_read(caplog, hf_folder, tmp_path):
    model, _ = loaded_line(caplog, hf_folder)
    orbax = str(tmp_path / "orbax")
    arch = loading.read_architecture(hf_folder, "hf")
    checkpoint.save_params_only(orbax, model.params, arch)
    caplog.clear()
    _, m = loaded_line(caplog, orbax)
    assert m.group(1, 3) == ("orbax", "holds")
    assert m.group(4) == m.group(5)
    read = float(m.group(6)) * UNITS[m.group(7)]
    n, unit = m.group(5).split()
    # zstd does not shrink random floats much, and each chunk (one device's shard) once
    assert 0.5 * float(n) * UNITS[unit] < read < 1.5 * float(n) * UNITS[unit]


def test_weights_kept_mxfp4_give_the_dequantized_checkpoints_numbers(hf_folder, tmp_path):
    """--weights=mxfp4 reads an MXFP4 checkpoint's experts as blocks and scales and keeps
    them so (a quarter of bfloat16's bytes); decoded inside the layers they give the
    numbers of the same checkpoint read dense (dequantized on the host by the codec),
    the other matrices bfloat16 in both (what the mxfp4 form keeps them in; MXFP4 values
    are exact in bfloat16)."""
    dense = loading.load_model(hf_folder, dtype="float32")
    mx_dir = str(tmp_path / "mxfp4")
    arch = hf.HFCheckpoint(hf_folder).model_config
    hf.save_hf(
        mx_dir,
        arch,
        jax.device_get(dense.params),
        dtype="float32",
        mxfp4=True,
        with_tokenizer=False,
    )
    unpacked = loading.load_model(mx_dir, dtype="float32", weights="bfloat16")
    packed = loading.load_model(mx_dir, dtype="float32", weights="mxfp4")
    is_packed = lambda x: isinstance(x, mxfp4_array.MXFP4Array)
    kinds = {type(x) for x in jax.tree.leaves(packed.params, is_leaf=is_packed)}
    assert mxfp4_array.MXFP4Array in kinds, kinds
    assert all(a.dtype != jnp.uint8 for a in jax.tree.leaves(unpacked.params))
    ids = tuple(int(t) for t in np.random.default_rng(0).integers(0, 300, 40))
    got = {}
    for name, model in (("unpacked", unpacked), ("packed", packed)):
        fn = scoring.job(model, "score")
        got[name] = scoring.score_batch(model, fn, [ids], rows=1)[0]
    np.testing.assert_allclose(got["packed"], got["unpacked"], rtol=1e-5, atol=1e-5)
    assert np.all(np.isfinite(got["packed"])) and got["packed"].mean() < -1
