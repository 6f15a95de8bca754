"""Responses API items <-> Harmony: input items -> the message dicts
`Tokenizer.render_chat` takes, and a generated turn's deltas -> output items.

    input item                         Harmony message
    message (user/system/developer)    the same role and text
    message (assistant)                final channel (commentary when a function_call
                                       follows it: a preamble, as chat_format.py does)
    reasoning                          analysis channel
    function_call                      commentary to functions.NAME, JSON content type
    function_call_output               a tool message from functions.NAME (NAME found by
                                       call_id among the earlier function_call items)

    generated                          output item
    analysis                           reasoning {content: [reasoning_text], summary: []}
    final (and commentary preambles)   message {role: assistant, content: [output_text]}
    commentary to functions.NAME       function_call {call_id, name, arguments}

Every reasoning item goes to the renderer, which drops the analysis that precedes the
last final message (the chain of thought of finished turns, never shown to the model
again) and keeps the analysis of the turn in progress (before a function_call whose
output is being sent back), exactly as for chat messages: a conversation continued by
`previous_response_id` and one sent as explicit items render the same.
"""

from __future__ import annotations

import copy
import uuid

from gpt_oss_train.inference.server.chat_format import JSON_CONTENT
from gpt_oss_train.inference.server.errors import bad_request
from gpt_oss_train.inference.server.harmony_stream import FUNCTIONS, Delta, ToolCallDelta
from gpt_oss_train.inference.server.responses_request import (
    FunctionCallItem,
    FunctionCallOutputItem,
    Item,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _assistant(item: MessageItem, preamble: bool) -> dict:
    channel = "commentary" if preamble else "final"
    return {"role": "assistant", "channel": channel, "content": item.text()}


def _call(item: FunctionCallItem) -> dict:
    return {
        "role": "assistant",
        "channel": "commentary",
        "recipient": f"{FUNCTIONS}{item.name}",
        "content_type": JSON_CONTENT,
        "content": item.arguments,
    }


def harmony_messages(items: list[Item], instructions: str | None, first: int = 0) -> list[dict]:
    """The conversation as Harmony message dicts; `instructions` become the developer
    message (after the system message, if any). `first`: the index of this request's
    first input item in `items` (earlier ones come from previous_response_id), so an
    error names the request's own input[i]."""
    names: dict[str, str] = {}  # call_id -> function name
    out: list[dict] = []
    for i, item in enumerate(items):
        if isinstance(item, MessageItem) and item.role == "assistant":
            following = items[i + 1] if i + 1 < len(items) else None
            out.append(_assistant(item, isinstance(following, FunctionCallItem)))
        elif isinstance(item, MessageItem):
            out.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            names[item.call_id] = item.name
            out.append(_call(item))
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in names:
                where = f"input[{max(0, i - first)}].call_id"
                raise bad_request(
                    f"{where}: no function_call with call_id {item.call_id!r} comes before "
                    "this function_call_output (in input or the previous response).",
                    where,
                )
            name = f"{FUNCTIONS}{names[item.call_id]}"
            out.append({"role": "tool", "name": name, "content": item.text()})
        elif isinstance(item, ReasoningItem) and item.text():
            out.append({"role": "assistant", "channel": "analysis", "content": item.text()})
    if instructions:
        at = 1 if out and out[0]["role"] == "system" else 0
        out.insert(at, {"role": "developer", "content": instructions})
    return out


def render_tools(req: ResponsesRequest) -> list[dict] | None:
    """The offered function tools as the tokenizer takes them (None: none)."""
    fields = {"name", "description", "parameters"}
    return [t.model_dump(include=fields) for t in req.offered_tools()] or None


def prompt_texts(items: list[Item], req: ResponsesRequest) -> list[str]:
    """Text the rendered prompt holds verbatim (generation.check_text_length's bound):
    messages, instructions, call arguments and outputs, each offered tool's name and
    description lines; not reasoning, which the renderer may drop."""
    texts = [req.instructions or ""]
    for item in items:
        if isinstance(item, (MessageItem, FunctionCallOutputItem)):
            texts.append(item.text())
        elif isinstance(item, FunctionCallItem):
            texts.append(item.arguments)
    for t in req.offered_tools():
        texts += [t.name, *(t.description or "").replace("\r\n", "\n").split("\n")]
    return texts


class OutputItems:
    """A generated turn's deltas (harmony_stream.ChatStream) -> output items, and the
    streamed events that open, grow and close each one (sequence numbers are added by
    the route). A streamed response and a whole one are built by this one code path.

    An item opens when the kind of text changes (reasoning, message text) or a tool call
    begins, and closes when the next one opens or the turn ends."""

    def __init__(self):
        self.items: list[dict] = []
        self._kind: str | None = None  # the open item's type; None: none is open

    def add(self, delta: Delta) -> list[dict]:
        call = delta.tool_call
        if call is not None:
            if call.id is not None:  # a new call: its first delta names it
                return self.close() + self._open_call(call)
            return self._grow(call.arguments)
        if delta.reasoning:
            kind, text = "reasoning", delta.reasoning
        else:
            kind, text = "message", delta.content
        opened = [] if self._kind == kind else self.close() + self._open(kind)
        return opened + self._grow(text)

    def close(self, status: str = "completed") -> list[dict]:
        """Close the open item (if any) with `status`; returns its closing events."""
        if self._kind is None:
            return []
        item, kind = self.items[-1], self._kind
        self._kind = None
        item["status"] = status
        where = {"item_id": item["id"], "output_index": len(self.items) - 1}
        if kind == "function_call":
            args = {"arguments": item["arguments"]}
            events = [{"type": "response.function_call_arguments.done", **where, **args}]
        else:
            where["content_index"] = 0
            part = item["content"][0]
            name = "reasoning_text" if kind == "reasoning" else "output_text"
            done = {"type": f"response.{name}.done", **where, "text": part["text"]}
            if kind == "message":
                done["logprobs"] = []
            events = [done, {"type": "response.content_part.done", **where, "part": part}]
        events.append(self._item_event("response.output_item.done"))
        return copy.deepcopy(events)

    def _item_event(self, kind: str) -> dict:
        item = copy.deepcopy(self.items[-1])
        return {"type": kind, "output_index": len(self.items) - 1, "item": item}

    def _open(self, kind: str) -> list[dict]:
        if kind == "reasoning":
            item = {"id": new_id("rs"), "type": "reasoning", "summary": [], "content": []}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = {"id": new_id("msg"), "type": "message", "role": "assistant", "content": []}
            part = {"type": "output_text", "text": "", "annotations": []}
        item["status"] = "in_progress"
        self.items.append(item)
        self._kind = kind
        added = self._item_event("response.output_item.added")
        item["content"].append(part)
        where = {"item_id": item["id"], "output_index": len(self.items) - 1, "content_index": 0}
        part_added = {"type": "response.content_part.added", **where, "part": dict(part)}
        return [added, part_added]

    def _open_call(self, call: ToolCallDelta) -> list[dict]:
        item = {
            "id": new_id("fc"),
            "type": "function_call",
            "call_id": call.id,
            "name": call.name,
            "arguments": "",
            "status": "in_progress",
        }
        self.items.append(item)
        self._kind = "function_call"
        return [self._item_event("response.output_item.added")] + self._grow(call.arguments)

    def _grow(self, text: str) -> list[dict]:
        if not text:
            return []
        item = self.items[-1]
        where = {"item_id": item["id"], "output_index": len(self.items) - 1}
        if self._kind == "function_call":
            item["arguments"] += text
            return [{"type": "response.function_call_arguments.delta", **where, "delta": text}]
        item["content"][0]["text"] += text
        name = "reasoning_text" if self._kind == "reasoning" else "output_text"
        event = {"type": f"response.{name}.delta", **where, "content_index": 0, "delta": text}
        if self._kind == "message":
            event["logprobs"] = []  # the event's schema has it; logprobs are not offered
        return [event]
