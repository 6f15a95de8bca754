"""Where documents come from: a data spec -> a random-access source of raw documents.

`make_source(spec, split=...)` accepts:
  stdlib                      this machine's Python standard library, a .py file a document
                              (split "train", or "eval": every 50th file, held out of train)
  tfds:NAME[:SPLIT[:FEATURE]] a TFDS dataset already prepared on disk, read through
                              `tfds.data_source` (no TensorFlow, never downloads); FEATURE
                              defaults to "text", SPLIT to `split` ("eval": validation/test)
  PATH, DIR or GLOB           .txt/.md/.py/... files (a file is a document), .jsonl (lines
                              of {"text": ...} or Harmony chats {"messages": [...]}),
                              .parquet (a "text" column), .array_record (pre-tokenized; a
                              directory written by tools/pretokenize.py). A path is read
                              whole whatever `split` says: give eval its own path.
  chat:PATH                   JSONL whose every line must be a {"messages": [...]} chat
  pairs:PATH                  preference pairs for DPO, TRL's conversational format: JSONL
                              lines of {"prompt": [...], "chosen": [...], "rejected": [...]}
                              (message lists; chosen and rejected hold assistant messages)

A source is what grain's MapDataset reads (`__len__`, `__getitem__`), plus `name`,
`has_chat`, `has_pairs` and `has_content()`. A raw document is a str (plain text), a `Chat`
or a `PreferencePair` (checked when the source is built, so a bad line stops the run
before training starts), or an
int32 array of ids ([n], or [2, n] with the loss mask as the second row). Bytes that are
not valid UTF-8 never stop a read: they become U+FFFD, are warned about once per file and
counted (`replaced_bytes`). Every mistake in a spec or a file is a `DataError`.
"""

from __future__ import annotations

import bisect
import codecs
import glob as globlib
import json
import os
import pathlib
import re
import sysconfig
import threading
from typing import Any, NamedTuple

import grain
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from absl import logging

from gpt_oss_train.errors import UserError, json_error
from gpt_oss_train.io import storage

TEXT_SUFFIXES = frozenset(
    ".txt .text .md .markdown .rst .tex .py .pyi .c .h .cc .cpp .hpp .java .js .ts .go "
    ".rs .rb .sh .html .css .toml .yaml .yml .cfg .ini .csv".split()
)
STDLIB_EVAL_EVERY = 50  # every 50th stdlib file (sorted by path) is the eval split
META_FILE = "pretokenized.json"  # written last by tools/pretokenize.py: its presence = complete
META_FORMAT = "gpt_oss_train/pretokenized-v1"
TOKENIZER_NAME = "o200k_harmony"


class DataError(UserError):
    """A problem with the user's data or data spec, found before training starts."""


# --------------------------------------------------------------------------------------
# Text decoding that never fails: bad UTF-8 bytes become U+FFFD and are counted.
# --------------------------------------------------------------------------------------
_decode_state = threading.local()  # the codec error handler is global; the count is per thread
_warned: set[str] = set()  # files already warned about in this process


def _replace_and_count(err: UnicodeDecodeError) -> tuple[str, int]:
    _decode_state.replaced += err.end - err.start
    return "\ufffd", err.end


codecs.register_error("gpt_oss_train.replace_and_count", _replace_and_count)


def decode_utf8(data: bytes) -> tuple[str, int]:
    """(text, number of bytes that were not valid UTF-8 and became U+FFFD)."""
    _decode_state.replaced = 0
    return data.decode("utf-8", errors="gpt_oss_train.replace_and_count"), _decode_state.replaced


class Replacements:
    """Replaced-byte counts per file, kept by the source that read them (this process):
    every source has one as `replacements` (post_training/prompts.py's too). `note` records
    a file's count and warns once per file and process."""

    def __init__(self):
        self.per_file: dict[str, int] = {}

    def note(self, name: str, count: int):
        if count:
            self.per_file[name] = count
            if name not in _warned:  # once per file and process, not once per epoch
                _warned.add(name)
                logging.warning(
                    "%s: %d bytes are not valid UTF-8 and were replaced by U+FFFD", name, count
                )


