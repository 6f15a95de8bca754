"""Context parallelism (kernels/xla/context_parallel.py): sequences split over the
`context` mesh axis give the loss and gradients of the same step with no mesh, for both
layer types, packed segments and padding; the banded layers move only the previous
shard's last keys."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from gpt_oss_train import config as config_lib
from gpt_oss_train import sharding
from gpt_oss_train.kernels.xla import attention
from gpt_oss_train.model.transformer import ModelDef
from gpt_oss_train.training import objectives

B, S = 2, 1024
WINDOW = 128  # gpt-oss's: the banded layers need the previous shard's last 128 keys
RULES = config_lib.DEFAULT_RULES


def _config(**model):
    """The tiny preset (2 layers of width 64, 4 experts, GQA 4:2) at gpt-oss's window."""
    c = config_lib.default_config()
    c.dtype = "float32"
    c.model.update(vocab_size=512, intermediate_size=32, sliding_window=WINDOW, **model)
    c.train.update(seq_len=S, loss_chunk_size=256)
    return c


def _packed_batch(seed=0):
    """Rows of several documents each (positions restart, segment ids count up), the
    last one cut by padding (segment 0), split at lengths that cross shard borders."""
    rng = np.random.RandomState(seed)
    tokens = rng.randint(0, 512, (B, S + 1)).astype(np.int32)
    positions = np.zeros((B, S), np.int32)
    segments = np.zeros((B, S), np.int32)
    for row, cuts in enumerate(([0, 300, 301, 700, 1000], [0, 90, 600, 1024])):
        for seg, (a, b) in enumerate(zip(cuts[:-1], cuts[1:]), start=1):
            positions[row, a:b] = np.arange(b - a)
            segments[row, a:b] = seg
    mask = (segments > 0).astype(np.int32)
    return {
        "inputs": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "positions": np.where(mask > 0, positions, -1).astype(np.int32),
        "segment_ids": segments,
        "loss_mask": mask,
    }


def _model_def(cfg):
    return ModelDef(config_lib.ModelConfig.from_config(cfg))


def _loss_and_grads(cfg, model_def, params, batch):
    loss_fn = objectives.lm_loss_fn(model_def, cfg.train)

    def f(params):
        objective, stats = loss_fn(params, batch)
        return objective / stats["tokens"]

    return jax.jit(jax.value_and_grad(f))(params)


def _on_mesh(cfg, params, batch):
    mesh = sharding.make_mesh(dict(cfg.mesh))
    model_def = _model_def(cfg)  # outside the mesh: NNX reads the logical names as mesh axes
    with sharding.use_mesh(mesh, RULES):
        params = jax.device_put(params, model_def.shardings(mesh, RULES))
        spec = sharding.logical_to_spec(("batch", "length"), RULES)
        rows = NamedSharding(mesh, sharding.fit_spec(spec, (B, S), mesh))
        batch = jax.device_put(batch, rows)
        return _loss_and_grads(cfg, model_def, params, batch)


@pytest.mark.parametrize(
    "mesh,moe_impl,block",
    [
        (dict(data=1, fsdp=2, context=4, tensor=1, expert=1), "ragged", 512),
        (dict(data=1, fsdp=2, context=4, tensor=1, expert=1), "ragged", 64),  # query blocks
        (dict(data=1, fsdp=2, context=2, tensor=1, expert=2), "sharded", 128),
        (dict(data=1, fsdp=1, context=2, tensor=2, expert=2), "sharded", 512),  # heads split
    ],
)
def test_context_parallel_step_equals_the_unsplit_step(mesh, moe_impl, block):
    cfg = _config()
    cfg.update(moe_impl=moe_impl, attention_block=block)
    cfg.mesh.update(mesh)
    batch = {k: jnp.asarray(v) for k, v in _packed_batch().items()}
    model_def = _model_def(cfg)
    params = model_def.init(0)
    ref_loss, ref_grads = _loss_and_grads(cfg, model_def, params, batch)
    loss, grads = _on_mesh(cfg, params, batch)
    # float32 sums in another order over the shards: a few ulps (the bound, 1e-5)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    flat_ref = jax.tree_util.tree_leaves_with_path(ref_grads)
    for (path, g_ref), g in zip(flat_ref, jax.tree.leaves(grads)):
        scale = float(np.abs(g_ref).max()) or 1.0
        err = float(np.abs(np.asarray(g) - np.asarray(g_ref)).max()) / scale
        assert err < 1e-5, (jax.tree_util.keystr(path), err)


