"""Tokenizer and chat format for GPT-OSS: o200k_harmony through openai-harmony, offline.

openai-harmony (Rust) renders and parses the Harmony chat format, but on first use it
downloads the o200k_base vocabulary from the internet. Training machines often have no
internet, and the same file already ships gzipped inside the bpe-openai wheel, so
`ensure_vocab` unpacks it into a local cache and points harmony at it through
TIKTOKEN_ENCODINGS_BASE (harmony then loads that file and checks its SHA-256 itself).

`Tokenizer` is the one object the rest of the project uses:
  * plain text <-> ids for pre-training (documents separated by `eos_id`), of any length
    (long_text.py: harmony alone is quadratic in the longest pre-token);
  * chat dicts (+ function tools) -> prompt ids for generation (`render_chat`);
  * chat dicts -> ids + loss mask for fine-tuning (`render_chat_for_training`);
  * generated ids -> messages (`parse_completion`, `stream_parser`).

Chat messages are plain dicts:
  {"role": "system"|"developer"|"user"|"assistant"|"tool", "content": str,
   optional "channel": "analysis"|"commentary"|"final", "recipient": str, "name": str,
   "content_type": str}
"""

from __future__ import annotations

import base64
import functools
import gzip
import hashlib
import importlib.util
import os
import pathlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from openai_harmony import (
    Author,
    Conversation,
    DeveloperContent,
    HarmonyEncoding,
    HarmonyEncodingName,
    HarmonyError,
    Message,
    ReasoningEffort,
    RenderConversationConfig,
    RenderOptions,
    Role,
    StreamableParser,
    SystemContent,
    TextContent,
    ToolDescription,
    load_harmony_encoding,
)

from gpt_oss_train.io import long_text, storage

# --------------------------------------------------------------------------------------
# Token ids of o200k_harmony. They are fixed by the published encoding; the tests check
# them against harmony so a changed encoding fails loudly instead of silently shifting.
# --------------------------------------------------------------------------------------
STARTOFTEXT_ID = 199998  # <|startoftext|>
ENDOFTEXT_ID = 199999  # <|endoftext|>: document separator in pre-training, and padding
PAD_ID = ENDOFTEXT_ID  # padding is masked out of the loss, so reusing a real id is safe
RETURN_ID = 200002  # <|return|>: the assistant is done with its turn
CONSTRAIN_ID = 200003  # <|constrain|>: precedes a content type such as "json"
CHANNEL_ID = 200005  # <|channel|>
START_ID = 200006  # <|start|>: opens every message header
END_ID = 200007  # <|end|>: closes a message that is not the end of the turn
MESSAGE_ID = 200008  # <|message|>: separates header from content
CALL_ID = 200012  # <|call|>: closes an assistant message addressed to a tool
# Embedding rows of the model. Unnamed ids from 200000 up are reserved specials the model
# never emits. (harmony's tokenizer also knows <|reserved_201088|>, one past the last row.)
VOCAB_SIZE = 201088

VOCAB_FILE = "o200k_base.tiktoken"
# SHA-256 of the *unzipped* o200k_base.tiktoken; harmony checks the same hash.
VOCAB_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"

_REASONING = {
    "low": ReasoningEffort.LOW,
    "medium": ReasoningEffort.MEDIUM,
    "high": ReasoningEffort.HIGH,
}
_ROLES = {r.value: r for r in Role}
_CHANNELS = ("analysis", "commentary", "final")
_MESSAGE_KEYS = {"role", "content", "channel", "recipient", "name", "content_type"}


# --------------------------------------------------------------------------------------
# Vocabulary file
# --------------------------------------------------------------------------------------
def _sha256(path: pathlib.Path) -> str | None:
    """Hex SHA-256 of a file, or None when it cannot be read (missing, a folder, ...)."""
    try:
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except OSError:
        return None


def _packaged_vocab_gz() -> pathlib.Path:
    """Where the bpe-openai wheel keeps o200k_base.tiktoken.gz (a function so tests can swap it).

    The package is located, not imported: importing bpe_openai builds its own tokenizers
    (about half a second) and we only want one of its data files.
    """
    spec = importlib.util.find_spec("bpe_openai")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "The o200k_base vocabulary is taken from the bpe-openai package, which is not "
            "installed. Install it with `pip install 'bpe-openai>=0.1.4'`."
        )
    return pathlib.Path(next(iter(spec.submodule_search_locations))) / "data" / (VOCAB_FILE + ".gz")


