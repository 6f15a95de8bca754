"""The o200k_harmony tokenizer as Hugging Face files (gpt_oss_train.io.hf_tokenizer).

The reference is openai-harmony through our Tokenizer: transformers' AutoTokenizer, loaded
offline from the written files, must give its ids on real text and render its chat prompts.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import subprocess
import sys
import sysconfig

import numpy as np
import pytest
import transformers

from gpt_oss_train.io import hf, hf_config, hf_tokenizer
from gpt_oss_train.io import tokenizer as tk


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf_tokenizer")
    hf_tokenizer.save_tokenizer(folder, model_max_length=131072)
    return folder


@pytest.fixture(scope="module")
def hf_tok(hf_folder):
    assert os.environ["HF_HUB_OFFLINE"] == "1"  # conftest: nothing can be downloaded
    return transformers.AutoTokenizer.from_pretrained(hf_folder)


@pytest.fixture(scope="module")
def ref():
    return tk.Tokenizer()


def hf_ids(hf_tok, texts):
    """Plain-text ids, special-token strings encoded as text (as Tokenizer.encode does)."""
    return hf_tok(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"]


# ----------------------------------------------------------------------------------------
# tokenizer.json: ids
# ----------------------------------------------------------------------------------------
def test_byte_to_unicode_is_a_printable_bijection():
    table = hf_tokenizer.byte_to_unicode()
    assert sorted(table) == list(range(256)) and len(set(table.values())) == 256
    assert all(c.isprintable() and not c.isspace() for c in table.values())
    assert table[ord("A")] == "A" and table[ord(" ")] == "\u0120" and table[ord("\n")] == "\u010a"


def test_recover_merges_follows_ranks():
    ranks = {b"a": 0, b"b": 1, b"c": 2, b"bc": 3, b"ab": 4, b"abc": 5, b"cab": 6}
    # "abc": with ranks below 5 BPE merges "bc" (3) before "ab" (4): abc = a + bc.
    # "cab": ab (4) is the only pair below 6, so cab = c + ab.
    assert hf_tokenizer.recover_merges(ranks) == [
        (b"b", b"c"),
        (b"a", b"b"),
        (b"a", b"bc"),
        (b"c", b"ab"),
    ]
    with pytest.raises(ValueError, match="not a merge of two lower ranks"):
        hf_tokenizer.recover_merges({b"a": 0, b"b": 1, b"c": 2, b"abc": 3})


def test_vocabulary_and_special_tokens_match_harmony(hf_folder, hf_tok, ref):
    assert len(hf_tok) == tk.VOCAB_SIZE
    names = {
        tk.STARTOFTEXT_ID: "<|startoftext|>",
        tk.ENDOFTEXT_ID: "<|endoftext|>",
        tk.RETURN_ID: "<|return|>",
        tk.CONSTRAIN_ID: "<|constrain|>",
        tk.CHANNEL_ID: "<|channel|>",
        tk.START_ID: "<|start|>",
        tk.END_ID: "<|end|>",
        tk.MESSAGE_ID: "<|message|>",
        tk.CALL_ID: "<|call|>",
        200000: "<|reserved_200000|>",
        tk.VOCAB_SIZE - 1: "<|reserved_201087|>",
    }
    for i, name in names.items():
        assert hf_tok.convert_ids_to_tokens(i) == name
        assert hf_tok.encode(name, add_special_tokens=False) == [i]
    specials = range(hf_tokenizer.FIRST_SPECIAL_ID, tk.VOCAB_SIZE)
    assert hf_tok.convert_ids_to_tokens(list(specials)) == [ref.decode([i]) for i in specials]
    assert set(hf_tok.all_special_ids) >= {tk.STARTOFTEXT_ID, tk.ENDOFTEXT_ID, tk.RETURN_ID}
    assert (hf_tok.bos_token_id, hf_tok.eos_token_id, hf_tok.pad_token_id) == (
        tk.STARTOFTEXT_ID,
        tk.RETURN_ID,
        tk.PAD_ID,
    )
    # One past the embedding: harmony names it, the exported tokenizer must not produce it.
    assert len(hf_tok.encode("<|reserved_201088|>", add_special_tokens=False)) > 1
    config = json.loads((hf_folder / "tokenizer_config.json").read_text())
    assert config["model_max_length"] == hf_tok.model_max_length == 131072


def stdlib_sample(n_files=300, max_chars=8000):
    """Python source from the standard library: every k-th file, cut to max_chars."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    step = max(1, len(files) // n_files)
    texts = [p.read_text(encoding="utf-8", errors="replace")[:max_chars] for p in files[::step]]
    assert len(texts) >= 100
    return texts


