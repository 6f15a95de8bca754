"""Where GRPO prompts come from: a prompt spec -> a random-access source of `PromptRecord`s.

`make_prompt_source(spec, seed=..., size=...)` accepts:
  chat:PATH or PATH.jsonl       JSONL lines {"messages": [...], ...}: a conversation that
                                ends where the assistant speaks next (the last message is
                                not the assistant's). An optional "reasoning_effort"
                                (low/medium/high) is that prompt's effort; every other field
                                (e.g. "answer") reaches the reward functions as a keyword
                                argument. Every line is checked when the source is built.
                                PATH may be a directory or glob (its .jsonl files).
  rl:reasoning_gym:TASK[:SIZE]  SIZE (default `size`) problems of a reasoning-gym task,
                                generated from `seed` on this machine (nothing is
                                downloaded); its default reward is the task's own scorer.

A source has `__len__`, `__getitem__` -> PromptRecord, `name`, and `default_rewards`: the
reward spec to use when config.rl.rewards names none ("" for chat files). Every mistake in
a spec or a file is a `DataError` naming it (file:line for a bad line).
"""

from __future__ import annotations

import difflib
import functools
from typing import NamedTuple

import numpy as np

from gpt_oss_train.config import REASONING_EFFORTS
from gpt_oss_train.io import storage
from gpt_oss_train.training.sources import (
    DataError,
    Replacements,
    check_chat,
    expand,
    read_jsonl_line,
    scan_jsonl,
)

_SPECS = "chat:PATH, a .jsonl file or rl:reasoning_gym:TASK[:SIZE]"


class PromptRecord(NamedTuple):
    messages: list[dict]  # the conversation the policy continues
    extra: dict  # the line's other fields: keyword arguments of the rewards
    where: str  # "file:line" or "rl:reasoning_gym:TASK:SIZE[i]", for error messages
    reasoning_effort: str | None  # None: the run's default


# --------------------------------------------------------------------------------------
# Chat prompts from JSONL
# --------------------------------------------------------------------------------------
def _check_prompt(obj, where: str) -> None:
    if not isinstance(obj, dict) or "messages" not in obj:
        got = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
        raise DataError(f'{where}: expected an object like {{"messages": [...]}}, got {got}')
    check_chat(obj["messages"], where, trains=False)
    if obj["messages"][-1]["role"] == "assistant":
        raise DataError(
            f"{where}: the last message is the assistant's; a prompt ends where the "
            "assistant speaks next (after a user or tool message)"
        )
    effort = obj.get("reasoning_effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise DataError(
            f'{where}: "reasoning_effort" is {effort!r}; use one of {list(REASONING_EFFORTS)}'
        )


class ChatPrompts:
    """Prompt lines of JSONL files. Like sources.JsonlFiles, every line is checked here and
    only its byte offset kept; a line is read again when asked for."""

    default_rewards = ""

    def __init__(self, paths: list[str], name: str):
        self.paths, self.name = list(paths), name
        self.replacements = Replacements()
        rows = []  # (file index, byte offset, line number)
        for f_i, start, line_no, obj, where in scan_jsonl(self.paths, self.replacements):
            _check_prompt(obj, where)
            rows.append((f_i, start, line_no))
        if not rows:
            raise DataError(f"{name}: no prompts (the files hold no JSON lines)")
        self._rows = np.asarray(rows, np.int64)

    def __len__(self):
        return len(self._rows)

    def __getitem__(self, i: int) -> PromptRecord:
        f_i, offset, line_no = (int(v) for v in self._rows[i])
        obj = read_jsonl_line(self.paths[f_i], offset)
        messages, effort = obj.pop("messages"), obj.pop("reasoning_effort", None)
        return PromptRecord(messages, obj, f"{self.paths[f_i]}:{line_no}", effort)


# --------------------------------------------------------------------------------------
# Procedural prompts from reasoning-gym
# --------------------------------------------------------------------------------------
@functools.cache
def _rg_dataset(task: str, size: int, seed: int):
    import reasoning_gym  # lazy: optional dependency (the `rl` extra)

    return reasoning_gym.create_dataset(task, size=size, seed=seed)


@functools.lru_cache(maxsize=4096)  # a prompt's entry is scored once per sampled completion
def _rg_entry(task: str, size: int, seed: int, index: int) -> dict:
    return _rg_dataset(task, size, seed)[index]