# --------------------------------------------------------------------------------------
# Sources: random access (__len__, __getitem__) to raw documents, as grain wants them.
# A raw document is a str (plain text), a Chat, or an int32 array of ids ([n], or [2, n]
# with the loss mask as the second row).
# --------------------------------------------------------------------------------------
class Chat(NamedTuple):
    messages: list
    where: str  # "file:line", for error messages


class PreferencePair(NamedTuple):
    prompt: list  # the conversation so far
    chosen: list  # the preferred assistant messages that follow it
    rejected: list  # the other ones
    where: str  # "file:line", for error messages


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def check_chat(messages: Any, where: str, field: str = "messages", trains: bool = True) -> None:
    """The structural checks a chat must pass before training starts (rendering is later):
    a non-empty list of messages with a known role and string content, else a DataError
    naming `where` and `field`. `trains`: it must hold an assistant message to train on
    (a GRPO prompt, post_training/prompts.py, is checked with trains=False)."""
    if not isinstance(messages, list) or not messages:
        raise DataError(
            f'{where}: "{field}" must be a non-empty list of '
            '{"role": ..., "content": ...} objects'
        )
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise DataError(f"{where}: message {i} is a {type(m).__name__}, not an object")
        if m.get("role") not in CHAT_ROLES:
            raise DataError(
                f"{where}: message {i} has unknown role {m.get('role')!r}; "
                f"use one of {list(CHAT_ROLES)}"
            )
        if not isinstance(m.get("content"), str):
            raise DataError(f'{where}: message {i} ({m["role"]}) needs a string "content"')
    if trains and not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: the chat has no assistant message, so nothing to train on")


def _check_pair(obj: dict, where: str) -> None:
    """A preference pair: a prompt, then two alternative assistant replies."""
    missing = [k for k in ("prompt", "chosen", "rejected") if k not in obj]
    if missing:
        raise DataError(
            f'{where}: a preference pair needs "prompt", "chosen" and "rejected" message '
            f"lists; missing {missing}"
        )
    check_chat(obj["prompt"], where, "prompt", trains=False)
    for field in ("chosen", "rejected"):
        check_chat(obj[field], where, field)
        roles = {m["role"] for m in obj[field]}
        if roles != {"assistant"}:
            raise DataError(
                f'{where}: "{field}" must hold the assistant\'s reply only, got roles '
                f"{sorted(roles)}"
            )


class TextFiles:
    """One document per file."""

    def __init__(self, paths: list[str], name: str):
        self.paths, self.name, self.has_chat = list(paths), name, False
        self.replacements = Replacements()

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i: int) -> str:
        with open(self.paths[i], "rb") as f:
            text, bad = decode_utf8(f.read())
        self.replacements.note(self.paths[i], bad)
        return text

    def has_content(self) -> bool:
        return any(os.path.getsize(p) for p in self.paths)


def scan_jsonl(paths: list[str], replacements: Replacements):
    """Yields (file index, byte offset, line number, object, "path:line") for each non-blank
    line of JSONL files: decoded (invalid UTF-8 replaced, counted in `replacements`) and
    parsed; a line that is not JSON is a DataError naming it."""
    for f_i, path in enumerate(paths):
        offset, bad = 0, 0
        with open(path, "rb") as f:
            for line_no, raw in enumerate(f, 1):
                start, offset = offset, offset + len(raw)
                text, n_bad = decode_utf8(raw)
                bad += n_bad
                if not text.strip():
                    continue  # blank lines (e.g. a trailing newline) are allowed
                where = f"{path}:{line_no}"
                try:
                    obj = json.loads(text)
                except json.JSONDecodeError as e:
                    raise DataError(f"{where}: {json_error(e)}") from None
                yield f_i, start, line_no, obj, where
        replacements.note(path, bad)


def read_jsonl_line(path: str, offset: int):
    """The object on the line at `offset` of a file scan_jsonl checked."""
    with open(path, "rb") as f:
        f.seek(offset)
        return json.loads(decode_utf8(f.readline())[0])


