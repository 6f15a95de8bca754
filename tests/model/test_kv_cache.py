"""The KV cache is placed by the logical axis rules like every other array: created
sharded under jit, and decoding on a tensor x expert mesh gives the single-device tokens."""

import logging

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gpt_oss_train.inference import loading
from gpt_oss_train.model import kv_cache

pytestmark = pytest.mark.full  # sharded caches on a mesh of 8

PROMPTS = [[5, 9, 200, 17, 3, 3, 8], [1, 2], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49], [7] * 5]


def _model(mesh, devices):
    config = loading.default_runtime_config()
    config.dtype = "float32"
    config.model.update(vocab_size=512, num_experts=8, sliding_window=4)
    config.mesh.update(mesh)
    return loading.random_model(config, devices=devices)


def test_cache_is_sharded_by_rules_and_decoding_matches_one_device():
    sharded = _model(dict(data=1, fsdp=1, tensor=2, expert=4), jax.devices())
    single = _model(dict(data=1, fsdp=1, tensor=1, expert=1), jax.devices()[:1])
    gen = sharded.generator(prefill_chunk=16, int8_kv_cache=False)
    with sharded.scope():
        cache, last, lengths = gen.prefill(PROMPTS, max_len=32)
    # [layers, batch, slots, kv_heads, head_dim]: rows over the batch axes (4 rows over
    # data x fsdp x expert = 4), KV heads over tensor (2 heads, 2 ways).
    rows = ("data", "fsdp", "expert")
    kv = NamedSharding(sharded.mesh, P(None, rows, None, "tensor", None))
    pos = NamedSharding(sharded.mesh, P(None, rows, None))
    for kind, c in cache.items():
        assert c.k.sharding.is_equivalent_to(kv, 5), (kind, c.k.sharding)
        assert c.v.sharding.is_equivalent_to(kv, 5), (kind, c.v.sharding)
        assert c.pos.sharding.is_equivalent_to(pos, 3), (kind, c.pos.sharding)
        assert len({s.device for s in c.k.addressable_shards}) == 8
        assert c.k.addressable_shards[0].data.shape[1:] == (1, c.k.shape[2], 1, c.k.shape[4])
    assert cache["sliding"].k.shape[2] == 16 and cache["full"].k.shape[2] == 32
    # born that way: kv_cache.init places the empty cache by the rules, int8 scales too
    with sharded.scope():
        empty = kv_cache.init(sharded.cfg, 4, 32, 16, jax.numpy.float32, int8=True)
    # (the slots' rule names `context`, one device here: equivalent to unsplit)
    assert empty["full"].k.sharding.is_equivalent_to(kv, 5)
    assert empty["full"].k_scale.sharding.is_equivalent_to(kv, 5)
    assert empty["sliding"].pos.sharding.is_equivalent_to(pos, 3)
    assert empty["full"].k.sharding.spec[3] == "tensor"

    def greedy(model):
        with model.scope():
            outs = model.generator(16, False).generate(PROMPTS, max_new_tokens=12, stop_ids=[])
        return [o["tokens"] for o in outs], np.array([o["logprobs"] for o in outs])

    tokens, logprobs = greedy(sharded)
    ref_tokens, ref_logprobs = greedy(single)
    assert tokens == ref_tokens
    np.testing.assert_allclose(logprobs, ref_logprobs, atol=1e-5)


def test_a_cache_shape_is_compiled_once():
    """Each request's prefill makes an empty cache; the function that makes it is jitted
    once per shape and mesh, not traced and compiled per request (~60 ms of every time
    to first token on a CPU)."""
    single = _model(dict(data=1, fsdp=1, tensor=1, expert=1), jax.devices()[:1])
    compiled = []
    with jax.log_compiles(True), single.scope():

        class Count(logging.Handler):
            def emit(self, record):
                if "make" in record.getMessage() and "Compiling" in record.getMessage():
                    compiled.append(record.getMessage())

        handler = Count()
        logging.getLogger("jax").addHandler(handler)
        try:
            for _ in range(3):
                c = kv_cache.init(single.cfg, 2, 48, 16, jax.numpy.float32)
                c["full"].k.block_until_ready()
        finally:
            logging.getLogger("jax").removeHandler(handler)
    assert len(compiled) <= 1, compiled
    assert np.all(np.asarray(c["full"].pos) == -1) and c["full"].k.shape[2] == 48
