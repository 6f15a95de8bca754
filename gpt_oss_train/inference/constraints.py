"""Constrained decoding: a grammar decides which tokens a request may sample next.

A request's grammar (RequestParams.grammar: Lark text in llguidance's dialect) is compiled
once per distinct text; each request walks its own copy. Before each of its tokens the
host fills the request's row of a bitmask (one bit per vocabulary id), the device sets the
logits outside it to -inf (sampling.py), and the sampled token advances the walk.

The grammars built here cover a Harmony turn as gpt-oss writes it after the rendered
`<|start|>assistant`: the analysis channel stays free text, bounded so that a model that
never closes it still leaves room for the answer, and only what must be exact is
constrained: the final channel's JSON (`json_answer`), a call to a function tool with
arguments valid for its schema (`tool_call`, with the recipient in the header as
openai-harmony renders a call), or strict tools' arguments when the model may also answer
in text (`answer_or_strict_call`). JSON is compact (no free whitespace between tokens) and an
integer without bounds is kept to JSON's safe integers (|n| < 2^53), so the grammar never
lets blanks or digits run on; a string without maxLength, an array without maxItems or a
non-integer number can still run as long as the model keeps them going.

llguidance rather than xgrammar or outlines-core: it needs nothing else installed
(xgrammar requires torch, transformers and triton), it names special tokens inside a
grammar (Harmony's <|channel|>, <|message|>, ...), it takes JSON schema with string
lengths, item counts, enums and nested objects, and it compiles a schema and fills a mask
row in milliseconds against gpt-oss's 201,088-token vocabulary, with no index built over
the vocabulary per schema (outlines-core's way); docs/PERFORMANCE.md has the figures.
"""

from __future__ import annotations

import functools
import json

import llguidance
import numpy as np

from gpt_oss_train.io import tokenizer as tok_lib

WORD_BITS = 32  # a mask row is vocab / 32 uint32 words; bit j of word i: token 32 i + j


class GrammarError(ValueError):
    """A grammar llguidance cannot compile (a bad JSON schema, say)."""


class _HarmonyVocabulary:
    """What llguidance.TokenizerWrapper reads: every id's bytes, the specials, and a
    tokenizer for the text a grammar forces."""

    eos_token_id = tok_lib.RETURN_ID
    bos_token_id = None

    def __init__(self):
        self.tokens = [tok_lib.token_bytes(i) for i in range(tok_lib.VOCAB_SIZE)]
        self.special_token_ids = list(range(tok_lib.STARTOFTEXT_ID, tok_lib.VOCAB_SIZE))
        self._tokenizer = tok_lib.Tokenizer()

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text)


@functools.cache
def vocabulary() -> llguidance.LLTokenizer:
    """The Harmony vocabulary as llguidance's tokenizer (~1 s to build, once a process)."""
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_HarmonyVocabulary()))


@functools.lru_cache(maxsize=256)
def _compiled(grammar: str) -> llguidance.LLMatcher:
    """A fresh walk of `grammar`, to copy (repeated schemas compile once)."""
    matcher = llguidance.LLMatcher(vocabulary(), grammar, log_level=0)
    if matcher.is_error():
        raise GrammarError(matcher.get_error().strip().splitlines()[0])
    return matcher


def check(grammar: str) -> None:
    """Raises GrammarError (its first line) if `grammar` does not compile."""
    if not isinstance(grammar, str) or not grammar.strip():
        raise GrammarError("a grammar is Lark text in llguidance's dialect")
    _compiled(grammar)


class Walk:
    """One request's position in its grammar."""

    def __init__(self, grammar: str):
        self._matcher = _compiled(grammar).deep_copy()

    def fill(self, row: np.ndarray) -> None:
        """Writes the allowed next tokens into `row`, a C-contiguous uint32 [words]."""
        self._matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def advance(self, token: int) -> None:
        """Takes the sampled token; raises GrammarError if the grammar did not allow it."""
        if not self._matcher.consume_token(int(token)):
            raise GrammarError(f"token {token} breaks the grammar: {self._matcher.get_error()}")

    @property
    def done(self) -> bool:
        return self._matcher.is_stopped()