class JsonlFiles:
    """Lines of {"text": str} or {"messages": [...]}, or with `pairs_only` preference pairs
    ({"prompt", "chosen", "rejected"}). Every line is parsed and checked once here, so a bad
    line stops the run before training starts; then only byte offsets are kept and a line
    is re-read when asked for."""

    def __init__(
        self, paths: list[str], name: str, *, chat_only: bool = False, pairs_only: bool = False
    ):
        self.paths, self.name = list(paths), name
        self.replacements = Replacements()
        file_idx, offsets, lines = [], [], []
        self.has_chat, self.has_pairs, self._pairs_only = False, pairs_only, pairs_only
        self._nonempty = 0
        for f_i, start, line_no, obj, where in scan_jsonl(self.paths, self.replacements):
            self._nonempty += self._check(obj, where, chat_only)
            file_idx.append(f_i)
            offsets.append(start)
            lines.append(line_no)
        self._file = np.asarray(file_idx, np.int32)
        self._offset = np.asarray(offsets, np.int64)
        self._line = np.asarray(lines, np.int64)

    def _check(self, obj: Any, where: str, chat_only: bool) -> bool:
        """Validates one line; returns whether it holds a non-empty document."""
        if self._pairs_only:
            if not isinstance(obj, dict):
                raise DataError(
                    f"{where}: expected a preference pair object, got {type(obj).__name__}"
                )
            _check_pair(obj, where)
            return True
        if not isinstance(obj, dict) or (
            "messages" not in obj and ("text" not in obj or chat_only)
        ):
            want = '{"messages": [...]}' if chat_only else '{"text": ...} or {"messages": [...]}'
            got = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
            raise DataError(f"{where}: expected an object like {want}, got {got}")
        if "messages" in obj:
            check_chat(obj["messages"], where)
            self.has_chat = True
            return True
        if not isinstance(obj["text"], str):
            raise DataError(f'{where}: "text" must be a string, got {type(obj["text"]).__name__}')
        return bool(obj["text"])

    def __len__(self):
        return len(self._offset)

    def __getitem__(self, i: int) -> str | Chat | PreferencePair:
        path = self.paths[self._file[i]]
        obj = read_jsonl_line(path, int(self._offset[i]))
        if self._pairs_only:
            where = f"{path}:{self._line[i]}"
            return PreferencePair(obj["prompt"], obj["chosen"], obj["rejected"], where)
        if "messages" in obj:
            return Chat(obj["messages"], f"{path}:{self._line[i]}")
        return obj["text"]

    def has_content(self) -> bool:
        return self._nonempty > 0


class ParquetFiles:
    """The "text" column of Parquet files, held in memory as one Arrow array."""

    def __init__(self, paths: list[str], name: str, column: str = "text"):
        self.paths, self.name, self.has_chat = list(paths), name, False
        self.replacements = Replacements()
        chunks = []
        for path in self.paths:
            try:
                schema = pq.read_schema(path)
            except (OSError, pa.ArrowException) as e:
                raise DataError(f"{path}: not a readable Parquet file ({e})") from None
            if column not in schema.names:
                raise DataError(f"{path}: no {column!r} column; its columns are {schema.names}")
            col = pq.read_table(path, columns=[column]).column(column)
            if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)):
                raise DataError(f"{path}: column {column!r} has type {col.type}, not string")
            # large_string: one array may hold more than 2 GiB of text.
            chunks += col.cast(pa.large_string()).chunks
        self._texts = pa.concat_arrays(chunks) if chunks else pa.array([], pa.large_string())
        self._nonempty = int(
            pc.sum(pc.greater(pc.utf8_length(self._texts.fill_null("")), 0)).as_py() or 0
        )

    def __len__(self):
        return len(self._texts)

    def __getitem__(self, i: int) -> str:
        return self._texts[i].as_py() or ""

    def has_content(self) -> bool:
        return self._nonempty > 0