def default_cache_dir() -> pathlib.Path:
    """`$GPT_OSS_TRAIN_CACHE/tiktoken` if that variable is set, else
    ~/.cache/gpt_oss_train/tiktoken."""
    root = os.environ.get("GPT_OSS_TRAIN_CACHE")
    base = (
        pathlib.Path(root).expanduser()
        if root
        else pathlib.Path.home() / ".cache" / "gpt_oss_train"
    )
    return base / "tiktoken"


def ensure_vocab(cache_dir: str | os.PathLike[str] | None = None) -> pathlib.Path:
    """Make o200k_base.tiktoken available offline and point harmony at it; return its folder.

    Must run before `load_harmony_encoding` (harmony reads TIKTOKEN_ENCODINGS_BASE when it
    loads). If the user already set TIKTOKEN_ENCODINGS_BASE to a folder holding a valid
    file, that folder is kept. Otherwise the file is unpacked from the bpe-openai wheel into
    `cache_dir` (default: `default_cache_dir()`), unless a valid copy is already there.
    """
    user_dir = os.environ.get("TIKTOKEN_ENCODINGS_BASE")
    if user_dir and _sha256(pathlib.Path(user_dir) / VOCAB_FILE) == VOCAB_SHA256:
        return pathlib.Path(user_dir)

    folder = pathlib.Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = folder / VOCAB_FILE
    # A wrong hash means a truncated or edited file; harmony would refuse it, so rewrite it.
    if _sha256(target) != VOCAB_SHA256:
        source = _packaged_vocab_gz()
        if not source.is_file():
            raise RuntimeError(
                f"{source} is missing; reinstall bpe-openai "
                "(`pip install --force-reinstall bpe-openai`)."
            )
        data = gzip.decompress(source.read_bytes())
        digest = hashlib.sha256(data).hexdigest()
        if digest != VOCAB_SHA256:
            raise RuntimeError(
                f"The vocabulary shipped in {source} has SHA-256 {digest}, expected "
                f"{VOCAB_SHA256}. The bpe-openai installation is damaged or a different "
                "version; reinstall it (`pip install --force-reinstall bpe-openai`)."
            )
        # Atomic: a reader (or a second process racing us) sees the old or the complete
        # new file, never a half-written one.
        storage.write_atomic(target, data)
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(folder)
    return folder


@functools.cache
def _mergeable_ranks() -> dict[bytes, int]:
    """o200k_base's ranks (token bytes -> id): harmony's ids of ordinary text."""
    ranks = {}
    for line in (ensure_vocab() / VOCAB_FILE).read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


@functools.cache
def _ordinary_token_bytes() -> tuple[bytes, ...]:
    """The bytes of every ordinary token, by id (specials come after them)."""
    table = [b""] * STARTOFTEXT_ID
    for token, rank in _mergeable_ranks().items():
        table[rank] = token
    return tuple(table)


def is_special(token: int) -> bool:
    return token >= STARTOFTEXT_ID


def token_bytes(token: int) -> bytes:
    """A token's bytes; a special token's are its "<|...|>" name."""
    if is_special(token):
        return Tokenizer().decode([token]).encode()
    return _ordinary_token_bytes()[token]


@functools.cache
def get_encoding() -> HarmonyEncoding:
    """The o200k_harmony HarmonyEncoding, loaded once per process without any download."""
    ensure_vocab()
    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


# --------------------------------------------------------------------------------------
# Chat dicts -> harmony Messages
# --------------------------------------------------------------------------------------
def _reasoning_effort(effort: str | ReasoningEffort) -> ReasoningEffort:
    if isinstance(effort, ReasoningEffort):
        return effort
    try:
        return _REASONING[str(effort).lower()]
    except KeyError:
        raise ValueError(
            f"reasoning_effort={effort!r} is not one of 'low', 'medium', 'high'."
        ) from None


