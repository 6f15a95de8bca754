"""Tests for gpt_oss_train.arrays.mxfp4: the E2M1 value table, nibble order and scales, and
round-to-nearest-even quantization, against a bit-field reference (conftest's mxfp4_reference)."""

import numpy as np

from gpt_oss_train.arrays import mxfp4
from gpt_oss_train.arrays.mxfp4 import dequantize_mxfp4, quantize_mxfp4


def test_fp4_lut_matches_bit_fields(mxfp4_reference):
    fp4_ref, _ = mxfp4_reference
    assert [fp4_ref(c) for c in range(16)] == mxfp4.FP4_VALUES.tolist()
    assert np.signbit(mxfp4.FP4_VALUES[8]) and not np.signbit(mxfp4.FP4_VALUES[0])


def test_mxfp4_nibble_order_and_scale():
    blocks = np.zeros((1, 1, 16), np.uint8)
    blocks[0, 0, 0] = 0x21  # low nibble 1 (0.5) = element 0, high nibble 2 (1.0) = element 1
    blocks[0, 0, 15] = 0xF7  # element 30 = 6.0, element 31 = -6.0
    for s, mult in ((127, 1.0), (130, 8.0), (125, 0.25)):
        out = dequantize_mxfp4(blocks, np.full((1, 1), s, np.uint8))
        assert out.shape == (32, 1) and out.dtype == np.float32
        assert out[:2, 0].tolist() == [0.5 * mult, 1.0 * mult]
        assert out[30:, 0].tolist() == [6.0 * mult, -6.0 * mult]
        assert not out[2:30].any()
    # Smallest scale: 0.5 * 2**-127 = 2**-128 is a float32 subnormal, still exact.
    out = dequantize_mxfp4(blocks, np.zeros((1, 1), np.uint8))
    assert out[0, 0] == np.float32(2.0**-128) and out[0, 0] > 0


def test_dequantize_matches_bitfield_reference(mxfp4_reference):
    _, dequant_ref = mxfp4_reference
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, size=(2, 3, 2, 16), dtype=np.uint8)
    scales = rng.integers(110, 145, size=(2, 3, 2), dtype=np.uint8)
    scales[0, 0, 0], scales[1, 2, 1] = 0, 1  # subnormal range
    got = dequantize_mxfp4(blocks, scales)
    assert got.shape == (2, 64, 3) and got.dtype == np.float32
    np.testing.assert_array_equal(got.astype(np.float64), dequant_ref(blocks, scales))
    # No leading axis.
    np.testing.assert_array_equal(dequantize_mxfp4(blocks[1], scales[1]), got[1])
    # More output rows than one internal chunk.
    blocks = rng.integers(0, 256, size=(600, 1, 16), dtype=np.uint8)
    scales = rng.integers(120, 135, size=(600, 1), dtype=np.uint8)
    np.testing.assert_array_equal(
        dequantize_mxfp4(blocks, scales).astype(np.float64), dequant_ref(blocks, scales)
    )


def test_quantize_mxfp4_exact_on_representable_and_nearest_otherwise():
    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, size=(3, 64, 2, 16), dtype=np.uint8)
    scales = rng.integers(100, 150, size=(3, 64, 2), dtype=np.uint8)
    w = dequantize_mxfp4(blocks, scales)  # [3, 64, 64], representable
    b2, s2 = quantize_mxfp4(w)
    assert b2.shape == blocks.shape and s2.shape == scales.shape
    back = dequantize_mxfp4(b2, s2)
    assert back.tobytes() == w.tobytes()  # bit exact, including -0.0

    x = rng.standard_normal((2, 64, 40)).astype(np.float32) * 3
    x[0, :32, 0] = 0.0  # an all-zero block
    b, s = quantize_mxfp4(x)
    q = dequantize_mxfp4(b, s)
    assert not q[0, :32, 0].any()
    grid = np.array(sorted(set(np.abs(mxfp4.FP4_VALUES).tolist())))
    for e in range(2):
        for o in range(40):
            for j in range(2):
                blk = x[e, 32 * j : 32 * j + 32, o].astype(np.float64)
                amax = np.abs(blk).max()
                if amax == 0:
                    continue
                step = 2.0 ** (int(s[e, o, j]) - 127)
                # Smallest scale that fits: 3 < amax/step <= 6.
                assert 3 < amax / step <= 6
                # Each value is the nearest grid point of |x|/step.
                y = np.abs(blk) / step
                nearest = grid[np.argmin(np.abs(y[:, None] - grid[None]), axis=1)]
                np.testing.assert_array_equal(np.abs(q[e, 32 * j : 32 * j + 32, o]) / step, nearest)
                assert np.all(
                    (np.sign(q[e, 32 * j : 32 * j + 32, o]) == np.sign(blk)) | (nearest == 0)
                )


def test_quantize_mxfp4_ties_round_to_even_code():
    # amax 6 -> scale 127 (step 1); midpoints between neighbours go to the even code.
    x = np.zeros((32, 1), np.float32)
    x[:8, 0] = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    x[8:11, 0] = [-0.75, -5.0, -0.0]
    b, s = quantize_mxfp4(x)
    assert s.tolist() == [[127]]
    q = dequantize_mxfp4(b, s)[:, 0]
    assert q[:8].tolist() == [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert q[8:10].tolist() == [-1.0, -4.0] and np.signbit(q[10])
    assert b[0, 0, 0] == 0x07  # element 0 = 6.0 (code 7) in the low nibble, element 1 = +0