def test_banded_layers_move_only_the_previous_shards_last_keys():
    """The compiled step's collective permutes are the banded layers' tails (128 keys a
    row, of K, V, positions, segment ids, and their gradients back); the full layers'
    keys travel by all-gather. (moe_impl "sharded", as configs on a mesh run it: the
    partitioner's "ragged" moves tokens between devices of its own accord.)"""
    cfg = _config(num_layers=2)
    cfg.moe_impl = "sharded"
    cfg.mesh.update(dict(data=1, fsdp=2, context=4, tensor=1, expert=1))
    mesh = sharding.make_mesh(dict(cfg.mesh))
    model_def = _model_def(cfg)
    loss_fn = objectives.lm_loss_fn(model_def, cfg.train)
    batch = {k: jnp.asarray(v) for k, v in _packed_batch().items()}
    with sharding.use_mesh(mesh, RULES):
        params = model_def.init(0, mesh, RULES)
        rows = NamedSharding(mesh, sharding.logical_to_spec(("batch", "length"), RULES))
        batch = jax.device_put(batch, rows)
        grad = jax.jit(jax.grad(lambda p: loss_fn(p, batch)[0]))
        hlo = grad.lower(params).compile().as_text()
    permutes = re.findall(r"= ([a-z0-9]+)\[([0-9,]*)\][^=]*? collective-permute(?:-start)?\(", hlo)
    assert permutes, "no collective permute: the banded layers' neighbour exchange is missing"
    lead = attention.lead_keys(WINDOW)
    local = S // 4
    for _dtype, dims in permutes:
        shape = tuple(int(d) for d in dims.split(",") if d)
        # one row a device (batch 2 over fsdp 2), `lead` keys: never a whole shard
        assert lead in shape and local not in shape, shape
    gathers = re.findall(r"= f32\[([0-9,]*)\][^=]*? all-gather(?:-start)?\(", hlo)
    assert any(str(S) in g.split(",") for g in gathers), "the full layers gather no keys"


def test_a_shard_shorter_than_the_banded_layers_reach_is_refused():
    cfg = _config()
    cfg.train.seq_len = 512
    cfg.mesh.update(dict(data=1, fsdp=1, context=8, tensor=1, expert=1))
    with pytest.raises(config_lib.ConfigError, match="mesh.context"):
        config_lib.validate(cfg)


@pytest.mark.parametrize("window", [None, 16])
def test_streamed_keys_equal_the_whole_softmax(window):
    """A full layer's keys taken 48 at a time (an online softmax, the sink in the running
    denominator from the start) against all at once: the outputs and gradients of
    queries over 200 keys with packed segments and padding (float32: summation order)."""
    rng = np.random.RandomState(3)
    b, s, n, kh, h = 2, 200, 4, 2, 8
    q, k, v = (rng.randn(b, s, heads, h).astype(np.float32) for heads in (n, kh, kh))
    sinks = rng.randn(n).astype(np.float32)
    seg = np.repeat([[1] * 70 + [2] * 100 + [0] * 30], b, axis=0)
    pos = np.where(seg > 0, np.concatenate([np.arange(70), np.arange(130)])[None], -1)
    ref = lambda q, k, v, snk: attention.xla_attention(
        q, k, v, snk, attention.visibility_mask(pos, pos, seg, seg, window)
    )
    got = lambda q, k, v, snk: attention.blockwise_attention(
        q, k, v, snk, pos, pos, seg, seg, window, 64, key_block=48
    )
    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))
    args = tuple(jnp.asarray(a) for a in (q, k, v, sinks))
    want = jax.value_and_grad(loss(ref), argnums=(0, 1, 2, 3))(*args)
    have = jax.value_and_grad(loss(got), argnums=(0, 1, 2, 3))(*args)
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(have)):
        np.testing.assert_allclose(g, w, atol=1e-5 * float(np.abs(w).max()))
