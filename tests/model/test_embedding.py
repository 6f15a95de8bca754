"""The sharded embedding lookup (embedding.py): rows and table gradients on meshes equal
a plain `take` with no mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gpt_oss_train import config as config_lib
from gpt_oss_train import sharding
from gpt_oss_train.model import embedding

V, D, S = 48, 16, 5


def _value_and_grad(table, tokens, probe):
    def f(table):
        x = embedding.lookup(table, tokens, jnp.float32)
        return jnp.sum(x * probe), x

    return jax.jit(jax.value_and_grad(f, has_aux=True))(table)


@pytest.mark.parametrize(
    "sizes, batch, seq",
    [
        (dict(data=1, fsdp=8, tensor=1, expert=1), 8, S),  # embed slices <-> batch rows
        (dict(data=2, fsdp=2, tensor=2, expert=1), 8, S),  # and the vocabulary split in two
        (dict(data=2, fsdp=1, tensor=1, expert=4), 8, S),  # embed not sharded
        (dict(data=1, fsdp=4, tensor=2, expert=1), 3, S),  # batch 3 splits over nothing
        # context parallelism: embed slices <-> batch rows and sequence pieces
        (dict(fsdp=2, context=4), 2, 8),
        (dict(fsdp=2, context=2, tensor=2), 4, 8),
    ],
)
def test_lookup_and_its_gradient_on_a_mesh_equal_take(sizes, batch, seq):
    rng = np.random.RandomState(0)
    table = jnp.asarray(rng.randn(V, D), jnp.float32)
    tokens = jnp.asarray(rng.randint(0, V, (batch, seq)), jnp.int32)
    tokens = tokens.at[0, :2].set(7)  # a repeated token: its gradient rows add up
    probe = jnp.asarray(rng.randn(batch, seq, D), jnp.float32)
    (ref_loss, ref_x), ref_grad = _value_and_grad(table, tokens, probe)
    np.testing.assert_array_equal(ref_x, np.asarray(table)[np.asarray(tokens)])

    rules = config_lib.DEFAULT_RULES
    mesh = sharding.make_mesh(sizes)
    with sharding.use_mesh(mesh, rules):
        put = lambda a, names: jax.device_put(
            a,
            jax.sharding.NamedSharding(
                mesh, sharding.fit_spec(sharding.logical_to_spec(names, rules), a.shape, mesh)
            ),
        )
        args = put(table, ("vocab", "embed")), put(tokens, ("batch", "length"))
        (loss, x), grad = _value_and_grad(*args, probe)
        if sizes.get("context", 1) > 1:
            # The table's slices trade places with rows and sequence pieces (all-to-all),
            # not gathered whole by the partitioner.
            hlo = jax.jit(embedding.lookup, static_argnums=2).lower(*args, jnp.float32)
            assert "all_to_all" in hlo.as_text()
    # A lookup moves values without arithmetic (the vocabulary split adds zeros): exact.
    np.testing.assert_array_equal(x, ref_x)
    # The gradient sums a token's rows in another order on a mesh: float32 ulps.
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-6, atol=1e-6)
    # The loss sums the same products in another order: ulps of the terms' magnitude.
    scale = float(np.abs(np.asarray(ref_x) * np.asarray(probe)).sum())
    np.testing.assert_allclose(loss, ref_loss, rtol=0, atol=1e-6 * scale)
