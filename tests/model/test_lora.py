"""LoRA in the model: exact base with B = 0, the experts' low-rank terms in every MoE
back-end against a float64 loop, stacked adapters per batch row, MXFP4 and int8 frozen
bases, and the one-line errors for what cannot work."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gpt_oss_train import config as config_lib
from gpt_oss_train import sharding
from gpt_oss_train.arrays import mxfp4 as np_mxfp4
from gpt_oss_train.arrays import mxfp4_array
from gpt_oss_train.errors import ConfigError
from gpt_oss_train.inference import adapters as adapters_lib
from gpt_oss_train.model import frozen_base, lora
from gpt_oss_train.model import moe as moe_lib
from gpt_oss_train.model.transformer import ModelDef
from gpt_oss_train.training import lora as lora_training

ALL = ",".join(lora.TARGETS)


def tiny(targets=ALL, rank=3, **kw):
    c = config_lib.default_config()
    c.model.update(
        vocab_size=128,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        num_experts=4,
        experts_per_token=2,
        intermediate_size=32,
        sliding_window=4,
    )
    c.dtype, c.remat_policy = "float32", "none"
    c.lora.update(rank=rank, alpha=5.0, targets=targets)
    c.update(kw)
    return config_lib.ModelConfig.from_config(c)


def random_params(mc, seed=0, std=0.05):
    """Random leaves for every parameter of ModelDef(mc) (fast: no model init): norm
    scales near 1, the rest normal(0, std)."""
    rng = np.random.RandomState(seed)

    def one(key_path, a):
        x = rng.standard_normal(a.shape).astype(np.float32)
        scale = "scale" in str(key_path[-1])
        return jnp.asarray(1.0 + 0.1 * x if scale else std * x)

    return jax.tree_util.tree_map_with_path(one, ModelDef(mc).abstract_params())


def base_and_adapters(mc, seed=0, std=0.1):
    """(random base, the adapters as training starts them (B = 0), random adapters)."""
    base = random_params(mc.replace(lora=None), seed)
    adapters = lora.split(random_params(mc, seed + 1, std))[1]
    fresh = {k: v for k, v in lora.flat(adapters).items()}
    fresh = lora.unflat({k: 0 * v if "_b" in k.rpartition("/")[2] else v for k, v in fresh.items()})
    return base, fresh, adapters


def tokens(b, s, seed=0):
    return jnp.asarray(np.random.RandomState(seed).randint(0, 128, (b, s)), jnp.int32)


def logits(mc, params, toks, adapter_ids=None):
    md = ModelDef(mc)

    def run(params, toks, adapter_ids):
        model = md.bind(params)
        return model.logits(model(toks, adapter_ids=adapter_ids)[0])

    return np.asarray(jax.jit(run)(params, toks, adapter_ids))


@pytest.mark.parametrize(
    "moe_impl,shape", [("dense", (2, 16)), ("ragged", (2, 16)), ("ragged", (1, 1))]
)  # (1, 1): the decode-sized gathered path
@pytest.mark.full
def test_zero_b_gives_exactly_the_base_logits(moe_impl, shape):
    mc = tiny(moe_impl=moe_impl)
    base, fresh, rand = base_and_adapters(mc)
    toks = tokens(*shape)
    want = logits(mc.replace(lora=None), base, toks)
    assert np.array_equal(logits(mc, lora.merge(base, fresh), toks), want)
    # and random adapters do change them (the comparison above can fail)
    assert np.abs(logits(mc, lora.merge(base, rand), toks) - want).max() > 1e-2


# ----------------------------------------------------------------------------- experts


def numpy_moe_lora(x, weights, idx, w, lo, limit=7.0, alpha=1.702):
    """float64 loops: each chosen expert's gate/up/down plus its (x A) B terms."""
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for p, e in zip(weights[t], idx[t]):
            xa = x[t] @ lo["a_in"][e]
            gate = np.minimum(
                x[t] @ w["wi_gate"][e] + xa @ lo["b_gate"][e] + w["bi_gate"][e], limit
            )
            up = np.clip(x[t] @ w["wi_up"][e] + xa @ lo["b_up"][e] + w["bi_up"][e], -limit, limit)
            act = gate / (1 + np.exp(-alpha * gate)) * (up + 1)
            y = act @ w["wo"][e] + (act @ lo["a_out"][e]) @ lo["b_out"][e] + w["bo"][e]
            out[t] += p * y
    return out


