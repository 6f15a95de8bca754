"""Logit parity with Hugging Face `transformers.GptOssForCausalLM` (float32, eager
attention), through our safetensors loader: a random tiny model saved by transformers is
read by `hf.load_sharded` (onto a sharded mesh) and run scanned and unscanned; a
checkpoint whose experts are MXFP4 is read by our dequantizer and compared with HF's own.

Tolerance 1e-5 on logits of magnitude ~1-3: float32 has 2^-24 ≈ 6e-8 relative
precision; the two implementations sum in different orders over 4 layers of width 64, and
the measured differences stay below 1e-6, so a 10x regression fails while a wrong window
or RoPE pairing (which moves logits by > 1e-2) fails by far.
"""

import math

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors import safe_open

from gpt_oss_train import config as config_lib
from gpt_oss_train import sharding
from gpt_oss_train.io import hf
from gpt_oss_train.model.transformer import ModelDef

BOUND = 1e-5


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, random_hf_model):
    d = tmp_path_factory.mktemp("hf_tiny")
    random_hf_model().save_pretrained(d)
    return d


def tokens(batch=3, length=40, vocab=300, seed=0):
    # 40 > the tiny config's window of 8: banded layers really drop keys
    return np.random.RandomState(seed).randint(0, vocab, (batch, length))


def hf_logits(model, toks):
    with torch.no_grad():
        return model(torch.tensor(toks)).logits.numpy()


def our_logits(path, toks, mesh_sizes, positions=None, **overrides):
    arch = hf.HFCheckpoint(path).model_config
    c = config_lib.default_config()
    c.dtype = "float32"
    mc = config_lib.ModelConfig.from_config(c, arch).replace(**overrides)
    md = ModelDef(mc)

    n = math.prod(mesh_sizes.values()) if -1 not in mesh_sizes.values() else jax.device_count()
    mesh = sharding.make_mesh(mesh_sizes, devices=jax.devices()[:n])
    rules = config_lib.DEFAULT_RULES
    params = hf.load_sharded(path, md.abstract_params(mesh, rules))
    with sharding.use_mesh(mesh, rules):

        @jax.jit
        def f(p, t, pos):
            m = md.bind(p)
            h, _, _ = m(t, positions=pos)
            return m.logits(h)

        return np.asarray(f(params, toks, positions))


@pytest.mark.parametrize("scan", [True, False])
def test_logits_match_transformers(hf_dir, scan):
    toks = tokens()
    ref = hf_logits(transformers.GptOssForCausalLM.from_pretrained(hf_dir).eval(), toks)
    mesh = (
        dict(data=1, fsdp=2, tensor=2, expert=2)
        if scan
        else dict(data=1, fsdp=1, tensor=1, expert=1)
    )
    got = our_logits(hf_dir, toks, mesh, scan_layers=scan, moe_impl="ragged")
    assert np.abs(got - ref).max() <= BOUND
    # the comparison is not vacuous: the logits vary and a shifted window would be caught
    assert np.abs(ref).max() > 0.5


def test_mxfp4_checkpoint_matches_transformers_dequantized(hf_dir, tmp_path, read_hf_tree):
    """Experts quantized to MXFP4 by us and written in the published layout
    (*_blocks/*_scales + quantization_config); HF dequantizes with its own code."""
    arch, params = read_hf_tree(hf_dir)
    mx_dir = tmp_path / "mxfp4"
    hf.save_hf(mx_dir, arch, params, dtype="float32", mxfp4=True)
    cfg = __import__("json").load(open(mx_dir / "config.json"))
    assert cfg["quantization_config"]["quant_method"] == "mxfp4"
    names = set()
    for f in mx_dir.glob("*.safetensors"):
        with safe_open(str(f), "np") as h:
            names |= set(h.keys())
    assert "model.layers.0.mlp.experts.gate_up_proj_blocks" in names
    assert "model.layers.0.mlp.experts.gate_up_proj" not in names

    ref_model = transformers.GptOssForCausalLM.from_pretrained(
        mx_dir, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32
    ).eval()
    toks = tokens(seed=1)
    ref = hf_logits(ref_model, toks)
    got = our_logits(mx_dir, toks, dict(data=1, fsdp=1, tensor=1, expert=-1))
    assert np.abs(got - ref).max() <= BOUND
    # quantization really changed the model (else this test would prove nothing)
    dense = hf_logits(transformers.GptOssForCausalLM.from_pretrained(hf_dir).eval(), toks)
    assert np.abs(dense - ref).max() > 1e-3


@pytest.mark.parametrize("start", [40_000, 131_032])
def test_logits_match_transformers_far_into_the_context(tmp_path, random_hf_model, start):
    """YaRN's long positions (factor 32 over 4,096: 131,072 in all), past 32,768 and up to
    the last one: 40 tokens placed at `start` by their position ids, against transformers
    given the same position ids (the window and causal masks depend on distances only).

    Where attention is sharp, float32 angles this far out differ by ~1e-3 rad between any
    two implementations whose frequencies differ in the last bit (ours are rounded from
    float64, transformers' computed in float32): scaling q and k 3x here moves the logits
    ~1.6e-4 apart at 40,000. The random model's gentle attention keeps that below BOUND,
    while RoPE still moves its logits by several BOUNDs (the last assert)."""
    random_hf_model(seed=4, max_position_embeddings=131_072).save_pretrained(tmp_path)
    toks = tokens(batch=2, seed=5)
    positions = np.broadcast_to(np.arange(start, start + toks.shape[1]), toks.shape)
    hf_model = transformers.GptOssForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        ref = hf_model(torch.tensor(toks), position_ids=torch.tensor(positions)).logits.numpy()
    near = hf_logits(hf_model, toks)  # the same tokens at 0..39: RoPE really moved them
    got = our_logits(tmp_path, toks, dict(data=1, fsdp=1, tensor=1, expert=1), positions=positions)
    assert np.abs(got - ref).max() <= BOUND
    assert np.abs(near - ref).max() > 4 * BOUND
