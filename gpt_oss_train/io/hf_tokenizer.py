"""The o200k_harmony tokenizer as Hugging Face files, so other servers load our exports.

`save_tokenizer(folder)` writes `tokenizer.json` and `tokenizer_config.json` (with a Jinja
chat template) that `transformers.AutoTokenizer` loads offline. The ids are openai-harmony's:

  * tokenizer.json is built here from the o200k_base ranks that ship in the bpe-openai wheel
    (`tokenizer.ensure_vocab`), never downloaded: a byte-level BPE whose vocabulary is the
    ranks (bytes spelled with GPT-2's byte-to-unicode map), whose merges are recovered from
    the ranks, and whose pre-tokenizer is o200k's regex; the specials 199998..201087 carry
    harmony's names and ids.
  * the chat template (harmony_chat_template.jinja) renders the text whose tokens equal
    `Tokenizer.render_chat` for the same messages, tools and reasoning effort.

Building takes 5-10 s on a 2-core CPU (the 200k merges are recovered in Python); exports
take longer anyway, so it is built each time rather than cached.
"""

from __future__ import annotations

import base64
import json
import os
import pathlib
from collections.abc import Mapping

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from gpt_oss_train.io import tokenizer as harmony_tokenizer

# o200k's pre-tokenizer (tiktoken's and harmony's pattern for o200k_base / o200k_harmony):
# letters with an optional leading symbol and English contractions, 1-3 digit numbers,
# punctuation runs, newlines, and whitespace that leaves one space to the next word.
O200K_PATTERN = "|".join(
    [
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)
FIRST_SPECIAL_ID = harmony_tokenizer.STARTOFTEXT_ID  # ranks below it are o200k_base's BPE
VOCAB_SIZE = harmony_tokenizer.VOCAB_SIZE  # ids 0 .. VOCAB_SIZE - 1, as the model's embedding
TEMPLATE_FILE = pathlib.Path(__file__).with_name("harmony_chat_template.jinja")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte, the alphabet of byte-level BPE vocabularies.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes (controls, space, DEL,
    NBSP, soft hyphen) take the code points from 256 up, in byte order.
    """
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    others = [b for b in range(256) if b not in table]
    table.update({b: chr(256 + n) for n, b in enumerate(others)})
    return table


def read_ranks(path: str | os.PathLike[str]) -> dict[bytes, int]:
    """A .tiktoken file's ranks: one "base64(token bytes) rank" line per token."""
    ranks = {}
    with open(path, "rb") as f:
        for line in f:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _split_by_lower_ranks(token: bytes, rank: int, ranks: Mapping[bytes, int]) -> list[bytes]:
    """tiktoken's merge loop on `token`'s bytes, using only tokens ranked below `rank`.

    For a token BPE learnt, this stops at the two parts whose merge created it.
    """
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best_rank, best_i = rank, -1
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1], rank)
            if r < best_rank:  # strict: the leftmost pair wins a tie, as in tiktoken
                best_rank, best_i = r, i
        if best_i < 0:
            break
        parts[best_i : best_i + 2] = [parts[best_i] + parts[best_i + 1]]
    return parts


def recover_merges(ranks: Mapping[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merge list, in rank order, that rebuilds every multi-byte token from its bytes.

    tiktoken merges the adjacent pair whose concatenation has the lowest rank; a merge list
    ordered by the rank of the merged token makes Hugging Face's BPE take the same steps.
    """
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) < 2:
            continue
        parts = _split_by_lower_ranks(token, rank, ranks)
        if len(parts) != 2:
            raise ValueError(f"token {token!r} (rank {rank}) is not a merge of two lower ranks")
        merges.append((parts[0], parts[1]))
    return merges


def harmony_special_tokens() -> list[str]:
    """Names of ids FIRST_SPECIAL_ID .. VOCAB_SIZE - 1, read from harmony's encoding.

    Harmony also names <|reserved_201088|>, one past the model's last embedding row; it is
    left out so the tokenizer never produces an id the model does not have.
    """
    enc = harmony_tokenizer.get_encoding()
    by_id = {}
    for name in enc.special_tokens_set:
        (i,) = enc.encode(name, allowed_special="all")
        by_id[i] = name
    ids = range(FIRST_SPECIAL_ID, VOCAB_SIZE)
    missing = [i for i in ids if i not in by_id]
    if missing:
        raise RuntimeError(f"openai-harmony has no special token for ids {missing[:5]}")
    return [by_id[i] for i in ids]


def build_tokenizer():
    """A `tokenizers.Tokenizer` with the ids of harmony's o200k_harmony, built offline."""
    ranks = read_ranks(harmony_tokenizer.ensure_vocab() / harmony_tokenizer.VOCAB_FILE)
    if sorted(ranks.values()) != list(range(FIRST_SPECIAL_ID)):
        raise RuntimeError(f"o200k_base ranks are not 0..{FIRST_SPECIAL_ID - 1}")
    table = byte_to_unicode()

    def spell(b: bytes) -> str:
        return "".join(table[x] for x in b)

    bpe = models.BPE(
        vocab={spell(t): r for t, r in ranks.items()},
        merges=[(spell(a), spell(b)) for a, b in recover_merges(ranks)],
        # tiktoken takes a pre-token that is itself in the vocabulary whole, merges or not.
        ignore_merges=True,
    )
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(O200K_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    # Added in id order, so each takes the next id: FIRST_SPECIAL_ID, FIRST_SPECIAL_ID + 1, ...
    tok.add_special_tokens(
        [AddedToken(name, special=True, normalized=False) for name in harmony_special_tokens()]
    )
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"built {tok.get_vocab_size()} tokens, expected {VOCAB_SIZE}")
    return tok


def chat_template() -> str:
    """The Harmony chat template (Jinja) that tokenizer_config.json carries."""
    return TEMPLATE_FILE.read_text(encoding="utf-8")


def tokenizer_config(model_max_length: int | None = None) -> dict:
    """tokenizer_config.json: the tokenizer class, named special tokens and chat template."""
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|startoftext|>",
        # The end of an assistant turn; generation_config.json also stops on <|call|>.
        "eos_token": "<|return|>",
        "pad_token": "<|endoftext|>",
        # Decoding must give back the text exactly, e.g. keep the space in "a ." .
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        "chat_template": chat_template(),
    }
    if model_max_length is not None:
        config["model_max_length"] = int(model_max_length)
    return config


def save_tokenizer(folder: str | os.PathLike[str], model_max_length: int | None = None) -> None:
    """Write the o200k_harmony tokenizer files (TOKENIZER_FILES) into an existing folder."""
    folder = pathlib.Path(folder)
    build_tokenizer().save(str(folder / "tokenizer.json"))
    with open(folder / "tokenizer_config.json", "w", encoding="utf-8") as f:
        json.dump(tokenizer_config(model_max_length), f, indent=2, ensure_ascii=False)
