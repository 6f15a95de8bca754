"""GRPO end to end: config and reward errors before the first rollout, sampling seeds that
make a run repeatable, a run whose reward rises, and SIGTERM + resume that reproduce the
uninterrupted run's rewards and losses. The loss and its gradient against a float64
reference: test_rl_losses.py; rewards and prompt sources: test_rewards_prompts.py."""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from support import ROOT

from gpt_oss_train import config as config_lib
from gpt_oss_train import train
from gpt_oss_train.checkpoints import checkpoint as ckpt_lib
from gpt_oss_train.errors import ConfigError
from gpt_oss_train.model import lora
from gpt_oss_train.model.transformer import ModelDef
from gpt_oss_train.post_training import rollouts
from gpt_oss_train.post_training.rewards import RewardError
from gpt_oss_train.training import data as data_lib
from gpt_oss_train.training import loss as loss_lib
from gpt_oss_train.training import objectives, rl_losses, steps
from gpt_oss_train.training.sources import DataError

NARROW = dict(hidden_size=16, num_heads=2, num_kv_heads=1, head_dim=8, intermediate_size=16)
PROMPTS = f"chat:{ROOT}/data/sample_prompts.jsonl"


def _config(**train):
    c = config_lib.from_file(os.path.join(ROOT, "configs", "grpo.py"))
    c.model.update(NARROW)
    c.lora.update(rank=8, alpha=16.0, targets="q,k,v,o,gate_up,down")  # the LoRA path
    c.train.update(dict(steps=3, global_batch_size=8, log_every=1), **train)
    c.rl.update(group_size=4, max_prompt_tokens=96, max_new_tokens=16)
    c.data.source = PROMPTS
    c.checkpoint.update(every=0)
    return c


@pytest.mark.parametrize(
    "field, value, error",
    [
        ("group_size", 1, "rl.group_size: must be an integer >= 2"),
        ("group_size", 3, "train.global_batch_size: 8 rows must hold whole groups"),
        ("max_new_tokens", 64, "train.seq_len: 128 cannot hold"),
        ("averaging", "mean", "rl.averaging: 'mean' is not one of"),
        ("temperature", 0.0, "rl.temperature: must be > 0"),
    ],
)
def test_a_bad_rl_setting_is_one_line(field, value, error):
    c = _config()
    c.rl[field] = value
    with pytest.raises(ConfigError, match=error):
        config_lib.validate(c)


def _user_reward_module(tmp_path, monkeypatch, body):
    (tmp_path / "my_rewards.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_rewards", None)


@pytest.mark.parametrize(
    "rewards, body, error",
    [
        ("my_rewards:nope", "", (ConfigError, "config.rl.rewards")),
        (
            "my_rewards:broken",
            "def broken(prompt, completion, **_):\n    return 1 / 0\n",
            (RewardError, "ZeroDivisionError"),
        ),
        (
            "my_rewards:needs",
            "def needs(prompt, completion, *, label):\n    return 1.0\n",
            (RewardError, "unexpected keyword argument .answer."),
        ),
    ],
    ids=["missing", "raises", "wrong-signature"],
)
def test_a_reward_that_cannot_score_stops_the_run_before_any_rollout(
    tmp_path, monkeypatch, rewards, body, error
):
    _user_reward_module(tmp_path, monkeypatch, body)
    c = _config()
    c.rl.rewards = rewards
    kind, message = error
    with pytest.raises(kind, match=message):
        train.train(c, str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_a_prompt_longer_than_its_budget_is_named(tmp_path):
    (tmp_path / "p.jsonl").write_text(
        json.dumps({"messages": [{"role": "user", "content": "Hi"}]})
        + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "word " * 200}]})
        + "\n"
    )
    c = _config()
    c.data.source = f"chat:{tmp_path}/p.jsonl"
    with pytest.raises(DataError, match=r"p.jsonl:2: the prompt is \d+ tokens; rl.max_prompt"):
        train.train(c, str(tmp_path / "run"))


def test_sampling_seeds_are_fixed_by_run_step_and_row():
    seeds = {rollouts.sample_seed(0, step, row) for step in range(50) for row in range(64)}
    assert len(seeds) == 50 * 64  # distinct: no two rows of a run sample alike
    assert rollouts.sample_seed(3, 7, 5) == rollouts.sample_seed(3, 7, 5)
    assert rollouts.sample_seed(3, 7, 5) != rollouts.sample_seed(4, 7, 5)


