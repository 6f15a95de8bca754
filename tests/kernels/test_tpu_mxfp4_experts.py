"""The TPU MXFP4 decode experts (kernels/tpu/mxfp4_experts.py): the in-kernel E2M1/E8M0
decoding against the float64 reference's bit fields, the expert FFN in Pallas' TPU
interpreter on the model's MXFP4 experts against float64 dequantize-then-multiply
(tests/support/mxfp4_reference.py), which operands the `moe_decode` op's `pallas_tpu`
entry takes, and the kernel's lowering for TPU at gpt-oss-20b's shapes (jax.export:
Pallas' block and tiling checks; with libtpu, in the full tier, Mosaic's compile too,
whose VMEM check the export does not make). Running it on a TPU needs one."""

import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import Mesh
from support import ROOT, mxfp4_experts, mxfp4_reference

from gpt_oss_train import sharding
from gpt_oss_train.arrays.layer_views import LayerView
from gpt_oss_train.arrays.mxfp4_array import MXFP4Array
from gpt_oss_train.kernels import Kernels, registry
from gpt_oss_train.kernels.tpu import mxfp4_experts as mx
from gpt_oss_train.kernels.xla.experts import ExpertLoRA, ExpertWeights

LIMIT, ALPHA = 7.0, 1.702  # gpt-oss's SwiGLU clamp and slope
KW = dict(limit=LIMIT, alpha=ALPHA)


def test_in_kernel_decoding_matches_the_bit_fields():
    codes = jnp.arange(16, dtype=jnp.uint32)
    expected = [mxfp4_reference.fp4(c) for c in range(16)]
    np.testing.assert_array_equal(np.asarray(mx.e2m1(codes)), expected)
    scales = jnp.arange(1, 255, dtype=jnp.uint8)  # 2^-126 .. 2^127: every normal power
    np.testing.assert_array_equal(np.asarray(mx._e8m0(scales)), 2.0 ** (np.arange(1, 255) - 127))


_case = mxfp4_experts.case


def _run(tokens, w, dtype, block_out=mx.BLOCK_OUT):
    fn = lambda *a: mx.experts(
        *a, dtype=dtype, interpret=pltpu.InterpretParams(), block_out=block_out, **KW
    )
    return np.asarray(jax.jit(fn)(*tokens, w), np.float64)


# d = 64 inputs (8 words a plane, 2 scale groups), f = 192 (3 groups); output blocks of 128
# columns, so gate and up's last block runs past their 192 columns.
D, F, BLOCK = 64, 192, 128


@pytest.mark.parametrize(
    "t,k,e,crowd",
    [(1, 4, 8, False), (6, 4, 8, False), (37, 2, 4, True)],
    ids=["batch1", "tokens_share_experts", "an_expert_over_three_tiles"],
)
def test_float32_experts_equal_float64_dequantize_then_multiply(
    t, k, e, crowd, expert_ffn_reference
):
    """In float32 the decoding is exact and the products nearly so: every nibble, scale,
    plane, bias, tile and expert must be the right one."""
    tokens, w, dense = _case(t, k, e, D, F, seed=t, crowd=crowd)
    ref = expert_ffn_reference(*map(np.asarray, tokens), dense)
    got = _run(tokens, w, jnp.float32, BLOCK)
    # float32 sums of 64-192 products of O(1-10) terms: ~1e-6 of the scale; a wrong nibble,
    # scale, bias or expert is off by O(1)
    np.testing.assert_allclose(got, ref, atol=2e-6 * np.abs(ref).max())


def test_bfloat16_experts_within_bf16_rounding(expert_ffn_reference):
    """The serving dtype: activations and decoded weights in bf16 (the weights exactly),
    float32 sums. Its error is the rounding of x and of the activation (2^-9 relative
    each), a few 1e-3 of the scale here; a tenfold one fails."""
    tokens, w, dense = _case(24, 4, 8, D, F, seed=3)
    ref = expert_ffn_reference(*map(np.asarray, tokens), dense)
    got = _run(tokens, w, jnp.bfloat16, BLOCK)
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err < 1e-2, err


def test_layer_views_are_read_from_their_stacks(expert_ffn_reference):
    """Inference's LayerViews (arrays/layer_views.py): layer 1 of two-layer stacks, read in
    place, equals the layer's experts (layer 0, other experts, must not leak in)."""
    tokens, w, dense = _case(3, 2, 4, D, F, seed=5)
    _, other, _ = _case(3, 2, 4, D, F, seed=6)
    stack = lambda a, b: jax.tree.map(lambda x, y: jnp.stack([x, y]), a, b)
    views = {
        n: LayerView(stack(getattr(other, n), getattr(w, n)), jnp.int32(1))
        for n in ("wi_gate", "wi_up", "wo")
    }
    ref = expert_ffn_reference(*map(np.asarray, tokens), dense)
    got = _run(tokens, w._replace(**views), jnp.float32, BLOCK)
    np.testing.assert_allclose(got, ref, atol=2e-6 * np.abs(ref).max())