def _expert_inputs(t=32, d=16, e=8, f=12, r=3, seed=0):
    rng = np.random.RandomState(seed)
    w = dict(
        wi_gate=rng.randn(e, d, f),
        bi_gate=rng.randn(e, f),
        wi_up=rng.randn(e, d, f),
        bi_up=rng.randn(e, f),
        wo=rng.randn(e, f, d) * 0.3,
        bo=rng.randn(e, d),
    )
    lo = dict(
        a_in=rng.randn(e, d, r),
        b_gate=rng.randn(e, r, f) * 0.5,
        b_up=rng.randn(e, r, f) * 0.5,
        a_out=rng.randn(e, f, r) * 0.5,
        b_out=rng.randn(e, r, d) * 0.3,
    )
    x = rng.randn(t, d)
    logits = rng.randn(t, e)
    idx = np.argsort(-logits, axis=1)[:, :2]
    weights = np.take_along_axis(logits, idx, 1)
    weights = np.exp(weights) / np.exp(weights).sum(1, keepdims=True)
    return x, weights, idx, w, lo


@pytest.mark.parametrize(
    "impl,t", [("dense", 32), ("ragged", 32), ("ragged", 1), ("sharded", 32)]
)  # ragged with t=1 takes the gathered (decode) path
def test_expert_lora_matches_float64_loops_in_every_backend(impl, t):
    x, weights, idx, w, lo = _expert_inputs(t=t)
    ref = numpy_moe_lora(x, weights, idx, w, lo)
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    ew = moe_lib.ExpertWeights(
        **{n: f32(a) for n, a in w.items()},
        lora=moe_lib.ExpertLoRA(**{n: f32(a) for n, a in lo.items()}),
    )
    fn = lambda *a: moe_lib.EXPERT_IMPLS[impl](*a, limit=7.0, alpha=1.702, dtype=jnp.float32)
    args = (f32(x), f32(weights), jnp.asarray(idx, jnp.int32), ew)
    if impl == "sharded":  # experts over 4 devices, their hidden units over 2
        mesh = sharding.make_mesh(dict(data=1, fsdp=1, tensor=2, expert=4))
        with sharding.use_mesh(mesh, config_lib.DEFAULT_RULES):
            got = jax.jit(fn)(*args)
    else:
        got = jax.jit(fn)(*args)
    no_lora = numpy_moe_lora(x, weights, idx, w, {k: 0 * v for k, v in lo.items()})
    assert np.abs(ref - no_lora).max() > 0.1 * np.abs(ref).max()  # the LoRA terms matter
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


@pytest.mark.full
def test_sharded_expert_lora_gradients_equal_ragged():
    x, weights, idx, w, lo = _expert_inputs()
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    base = {n: f32(a) for n, a in w.items()}

    def loss(lo_, impl):
        ew = moe_lib.ExpertWeights(**base, lora=moe_lib.ExpertLoRA(**lo_))
        y = moe_lib.EXPERT_IMPLS[impl](
            f32(x), f32(weights), jnp.asarray(idx), ew, limit=7.0, alpha=1.702, dtype=jnp.float32
        )
        return jnp.sum(jnp.sin(y))

    lo32 = {n: f32(a) for n, a in lo.items()}
    want = jax.grad(loss)(lo32, "ragged")
    mesh = sharding.make_mesh(dict(data=2, fsdp=1, tensor=1, expert=4))
    with sharding.use_mesh(mesh, config_lib.DEFAULT_RULES):
        got = jax.jit(jax.grad(loss), static_argnums=1)(lo32, "sharded")
    for n in lo:
        np.testing.assert_allclose(got[n], want[n], rtol=1e-4, atol=1e-4 * np.abs(want[n]).max())


