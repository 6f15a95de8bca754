"""Tests of GRPO's reward side (gpt_oss_train.post_training.rewards) and prompt sources
(gpt_oss_train.post_training.prompts), on real tokenizer ids, math-verify and reasoning-gym."""

from __future__ import annotations

import concurrent.futures
import json
import math
import os
import subprocess
import sys
import textwrap

import pytest

from gpt_oss_train.errors import ConfigError, UserError
from gpt_oss_train.io import tokenizer as tk
from gpt_oss_train.post_training import prompts, rewards
from gpt_oss_train.training.sources import DataError


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    # The vocabulary is unpacked into a temporary cache, not the user's ~/.cache.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GPT_OSS_TRAIN_CACHE", str(tmp_path_factory.mktemp("gpt_oss_cache")))
        yield tk.Tokenizer()


PROMPT = [{"role": "user", "content": "What is 6 * 7?"}]


def _generated(tok, reply: list[dict]) -> list[int]:
    """The ids a model writes for `reply`: the training render of prompt + reply, after the
    prompt's `<|start|>assistant` (where generation starts)."""
    ids, _ = tok.render_chat_for_training(PROMPT + reply, "low")
    prompt_ids = tok.render_chat(PROMPT, "low")
    assert ids[: len(prompt_ids)] == prompt_ids
    return ids[len(prompt_ids) :]


def _completion(final: str) -> dict:
    return {"final": final, "analysis": "", "tool_calls": [], "text": final, "token_ids": []}


# --------------------------------------------------------------------------------------
# completion_record
# --------------------------------------------------------------------------------------
def test_completion_record_splits_channels(tok):
    reply = [
        {"role": "assistant", "channel": "analysis", "content": "6 * 7 = 42."},
        {"role": "assistant", "channel": "final", "content": "The answer is \\boxed{42}"},
    ]
    ids = _generated(tok, reply)
    assert ids[-1] == tk.RETURN_ID
    rec = rewards.completion_record(ids, tok)
    assert rec["final"] == "The answer is \\boxed{42}"
    assert rec["analysis"] == "6 * 7 = 42."
    assert rec["tool_calls"] == []
    assert rec["token_ids"] == ids
    assert rec["text"] == (
        "<|channel|>analysis<|message|>6 * 7 = 42.<|end|><|start|>assistant<|channel|>final"
        "<|message|>The answer is \\boxed{42}<|return|>"
    )
    assert rewards.exact_answer(PROMPT, rec, answer=42) == 1.0
    assert rewards.format(PROMPT, rec) == 1.0


def test_completion_record_tool_call_and_truncation(tok):
    reply = [
        {"role": "assistant", "channel": "analysis", "content": "Use the tool."},
        {
            "role": "assistant",
            "channel": "commentary",
            "recipient": "functions.mul",
            "content_type": "<|constrain|>json",
            "content": '{"a": 6, "b": 7}',
        },
    ]
    ids = _generated(tok, reply)
    rec = rewards.completion_record(ids, tok)
    assert rec["tool_calls"] == [{"recipient": "functions.mul", "content": '{"a": 6, "b": 7}'}]
    assert rec["final"] == "" and rec["analysis"] == "Use the tool."
    assert rewards.format(PROMPT, rec) == 0.0
    # Cut inside the analysis: what parsed so far, and no final answer.
    cut = rewards.completion_record(ids[:4], tok)
    assert cut["final"] == "" and cut["analysis"] and "Use the tool.".startswith(cut["analysis"])
    assert rewards.completion_record([], tok)["final"] == ""


# --------------------------------------------------------------------------------------
# Built-in rewards
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "final, answer, expected",
    [
        ("The answer is \\boxed{42}", 42, 1.0),
        ("42", 42, 1.0),
        ("-48", "-48", 1.0),
        ("$\\frac{1}{2}$", "0.5", 1.0),
        ("43", 42, 0.0),
        ("48", "-48", 0.0),
        ("I do not know.", 42, 0.0),  # nothing to parse
        ("", 42, 0.0),
        ("42", "forty-two", 0.0),  # the gold does not parse
        ("\\frac{", 42, 0.0),  # broken LaTeX
    ],
)
def test_exact_answer(final, answer, expected):
    assert rewards.exact_answer(PROMPT, _completion(final), answer=answer) == expected