def _check_message(i: int, m: Any) -> None:
    """Raise ValueError, naming message i and the fix, unless m is a well-formed chat dict."""
    if not isinstance(m, Mapping):
        raise ValueError(
            f"message {i} is a {type(m).__name__}; give a dict with 'role' and 'content'."
        )
    unknown = set(m) - _MESSAGE_KEYS
    if unknown:
        raise ValueError(
            f"message {i} has unknown keys {sorted(unknown)}; "
            f"allowed keys are {sorted(_MESSAGE_KEYS)}."
        )
    role = m.get("role")
    if not isinstance(role, str) or role not in _ROLES:
        raise ValueError(f"message {i} has role {role!r}; use one of {sorted(_ROLES)}.")
    content = m.get("content")
    if not isinstance(content, str):
        raise ValueError(
            f"message {i} ({role}) has content of type {type(content).__name__}; content "
            "must be a str (join multi-part content into one string first)."
        )
    channel = m.get("channel")
    if channel is not None and channel not in _CHANNELS:
        raise ValueError(
            f"message {i} has channel {channel!r}; use one of {list(_CHANNELS)} or leave it out."
        )
    for key in ("recipient", "name", "content_type"):
        if m.get(key) is not None and not isinstance(m[key], str):
            raise ValueError(f"message {i} has a non-string {key!r}; give a str or leave it out.")
    if m.get("name") is not None and role not in ("user", "tool"):
        # harmony would render "<|start|>assistant:name", a header the model never saw.
        raise ValueError(
            f"message {i} ({role}) has 'name'; only user and tool messages carry a name "
            "(for a tool call, put the tool in the assistant message's 'recipient')."
        )
    if role == "system" and i != 0:
        raise ValueError(f"message {i} is a system message; the system message must come first.")
    if role == "tool" and not m.get("name"):
        raise ValueError(
            f"message {i} is a tool message without 'name'; set it to the tool that "
            "answered, e.g. 'functions.get_weather'."
        )


def _harmony_message(m: Mapping[str, Any], effort: ReasoningEffort) -> Message:
    """One checked chat dict as a harmony Message (the mapping `_to_harmony` describes)."""
    role, content = m["role"], m["content"]
    channel, recipient, name = m.get("channel"), m.get("recipient"), m.get("name")
    if role == "system":
        body = SystemContent.new().with_model_identity(content).with_reasoning_effort(effort)
        msg = Message.from_role_and_content(Role.SYSTEM, body)
    elif role == "developer":
        msg = Message.from_role_and_content(
            Role.DEVELOPER, DeveloperContent.new().with_instructions(content)
        )
    elif role == "tool":
        msg = Message(author=Author(role=Role.TOOL, name=name), content=[TextContent(text=content)])
        recipient = recipient or "assistant"
        channel = channel or "commentary"
    else:
        msg = Message(
            author=Author(role=_ROLES[role], name=name), content=[TextContent(text=content)]
        )
        if role == "assistant":
            channel = channel or "final"
    msg.channel = channel
    msg.recipient = recipient
    msg.content_type = m.get("content_type")
    return msg


def _to_harmony(messages: Sequence[Mapping[str, Any]], effort: ReasoningEffort) -> list[Message]:
    """Validate chat dicts and turn them into harmony Messages, system message first.

    Mapping choices (each matches how GPT-OSS was trained to see its prompt):
      * system: the string becomes the model-identity line of a full Harmony system
        message, so the reasoning-effort, knowledge-cutoff and channel lines stay in;
        with no system message a default one ("You are ChatGPT, ...") is inserted.
      * developer: the string becomes DeveloperContent instructions ("# Instructions").
      * assistant: with no "channel", the message goes to "final" (plain chat data is
        answers, and Harmony requires a channel on every assistant message).
      * tool: needs "name" (e.g. "functions.get_weather"); recipient defaults to
        "assistant" and channel to "commentary", the format of tool results in Harmony.
    """
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise ValueError("messages must be a list of dicts like {'role': 'user', 'content': 'Hi'}.")
    out: list[Message] = []
    for i, m in enumerate(messages):
        _check_message(i, m)
        out.append(_harmony_message(m, effort))
    if not out or out[0].author.role != Role.SYSTEM:
        out.insert(
            0,
            Message.from_role_and_content(
                Role.SYSTEM, SystemContent.new().with_reasoning_effort(effort)
            ),
        )
    return out


