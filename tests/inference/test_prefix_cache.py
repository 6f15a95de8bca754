"""The prefix cache's host side (inference/prefix_cache.py) and the engine's prefill
chunking (slots.next_chunk): pure Python, checked against hand-worked cases."""

from gpt_oss_train.inference.prefix_cache import PrefixIndex, block_names
from gpt_oss_train.inference.slots import chunk_buckets, context_buckets, next_chunk, row_buckets


def test_block_names_name_whole_prefixes():
    a = block_names(list(range(40)), 16)
    assert len(a) == 2  # the last 8 tokens are no whole block
    b = block_names(list(range(32)) + [99] * 8, 16)
    assert b == a  # same first 32 tokens, same names
    c = block_names([1] + list(range(1, 40)), 16)
    assert c[0] != a[0] and c[1] != a[1]  # a change in block 0 renames every later block
    d = block_names(list(range(16)) + [7] * 16, 16)
    assert d[0] == a[0] and d[1] != a[1]


def test_lookup_takes_the_longest_held_run_of_leading_blocks():
    index = PrefixIndex(8)
    names = block_names(list(range(64)), 16)  # 4 blocks
    ids = index.allocate(names[:3], 0)
    assert len(set(ids)) == 3 and len(index) == 3
    assert index.lookup(names, 4) == ids  # block 3 was never stored
    assert index.lookup(names, 2) == ids[:2]  # capped
    other = block_names([5] + list(range(1, 64)), 16)
    assert index.lookup(other, 4) == []
    new = index.allocate(names, 2)  # blocks 2 and 3: 2 is held, 3 is new
    assert new[0] is None and new[1] not in ids and index.lookup(names, 4) == ids + new[1:]


def test_allocate_skips_held_blocks_and_evicts_chain_ends_first():
    index = PrefixIndex(4)
    a = block_names(list(range(48)), 16)  # chain a: 3 blocks
    ids_a = index.allocate(a, 0)
    assert index.allocate(a, 0) == [None, None, None]  # all held: nothing to write
    b = block_names([9] * 32, 16)  # chain b: 2 blocks, needs one eviction
    ids_b = index.allocate(b, 0)
    assert index.evictions == 1 and len(index) == 4
    # a's last block went (a's first blocks were touched after it), so a still matches 2
    assert index.lookup(a, 3) == ids_a[:2]
    assert ids_a[2] in ids_b  # its pool block was reused
    assert index.lookup(b, 2) == ids_b


def test_shape_buckets():
    assert row_buckets(16) == [1, 2, 4, 8, 16] and row_buckets(6) == [1, 2, 4, 6]
    assert chunk_buckets(256, 16) == [16, 32, 64, 128, 256]
    assert context_buckets(4096) == [256, 1024, 4096] and context_buckets(64) == [64]


def test_next_chunk_pads_little():
    chunks = chunk_buckets(256, 16)
    # (rest of the prompt) -> (chunk, prompt tokens in it), worked by hand: the rest in
    # one bucket unless a smaller full bucket plus the one after pads less
    cases = {1: (16, 1), 17: (32, 17), 24: (32, 24), 40: (32, 32), 100: (128, 100)}
    cases.update({130: (128, 128), 200: (256, 200), 300: (256, 256)})
    for rest, want in cases.items():
        assert next_chunk(rest, chunks) == want, rest
