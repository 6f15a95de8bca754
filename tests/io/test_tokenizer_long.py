"""Tokenizer.encode and the chat renders on long texts: the ids of harmony's one-piece
encoding (the reference, wherever it finishes), in time that grows like the text, not like
its square.

harmony merges each o200k pre-token in time quadratic in its length, so a run of one
letter, a base64 blob or a wall of blank lines of a few hundred thousand characters took
minutes (and a longer one overflowed its regex stack). Tokenizer.encode cuts such texts
where the pre-tokenizer cuts anyway and merges the long pre-tokens itself."""

from __future__ import annotations

import random
import string
import time

import pytest
from openai_harmony import Conversation, RenderConversationConfig, Role
from support import harmony_model  # the tool the trained Harmony model calls

from gpt_oss_train.io import long_text
from gpt_oss_train.io import tokenizer as tk
from gpt_oss_train.training import data

QQ = 8127  # o200k_base.tiktoken's line "cXE= 8127": b"qq" (base64 cXE=) has rank 8127


@pytest.fixture(scope="module")
def tok():
    return tk.Tokenizer()


def _harmony(tok, text):
    """The reference: harmony's encoding of the whole text at once."""
    return tok.encoding.encode(text, allowed_special=set(), disallowed_special=())


def _mixed(rng: random.Random, n: int) -> str:
    """Text in which every kind of pre-token occurs, runs of them included: words and
    contractions in both cases, digits (ASCII and others), punctuation, slashes and line
    ends, spaces before digits, tabs, no-break and ideographic spaces, CJK, combining
    marks, emoji, special-token text, and characters newer than Python's Unicode tables."""
    # A table, kindred atoms a line: `# fmt: skip` keeps ruff from giving each its own.
    atoms = list("aAqQzZ09 '\t\n\r/=.,!?ſ") + [
        "'s", "'LL", "'re", "Hello", "WORLD", "ǅa", "ʰ", "中文", "，", "٣", "²", "Ⅻ",
        "e\u0301", "\u0308", "😀", "\u00a0", "\u3000", "\u2003", "\u0085", "\x1c",
        "<|end|>", "\r\n", "123456",
        "\U00031350", "\U00011f50",  # a CJK letter and a Kawi digit of Unicode 15
    ]  # fmt: skip
    out, size = [], 0
    while size < n:
        piece = rng.choice(atoms) * rng.choice([1, 1, 1, 2, 3, 7, 40])
        out.append(piece)
        size += len(piece)
    return "".join(out)


@pytest.mark.parametrize("char", ["q", "Q", "x", " ", "\n", "=", "7", "😀", "中", "\u0301"])
def test_a_run_of_one_character_encodes_as_harmony_does_in_one_piece(tok, char):
    for n in (long_text.LONG_PIECE + 1, 3001, 12_000):
        text = char * n
        assert tok.encode(text) == _harmony(tok, text), (char, n)


def test_long_runs_inside_ordinary_text_encode_as_harmony_does(tok):
    rng = random.Random(0)
    alnum = "".join(rng.choice(string.ascii_letters + string.digits) for _ in range(20_000))
    text = "\n".join(
        [
            "Intro text, with words.  " + "q" * 5000 + " then more.",
            "   " + " " * 4000 + "7",  # a white-space run before a digit, then after text
            "=" * 3000 + "\n" * 2000 + "/" * 700,
            alnum,
            "".join(rng.choice(string.digits) for _ in range(9000)),
            "end" + "\t \t" * 900,
        ]
    )
    assert tok.encode(text) == _harmony(tok, text)


@pytest.mark.parametrize("seed", range(6))
def test_cutting_agrees_with_harmony_on_random_text(tok, seed, monkeypatch):
    """With the long-pre-token threshold at a few characters, nearly every text is cut
    into many stretches and many pre-tokens are merged here: any cut harmony would not
    make, or any merge that differs, changes the ids."""
    rng = random.Random(seed)
    for _ in range(60):
        monkeypatch.setattr(long_text, "LONG_PIECE", rng.choice([1, 2, 3, 5, 8, 40]))
        text = _mixed(rng, rng.choice([30, 200, 1500]))
        assert tok.encode(text) == _harmony(tok, text), (long_text.LONG_PIECE, text)


