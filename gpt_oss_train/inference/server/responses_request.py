"""POST /v1/responses bodies as pydantic models: the request and its input items.

    input        a string (one user message) or a list of items:
                   message               role user / system / developer / assistant; content a
                                         string or [{"type": "input_text" | "output_text",
                                         "text": ...}]; "type" may be left out
                   function_call         call_id, name, arguments (JSON text)
                   function_call_output  call_id, output
                   reasoning             summary [{"type": "summary_text"}] and/or content
                                         [{"type": "reasoning_text"}], as a response returns it

Output items a response returned are valid input items as they are (their "id", "status"
and empty "annotations" are accepted), so a client can send `response.output` back.

As in schemas.py, an unknown field is refused with 400 naming it, and a field this server
does not implement is refused unless it has its no-op value (`reasoning.summary`);
`text.format` and a forced `tool_choice` become a grammar (structured.py).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from gpt_oss_train.inference.server.errors import bad_request


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Strict):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None  # output_text sent back: always empty here
    logprobs: list[Any] | None = None


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]
    id: str | None = None
    status: str | None = None
    phase: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[TextPart]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(p.text for p in self.output)


class SummaryPart(_Strict):
    type: Literal["summary_text"]
    text: str


class ReasoningPart(_Strict):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(_Strict):
    type: Literal["reasoning"]
    summary: list[SummaryPart] = []
    content: list[ReasoningPart] | None = None
    encrypted_content: None = None  # this server never encrypts reasoning
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        """The chain of thought: its content as generated, else its summary."""
        if self.content:
            return "".join(p.text for p in self.content)
        return "\n\n".join(p.text for p in self.summary)


Item = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
_ITEMS: dict[str, type[BaseModel]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
}


def _where(loc: tuple) -> str:
    """A pydantic error location as a field path: ("content", "list[TextPart]", 0, "type")
    -> "content[0].type" (union branch names, which hold a "[" or are "str", dropped)."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif "[" not in part and part != "str":
            path += f".{part}" if path else part
    return path


def parse_item(i: int, raw: Any) -> Item:
    """input[i] as its item model; 400 naming the field at fault."""
    if not isinstance(raw, dict):
        raise bad_request(f"input[{i}] must be an object (an input item).", f"input[{i}]")
    kind = raw.get("type", "message")
    model = _ITEMS.get(kind)
    if model is None:
        raise bad_request(
            f"input[{i}].type {kind!r} is not supported; send one of {sorted(_ITEMS)}.",
            f"input[{i}].type",
        )
    try:
        return model.model_validate({**raw, "type": kind})
    except ValidationError as e:
        # The deepest error is the informative one where a union tried several branches.
        first = max(e.errors(), key=lambda err: len(err["loc"]))
        param = f"input[{i}].{_where(first['loc'])}".rstrip(".")
        if first["type"] == "extra_forbidden":
            raise bad_request(f"Unrecognized input item field: {param}", param) from None
        raise bad_request(f"{param}: {first['msg']}", param) from None


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ReasoningConfig(_Strict):
    effort: Literal["low", "medium", "high"] | None = None
    summary: str | None = None  # refused: reasoning summaries are not generated
    generate_summary: str | None = None


class TextConfig(_Strict):
    format: dict[str, Any] | None = None


class ResponsesRequest(_Strict):
    model: str
    input: str | list[Any]
    instructions: str | None = None
    reasoning: ReasoningConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    user: str | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    _items: list[Item] = PrivateAttr(default_factory=list)

    @field_validator("input", mode="before")
    @classmethod
    def _input_shape(cls, value):
        if not isinstance(value, (str, list)):
            raise bad_request("input must be a string or a list of input items.", "input")
        return value

    @model_validator(mode="after")
    def _checks(self):
        for name in ("summary", "generate_summary"):
            if self.reasoning and getattr(self.reasoning, name) is not None:
                raise bad_request(
                    f"reasoning.{name}: summaries are not generated (the reasoning item holds "
                    "the whole chain of thought); leave it out.",
                    param=f"reasoning.{name}",
                )
        if isinstance(self.input, str):
            self._items = [MessageItem(role="user", content=self.input)]
        else:
            self._items = [parse_item(i, raw) for i, raw in enumerate(self.input)]
        return self

    @property
    def items(self) -> list[Item]:
        """This request's input as items (a string input: one user message)."""
        return self._items

    @property
    def effort(self) -> str:
        return (self.reasoning.effort if self.reasoning else None) or "medium"

    def text_format(self) -> dict:
        return (self.text.format if self.text else None) or {"type": "text"}

    def offered_tools(self) -> list[FunctionTool]:
        """The tools the prompt shows: none with tool_choice "none", as chat does."""
        return [] if self.tool_choice == "none" else list(self.tools or [])
