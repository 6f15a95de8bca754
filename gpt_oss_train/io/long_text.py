"""Long texts: harmony's ids in n log n time where harmony alone is quadratic.

harmony (tiktoken's algorithm) cuts text into pre-tokens with o200k's regex, then merges
each pre-token's bytes by BPE in time quadratic in its length: a pre-token of 100,000
characters (one letter repeated, a base64 blob, a wall of "=" or of blank lines) takes
seconds, one of 400,000 minutes, and a longer one overflows the regex engine's stack (a
panic). So a text with a pre-token over LONG_PIECE characters is cut where the
pre-tokenizer cuts anyway: harmony encodes the stretches between long pre-tokens, and the
long ones are merged here by harmony's rule (lowest rank first, leftmost on ties) with a
heap, in n log n. The ids are those of harmony's one-piece encoding.

`encode_text(text, encode, ranks)` is io/tokenizer.py's encode of any text (`encode`:
harmony's, `ranks`: a function giving o200k_base's token bytes -> id); `long_content`,
`with_stand_in` and STAND_IN let it render a chat message whose content is long.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import re
import unicodedata
from collections.abc import Callable

from openai_harmony import Message, SystemContent, TextContent

Encode = Callable[[str], list[int]]  # harmony's encoding of ordinary text
Ranks = Callable[[], dict[bytes, int]]  # o200k_base's token bytes -> id, loaded on first use

LONG_PIECE = 512  # characters; harmony merges a pre-token this long in milliseconds
# Unicode White_Space, what Rust's \s matches (Python's \s also takes U+001C..U+001F); it
# has not changed in many Unicode versions, unlike the letter and number classes.
_WHITE_SPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
_WHITE_SPACE_CHARS = frozenset(
    "\t\n\x0b\x0c\r \x85\xa0\u1680\u2028\u2029\u202f\u205f\u3000"
) | frozenset(map(chr, range(0x2000, 0x200B)))
# The Unicode categories o200k's pattern names, and those Python's tables lack.
_CATEGORIES = {
    "upper": ("Lu", "Lt", "Lm", "Lo", "Mn", "Mc", "Me"),  # [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]
    "lower": ("Ll", "Lm", "Lo", "Mn", "Mc", "Me"),  # [\p{Ll}\p{Lm}\p{Lo}\p{M}]
    "letter": ("Lu", "Ll", "Lt", "Lm", "Lo"),  # \p{L}
    "number": ("Nd", "Nl", "No"),  # \p{N}
    "unassigned": ("Cn",),
}


@functools.cache
def _unicode_classes() -> dict[str, str]:
    """Regex class bodies ("\\U...-\\U...") of _CATEGORIES, from Python's unicodedata."""
    runs, start = [], 0  # (first, last, category): about 4,000 runs cover every code point
    for cat, group in itertools.groupby(map(unicodedata.category, map(chr, range(0x110000)))):
        n = sum(1 for _ in group)
        runs.append((start, start + n - 1, cat))
        start += n
    out = {}
    for name, cats in _CATEGORIES.items():
        spans: list[list[int]] = []
        for first, last, cat in runs:
            if cat in cats and spans and spans[-1][1] == first - 1:
                spans[-1][1] = last
            elif cat in cats:
                spans.append([first, last])
        out[name] = "".join(f"\\U{a:08x}-\\U{b:08x}" for a, b in spans)
    return out


@functools.cache
def _pretokenizer() -> re.Pattern:
    """o200k_base's pre-tokenizer (tiktoken's pat_str) in Python's re."""
    c = _unicode_classes()
    up, lo, ln, num, ws = c["upper"], c["lower"], c["letter"], c["number"], _WHITE_SPACE
    contraction = "(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    alternatives = [
        f"[^\\r\\n{ln}{num}]?[{up}]*[{lo}]+{contraction}",
        f"[^\\r\\n{ln}{num}]?[{up}]+[{lo}]*{contraction}",
        f"[{num}]{{1,3}}",
        f" ?[^{ws}{ln}{num}]+[\\r\\n/]*",
        f"[{ws}]*[\\r\\n]+",
        f"[{ws}]+(?![^{ws}])",
        f"[{ws}]+",
    ]
    return re.compile("|".join(alternatives))


@functools.cache
def _unknown_char() -> re.Pattern:
    return re.compile(f"[{_unicode_classes()['unassigned']}]")


@functools.cache
def _white_space_run(length: int) -> re.Pattern:
    # The look-behind makes a search try each run once, from its start: linear time.
    return re.compile(f"(?<![{_WHITE_SPACE}])[{_WHITE_SPACE}]{{{length}}}")


def may_have_long_piece(text: str) -> bool:
    """False when no pre-token of text can pass LONG_PIECE characters, told without
    Unicode tables: a pre-token other than white space holds a space only as its first
    character, so a long one lies in a long stretch without spaces."""
    if len(text) <= LONG_PIECE:
        return False
    if max(map(len, text.split(" "))) >= LONG_PIECE:
        return True
    return _white_space_run(LONG_PIECE).search(text) is not None


