"""LoRA against PEFT on transformers: the exported adapter folder gives PEFT our logits
(dense and MXFP4 bases), PEFT's float64 gradients equal ours, PEFT's own adapters load
here, and a merged export equals the unmerged model."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from gpt_oss_train import config as config_lib
from gpt_oss_train import sharding
from gpt_oss_train.arrays import mxfp4_array
from gpt_oss_train.inference import adapters as adapters_lib
from gpt_oss_train.io import hf, lora_export
from gpt_oss_train.io import peft as peft_io
from gpt_oss_train.model import lora
from gpt_oss_train.model.transformer import ModelDef
from gpt_oss_train.training import lora as lora_training
from gpt_oss_train.training import objectives

pytestmark = pytest.mark.full  # PEFT's reference on transformers: over a minute

ALL = tuple(lora.TARGETS)
# hidden 64 and expert hidden 32: every A and B of the experts has its own shape, so a
# tensor given the wrong name cannot load unnoticed.
HF_SHAPE = dict(intermediate_size=32)


@pytest.fixture(scope="module")
def hf_base(random_hf_model, tmp_path_factory):
    """(transformers model, its folder, our architecture) of a random tiny gpt-oss."""
    model = random_hf_model(seed=0, **HF_SHAPE)
    folder = str(tmp_path_factory.mktemp("hf_base") / "base")
    model.save_pretrained(folder)
    model.config._experts_implementation = "eager"  # the grouped-mm kernel has no float64
    return model.double(), folder, hf.HFCheckpoint(folder).model_config


def our_config(arch, targets=ALL, rank=3, alpha=5.0, **kw):
    c = config_lib.default_config()
    c.model.update(arch)
    c.dtype, c.remat_policy, c.moe_impl = "float32", "none", "ragged"
    c.mesh.fsdp = 1
    c.lora.update(rank=rank, alpha=alpha, targets=",".join(targets))
    for k, v in kw.items():
        c[k] = v
    return c


def load_base(config, folder):
    """Our frozen base read from `folder` as a LoRA run reads it (one device)."""
    mc = config_lib.ModelConfig.from_config(config)
    mesh = sharding.make_mesh(config.mesh, devices=jax.devices()[:1])
    config.checkpoint.init_from = folder
    return mc, lora_training.FrozenBase(
        config, ModelDef(mc), mesh, config.logical_axis_rules
    ).arrays()


def random_adapters(mc, seed=1, std=0.1):
    return jax.device_get(lora.random_like(lora.split(ModelDef(mc).init(seed))[1], seed, std))


def our_logits(mc, base, adapters, toks):
    md = ModelDef(mc)

    def run(params, toks):
        model = md.bind(params)
        return model.logits(model(toks)[0])

    return np.asarray(jax.jit(run)(lora.merge(base, adapters) if adapters else base, toks))


def peft_logits(hf_model, adapter_dir, toks):
    pm = peft.PeftModel.from_pretrained(hf_model, adapter_dir).eval()
    with torch.no_grad():
        out = pm(torch.tensor(toks)).logits.double().numpy()
    pm.unload()  # leave hf_model as it was for the next test
    return out


TOKS = np.random.RandomState(0).randint(0, 300, (2, 12))


@pytest.mark.parametrize("targets", [ALL, ("q", "v"), ("o", "gate_up"), ("down", "router")])
def test_our_logits_equal_peft_on_transformers(hf_base, tmp_path, targets):
    hf_model, folder, arch = hf_base
    mc, base = load_base(our_config(arch, targets), folder)
    adapters = random_adapters(mc)
    peft_io.save_peft(str(tmp_path / "ad"), mc.lora, adapters, arch["num_layers"], folder)
    want = peft_logits(hf_model, str(tmp_path / "ad"), TOKS)
    got = our_logits(mc, base, adapters, TOKS)
    plain = our_logits(mc.replace(lora=None), base, None, TOKS)
    assert np.abs(want - plain).max() > 0.05  # the adapters change the logits
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
    cfg = json.loads((tmp_path / "ad" / "adapter_config.json").read_text())
    assert cfg["r"] == 3 and cfg["lora_alpha"] == 5.0


def test_mxfp4_base_kept_packed_equals_peft_on_its_dequantized_values(hf_base, tmp_path):
    """The base stored as published (MXFP4 experts): we keep the blocks; transformers gets
    the same values dequantized, and PEFT the exported adapter."""
    hf_model, folder, arch = hf_base
    mxfp4_dir, dequant_dir = str(tmp_path / "mxfp4"), str(tmp_path / "dequant")
    ckpt = hf.HFCheckpoint(folder)
    hf.save_hf(mxfp4_dir, arch, lambda p, layers: ckpt.read(p, layers), "float32", mxfp4=True)
    ckpt4 = hf.HFCheckpoint(mxfp4_dir)
    hf.save_hf(dequant_dir, arch, lambda p, layers: ckpt4.read(p, layers), "float32")
    config = our_config(arch)
    config.lora.base_format = "mxfp4"
    mc, base = load_base(config, mxfp4_dir)
    wi = base["blocks"]["sliding"]["moe"]["wi_gate"]
    assert isinstance(wi, mxfp4_array.MXFP4Array) and wi.blocks.dtype == jnp.uint32
    stored = ckpt4._tensor("model.layers.0.mlp.experts.gate_up_proj_blocks")
    file_form = mxfp4_array.to_file(np.asarray(wi.blocks[0]), np.asarray(wi.scales[0]))[0]
    assert np.array_equal(file_form, stored[:, 0::2])  # the file's bytes
    adapters = random_adapters(mc)
    peft_io.save_peft(str(tmp_path / "ad"), mc.lora, adapters, arch["num_layers"])
    hf_dequant = transformers.GptOssForCausalLM.from_pretrained(
        dequant_dir, experts_implementation="eager"
    )
    hf_dequant = hf_dequant.double().eval()
    want = peft_logits(hf_dequant, str(tmp_path / "ad"), TOKS)
    # our MXFP4 base computes in float32 with bf16-stored non-expert weights, as a QLoRA
    # run does; in float32 everywhere (param_dtype base) it is the 1e-4 comparison
    config.lora.base_format = "param_dtype"
    mc32, base32 = load_base(config, mxfp4_dir)
    np.testing.assert_allclose(our_logits(mc32, base32, adapters, TOKS), want, rtol=0, atol=1e-4)
    got = our_logits(mc, base, adapters, TOKS)
    assert np.abs(got - want).max() < 2e-2 * np.abs(want).max()


def test_adapter_gradients_equal_peft_float64(hf_base, tmp_path):
    """Our training loss's gradient (float32, remat, grouped-matmul experts) against
    PEFT + transformers differentiating the same loss in float64."""
    hf_model, folder, arch = hf_base
    config = our_config(arch, remat_policy="full")
    config.train.update(aux_loss_coef=0.0, z_loss_coef=0.0)
    mc, base = load_base(config, folder)
    adapters = random_adapters(mc, std=0.1)
    rng = np.random.RandomState(1)
    b, s = 2, 12
    inputs, targets = rng.randint(0, 300, (b, s)), rng.randint(0, 300, (b, s))
    batch = dict(
        inputs=inputs,
        targets=targets,
        positions=np.tile(np.arange(s), (b, 1)),
        segment_ids=np.ones((b, s)),
        loss_mask=np.ones((b, s)),
    )
    batch = {k: jnp.asarray(v, jnp.int32) for k, v in batch.items()}
    loss_fn = objectives.make_loss_fn(ModelDef(mc), config.train)
    ours = jax.jit(jax.grad(lambda a: loss_fn(a, batch, base)[0] / (b * s)))(adapters)
    ours = peft_io.to_peft_tensors(mc.lora, jax.device_get(ours), arch["num_layers"])

    peft_io.save_peft(str(tmp_path / "ad"), mc.lora, adapters, arch["num_layers"])
    pm = peft.PeftModel.from_pretrained(hf_model, str(tmp_path / "ad"), is_trainable=True)
    pm = pm.double().eval()
    logits = pm(torch.tensor(inputs)).logits
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(b * s, -1), torch.tensor(targets).reshape(-1)
    )
    loss.backward()
    # PEFT's parameter names carry the adapter name ("lora_A.default.weight"); files not
    theirs = {
        n.replace(".default", ""): p.grad.numpy()
        for n, p in pm.named_parameters()
        if p.grad is not None
    }
    pm.unload()
    assert sorted(theirs) == sorted(ours)
    for name, want in theirs.items():
        assert np.abs(want).max() > 1e-4, name
        np.testing.assert_allclose(
            ours[name], want, rtol=0, atol=2e-4 * np.abs(want).max(), err_msg=name
        )


def test_adapter_trained_by_peft_loads_here(hf_base, tmp_path):
    """An adapter PEFT made itself (its own names and layouts) gives PEFT's logits here."""
    hf_model, folder, arch = hf_base
    torch.manual_seed(3)
    config = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "o_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        init_lora_weights=False,  # random B: an adapter that does something
    )
    pm = peft.get_peft_model(hf_model, config)
    pm.save_pretrained(str(tmp_path / "theirs"))
    with torch.no_grad():
        want = pm(torch.tensor(TOKS)).logits.double().numpy()
    pm.unload()
    adapter = adapters_lib.read_adapter(str(tmp_path / "theirs"), arch)
    assert adapter.spec.targets == ("q", "o", "gate_up", "down") and adapter.spec.scale == 2.0
    mc, base = load_base(our_config(arch, adapter.spec.targets, 4, 8.0), folder)
    np.testing.assert_allclose(our_logits(mc, base, adapter.tree, TOKS), want, rtol=0, atol=1e-4)