def test_ids_equal_harmony_on_stdlib_source(hf_tok, ref):
    texts = stdlib_sample()
    got = hf_ids(hf_tok, texts)
    for text, ids in zip(texts, got):
        assert ids == ref.encode(text)
        assert hf_tok.decode(ids) == text
    # What servers call: the defaults add no BOS/EOS (harmony adds none either).
    assert hf_tok(texts[:20])["input_ids"] == got[:20]


HARD_TEXTS = [
    "Hello, world! It's a test; we'll see. I'M LOUD AND WE'VE SHOUTED, DON'T WE'D",
    "   leading spaces, trailing   \n\n\n\t\t  \r\n  mixed\u00a0nbsp\u3000ideographic  ",
    "12345678901234567890 3.14159 -42 1e-10 0x1F 1,000,000 ½ ٣٤٥ Ⅻ",
    "日本語のテキストと中文字符，한국어 문장도 섞여 있습니다。",
    "Emoji: 😀👍🏽👨\u200d👩\u200d👧 🇫🇷 ❤️ — and combining: e\u0301 n\u0303 \u0301alone",
    "Привет, мир! Ελληνικά. مرحبا بالعالم. שלום עולם. हिन्दी पाठ. ภาษาไทย",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n\n\n\nclass A_B(C):\n\tpass\n",
    "<|start|>user<|message|>not a control token<|end|> <|reserved_200100|>",
    "camelCaseWords HTTPServer __init__ snake_case_name kebab-case-name ALLCAPS",
    "\x00\x07\x1b[31mcontrol chars\x7f \ufeffBOM \U0010ffff last plane",
    "",
    " ",
    "\n",
]


@pytest.mark.parametrize("text", HARD_TEXTS)
def test_ids_equal_harmony_on_hard_text(hf_tok, ref, text):
    (ids,) = hf_ids(hf_tok, [text])
    assert ids == ref.encode(text)
    assert hf_tok.decode(ids) == text


def test_ids_equal_harmony_on_random_mixtures(hf_tok, ref):
    pieces = [" ", "  ", "\t", "\n", "\r\n", "\u00a0", "'s", "'LL", "'Ve", "don't", "a", "Z"]
    pieces += ["é", "ß", "ǅ", "ʰ", "中", "日本語", "한국어", "Привет", "e\u0301", "😀", "👍🏽"]
    pieces += ["1", "123", "1234", "٣", "-", "//", "...", "!?", "{", "}", "<|", "|>", "_"]
    rng = random.Random(0)
    texts = ["".join(rng.choices(pieces, k=rng.randint(1, 40))) for _ in range(3000)]
    assert hf_ids(hf_tok, texts) == [ref.encode(t) for t in texts]


def test_decode_of_control_tokens_matches_harmony(hf_tok, ref):
    ids = ref.render_chat([{"role": "user", "content": "Hi 😀"}]) + [tk.RETURN_ID]
    assert hf_tok.decode(ids) == ref.decode(ids)
    assert hf_tok.encode(ref.decode(ids), add_special_tokens=False) == ids


# ----------------------------------------------------------------------------------------
# Chat template: the same ids as Tokenizer.render_chat
# ----------------------------------------------------------------------------------------
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City and country, e.g. Paris, FR"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
            },
            "required": ["city"],
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "now", "description": "Time.\nIn UTC.\n"}}
TOOLS = [WEATHER, CLOCK]

CALL = {
    "role": "assistant",
    "channel": "commentary",
    "recipient": "functions.get_weather",
    "content_type": "<|constrain|>json",
    "content": '{"city": "Paris, FR"}',
}
RESULT = {"role": "tool", "name": "functions.get_weather", "content": '{"temp_c": 21}'}
U1, U2 = {"role": "user", "content": "Weather in Paris?"}, {"role": "user", "content": "Thanks"}
THINK = {"role": "assistant", "channel": "analysis", "content": "Need the weather tool."}
FINAL = {"role": "assistant", "channel": "final", "content": "It is 21 °C."}

