"""GRPO's rollouts: each training step's batch, sampled from the policy being trained
(post-training: it joins training with the serving engine, a floor below training).

For step s, `Rollouts.batch(state, s)` takes the next global_batch_size / group_size prompts
of the prompt pipeline (shuffled from config.seed and resumable like any data pipeline),
renders each as a Harmony prompt and has the serving `Engine` sample group_size
completions of it on the trainer's mesh (on several processes, process 0 schedules the
engine's rounds and the others run them with it), from the state's own parameters
(full fine-tuning: the trained ones; LoRA: the frozen base merged with the trained
adapters): no second copy of the model and no export between steps. Each completion's seed
is a function of (config.seed, s, row), so a resumed run samples exactly what the
uninterrupted one did. Completions end at Harmony's end of turn (<|return|>, <|call|>) or
after rl.max_new_tokens. Each is parsed (rewards.completion_record) and scored by the
config's reward functions; advantages are normalised within each group
(group_advantages); the rows (prompt + completion, only the completion trained) go to
the GRPO train step (training/steps.py; its loss: training/objectives.py), with their
advantages. `evaluate` samples greedily on held-out prompts (data.eval_source): mean
reward and pass@1 (the share with a positive reward).

The engine keeps no prefix cache (the weights change every step) and sits idle while the
train step runs; its compiled steps are built once, at the first rollout.
"""

from __future__ import annotations

import json
import time
import zlib
from typing import NamedTuple

import grain
import jax.numpy as jnp
import numpy as np
from absl import logging

from gpt_oss_train import hosts
from gpt_oss_train.errors import ConfigError
from gpt_oss_train.inference import loading
from gpt_oss_train.inference.engine import PREFIX_BLOCK, Engine, EngineOptions, RequestParams
from gpt_oss_train.model import lora
from gpt_oss_train.post_training import prompts as prompts_lib
from gpt_oss_train.post_training import rewards as rewards_lib
from gpt_oss_train.training import data as data_lib


class Sampled(NamedTuple):
    """A rollout's completion: its tokens and the engine's log-probability of each."""

    tokens: list[int]
    logprobs: list[float]


def sample_seed(seed: int, step: int, row: int) -> int:
    """The sampling seed of a batch row: fixed by the run's seed, the step and the row."""
    return zlib.crc32(f"{seed}:{step}:{row}".encode())


