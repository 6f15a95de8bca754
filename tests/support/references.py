"""Numerics written from their definitions in float64, for the tests to check the model's
and the kernels' against."""

import numpy as np


def expert_ffn(x, weights, idx, w, limit=7.0, alpha=1.702):
    """float64, from the definition (moe.py's docstring): token t's output is the routing
    weighted sum over its chosen experts e of
    (min(x Wg + bg, limit) * sigmoid(alpha * gate) * (clip(x Wu + bu) + 1)) Wo + bo,
    on dense [E, in, out] weights."""
    out = np.zeros((x.shape[0], w["wo"].shape[2]))
    for t in range(x.shape[0]):
        for weight, e in zip(weights[t], idx[t]):
            gate = np.minimum(x[t] @ w["wi_gate"][e] + w["bi_gate"][e], limit)
            up = np.clip(x[t] @ w["wi_up"][e] + w["bi_up"][e], -limit, limit)
            act = gate / (1 + np.exp(-alpha * gate)) * (up + 1)
            out[t] += weight * (act @ w["wo"][e] + w["bo"][e])
    return out
