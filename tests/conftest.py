"""Every test runs on the CPU with 8 fake devices, so meshes of up to 8 can be tested, and
with the Hugging Face hub switched off: the suite never downloads anything."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import pytest  # noqa: E402

# Builders shared by several test modules: fixtures, so no test module imports another.


@pytest.fixture(scope="session")
def hf_tiny_config():
    """factory(**overrides) -> a tiny transformers GptOssConfig (4 layers of width 64, 4
    experts top-2, window 8, a 300-id vocabulary, eager attention)."""
    transformers = pytest.importorskip("transformers")

    def make(**kw):
        args = dict(
            vocab_size=300,
            hidden_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            intermediate_size=64,
            sliding_window=8,
            max_position_embeddings=4096,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=150000.0,
                factor=32.0,
                original_max_position_embeddings=4096,
                beta_fast=32.0,
                beta_slow=1.0,
                truncate=False,
            ),
            attn_implementation="eager",
        )
        args.update(kw)
        return transformers.GptOssConfig(**args)

    return make


@pytest.fixture(scope="session")
def random_hf_model(hf_tiny_config):
    """factory(seed=0, **config_overrides) -> a transformers GptOssForCausalLM with every
    weight random, biases, sinks and norm scales included (so none is trivially 0 or 1)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

    def make(seed=0, **kw):
        torch.manual_seed(seed)
        model = transformers.GptOssForCausalLM(hf_tiny_config(**kw)).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        return model

    return make


def _read_hf_tree(path):
    from gpt_oss_train.io import hf

    ckpt = hf.HFCheckpoint(path)
    tree = {}
    for p in ckpt.param_paths():
        *head, last = p.split("/")
        node = tree
        for k in head:
            node = node.setdefault(k, {})
        node[last] = ckpt.read(p)
    return ckpt.model_config, tree


@pytest.fixture(scope="session")
def read_hf_tree():
    """read(path) -> (architecture, nested dict of float32 numpy arrays) of a whole (small)
    Hugging Face checkpoint, through the project's reader."""
    return _read_hf_tree


def _fp4(code: int) -> float:
    """E2M1 from its bit fields: sign, 2 exponent bits (bias 1), 1 mantissa bit."""
    sign = -1.0 if code & 8 else 1.0
    exp, man = (code >> 1) & 3, code & 1
    return sign * (man * 0.5 if exp == 0 else (1 + man * 0.5) * 2.0 ** (exp - 1))


def _dequant_ref(blocks, scales):
    """float64 loops: [..., out, nblk, 16] / [..., out, nblk] -> [..., in, out]."""
    import numpy as np

    *lead, o, g, _ = blocks.shape
    b = blocks.reshape(-1, o, g, 16)
    s = scales.reshape(-1, o, g)
    out = np.zeros((b.shape[0], g * 32, o), np.float64)
    for e in range(b.shape[0]):
        for r in range(o):
            for j in range(g):
                for k in range(16):
                    byte = int(b[e, r, j, k])
                    scale = 2.0 ** (int(s[e, r, j]) - 127)
                    out[e, j * 32 + 2 * k, r] = _fp4(byte & 0xF) * scale
                    out[e, j * 32 + 2 * k + 1, r] = _fp4(byte >> 4) * scale
    return out.reshape(*lead, g * 32, o)


@pytest.fixture(scope="session")
def mxfp4_reference():
    """(fp4(code) -> float, dequantize(blocks, scales) -> float64 [..., in, out]): MXFP4
    decoded from the OCP spec's bit fields by loops, independent of io/mxfp4.py."""
    return _fp4, _dequant_ref


@pytest.fixture(scope="session")
def harmony_checkpoint():
    """A float32 HF folder of a tiny gpt-oss that has memorised the Harmony conversations in
    tests/harmony_model.py (trained once, ~3 min on 2 cores, then cached under the temp dir)."""
    import harmony_model

    return harmony_model.cached()


@pytest.fixture(scope="session")
def harmony_server(harmony_checkpoint):
    """The HTTP server (in a thread, on a free loopback port) over an engine on the
    harmony_checkpoint model, float32, served as "tiny-harmony"; `.url` is its address."""
    from gpt_oss_train.inference.engine import Engine
    from gpt_oss_train.inference.server.app import create_app
    from gpt_oss_train.inference.server.local import ThreadServer
    from gpt_oss_train.io import tokenizer as tok_lib

    engine = Engine.from_checkpoint(
        harmony_checkpoint, dtype="float32", max_slots=4, max_context=512, prefill_chunk=64
    )
    engine.start()
    app = create_app(
        engine,
        tokenizer=tok_lib.Tokenizer(),
        model_name="tiny-harmony",
        max_context=512,
        vocab_size=tok_lib.VOCAB_SIZE,
    )
    with ThreadServer(app) as server:
        yield server
    engine.stop(0)