def _bpe(piece: bytes, ranks: dict[bytes, int]) -> list[int]:
    """The ids harmony gives one pre-token: merge the adjacent pair whose joined bytes have
    the lowest rank, the leftmost on ties, until no pair joins into a token. The heap holds
    rank << 32 | start of each pair; an entry whose pair has changed since is told by its
    rank (a rank names one byte string) and skipped."""
    if piece in ranks:  # as harmony: a pre-token that is a token is that token
        return [ranks[piece]]
    n = len(piece)
    nxt = list(range(1, n + 1))  # where the next part starts; n after the last part
    prv = list(range(-1, n - 1))
    gone = bytearray(n)  # 1 where a part started before it merged into its left neighbour
    heap = [r << 32 | i for i in range(n - 1) if (r := ranks.get(piece[i : i + 2])) is not None]
    heapq.heapify(heap)
    while heap:
        key = heapq.heappop(heap)
        rank, i = key >> 32, key & 0xFFFFFFFF
        j = n if gone[i] else nxt[i]
        if j == n or ranks.get(piece[i : nxt[j]]) != rank:
            continue
        k = nxt[j]
        gone[j], nxt[i] = 1, k
        if k < n:
            prv[k] = i
            if (r := ranks.get(piece[i : nxt[k]])) is not None:
                heapq.heappush(heap, r << 32 | i)
        if prv[i] >= 0 and (r := ranks.get(piece[prv[i] : k])) is not None:
            heapq.heappush(heap, r << 32 | prv[i])
    ids, i = [], 0
    while i < n:
        ids.append(ranks[piece[i : nxt[i]]])
        i = nxt[i]
    return ids


def _encode_pieces(text: str, encode: Encode, ranks: Ranks) -> list[int]:
    """Ids of a text whose characters Python's Unicode tables all know: its long
    pre-tokens by _bpe, the stretches between them by `encode` (harmony).

    A stretch handed to harmony must end at a pre-token boundary after a character that
    is not white space: cut there, the text encodes as it does whole. After white space it
    may not: o200k's `\\s+(?!\\S)` takes one space more at the end of a text than before a
    digit. Pre-tokens between the last such boundary and a long pre-token are merged here."""
    ids: list[int] = []
    start = stop = 0  # harmony has encoded text[:start]; text[start:stop] may go to it
    held: list[tuple[int, int]] = []  # the pre-tokens since `stop`
    for m in _pretokenizer().finditer(text):
        s, e = m.span()
        if e - s > LONG_PIECE:
            ids += encode(text[start:stop])
            for a, b in held + [(s, e)]:
                ids += _bpe(text[a:b].encode(), ranks())
            start = stop = e
            held = []
        elif text[e - 1] in _WHITE_SPACE_CHARS:
            held.append((s, e))
        else:
            stop, held = e, []
    return ids + encode(text[start:])


def _space_cut(text: str, p: int, step: int) -> int:
    """The nearest position from p (itself included) in direction step (-1 or +1) where a
    space follows a non-space, or the text's start or end. Whatever the Unicode classes,
    a pre-token ends there: none takes a space after a non-space."""
    while 0 < p < len(text) and not (text[p] == " " and text[p - 1] not in _WHITE_SPACE_CHARS):
        p = text.rfind(" ", 0, p) if step < 0 else text.find(" ", p + 1)
        p = max(p, 0) if step < 0 else (len(text) if p < 0 else p)
    return p


# Where a long content goes while harmony renders its message: private-use characters.
STAND_IN = "\U000f8a5e\U000f8a5f"


def long_content(m: Message) -> str | None:
    """The text of m's content (a system message's model identity, a developer message's
    instructions) if it may hold a long pre-token, else None."""
    if len(m.content) != 1:
        return None
    c = m.content[0]
    if isinstance(c, TextContent):
        text = c.text
    elif isinstance(c, SystemContent):
        text = c.model_identity
    else:
        text = getattr(c, "instructions", None)
    return text if text and may_have_long_piece(text) else None


def with_stand_in(m: Message) -> Message:
    """A copy of m with STAND_IN for the text long_content returns."""
    copy = m.model_copy(deep=True)
    c = copy.content[0]
    if isinstance(c, TextContent):
        c.text = STAND_IN
    elif isinstance(c, SystemContent):
        c.model_identity = STAND_IN
    else:
        c.instructions = STAND_IN
    return copy


def encode_text(text: str, encode: Encode, ranks: Ranks) -> list[int]:
    """harmony's `encode(text)` of ordinary text, in time n log n where harmony's can be
    quadratic or overflow its stack. Python's Unicode tables are older than harmony's: a
    character they lack may be a letter or a number to harmony, so the stretch around it,
    from one space after a non-space to the next, goes to harmony as it is."""
    if not may_have_long_piece(text):
        return encode(text)
    ids: list[int] = []
    start = 0
    for m in _unknown_char().finditer(text):
        if m.start() < start:
            continue
        a, b = _space_cut(text, m.start(), -1), _space_cut(text, m.end(), +1)
        ids += _encode_pieces(text[start:a], encode, ranks) + encode(text[a:b])
        start = b
    return ids + _encode_pieces(text[start:], encode, ranks)
