"""Next-token loss without materialising [tokens, vocab] logits: sums over the masked
tokens of the per-token log-probabilities that model/logprobs.py computes chunk by chunk
(see there).
"""

from __future__ import annotations

import jax.numpy as jnp

from gpt_oss_train.kernels import AUTO_KERNELS
from gpt_oss_train.model.logprobs import token_logprobs


def lm_loss_sums(
    hidden_bsd,
    unembed_dv,
    targets_bs,
    mask_bs,
    *,
    chunk: int,
    dtype,
    kernels=AUTO_KERNELS,
    gather_once: bool = False,
):
    """Sums over masked tokens: (negative log-likelihood, z-loss term lse^2, token count).

    Sums, not means, so microbatches of a gradient-accumulation step add up to exactly the
    loss of the whole batch once divided by the total count."""
    logp, lse = token_logprobs(
        hidden_bsd,
        unembed_dv,
        targets_bs,
        chunk=chunk,
        dtype=dtype,
        kernels=kernels,
        gather_once=gather_once,
    )
    m = mask_bs.astype(jnp.float32)
    return -jnp.sum(logp * m), jnp.sum(jnp.square(lse) * m), jnp.sum(m)
