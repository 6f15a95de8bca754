"""Tokenize a corpus once into ArrayRecord shards that training reads without tokenizing.

  python -m gpt_oss_train.tools.pretokenize --source=stdlib --output=/data/stdlib_tok \
      [--split=train] [--shard_size=10000]

--source takes any spec `gpt_oss_train.training.sources.make_source` does. Each record is one
document: its int32 ids (plain text ends with eos), followed by its int32 loss mask when
the corpus holds chats. `pretokenized.json` (tokenizer, dtype, counts, files) is written
last, so a directory without it is an interrupted run. Train on the result with
`--config.data.source=/data/stdlib_tok`.

The output directory must be new or empty: this tool never overwrites anything.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
from absl import app, flags, logging
from array_record.python.array_record_module import ArrayRecordWriter

from gpt_oss_train import errors
from gpt_oss_train.io.tokenizer import VOCAB_SIZE, Tokenizer
from gpt_oss_train.training import data, sources

_SOURCE = flags.DEFINE_string("source", None, "Corpus spec: stdlib, tfds:NAME, a path or glob.")
_OUTPUT = flags.DEFINE_string("output", None, "New or empty directory for the shards.")
_SPLIT = flags.DEFINE_string("split", "train", "Split of the source (stdlib, tfds).")
_SHARD_SIZE = flags.DEFINE_integer("shard_size", 10_000, "Documents per ArrayRecord file.")


def pretokenize(
    source_spec: str, output: str, *, split: str = "train", shard_size: int = 10_000
) -> dict:
    """Writes the shards and pretokenized.json; returns the metadata written."""
    if shard_size <= 0:
        raise sources.DataError(f"--shard_size must be positive, got {shard_size}")
    if os.path.exists(output) and (not os.path.isdir(output) or os.listdir(output)):
        raise sources.DataError(
            f"{output} already exists and is not an empty directory; "
            "choose a new --output (this tool never overwrites files)"
        )
    source = sources.make_source(source_spec, split=split)  # bad specs fail before any write
    os.makedirs(output, exist_ok=True)

    files, writer = [], None
    documents = tokens = in_shard = 0
    start = time.time()
    for i in range(len(source)):
        ids, mask = data.document_ids(source[i])
        if len(ids) < 2:  # empty text: nothing to predict, as the pipeline would drop it
            continue
        if writer is None or in_shard == shard_size:
            if writer is not None:
                writer.close()
            in_shard = 0
            files.append(f"shard-{len(files):05d}.array_record")
            # group_size:1 makes every record its own chunk: fast random access for grain.
            writer = ArrayRecordWriter(os.path.join(output, files[-1]), "group_size:1")
        record = np.concatenate([ids, mask] if source.has_chat else [ids])
        writer.write(record.astype("<i4").tobytes())  # little-endian, as sources.TokenRecords reads
        documents += 1
        in_shard += 1
        tokens += len(ids)
        if documents % 10_000 == 0:
            logging.info(
                "%d documents, %d tokens, %.0f tokens/s",
                documents,
                tokens,
                tokens / (time.time() - start),
            )
    if writer is not None:
        writer.close()
    if not documents:
        raise sources.DataError(f"{source_spec}: no document has any text")

    tok = Tokenizer()
    meta = {
        "format": sources.META_FORMAT,
        "tokenizer": sources.TOKENIZER_NAME,
        "vocab_size": VOCAB_SIZE,
        "eos_id": tok.eos_id,
        "dtype": "int32",
        "loss_mask": bool(source.has_chat),
        "documents": documents,
        "tokens": tokens,
        "files": files,
        "source": source_spec,
        "split": split,
        "replaced_bytes": sum(sources.replaced_bytes(source).values()),
    }
    tmp = os.path.join(output, sources.META_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(meta, f, indent=2)
    os.replace(tmp, os.path.join(output, sources.META_FILE))  # atomic: present means complete
    return meta


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    if not _SOURCE.value or not _OUTPUT.value:
        raise app.UsageError("--source and --output are required")
    try:
        meta = pretokenize(
            _SOURCE.value, _OUTPUT.value, split=_SPLIT.value, shard_size=_SHARD_SIZE.value
        )
    except sources.DataError as e:
        sys.exit(f"error: {e}")
    print(
        f"wrote {meta['documents']} documents, {meta['tokens']} tokens in "
        f"{len(meta['files'])} files to {_OUTPUT.value}"
    )


if __name__ == "__main__":
    app.run(main, flags_parser=errors.parse_flags)
