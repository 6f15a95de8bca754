"""Input pipelines: documents -> token ids -> packed rows -> per-process batches.

Documents come from `gpt_oss_train.training.sources` (`make_source`: a spec such as stdlib, a
path, tfds:NAME or chat:PATH); `make_pipeline` takes a spec or a source.

Documents. Plain text becomes `encode(text) + [eos]` with every token trained; a chat
becomes `render_chat_for_training(messages)`, trained only on what the assistant writes.
A document of n ids is the example (inputs=ids[:-1], targets=ids[1:],
loss_mask=mask[1:]): every target is the next token of its own document, and a
document's first token is context only (there is no BOS).

Packing, grain's ConcatThenSplitIterDataset: examples are laid end to end in order and
cut into rows of exactly seq_len. An example that crosses a row end is split there; its
rest opens the next row as a new segment whose positions start again at 0 (so a document
longer than seq_len becomes seq_len-long pieces). No (input, target) pair is dropped or
repeated, and the only padding is the tail of the last row of a finite run.

A batch, the contract with the train step, is a dict of int32 numpy arrays [rows, seq_len]:
  inputs       token ids (pad_id on padding)
  targets      the next token of the same document (pad_id on padding)
  positions    0, 1, 2, ... within each segment (0 on padding)
  segment_ids  1, 2, 3, ... per segment within the row; 0 marks padding
  loss_mask    1 where the target is trained: not padding, and for chats an assistant token

Preference pairs (pairs:PATH, for DPO) are not packed: a pair is two rows, the prompt then
the chosen reply, and the prompt then the rejected one (`render_reply_for_training`: the
mask covers the reply alone), each cut at seq_len and padded. A batch's rows alternate
chosen, rejected, so its rows 2i and 2i+1 are pair i. The DPO loss counts only pairs with
trained tokens in both rows: not the padding of a last batch, nor a pair one of whose
replies starts past seq_len (`check_pairs_fit` refuses a run where none of the first pairs
fits).
"""

from __future__ import annotations

import functools
from typing import Any

import grain
import jax
import numpy as np
from absl import flags

from gpt_oss_train import sharding
from gpt_oss_train.io.tokenizer import PAD_ID, Tokenizer

# DataError is raised here too; callers catch it as data.DataError.
from gpt_oss_train.training.sources import (
    Chat,
    DataError,
    PreferencePair,
    TokenRecords,
    make_source,
)

EXAMPLE_KEYS = ("inputs", "targets", "loss_mask")
BATCH_KEYS = ("inputs", "targets", "positions", "segment_ids", "loss_mask")


# --------------------------------------------------------------------------------------
# Documents -> examples -> packed rows
# --------------------------------------------------------------------------------------
@functools.cache
def _tokenizer():
    # Built lazily in each process (grain workers too): the harmony encoding is not picklable.
    return Tokenizer()


def document_ids(raw) -> tuple[np.ndarray, np.ndarray]:
    """(ids, loss_mask) of one raw document, both int32 [n]."""
    if isinstance(raw, str):
        ids = np.asarray(_tokenizer().encode(raw) + [_tokenizer().eos_id], np.int32)
        return ids, np.ones_like(ids)
    if isinstance(raw, Chat):
        try:
            ids, mask = _tokenizer().render_chat_for_training(raw.messages)
        except ValueError as e:
            raise DataError(f"{raw.where}: {e}") from None
        return np.asarray(ids, np.int32), np.asarray(mask, np.int32)
    raw = np.asarray(raw, np.int32)
    return (raw[0], raw[1]) if raw.ndim == 2 else (raw, np.ones_like(raw))


def to_example(raw) -> dict[str, np.ndarray]:
    ids, mask = document_ids(raw)
    return {"inputs": ids[:-1], "targets": ids[1:], "loss_mask": mask[1:]}


def _has_pairs(example: dict[str, np.ndarray]) -> bool:
    return len(example["inputs"]) > 0  # an empty text is [eos] alone: nothing to predict


def padded_row(ids: list[int], mask: list[int], seq_len: int) -> dict[str, np.ndarray]:
    """One unpacked row: the document's example cut at seq_len, padded after."""
    ids, mask = np.asarray(ids, np.int32), np.asarray(mask, np.int32)
    n = min(len(ids) - 1, seq_len)
    row = {k: np.zeros(seq_len, np.int32) for k in BATCH_KEYS}
    row["inputs"][:] = row["targets"][:] = PAD_ID
    row["inputs"][:n], row["targets"][:n], row["loss_mask"][:n] = (
        ids[:n],
        ids[1 : n + 1],
        mask[1 : n + 1],
    )
    row["positions"][:n] = np.arange(n)
    row["segment_ids"][:n] = 1
    return row


def pair_rows(pair: PreferencePair, seq_len: int) -> dict[str, np.ndarray]:
    """A preference pair as two rows (module docstring): each key [2, seq_len]."""
    tok = _tokenizer()
    rows = []
    for reply in (pair.chosen, pair.rejected):
        try:
            ids, mask = tok.render_reply_for_training(pair.prompt, reply)
        except ValueError as e:
            raise DataError(f"{pair.where}: {e}") from None
        rows.append(padded_row(ids, mask, seq_len))
    return {k: np.stack([r[k] for r in rows]) for k in BATCH_KEYS}


