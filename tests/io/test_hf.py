"""Tests for gpt_oss_train.io.hf and hf_config: HF safetensors <-> our tree (MXFP4 folders
included), config mapping. The MXFP4 codec itself is tested in test_mxfp4.py.

The reference is transformers' own GptOssForCausalLM: tiny random models are written with
save_pretrained and read back with from_pretrained.
"""

import hashlib
import json
import os
import shutil
import struct

import jax
import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors import safe_open
from safetensors.numpy import save_file
from transformers import GptOssConfig, GptOssForCausalLM

from gpt_oss_train import architecture, sharding
from gpt_oss_train import config as config_lib
from gpt_oss_train.arrays import mxfp4_array
from gpt_oss_train.arrays.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from gpt_oss_train.io import hf, hf_config
from gpt_oss_train.io.hf import HFCheckpoint, save_hf
from gpt_oss_train.io.hf_config import hf_config_to_model_dict, model_dict_to_hf_config
from gpt_oss_train.model import frozen_base, lora, parameters
from gpt_oss_train.model.transformer import ModelDef

# Tiny but asymmetric: N*H (96) != D (64), 2F (192) != D, F (96) != D; D and F divisible by 32.
V, D, L, N, K, H, E, TOPK, F, W = 301, 64, 4, 4, 2, 24, 4, 2, 96, 8
ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
    "rope_theta": 150000.0,
}


