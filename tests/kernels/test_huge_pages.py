"""Weights backed by 2 MB pages: checked in the kernel's own account of the process's
memory (/proc/self/smaps), not in what the call returns."""

import sys

import jax
import numpy as np
import pytest

from gpt_oss_train.kernels.cpu import huge_pages

MB = 1 << 20


def test_aligned_range_keeps_only_whole_huge_pages_inside_the_buffer():
    two = 2 * MB
    assert huge_pages.aligned_range(two, 3 * two) == (two, 3 * two)
    assert huge_pages.aligned_range(two + 64, 3 * two) == (2 * two, 2 * two)
    assert huge_pages.aligned_range(two + 64, two) == (2 * two, 0)
    assert huge_pages.aligned_range(two - 64, two + 128) == (two, two)


def _thp_mode() -> str:
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return "never"
    return text.split("[")[1].split("]")[0]


def anon_huge_bytes(start: int, end: int) -> int:
    """AnonHugePages of the mappings overlapping [start, end), from /proc/self/smaps."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:
                lo, hi = (int(v, 16) for v in fields[0].split("-"))
                inside = lo < end and hi > start
            elif inside and fields[0] == "AnonHugePages:":
                total += int(fields[1]) * 1024
    return total


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or _thp_mode() == "never",
    reason="needs Linux with transparent huge pages not disabled",
)
def test_large_cpu_arrays_are_collapsed_into_huge_pages_with_their_values_kept():
    # 64 MB: above glibc's largest mmap threshold, so the array has its own mapping (the
    # kernel refuses to collapse glibc's per-thread heaps).
    values = np.random.default_rng(0).standard_normal((64 * MB) // 4, dtype=np.float32)
    small = jax.device_put(np.ones(1024, np.float32))
    big = jax.jit(lambda x: x * 2.0)(values)
    address = big.unsafe_buffer_pointer()
    start, length = huge_pages.aligned_range(address, big.nbytes)
    assert length >= 62 * MB

    done = huge_pages.back_with_huge_pages({"big": big, "small": small})

    assert done == length  # the small array is left alone
    assert anon_huge_bytes(start, start + length) >= length
    np.testing.assert_array_equal(np.asarray(big), values * 2.0)
    np.testing.assert_array_equal(np.asarray(small), 1.0)