def _metrics(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.full
def test_one_step_raises_the_completions_the_rewards_favour(tmp_path):
    """A rollout batch from the engine on the live adapters, then one GRPO step: each
    completion's log-likelihood moves with its advantage (up above its group's mean reward,
    down below). The engine's log-probabilities of what it sampled are the learner's."""
    run = train.prepare(_config(learning_rate=5e-2), str(tmp_path / "run"))
    setup = run.setup

    def token_logps(state, batch):
        tree = lora.merge(setup.frozen.arrays(), state["params"])
        hidden, _, _ = setup.model_def.bind(tree)(
            batch["inputs"], batch["positions"], batch["segment_ids"]
        )
        kernel = tree["unembed"]["kernel"]
        return loss_lib.token_logprobs(
            hidden, kernel, batch["targets"], chunk=128, dtype=jnp.float32
        )[0]

    try:
        with setup.scope():
            sampled = []
            score = run.rollouts._scores
            run.rollouts._scores = lambda r, done, n: (sampled.extend(done), score(r, done, n))[1]
            local, made = run.rollouts.batch(run.state, 0)
            batch = data_lib.global_batch(local, setup.mesh, setup.rules)
            before = np.asarray(jax.jit(token_logps)(run.state, batch))
            mask = local["loss_mask"] == 1
            for row, completion in enumerate(sampled):
                np.testing.assert_allclose(before[row][mask[row]], completion.logprobs, atol=2e-3)
            state, _ = setup.train_step(run.state, batch)
            after = np.asarray(jax.jit(token_logps)(state, batch))
            run.state = state
    finally:
        run.close()
    seq = lambda lp: np.asarray(rl_losses.sequence_logprobs(lp, mask))
    advantages = local["advantages"][:, 0]
    assert np.std(advantages) > 0.5, made  # the group's rewards differ
    moved = seq(after) - seq(before)
    assert np.corrcoef(advantages, moved)[0, 1] > 0.9, (advantages, moved)
    assert np.all(
        np.sign(moved[np.abs(advantages) > 0.3]) == np.sign(advantages[np.abs(advantages) > 0.3])
    )


def _cli(workdir):
    narrow = [f"--config.model.{k}={v}" for k, v in NARROW.items()]
    cmd = [
        sys.executable,
        "-m",
        "gpt_oss_train.train",
        "--config=configs/grpo.py",
        f"--workdir={workdir}",
        "--config.train.steps=8",
        "--config.train.global_batch_size=8",
        "--config.rl.max_new_tokens=16",
        "--config.rl.num_iterations=2",
        "--config.checkpoint.every=2",
        *narrow,
    ]
    return cmd, dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")


def _per_step(workdir):
    rows = _metrics(workdir) if (workdir / "metrics.jsonl").exists() else []
    return {r["step"]: (r["reward"], r["loss"]) for r in rows if "reward" in r}


@pytest.mark.full
def test_sigterm_then_resume_gives_the_uninterrupted_rewards_and_losses(tmp_path):
    full, cut = tmp_path / "full", tmp_path / "cut"
    cmd, env = _cli(full)
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(_per_step(full)) == list(range(1, 9)), done.stderr[-6000:]
    # the learner's throughput beside the whole step's: the step less its rollout
    timed = [r for r in _metrics(full) if "perf/learner_step_time_seconds" in r]
    assert len(timed) == 7, timed  # every step after the first (compilation)
    for r in timed:
        assert 0 < r["perf/learner_step_time_seconds"] < r["perf/step_time_seconds"], r
        assert r["perf/learner_per_device_tokens_per_sec"] > r["perf/per_device_tokens_per_sec"], r
    cmd, env = _cli(cut)
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    deadline = time.time() + 400
    while time.time() < deadline and max(_per_step(cut) or {0: 0}) < 3:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-4000:]
    stopped = ckpt_lib.find_step_dir(str(cut))[1]
    assert 3 <= stopped < 8 and "Preempted" in err
    again = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    want, got = _per_step(full), _per_step(cut)
    assert sorted(got) == list(range(1, 9)), again.stderr[-6000:]
    for step in want:  # the same prompts, samples and arithmetic: bitwise
        assert got[step] == want[step], step


