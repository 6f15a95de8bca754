"""OpenAI's output constraints -> the grammar a request's tokens must follow.

Chat's `response_format` ({"type": "json_schema", "json_schema": {"schema": ...}} or
{"type": "json_object"}) and the Responses API's `text.format` ({"type": "json_schema",
"schema": ...}) hold the final answer to JSON; `tool_choice` "required", or one function
by name (chat: {"type": "function", "function": {"name"}}; responses: {"type":
"function", "name"}), forces a call with arguments valid for the tool's parameters; with
`tool_choice` "auto", a tool marked `"strict": true` has its arguments held to its
parameters whenever the model calls it (the answer stays free text). The
grammars are those of a Harmony turn (inference/constraints.py): the analysis channel
stays free, for at most REASONING_SHARE of the request's max tokens, so that the answer
always has room. A request with none of these has no grammar and pays nothing.
"""

from __future__ import annotations

from typing import Any

from gpt_oss_train.inference import constraints
from gpt_oss_train.inference.server.errors import bad_request

REASONING_SHARE = 0.5  # of max_tokens, for analysis before a constrained answer or call


def _answer_schema(fmt: dict | None, param: str) -> tuple[bool, dict | None]:
    """(whether the answer is JSON, its schema or None for any object) of a format."""
    kind = (fmt or {}).get("type", "text")
    if kind == "text":
        return False, None
    if kind == "json_object":
        return True, None
    if kind == "json_schema":
        spec = fmt.get("json_schema", fmt)  # chat nests the schema one level down
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise bad_request(f"{param}: a json_schema format needs a 'schema' object.", param)
        return True, schema
    raise bad_request(f"{param}: type is text, json_object or json_schema, not {kind!r}.", param)


def _forced_tool(choice: Any, names: list[str]) -> tuple[bool, str | None]:
    """(whether a call is forced, the one tool it must call or None for any)."""
    if choice in (None, "auto", "none"):
        return False, None
    if choice == "required":
        if not names:
            raise bad_request("tool_choice 'required' needs tools.", "tool_choice")
        return True, None
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = choice.get("name") or (choice.get("function") or {}).get("name")
        if name not in names:
            raise bad_request(
                f"tool_choice names {name!r}, which is not a tool given.", "tool_choice"
            )
        return True, name
    raise bad_request(
        "tool_choice is 'auto', 'none', 'required' or {'type': 'function', ...}.", "tool_choice"
    )


def grammar(
    fmt: dict | None, fmt_param: str, choice: Any, tools: list[dict], max_tokens: int
) -> str | None:
    """The grammar of a request (None: unconstrained), checked to compile; a format or
    tool_choice that cannot hold is a 400 naming its field. `tools`: {"name",
    "parameters", "strict"} each."""
    json_answer, schema = _answer_schema(fmt, fmt_param)
    forced, name = _forced_tool(choice, [t["name"] for t in tools])
    if forced and json_answer:
        raise bad_request(
            f"{fmt_param} and a forced tool_choice cannot both hold: the turn ends either "
            "with an answer or with a call.",
            "tool_choice",
        )
    strict = choice in (None, "auto") and any(t.get("strict") for t in tools)
    if not (forced or json_answer or strict):
        return None
    budget = int(max_tokens * REASONING_SHARE)
    param = fmt_param if json_answer else "tool_choice" if forced else "tools"
    try:
        if forced:
            text = constraints.tool_call(tools, name, budget)
        elif json_answer:
            text = constraints.json_answer(schema, budget)
        else:
            text = constraints.answer_or_strict_call(tools, budget)
        constraints.check(text)
    except constraints.GrammarError as e:
        raise bad_request(f"{param}: {e}", param) from None
    return text