CONVERSATIONS = {
    "user": [U1],
    "system_user": [{"role": "system", "content": "You are a terse bot."}, U1],
    "developer_user": [{"role": "developer", "content": "Answer in French."}, U1],
    "system_developer_named_user": [
        {"role": "system", "content": "You are a bot."},
        {"role": "developer", "content": "Line one.\n\nLine two."},
        {"role": "user", "content": "Hi", "name": "alice"},
    ],
    "finished_turns_drop_analysis": [U1, THINK, FINAL, U2, THINK, {**FINAL, "content": "Bye"}, U2],
    "tool_turn_in_progress_keeps_analysis": [U1, THINK, CALL, RESULT],
    "tool_turn_finished": [U1, THINK, CALL, RESULT, THINK, FINAL, U2],
    "preamble_then_call": [
        U1,
        {"role": "assistant", "channel": "commentary", "content": "Checking the weather."},
        CALL,
        RESULT,
    ],
    "analysis_last": [U1, THINK],
    "empty_final_and_default_channel": [
        U1,
        {"role": "assistant", "content": ""},
        U2,
        {"role": "assistant", "content": "ok"},
        U2,
    ],
    "two_developer_messages": [
        {"role": "developer", "content": "First."},
        U1,
        {"role": "developer", "content": "Second."},
        U2,
    ],
    "plain_json_content_type_and_explicit_tool_header": [
        U1,
        {**CALL, "content_type": "json"},
        {**RESULT, "recipient": "assistant", "channel": "commentary"},
    ],
    "whitespace_and_unicode_content": [
        {"role": "user", "content": "  spaced\n\n\nlines\t\t  "},
        {"role": "assistant", "content": "日本語 😀\n"},
        {"role": "user", "content": "\n"},
    ],
}


def assert_template_renders(hf_tok, ref, template_messages, messages, effort, tools):
    """apply_chat_template(template_messages) == Tokenizer.render_chat(messages)."""
    want = ref.render_chat(messages, reasoning_effort=effort, tools=tools)
    got = hf_tok.apply_chat_template(
        template_messages,
        tools=tools,
        tokenize=True,
        add_generation_prompt=True,
        reasoning_effort=effort,
    )["input_ids"]
    assert got == want, f"\n{hf_tok.decode(got)!r}\n{ref.decode(want)!r}"


@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no_tools", "tools"])
@pytest.mark.parametrize("effort", ["low", "medium", "high"])
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_chat_template_renders_harmony_ids(hf_tok, ref, name, effort, tools):
    messages = CONVERSATIONS[name]
    assert_template_renders(hf_tok, ref, messages, messages, effort, tools)


def test_chat_template_without_generation_prompt_and_default_effort(hf_tok, ref):
    messages = CONVERSATIONS["tool_turn_finished"]
    got = hf_tok.apply_chat_template(messages, tokenize=True)["input_ids"]
    assert got + [tk.START_ID, *ref.encode("assistant")] == ref.render_chat(messages)


def openai_call(call_id, name, arguments):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


