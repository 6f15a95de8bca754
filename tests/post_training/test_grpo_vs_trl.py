"""The pure parts of tools/bench_grpo_vs_trl.py (no training): the reward TRL calls, the prompts
in our order, our schedule as TRL's factors, and the summary of a run."""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("trl")

import torch
from support import ROOT

from gpt_oss_train.io import tokenizer as tk
from gpt_oss_train.tools import bench_grpo_vs_trl as gvt


@pytest.fixture(scope="module")
def config():
    with pytest.MonkeyPatch.context() as mp:  # the config's paths are the repository's
        mp.chdir(ROOT)
        yield gvt.load_config(gvt.shared_settings())


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    # The vocabulary is unpacked into a temporary cache, not the user's ~/.cache.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GPT_OSS_TRAIN_CACHE", str(tmp_path_factory.mktemp("gpt_oss_cache")))
        yield


def test_reward_scores_the_ids_as_our_rollouts(cache):
    reward = gvt.OurReward("whitespace", "", columns=["answer"])
    assert reward.__name__ == "whitespace"
    tok = tk.Tokenizer()
    ids = [tok.encode("a b c"), tok.encode("abcd")]
    prompts = [[{"role": "user", "content": "x"}]] * 2
    # TRL adds its own keyword arguments; only the dataset's columns reach our reward
    got = reward(prompts, [None, None], ids, answer=["1", "2"], trainer_state=object())
    assert got == pytest.approx([2 / 5, 0.0])
    assert reward.means == pytest.approx([0.2])

    seen = []
    reward.rewards = [("echo", lambda p, c, *, answer, **_: seen.append(answer) or 1.0, 2.0)]
    assert reward(prompts, [None, None], ids, answer=["1", "2"]) == [2.0, 2.0]
    assert seen == ["1", "2"]


def test_prompts_in_our_pipeline_order(config, monkeypatch):
    monkeypatch.chdir(ROOT)
    rows = gvt.prompt_rows(config, steps=3)
    assert len(rows) == 3 * 8
    with open(os.path.join(ROOT, "data/sample_prompts.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    for step in range(3):  # each step draws 8 different prompts of the file, with their fields
        batch = rows[step * 8 : (step + 1) * 8]
        assert len({json.dumps(r["prompt"]) for r in batch}) == 8
        known = [{"prompt": x["messages"], "answer": x["answer"]} for x in lines]
        assert all({"prompt": r["prompt"], "answer": r["answer"]} in known for r in batch)
    assert rows == gvt.prompt_rows(config, steps=3)  # the seed fixes the order


def test_schedule_factors(config):
    f = gvt.lr_factors(config)
    assert len(f) == 30
    # our warmup starts at lr / warmup_steps (not 0), the cosine ends at end_lr_ratio
    assert f[0] == pytest.approx(0.5) and f[1] == pytest.approx(1.0)
    assert f[-1] == pytest.approx(0.5) and all(a >= b for a, b in zip(f[1:], f[2:]))


def test_summary_leaves_out_step_one():
    side = {
        "reward": [0.1] * 5 + [0.3] * 10,
        "step_s": [None] + [2.0] * 14,
        "rollout_s": [9.0] + [0.5] * 14,
        "learn_s": [None] + [1.5] * 14,
    }
    s = gvt.summary(side)
    assert (s["step_s"], s["rollout_s"], s["learn_s"]) == (2.0, 0.5, 1.5)
    assert s["reward_last"] == pytest.approx(0.3) and s["reward_first"] == 0.1


def test_trl_takes_our_optimizer_and_settings(config, tmp_path):
    """TRL's optimizer, schedule and GRPOConfig, read from our config: AdamW with our
    betas and decay at our learning rate for each update, and the shared settings."""
    t, rl = config.train, config.rl
    opt, sched = gvt.our_optimizer(config, torch.nn.Linear(2, 2))
    assert opt.param_groups[0]["betas"] == (t.b1, t.b2)
    assert opt.param_groups[0]["weight_decay"] == t.weight_decay
    lrs = []
    for _ in range(t.steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([f * t.learning_rate for f in gvt.lr_factors(config)])
    args = gvt.trl_config(config, str(tmp_path), {"reasoning_effort": rl.reasoning_effort})
    assert (args.max_steps, args.per_device_train_batch_size) == (t.steps, t.global_batch_size)
    assert (args.num_generations, args.max_completion_length) == (rl.group_size, 8)
    assert args.loss_type == gvt.LOSS_TYPES[rl.averaging] and args.beta == rl.kl_coef
    assert args.chat_template_kwargs == {"reasoning_effort": rl.reasoning_effort}