def engine_options(config) -> EngineOptions:
    """The rollout engine's shape: a slot for every row of the batch, each as long as a
    prompt plus its completion (tools/aot_compile.py compiles the same for a TPU slice)."""
    rl, rows = config.rl, config.train.global_batch_size
    # the engine's prefill chunks are multiples of its prefix block
    chunk = -(-min(256, rl.max_prompt_tokens) // PREFIX_BLOCK) * PREFIX_BLOCK
    return EngineOptions(
        max_slots=rows,
        max_context=rl.max_prompt_tokens + rl.max_new_tokens,
        prefill_chunk=chunk,
        prefix_cache_tokens=0,  # the weights change every step
        max_queue=rows,
    )


def group_advantages(rewards, group_size: int, *, scale: bool = True, eps: float = 1e-4):
    """[n*G] rewards, G consecutive completions per prompt -> [n*G] float32 advantages
    A = r - mean(group), divided by (std(group) + eps) if `scale`. std is the unbiased one
    (ddof=1), as TRL's torch.std; eps=1e-4 as TRL. A group of equal rewards gets A = 0.
    scale=False is Dr. GRPO (Liu et al. 2025), which drops the division as a bias towards
    groups of low reward variance (too easy or too hard prompts)."""
    r = jnp.asarray(rewards, jnp.float32)
    if r.ndim != 1 or r.shape[0] % group_size:
        raise ValueError(f"rewards of shape {r.shape} do not split into groups of {group_size}")
    if scale and group_size < 2:
        raise ValueError("scaled advantages need group_size >= 2 (the unbiased std of one)")
    groups = r.reshape(-1, group_size)
    a = groups - jnp.mean(groups, axis=1, keepdims=True)
    if scale:
        a = a / (jnp.std(groups, axis=1, ddof=1, keepdims=True) + eps)
    return a.reshape(-1)


def prompt_pipeline(source, prompts_per_step: int, seed: int) -> data_lib.Pipeline:
    """Prompts in a new shuffled order each epoch, prompts_per_step a batch, forever; its
    iterator is checkpointed with the run like a data pipeline's. Every process reads the
    same prompts, and the rollout batch it makes is the whole global batch."""
    ds = grain.MapDataset.source(source).shuffle(seed=seed).repeat(None)
    ds = ds.to_iter_dataset().batch(prompts_per_step, batch_fn=list)
    return data_lib.Pipeline(ds, source, whole_batches=True)


class Rollouts:
    """The GRPO run's prompt pipeline, reward functions and engine (module docstring).
    Every user error (a bad prompt file, a prompt longer than rl.max_prompt_tokens, a
    reward that does not load or fails on the first prompt) is raised here, before the
    first rollout."""

    def __init__(self, setup, config, link: hosts.Link | None = None):
        t = config.train
        if t.eval_every and not config.data.eval_source:
            raise ConfigError(
                "config.data.eval_source: GRPO's periodic eval (train.eval_every > 0) needs "
                "held-out prompts; set it, or train.eval_every=0"
            )
        self.setup, self.c, self.rl = setup, config, config.rl
        self.link = link or hosts.Link(0, 1, {})
        if config.train.objective != "grpo":
            raise ConfigError("train.objective: Rollouts are GRPO's (train.objective='grpo')")
        self.source = prompts_lib.make_prompt_source(config.data.source, seed=config.seed)
        spec = self.rl.rewards or self.source.default_rewards
        if not spec:
            raise ConfigError(
                "config.rl.rewards: name the reward functions (pkg.module:function, or the "
                f"built-ins exact_answer, format); {config.data.source!r} has none of its own"
            )
        self.rewards = rewards_lib.load_rewards(spec, self.rl.reward_weights)
        self.tokenizer = loading.tokenizer()
        prompts_lib.check_prompt_lengths(
            self.source, self.tokenizer, self.rl.max_prompt_tokens, effort=self.rl.reasoning_effort
        )
        first = self.source[0]  # a reward that cannot score an (empty) completion fails now
        empty = rewards_lib.completion_record([], self.tokenizer)
        rewards_lib.score(self.rewards, first.messages, empty, first.extra)
        self.group = self.rl.group_size
        self.pipeline = prompt_pipeline(
            self.source, config.train.global_batch_size // self.group, config.seed
        )
        self.eval_source = None
        if t.eval_every:
            self.eval_source = prompts_lib.make_prompt_source(
                config.data.eval_source, seed=config.seed + 1
            )
            prompts_lib.check_prompt_lengths(
                self.eval_source,
                self.tokenizer,
                self.rl.max_prompt_tokens,
                effort=self.rl.reasoning_effort,
            )
        self.engine: Engine | None = None

    def _engine(self, params) -> Engine:
        if self.engine is None:
            s = self.setup
            model = loading.LoadedModel(s.model_def, params, s.mesh, s.rules, "train", "", self.c)
            self.engine = Engine(model, engine_options(self.c), self.link)
        self.engine.model.params = params
        return self.engine

    def _complete(self, state, prompts, params) -> list[Sampled]:
        """Each prompt's completion, on every process: process 0 schedules the engine's
        rounds and the others run them with it (Engine.follow), then it sends the
        completions, so every process scores and trains on the same rows."""
        engine = self._engine(self._policy(state))
        done = None
        if self.link.leader:
            done = [Sampled(c.tokens, c.logprobs) for c in engine.run_batch(prompts, params)]
            if not self.link.multihost:
                return done
        else:
            engine.follow()
        shared = self.link.share(json.dumps(done).encode() if done is not None else None)
        return [Sampled(*c) for c in json.loads(shared)]

    def _policy(self, state):
        """The parameters the engine samples from: the state's, with the base under LoRA."""
        if self.setup.frozen is None:
            return state["params"]
        return lora.merge(self.setup.frozen.arrays(), state["params"])

    def _prompt(self, rec) -> list[int]:
        effort = rec.reasoning_effort or self.rl.reasoning_effort
        return self.tokenizer.render_chat(rec.messages, effort)

    def _params(self, seed: int | None) -> RequestParams:
        """Sampled (seed given) or greedy (None), to the end of the turn."""
        sampled = seed is not None
        return RequestParams(
            max_tokens=self.rl.max_new_tokens,
            temperature=self.rl.temperature if sampled else 0.0,
            top_p=self.rl.top_p if sampled else 1.0,
            seed=seed,
            stop_ids=tuple(sorted(self.tokenizer.stop_ids)),
        )

    def _scores(self, records, done, per_record: int):
        """Each completion's total reward and each reward function's values."""
        totals = np.zeros(len(done), np.float64)
        per_fn = {name: np.zeros(len(done)) for name, _, _ in self.rewards}
        for row, completion in enumerate(done):
            rec = records[row // per_record]
            record = rewards_lib.completion_record(completion.tokens, self.tokenizer)
            totals[row], values = rewards_lib.score(self.rewards, rec.messages, record, rec.extra)
            for name, v in values.items():
                per_fn[name][row] = v
        return totals, per_fn

    def batch(self, state, step: int) -> tuple[dict, dict]:
        """(this step's rows as the whole global batch, the same on every process; the
        rollout's metrics)."""
        records = next(self.pipeline)
        t0 = time.perf_counter()
        prompts, params = [], []
        for i, rec in enumerate(records):
            ids = self._prompt(rec)
            for g in range(self.group):
                prompts.append(ids)
                params.append(self._params(sample_seed(self.c.seed, step, i * self.group + g)))
        done = self._complete(state, prompts, params)
        rollout_s = time.perf_counter() - t0
        totals, per_fn = self._scores(records, done, self.group)
        adv = np.asarray(group_advantages(totals, self.group, scale=self.rl.scale_rewards))

        seq_len = self.c.train.seq_len
        rows = []
        for prompt, completion, a in zip(prompts, done, adv):
            ids = prompt + completion.tokens
            mask = [0] * len(prompt) + [1] * len(completion.tokens)
            row = data_lib.padded_row(ids, mask, seq_len)
            row["advantages"] = np.full(seq_len, a, np.float32)
            rows.append(row)
        local = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
        lengths = np.asarray([len(c.tokens) for c in done], np.float64)
        metrics = {
            "reward": float(totals.mean()),
            "reward_std": float(totals.std()),
            "pass_rate": float(np.mean(totals > 0)),
            **{f"rewards/{name}": float(v.mean()) for name, v in per_fn.items()},
            "completion_length": float(lengths.mean()),
            "rollout_tokens_per_s": float(lengths.sum() / max(rollout_s, 1e-9)),
            "rollout_s": rollout_s,
        }
        return local, metrics

    def evaluate(self, state) -> dict:
        """Greedy completions of the first train.eval_batches x global_batch_size held-out
        prompts: {"eval_reward", "eval_pass@1"}."""
        n = min(len(self.eval_source), self.c.train.eval_batches * self.c.train.global_batch_size)
        records = [self.eval_source[i] for i in range(n)]
        prompts = [self._prompt(rec) for rec in records]
        done = self._complete(state, prompts, [self._params(None)] * len(prompts))
        totals, _ = self._scores(records, done, 1)
        return {"eval_reward": float(totals.mean()), "eval_pass@1": float(np.mean(totals > 0))}

    def close(self) -> None:
        if self.engine is not None and self.link.leader:
            self.engine.stop()
        logging.info("GRPO rollouts stopped")