# OpenAI-style messages (reasoning_content, tool_calls, tool_call_id, content parts) and the
# project's messages that mean the same conversation.
OPENAI_EQUIVALENTS = {
    "reasoning_of_finished_turn_dropped": (
        [U1, {"role": "assistant", "reasoning_content": "hmm", "content": "It is 21 °C."}, U2],
        [U1, {"role": "assistant", "content": "It is 21 °C."}, U2],
    ),
    "thinking_kept_while_calling_tools": (
        [
            U1,
            {
                "role": "assistant",
                "thinking": "Need the weather tool.",
                "content": None,
                "tool_calls": [openai_call("c1", "get_weather", {"city": "Paris, FR"})],
            },
            {"role": "tool", "tool_call_id": "c1", "content": '{"temp_c": 21}'},
        ],
        [U1, THINK, CALL, RESULT],
    ),
    "reasoning_dropped_after_final": (
        [
            U1,
            {
                "role": "assistant",
                "reasoning_content": "Need the weather tool.",
                "tool_calls": [openai_call("c1", "get_weather", '{"city": "Paris, FR"}')],
            },
            {"role": "tool", "tool_call_id": "c1", "content": '{"temp_c": 21}'},
            {"role": "assistant", "reasoning_content": "Answer now.", "content": "It is 21 °C."},
            U2,
        ],
        [U1, CALL, RESULT, FINAL, U2],
    ),
    "parallel_calls_matched_by_id_and_preamble": (
        [
            U1,
            {
                "role": "assistant",
                "content": "Let me check.",
                "tool_calls": [
                    openai_call("a", "get_weather", {"city": "Paris, FR"}),
                    openai_call("b", "now", {}),
                ],
            },
            {"role": "tool", "tool_call_id": "b", "content": "12:00"},
            {"role": "tool", "name": "get_weather", "content": '{"temp_c": 21}'},
        ],
        [
            U1,
            {"role": "assistant", "channel": "commentary", "content": "Let me check."},
            CALL,
            {**CALL, "recipient": "functions.now", "content": "{}"},
            {"role": "tool", "name": "functions.now", "content": "12:00"},
            RESULT,
        ],
    ),
    "content_parts": (
        [
            {"role": "system", "content": [{"type": "text", "text": "You are "}, "a bot."]},
            {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
        ],
        [{"role": "system", "content": "You are a bot."}, U1],
    ),
}


@pytest.mark.parametrize("name", sorted(OPENAI_EQUIVALENTS))
def test_chat_template_reads_openai_messages(hf_tok, ref, name):
    openai_messages, ours = OPENAI_EQUIVALENTS[name]
    assert_template_renders(hf_tok, ref, openai_messages, ours, "high", TOOLS)


# Parameter schemas: harmony turns each into a TypeScript-like type; the template must too.
SCHEMAS = {
    "empty": {},
    "no_properties": {"type": "object"},
    "scalars_defaults_required": {
        "type": "object",
        "properties": {
            "s": {"type": "string", "description": "a string", "default": "x y"},
            "n": {"type": "number", "default": 0.5},
            "i": {"type": "integer", "default": 3},
            "b": {"type": "boolean", "default": False},
            "l": {"type": "array", "items": {"type": "string"}, "default": ["a", "b"]},
            "d": {"type": "object", "default": {"k": 1, "m": [True, None]}},
            "e": {"type": "string", "enum": ["a", "b", 3], "default": "a"},
            "any_array": {"type": "array"},
            "untyped": {"description": "no type"},
            "unknown_type": {"type": "null"},
            "not_a_schema": True,
        },
        "required": ["s", "i", "missing"],
    },
    "nested_objects_and_arrays": {
        "type": "object",
        "description": "params object",
        "properties": {
            "where": {
                "type": "object",
                "description": "a place",
                "properties": {
                    "lat": {"type": "number"},
                    "tags": {"type": "array", "items": {"type": "object", "properties": {}}},
                },
                "required": ["lat"],
            },
            "matrix": {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}},
        },
    },
    "type_lists_and_nullable": {
        "type": "object",
        "properties": {
            "a": {"type": ["string", "null"]},
            "b": {"type": ["integer", "number"], "nullable": True},
            "c": {"type": "string", "nullable": True, "default": "z"},
            "d": {"type": "string", "nullable": False},
            "e": {"type": [7, "boolean"]},
        },
    },
    "titles_and_examples": {
        "type": "object",
        "properties": {
            "q": {"type": "string", "title": "Query", "examples": ["cats", 4, "dogs"]},
            "r": {"type": "string", "examples": []},
        },
    },
    "property_one_of": {
        "type": "object",
        "properties": {
            "same_desc": {
                "description": "x or y",
                "oneOf": [{"type": "string", "description": "x or y"}, {"type": "number"}],
            },
            "own_desc": {
                "description": "either",
                "default": 20,
                "oneOf": [
                    {"type": "string", "description": "text", "default": "t"},
                    {"type": "number", "description": "either", "nullable": True},
                    {"type": "string", "enum": ["p", "q"], "default": "p"},
                ],
            },
            "string_default": {"default": "dflt", "oneOf": [{"type": "boolean"}]},
        },
        "required": ["own_desc"],
    },
    "top_level_one_of": {
        "oneOf": [
            {"type": "object", "properties": {"a": {"type": "string"}}, "description": "first"},
            {"type": "string", "enum": ["x"], "default": "x", "nullable": True},
            {"type": "number", "default": 1.5},
        ]
    },
    "null_values": {  # harmony sees JSON null: "default: null", "any[]", oneOf hides notes
        "type": "object",
        "properties": {
            "s": {"type": "string", "description": None, "default": None},
            "a": {"type": "array", "items": None},
            "o": {"type": "string", "oneOf": None, "description": "hidden", "default": "hidden"},
            "p": {"oneOf": [{"type": "string", "default": None}, {"type": "number"}]},
        },
    },
    "unicode_text": {
        "type": "object",
        "properties": {"städte": {"type": "string", "description": "Städte 😀, 東京"}},
    },
}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_chat_template_renders_tool_schemas_as_harmony(hf_tok, ref, name):
    tools = [
        {"name": "f", "description": "Line 1\r\nLine 2\n\n", "parameters": SCHEMAS[name]},
        CLOCK,
        {"type": "function", "function": {"name": "ping"}},  # no description, no parameters
    ]
    assert_template_renders(hf_tok, ref, [U1], [U1], "medium", tools)