def test_exact_answer_in_a_worker_thread():
    # math-verify's timeout uses signal.alarm, which raises outside the main thread; a
    # learner that scores in a thread pool must still get the right reward.
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        got = pool.map(
            lambda f: rewards.exact_answer(PROMPT, _completion(f), answer="42"),
            ["\\boxed{42}", "41"],
        )
        assert list(got) == [1.0, 0.0]


def test_format():
    assert rewards.format(PROMPT, _completion("42")) == 1.0
    assert rewards.format(PROMPT, _completion(" \n")) == 0.0


# --------------------------------------------------------------------------------------
# load_rewards and score
# --------------------------------------------------------------------------------------
def test_load_rewards_builtins_and_weights():
    loaded = rewards.load_rewards("exact_answer, format", "1.0,0.5")
    assert [(n, f, w) for n, f, w in loaded] == [
        ("exact_answer", rewards.exact_answer, 1.0),
        ("format", rewards.format, 0.5),
    ]
    full = "gpt_oss_train.post_training.prompts:reasoning_gym_score"
    assert rewards.load_rewards(full, "") == [(full, prompts.reasoning_gym_score, 1.0)]
    total, per = rewards.score(loaded, PROMPT, _completion("\\boxed{42}"), {"answer": "42"})
    assert per == {"exact_answer": 1.0, "format": 1.0} and total == 1.5
    total, per = rewards.score(loaded, PROMPT, _completion("41"), {"answer": "42"})
    assert per == {"exact_answer": 0.0, "format": 1.0} and total == 0.5


@pytest.mark.parametrize(
    "spec, weights, message",
    [
        ("", "", r"^config\.rl\.rewards is empty"),
        ("format,", "", r"^config\.rl\.rewards: 'format,' has an empty entry"),
        ("format,format", "", r"^config\.rl\.rewards: 'format' is named twice"),
        ("exact", "", r"^config\.rl\.rewards: 'exact' is neither a built-in reward"),
        ("no_such_pkg.mod:fn", "", r"^config\.rl\.rewards: 'no_such_pkg.mod:fn': cannot import"),
        ("math:nope", "", r"^config\.rl\.rewards: 'math:nope': 'math' has no attribute 'nope'"),
        ("math:pi", "", r"^config\.rl\.rewards: 'math:pi': 'pi' is a float, not a function"),
        ("format", "1,2", r"^config\.rl\.reward_weights: '1,2' gives 2 weights for 1 rewards"),
        ("format", "heavy", r"^config\.rl\.reward_weights: 'heavy' is not a number"),
        ("format", "nan", r"^config\.rl\.reward_weights: 'nan' is not a number"),
    ],
)
def test_load_rewards_errors(spec, weights, message):
    with pytest.raises(ConfigError, match=message) as e:
        rewards.load_rewards(spec, weights)
    assert "\n" not in str(e.value)


