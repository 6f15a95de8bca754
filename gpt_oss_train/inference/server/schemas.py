"""OpenAI request bodies as pydantic models.

Unknown fields are refused (400 naming the field) rather than silently ignored, so a
client never believes a setting took effect when it did not. Fields of OpenAI's schema
that this server does not implement are accepted only at their no-op value (`suffix`
empty, `response_format` text, ...). Two extensions vLLM also has:
`top_k`, and `return_token_ids` (the prompt's ids in the response as `prompt_token_ids`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gpt_oss_train.inference.scoring import MAX_TOP_LOGPROBS
from gpt_oss_train.inference.server.errors import bad_request


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class FunctionCall(_Strict):
    name: str
    arguments: str


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDef(_Strict):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: dict[str, str]  # {"name": ...}


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    # The analysis channel of an earlier assistant turn (what responses return); kept in
    # the prompt while its turn is still going on (tool calls), as Harmony asks.
    reasoning_content: str | None = None
    reasoning: str | None = None
    refusal: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class _Sampling(_Strict):
    """Fields chat and completions share."""

    model: str
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    n: int = Field(default=1, ge=1, le=16)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**32)
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = Field(default=0.0, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(default=0.0, ge=-2.0, le=2.0)
    # token id (a string, as JSON keys are) -> an amount in [-100, 100] added to its logit
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    return_token_ids: bool = False

    @model_validator(mode="after")
    def _shared_checks(self):
        for key, amount in (self.logit_bias or {}).items():
            if not key.isdigit() or not -100 <= amount <= 100:
                raise bad_request(
                    f"logit_bias: {key!r}: {amount!r}: keys are token ids, amounts in [-100, 100].",
                    "logit_bias",
                )
        stops = self.stop_list()
        if len(stops) > 4 or any(not s for s in stops):
            raise bad_request("stop takes at most 4 non-empty strings.", "stop")
        return self

    def logit_adjustments(self) -> dict:
        """RequestParams' logit_bias and penalties (the engine checks ids against the
        vocabulary)."""
        return dict(
            logit_bias=tuple((int(k), float(v)) for k, v in (self.logit_bias or {}).items()),
            frequency_penalty=float(self.frequency_penalty or 0.0),
            presence_penalty=float(self.presence_penalty or 0.0),
        )

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none"] | NamedToolChoice | Literal["required"] | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    response_format: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None

    @model_validator(mode="after")
    def _chat_checks(self):
        # response_format and a forced tool_choice become a grammar (structured.py)
        if self.top_logprobs and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs=true.", "top_logprobs")
        return self

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def tool_choice_value(self):
        """tool_choice as plain JSON ("auto", "required", {"type": "function", ...})."""
        choice = self.tool_choice
        return choice.model_dump() if isinstance(choice, NamedToolChoice) else choice


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _completion_checks(self):
        if self.suffix:  # gpt-oss has no fill-in-the-middle tokens: nothing to render it with
            raise bad_request(
                "suffix is not supported: gpt-oss was not trained for fill-in-the-middle; "
                "leave it out.",
                "suffix",
            )
        if self.best_of not in (None, self.n):
            raise bad_request("best_of is not supported; leave it out or set it to n.")
        if self.max_tokens == 0 and not self.echo:
            raise bad_request("max_tokens=0 only makes sense with echo=true.", "max_tokens")
        if self.max_tokens == 0 and self.stream:
            raise bad_request("max_tokens=0 cannot be streamed.", "max_tokens")
        return self

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise bad_request("prompt is empty.", "prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)
