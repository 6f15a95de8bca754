"""Long context: config.moe_token_tile runs the experts tile by tile (each tile
recomputed on its own in the backward) and gives the untiled layer's outputs, gradients
and load-balancing loss, on one device and under expert parallelism, in less temporary
memory; remat policy "offload_inputs" keeps each block's input in host memory and
differentiates as "full" does."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gpt_oss_train import config as config_lib
from gpt_oss_train import sharding
from gpt_oss_train.errors import ConfigError
from gpt_oss_train.model.transformer import ModelDef, MoE


def _model_config(**kw) -> config_lib.ModelConfig:
    c = config_lib.default_config()
    c.dtype = "float32"
    c.model.update(
        vocab_size=512,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        num_experts=8,
        experts_per_token=2,
        intermediate_size=16,
        sliding_window=8,
    )
    return config_lib.ModelConfig.from_config(c).replace(**kw)


def _inputs(b: int, s: int, d: int, seed: int = 0):
    """x [b, s, d] and the valid mask: each row's last 3 positions are padding (segment 0)."""
    rng = np.random.RandomState(seed)
    x = jnp.asarray(rng.randn(b, s, d), jnp.float32)
    valid = jnp.asarray(np.arange(s)[None, :] < s - 3).repeat(b, axis=0)
    return x, valid


def test_the_tile_is_a_config_knob_refused_below_zero():
    c = config_lib.default_config()
    assert c.moe_token_tile == 0  # off by default
    c.moe_token_tile = 4096
    assert config_lib.ModelConfig.from_config(c).moe_token_tile == 4096
    c.moe_token_tile = -1
    with pytest.raises(ConfigError) as e:
        config_lib.validate(c)
    assert str(e.value) == "config.moe_token_tile: must be >= 0 (0: no tiling)"


def _layer_loss(mc, state, x, valid):
    """The MoE layer's (loss, (y, aux)), the loss weighing every valid output."""
    y, aux = nnx.merge(nnx.graphdef(MoE(mc, rngs=nnx.Rngs(0))), state)(x, valid)
    return jnp.sum(jnp.sin(y) * valid[..., None]) + aux, (y, aux)


def _run(mc, state, x, valid):
    """y, aux and the gradients of the loss in the layer's parameters and its input, and
    the compiled program's HLO text."""
    fn = functools.partial(_layer_loss, mc)
    compiled = jax.jit(jax.grad(fn, argnums=(0, 1), has_aux=True)).lower(state, x, valid).compile()
    g, (y, aux) = compiled(state, x, valid)
    return y, aux, g, compiled.as_text()


def _assert_same(got, want, rtol):
    y, aux, g, _ = got
    y0, aux0, g0, _ = want
    np.testing.assert_allclose(y, y0, rtol=rtol, atol=rtol * np.abs(y0).max())
    assert float(aux) == float(aux0)  # routing runs untiled: the very same numbers
    for path, a, b in zip(
        jax.tree_util.tree_leaves_with_path(g0), jax.tree.leaves(g), jax.tree.leaves(g0)
    ):
        np.testing.assert_allclose(
            a, b, rtol=rtol, atol=rtol * np.abs(b).max(), err_msg=jax.tree_util.keystr(path[0])
        )


@pytest.mark.parametrize("impl", ["ragged", "dense"])
def test_tiled_moe_equals_untiled_with_gradients(impl):
    """26 tokens in tiles of 8 (4 positions of each of 2 rows): 4 tiles, the sequence of
    13 padded to 16, so the last positions of the tiles are padding whose outputs drop."""
    b, s = 2, 13
    mc = _model_config(moe_impl=impl)
    state = nnx.state(MoE(mc, rngs=nnx.Rngs(1)))
    x, valid = _inputs(b, s, mc.hidden_size)
    want = _run(mc, state, x, valid)
    got = _run(mc.replace(moe_token_tile=8), state, x, valid)
    _assert_same(got, want, rtol=1e-6)
    jaxpr = lambda tile: str(
        jax.make_jaxpr(functools.partial(_layer_loss, mc.replace(moe_token_tile=tile)))(
            state, x, valid
        )
    )
    tiled = jaxpr(8)
    assert "length=4" in tiled and "remat2[" in tiled  # 4 tiles, each rematerialised
    assert "remat2[" not in jaxpr(26)  # no more tokens than a tile: untiled


