"""Generated Harmony ids -> OpenAI chat deltas, token by token.

openai-harmony's StreamableParser reads the ids; what the model writes goes out by channel:

    analysis                         -> reasoning_content deltas
    final (and commentary preambles) -> content deltas (through the `stop` strings)
    commentary to=functions.NAME     -> a tool call: one delta with its id and name as soon
                                        as the header is read, then its JSON arguments in
                                        as many pieces as the model writes tokens

The same object gives the whole message at the end (`message()`), so a streamed answer
and a non-streamed one are built by one code path and cannot disagree.
"""

from __future__ import annotations

import dataclasses
import uuid

from absl import logging
from openai_harmony import HarmonyError, Role, StreamableParser, StreamState

from gpt_oss_train.inference.server.text import StopMatcher
from gpt_oss_train.io import tokenizer as tok_lib

FUNCTIONS = "functions."


@dataclasses.dataclass
class ToolCallDelta:
    index: int
    arguments: str
    id: str | None = None  # the first delta of a call carries its id and name
    name: str | None = None


@dataclasses.dataclass
class Delta:
    reasoning: str = ""
    content: str = ""
    tool_call: ToolCallDelta | None = None

    def __bool__(self):
        return bool(self.reasoning or self.content or self.tool_call)


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class ChatStream:
    """feed(token) -> [Delta]; finish() -> [Delta] left over; message() -> the whole turn."""

    def __init__(self, stops: list[str] | None = None):
        self._parser = StreamableParser(tok_lib.get_encoding(), Role.ASSISTANT, strict=False)
        self._stop = StopMatcher(stops or [])
        self.reasoning, self.content = "", ""
        self.tool_calls: list[dict] = []  # {"id", "type", "function": {"name", "arguments"}}
        self._call_open = False  # the message being read is a tool call we announced
        self._broken = False
        self.reasoning_tokens = 0  # tokens read as analysis text (the Responses usage's)

    @property
    def stopped(self) -> bool:
        """A `stop` string appeared in the content: generation should end here."""
        return self._stop.stopped

    def feed(self, token: int) -> list[Delta]:
        if self._broken:
            return []
        n_done = len(self._parser.messages)
        in_analysis = self._in_analysis()
        try:
            self._parser.process(int(token))
        except HarmonyError as e:  # the model broke the format; keep what parsed so far
            logging.warning("Harmony parse stopped at token %d: %s", token, e)
            self._broken = True
            return []
        # Text of the analysis message, not the <|end|> that closes it (CONTENT no more).
        if in_analysis and self._parser.state == StreamState.CONTENT:
            self.reasoning_tokens += 1
        out = []
        if self._parser.state == StreamState.CONTENT:
            out += self._announce_call()
            out += self._route(self._parser.last_content_delta or "")
        if len(self._parser.messages) > n_done:
            self._call_open = False
        return [d for d in out if d]

    def _in_analysis(self) -> bool:
        p = self._parser
        in_text = p.state == StreamState.CONTENT and not p.current_recipient
        return in_text and p.current_channel == "analysis"

    def _recipient(self) -> str | None:
        r = self._parser.current_recipient
        return r if r and r.startswith(FUNCTIONS) else None

    def _announce_call(self) -> list[Delta]:
        """The first delta of a tool call, as soon as its header names the function."""
        name = self._recipient()
        if name is None or self._call_open:
            return []
        self._call_open = True
        call = {
            "id": new_call_id(),
            "type": "function",
            "function": {"name": name[len(FUNCTIONS) :], "arguments": ""},
        }
        self.tool_calls.append(call)
        index = len(self.tool_calls) - 1
        return [Delta(tool_call=ToolCallDelta(index, "", call["id"], call["function"]["name"]))]

    def _route(self, text: str) -> list[Delta]:
        if not text:
            return []
        channel = self._parser.current_channel
        if self._call_open:
            self.tool_calls[-1]["function"]["arguments"] += text
            return [Delta(tool_call=ToolCallDelta(len(self.tool_calls) - 1, text))]
        if self._parser.current_recipient:  # a built-in tool (browser, python): not ours
            return []
        if channel == "analysis":
            self.reasoning += text
            return [Delta(reasoning=text)]
        safe, _ = self._stop.push(text)
        self.content += safe
        return [Delta(content=safe)]

    def finish(self) -> list[Delta]:
        """End of generation: close a message cut short, release held-back text."""
        out = []
        if not self._broken:
            try:
                self._parser.process_eos()
            except HarmonyError:  # cut inside a header: nothing of that message to add
                pass
            out += self._catch_up()
        tail = self._stop.flush()
        self.content += tail
        out.append(Delta(content=tail))
        return [d for d in out if d]

    def _catch_up(self) -> list[Delta]:
        """Text harmony only gives once the stream ends (content with no header, which
        non-strict parsing reads as a final message): emitted here so stream == message."""
        parsed = "".join(
            "".join(c.text for c in m.content if hasattr(c, "text"))
            for m in self._parser.messages
            if m.channel in ("final", None) and not m.recipient
        )
        streamed = self.content + self._stop._held
        if self._stop.stopped or not parsed.startswith(streamed) or parsed == streamed:
            return []
        safe, _ = self._stop.push(parsed[len(streamed) :])
        self.content += safe
        return [Delta(content=safe)]

    def message(self) -> dict:
        """The assistant message of a chat.completion response."""
        msg: dict = {"role": "assistant", "content": self.content or None}
        if self.reasoning:
            msg["reasoning_content"] = self.reasoning
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        return msg
