"""Verifiable rewards for GRPO: what a completion is to a reward, and how rewards are named.

A reward function sees the prompt (chat dicts), the completion as a record (`completion_record`:
its final answer, its reasoning, its tool calls, its text and ids) and, as keyword arguments,
the prompt line's other fields (e.g. `answer`), and returns a float:

    def my_reward(prompt: list[dict], completion: dict, *, answer, **_) -> float

`config.rl.rewards` names them "pkg.module:function,other.module:fn" (or a built-in by its
short name: exact_answer, format, reasoning_gym_score) and `config.rl.reward_weights` weighs
them ("1.0,0.5"; empty: all 1.0). `score` adds them up. A reward is user code: a mistake in
naming it is a `ConfigError`, and one that raises or returns a non-number is a `RewardError`,
both one line, so a broken reward stops the run before its first rollout (exit 2).
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

from gpt_oss_train.errors import ConfigError, UserError

RewardFn = Callable[..., float]
_RL_EXTRA = "pip install 'gpt_oss_train[rl]'"


class RewardError(UserError):
    """A reward function raised, or returned something that is not a finite number."""


def completion_record(token_ids: Sequence[int], tokenizer) -> dict[str, Any]:
    """What a reward sees of generated ids (the ids after the prompt's `<|start|>assistant`).

    "final" and "analysis" join the text of the assistant's messages on that channel ("" if
    none); a message with a recipient is a tool call, listed in "tool_calls" and in neither
    text. A truncated completion gives what parsed (see Tokenizer.parse_completion)."""
    ids = [int(t) for t in token_ids]
    final, analysis, calls = [], [], []
    for m in tokenizer.parse_completion(ids):
        if m["role"] != "assistant":
            continue
        if m.get("recipient"):
            calls.append({"recipient": m["recipient"], "content": m["content"]})
        elif m.get("channel") == "final":
            final.append(m["content"])
        elif m.get("channel") == "analysis":
            analysis.append(m["content"])
    return {
        "final": "\n".join(final),
        "analysis": "\n".join(analysis),
        "tool_calls": calls,
        "text": tokenizer.decode(ids),
        "token_ids": ids,
    }


# --------------------------------------------------------------------------------------
# Built-in rewards
# --------------------------------------------------------------------------------------
def exact_answer(prompt, completion, *, answer, **_) -> float:
    """1.0 if the final answer equals `answer` mathematically (math-verify: "\\boxed{1/2}",
    "0.5" and "The answer is 1/2." all match 0.5), else 0.0; text with no answer in it is 0.0."""
    from math_verify import parse, verify  # lazy: optional dependency (the `rl` extra)

    # math-verify bounds its sympy work with signal.alarm, which only the main thread may
    # set; elsewhere it would raise, so a reward scored in a worker thread goes unbounded.
    limit = 5 if threading.current_thread() is threading.main_thread() else None
    try:
        gold = parse(str(answer), parsing_timeout=limit)
        guess = parse(completion["final"], parsing_timeout=limit)
        ok = bool(gold and guess and verify(gold, guess, timeout_seconds=limit))
    except Exception:  # whatever the model wrote must not stop a run
        return 0.0
    return 1.0 if ok else 0.0


def format(prompt, completion, **_) -> float:  # shadows format() here: the name users write
    """1.0 if the completion reached a non-empty final-channel answer, else 0.0."""
    return 1.0 if completion["final"].strip() else 0.0


def whitespace(prompt, completion, **_) -> float:
    """The share of the completion's characters that are whitespace: a reward a tiny model
    trained on code learns in minutes (configs/grpo.py's demonstration, where the lever is
    its indentation tokens), not a task of any use."""
    text = completion["text"]
    return sum(ch.isspace() for ch in text) / len(text) if text else 0.0


BUILTINS = {
    "exact_answer": f"{__name__}:exact_answer",
    "format": f"{__name__}:format",
    "whitespace": f"{__name__}:whitespace",
    "reasoning_gym_score": "gpt_oss_train.post_training.prompts:reasoning_gym_score",
}
# Built-ins whose package comes with the `rl` extra: target -> (module, package).
_NEEDS = {
    BUILTINS["exact_answer"]: ("math_verify", "math-verify"),
    BUILTINS["reasoning_gym_score"]: ("reasoning_gym", "reasoning-gym"),
}


# --------------------------------------------------------------------------------------
# Naming and scoring
# --------------------------------------------------------------------------------------
def _resolve(entry: str) -> RewardFn:
    """The function an entry of config.rl.rewards names, or a one-line ConfigError."""
    where = f"config.rl.rewards: {entry!r}"
    target = BUILTINS.get(entry, entry)
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(
            f"{where} is neither a built-in reward ({', '.join(BUILTINS)}) nor 'module:function'"
        )
    if target in _NEEDS and importlib.util.find_spec(_NEEDS[target][0]) is None:
        raise ConfigError(f"{where} needs the {_NEEDS[target][1]} package; {_RL_EXTRA}")
    try:
        obj = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise ConfigError(f"{where}: cannot import module {module_name!r} ({e})") from None
    except Exception as e:  # the user's module ran and failed (SyntaxError, NameError, ...)
        first = (str(e).splitlines() or [""])[0]
        raise ConfigError(
            f"{where}: importing {module_name!r} failed: {type(e).__name__}: {first}"
        ) from None
    for part in attr.split("."):  # "module:Class.method" too
        if not hasattr(obj, part):
            raise ConfigError(f"{where}: {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"{where}: {attr!r} is a {type(obj).__name__}, not a function")
    return obj


def load_rewards(spec: str, weights: str = "") -> list[tuple[str, RewardFn, float]]:
    """[(name, function, weight)] for config.rl.rewards and config.rl.reward_weights."""
    entries = [e.strip() for e in str(spec).split(",")]
    if entries == [""]:
        raise ConfigError(
            "config.rl.rewards is empty; name a reward, e.g. 'exact_answer' or 'module:function'"
        )
    if "" in entries:
        raise ConfigError(f"config.rl.rewards: {spec!r} has an empty entry (a stray comma?)")
    dupes = sorted({e for e in entries if entries.count(e) > 1})
    if dupes:
        raise ConfigError(f"config.rl.rewards: {dupes[0]!r} is named twice")
    fns = [_resolve(e) for e in entries]
    if not str(weights).strip():
        ws = [1.0] * len(entries)
    else:
        ws = []
        for w in str(weights).split(","):
            try:
                ws.append(float(w))
            except ValueError:
                ws.append(math.nan)
            if not math.isfinite(ws[-1]):
                raise ConfigError(f"config.rl.reward_weights: {w.strip()!r} is not a number")
        if len(ws) != len(entries):
            raise ConfigError(
                f"config.rl.reward_weights: {weights!r} gives {len(ws)} weights for "
                f"{len(entries)} rewards ({', '.join(entries)}); give one per reward or none"
            )
    return list(zip(entries, fns, ws))


def score(
    rewards: Sequence[tuple[str, RewardFn, float]],
    prompt: list[dict],
    completion: dict,
    extra: dict,
) -> tuple[float, dict[str, float]]:
    """(weighted total, {name: unweighted value}) of one completion."""
    per: dict[str, float] = {}
    for name, fn, _ in rewards:
        try:
            value = fn(prompt, completion, **extra)
        except Exception as e:  # user code: any failure is reported as its own
            first = (str(e).splitlines() or [""])[0]
            raise RewardError(f"reward {name!r} raised {type(e).__name__}: {first}") from e
        try:
            per[name] = float(value)
        except (TypeError, ValueError):
            per[name] = math.nan
        if not math.isfinite(per[name]):
            shown = repr(value) if len(repr(value)) <= 40 else type(value).__name__
            raise RewardError(f"reward {name!r} returned {shown}; a reward must be a finite number")
    return sum(w * per[name] for name, _, w in rewards), per
