"""A decode batch through MXFP4 experts, for the kernels' and the sharded MoE's tests: random
tokens and routing, experts quantized from random floats, and the float64 dequantization of
their bytes by the spec's reference (mxfp4_reference.py)."""

import jax
import jax.numpy as jnp
import numpy as np

from gpt_oss_train.arrays import mxfp4_array
from gpt_oss_train.kernels.xla.experts import ExpertWeights
from support import mxfp4_reference


def case(t, k, e, d, f, seed, crowd=False):
    """(x, weights, idx), ExpertWeights with MXFP4 matrices, and the float64 matrices and
    biases. crowd: every token's first choice is the last expert, whose rows then fill
    several tiles."""
    rng = np.random.RandomState(seed)
    x = rng.randn(t, d)
    idx = np.stack([rng.choice(e, k, replace=False) for _ in range(t)])
    if crowd:
        idx[:, 0] = e - 1
        idx[:, 1:] = np.stack([rng.choice(e - 1, k - 1, replace=False) for _ in range(t)])
    weights = rng.dirichlet(np.ones(k), t)
    shapes = dict(wi_gate=(e, d, f), wi_up=(e, d, f), wo=(e, f, d))
    quantize = jax.jit(mxfp4_array.quantize)
    packed = {n: quantize(jnp.asarray(rng.randn(*s) * 0.3, jnp.float32)) for n, s in shapes.items()}
    deq = {
        n: mxfp4_reference.dequantize(*map(np.asarray, mxfp4_array.to_file(p.blocks, p.scales)))
        for n, p in packed.items()
    }
    biases = dict(bi_gate=rng.randn(e, f), bi_up=rng.randn(e, f), bo=rng.randn(e, d))
    w = ExpertWeights(**packed, **{n: jnp.asarray(b, jnp.float32) for n, b in biases.items()})
    tokens = (jnp.asarray(x, jnp.float32), jnp.asarray(weights, jnp.float32), jnp.asarray(idx))
    return tokens, w, {**deq, **biases}