# ----------------------------------------------------------------------------- stacked


@pytest.mark.full
@pytest.mark.parametrize("moe_impl", ["dense", "ragged"])
def test_stacked_adapters_give_each_row_its_own_adapter(moe_impl):
    """Rows naming slot 0 (no adapter), adapter 1 (rank 3, attention + experts) and adapter
    2 (rank 2, o + router + down) in one batch equal each run alone."""
    arch = {k: v for k, v in config_lib.model_arch(_arch_config()).items()}
    specs = [
        tiny("q,v,gate_up,down", 3, moe_impl=moe_impl),
        tiny("o,router,down", 2, moe_impl=moe_impl),
    ]
    base = random_params(specs[0].replace(lora=None))
    read = []
    for i, mc in enumerate(specs):
        tree = jax.device_get(lora.split(random_params(mc, 10 + i, 0.2))[1])
        read.append(adapters_lib.Adapter(f"a{i}", "", mc.lora, tree, {}))
    spec, stacked = adapters_lib.stack(read, arch)
    mc_stacked = specs[0].replace(lora=spec)
    toks = tokens(3, 12, seed=1)
    got = logits(mc_stacked, lora.merge(base, stacked), toks, adapter_ids=jnp.array([0, 1, 2]))
    alone = [
        logits(specs[0].replace(lora=None), base, toks[:1]),
        logits(specs[0], lora.merge(base, read[0].tree), toks[1:2]),
        logits(specs[1], lora.merge(base, read[1].tree), toks[2:3]),
    ]
    for row, want in enumerate(alone):
        np.testing.assert_allclose(got[row], want[0], rtol=1e-5, atol=1e-5, err_msg=str(row))
    assert np.abs(alone[1] - alone[0]).max() > 1e-2 and np.abs(alone[2] - alone[0]).max() > 1e-2


def _arch_config():
    c = config_lib.default_config()
    c.model.update(
        vocab_size=128,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        num_experts=4,
        experts_per_token=2,
        intermediate_size=32,
        sliding_window=4,
    )
    return c


# ----------------------------------------------------------------------------- frozen bases


def test_mxfp4_array_is_the_numpy_codec(mxfp4_reference):
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((3, 64, 40)) * np.array([1e-3, 0.02, 5.0])[:, None, None]).astype(
        np.float32
    )
    w[0, :32, 0] = 0.0  # an all-zero block
    blocks, scales = np_mxfp4.quantize_mxfp4(w)
    q = mxfp4_array.quantize(jnp.asarray(w))
    file_blocks, file_scales = mxfp4_array.to_file(q.blocks, q.scales)
    assert np.array_equal(file_blocks, blocks) and np.array_equal(file_scales, scales)
    _, dequant_ref = mxfp4_reference
    np.testing.assert_array_equal(q.astype(jnp.float32), dequant_ref(blocks, scales))
    assert q.shape == w.shape and q[1:2].shape == (1, 64, 40)