def mask_words(vocab_size: int = tok_lib.VOCAB_SIZE) -> int:
    return -(-vocab_size // WORD_BITS)


# -- grammars of a Harmony turn ----------------------------------------------------------

# The analysis message a constrained turn may open with, bounded to `thought` tokens; after
# it the header of the next message of the turn.
_ANALYSIS = """analysis: <|channel|> "analysis" <|message|> thought <|end|> <|start|> "assistant"
thought[max_tokens={limit}]: /(.|\\n)*/
"""


# JSON's safe integers (what a double holds exactly): llguidance builds a regex per range
# and refuses int64's.
_SAFE_INTEGERS = (-(2**53 - 1), 2**53 - 1)


def _bounded(node):
    """The schema with every integer that has no bound kept to JSON's safe integers, so
    digits cannot run on without end (a model drawing them freely would never stop)."""
    if isinstance(node, list):
        return [_bounded(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: _bounded(v) for k, v in node.items()}
    if out.get("type") == "integer":
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = _SAFE_INTEGERS[0]
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = _SAFE_INTEGERS[1]
    return out


def _compact(schema: dict) -> str:
    """`schema` for %json: integers bounded, JSON written compactly (no whitespace
    between tokens)."""
    return json.dumps({**_bounded(schema), "x-guidance": {"whitespace_flexible": False}})


def _turn(body: str, rules: str, max_thought_tokens: int) -> str:
    if max_thought_tokens > 0:
        return f"start: analysis? {body}\n{_ANALYSIS.format(limit=max_thought_tokens)}{rules}"
    return f"start: {body}\n{rules}"


def json_answer(schema: dict | None, max_thought_tokens: int) -> str:
    """A turn whose final answer is JSON valid for `schema` (None: any JSON object), after
    at most `max_thought_tokens` of analysis (0: none)."""
    schema = {"type": "object"} if schema is None else schema
    if not isinstance(schema, dict):
        raise GrammarError("a JSON schema is an object")
    final = (
        'final: <|channel|> "final" <|message|> answer <|return|>\n'
        f"answer: %json {_compact(schema)}\n"
    )
    return _turn("final", final, max_thought_tokens)


def _tool_name(tool: dict) -> str:
    name = tool.get("name", "")
    if not isinstance(name, str) or not name or any(c in name for c in ' <>\n"\\'):
        raise GrammarError(f"a tool name must be a plain word, got {name!r}")
    return name


def _parameters(tool: dict) -> dict:
    return tool.get("parameters") or {"type": "object"}


def _calls(tools: list[dict], schema_of) -> tuple[list[str], str]:
    """(rule names, rules) of a call to each tool, its arguments held to schema_of(tool)."""
    rules = []
    for i, tool in enumerate(tools):
        rules.append(
            f'call{i}: " to=functions.{_tool_name(tool)}" <|channel|> "commentary " '
            f'<|constrain|> "json" <|message|> args{i} <|call|>\n'
            f"args{i}: %json {_compact(schema_of(tool))}\n"
        )
    return [f"call{i}" for i in range(len(tools))], "".join(rules)


def tool_call(tools: list[dict], only: str | None, max_thought_tokens: int) -> str:
    """A turn that calls one of `tools` ({"name", "parameters"} each), or the one named
    `only`, with arguments valid for its parameters' schema."""
    chosen = [t for t in tools if only is None or t.get("name") == only]
    if not chosen:
        raise GrammarError(f"no tool named {only!r} among the tools given")
    names, rules = _calls(chosen, _parameters)
    return _turn(f"({' | '.join(names)})", rules, max_thought_tokens)


def answer_or_strict_call(tools: list[dict], max_thought_tokens: int) -> str:
    """A turn that ends with a free-text answer or a call to one of `tools`: the
    arguments of a tool marked "strict" valid for its parameters, any JSON object for
    the others (OpenAI's strict function calling, with tool_choice "auto")."""
    names, rules = _calls(
        tools, lambda t: _parameters(t) if t.get("strict") else {"type": "object"}
    )
    final = 'final: <|channel|> "final" <|message|> text <|return|>\ntext: /(.|\\n)*/\n'
    return _turn(f"(final | {' | '.join(names)})", final + rules, max_thought_tokens)