class ReasoningGymPrompts:
    """A reasoning-gym task's questions as one-message chats; the extra fields let
    `reasoning_gym_score` find the entry again, in any process, from (task, size, seed)."""

    default_rewards = f"{__name__}:reasoning_gym_score"

    def __init__(self, task: str, size: int, seed: int):
        try:
            from reasoning_gym.factory import DATASETS  # lazy: optional dependency (`rl` extra)
        except ImportError:
            raise DataError(
                f"rl:reasoning_gym:{task} needs the reasoning-gym package; "
                "pip install 'gpt_oss_train[rl]'"
            ) from None
        if task not in DATASETS:
            near = difflib.get_close_matches(task, DATASETS, n=3) or sorted(DATASETS)[:6]
            raise DataError(
                f"rl:reasoning_gym:{task}: no such reasoning-gym task; e.g. "
                f"{', '.join(near)} ({len(DATASETS)} tasks in all)"
            )
        self.name, self._key = f"rl:reasoning_gym:{task}:{size}", (task, size, seed)
        try:
            self._n = len(_rg_dataset(task, size, seed))
        except Exception as e:  # the task rejects its arguments
            raise DataError(f"{self.name}: {type(e).__name__}: {e}") from None

    def __len__(self):
        return self._n

    def __getitem__(self, i: int) -> PromptRecord:
        if not 0 <= i < self._n:
            raise IndexError(f"{self.name}: index {i} out of range")
        task, size, seed = self._key
        entry = _rg_entry(task, size, seed, i)
        extra = {"answer": entry["answer"], "_rg_task": task, "_rg_size": size}
        extra |= {"_rg_seed": seed, "_rg_index": i}
        messages = [{"role": "user", "content": entry["question"]}]
        return PromptRecord(messages, extra, f"{self.name}[{i}]", None)


def reasoning_gym_score(
    prompt, completion, *, _rg_task, _rg_size, _rg_seed, _rg_index, **_
) -> float:
    """The task's own score (0..1) of the final answer; surrounding whitespace is dropped
    (most tasks compare strings, and " 42\\n" would get partial credit)."""
    ds = _rg_dataset(_rg_task, _rg_size, _rg_seed)
    entry = _rg_entry(_rg_task, _rg_size, _rg_seed, _rg_index)
    return float(ds.score_answer(completion["final"].strip(), entry))


# --------------------------------------------------------------------------------------
# Spec -> source, and the length check
# --------------------------------------------------------------------------------------
def make_prompt_source(spec: str, *, seed: int, size: int = 1000):
    """A random-access source of PromptRecords for `spec` (see the module docstring)."""
    spec = str(spec).strip()
    if spec.startswith("rl:"):
        parts = spec.split(":")
        if len(parts) not in (3, 4) or parts[1] != "reasoning_gym" or not parts[2]:
            raise DataError(f"{spec}: expected rl:reasoning_gym:TASK[:SIZE]")
        if len(parts) == 4:
            size = int(parts[3]) if parts[3].isdigit() else 0
        if size <= 0:
            raise DataError(f"{spec}: the size must be a positive whole number")
        return ReasoningGymPrompts(parts[2], size, seed)
    if spec.startswith("chat:") or spec.endswith(".jsonl"):
        path = spec.removeprefix("chat:")
        if storage.is_remote(path):
            raise DataError(f"{spec}: prompts are read from local disk only; copy them here")
        files, single = expand(path)
        files = files if single else [f for f in files if f.endswith(".jsonl")]
        if not files:
            raise DataError(f"{spec}: no .jsonl files there")
        return ChatPrompts(files, spec)
    raise DataError(f"{spec!r} is not a prompt source; give {_SPECS}")


def check_prompt_lengths(
    source, tokenizer, max_prompt_tokens: int, first: int | None = None, *, effort="medium"
) -> int:
    """Renders the first `first` prompts (all: None) as the policy will see them (`effort`
    where a prompt sets none) and returns the longest length; DataError on a prompt that
    does not render or is longer than max_prompt_tokens."""
    longest = 0
    for i in range(len(source) if first is None else min(first, len(source))):
        rec = source[i]
        try:
            n = len(tokenizer.render_chat(rec.messages, rec.reasoning_effort or effort))
        except ValueError as e:  # the tokenizer's checks: unknown keys, channels, ...
            raise DataError(f"{rec.where}: {e}") from None
        if n > max_prompt_tokens:
            raise DataError(
                f"{rec.where}: the prompt is {n} tokens; rl.max_prompt_tokens is "
                f"{max_prompt_tokens}"
            )
        longest = max(longest, n)
    return longest