def test_chat_template_errors(hf_tok, ref):
    with pytest.raises(Exception, match="reasoning_effort must be"):
        hf_tok.apply_chat_template([U1], reasoning_effort="max")
    with pytest.raises(ValueError, match="reasoning_effort='max'"):
        ref.render_chat([U1], reasoning_effort="max")
    late_system = [U1, {"role": "system", "content": "x"}]
    with pytest.raises(Exception, match="system message must come first"):
        hf_tok.apply_chat_template(late_system)
    with pytest.raises(ValueError, match="system message must come first"):
        ref.render_chat(late_system)
    with pytest.raises(Exception, match="tool message needs a 'name'"):
        hf_tok.apply_chat_template([U1, {"role": "tool", "content": "42"}])


# ----------------------------------------------------------------------------------------
# Exports: save_hf and gpt_oss_train.tools.convert_checkpoint
# ----------------------------------------------------------------------------------------
def _zeros_getter(model):
    shapes = hf.param_shapes(model)
    return lambda path, layers: np.zeros(
        shapes[path] if layers is None else (1, *shapes[path][1:]), np.float32
    )


def test_save_hf_skips_the_tokenizer_for_other_vocabularies_or_when_asked(tmp_path, hf_tiny_config):
    # The written case (vocabulary 201088, the default) is the convert_checkpoint test below.
    small = hf_config.hf_config_to_model_dict(hf_tiny_config().to_dict())
    big = dict(small, vocab_size=tk.VOCAB_SIZE)
    for name, model, kw in [("small", small, {}), ("off", big, {"with_tokenizer": False})]:
        hf.save_hf(tmp_path / name, model, _zeros_getter(model), dtype="float32", **kw)
        assert (tmp_path / name / "config.json").is_file()
        assert not any((tmp_path / name / f).exists() for f in hf_tokenizer.TOKENIZER_FILES)


@pytest.mark.full
def test_converted_checkpoint_serves_with_transformers(tmp_path, ref, hf_tiny_config):
    """A tiny gpt-oss with the real vocabulary: HF -> Orbax -> HF through the tool, then
    loaded as `transformers serve` does (AutoTokenizer + GptOssForCausalLM) and prompted
    through the chat template."""
    import torch

    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(hf_tiny_config(vocab_size=tk.VOCAB_SIZE)).eval()
    hf_in, orbax, hf_out = tmp_path / "hf_in", tmp_path / "orbax", tmp_path / "hf_out"
    model.save_pretrained(hf_in)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    tool = [sys.executable, "-m", "gpt_oss_train.tools.convert_checkpoint"]
    for args in (
        [f"--hf_dir={hf_in}", f"--output_dir={orbax}"],
        [f"--orbax_dir={orbax}", f"--hf_out={hf_out}", "--dtype=float32"],
    ):
        r = subprocess.run(tool + args, capture_output=True, text=True, env=env, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
    assert "with tokenizer" in r.stdout

    config = json.loads((hf_out / "tokenizer_config.json").read_text())
    assert config["model_max_length"] == model.config.max_position_embeddings
    tok = transformers.AutoTokenizer.from_pretrained(hf_out)
    served = transformers.GptOssForCausalLM.from_pretrained(hf_out).eval()
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    inputs = tok.apply_chat_template(
        messages, tools=TOOLS, add_generation_prompt=True, return_tensors="pt"
    )
    assert inputs["input_ids"][0].tolist() == ref.render_chat(messages, tools=TOOLS)
    with torch.no_grad():
        assert torch.equal(served(**inputs).logits, model(**inputs).logits)  # float32 export
        out = served.generate(**inputs, max_new_tokens=4, do_sample=False)
    prompt_len = inputs["input_ids"].shape[1]
    assert out[0, :prompt_len].tolist() == inputs["input_ids"][0].tolist()
    assert 0 < out.shape[1] - prompt_len <= 4
    assert tok.decode(out[0]).startswith(ref.decode(inputs["input_ids"][0].tolist()))