def test_merged_export_equals_unmerged(hf_base, tmp_path):
    hf_model, folder, arch = hf_base
    mc, base = load_base(our_config(arch), folder)
    adapters = random_adapters(mc)
    ckpt = hf.HFCheckpoint(folder)
    report = lora_export.save_merged(
        str(tmp_path / "merged"), arch, mc.lora, adapters, ckpt.read, dtype="float32"
    )
    assert report == {}
    mc0, merged = load_base(our_config(arch), str(tmp_path / "merged"))
    got = our_logits(mc0.replace(lora=None), merged, None, TOKS)
    np.testing.assert_allclose(got, our_logits(mc, base, adapters, TOKS), rtol=0, atol=1e-5)
    # the merged MXFP4 export measures what re-quantization costs
    report = lora_export.save_merged(
        str(tmp_path / "merged4"), arch, mc.lora, adapters, ckpt.read, mxfp4=True
    )
    assert set(report) == {"wi_gate", "wi_up", "wo"}
    for r in report.values():
        assert 0.02 < r["rel_rms_vs_weight"] < 0.2 and r["max_abs"] > 0, r
    assert os.path.isfile(tmp_path / "merged4" / "tokenizer.json") is False  # toy vocabulary
    reloaded = transformers.GptOssForCausalLM.from_pretrained(str(tmp_path / "merged4"))
    assert reloaded.config.num_hidden_layers == arch["num_layers"]
