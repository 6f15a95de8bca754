"""OpenAI chat messages -> the Harmony message dicts `Tokenizer.render_chat` takes.

    system / developer / user        the same role and text
    assistant                        its reasoning_content (if sent back) as an analysis
                                     message, its content as final (commentary when it
                                     precedes tool calls: a preamble), each tool call as a
                                     commentary message to functions.NAME in JSON
    tool                             a tool message from functions.NAME, NAME found by
                                     tool_call_id among the earlier calls

`reasoning_effort` goes into the system message and `tools` into the developer message
by the tokenizer; `tool_choice="none"` leaves the tools out of the prompt, so the model
is never shown a function it may not call.
"""

from __future__ import annotations

from gpt_oss_train.inference.server.errors import bad_request
from gpt_oss_train.inference.server.schemas import ChatCompletionRequest, ChatMessage

JSON_CONTENT = "<|constrain|>json"


def _assistant(m: ChatMessage, calls: dict[str, str]) -> list[dict]:
    out = []
    reasoning = m.reasoning_content or m.reasoning
    if reasoning:
        out.append({"role": "assistant", "channel": "analysis", "content": reasoning})
    if m.text():
        channel = "commentary" if m.tool_calls else "final"
        out.append({"role": "assistant", "channel": channel, "content": m.text()})
    for call in m.tool_calls or []:
        calls[call.id] = call.function.name
        out.append(
            {
                "role": "assistant",
                "channel": "commentary",
                "recipient": f"functions.{call.function.name}",
                "content_type": JSON_CONTENT,
                "content": call.function.arguments,
            }
        )
    return out


def _tool(i: int, m: ChatMessage, calls: dict[str, str]) -> dict:
    name = calls.get(m.tool_call_id or "") or m.name
    if not name:
        raise bad_request(
            f"messages[{i}]: a tool message needs the tool_call_id of an earlier assistant "
            "tool call (or a name).",
            f"messages[{i}].tool_call_id",
        )
    return {"role": "tool", "name": f"functions.{name}", "content": m.text()}


def harmony_messages(messages: list[ChatMessage]) -> list[dict]:
    calls: dict[str, str] = {}  # tool_call_id -> function name
    out: list[dict] = []
    for i, m in enumerate(messages):
        if m.role == "assistant":
            out += _assistant(m, calls)
        elif m.role == "tool":
            out.append(_tool(i, m, calls))
        else:
            d = {"role": m.role, "content": m.text()}
            if m.name and m.role == "user":
                d["name"] = m.name
            out.append(d)
    return out


def prompt_texts(req: ChatCompletionRequest) -> list[str]:
    """Text the rendered prompt holds verbatim: every message's content and tool-call
    arguments (not reasoning, which earlier turns drop), and each offered tool's name and
    description lines (harmony writes each line as a "// " comment)."""
    texts = [m.text() for m in req.messages]
    texts += [c.function.arguments for m in req.messages for c in m.tool_calls or []]
    if req.tools and req.tool_choice != "none":
        for t in req.tools:
            lines = (t.function.description or "").replace("\r\n", "\n").split("\n")
            texts += [t.function.name, *lines]
    return texts


def prompt_ids(req: ChatCompletionRequest, tokenizer) -> list[int]:
    """The rendered prompt, ending with `<|start|>assistant`."""
    tools = None
    if req.tools and req.tool_choice != "none":
        tools = [t.model_dump(exclude_none=True) for t in req.tools]
    try:
        return tokenizer.render_chat(
            harmony_messages(req.messages), req.reasoning_effort or "medium", tools
        )
    except ValueError as e:  # e.g. a system message that is not first
        raise bad_request(f"messages: {e}", "messages") from None