WEATHER = harmony_model.WEATHER_TOOL


def _chat(rng: random.Random, n: int) -> list[dict]:
    text = lambda: _mixed(rng, n)  # noqa: E731
    return [
        {"role": "system", "content": text()},
        {"role": "developer", "content": text()},
        {"role": "user", "content": text(), "name": "ann"},
        {"role": "assistant", "channel": "analysis", "content": text()},
        {"role": "assistant", "content": text()},
        {"role": "user", "content": text()},
        {
            "role": "assistant",
            "channel": "commentary",
            "recipient": "functions.get_weather",
            "content_type": "<|constrain|>json",
            "content": text(),
        },
        {"role": "tool", "name": "functions.get_weather", "content": text()},
    ]


@pytest.mark.parametrize("seed", range(3))
def test_chat_renders_equal_harmony_with_long_contents(tok, seed, monkeypatch):
    """A message whose content may hold a long pre-token is rendered with a stand-in and
    its content encoded by Tokenizer.encode; with the threshold at a few characters every
    content goes that way, and the ids must still be harmony's whole render (prompt and
    training), system and developer text around the content included."""
    rng = random.Random(seed)
    monkeypatch.setattr(long_text, "LONG_PIECE", 3)
    for tools in (None, [WEATHER]):
        messages = _chat(rng, 300)
        prompt = tk._drop_past_analysis(tk._conversation(messages, "high", tools))
        expected = tok.encoding.render_conversation_for_completion(
            Conversation.from_messages(prompt),
            Role.ASSISTANT,
            config=RenderConversationConfig(auto_drop_analysis=False),
        )
        assert tok.render_chat(messages, "high", tools) == expected
        whole = tk._conversation(messages[:-1], "low", tools)  # ends on the tool call
        expected = tok.encoding.render_conversation_for_training(
            Conversation.from_messages(whole),
            config=RenderConversationConfig(auto_drop_analysis=False),
        )
        assert tok.render_chat_for_training(messages[:-1], "low", tools)[0] == expected


def test_a_chat_of_a_million_letters_renders_in_seconds(tok):
    start = time.perf_counter()
    ids = tok.render_chat([{"role": "user", "content": "q" * 1_000_000}])
    assert time.perf_counter() - start < 60
    prefix = tok.render_chat([{"role": "user", "content": ""}])[:-3]  # up to <|message|>
    assert ids == prefix + [QQ] * 500_000 + ids[-3:]
    assert ids[-3:] == [tk.END_ID, tk.START_ID, tok.encode("assistant")[0]]


def test_a_million_letter_document_is_kept_whole(tok):
    assert tok.encode("qq") == [QQ] and _harmony(tok, "q" * 2000) == [QQ] * 1000
    ids, mask = data.document_ids("q" * 1_000_000)  # what training does with a text document
    assert ids.tolist() == [QQ] * 500_000 + [tk.ENDOFTEXT_ID]
    assert mask.sum() == len(ids)


def _seconds(fn) -> float:
    best = float("inf")
    for _ in range(2):  # the faster of two: less noise from a busy machine
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


@pytest.mark.parametrize(
    "kind",
    ["one letter", "spaces", "random alphanumerics", "digits", "mixed", "unicode"],
)
def test_encoding_time_grows_like_the_text(tok, kind):
    """4x the text takes about 4x the time (n log n where a long pre-token is merged
    here); quadratic growth would be 16x. The bound leaves room for a busy machine."""
    rng = random.Random(1)
    make = {
        "one letter": lambda n: "q" * n,
        "spaces": lambda n: " " * n,
        "random alphanumerics": lambda n: "".join(
            rng.choices(string.ascii_letters + string.digits, k=n)
        ),
        "digits": lambda n: "".join(rng.choices(string.digits, k=n)),
        "mixed": lambda n: _mixed(rng, n),
        "unicode": lambda n: "".join(rng.choices("中文字é\u0301ʰ٣😀Ωж", k=n)),
    }[kind]
    small, large = make(200_000), make(800_000)
    t_small = _seconds(lambda: tok.encode(small))
    t_large = _seconds(lambda: tok.encode(large))
    assert t_large < 60, t_large
    assert t_large / max(t_small, 1e-3) < 9, (t_small, t_large)