def _tool_descriptions(tools: Sequence[Mapping[str, Any]]) -> list[ToolDescription]:
    """OpenAI function tools ({"type": "function", "function": {...}} or the bare function
    dict: "name", optional "description" and JSON-schema "parameters") -> harmony's."""
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise ValueError(
            "tools must be a list of dicts like {'type': 'function', 'function': ...}."
        )
    out = []
    for i, tool in enumerate(tools):
        f = tool.get("function", tool) if isinstance(tool, Mapping) else None
        if not isinstance(f, Mapping) or not isinstance(f.get("name"), str) or not f["name"]:
            raise ValueError(f"tool {i} has no function name; give {{'name': 'get_weather', ...}}.")
        description, parameters = f.get("description") or "", f.get("parameters")
        if not isinstance(description, str) or not isinstance(parameters, (Mapping, type(None))):
            raise ValueError(
                f"tool {i} ({f['name']}): 'description' must be a str and 'parameters' a dict."
            )
        out.append(ToolDescription.new(f["name"], description, parameters))
    return out


def _with_function_tools(messages: list[Message], tools: Sequence[Mapping[str, Any]]) -> None:
    """Put the tools into the first developer message's "functions" namespace, or into a
    developer message of their own right after the system message (harmony's layout)."""
    descriptions = _tool_descriptions(tools)
    if not descriptions:
        return
    for m in messages:
        if m.author.role == Role.DEVELOPER:
            m.content[0].with_function_tools(descriptions)  # DeveloperContent, from _to_harmony
            return
    content = DeveloperContent.new().with_function_tools(descriptions)
    messages.insert(1, Message.from_role_and_content(Role.DEVELOPER, content))


def _conversation(
    messages: Sequence[Mapping[str, Any]],
    reasoning_effort: str,
    tools: Sequence[Mapping[str, Any]] | None,
) -> list[Message]:
    msgs = _to_harmony(messages, _reasoning_effort(reasoning_effort))
    if tools is not None:
        _with_function_tools(msgs, tools)
    return msgs


def _drop_past_analysis(messages: list[Message]) -> list[Message]:
    """Drop assistant analysis messages that precede the last final-channel message.

    Harmony's guidance is that chain-of-thought of finished turns is removed from later
    prompts. Harmony's own auto_drop_analysis (0.0.8) only drops analysis before the
    *first* final message, so in a 3-turn chat the 2nd turn's analysis would survive;
    this does what the guidance says. Analysis after the last final (the turn in
    progress, e.g. around tool calls) is kept.
    """
    finals = [
        i
        for i, m in enumerate(messages)
        if m.author.role == Role.ASSISTANT and m.channel == "final"
    ]
    if not finals:
        return messages
    last_final = finals[-1]
    return [
        m
        for i, m in enumerate(messages)
        if not (i < last_final and m.author.role == Role.ASSISTANT and m.channel == "analysis")
    ]


def _message_to_dict(m: Message) -> dict[str, Any]:
    out: dict[str, Any] = {
        "role": m.author.role.value,
        "channel": m.channel,
        "recipient": m.recipient,
        "content_type": m.content_type,
        "content": "".join(c.text for c in m.content if isinstance(c, TextContent)),
    }
    if m.author.name is not None:
        out["name"] = m.author.name
    return out


# --------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------
class StreamParser:
    """Incremental parser of generated ids for a terminal chat UI.

    `process(tok)` returns (channel, delta): the channel of the message being written
    (None while a header is being read) and the new text ("" for header/control tokens
    and for a token that ends mid UTF-8 character; harmony holds those bytes back and
    emits the whole character with the next token). Raises HarmonyError on ids that do
    not fit the format even in non-strict mode.
    """

    def __init__(self, encoding: HarmonyEncoding):
        # Non-strict: tolerate the small format slips a sampled model makes.
        self._parser = StreamableParser(encoding, Role.ASSISTANT, strict=False)

    def process(self, token: int) -> tuple[str | None, str]:
        self._parser.process(int(token))
        return self._parser.current_channel, self._parser.last_content_delta or ""

    def finish(self) -> list[dict[str, Any]]:
        """Close the stream (end of generation) and return all parsed messages."""
        self._parser.process_eos()
        return self.messages

    @property
    def messages(self) -> list[dict[str, Any]]:
        """Messages completed so far, as dicts like `parse_completion` returns."""
        return [_message_to_dict(m) for m in self._parser.messages]