@pytest.mark.full
@pytest.mark.parametrize("fmt", ["bfloat16", "int8", "mxfp4"])
def test_frozen_base_formats_keep_logits_close_and_shard_like_dense(fmt):
    # no router adapter and small adapters: few routing choices flip, so the error is the
    # weights' rounding (a flipped choice moves its token's logits by O(1))
    mc = tiny(targets="q,k,v,o,gate_up,down", moe_impl="ragged")
    base, _, adapters = base_and_adapters(mc, std=0.02)
    mesh = sharding.make_mesh(dict(data=1, fsdp=2, tensor=1, expert=4))
    rules = config_lib.DEFAULT_RULES
    dense_abstract = ModelDef(mc.replace(lora=None)).abstract_params(mesh, rules)
    abstract = frozen_base.abstract(dense_abstract, fmt, mesh, rules)
    packed = frozen_base.convert(base, fmt)
    moe = lambda t: t["blocks"]["full"]["moe"]
    if fmt == "mxfp4":
        wi = moe(abstract)["wi_gate"]
        assert isinstance(wi, mxfp4_array.MXFP4Array) and wi.blocks.dtype == jnp.uint32
        assert wi.blocks.shape == (1, 4, 8, 32)  # [layers, E, in/8 words, out=F]
        assert wi.blocks.sharding.spec[1] == "expert"  # blocks shard over experts
    nbytes, dense_bytes = frozen_base.nbytes(packed), frozen_base.nbytes(base)
    assert nbytes < {"bfloat16": 0.51, "int8": 0.45, "mxfp4": 0.5}[fmt] * dense_bytes
    toks = tokens(2, 16)
    want = logits(mc, lora.merge(base, adapters), toks)
    got = logits(mc, lora.merge(packed, adapters), toks)
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert 0 < err < {"bfloat16": 0.01, "int8": 0.03, "mxfp4": 0.2}[fmt], err


def test_mxfp4_base_equals_its_dequantized_values_exactly():
    mc = tiny(moe_impl="ragged")
    base, _, adapters = base_and_adapters(mc)
    packed = frozen_base.convert(base, "mxfp4")
    dense = jax.tree.map(
        lambda a: a.astype(jnp.float32),
        packed,
        is_leaf=lambda a: isinstance(a, mxfp4_array.MXFP4Array),
    )
    toks = tokens(2, 16)
    got = logits(mc, lora.merge(packed, adapters), toks)
    np.testing.assert_allclose(
        got, logits(mc, lora.merge(dense, adapters), toks), rtol=0, atol=2e-6
    )


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "overrides,match",
    [
        (dict(targets="q,qq"), r"config.lora.targets: unknown LoRA target 'qq'"),
        (dict(rank=0, base_format="mxfp4"), r"config.lora.base_format: a mxfp4 base is frozen"),
        (dict(rank=0, base_format="int8"), r"needs LoRA adapters: set config.lora.rank > 0"),
        (dict(rank=-1), r"config.lora.rank: must be >= 0"),
        (dict(base_format="fp4"), r"config.lora.base_format: 'fp4' is not one of"),
    ],
)
def test_bad_lora_configs_are_one_line_errors(overrides, match):
    c = config_lib.default_config()
    c.lora.update(dict(rank=4, **{k: v for k, v in overrides.items() if k != "rank"}))
    if "rank" in overrides:
        c.lora.rank = overrides["rank"]
    with pytest.raises(ConfigError, match=match) as e:
        config_lib.validate(c)
    assert "\n" not in str(e.value)


def test_training_starts_from_the_base_model():
    """Adapters as a run creates them (training/lora.py): B = 0, A random."""
    mc = tiny()
    mesh = sharding.make_mesh(dict(data=1, fsdp=1, tensor=1, expert=1), devices=jax.devices()[:1])
    shardings = lora.split(ModelDef(mc).shardings(mesh, config_lib.DEFAULT_RULES))[1]
    fresh = lora_training.init_adapters(ModelDef(mc), 0, mesh, config_lib.DEFAULT_RULES, shardings)
    for path, a in lora.flat(fresh).items():
        is_b = "_b" in path.rpartition("/")[2]
        assert (float(jnp.abs(a).max()) == 0) == is_b, path
        if not is_b:
            assert 0.01 < float(jnp.std(a)) < 0.03  # initializer_range
    assert sorted(lora.flat(fresh)) == sorted(lora.flat(lora.split(random_params(mc))[1]))
