"""MXFP4 decoded from the OCP Microscaling spec's bit fields by loops in float64, independent
of gpt_oss_train/arrays/mxfp4.py: the reference its codec and the MXFP4 kernels are checked
against."""

import numpy as np


def fp4(code: int) -> float:
    """E2M1 from its bit fields: sign, 2 exponent bits (bias 1), 1 mantissa bit."""
    sign = -1.0 if code & 8 else 1.0
    exp, man = (code >> 1) & 3, code & 1
    return sign * (man * 0.5 if exp == 0 else (1 + man * 0.5) * 2.0 ** (exp - 1))


def dequantize(blocks, scales):
    """float64 loops: [..., out, nblk, 16] / [..., out, nblk] -> [..., in, out]."""
    *lead, o, g, _ = blocks.shape
    b = blocks.reshape(-1, o, g, 16)
    s = scales.reshape(-1, o, g)
    out = np.zeros((b.shape[0], g * 32, o), np.float64)
    for e in range(b.shape[0]):
        for r in range(o):
            for j in range(g):
                for k in range(16):
                    byte = int(b[e, r, j, k])
                    scale = 2.0 ** (int(s[e, r, j]) - 127)
                    out[e, j * 32 + 2 * k, r] = fp4(byte & 0xF) * scale
                    out[e, j * 32 + 2 * k + 1, r] = fp4(byte >> 4) * scale
    return out.reshape(*lead, g * 32, o)
