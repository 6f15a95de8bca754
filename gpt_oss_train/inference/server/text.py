"""Generated ids -> text as it streams, and OpenAI `stop` strings on that text.

A token can end in the middle of a UTF-8 character, so text is decoded from each token's
bytes by an incremental decoder: a cut character is held back until the token that
completes it. Stop strings are matched on the decoded text: text that could be the start
of a stop string is held back until it is known not to be one, so a client never sees
part of a stop string, and the stop string itself is trimmed (as OpenAI does).
"""

from __future__ import annotations

import codecs

from gpt_oss_train.io import tokenizer as tok_lib


def token_text(token: int) -> str:
    """One token as text on its own (what logprobs report); a cut character is U+FFFD."""
    return tok_lib.token_bytes(token).decode("utf-8", errors="replace")


class Detokenizer:
    """push(token) -> the text it completes. Special tokens give "" unless `specials`."""

    def __init__(self, specials: bool = False):
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._specials = specials

    def push(self, token: int) -> str:
        if tok_lib.is_special(token) and not self._specials:
            return ""
        return self._decoder.decode(tok_lib.token_bytes(token))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


def decode(tokens, specials: bool = False) -> str:
    d = Detokenizer(specials)
    return "".join(d.push(t) for t in tokens) + d.flush()


class StopMatcher:
    """push(text) -> (text safe to emit, stopped). After a stop, everything is dropped."""

    def __init__(self, stops: list[str]):
        self._stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False

    def push(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self._stops:
            return text, False
        buf = self._held + text
        hits = [i for i in (buf.find(s) for s in self._stops) if i >= 0]
        if hits:
            self.stopped, self._held = True, ""
            return buf[: min(hits)], True
        keep = self._partial_suffix(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest end of buf that is a proper prefix of a stop string."""
        best = 0
        for s in self._stops:
            for n in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:n]):
                    best = n
                    break
        return best

    def flush(self) -> str:
        """At the end of generation: the held text was not a stop string after all."""
        held, self._held = self._held, ""
        return "" if self.stopped else held