class TokenRecords:
    """Pre-tokenized documents in ArrayRecord files: each record is the int32 bytes of the
    ids, followed by as many int32 loss-mask values when `has_mask`."""

    def __init__(self, paths: list[str], name: str, *, has_mask: bool = False):
        self.paths, self.name, self.has_mask, self.has_chat = list(paths), name, has_mask, has_mask
        self.replacements = Replacements()
        self._records = grain.sources.ArrayRecordDataSource(self.paths)

    def __len__(self):
        return len(self._records)

    def __getitem__(self, i: int) -> np.ndarray:
        ids = np.frombuffer(self._records[i], dtype="<i4").astype(np.int32)
        return ids.reshape(2, -1) if self.has_mask else ids

    def has_content(self) -> bool:
        return len(self) > 0


class TfdsSource:
    """A text feature of a TFDS split, through tfds.data_source (ArrayRecord, no TensorFlow)."""

    def __init__(self, name: str, split: str | None, feature: str, default_split: str):
        # lazy: start-up (~0.1 s, for tfds: specs alone), and tfds defines an absl flag
        # (--tfds_debug_list_dir) that every command's --help would otherwise list
        import tensorflow_datasets as tfds

        # Read here, not at tfds import, so a TFDS_DATA_DIR set after import still counts.
        data_dir = os.environ.get("TFDS_DATA_DIR") or os.path.expanduser("~/tensorflow_datasets")
        self.name, self.has_chat, self.feature = f"tfds:{name}", False, feature
        self.replacements = Replacements()
        hint = (
            f"prepare it once on a machine with internet: `tfds build {name} "
            f"--file_format=array_record --data_dir=DIR`, then copy DIR here and set "
            f"TFDS_DATA_DIR=DIR (now {data_dir})"
        )
        try:
            builder = tfds.builder(name, data_dir=data_dir)
        except Exception as e:  # DatasetNotFoundError lists every registered name: keep line 1
            first_line = (str(e).splitlines() or [type(e).__name__])[0]
            raise DataError(
                f"tfds:{name}: {first_line} Either the name is wrong or "
                f"its builder needs TensorFlow; {hint}"
            ) from None
        # Checked here because tfds.data_source on an unprepared dataset fails with an
        # unrelated message; with download=False below it never fetches anything.
        if not builder.is_prepared():
            raise DataError(f"tfds:{name} is not prepared in {builder.data_dir}; {hint}")
        splits = list(builder.info.splits)
        if split is None:
            split = default_split
            if split == "eval":
                split = next((s for s in ("validation", "test") if s in splits), "validation")
        if split.split("[")[0] not in splits:
            raise DataError(f"tfds:{name} has no split {split!r}; it has {splits}")
        features = list(builder.info.features.keys())
        if feature not in features:
            raise DataError(
                f"tfds:{name} has no feature {feature!r}; its features are {features}. "
                f"Name one: tfds:{name}:{split}:FEATURE"
            )
        try:
            self._ds = tfds.data_source(name, split=split, data_dir=data_dir, download=False)
        except NotImplementedError as e:  # prepared as TFRecord: no random access without TF
            raise DataError(
                f"tfds:{name}: {str(e).splitlines()[0]}; rebuild it with "
                "`tfds build --file_format=array_record`"
            ) from None

    def __len__(self):
        return len(self._ds)

    def __getitem__(self, i: int) -> str:
        value = self._ds[i][self.feature]
        if isinstance(value, bytes):
            value, bad = decode_utf8(value)
            self.replacements.note(f"{self.name}[{i}]", bad)
        return str(value)

    def has_content(self) -> bool:
        return len(self) > 0


class Concat:
    """Several sources one after another (a directory holding different file types)."""

    def __init__(self, parts: list, name: str):
        self.parts, self.name = parts, name
        self.has_chat = any(p.has_chat for p in parts)
        self._ends = np.cumsum([len(p) for p in parts]).tolist()

    def __len__(self):
        return self._ends[-1] if self._ends else 0

    def __getitem__(self, i: int):
        k = bisect.bisect_right(self._ends, i)
        return self.parts[k][i - (self._ends[k - 1] if k else 0)]

    def has_content(self) -> bool:
        return any(p.has_content() for p in self.parts)