def _tiny_grpo_step_inputs():
    """(config, model, params, a GRPO batch, the policy's log-probs of it from the model and
    the loss module directly) at test sizes, full fine-tuning, float32."""
    c = _config(seq_len=16, loss_chunk_size=16, aux_loss_coef=0.0)
    c.lora.rank = 0
    c.model.update(
        num_layers=2, num_experts=4, experts_per_token=2, sliding_window=8, vocab_size=1024
    )
    c.dtype, c.remat_policy = "float32", "none"
    c.rl.update(max_prompt_tokens=8, max_new_tokens=8, num_iterations=2)
    md = ModelDef(config_lib.ModelConfig.from_config(c))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 1000, (8, 17))
    batch = {
        "inputs": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "positions": np.tile(np.arange(16), (8, 1)),
        "segment_ids": np.ones((8, 16), np.int32),
        "loss_mask": np.tile((np.arange(16) >= 8).astype(np.int32), (8, 1)),
        "advantages": np.repeat(rng.normal(size=(8, 1)), 16, 1).astype(np.float32),
    }
    batch = jax.tree.map(jnp.asarray, batch)
    params = md.init(0)

    def logits(tree):
        hidden, _, _ = md.bind(tree)(batch["inputs"], batch["positions"], batch["segment_ids"])
        return hidden, tree["unembed"]["kernel"]

    def logp(tree):
        hidden, kernel = logits(tree)
        return loss_lib.token_logprobs(
            hidden, kernel, batch["targets"], chunk=16, dtype=jnp.float32
        )[0]

    return c, md, params, batch, logp, logits


@pytest.mark.full
def test_several_updates_per_rollout_batch_take_the_ratio_to_the_sampling_policy():
    """rl.num_iterations=2: one train step is two updates on the same rollout batch whose
    ratio's denominator is the sampling policy's log-probs (the starting parameters'), so
    it equals two one-update steps given those log-probs: the first with ratio 1, the
    second with the ratio the first update made. SGD (the change is the gradient)."""
    c, md, params, batch, logp, _ = _tiny_grpo_step_inputs()
    tx, lr = optax.sgd(0.5), lambda n: 1.0 + n  # lr: what the metric reads
    state = {"step": jnp.int32(0), "params": params, "opt_state": tx.init(params)}
    twice = jax.jit(steps.make_train_step(md, tx, lr, c.train, rl=c.rl))
    one_rl = copy.deepcopy(c.rl)
    one_rl.num_iterations = 1
    once = jax.jit(steps.make_train_step(md, tx, lr, c.train, rl=one_rl))

    got, metrics = twice(state, batch)
    given = {**batch, "old_logp": logp(params)}
    first, m1 = once(state, given)
    second, m2 = once(first, given)
    assert int(got["step"]) == 1 and float(metrics["learning_rate"]) == 1.5  # updates 0, 1
    assert float(m1["ratio"]) == pytest.approx(1.0, abs=1e-6)
    assert abs(float(m2["ratio"]) - 1.0) > 1e-4  # the first update moved the policy
    assert float(metrics["ratio"]) == pytest.approx((float(m1["ratio"]) + float(m2["ratio"])) / 2)
    for a, b in zip(jax.tree.leaves(got["params"]), jax.tree.leaves(second["params"])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    plain, _ = once(state, batch)  # one update without old_logp: the sampling policy is its own
    for a, b in zip(jax.tree.leaves(plain["params"]), jax.tree.leaves(first["params"])):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8)


def test_the_schedule_counts_updates():
    """With k updates a step, warmup and decay stretch k-fold: the last update of the run
    takes the end learning rate (the shifted warmup + cosine of make_optimizer)."""
    t = _config(steps=10, warmup_steps=2, learning_rate=1.0, end_lr_ratio=0.1).train
    _, schedule = steps.make_optimizer(t, updates=3)
    assert float(schedule(0)) == pytest.approx(1 / 6)  # warmup over 6 updates
    assert float(schedule(5)) == pytest.approx(1.0)
    assert float(schedule(29)) == pytest.approx(0.1)  # the 30th update: the end value
    assert float(schedule(17)) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * 12 / 24)))


def test_the_learner_takes_log_probs_at_the_sampling_temperature():
    """rl.temperature=2: the learner's log p(target) is log_softmax(logits / 2), in float64
    from the same logits."""
    c, md, params, batch, _, logits = _tiny_grpo_step_inputs()
    got, _ = objectives.policy_logprobs(md, c.train, params, batch, temperature=2.0)
    hidden, kernel = logits(params)
    z = np.einsum("bsd,dv->bsv", np.float64(hidden), np.float64(kernel)) / 2.0
    z -= z.max(-1, keepdims=True)
    want = np.take_along_axis(z, np.asarray(batch["targets"])[..., None], -1)[..., 0]
    want -= np.log(np.exp(z).sum(-1))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
