"""What a train step minimises: the objectives of config.train.objective (next-token loss,
DPO, GRPO). OBJECTIVES is their table, one entry for each name config.OBJECTIVES declares
(checked at import): each holds its loss builder, the statistics its loss function sums,
the one that normalises it and what is logged.

A builder, (model_def, t, dpo, rl) -> loss_fn(params, batch, frozen=None) -> (summed
objective, stats), gives sums (over tokens, or DPO's pairs), so the gradient-accumulation
path (steps.make_train_step) divides once by the total count. With LoRA, `params` are the
adapters (what is differentiated) and `frozen` the base; under full-fine-tuning DPO (or
GRPO with a KL term), `frozen` is the reference's parameters.

Layering: DPO and GRPO are post-training, yet their losses sit here, on training's floor,
with the pure array math they call (training/rl_losses.py). The state builder
(training/state.build) makes the step of whatever objective the config names, and
`train.py`, the AOT compile (aot/) and `tools/bench_model.py` all build through it;
training imports nothing from post_training/ above it, so the table and its three
builders live beside the state builder. post_training/ holds what only a GRPO run's loop
needs: the prompts, the rewards and their group advantages, and the rollouts through the
serving engine that make each step's batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from gpt_oss_train import config as config_lib
from gpt_oss_train.model import lora
from gpt_oss_train.model.transformer import DTYPES, ModelDef
from gpt_oss_train.training import loss as loss_lib
from gpt_oss_train.training import rl_losses


@dataclasses.dataclass(frozen=True)
class Objective:
    """An objective's loss builder (`loss`, module docstring), what its loss function sums
    (`stats`: every one adds up over microbatches), which of them normalises the objective
    (`count`: the gradient is the summed objective's over it), and what is logged: each of
    `means` is a stat divided by the count, or by the stat named with it."""

    loss: Callable  # (model_def, t, dpo, rl) -> loss_fn(params, batch, frozen=None)
    stats: tuple[str, ...]
    count: str
    means: dict[str, str | tuple[str, str]]  # logged name -> stat, or (stat, its count)

    def metrics(self, stats: dict) -> dict:
        out = {}
        for name, key in self.means.items():
            key, count = (key, self.count) if isinstance(key, str) else key
            out[name] = stats[key] / jnp.maximum(stats[count], 1.0)
        return out


def _hidden(model_def: ModelDef, tree, batch):
    model = model_def.bind(tree)
    hidden, aux, _ = model(batch["inputs"], batch["positions"], batch["segment_ids"])
    return hidden, aux


def _token_logprobs(model_def: ModelDef, t, tree, hidden, batch):
    """log p(target) of every position, [rows, seq_len]."""
    return loss_lib.token_logprobs(
        hidden,
        tree["unembed"]["kernel"],
        batch["targets"],
        chunk=t.loss_chunk_size,
        dtype=DTYPES[model_def.cfg.dtype],
        kernels=model_def.cfg.kernels,
        gather_once=t.loss_gather_once,
    )[0]


def policy_logprobs(model_def: ModelDef, t, params, batch, frozen=None, temperature=1.0):
    """The trained policy's log p(target) of every position, [rows, seq_len], and the MoE
    aux loss. Under LoRA `params` are the adapters and `frozen` the base (else None).
    `temperature`: of the distribution the tokens were sampled from (logits / T, as the
    engine samples; the final hidden state scaled is the logits scaled)."""
    policy = params if frozen is None else lora.merge(frozen, params)
    hidden, aux = _hidden(model_def, policy, batch)
    if temperature != 1.0:
        hidden = hidden / jnp.asarray(temperature, hidden.dtype)
    return _token_logprobs(model_def, t, policy, hidden, batch), aux


def _reference(model_def: ModelDef, params, frozen):
    """The reference policy, without gradient flowing into it: the base with the adapters
    off (LoRA: zero adapters, B = 0, compute the base exactly), or a frozen copy of the
    starting parameters (full fine-tuning)."""
    if model_def.cfg.lora is not None:
        return lora.merge(frozen, jax.tree.map(jnp.zeros_like, params))
    return frozen


# ----------------------------------------------------------------------------- the builders


def lm_loss_fn(model_def: ModelDef, t, dpo=None, rl=None):
    """The next-token loss: summed NLL, plus the z-loss and MoE aux terms; counted in tokens."""
    dtype = DTYPES[model_def.cfg.dtype]

    def lm_loss(params, batch, frozen=None):
        tree = params if frozen is None else lora.merge(frozen, params)
        hidden, aux = _hidden(model_def, tree, batch)
        nll, z, n = loss_lib.lm_loss_sums(
            hidden,
            tree["unembed"]["kernel"],
            batch["targets"],
            batch["loss_mask"],
            chunk=t.loss_chunk_size,
            dtype=dtype,
            kernels=model_def.cfg.kernels,
            gather_once=t.loss_gather_once,
        )
        # The aux and z terms are scaled by the token count so that, like the NLL, they are
        # per-token means once the summed objective is divided by the total count.
        objective = nll + t.z_loss_coef * z + t.aux_loss_coef * aux * n
        return objective, {"nll": nll, "z": z, "aux": aux * n, "tokens": n}

    return lm_loss


def _sequence_logprobs(model_def: ModelDef, t, tree, batch):
    """Each row's summed log-probability of its trained tokens, [rows]; and the MoE aux."""
    hidden, aux = _hidden(model_def, tree, batch)
    logp = _token_logprobs(model_def, t, tree, hidden, batch)
    return rl_losses.sequence_logprobs(logp, batch["loss_mask"]), aux


def dpo_loss_fn(model_def: ModelDef, t, dpo, rl=None):
    """DPO (config.dpo) against the reference (_reference); counted in pairs, rows 2i and
    2i+1 of the batch being pair i."""
    is_lora = model_def.cfg.lora is not None

    def dpo_loss(params, batch, frozen):
        policy = lora.merge(frozen, params) if is_lora else params
        reference = _reference(model_def, params, frozen)
        logp, aux = _sequence_logprobs(model_def, t, policy, batch)
        ref_logp, _ = _sequence_logprobs(model_def, t, jax.lax.stop_gradient(reference), batch)
        trained = jnp.sum(batch["loss_mask"], axis=1).reshape(-1, 2)  # rows 2i, 2i+1: pair i
        real = jnp.all(trained > 0, axis=1).astype(jnp.float32)  # padding pairs count for 0
        loss, pairs, stats = rl_losses.dpo_sums(
            *logp.reshape(-1, 2).T,
            *ref_logp.reshape(-1, 2).T,
            beta=dpo.beta,
            label_smoothing=dpo.label_smoothing,
            weights=real,
        )
        objective = loss + t.aux_loss_coef * aux * pairs
        tokens = jnp.sum(batch["loss_mask"]).astype(jnp.float32)
        return objective, {
            "loss": loss,
            "aux": aux * pairs,
            "pairs": pairs,
            "tokens": tokens,
            **stats,
        }

    return dpo_loss


def grpo_loss_fn(model_def: ModelDef, t, dpo, rl):
    """GRPO (config.rl) on a rollout batch (its advantages, and old_logp when the step makes
    several updates on it); normalised as rl.averaging says."""
    is_lora = model_def.cfg.lora is not None

    def grpo_loss(params, batch, frozen=None):
        # Log-probs at the sampling temperature, the reference's too (as TRL takes them).
        base = frozen if is_lora else None
        logp, aux = policy_logprobs(model_def, t, params, batch, base, rl.temperature)
        # The sampling policy's log-probs: the batch carries them when the step makes
        # several updates on it (steps.iterated_updates); at the first update the sampling
        # policy is these parameters, so they are logp without its gradient (the ratio is
        # 1, its gradient is not).
        old_logp = batch.get("old_logp", jax.lax.stop_gradient(logp))
        ref_logp = None
        if rl.kl_coef:
            reference = _reference(model_def, params, frozen)
            ref_logp, _ = policy_logprobs(
                model_def, t, jax.lax.stop_gradient(reference), batch, temperature=rl.temperature
            )
        loss, normalizer, stats = rl_losses.grpo_sums(
            logp,
            old_logp,
            batch["advantages"][:, 0],
            batch["loss_mask"],
            ref_logp=ref_logp,
            kl_coef=rl.kl_coef,
            epsilon_low=rl.epsilon_low,
            epsilon_high=rl.epsilon_high,
            averaging=rl.averaging,
            max_completion_length=rl.max_new_tokens,
        )
        objective = loss + t.aux_loss_coef * aux * normalizer
        return objective, {
            "loss": loss,
            "aux": aux * stats["sequences"],
            "normalizer": normalizer,
            **stats,
        }

    return grpo_loss


# ----------------------------------------------------------------------------- the table


OBJECTIVES = {  # config.train.objective
    "lm": Objective(
        loss=lm_loss_fn,
        stats=("nll", "z", "aux", "tokens"),
        count="tokens",
        means={"loss": "nll", "aux_loss": "aux", "z_loss": "z"},
    ),
    # Names as TRL's DPOTrainer logs them.
    "dpo": Objective(
        loss=dpo_loss_fn,
        stats=("loss", "aux", "pairs", "tokens", *rl_losses.DPO_STATS),
        count="pairs",
        means={
            "loss": "loss",
            "aux_loss": "aux",
            "rewards/chosen": "chosen_reward",
            "rewards/rejected": "rejected_reward",
            "rewards/margins": "margin",
            "rewards/accuracies": "accuracy",
            "logps/chosen": "chosen_logp",
            "logps/rejected": "rejected_logp",
        },
    ),
    # Names as TRL's GRPOTrainer logs them; the rollouts' own (rewards, lengths) are the
    # loop's (post_training/rollouts.py).
    "grpo": Objective(
        loss=grpo_loss_fn,
        stats=("loss", "aux", "normalizer", *rl_losses.GRPO_STATS),
        count="normalizer",
        means={
            "loss": "loss",
            "aux_loss": ("aux", "sequences"),
            "kl": ("kl", "tokens"),
            "clip_ratio": ("clipped", "tokens"),
            "ratio": ("ratio", "tokens"),
        },
    ),
}


# The names are declared in config.OBJECTIVES (config.py validates train.objective against
# them, on a floor below this one): the table holds one entry for each, in that order.
if tuple(OBJECTIVES) != config_lib.OBJECTIVES:
    raise ImportError(
        f"training/objectives.py's OBJECTIVES {tuple(OBJECTIVES)} differ from the names "
        f"config.OBJECTIVES declares {config_lib.OBJECTIVES}"
    )


def make_loss_fn(model_def: ModelDef, t, dpo=None, objective: str | None = None, rl=None):
    """loss_fn(params, batch, frozen=None) -> (summed objective, stats) of the objective
    named `objective` (default t.objective), as its OBJECTIVES entry builds it (module
    docstring). `dpo`, `rl`: config.dpo and config.rl."""
    return OBJECTIVES[objective or t.objective].loss(model_def, t, dpo, rl)