def replaced_bytes(source) -> dict[str, int]:
    """{file: bytes replaced by U+FFFD} for what this process has read from `source`."""
    if isinstance(source, Concat):
        return {k: v for p in source.parts for k, v in replaced_bytes(p).items()}
    return dict(source.replacements.per_file)


# --------------------------------------------------------------------------------------
# Spec -> source
# --------------------------------------------------------------------------------------
def _stdlib_files() -> list[str]:
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for folder, dirs, names in os.walk(root):
        # Pruned rather than filtered: site-packages can be far bigger than the stdlib.
        dirs[:] = [d for d in dirs if d not in ("site-packages", "dist-packages", "__pycache__")]
        files += [os.path.join(folder, n) for n in names if n.endswith(".py")]
    return sorted(files)


def expand(spec: str) -> tuple[list[str], bool]:
    """Files a path, directory or glob names (sorted; a directory walked, its hidden files
    and folders skipped), and whether it named one file; a DataError when it names none.
    Shared by the data specs here and post_training/prompts.py's chat prompts."""
    path = os.path.expanduser(spec)
    if any(c in spec for c in "*?["):
        matches = sorted(globlib.glob(path, recursive=True))
        if not matches:
            raise DataError(f"{spec}: the pattern matches no files")
    elif os.path.isfile(path):
        return [path], True
    elif os.path.isdir(path):
        matches = [path]
    else:
        raise DataError(f"{spec}: no such file or directory")
    files = []
    for m in matches:
        if os.path.isdir(m):  # walk it, skipping hidden files and folders (.git, ...)
            files += sorted(
                str(p)
                for p in pathlib.Path(m).rglob("*")
                if p.is_file() and not any(part.startswith(".") for part in p.relative_to(m).parts)
            )
        else:
            files.append(m)
    return files, False


def _read_meta(path: str) -> dict:
    try:
        meta = json.loads(storage.read_text(path))
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: unreadable ({e}); pre-tokenize the corpus again") from None
    if meta.get("format") != META_FORMAT or meta.get("dtype") != "int32":
        raise DataError(
            f"{path}: not written by this version of gpt_oss_train.tools.pretokenize "
            f"(format {meta.get('format')!r}, dtype {meta.get('dtype')!r})"
        )
    if meta.get("tokenizer") != TOKENIZER_NAME:
        raise DataError(
            f"{path}: tokenized with {meta.get('tokenizer')!r}, but this model uses "
            f"{TOKENIZER_NAME!r}; pre-tokenize the corpus again"
        )
    return meta


def _pretokenized_dir(directory: str) -> TokenRecords:
    """A folder tools/pretokenize.py wrote, local or gs:// (ArrayRecord reads gs:// itself,
    through google-cloud-cpp)."""
    meta = _read_meta(storage.join(directory, META_FILE))
    files = [storage.join(directory, f) for f in meta["files"]]
    missing = [f for f in files if not storage.exists(f)]
    if missing:
        raise DataError(f"{directory}: {META_FILE} lists files that are missing: {missing[:3]}")
    return TokenRecords(files, directory, has_mask=bool(meta["loss_mask"]))


def _token_files(files: list[str], name: str) -> TokenRecords:
    """Loose .array_record files: a pretokenized.json beside them says whether there is a
    loss mask; without one the records are taken to be bare int32 ids."""
    metas = {os.path.join(os.path.dirname(f), META_FILE) for f in files}
    masks = {bool(_read_meta(m)["loss_mask"]) for m in metas if os.path.isfile(m)}
    if len(masks) > 1:
        raise DataError(f"{name}: the files mix pre-tokenized sets with and without loss masks")
    if not masks:
        logging.warning(
            "%s: no %s beside the .array_record files; reading each record as bare "
            "int32 ids, all trained",
            name,
            META_FILE,
        )
    return TokenRecords(files, name, has_mask=masks.pop() if masks else False)


