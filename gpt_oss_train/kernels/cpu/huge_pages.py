"""Backing the CPU's copies of large arrays (the weights decode streams every step) with
2 MB transparent huge pages.

A batch-1 decode step reads every active weight once; with 4 KB pages that is a page-table
walk every 4 KB streamed, and the walks cost a few percent of a read-bound step. Linux
gives huge pages to memory that asks (`/sys/kernel/mm/transparent_hugepage/enabled` is
`madvise` on most distributions): `madvise(MADV_HUGEPAGE)` marks a range and
`madvise(MADV_COLLAPSE)` (Linux 6.1+) rebuilds its pages as huge pages now, rather than
whenever khugepaged gets to it. Only whole, aligned 2 MB pages inside a buffer are
touched, so nothing outside it changes; where the kernel says no, a buffer stays as it
was.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Iterable

import jax
from absl import logging

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
# Smaller arrays span few pages, and most sit in glibc's per-thread heaps, which the
# kernel refuses to collapse: not worth a call.
MIN_BYTES = 4 * HUGE_PAGE


def aligned_range(address: int, nbytes: int) -> tuple[int, int]:
    """The whole huge pages inside [address, address + nbytes): (start, length), length 0
    when there is none."""
    start = -(-address // HUGE_PAGE) * HUGE_PAGE
    end = (address + nbytes) // HUGE_PAGE * HUGE_PAGE
    return start, max(0, end - start)


def _cpu_buffers(tree) -> Iterable[tuple[int, int]]:
    """(address, nbytes) of each CPU buffer of the tree's arrays at least MIN_BYTES long."""
    for leaf in jax.tree.leaves(tree):
        for shard in getattr(leaf, "addressable_shards", ()):
            data = shard.data
            if data.platform() != "cpu" or data.nbytes < MIN_BYTES:
                continue
            yield data.unsafe_buffer_pointer(), data.nbytes


def _madvise():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc.madvise


def back_with_huge_pages(tree) -> int:
    """Asks Linux to back the CPU buffers of `tree`'s arrays with huge pages, now. Returns
    the bytes it collapsed (0 off Linux, on accelerators, or where transparent huge pages
    are disabled). A buffer the kernel refuses (glibc's per-thread heaps, where XLA puts
    some arrays under 32 MB) keeps its 4 KB pages."""
    if not sys.platform.startswith("linux"):
        return 0
    # A collapse that races the computation still writing a buffer fails (EINVAL).
    buffers = list(_cpu_buffers(jax.block_until_ready(tree)))
    if not buffers:
        return 0
    madvise = _madvise()
    done, refused, errno = 0, 0, 0
    for address, nbytes in buffers:
        start, length = aligned_range(address, nbytes)
        if not length:
            continue
        if madvise(start, length, MADV_HUGEPAGE) or madvise(start, length, MADV_COLLAPSE):
            refused, errno = refused + length, ctypes.get_errno()
        else:
            done += length
    logging.info(
        "Weights on 2 MB pages: %.2f GB; refused: %.2f GB (madvise errno %d)",
        done / 1e9,
        refused / 1e9,
        errno,
    )
    return done
