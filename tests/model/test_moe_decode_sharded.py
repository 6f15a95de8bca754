"""The `sharded` MoE's local experts through the `moe_decode` op per shard (model/moe.py
`_decode_local_rows`): on the 8-device CPU mesh, MXFP4 experts under expert parallelism
(both ways of moving the rows, an mlp split over tensor, the capacity rounds) give, with
the TPU's MXFP4 kernel (kernels/tpu/mxfp4_experts.py, in Pallas' TPU interpreter), the
same numbers as the grouped matmuls and as float64 dequantize-then-multiply, and the
kernel runs only where the registry says its implementation runs per shard."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import mxfp4_experts

from gpt_oss_train import config as config_lib
from gpt_oss_train import sharding
from gpt_oss_train.arrays.layer_views import LayerView
from gpt_oss_train.kernels import Kernels, registry
from gpt_oss_train.model import moe as moe_lib

KW = dict(limit=7.0, alpha=1.702)
# 16 tokens x top-4 of 8 experts, 64 -> 2 x 128; f/32 = 4 scale groups split 2 ways
T, K, E, D, F = 16, 4, 8, 64, 128
# the references' kernels: grouped matmuls in XLA (no C++ build), the same exchange
GROUPED = dict(grouped_matmul="xla", gated_activation="xla")
EXPERT_FSDP = dict(data=1, fsdp=2, tensor=1, expert=4)
EXPERT_TENSOR = dict(data=1, fsdp=1, tensor=2, expert=4)


@pytest.fixture(autouse=True)
def _tpu_kernels_interpreted(monkeypatch):
    """On a CPU the registry lets a TPU kernel be chosen only here: it runs in Pallas'
    interpreter (the kernel module interprets off a TPU)."""
    monkeypatch.setattr(registry, "_interpreted", lambda impl: True)


def _case(seed=0):
    """Tokens, routing and MXFP4 experts with their float64 dequantization."""
    return mxfp4_experts.case(T, K, E, D, F, seed)


def _sharded(kernels, mesh_sizes, tokens, w, dtype=jnp.float32, capacity_factor=0.0):
    """(the sharded MoE's output as float64, whether its program has a Pallas call)."""
    mesh = sharding.make_mesh(mesh_sizes)
    with sharding.use_mesh(mesh, config_lib.DEFAULT_RULES):
        f = jax.jit(
            lambda *a: moe_lib.sharded_experts(
                *a, dtype=dtype, kernels=kernels, capacity_factor=capacity_factor, **KW
            )
        )
        ran = "pallas_call" in str(jax.make_jaxpr(f)(*tokens, w))
        return np.asarray(f(*tokens, w), np.float64), ran


def _err(got, ref):
    return float(np.abs(got - ref).max() / np.abs(ref).max())


# capacity 1.0: the gather's rows in rounds of 8 (a shard's balanced share), each its
# own call of the local experts
@pytest.mark.parametrize(
    "exchange,mesh_sizes,capacity",
    [
        ("xla", EXPERT_FSDP, 0.0),
        ("all_to_all", EXPERT_FSDP, 0.0),
        ("xla", EXPERT_TENSOR, 0.0),
        ("all_to_all", EXPERT_TENSOR, 0.0),
        ("xla", EXPERT_FSDP, 1.0),
    ],
    ids=["gather", "all_to_all", "gather_tensor2", "all_to_all_tensor2", "gather_rounds"],
)
def test_the_kernel_per_shard_equals_grouped_matmuls_and_float64(
    exchange, mesh_sizes, capacity, expert_ffn_reference
):
    """float32: the decoding is exact, the products nearly so (1.4e-7 to 3.4e-7 of the
    scale, either path against float64 or each other): a wrong expert, bias (added twice
    over tensor, or on padding rows), row or tensor shard's half is off by O(1)."""
    tokens, w, dense = _case()
    ref = expert_ffn_reference(*map(np.asarray, tokens), dense)
    grouped = Kernels.of(expert_parallel=exchange, **GROUPED)
    kernel = Kernels.of(expert_parallel=exchange, moe_decode="pallas_tpu", **GROUPED)
    run = lambda kernels: _sharded(kernels, mesh_sizes, tokens, w, capacity_factor=capacity)
    (want, grouped_ran), (got, kernel_ran) = run(grouped), run(kernel)
    assert kernel_ran and not grouped_ran
    assert _err(want, ref) < 1e-6, _err(want, ref)
    assert _err(got, ref) < 1e-6, _err(got, ref)
    assert _err(got, want) < 1e-6, _err(got, want)


def test_bfloat16_per_shard_within_bf16_rounding(expert_ffn_reference):
    """The serving dtype: the rounding of the activations, 4.4e-3 of the scale here, as
    the grouped matmuls' (a tenfold error fails)."""
    tokens, w, dense = _case(1)
    ref = expert_ffn_reference(*map(np.asarray, tokens), dense)
    kernels = Kernels.of(moe_decode="pallas_tpu", **GROUPED)
    got, ran = _sharded(kernels, EXPERT_FSDP, tokens, w, jnp.bfloat16)
    want, _ = _sharded(Kernels.of(**GROUPED), EXPERT_FSDP, tokens, w, jnp.bfloat16)
    assert ran
    assert _err(got, ref) < 1e-2 and _err(got, ref) < 2 * _err(want, ref), (
        _err(got, ref),
        _err(want, ref),
    )


def test_layer_views_reach_the_kernel_as_packed_layers(expert_ffn_reference):
    """Inference's LayerViews (CPU streams them): the sharded MoE hands shard_map their
    whole layers, MXFP4 arrays the kernel takes; layer 1 of the stacks, not layer 0."""
    tokens, w, dense = _case(2)
    _, other, _ = _case(3)
    stack = lambda a, b: jax.tree.map(lambda x, y: jnp.stack([x, y]), a, b)
    views = {
        n: LayerView(stack(getattr(other, n), getattr(w, n)), jnp.int32(1))
        for n in ("wi_gate", "wi_up", "wo")
    }
    ref = expert_ffn_reference(*map(np.asarray, tokens), dense)
    kernels = Kernels.of(moe_decode="pallas_tpu", **GROUPED)
    got, ran = _sharded(kernels, EXPERT_FSDP, tokens, w._replace(**views))
    assert ran and _err(got, ref) < 1e-6, _err(got, ref)


def test_only_implementations_declared_per_shard_run_there(monkeypatch):
    """The registry's Impl.per_shard decides, not the model: pallas_tpu without it runs
    grouped matmuls in the shards (it still runs whole batches on one device); batches
    past MAX_PAIRS a shard and bfloat16 experts take grouped matmuls too."""
    tokens, w, _ = _case(4)
    kernels = Kernels.of(moe_decode="pallas_tpu", **GROUPED)
    trace = lambda tokens, w: _sharded_jaxpr(kernels, EXPERT_FSDP, tokens, w)
    assert "pallas_call" in trace(tokens, w)
    op = registry.OPS["moe_decode"]
    undeclared = dataclasses.replace(op.impl("pallas_tpu"), per_shard=False)
    impls = tuple(undeclared if i.name == "pallas_tpu" else i for i in op.impls)
    with monkeypatch.context() as m:
        m.setitem(registry.OPS, "moe_decode", dataclasses.replace(op, impls=impls))
        assert "pallas_call" not in trace(tokens, w)
    # 320 tokens: an fsdp half's 160 x 4 choices gathered to each expert shard, 640 rows
    big = tuple(jnp.concatenate([a] * 20) for a in tokens)
    assert "pallas_call" not in trace(big, w)
    dense = w._replace(**{n: getattr(w, n).astype(jnp.float32) for n in ("wi_gate", "wi_up", "wo")})
    assert "pallas_call" not in trace(tokens, dense)


def _sharded_jaxpr(kernels, mesh_sizes, tokens, w):
    mesh = sharding.make_mesh(mesh_sizes)
    with sharding.use_mesh(mesh, config_lib.DEFAULT_RULES):
        f = lambda *a: moe_lib.sharded_experts(*a, dtype=jnp.float32, kernels=kernels, **KW)
        return str(jax.make_jaxpr(f)(*tokens, w))
