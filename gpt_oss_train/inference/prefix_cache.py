"""Which prompt prefixes the prefix pool holds: block-aligned hashing and LRU eviction.

A prompt is cut into blocks of `block` tokens; block i is named by a hash of its tokens
and of block i-1's name, so equal names mean equal prefixes. The first block's name also
covers the LoRA adapter the prompt runs with: the same tokens under another adapter have
other keys and values, so they never share blocks. The pool (engine_steps.py) keeps the
keys and values of every position of each stored block, both layer kinds, so a later
prompt sharing the first n blocks starts its prefill at n * block. Blocks are shared by
every prompt with that prefix (a long Harmony system/developer message is stored once)
and evicted least recently used first; a block's parent is always used at least as
recently as the block itself, so eviction takes the ends of chains first.

Host-side bookkeeping only: the engine's thread owns it, no locking.
"""

from __future__ import annotations

import collections
import hashlib
from typing import Sequence

import numpy as np


def block_names(tokens: Sequence[int], block: int, adapter: int = 0) -> list[bytes]:
    """One name per whole block of `tokens` run with adapter slot `adapter` (0: the base
    or the one unstacked adapter), each covering the adapter and the prefix up to its end."""
    names, parent = [], b"" if adapter == 0 else b"adapter %d" % adapter
    ids = np.asarray(tokens, np.int64)
    for start in range(0, len(ids) - block + 1, block):
        parent = hashlib.blake2b(parent + ids[start : start + block].tobytes(), digest_size=16)
        parent = parent.digest()
        names.append(parent)
    return names


class PrefixIndex:
    """Maps block names to pool block ids, `num_blocks` of them, LRU-evicted."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._ids: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self._free = list(range(num_blocks - 1, -1, -1))
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._ids)

    def lookup(self, names: Sequence[bytes], max_blocks: int) -> list[int]:
        """Pool ids of the longest run of leading blocks held (at most max_blocks), which
        become the most recently used (the first block most of all)."""
        found = []
        for name in names[:max_blocks]:
            if name not in self._ids:
                break
            found.append(name)
        for name in reversed(found):
            self._ids.move_to_end(name)
        return [self._ids[n] for n in found]

    def allocate(self, chain: Sequence[bytes], first: int) -> list[int | None]:
        """A pool id for each of chain[first:] not held yet (evicting the least recently
        used), None for those already held. `chain` is a prompt's names from its first
        block: all of them are then touched, parents last, so that a chain is evicted
        from its end. The caller writes the new blocks; at most num_blocks per call."""
        if len(chain) - first > self.num_blocks:
            raise ValueError(f"{len(chain) - first} blocks do not fit a pool of {self.num_blocks}")
        out: list[int | None] = []
        for name in chain[first:]:
            if name in self._ids:
                out.append(None)
                continue
            if not self._free:
                _, freed = self._ids.popitem(last=False)
                self._free.append(freed)
                self.evictions += 1
            out.append(self._free.pop())
            self._ids[name] = out[-1]
        for name in reversed(chain):
            if name in self._ids:
                self._ids.move_to_end(name)
        return out