class Tokenizer:
    """o200k_harmony text tokenizer plus the Harmony chat format. Cheap to construct."""

    eos_id = ENDOFTEXT_ID
    pad_id = PAD_ID
    vocab_size = VOCAB_SIZE
    # Generation ends the turn on <|return|> (answer done) or <|call|> (tool call to run).
    # <|end|> is not a stop: after an analysis message the model goes on by itself.
    stop_ids = frozenset({RETURN_ID, CALL_ID})

    def __init__(self, encoding: HarmonyEncoding | None = None):
        self.encoding = encoding if encoding is not None else get_encoding()

    # ---- plain text -------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Ids of ordinary text. Special-token strings such as "<|end|>" inside the text are
        encoded as the plain characters they are, never as control tokens: harmony would
        otherwise raise on them (its default) or, if allowed, let data inject control tokens.
        Any length: a long pre-token (a run of one letter, say) is merged here rather than
        by harmony, with the same ids (see "Long texts")."""
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, got {type(text).__name__}.")
        return long_text.encode_text(text, self._encode_ordinary, _mergeable_ranks)

    def _encode_ordinary(self, text: str) -> list[int]:
        return self.encoding.encode(text, allowed_special=set(), disallowed_special=())

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ids; special ids decode to their "<|...|>" text. Bytes that are not valid
        UTF-8 (a character cut between tokens) become U+FFFD instead of raising."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < VOCAB_SIZE]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {VOCAB_SIZE}).")
        return self.encoding.decode(ids, errors="replace")

    # ---- chat -------------------------------------------------------------------------
    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        reasoning_effort: str = "medium",
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """Prompt ids for generating the next assistant turn; ends with `<|start|>assistant`.

        Analysis messages of finished turns are dropped (see `_drop_past_analysis`), as
        the model saw its history in training. `tools` (OpenAI function definitions) go
        into the developer message's "functions" namespace; the model calls one with an
        assistant message on the commentary channel to "functions.NAME", answered by a
        tool message named "functions.NAME".
        """
        msgs = _drop_past_analysis(_conversation(messages, reasoning_effort, tools))
        if any(long_text.long_content(m) is not None for m in msgs):
            options = RenderOptions(conversation_has_function_tools=bool(tools))
            ids = [t for m in msgs for t in self._render_message(m, options)]
            return ids + [START_ID, *self.encode(Role.ASSISTANT.value)]
        return self.encoding.render_conversation_for_completion(
            Conversation.from_messages(msgs),
            Role.ASSISTANT,
            config=RenderConversationConfig(auto_drop_analysis=False),  # dropped above
        )

    def render_chat_for_training(
        self,
        messages: Sequence[Mapping[str, Any]],
        reasoning_effort: str = "medium",
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> tuple[list[int], list[int]]:
        """(ids, loss_mask) of a whole conversation; the mask is 1 on what the model writes.
        `tools` as in `render_chat`.

        The ids equal harmony's `render_conversation_for_training(...,
        auto_drop_analysis=False)`: every message given is rendered (drop analysis of
        earlier turns yourself if training context should match `render_chat`), and a last
        assistant message on the final channel ends with <|return|> instead of <|end|>.

        Loss-mask rule (1 = trained), message by message:
          * system, developer, user and tool messages: 0 (the prompt supplies them);
          * an assistant message: 1 on everything after `<|start|>assistant`, i.e. the rest
            of the header (" to=...", "<|channel|>final", "<|constrain|>json"), the
            "<|message|>", the content and the terminator (<|end|>, <|return|>, <|call|>);
          * its leading `<|start|>assistant` is 1 only when the previous message is an
            assistant message that ended with <|end|> mid-turn (not final, no recipient):
            the model writes that header itself after e.g. its analysis. After a user or
            tool message, or a finished turn, the prompt (`render_chat`) supplies it: 0;
          * exception: a final-channel message that is not the last message is rendered
            with <|end|> (how history looks in later prompts), but the model really ends
            such a turn with <|return|>, so that <|end|> gets 0 rather than teaching the
            model to keep talking after its answer.
        """
        msgs = _conversation(messages, reasoning_effort, tools)
        if not any(m.author.role == Role.ASSISTANT for m in msgs):
            raise ValueError(
                "render_chat_for_training needs at least one assistant message to train on."
            )
        header = [START_ID, *self.encode(Role.ASSISTANT.value)]  # `<|start|>assistant`
        # The system message names the functions namespace when tools are given, as harmony
        # does when it renders the whole conversation.
        options = RenderOptions(conversation_has_function_tools=bool(tools))
        ids: list[int] = []
        mask: list[int] = []
        prev_continues_turn = False
        for i, m in enumerate(msgs):
            toks = self._render_message(m, options)
            is_last = i == len(msgs) - 1
            if m.author.role != Role.ASSISTANT:
                ids += toks
                mask += [0] * len(toks)
                prev_continues_turn = False
                continue
            assert toks[: len(header)] == header, "harmony changed the assistant header"
            is_final = m.channel == "final"
            m_mask = [1] * len(toks)
            if not prev_continues_turn:
                m_mask[: len(header)] = [0] * len(header)
            if is_final and is_last:
                toks[-1] = RETURN_ID  # as harmony's training render: the turn's real last token
            elif is_final:
                m_mask[-1] = 0
            ids += toks
            mask += m_mask
            prev_continues_turn = toks[-1] == END_ID and not is_final
        return ids, mask

    def render_reply_for_training(
        self,
        prompt: Sequence[Mapping[str, Any]],
        reply: Sequence[Mapping[str, Any]],
        reasoning_effort: str = "medium",
    ) -> tuple[list[int], list[int]]:
        """(ids, loss_mask) of `prompt` followed by the assistant messages `reply`, the mask
        1 on the reply alone (render_chat_for_training's rule, within the reply): what a
        preference pair compares is the two replies' log-probabilities, never the prompt's,
        even where the prompt holds earlier assistant turns."""
        ids, mask = self.render_chat_for_training([*prompt, *reply], reasoning_effort)
        options = RenderOptions(conversation_has_function_tools=False)
        prompt_len = sum(
            len(self._render_message(m, options))
            for m in _conversation(prompt, reasoning_effort, None)
        )
        return ids, [0] * prompt_len + mask[prompt_len:]

    def _render_message(self, m: Message, options: RenderOptions) -> list[int]:
        """harmony's render of one message. A content that may hold a long pre-token is
        rendered as a stand-in, then put back and encoded by `encode`: harmony encodes a
        message's content text (for system and developer messages, the whole text it
        builds around the content) in one piece, between <|message|> and the last token."""
        text = long_text.long_content(m)
        if text is None:
            return self.encoding.render(m, options)
        toks = self.encoding.render(long_text.with_stand_in(m), options)
        at = toks.index(MESSAGE_ID) + 1
        # The content comes first in the text harmony builds, before any tool description
        # that might also hold the stand-in.
        body = self.encoding.decode(toks[at:-1]).replace(long_text.STAND_IN, text, 1)
        return toks[:at] + self.encode(body) + toks[-1:]

    def parse_completion(self, tokens: Iterable[int]) -> list[dict[str, Any]]:
        """Messages in generated ids (what followed `<|start|>assistant`).

        Returns [{"role", "channel", "recipient", "content_type", "content"}, ...] ("name"
        too when a header names one). A trailing stop id (<|return|>, <|call|>, <|end|>)
        may be there or not: it is fed to harmony rather than stripped, because in
        non-strict mode harmony reads header-less text as content only once it sees the
        stop id. Parsing stops at the first id that breaks the format, so a truncated or
        partly garbled completion still yields its parsed prefix; a message cut inside
        its content is returned with the text so far, one cut inside its header is dropped.
        """
        parser = StreamableParser(self.encoding, Role.ASSISTANT, strict=False)
        for t in tokens:
            try:
                parser.process(int(t))
            except HarmonyError:  # e.g. text after <|return|>; keep what parsed so far
                break
        try:
            parser.process_eos()  # closes a message cut inside its content
        except HarmonyError:  # cut inside a header: nothing of that message to return
            pass
        return [_message_to_dict(m) for m in parser.messages]

    def stream_parser(self) -> StreamParser:
        return StreamParser(self.encoding)