def test_tiled_moe_equals_untiled_under_expert_parallelism():
    """moe_impl "sharded" on 8 devices (batch over fsdp x expert, experts over expert):
    8 rows of 13 positions in tiles of 8 x 4, each tile's rows spread over every device."""
    b, s = 8, 13
    mc = _model_config(moe_impl="sharded")
    state = nnx.state(MoE(mc, rngs=nnx.Rngs(1)))
    x, valid = _inputs(b, s, mc.hidden_size, seed=1)
    want = _run(mc.replace(moe_impl="ragged"), state, x, valid)
    mesh = sharding.make_mesh(dict(data=1, fsdp=4, context=1, tensor=1, expert=2))
    with sharding.use_mesh(mesh, config_lib.DEFAULT_RULES):
        untiled = _run(mc, state, x, valid)
        got = _run(mc.replace(moe_token_tile=32), state, x, valid)
    _assert_same(untiled, want, rtol=1e-5)  # the sharded strategy itself, for scale
    _assert_same(got, untiled, rtol=1e-6)
    # Each device holds 1 row, 4 tokens of a tile, and gathers them only from the other
    # expert shard ([8, d]); tiles that lost the tokens' sharding would be gathered whole.
    # (The other gather ending in d: wo [4 experts, 16, d], sharding.gather_weight's.)
    gathered = set(re.findall(r"= f32\[([\d,]+),32\]\S* all-gather\(", got[3]))
    assert gathered == {"8", "4,16"}, gathered


def test_tiling_shrinks_the_temporary_memory_of_a_layer():
    """The compiled forward and backward of one MoE layer (ragged) at 4096 tokens, d 64,
    8 experts, k 2, expert hidden 128, measured on CPU with jax 0.10.2: 53.1 MB of
    temporaries untiled, 10.2 MB in tiles of 512 (the rest scales with the tokens: x,
    its gradient, the output, the routing). Asserted: under a third."""
    mc = _model_config(hidden_size=64, intermediate_size=128)
    state = nnx.state(MoE(mc, rngs=nnx.Rngs(1)))
    x, valid = _inputs(1, 4096, mc.hidden_size)

    def temp_bytes(cfg):
        grad = jax.grad(functools.partial(_layer_loss, cfg), argnums=(0, 1), has_aux=True)
        compiled = jax.jit(grad).lower(state, x, valid).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    untiled, tiled = temp_bytes(mc), temp_bytes(mc.replace(moe_token_tile=512))
    assert tiled < untiled / 3, (tiled, untiled)


def _model_grads(mc, params, tokens):
    md = ModelDef(mc)

    def loss(p):
        model = md.bind(p)
        h, aux, _ = model(tokens)
        return jnp.mean(model.logits(h) ** 2) + aux

    return jax.jit(jax.grad(loss)), loss


def test_offload_inputs_differentiates_as_full_and_puts_block_inputs_on_host():
    """On CPU the copy to host memory is no copy (the CPU's memory is the host's), so the
    policy runs with "full"'s gradients; lowered for TPU or GPU, each block's input goes to
    pinned host memory in the forward and comes back for the backward."""
    mc = _model_config(num_layers=4, moe_impl="dense")  # the quickest to compile
    rng = np.random.RandomState(0)
    params = jax.tree.map(  # not ModelDef.init: compiling the initializers takes longer
        lambda a: jnp.asarray(0.2 * rng.randn(*a.shape), a.dtype), ModelDef(mc).shapes()
    )
    tokens = jax.random.randint(jax.random.key(0), (2, 24), 0, mc.vocab_size)
    want, _ = _model_grads(mc, params, tokens)
    got, loss = _model_grads(mc.replace(remat_policy="offload_inputs"), params, tokens)
    for a, b in zip(jax.tree.leaves(got(params)), jax.tree.leaves(want(params))):
        np.testing.assert_array_equal(a, b)
    jaxpr = str(jax.make_jaxpr(jax.grad(loss))(params))
    assert "f32<host>[2,2,24,32]" in jaxpr  # both blocks' inputs, stacked, on host
    assert "f32[2,2,24,32]" not in jaxpr  # and no copy of them kept on the device
    for platform in ("tpu", "cuda"):
        text = got.trace(params).lower(lowering_platforms=(platform,)).as_text()
        assert text.count('_xla_buffer_placement = "pinned_host"') == 1, platform
        assert text.count('_xla_buffer_placement = "device"') == 1, platform