def check_pairs_fit(source, seq_len: int, first: int = 64) -> None:
    """A DataError unless some of the first `first` pairs has both replies inside seq_len:
    otherwise the run would train nothing, step after step."""
    n = min(first, len(source))
    for i in range(n):
        if pair_rows(source[i], seq_len)["loss_mask"].any(axis=1).all():
            return
    raise DataError(
        f"{source.name}: none of the first {n} preference pairs has both replies within "
        f"train.seq_len={seq_len} tokens (the Harmony system prompt alone takes about 60); "
        "raise seq_len"
    )


def _stack_pairs(pairs: list[dict[str, np.ndarray]], *, num_rows: int):
    """[2, seq_len] pairs -> a batch of num_rows rows (chosen, rejected, ...), a short last
    batch padded with untrained rows as _stack_rows does."""
    rows = [{k: p[k][i] for k in BATCH_KEYS} for p in pairs for i in (0, 1)]
    return _stack_rows(rows, num_rows=num_rows, pad_id=PAD_ID)


class _RowsIterator(grain.DatasetIterator):
    """Turns ConcatThenSplit's output into batch rows, and repairs its state after JSON.

    grain 0.2.18's ConcatThenSplit compares `remainder_slices` with the tuple (-1, -1);
    after a JSON round trip (Orbax's grain handler) they are lists, the comparison fails,
    and the restored iterator yields different rows. Tuples are put back here.
    """

    def __init__(self, parent: grain.DatasetIterator, pad_id: int):
        super().__init__(parent)
        self._pad_id = pad_id

    def __next__(self) -> dict[str, np.ndarray]:
        row = next(self._parent)
        seg = row["inputs_segment_ids"].astype(np.int32)
        pad = seg == 0
        return {
            "inputs": np.where(pad, self._pad_id, row["inputs"]).astype(np.int32),
            "targets": np.where(pad, self._pad_id, row["targets"]).astype(np.int32),
            "positions": np.where(pad, 0, row["inputs_positions"]).astype(np.int32),
            "segment_ids": seg,
            "loss_mask": np.where(pad, 0, row["loss_mask"]).astype(np.int32),
        }

    def get_state(self) -> dict[str, Any]:
        return self._parent.get_state()

    def set_state(self, state: dict[str, Any]) -> None:
        state = dict(state)
        state["remainder_slices"] = {k: tuple(v) for k, v in state["remainder_slices"].items()}
        self._parent.set_state(state)


class _Rows(grain.IterDataset):
    def __init__(self, parent: grain.IterDataset, pad_id: int):
        super().__init__(parent)
        self._pad_id = pad_id

    def __iter__(self) -> _RowsIterator:
        return _RowsIterator(self._parent.__iter__(), self._pad_id)


def pack(examples: grain.IterDataset, seq_len: int, pad_id: int = PAD_ID) -> grain.IterDataset:
    """Rows of exactly seq_len from examples {inputs, targets, loss_mask} (module docstring)."""
    cts = grain.experimental.ConcatThenSplitIterDataset(
        examples, length_struct={k: seq_len for k in EXAMPLE_KEYS}
    )
    return _Rows(cts, pad_id)


def _stack_rows(rows: list[dict[str, np.ndarray]], *, num_rows: int, pad_id: int):
    """Stacks rows into a batch, padding a short last batch with empty rows so every batch
    has the same shape (a new shape would recompile the train step)."""
    batch = {k: np.stack([r[k] for r in rows]) for k in BATCH_KEYS}
    missing = num_rows - len(rows)
    if missing:
        for k, v in batch.items():
            fill = pad_id if k in ("inputs", "targets") else 0
            batch[k] = np.concatenate([v, np.full((missing, v.shape[1]), fill, np.int32)])
    return batch


# --------------------------------------------------------------------------------------
# Pipeline
# --------------------------------------------------------------------------------------
class Pipeline:
    """A running input pipeline: `next(p)` gives this process's batch: its own rows, or
    with `whole_batches` the whole global batch (see make_pipeline). `iterator` is the
    grain DatasetIterator; checkpoints save and restore it through Orbax
    (`grain.checkpoint.CheckpointSave(p.iterator)` / `CheckpointRestore(p.iterator)`),
    and `iterator.get_state()` is the same state as a JSON-able dict."""

    def __init__(self, dataset: grain.IterDataset, source, whole_batches: bool = False):
        self.dataset, self.source, self.whole_batches = dataset, source, whole_batches
        self.iterator = iter(dataset)

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        return next(self.iterator)

    def close(self) -> None:
        self.iterator.close()