def _parse_tfds(rest: str) -> tuple[str, str | None, str]:
    """NAME[:VERSION][:SPLIT[:FEATURE]]; a split such as train[:10%] may hold a colon."""
    parts = re.findall(r"[^:\[]+(?:\[[^\]]*\])?", rest)
    if len(parts) > 1 and re.fullmatch(r"\d+(\.\d+)*", parts[1]):
        parts[:2] = [f"{parts[0]}:{parts[1]}"]
    if not parts or len(parts) > 3:
        raise DataError(f"tfds:{rest}: expected tfds:NAME[:SPLIT[:FEATURE]]")
    return (
        parts[0],
        (parts[1] if len(parts) > 1 else None),
        (parts[2] if len(parts) > 2 else "text"),
    )


def make_source(spec: str, *, split: str = "train"):
    """A random-access source of raw documents for `spec` (see the module docstring)."""
    spec = str(spec).strip()
    if not spec:
        raise DataError("the data source is empty; give a path, 'stdlib' or 'tfds:NAME'")
    if spec == "stdlib":
        files = _stdlib_files()
        if split == "train":
            files = [f for i, f in enumerate(files) if i % STDLIB_EVAL_EVERY]
        elif split == "eval":
            files = files[::STDLIB_EVAL_EVERY]
        else:
            raise DataError(f"stdlib: unknown split {split!r}; use 'train' or 'eval'")
        source = TextFiles(files, "stdlib")
    elif spec.startswith("tfds:"):
        name, tfds_split, feature = _parse_tfds(spec[len("tfds:") :])
        source = TfdsSource(name, tfds_split, feature, split)
    elif storage.is_remote(spec.removeprefix("chat:").removeprefix("pairs:")):
        if spec.startswith(("chat:", "pairs:")) or not storage.exists(
            storage.join(spec, META_FILE)
        ):
            raise DataError(
                f"{spec}: from cloud storage only folders written by "
                f"gpt_oss_train.tools.pretokenize (with {META_FILE}) are read; pre-tokenize the "
                "corpus, or copy it to local disk"
            )
        source = _pretokenized_dir(storage.normalize(spec))
    elif spec.startswith(("chat:", "pairs:")):
        kind, path = spec.split(":", 1)
        files, single = expand(path)
        files = files if single else [f for f in files if f.endswith(".jsonl")]
        if not files:
            raise DataError(f"{spec}: no .jsonl files there")
        source = JsonlFiles(files, spec, chat_only=kind == "chat", pairs_only=kind == "pairs")
    elif os.path.isfile(os.path.join(os.path.expanduser(spec), META_FILE)):
        source = _pretokenized_dir(os.path.expanduser(spec))
    else:
        files, single = expand(spec)
        if not files:
            raise DataError(f"{spec}: the corpus is empty (the directory holds no files)")
        if single and spec.endswith(".json"):
            raise DataError(
                f"{spec}: a .json file is not read; write one JSON object per line to a .jsonl file"
            )
        groups: dict[str, list[str]] = {"text": [], "jsonl": [], "parquet": [], "tokens": []}
        skipped = 0
        for f in files:
            suffix = pathlib.Path(f).suffix.lower()
            kind = {".jsonl": "jsonl", ".parquet": "parquet", ".array_record": "tokens"}.get(
                suffix, "text" if suffix in TEXT_SUFFIXES or single else None
            )
            if kind is None:
                skipped += 1
            else:
                groups[kind].append(f)
        if skipped:
            logging.info(
                "%s: skipped %d files whose type is not text, .jsonl, .parquet or .array_record",
                spec,
                skipped,
            )
        makers = {
            "text": TextFiles,
            "jsonl": JsonlFiles,
            "parquet": ParquetFiles,
            "tokens": _token_files,
        }
        parts = [makers[k](fs, spec) for k, fs in groups.items() if fs]
        if not parts:
            raise DataError(
                f"{spec}: found {len(files)} files but none is text, .jsonl, .parquet "
                "or .array_record"
            )
        source = parts[0] if len(parts) == 1 else Concat(parts, spec)
    if len(source) == 0 or not source.has_content():
        raise DataError(f"{spec}: the corpus is empty ({len(source)} documents, none with text)")
    return source
