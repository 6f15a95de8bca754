"""The math of two preference/RL objectives on per-token log-probs: DPO and GRPO.

No model code: callers (training/objectives.py) compute per-token log-probs of completions
(loss.token_logprobs) under the policy, and where needed under a frozen reference or the
policy that sampled the data, and pass them here. Like the LM loss, every objective comes
back as a SUM plus a normalizer, and every statistic as a sum with its own count: the
gradient-accumulation path adds the sums of its microbatches and divides once by the summed
normalizer, which is exactly the whole batch's mean.

DPO (Rafailov et al. 2023; TRL DPOTrainer loss_type="sigmoid", with TRL's cDPO label
smoothing): for a pair with sequence log-probs pi_c, pi_r (policy) and ref_c, ref_r
(reference), h = (pi_c - ref_c) - (pi_r - ref_r) and
    loss = -(1 - ls) * logsigmoid(beta * h) - ls * logsigmoid(-beta * h).

GRPO (Shao et al. 2024; TRL GRPOTrainer): advantages are rewards normalised within each
group of completions of one prompt (the rollouts': post_training/rollouts.group_advantages),
and the per-token objective is PPO's clipped surrogate plus an optional k3 KL penalty
towards a reference; see grpo_sums for the averagings.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# TRL's names for the ways of averaging the per-token GRPO loss, see grpo_sums; declared in
# config.py, which validates config.rl.averaging against them.
from gpt_oss_train.config import GRPO_AVERAGINGS as AVERAGINGS

# What grpo_sums' stats hold (sums over tokens, and the rows with tokens).
GRPO_STATS = ("tokens", "sequences", "ratio", "clipped", "kl", "policy_loss")
# What dpo_sums' stats hold (sums over pairs).
DPO_STATS = (
    "chosen_reward",
    "rejected_reward",
    "margin",
    "accuracy",
    "chosen_logp",
    "rejected_logp",
)


def sequence_logprobs(token_logps, mask):
    """[b, s] per-token log-probs -> [b] float32 sums over the tokens where mask is set.
    A select, not a product, so garbage (even -inf) in masked positions cannot leak in."""
    return jnp.sum(jnp.where(mask, token_logps.astype(jnp.float32), 0.0), axis=-1)


# ----------------------------------------------------------------------------- DPO


def dpo_sums(
    policy_chosen,
    policy_rejected,
    ref_chosen,
    ref_rejected,
    *,
    beta: float,
    label_smoothing: float = 0.0,
    weights=None,
):
    """DPO over [b] sequence log-probs -> (loss_sum, count, stats).

    loss_sum = sum_i w_i * loss_i (formula in the module docstring), count = sum_i w_i.
    `weights` [b] (default all ones) is 1 for real pairs and 0 for padding rows, whose
    inputs must still be finite (sequence_logprobs of an all-masked row is 0). The reference
    log-probs are constants of the objective, so they carry no gradient. stats are sums over
    pairs (divide by count): chosen_reward = beta*(pi_c - ref_c), rejected_reward likewise,
    margin = their difference, accuracy = [chosen_reward > rejected_reward], chosen_logp
    and rejected_logp (the policy's)."""
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    pi_c, pi_r = f32(policy_chosen), f32(policy_rejected)
    ref_c, ref_r = jax.lax.stop_gradient(f32(ref_chosen)), jax.lax.stop_gradient(f32(ref_rejected))
    w = jnp.ones_like(pi_c) if weights is None else f32(weights)

    chosen_reward = beta * (pi_c - ref_c)
    rejected_reward = beta * (pi_r - ref_r)
    logits = chosen_reward - rejected_reward  # beta * h
    # cDPO: with probability ls the preference label is flipped.
    loss = -(1.0 - label_smoothing) * jax.nn.log_sigmoid(logits) - (
        label_smoothing * jax.nn.log_sigmoid(-logits)
    )

    wsum = lambda x: jnp.sum(w * jax.lax.stop_gradient(x))
    stats = {
        "chosen_reward": wsum(chosen_reward),
        "rejected_reward": wsum(rejected_reward),
        "margin": wsum(logits),
        "accuracy": wsum((chosen_reward > rejected_reward).astype(jnp.float32)),
        "chosen_logp": wsum(pi_c),
        "rejected_logp": wsum(pi_r),
    }
    return jnp.sum(w * loss), jnp.sum(w), stats


# ----------------------------------------------------------------------------- GRPO


def _clipped_surrogate(ratio, adv, epsilon_low, epsilon_high):
    """PPO's per-token loss -min(ratio*A, clip(ratio, 1-el, 1+eh)*A), and where the clipped
    term won (ratio left the band in the direction A pushes it: its gradient is zero)."""
    loss = -jnp.minimum(ratio * adv, jnp.clip(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high) * adv)
    clipped = ((ratio < 1.0 - epsilon_low) & (adv < 0)) | ((ratio > 1.0 + epsilon_high) & (adv > 0))
    return loss, clipped


def grpo_sums(
    logp,
    old_logp,
    advantages,
    mask,
    *,
    ref_logp=None,
    kl_coef: float = 0.0,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    averaging: str = "token",
    max_completion_length: int | None = None,
):
    """GRPO over [b, s] per-token log-probs of completions -> (loss_sum, normalizer, stats).

    Per token, with ratio = exp(logp - old_logp) (old_logp from the sampling policy, no
    gradient) and A the row's advantage:
        l = -min(ratio*A, clip(ratio, 1-epsilon_low, 1+epsilon_high)*A) + kl_coef * k3,
        k3 = exp(ref - logp) - (ref - logp) - 1 (Schulman's unbiased KL estimator, as TRL;
        ref_logp carries no gradient; kl_coef != 0 needs ref_logp).
    The loss is loss_sum / normalizer, with `averaging` (TRL's loss_type):
      "sequence" (TRL "grpo"): each row's mean over its tokens, then the mean over rows;
          loss_sum = sum of row means, normalizer = rows with >= 1 token (so all-masked
          padding rows do not dilute it).
      "token" (TRL "bnpo", DAPO): sum over all tokens / number of tokens.
      "dr_grpo": sum over all tokens / (rows with >= 1 token * max_completion_length), a
          constant per row, without the length bias of per-row means. max_completion_length
          defaults to s.
    stats are sums over masked tokens unless named otherwise (divide by stats["tokens"]):
    tokens, sequences (rows with >= 1 token), ratio, clipped (tokens where the clipped term
    won: ratio < 1-epsilon_low with A < 0, or ratio > 1+epsilon_high with A > 0; its
    gradient is zero), kl (k3, zero without ref_logp), policy_loss (the surrogate alone)."""
    if averaging not in AVERAGINGS:
        raise ValueError(f"averaging must be one of {AVERAGINGS}, got {averaging!r}")
    if ref_logp is None and kl_coef:
        raise ValueError("kl_coef != 0 needs ref_logp")
    m = jnp.asarray(mask).astype(bool)
    logp = logp.astype(jnp.float32)
    old = jax.lax.stop_gradient(old_logp.astype(jnp.float32))
    adv = jax.lax.stop_gradient(jnp.asarray(advantages, jnp.float32))[:, None]

    ratio = jnp.exp(logp - old)
    surrogate, clipped = _clipped_surrogate(ratio, adv, epsilon_low, epsilon_high)
    if ref_logp is None:
        kl = jnp.zeros_like(logp)
    else:
        d = jax.lax.stop_gradient(ref_logp.astype(jnp.float32)) - logp
        kl = jnp.exp(d) - d - 1.0
    per_token = jnp.where(m, surrogate + kl_coef * kl, 0.0)

    tokens_per_row = jnp.sum(m, axis=1).astype(jnp.float32)
    sequences = jnp.sum(tokens_per_row > 0).astype(jnp.float32)
    tokens = jnp.sum(tokens_per_row)
    if averaging == "sequence":
        loss_sum = jnp.sum(jnp.sum(per_token, axis=1) / jnp.maximum(tokens_per_row, 1.0))
        normalizer = sequences
    elif averaging == "token":
        loss_sum, normalizer = jnp.sum(per_token), tokens
    else:
        length = logp.shape[1] if max_completion_length is None else max_completion_length
        loss_sum, normalizer = jnp.sum(per_token), sequences * float(length)

    msum = lambda x: jnp.sum(jnp.where(m, jax.lax.stop_gradient(x).astype(jnp.float32), 0.0))
    stats = {
        "tokens": tokens,
        "sequences": sequences,
        "ratio": msum(ratio),
        "clipped": msum(clipped),
        "kl": msum(kl),
        "policy_loss": msum(surrogate),
    }
    return loss_sum, normalizer, stats