def tiny_hf_config(**kw):
    args = dict(
        vocab_size=V,
        hidden_size=D,
        num_hidden_layers=L,
        num_attention_heads=N,
        num_key_value_heads=K,
        head_dim=H,
        num_local_experts=E,
        num_experts_per_tok=TOPK,
        intermediate_size=F,
        sliding_window=W,
        rope_parameters=dict(ROPE),
        max_position_embeddings=131072,
        layer_types=["sliding_attention", "full_attention"] * (L // 2),
    )
    args.update(kw)
    return GptOssConfig(**args)


def make_model(seed=0):
    torch.manual_seed(seed)
    model = GptOssForCausalLM(tiny_hf_config())
    with torch.no_grad():
        for p in model.parameters():  # biases, sinks, norms: all nonzero and distinct
            p.add_(0.05 * torch.randn_like(p))
    model.config._attn_implementation = "eager"
    return model.eval()


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    model = make_model()
    d = tmp_path_factory.mktemp("hf") / "dense"
    model.save_pretrained(d, safe_serialization=True)
    return model, str(d)


@pytest.fixture(scope="module")
def tree(hf_model, read_hf_tree):
    return read_hf_tree(hf_model[1])


def st_tensors(folder):
    """All tensors of a safetensors folder as numpy (bf16 via ml_dtypes), plus dtypes."""
    out, dtypes = {}, {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(folder, f), framework="numpy") as h:
                for k in h.keys():
                    out[k] = h.get_tensor(k)
                    dtypes[k] = h.get_slice(k).get_dtype()
    return out, dtypes


def get(tree, path):
    for k in path.split("/"):
        tree = tree[k]
    return tree


def expected_from_state_dict(sd, path):
    """The documented transform, written out independently of hf.py."""
    t = {k: v.detach().numpy() for k, v in sd.items()}
    if path == "embed/embedding":
        return t["model.embed_tokens.weight"]
    if path == "final_norm/scale":
        return t["model.norm.weight"]
    if path == "unembed/kernel":
        return t["lm_head.weight"].T
    _, kind, *rest = path.split("/")
    leaf = "/".join(rest)
    layers = [2 * i + (0 if kind == "sliding" else 1) for i in range(L // 2)]
    out = []
    for n in layers:
        p = f"model.layers.{n}."
        a = {
            "attn_norm/scale": lambda: t[p + "input_layernorm.weight"],
            "mlp_norm/scale": lambda: t[p + "post_attention_layernorm.weight"],
            "attn/q_kernel": lambda: t[p + "self_attn.q_proj.weight"].T.reshape(D, N, H),
            "attn/q_bias": lambda: t[p + "self_attn.q_proj.bias"].reshape(N, H),
            "attn/k_kernel": lambda: t[p + "self_attn.k_proj.weight"].T.reshape(D, K, H),
            "attn/k_bias": lambda: t[p + "self_attn.k_proj.bias"].reshape(K, H),
            "attn/v_kernel": lambda: t[p + "self_attn.v_proj.weight"].T.reshape(D, K, H),
            "attn/v_bias": lambda: t[p + "self_attn.v_proj.bias"].reshape(K, H),
            "attn/o_kernel": lambda: t[p + "self_attn.o_proj.weight"].T.reshape(N, H, D),
            "attn/o_bias": lambda: t[p + "self_attn.o_proj.bias"],
            "attn/sinks": lambda: t[p + "self_attn.sinks"],
            "moe/router_kernel": lambda: t[p + "mlp.router.weight"].T,
            "moe/router_bias": lambda: t[p + "mlp.router.bias"],
            "moe/wi_gate": lambda: t[p + "mlp.experts.gate_up_proj"][:, :, 0::2],
            "moe/wi_up": lambda: t[p + "mlp.experts.gate_up_proj"][:, :, 1::2],
            "moe/bi_gate": lambda: t[p + "mlp.experts.gate_up_proj_bias"][:, 0::2],
            "moe/bi_up": lambda: t[p + "mlp.experts.gate_up_proj_bias"][:, 1::2],
            "moe/wo": lambda: t[p + "mlp.experts.down_proj"],
            "moe/bo": lambda: t[p + "mlp.experts.down_proj_bias"],
        }[leaf]()
        out.append(a)
    return np.stack(out)


# ----------------------------------------------------------------------------
# 1. Reading
# ----------------------------------------------------------------------------


def test_transformers_dense_layout_on_disk(hf_model):
    """What transformers 5 actually writes: experts as [E, in, out], no renaming."""
    _, d = hf_model
    _, dtypes = st_tensors(d)
    with safe_open(os.path.join(d, "model.safetensors"), framework="numpy") as h:
        shapes = {k: tuple(h.get_slice(k).get_shape()) for k in h.keys()}
    assert shapes["model.layers.0.mlp.experts.gate_up_proj"] == (E, D, 2 * F)
    assert shapes["model.layers.0.mlp.experts.down_proj"] == (E, F, D)
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (N * H, D)
    assert shapes["model.layers.0.self_attn.o_proj.weight"] == (D, N * H)
    assert shapes["lm_head.weight"] == (V, D)
    # The reader's plan names exactly what transformers wrote.
    config = hf_config_to_model_dict(json.load(open(os.path.join(d, "config.json"))))
    assert {p.name: p.shape for p in hf.hf_tensors(config)} == shapes
    assert set(dtypes.values()) == {"F32"}


def test_read_tree_matches_state_dict(hf_model, tree):
    model, d = hf_model
    cfg, params = tree
    sd = model.state_dict()
    ckpt = HFCheckpoint(d)
    assert ckpt.model_config == cfg
    paths = ckpt.param_paths()
    assert len(paths) == 3 + 2 * 19
    for path in paths:
        got = get(params, path)
        want = expected_from_state_dict(sd, path)
        assert got.dtype == np.float32, path
        assert got.shape == ckpt.param_shape(path) == want.shape, path
        np.testing.assert_array_equal(got, want, err_msg=path)


def test_read_layer_range(hf_model, tree):
    _, d = hf_model
    _, params = tree
    ckpt = HFCheckpoint(d)
    for path in ("blocks/full/moe/wi_up", "blocks/sliding/attn/o_kernel"):
        part = ckpt.read(path, slice(1, 2))
        assert part.shape == (1, *ckpt.param_shape(path)[1:])
        np.testing.assert_array_equal(part, get(params, path)[1:2])
        np.testing.assert_array_equal(ckpt.read(path, slice(0, 1))[0], get(params, path)[0])
    with pytest.raises(ValueError, match="no layer axis"):
        ckpt.read("embed/embedding", slice(0, 1))
    with pytest.raises(KeyError, match="blocks/full/moe/nope"):
        ckpt.read("blocks/full/moe/nope")


# ----------------------------------------------------------------------------
# 2. Round trip
# ----------------------------------------------------------------------------


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def _from_pretrained(path):
    m, info = GptOssForCausalLM.from_pretrained(
        path, output_loading_info=True, attn_implementation="eager"
    )
    return m.eval(), info


def test_round_trip_float32_bit_exact_and_loads_in_transformers(hf_model, tree, tmp_path):
    model, d = hf_model
    cfg, params = tree
    out = tmp_path / "out"
    save_hf(
        out,
        cfg,
        lambda p, layers: get(params, p) if layers is None else get(params, p)[layers],
        dtype="float32",
    )
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors"]
    a, adt = st_tensors(d)
    b, bdt = st_tensors(out)
    assert set(a) == set(b)
    for k in a:
        assert adt[k] == bdt[k] == "F32", k
        assert a[k].shape == b[k].shape, k
        assert a[k].tobytes() == b[k].tobytes(), k

    new, info = _from_pretrained(str(out))
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info.get("mismatched_keys"), info
    assert new.config.layer_types == model.config.layer_types
    assert new.config.rope_parameters["factor"] == 32.0
    ids = torch.randint(0, V, (2, 3 * W))  # longer than the sliding window
    ref = _logits(model, ids)
    got = _logits(new, ids)
    assert torch.equal(ref, got)
    assert ref.abs().max() > 0


def test_round_trip_bfloat16_bit_exact(read_hf_tree, tmp_path):
    model = make_model(seed=1).to(torch.bfloat16)
    src = tmp_path / "bf16"
    model.save_pretrained(src, safe_serialization=True)
    a, adt = st_tensors(src)
    assert set(adt.values()) == {"BF16"}
    cfg, params = read_hf_tree(src)
    t = params["blocks"]["full"]["moe"]["wo"]
    assert t.dtype == np.float32
    # bf16 -> float32 is exact: the low 16 bits of every float32 are zero.
    assert not np.any(t.view(np.uint32) & 0xFFFF)
    out = tmp_path / "out"
    save_hf(out, cfg, params, dtype="bfloat16")
    b, bdt = st_tensors(out)
    assert set(a) == set(b)
    for k in a:
        assert bdt[k] == "BF16", k
        assert a[k].view(np.uint16).tobytes() == b[k].view(np.uint16).tobytes(), k
    assert json.load(open(out / "config.json"))["dtype"] == "bfloat16"


def test_raw_byte_fallback_reads_bf16(tmp_path):
    """If safetensors' numpy backend cannot make a bf16 array, the raw bytes are read."""
    model = make_model(seed=2).to(torch.bfloat16)
    src = tmp_path / "bf16"
    model.save_pretrained(src, safe_serialization=True)
    ckpt = HFCheckpoint(src)
    want = ckpt.read("blocks/full/attn/q_kernel")

    class NoBF16:
        def get_tensor(self, name):
            raise TypeError("data type 'bfloat16' not understood")

    ckpt._handles = {str(src / "model.safetensors"): NoBF16()}
    np.testing.assert_array_equal(ckpt.read("blocks/full/attn/q_kernel"), want)
    np.testing.assert_array_equal(
        ckpt.read("unembed/kernel"), model.lm_head.weight.detach().float().numpy().T
    )
    assert [type(h) for h in ckpt._handles.values()] == [NoBF16]  # the fallback was used


def test_save_hf_config_and_generation_config(tree, tmp_path):
    cfg, params = tree
    out = tmp_path / "o"
    save_hf(out, cfg, params, dtype="float32")
    c = json.load(open(out / "config.json"))
    assert c["architectures"] == ["GptOssForCausalLM"] and c["model_type"] == "gpt_oss"
    assert "quantization_config" not in c
    assert c["layer_types"] == ["sliding_attention", "full_attention"] * (L // 2)
    assert hf_config_to_model_dict(c) == cfg
    # Our tiny vocab (301) cannot hold the GPT-OSS special ids; a real one does.
    assert c["pad_token_id"] is None
    big = model_dict_to_hf_config(dict(cfg, vocab_size=201088))
    assert (big["bos_token_id"], big["eos_token_id"], big["pad_token_id"]) == (
        199998,
        200002,
        199999,
    )
    g = hf_config.generation_config(dict(cfg, vocab_size=201088))
    assert g["eos_token_id"] == [200002, 199999, 200012] and g["bos_token_id"] == 199998
    assert g["pad_token_id"] == 199999


# ----------------------------------------------------------------------------
# 3. Sharded
# ----------------------------------------------------------------------------


def test_sharded_save_and_read(read_hf_tree, hf_model, tree, tmp_path):
    model, _ = hf_model
    cfg, params = tree
    out = tmp_path / "sharded"
    limit = 200_000
    calls = []

    def getter(p, layers):
        calls.append((p, layers))
        a = get(params, p)
        return a if layers is None else a[layers]

    save_hf(out, cfg, getter, dtype="float32", max_shard_bytes=limit)
    # One stacked block at a time.
    assert all(layers is None or layers.stop - layers.start == 1 for _, layers in calls)
    files = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    assert len(files) >= 3 and "model.safetensors" not in files
    assert files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.load(open(out / "model.safetensors.index.json"))
    assert set(index["weight_map"].values()) == set(files)
    total = 0
    for f in files:
        with safe_open(out / f, framework="numpy") as h:
            sizes = [h.get_tensor(k).nbytes for k in h.keys()]
            for k in h.keys():
                assert index["weight_map"][k] == f
        total += sum(sizes)
        assert sum(sizes) <= limit or len(sizes) == 1, f
    assert index["metadata"]["total_size"] == total

    cfg2, params2 = read_hf_tree(out)
    assert cfg2 == cfg
    for p in HFCheckpoint(out).param_paths():
        np.testing.assert_array_equal(get(params2, p), get(params, p), err_msg=p)
    new, info = _from_pretrained(str(out))
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ids = torch.randint(0, V, (1, 2 * W + 3))
    assert torch.equal(_logits(model, ids), _logits(new, ids))


# ----------------------------------------------------------------------------
# 4. MXFP4
# ----------------------------------------------------------------------------


def _write_mxfp4_checkpoint(src, dst, rng):
    """The published layout from a dense HF folder: experts as blocks/scales (random
    representable values), other tensors dense, two shards + index, quantization_config."""
    tensors, _ = st_tensors(src)
    new = {}
    for k, v in tensors.items():
        if k.endswith("mlp.experts.gate_up_proj") or k.endswith("mlp.experts.down_proj"):
            e, i, o = v.shape
            blocks = rng.integers(0, 256, size=(e, o, i // 32, 16), dtype=np.uint8)
            scales = rng.integers(118, 126, size=(e, o, i // 32), dtype=np.uint8)
            new[k + "_blocks"], new[k + "_scales"] = blocks, scales
        else:
            new[k] = v.astype(ml_dtypes.bfloat16)
    names = sorted(new)
    os.makedirs(dst)
    shards = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    wmap = {}
    for f, ks in shards.items():
        save_file({k: new[k] for k in ks}, os.path.join(dst, f), metadata={"format": "pt"})
        wmap.update({k: f for k in ks})
    json.dump(
        {"metadata": {"total_size": 0}, "weight_map": wmap},
        open(os.path.join(dst, "model.safetensors.index.json"), "w"),
    )
    cfg = json.load(open(os.path.join(src, "config.json")))
    cfg["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
    return new


def test_mxfp4_checkpoint_read(mxfp4_reference, hf_model, tmp_path):
    _, dequant_ref = mxfp4_reference
    _, d = hf_model
    dst = str(tmp_path / "mx")
    raw = _write_mxfp4_checkpoint(d, dst, np.random.default_rng(2))
    ckpt = HFCheckpoint(dst)
    for kind, j in (("sliding", 0), ("full", 1)):
        gate = ckpt.read(f"blocks/{kind}/moe/wi_gate")
        up = ckpt.read(f"blocks/{kind}/moe/wi_up")
        wo = ckpt.read(f"blocks/{kind}/moe/wo")
        assert gate.shape == up.shape == (L // 2, E, D, F) and wo.shape == (L // 2, E, F, D)
        for i in range(L // 2):
            p = f"model.layers.{2 * i + j}.mlp.experts."
            gu = dequant_ref(raw[p + "gate_up_proj_blocks"], raw[p + "gate_up_proj_scales"])
            assert gu.shape == (E, D, 2 * F)
            np.testing.assert_array_equal(gate[i], gu[..., 0::2])
            np.testing.assert_array_equal(up[i], gu[..., 1::2])
            dn = dequant_ref(raw[p + "down_proj_blocks"], raw[p + "down_proj_scales"])
            np.testing.assert_array_equal(wo[i], dn)
            np.testing.assert_array_equal(
                ckpt.read(f"blocks/{kind}/moe/bi_up", slice(i, i + 1))[0],
                raw[p + "gate_up_proj_bias"][:, 1::2].astype(np.float32),
            )
    np.testing.assert_array_equal(
        ckpt.read("unembed/kernel"), raw["lm_head.weight"].astype(np.float32).T
    )

    # transformers' own MXFP4 loader (dequantizes to bf16 on CPU) agrees on the layout.
    m = GptOssForCausalLM.from_pretrained(
        dst, dtype=torch.bfloat16, quantization_config=transformers.Mxfp4Config(dequantize=True)
    )
    hf_gu = m.model.layers[3].mlp.experts.gate_up_proj.detach().float().numpy()
    hf_dn = m.model.layers[3].mlp.experts.down_proj.detach().float().numpy()
    np.testing.assert_array_equal(hf_gu[..., 0::2], ckpt.read("blocks/full/moe/wi_gate")[1])
    np.testing.assert_array_equal(hf_gu[..., 1::2], ckpt.read("blocks/full/moe/wi_up")[1])
    np.testing.assert_array_equal(hf_dn, ckpt.read("blocks/full/moe/wo")[1])


def test_save_hf_mxfp4_round_trip(read_hf_tree, tree, tmp_path):
    cfg, params = tree
    # Make the expert weights MXFP4-representable first, so the round trip is exact.
    rep = dict(params)
    rep["blocks"] = {
        kind: dict(params["blocks"][kind], moe=dict(params["blocks"][kind]["moe"]))
        for kind in ("sliding", "full")
    }
    for kind in ("sliding", "full"):
        for leaf in ("wi_gate", "wi_up", "wo"):
            w = rep["blocks"][kind]["moe"][leaf]
            rep["blocks"][kind]["moe"][leaf] = dequantize_mxfp4(*quantize_mxfp4(w))
    out = tmp_path / "mx"
    save_hf(out, cfg, rep, dtype="float32", mxfp4=True)
    c = json.load(open(out / "config.json"))
    assert c["quantization_config"]["quant_method"] == "mxfp4"
    _, dt = st_tensors(out)
    assert dt["model.layers.1.mlp.experts.down_proj_blocks"] == "U8"
    assert "model.layers.1.mlp.experts.down_proj" not in dt
    cfg2, back = read_hf_tree(out)
    assert cfg2 == cfg
    for p in HFCheckpoint(out).param_paths():
        np.testing.assert_array_equal(get(back, p), get(rep, p), err_msg=p)
    # transformers dequantizes what we wrote to the same experts.
    m = GptOssForCausalLM.from_pretrained(
        out, dtype=torch.float32, quantization_config=transformers.Mxfp4Config(dequantize=True)
    )
    ex = m.model.layers[2].mlp.experts
    gu = ex.gate_up_proj.detach().float().numpy()
    np.testing.assert_array_equal(gu[..., 0::2], rep["blocks"]["sliding"]["moe"]["wi_gate"][1])
    np.testing.assert_array_equal(gu[..., 1::2], rep["blocks"]["sliding"]["moe"]["wi_up"][1])
    np.testing.assert_array_equal(
        ex.down_proj.detach().float().numpy(), rep["blocks"]["sliding"]["moe"]["wo"][1]
    )


# ----------------------------------------------------------------------------
# 4b. Loading onto devices: each shard read alone, each stored byte once
# ----------------------------------------------------------------------------


def _file_tensor_bytes(folder):
    """The bytes of every tensor in a folder's safetensors files, from the headers' data
    offsets (read here, not through hf.py)."""
    total = 0
    for f in os.listdir(folder):
        if f.endswith(".safetensors"):
            with open(os.path.join(folder, f), "rb") as h:
                header = json.loads(h.read(struct.unpack("<Q", h.read(8))[0]))
            offsets = [v["data_offsets"] for k, v in header.items() if k != "__metadata__"]
            total += sum(e - b for b, e in offsets)
    return total


@pytest.fixture(scope="module")
def mxfp4_folder(hf_model, tmp_path_factory):
    """(folder, its tensors): the published layout, split over two files."""
    dst = str(tmp_path_factory.mktemp("mxfp4") / "mx")
    return dst, _write_mxfp4_checkpoint(hf_model[1], dst, np.random.default_rng(5))


def _abstract(folder, mesh_shape, packed=False):
    """The model's parameters as ShapeDtypeStructs sharded over all 8 devices (`packed`:
    the experts as MXFP4 blocks and scales, as a QLoRA base keeps them)."""
    arch = HFCheckpoint(folder).model_config
    md = ModelDef(config_lib.ModelConfig.from_config(config_lib.default_config(), arch))
    mesh = sharding.make_mesh(mesh_shape, devices=jax.devices())
    dense = md.abstract_params(mesh, config_lib.DEFAULT_RULES)
    if not packed:
        return dense
    base = frozen_base.abstract(dense, "mxfp4", mesh, config_lib.DEFAULT_RULES)

    def one(key_path, leaf):
        path = parameters.path_of(key_path)
        return lora.get(base, path) if frozen_base.form_of(path, "mxfp4") == "mxfp4" else leaf

    return jax.tree_util.tree_map_with_path(one, dense)


FSDP8 = dict(data=1, fsdp=8, tensor=1, expert=1)  # the default mesh on 8 devices
MIXED = dict(data=2, fsdp=2, tensor=2, expert=1)  # shards, and 2 replicas of each


@pytest.mark.parametrize("mesh", [FSDP8, MIXED], ids=["fsdp8", "data2_fsdp2_tensor2"])
@pytest.mark.parametrize("form", ["dense", "mxfp4"])
def test_load_sharded_reads_each_stored_byte_once(hf_model, mxfp4_folder, form, mesh):
    """One process with 8 devices: every device's shard is read, but each byte of the files
    once (not once per device, nor once per replica, nor whole tensors per device), as one
    process of a pod reads just its devices' shards. MXFP4: a 32-input block two devices
    split (FSDP over 8 leaves 8 inputs each) is read once for both."""
    model, folder = hf_model[0], hf_model[1] if form == "dense" else mxfp4_folder[0]
    count = hf.ReadCount()
    params = hf.load_sharded(folder, _abstract(folder, mesh), count)
    assert count.total == _file_tensor_bytes(folder)
    assert count.read == count.total
    ckpt = HFCheckpoint(folder)  # read whole (the path test_mxfp4_checkpoint_read checks)
    for p in ckpt.param_paths():
        if form == "dense":
            want = expected_from_state_dict(model.state_dict(), p)
        else:
            want = ckpt.read(p)
        np.testing.assert_array_equal(np.asarray(get(params, p)), want, err_msg=p)


@pytest.mark.parametrize("form", ["dense", "mxfp4"])
def test_load_sharded_packed_experts_read_once(hf_model, mxfp4_folder, form):
    """Experts kept as MXFP4 blocks and scales (a QLoRA base): the stored bytes, or the
    dense ones quantized, each read once although blocks and scales shard differently."""
    folder = hf_model[1] if form == "dense" else mxfp4_folder[0]
    count = hf.ReadCount()
    params = hf.load_sharded(folder, _abstract(folder, FSDP8, packed=True), count)
    assert count.read == count.total == _file_tensor_bytes(folder)
    sd = {k: v.detach().numpy() for k, v in hf_model[0].state_dict().items()}
    for kind, j in (("sliding", 0), ("full", 1)):
        for leaf, name, part in (
            ("wi_gate", "gate_up_proj", 0),
            ("wi_up", "gate_up_proj", 1),
            ("wo", "down_proj", None),
        ):
            rows = slice(None) if part is None else slice(part, None, 2)
            pairs = []
            for i in range(L // 2):
                key = f"model.layers.{2 * i + j}.mlp.experts.{name}"
                if form == "dense":
                    b, s = quantize_mxfp4(sd[key][..., rows])
                else:
                    raw = mxfp4_folder[1]
                    b, s = raw[key + "_blocks"][:, rows], raw[key + "_scales"][:, rows]
                pairs.append(mxfp4_array.from_file(b, s))
            got = get(params, f"blocks/{kind}/moe/{leaf}")
            np.testing.assert_array_equal(np.asarray(got.blocks), np.stack([b for b, _ in pairs]))
            np.testing.assert_array_equal(np.asarray(got.scales), np.stack([s for _, s in pairs]))


def test_one_shard_reads_only_its_bytes(hf_model, mxfp4_folder):
    """What one device of FSDP over 8 holds, read alone: inputs 24..31 of the up projection
    are those elements of the fused gate_up tensor only (dense), or the one 32-input MXFP4
    block under them (codes and scale); rows 8..15 of the embedding, just those."""
    box = ((0, L // 2), (0, E), (24, 32), (0, F))
    dense, mx = HFCheckpoint(hf_model[1]), HFCheckpoint(mxfp4_folder[0])
    for ckpt, nbytes in ((dense, L // 2 * E * 8 * F * 4), (mx, L // 2 * E * F * (16 + 1))):
        got = ckpt.read_box("blocks/full/moe/wi_up", box)
        np.testing.assert_array_equal(got, ckpt.read("blocks/full/moe/wi_up")[:, :, 24:32])
        assert ckpt.count.read == nbytes
        got = ckpt.read_box("embed/embedding", ((0, V), (8, 16)))
        np.testing.assert_array_equal(got, ckpt.read("embed/embedding")[:, 8:16])
        itemsize = 4 if ckpt is dense else 2  # float32; bfloat16 in the MXFP4 folder
        assert ckpt.count.read == nbytes + V * 8 * itemsize


# ----------------------------------------------------------------------------
# 5. Errors
# ----------------------------------------------------------------------------


def _copy(d, tmp_path, name="c"):
    dst = tmp_path / name
    shutil.copytree(d, dst)
    return dst


def _rewrite(folder, edit):
    f = folder / "model.safetensors"
    t, _ = st_tensors(folder)
    edit(t)
    save_file(t, f, metadata={"format": "pt"})


def test_error_missing_tensor(hf_model, tmp_path):
    c = _copy(hf_model[1], tmp_path)
    name = "model.layers.2.self_attn.sinks"
    _rewrite(c, lambda t: t.pop(name))
    with pytest.raises(ValueError, match=name.replace(".", r"\.")) as e:
        HFCheckpoint(c)
    assert "model.safetensors" in str(e.value)


def test_error_missing_expert_tensor_names_both_forms(hf_model, tmp_path):
    c = _copy(hf_model[1], tmp_path)
    name = "model.layers.3.mlp.experts.down_proj"
    _rewrite(c, lambda t: t.pop(name))
    with pytest.raises(ValueError, match="down_proj_blocks") as e:
        HFCheckpoint(c)
    assert repr(name) in str(e.value)


def test_error_wrong_shape(hf_model, tmp_path):
    c = _copy(hf_model[1], tmp_path)
    name = "model.layers.1.self_attn.q_proj.weight"
    _rewrite(c, lambda t: t.__setitem__(name, np.zeros((N * H, D + 1), np.float32)))
    with pytest.raises(ValueError) as e:
        HFCheckpoint(c)
    msg = str(e.value)
    assert name in msg and str([N * H, D + 1]) in msg and str([N * H, D]) in msg
    assert str(c / "model.safetensors") in msg


def test_error_wrong_dtype_class(hf_model, tmp_path):
    c = _copy(hf_model[1], tmp_path)
    name = "model.norm.weight"
    _rewrite(c, lambda t: t.__setitem__(name, np.zeros((D,), np.int32)))
    with pytest.raises(ValueError, match="I32"):
        HFCheckpoint(c)


@pytest.mark.parametrize("keep", [-100, 20, 4])
def test_error_truncated_file(hf_model, tmp_path, keep):
    c = _copy(hf_model[1], tmp_path)
    f = c / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:keep] if keep > 0 else data[:keep])
    with pytest.raises(ValueError, match="truncated") as e:
        HFCheckpoint(c)
    assert str(f) in str(e.value)


def test_error_missing_config(hf_model, tmp_path):
    c = _copy(hf_model[1], tmp_path)
    os.remove(c / "config.json")
    with pytest.raises(FileNotFoundError, match="config.json"):
        HFCheckpoint(c)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        HFCheckpoint(tmp_path / "nowhere")


def test_error_index_points_to_missing_file(tree, tmp_path):
    cfg, params = tree
    out = tmp_path / "s"
    save_hf(out, cfg, params, dtype="float32", max_shard_bytes=200_000)
    os.remove(out / sorted(f for f in os.listdir(out) if f.startswith("model-"))[1])
    with pytest.raises(FileNotFoundError, match="model-00002-of-"):
        HFCheckpoint(out)


def _digest(folder):
    return {
        f: hashlib.sha256((folder / f).read_bytes()).hexdigest() for f in sorted(os.listdir(folder))
    }


def test_save_hf_refuses_existing_checkpoint(hf_model, tree, tmp_path):
    cfg, params = tree
    c = _copy(hf_model[1], tmp_path)
    before = _digest(c)
    with pytest.raises(FileExistsError, match=str(c)):
        save_hf(c, cfg, params, dtype="float32")
    assert _digest(c) == before
    assert sorted(os.listdir(tmp_path)) == ["c"]  # no temp dir left behind
    # An empty existing directory is fine.
    (tmp_path / "empty").mkdir()
    save_hf(tmp_path / "empty", cfg, params, dtype="float32")
    assert "model.safetensors" in os.listdir(tmp_path / "empty")


def test_save_hf_failure_leaves_nothing(tree, tmp_path):
    cfg, params = tree

    def bad(p, layers):
        if p == "blocks/full/moe/wo":
            raise RuntimeError("device gone")
        a = get(params, p)
        return a if layers is None else a[layers]

    with pytest.raises(RuntimeError, match="device gone"):
        save_hf(tmp_path / "x", cfg, bad, dtype="float32")
    assert os.listdir(tmp_path) == []

    def wrong_shape(p, layers):
        return np.zeros((3,), np.float32)

    with pytest.raises(ValueError, match="embed/embedding"):
        save_hf(tmp_path / "y", cfg, wrong_shape)
    assert os.listdir(tmp_path) == []


# ----------------------------------------------------------------------------
# 6. Config mapping
# ----------------------------------------------------------------------------

# openai/gpt-oss-20b config.json (legacy rope_scaling + rope_theta spelling).
GPT_OSS_20B_CONFIG = {
    "architectures": ["GptOssForCausalLM"],
    "attention_bias": True,
    "attention_dropout": 0.0,
    "eos_token_id": 200002,
    "experts_per_token": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2880,
    "initial_context_length": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072,
    "model_type": "gpt_oss",
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24,
    "num_key_value_heads": 8,
    "num_local_experts": 32,
    "output_router_logits": False,
    "pad_token_id": 199999,
    "quantization_config": {
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
        "quant_method": "mxfp4",
    },
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "rope_theta": 150000,
    "router_aux_loss_coef": 0.9,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "transformers_version": "4.55.0.dev0",
    "use_cache": True,
    "vocab_size": 201088,
}

GPT_OSS_20B_MODEL = dict(
    vocab_size=201088,
    hidden_size=2880,
    num_layers=24,
    num_heads=64,
    num_kv_heads=8,
    head_dim=64,
    num_experts=32,
    experts_per_token=4,
    intermediate_size=2880,
    sliding_window=128,
    rope_theta=150000.0,
    rope_scaling_factor=32.0,
    rope_original_max_position=4096,
    rope_beta_fast=32.0,
    rope_beta_slow=1.0,
    rope_truncate=False,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    swiglu_limit=7.0,
)


def test_config_published_20b():
    m = hf_config_to_model_dict(GPT_OSS_20B_CONFIG)
    assert m == GPT_OSS_20B_MODEL
    assert tuple(m) == architecture.FIELDS
    assert isinstance(m["rope_theta"], float) and isinstance(m["num_layers"], int)


def test_model_fields_match_project_config():
    # Every architecture field the project's configs carry survives config.json both ways.
    arch = config_lib.model_arch(config_lib.default_config())
    back = hf_config_to_model_dict(model_dict_to_hf_config(arch))
    assert tuple(back) == tuple(architecture.FIELDS)
    assert back == arch


def test_config_round_trip_and_transformers_accepts_it(hf_model):
    model, _ = hf_model
    m = hf_config_to_model_dict(model.config.to_dict())
    assert m["num_layers"] == L and m["intermediate_size"] == F and m["head_dim"] == H
    assert m["rope_truncate"] is False and m["sliding_window"] == W
    out = model_dict_to_hf_config(m)
    assert hf_config_to_model_dict(out) == m
    big = model_dict_to_hf_config(GPT_OSS_20B_MODEL)
    assert hf_config_to_model_dict(big) == GPT_OSS_20B_MODEL
    # transformers reads back the same architecture.
    tc = GptOssConfig(**{k: v for k, v in out.items() if k not in ("architectures", "model_type")})
    assert tc.rope_parameters["rope_type"] == "yarn" and tc.rope_parameters["truncate"] is False
    assert tc.rope_parameters["rope_theta"] == 150000.0
    assert tc.layer_types == model.config.layer_types
    assert hf_config_to_model_dict(tc.to_dict()) == m


def test_config_defaults_follow_transformers():
    c = dict(GPT_OSS_20B_CONFIG)
    c["rope_scaling"] = {
        "rope_type": "yarn",
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
    }
    m = hf_config_to_model_dict(c)
    # transformers' yarn: truncate defaults to True, betas to 32 / 1.
    assert m["rope_truncate"] is True and m["rope_beta_fast"] == 32.0 and m["rope_beta_slow"] == 1.0


@pytest.mark.parametrize(
    "edit, field",
    [
        (
            lambda c: c.update(layer_types=["full_attention", "sliding_attention"] * 12),
            "layer_types",
        ),
        (lambda c: c.update(layer_types=["sliding_attention"] * 24), "layer_types"),
        (lambda c: c.update(num_hidden_layers=23, layer_types=None), "num_hidden_layers"),
        (
            lambda c: c.update(
                rope_scaling=dict(GPT_OSS_20B_CONFIG["rope_scaling"], rope_type="linear")
            ),
            "rope_type",
        ),
        (lambda c: c.update(rope_scaling=None), "rope_parameters"),
        (lambda c: c.update(tie_word_embeddings=True), "tie_word_embeddings"),
        (lambda c: c.update(swiglu_alpha=1.5), "swiglu_alpha"),
        (lambda c: c.update(quantization_config={"quant_method": "gptq"}), "quant_method"),
        (lambda c: c.update(model_type="llama"), "model_type"),
        (lambda c: c.pop("hidden_size"), "hidden_size"),
        (lambda c: c.update(sliding_window=None), "sliding_window"),
        (lambda c: c.update(attention_bias=False), "attention_bias"),
    ],
)
def test_config_validation_errors(edit, field):
    c = json.loads(json.dumps(GPT_OSS_20B_CONFIG))
    edit(c)
    with pytest.raises(ValueError, match=field):
        hf_config_to_model_dict(c)


def test_checkpoint_config_error_names_file(hf_model, tmp_path):
    c = _copy(hf_model[1], tmp_path)
    cfg = json.load(open(c / "config.json"))
    cfg["tie_word_embeddings"] = True
    json.dump(cfg, open(c / "config.json", "w"))
    with pytest.raises(ValueError, match="config.json.*tie_word_embeddings"):
        HFCheckpoint(c)