def test_user_reward_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        textwrap.dedent(
            """
            def length_penalty(prompt, completion, *, max_chars=10, **_):
                return -max(0, len(completion["final"]) - max_chars) / 10

            def broken(prompt, completion, **_):
                return 1 / 0

            def not_a_number(prompt, completion, **_):
                return float("nan")

            def words(prompt, completion, **_):
                return "many"
            """
        )
    )
    (tmp_path / "bad_module.py").write_text("x = undefined_name\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    loaded = rewards.load_rewards("my_rewards:length_penalty,format", "2,1")
    total, per = rewards.score(loaded, PROMPT, _completion("x" * 15), {"max_chars": 10})
    assert per == {"my_rewards:length_penalty": -0.5, "format": 1.0} and total == 0.0

    with pytest.raises(ConfigError, match=r"importing 'bad_module' failed: NameError: name"):
        rewards.load_rewards("bad_module:f", "")
    cases = {
        "broken": r"^reward 'my_rewards:broken' raised ZeroDivisionError: division by zero$",
        "not_a_number": r"^reward 'my_rewards:not_a_number' returned nan; a reward must be a",
        "words": r"^reward 'my_rewards:words' returned 'many'; a reward must be a finite number",
    }
    for fn, message in cases.items():
        loaded = rewards.load_rewards(f"format,my_rewards:{fn}", "")
        with pytest.raises(rewards.RewardError, match=message) as e:
            rewards.score(loaded, PROMPT, _completion("42"), {})
        assert isinstance(e.value, UserError) and "\n" not in str(e.value)
    # A prompt without the field a reward needs: one line naming the reward.
    with pytest.raises(rewards.RewardError, match=r"^reward 'exact_answer' raised TypeError"):
        rewards.score(rewards.load_rewards("exact_answer", ""), PROMPT, _completion("42"), {})


# --------------------------------------------------------------------------------------
# Chat prompt sources
# --------------------------------------------------------------------------------------
def _write_jsonl(path, lines) -> str:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return str(path)


def test_chat_prompts(tmp_path):
    path = _write_jsonl(
        tmp_path / "p.jsonl",
        [
            {"messages": PROMPT, "answer": "42", "id": 7},
            "",  # a blank line is skipped
            {
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "1 + 1?"},
                ],
                "reasoning_effort": "high",
                "answer": 2,
            },
        ],
    )
    for spec in (path, f"chat:{path}", f"chat:{tmp_path}"):
        src = prompts.make_prompt_source(spec, seed=0)
        assert len(src) == 2 and src.default_rewards == "" and src.name == spec
    first, second = src[0], src[1]
    assert first == prompts.PromptRecord(PROMPT, {"answer": "42", "id": 7}, f"{path}:1", None)
    assert second.extra == {"answer": 2} and second.reasoning_effort == "high"
    assert second.where == f"{path}:3"


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", r"p\.jsonl:2: not valid JSON"),
        ({"text": "hi"}, r'p\.jsonl:2: expected an object like \{"messages": \[\.\.\.\]\}'),
        ({"messages": []}, r'p\.jsonl:2: "messages" must be a non-empty list'),
        ({"messages": [{"role": "bot", "content": "x"}]}, r"p\.jsonl:2: message 0 has unknown"),
        ({"messages": [{"role": "user"}]}, r'p\.jsonl:2: message 0 \(user\) needs a string "con'),
        (
            {"messages": PROMPT + [{"role": "assistant", "content": "42"}]},
            r"p\.jsonl:2: the last message is the assistant's",
        ),
        ({"messages": PROMPT, "reasoning_effort": "max"}, r'p\.jsonl:2: "reasoning_effort" is'),
    ],
)
def test_chat_prompt_errors(tmp_path, line, message):
    path = _write_jsonl(tmp_path / "p.jsonl", [{"messages": PROMPT}, line])
    with pytest.raises(DataError, match=message):
        prompts.make_prompt_source(path, seed=0)


def test_prompt_spec_errors(tmp_path):
    with pytest.raises(DataError, match="is not a prompt source; give chat:PATH"):
        prompts.make_prompt_source("prompts.txt", seed=0)
    with pytest.raises(DataError, match="no such file or directory"):
        prompts.make_prompt_source(str(tmp_path / "missing.jsonl"), seed=0)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="no prompts"):
        prompts.make_prompt_source(str(tmp_path / "empty.jsonl"), seed=0)
    with pytest.raises(DataError, match="expected rl:reasoning_gym:TASK"):
        prompts.make_prompt_source("rl:gym:basic_arithmetic", seed=0)
    with pytest.raises(DataError, match="the size must be a positive whole number"):
        prompts.make_prompt_source("rl:reasoning_gym:basic_arithmetic:0", seed=0)
    with pytest.raises(DataError, match=r"no such reasoning-gym task; e\.g\. basic_arithmetic"):
        prompts.make_prompt_source("rl:reasoning_gym:basic_arithmetc", seed=0)