def make_pipeline(
    source_spec,
    *,
    seq_len: int,
    global_batch_size: int,
    seed: int,
    shuffle: bool = True,
    process_index: int | None = None,
    process_count: int | None = None,
    num_epochs: int | None = None,
    split: str = "train",
    num_workers: int = 0,
    max_docs: int = 0,
    read_threads: int = 2,
) -> Pipeline:
    """The pipeline of one JAX process.

    Order (all deterministic in `seed`, resumable from the iterator state): documents ->
    shuffle (a new order each epoch) -> repeat num_epochs (None: forever) -> this process's
    share [process_index::process_count] -> tokenize -> pack -> batch of
    global_batch_size // process_count rows. `source_spec` is a spec string or a source
    from `make_source`; `max_docs` > 0 keeps the first max_docs.

    Pre-tokenized sources skip the per-process share: every process reads and packs the
    same documents into whole global batches (`Pipeline.whole_batches`), so the batch at
    step s is a function of the seed and s alone, on any number of processes, and the
    iterator state is the same on all of them (a checkpoint resumes on another process
    count). Reading ids is cheap; tokenizing text on every process would not be, so text
    sources keep the per-process share and an order that depends on the process count.

    A finite run (num_epochs set) ends with a last batch padded to full size; in a
    multi-process job the processes may run out after different numbers of batches, so
    take a fixed number of batches from a forever pipeline when they must stay in step.
    """
    if process_index is None or process_count is None:
        process_index, process_count = jax.process_index(), jax.process_count()
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} is not in [0, {process_count})")
    if seq_len <= 0 or global_batch_size <= 0 or global_batch_size % process_count:
        raise ValueError(
            f"global_batch_size {global_batch_size} must be a positive multiple of "
            f"the {process_count} processes, and seq_len ({seq_len}) positive"
        )
    if not 0 <= seed < 2**32:
        raise ValueError(f"seed {seed} must be in [0, 2**32)")
    source = make_source(source_spec, split=split) if isinstance(source_spec, str) else source_spec
    whole = isinstance(source, TokenRecords)
    rows = global_batch_size if whole else global_batch_size // process_count
    pairs = getattr(source, "has_pairs", False)
    if pairs and rows % 2:
        raise ValueError(
            f"preference pairs take two rows each: {rows} rows a batch per process is odd"
        )
    share = None if whole else (process_index, process_count)
    ds = _documents(source, seed, shuffle, num_epochs, max_docs, share)
    ds = _batches(ds, seq_len, rows, pairs, read_threads)
    if num_workers > 0:
        ds = _in_workers(ds, num_workers)
    return Pipeline(ds, source, whole_batches=whole)


def _documents(source, seed: int, shuffle: bool, num_epochs, max_docs: int, share):
    """The documents a pipeline reads, in order: the first max_docs (0: all), shuffled (a
    new order each epoch), repeated num_epochs times (None: forever), and with `share`
    (process_index, process_count) only this process's part of them."""
    ds = grain.MapDataset.source(source)
    if max_docs > 0:
        ds = ds[:max_docs]
    if shuffle:
        ds = ds.shuffle(seed=seed)
    ds = ds.repeat(num_epochs)
    if share is not None:
        # After repeat, so the processes split every epoch between them, each a disjoint part.
        process_index, process_count = share
        ds = ds[process_index::process_count]
    return ds


def _batches(documents, seq_len: int, rows: int, pairs: bool, read_threads: int):
    """Documents -> batches of `rows` rows: examples packed into rows of seq_len, or
    preference pairs of two padded rows each (module docstring)."""
    if pairs:
        ds = documents.map(functools.partial(pair_rows, seq_len=seq_len))
    else:
        ds = documents.map(to_example).filter(_has_pairs)
    # Threads overlap file reads and tokenizing with the train step (which releases the GIL).
    ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=64))
    if pairs:
        return ds.batch(rows // 2, batch_fn=functools.partial(_stack_pairs, num_rows=rows))
    ds = pack(ds, seq_len, PAD_ID)
    return ds.batch(rows, batch_fn=functools.partial(_stack_rows, num_rows=rows, pad_id=PAD_ID))


def _in_workers(ds: grain.IterDataset, num_workers: int) -> grain.IterDataset:
    """`ds` made by num_workers grain worker processes."""
    if not flags.FLAGS.is_parsed():  # grain's workers read absl flags; outside an absl app
        flags.FLAGS.mark_as_parsed()  # (tests, notebooks) their defaults are the right ones
    return ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=num_workers))


def global_batch(
    local_batch: dict[str, np.ndarray], mesh, rules, *, whole: bool = False
) -> dict[str, Any]:
    """This process's rows -> global jax.Arrays sharded over `batch` (any process count).
    whole=True: `local_batch` is the whole global batch (Pipeline.whole_batches); each
    device takes its own rows of it."""
    s = sharding.batch_sharding(mesh, sharding.validate_rules(rules, mesh.axis_names), 2)
    if whole:
        return {
            k: jax.make_array_from_callback(v.shape, s, lambda index, v=v: np.asarray(v[index]))
            for k, v in local_batch.items()
        }
    return {
        k: jax.make_array_from_process_local_data(s, np.asarray(v)) for k, v in local_batch.items()
    }