def _weights_like(e, d, f, packed=True):
    if packed:
        mat = lambda i, o: MXFP4Array(
            jnp.zeros((e, i // 8, o), jnp.uint32), jnp.zeros((e, i // 32, o), jnp.uint8)
        )
    else:
        mat = lambda i, o: jnp.zeros((e, i, o), jnp.bfloat16)
    bias = lambda o: jnp.zeros((e, o), jnp.float32)
    return ExpertWeights(mat(d, f), bias(f), mat(d, f), bias(f), mat(f, d), bias(d))


def test_the_op_takes_mxfp4_decode_batches_on_one_device_only():
    """`pallas_tpu` is the TPU's choice when named, and it takes MXFP4 experts without
    LoRA, up to MAX_PAIRS pairs, on one device's arrays; the op runs the reference (or
    grouped matmuls) for the rest."""
    impl = Kernels.of(moe_decode="pallas_tpu").impl("moe_decode", "tpu")
    assert impl.name == "pallas_tpu"
    w = _weights_like(8, D, F)

    def takes(t, k=4, experts=w, dtype=jnp.bfloat16):
        idx = jnp.zeros((t, k), jnp.int32)
        return impl.takes(jnp.zeros((t, D)), jnp.zeros((t, k)), idx, experts, dtype=dtype, **KW)

    assert takes(1) and takes(128)
    assert not takes(129)  # 516 pairs: grouped matmuls
    assert not takes(8, experts=_weights_like(8, D, F, packed=False))  # bf16 experts
    assert not takes(8, experts=w._replace(lora=ExpertLoRA(a_in=jnp.zeros((8, D, 2)))))
    assert not takes(8, dtype=jnp.float16)
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    with sharding.use_mesh(mesh, ()):  # a Pallas call is not split by the partitioner
        assert not takes(8)


def test_the_op_through_the_registry(expert_ffn_reference):
    """The op's entry runs the kernel (interpreted off a TPU) with its default blocks."""
    tokens, w, dense = _case(5, 4, 8, D, F, seed=11)
    ref = expert_ffn_reference(*map(np.asarray, tokens), dense)
    impl = registry.OPS["moe_decode"].impl("pallas_tpu")
    op = lambda *a: impl.call(*a, dtype=jnp.float32, **KW)
    names = re.findall(r"name=(mxfp4_experts_\d)", str(jax.make_jaxpr(op)(*tokens, w)))
    assert names == ["mxfp4_experts_2", "mxfp4_experts_1"]
    got = np.asarray(jax.jit(op)(*tokens, w))
    np.testing.assert_allclose(got, ref, atol=2e-6 * np.abs(ref).max())


def _abstract_20b(t=64, k=4, e=32, d=2880, f=2880):
    """gpt-oss-20b's decode MoE: 64 rows x top-4 of 32 MXFP4 experts, 2880 -> 2 x 2880."""
    s = jax.ShapeDtypeStruct
    mat = lambda i, o: MXFP4Array(s((e, i // 8, o), jnp.uint32), s((e, i // 32, o), jnp.uint8))
    bias = lambda o: s((e, o), jnp.bfloat16)
    w = ExpertWeights(mat(d, f), bias(f), mat(d, f), bias(f), mat(f, d), bias(d))
    return (s((t, d), jnp.bfloat16), s((t, k), jnp.float32), s((t, k), jnp.int32), w)


def test_kernel_lowers_for_tpu_at_gpt_oss_20b_shapes():
    """Pallas' TPU lowering (block shapes against Mosaic's tiling, every op supported) of
    both calls, without libtpu."""
    fn = lambda *a: mx.experts(*a, dtype=jnp.bfloat16, **KW)
    exported = jax.export.export(jax.jit(fn), platforms=["tpu"])(*_abstract_20b())
    names = re.findall(r'kernel_name = "(\w+)"', exported.mlir_module())
    assert names == ["mxfp4_experts_2", "mxfp4_experts_1"]


_COMPILE = """
import jax, jax.numpy as jnp
from jax.sharding import SingleDeviceSharding
from gpt_oss_train.aot import tpu
from gpt_oss_train.kernels.tpu import mxfp4_experts as mx
from test_tpu_mxfp4_experts import KW, _abstract_20b

sharding = SingleDeviceSharding(tpu.devices("v5e:1x1")[0])
placed = lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding)
args = jax.tree.map(placed, _abstract_20b())
fn = lambda *a: mx.experts(*a, dtype=jnp.bfloat16, **KW)
compiled = jax.jit(fn).lower(*args).compile()
print("compiled", "mxfp4_experts_2" in compiled.as_text())
"""


@pytest.mark.full
@pytest.mark.tpu
def test_mosaic_compiles_the_kernel_for_v5e():
    """libtpu's Mosaic compile for one v5e chip (~25 s), under libtpu's default flags: the
    VMEM the kernel asks for (VMEM_LIMIT) is what its blocks need."""
    pytest.importorskip("libtpu", reason="libtpu not installed (pip install -e '.[tpu]')")
    tests = [os.path.join(ROOT, "tests", "kernels"), os.path.join(ROOT, "tests")]
    # LIBTPU_INIT_ARGS empty: not aot/tpu.py's raised scoped VMEM limit
    env = dict(
        os.environ, JAX_PLATFORMS="cpu", LIBTPU_INIT_ARGS="", PYTHONPATH=os.pathsep.join(tests)
    )
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_COMPILE)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0 and "compiled True" in proc.stdout, proc.stderr[-3000:]