def test_check_prompt_lengths(tmp_path, tok):
    long = {"messages": [{"role": "user", "content": "word " * 300}]}
    bad_key = {"messages": [{"role": "user", "content": "hi", "chanel": "final"}]}
    path = _write_jsonl(tmp_path / "p.jsonl", [{"messages": PROMPT}, long, bad_key])
    src = prompts.make_prompt_source(path, seed=0)
    n = prompts.check_prompt_lengths(src, tok, 200, first=1)
    assert n == len(tok.render_chat(PROMPT, "medium"))
    with pytest.raises(DataError, match=r"p\.jsonl:2: the prompt is 3\d\d tokens; rl\.max_prom"):
        prompts.check_prompt_lengths(src, tok, 200)
    with pytest.raises(DataError, match=r"p\.jsonl:3: message 0 has unknown keys \['chanel'\]"):
        prompts.check_prompt_lengths(src, tok, 1000)


# --------------------------------------------------------------------------------------
# reasoning-gym prompts
# --------------------------------------------------------------------------------------
def test_reasoning_gym_prompts(tok):
    src = prompts.make_prompt_source("rl:reasoning_gym:basic_arithmetic:20", seed=3)
    assert len(src) == 20 and src.name == "rl:reasoning_gym:basic_arithmetic:20"
    recs = [src[i] for i in range(len(src))]
    assert all(r.messages[0]["role"] == "user" and r.messages[0]["content"] for r in recs)
    assert len({r.messages[0]["content"] for r in recs}) > 10  # different problems
    assert recs[4].where == "rl:reasoning_gym:basic_arithmetic:20[4]"
    # The same seed gives the same problems; another seed, others.
    again = prompts.make_prompt_source("rl:reasoning_gym:basic_arithmetic", seed=3, size=20)
    assert [again[i] for i in range(20)] == recs
    other = prompts.make_prompt_source("rl:reasoning_gym:basic_arithmetic:20", seed=4)
    assert [other[i].messages for i in range(20)] != [r.messages for r in recs]
    with pytest.raises(IndexError):
        src[20]

    loaded = rewards.load_rewards(src.default_rewards, "")
    rec = recs[0]
    answer = rec.extra["answer"]
    assert isinstance(answer, str) and answer
    right, _ = rewards.score(loaded, rec.messages, _completion(f"{answer}\n"), rec.extra)
    wrong, _ = rewards.score(loaded, rec.messages, _completion("no idea"), rec.extra)
    assert (right, wrong) == (1.0, 0.0)
    assert prompts.check_prompt_lengths(src, tok, 512) < 512


def test_reasoning_gym_score_matches_a_fresh_dataset():
    # The scorer finds its entry from the extra fields alone, as another process would.
    import reasoning_gym

    ds = reasoning_gym.create_dataset("basic_arithmetic", size=5, seed=11)
    src = prompts.make_prompt_source("rl:reasoning_gym:basic_arithmetic:5", seed=11)
    for i in range(5):
        assert src[i].messages[0]["content"] == ds[i]["question"]
        assert src[i].extra == {
            "answer": ds[i]["answer"],
            "_rg_task": "basic_arithmetic",
            "_rg_size": 5,
            "_rg_seed": 11,
            "_rg_index": i,
        }
        got = prompts.reasoning_gym_score([], _completion(ds[i]["answer"]), **src[i].extra)
        assert got == 1.0 and math.isfinite(got)


def test_reasoning_gym_needs_no_network(tmp_path):
    # A fresh interpreter (nothing imported yet) in which any connection attempt fails.
    script = textwrap.dedent(
        """
        import sys

        def no_network(event, args):
            if event in ("socket.connect", "socket.getaddrinfo", "urllib.Request"):
                raise RuntimeError(f"network access: {event} {args}")

        sys.addaudithook(no_network)
        from gpt_oss_train.post_training import prompts, rewards

        src = prompts.make_prompt_source("rl:reasoning_gym:basic_arithmetic:3", seed=0)
        rec = src[0]
        completion = {"final": rec.extra["answer"]}
        print(rewards.score(rewards.load_rewards(src.default_rewards, ""), [], completion,
                            rec.extra)[0])
        """
    )
    env = dict(os.environ, MPLCONFIGDIR=str(tmp_path / "mpl"))
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "1.0"
