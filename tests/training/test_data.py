"""Tests of gpt_oss_train.training.data and .sources, and tools.pretokenize: sources,
packing, determinism, resume, process sharding, and the errors a user can cause. The
expected token streams are computed here straight from the tokenizer, independently of
the pipeline."""

from __future__ import annotations

import collections
import json
import logging
import os
import re
import subprocess
import sys

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gpt_oss_train import config, sharding
from gpt_oss_train.io.tokenizer import Tokenizer
from gpt_oss_train.training import data, sources

SEQ = 64
EOS = 199999


@pytest.fixture(scope="module")
def tok():
    return Tokenizer()


def _write_jsonl(path, objs):
    path.write_text("".join(json.dumps(o) + "\n" for o in objs))
    return path


def _texts(n, seed=0):
    """Documents of very different lengths (some longer than SEQ tokens, one empty)."""
    rng = np.random.default_rng(seed)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    out = []
    for i in range(n):
        length = int(rng.choice([0, 1, 3, 10, 40, 150])) if i else 0
        out.append(f"<doc {i}> " + " ".join(rng.choice(words, length)) if i else "")
    return out


def _pipe(spec, **kw):
    kw = {
        "seq_len": SEQ,
        "global_batch_size": 4,
        "seed": 0,
        "process_index": 0,
        "process_count": 1,
        **kw,
    }
    return data.make_pipeline(spec, **kw)


def _stream(batches):
    """Non-padding (input, target, loss_mask) triples of batches in order."""
    out = []
    for b in batches:
        keep = b["segment_ids"] > 0
        out += list(zip(b["inputs"][keep], b["targets"][keep], b["loss_mask"][keep]))
    return [tuple(int(v) for v in t) for t in out]


def _expected_stream(docs_ids, docs_masks=None):
    out = []
    for i, ids in enumerate(docs_ids):
        mask = docs_masks[i] if docs_masks else [1] * len(ids)
        out += [(ids[j], ids[j + 1], mask[j + 1]) for j in range(len(ids) - 1)]
    return out


def _check_row_invariants(batch):
    """Positions restart at 0 with each segment and count up; segment ids are 1, 2, ... with
    0 only as trailing padding; padding has no loss and pad ids."""
    for seg, pos, inp, tgt, loss in zip(
        *(batch[k] for k in ("segment_ids", "positions", "inputs", "targets", "loss_mask"))
    ):
        real = seg > 0
        n = int(real.sum())
        assert real[:n].all() and not real[n:].any(), "padding must be at the row end"
        assert (loss[~real] == 0).all() and (pos[~real] == 0).all()
        assert (inp[~real] == EOS).all() and (tgt[~real] == EOS).all()
        if n:
            assert seg[0] == 1 and pos[0] == 0
            step = np.diff(seg[:n])
            assert set(step.tolist()) <= {0, 1}
            new = np.concatenate([[True], step == 1])
            expect = np.zeros(n, np.int64)
            for j in range(1, n):
                expect[j] = 0 if new[j] else expect[j - 1] + 1
            np.testing.assert_array_equal(pos[:n], expect)


# ----------------------------------------------------------------------------------------
# Packing
# ----------------------------------------------------------------------------------------
def test_pack_raw_token_lists_exact():
    # Token = 1000 * doc + position, so a target must be its input + 1 inside one document.
    lengths = [1, 2, 5, 17, 16, 33, 3, 50, 7, 40]
    docs = [np.arange(n, dtype=np.int32) + 1000 * (d + 1) for d, n in enumerate(lengths)]
    docs[3] = np.stack([docs[3], np.arange(17, dtype=np.int32) % 2])  # with a loss mask
    examples = (
        grain.MapDataset.source(docs).map(data.to_example).filter(data._has_pairs).to_iter_dataset()
    )
    rows = list(data.pack(examples, 16, pad_id=EOS))
    batch = {k: np.stack([r[k] for r in rows]) for k in data.BATCH_KEYS}
    _check_row_invariants(batch)
    assert all(r["segment_ids"].all() for r in rows[:-1]), "only the last row may pad"
    real = batch["segment_ids"] > 0
    assert (batch["targets"][real] == batch["inputs"][real] + 1).all()
    # Each segment starts where its document does, or at a row start (a split piece).
    starts = real & (batch["positions"] == 0)
    piece = starts & (batch["inputs"] % 1000 != 0)
    assert (np.nonzero(piece)[1] == 0).all()
    assert piece.any(), "the test should split documents across rows"
    masks = [[1] * n for n in lengths]
    masks[3] = (np.arange(17) % 2).tolist()
    ids = [d[0].tolist() if d.ndim == 2 else d.tolist() for d in docs]
    assert _stream([batch]) == _expected_stream(ids, masks)


def test_pipeline_jsonl_stream_is_exact(tmp_path, tok):
    texts = _texts(40)
    path = _write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in texts])
    batches = list(_pipe(str(path), shuffle=False, num_epochs=1))
    for b in batches:
        assert set(b) == set(data.BATCH_KEYS)
        assert all(v.shape == (4, SEQ) and v.dtype == np.int32 for v in b.values())
        _check_row_invariants(b)
    ids = [tok.encode(t) + [EOS] for t in texts if t]
    assert _stream(batches) == _expected_stream(ids)
    inputs = [i for i, _, _ in _stream(batches)]
    assert EOS not in inputs, "eos ends a document: it is a target, never an input"


def test_every_pair_once_per_epoch_when_shuffled(tmp_path, tok):
    texts = _texts(30, seed=1)
    path = _write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in texts])
    want = collections.Counter(_expected_stream([tok.encode(t) + [EOS] for t in texts if t]))
    got = collections.Counter(_stream(_pipe(str(path), num_epochs=2, seed=3)))
    assert got == collections.Counter({k: 2 * v for k, v in want.items()})


# ----------------------------------------------------------------------------------------
# Determinism, resume, process sharding
# ----------------------------------------------------------------------------------------
def _take(p, n):
    return [next(p) for _ in range(n)]


def _same(a, b):
    return len(a) == len(b) and all(
        all(np.array_equal(x[k], y[k]) for k in data.BATCH_KEYS) for x, y in zip(a, b)
    )


def test_same_seed_same_batches_other_seed_other_order(tmp_path):
    path = _write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in _texts(60, seed=2)])
    a, b, c = (_take(_pipe(str(path), seed=s), 6) for s in (7, 7, 8))
    assert _same(a, b)
    assert not _same(a, c)


@pytest.mark.parametrize("spec", ["jsonl", "stdlib"])
def test_resume_from_json_state_continues_exactly(tmp_path, spec):
    if spec == "jsonl":  # short documents: states with and without a split remainder
        spec = str(_write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in _texts(80, seed=4)]))
    reference = _take(_pipe(spec, seed=5), 12)
    for k in (0, 1, 2, 3, 5, 8):
        p = _pipe(spec, seed=5)
        assert _same(_take(p, k), reference[:k])
        state = json.loads(json.dumps(p.iterator.get_state()))  # as a checkpoint stores it
        fresh = _pipe(spec, seed=5)
        fresh.iterator.set_state(state)
        assert _same(_take(fresh, 4), reference[k : k + 4]), f"resume after {k} batches"


def test_orbax_checkpoint_of_iterator(tmp_path):
    # The classes the checkpoint code uses; Orbax's grain handler stores the state as JSON.
    spec = str(_write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in _texts(50, seed=6)]))
    reference = _take(_pipe(spec), 8)
    with ocp.CheckpointManager(tmp_path / "ckpt", item_names=("data",)) as mngr:
        for k in (0, 3):  # 0: a state without a split remainder, the one grain restores wrongly
            p = _pipe(spec)
            _take(p, k)
            mngr.save(k, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(p.iterator)))
            mngr.wait_until_finished()
            fresh = _pipe(spec)
            mngr.restore(
                k, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(fresh.iterator))
            )
            assert _same(_take(fresh, 5), reference[k : k + 5]), f"restore after {k} batches"


def test_worker_processes_are_deterministic_and_resumable():
    # Packing runs inside each worker, so the batches differ from num_workers=0, but two
    # runs agree and a JSON state restores (the state repair runs in the workers too).
    p = _pipe("stdlib", num_workers=2, seed=1)
    first = _take(p, 3)
    state = json.loads(json.dumps(p.iterator.get_state()))
    rest = _take(p, 3)
    p.close()
    fresh = _pipe("stdlib", num_workers=2, seed=1)
    fresh.iterator.set_state(state)
    assert _same(_take(fresh, 3), rest)
    fresh.close()
    assert all(b["segment_ids"].all() for b in first + rest)


def test_max_docs_keeps_the_first_documents(tmp_path, tok):
    texts = [f"doc {i}" for i in range(10)]
    path = _write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in texts])
    stream = _stream(_pipe(str(path), num_epochs=1, max_docs=4))
    assert collections.Counter(stream) == collections.Counter(
        _expected_stream([tok.encode(t) + [EOS] for t in texts[:4]])
    )


def test_processes_read_disjoint_documents_covering_all(tmp_path, tok):
    texts = [f"<doc {i}> " + "word " * (i % 23) for i in range(50)]
    path = _write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in texts])
    seen = []
    for pi in range(2):
        stream = _stream(
            _pipe(
                str(path),
                global_batch_size=4,
                process_index=pi,
                process_count=2,
                num_epochs=1,
                seed=9,
            )
        )
        # A document's inputs are its text's ids (eos is never an input), so the decoded
        # input stream is the texts of this process's documents, end to end.
        text = tok.decode([i for i, _, _ in stream])
        seen.append(collections.Counter(int(n) for n in re.findall(r"<doc (\d+)>", text)))
    assert not set(seen[0]) & set(seen[1])
    assert seen[0] + seen[1] == collections.Counter(range(50))
    assert abs(sum(seen[0].values()) - sum(seen[1].values())) <= 1


def test_batch_must_divide_over_processes(tmp_path):
    with pytest.raises(ValueError, match="multiple"):
        data.make_pipeline(
            "stdlib", seq_len=SEQ, global_batch_size=3, seed=0, process_index=0, process_count=2
        )


def test_global_batch_on_a_mesh():
    mesh = sharding.make_mesh(dict(data=1, fsdp=-1, tensor=1, expert=1))
    local = next(_pipe("stdlib", global_batch_size=len(jax.devices())))
    arrays = data.global_batch(local, mesh, config.DEFAULT_RULES)
    for k, v in local.items():
        assert arrays[k].shape == v.shape and arrays[k].dtype == np.int32
        assert arrays[k].sharding.spec[0] == ("data", "fsdp", "expert")
        np.testing.assert_array_equal(np.asarray(arrays[k]), v)


# ----------------------------------------------------------------------------------------
# Sources
# ----------------------------------------------------------------------------------------
def test_stdlib_is_python_code_with_disjoint_eval():
    train, ev = sources.make_source("stdlib"), sources.make_source("stdlib", split="eval")
    assert len(ev) >= 10 and len(train) >= 40 * len(ev)
    assert not set(train.paths) & set(ev.paths)
    assert sorted(train.paths + ev.paths) == sources._stdlib_files()
    assert not any("site-packages" in p for p in train.paths)
    b = next(_pipe("stdlib", global_batch_size=8))
    code = Tokenizer().decode(b["inputs"].ravel())
    assert len(re.findall(r"\b(def|import|class|return)\b", code)) >= 5
    with pytest.raises(sources.DataError, match="unknown split"):
        sources.make_source("stdlib", split="test")


def test_text_files_directory_glob_and_single_file(tmp_path, tok):
    (tmp_path / "d" / "sub").mkdir(parents=True)
    files = {
        "d/a.txt": "first text file",
        "d/sub/b.md": "# markdown\nbody",
        "d/c.py": "def f():\n  return 1\n",
        "d/empty.txt": "",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "d" / "image.bin").write_bytes(b"\0\1\2")  # unknown type: skipped in a dir
    (tmp_path / "d" / ".hidden.txt").write_text("hidden")
    src = sources.make_source(str(tmp_path / "d"))
    assert sorted(src[i] for i in range(len(src))) == sorted(files.values())
    md = sources.make_source(str(tmp_path / "d" / "**" / "*.md"))
    assert [md[i] for i in range(len(md))] == ["# markdown\nbody"]
    one = sources.make_source(str(tmp_path / "d" / "image.bin"))  # named alone: read as text
    assert len(one) == 1
    stream = _stream(_pipe(str(tmp_path / "d"), shuffle=False, num_epochs=1))
    want = [tok.encode(files[n]) + [EOS] for n in sorted(files) if files[n]]
    assert stream == _expected_stream(want)


def test_parquet_and_mixed_directory(tmp_path, tok):
    (tmp_path / "m").mkdir()
    pq.write_table(
        pa.table({"text": ["parquet one", None, "parquet two"], "id": [1, 2, 3]}),
        tmp_path / "m" / "p.parquet",
    )
    _write_jsonl(tmp_path / "m" / "j.jsonl", [{"text": "jsonl doc"}])
    (tmp_path / "m" / "t.txt").write_text("text doc")
    src = sources.make_source(str(tmp_path / "m"))
    assert sorted(src[i] for i in range(len(src))) == sorted(
        ["", "parquet one", "parquet two", "jsonl doc", "text doc"]
    )
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "bad.parquet")
    with pytest.raises(sources.DataError, match=r"bad\.parquet.*no 'text' column"):
        sources.make_source(str(tmp_path / "bad.parquet"))


def _pretokenize(*args):
    """Runs the tool as a user would (in a subprocess, which also keeps its absl flags out
    of this process's flag registry)."""
    return subprocess.run(
        [sys.executable, "-m", "gpt_oss_train.tools.pretokenize", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )


def test_pretokenize_cli_roundtrip_and_refuses_to_overwrite(tmp_path, tok):
    texts = _texts(25, seed=7)
    src = _write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in texts])
    out = tmp_path / "tok"
    run = _pretokenize(f"--source={src}", f"--output={out}", "--shard_size=7")
    assert run.returncode == 0, run.stderr
    meta = json.loads((out / sources.META_FILE).read_text())
    assert meta["tokenizer"] == "o200k_harmony" and meta["dtype"] == "int32"
    assert meta["documents"] == sum(1 for t in texts if t) and len(meta["files"]) == 4
    want = _stream(_pipe(str(src), shuffle=False, num_epochs=1))
    for spec in (str(out), str(out / "*.array_record")):
        assert _stream(_pipe(spec, shuffle=False, num_epochs=1)) == want
    # Never overwrite: a non-empty output directory is refused, before anything is read.
    before = {f: (out / f).read_bytes() for f in os.listdir(out)}
    run = _pretokenize(f"--source={src}", f"--output={out}")
    assert run.returncode != 0 and "not an empty directory" in run.stderr
    assert {f: (out / f).read_bytes() for f in os.listdir(out)} == before


CHATS = [
    [
        {"role": "user", "content": "What is two plus two?"},
        {"role": "assistant", "content": "Four."},
    ],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "channel": "analysis", "content": "Pick a common one."},
        {"role": "assistant", "content": "Blue."},
    ],
    [
        {"role": "developer", "content": "Answer in French."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Bonjour " * 40},
    ],  # longer than SEQ: split
]


def test_chat_jsonl_trains_only_assistant_tokens(tmp_path, tok):
    path = _write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CHATS])
    rendered = [tok.render_chat_for_training(m) for m in CHATS]
    want = _expected_stream([r[0] for r in rendered], [r[1] for r in rendered])
    for spec in (str(path), f"chat:{path}"):
        stream = _stream(_pipe(spec, shuffle=False, num_epochs=1))
        assert stream == want
    trained = tok.decode([t for _, t, m in stream if m])
    assert "Four." in trained and "Blue." in trained and "Pick a common one." in trained
    for prompt in ("two plus two", "Name a colour", "terse", "French", "Hello"):
        assert prompt not in trained
    assert 0 < sum(m for *_, m in stream) < len(stream)
    # Pre-tokenized chats keep their loss mask.
    out = tmp_path / "chat_tok"
    assert _pretokenize(f"--source={path}", f"--output={out}").returncode == 0
    assert json.loads((out / sources.META_FILE).read_text())["loss_mask"] is True
    assert _stream(_pipe(str(out), shuffle=False, num_epochs=1)) == want


def test_tfds_unprepared_dataset_is_a_clear_error_without_download(tmp_path, monkeypatch):
    # here, not at the top: importing tfds defines an absl flag in every process
    import tensorflow_datasets as tfds

    def no_download(*a, **k):
        raise AssertionError("tried to download")

    monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path))
    monkeypatch.setattr(tfds.core.DatasetBuilder, "download_and_prepare", no_download)
    with pytest.raises(sources.DataError) as e:
        sources.make_source("tfds:lm1b")
    msg = str(e.value)
    assert "tfds:lm1b is not prepared" in msg and "tfds build lm1b" in msg and str(tmp_path) in msg
    with pytest.raises(sources.DataError, match="no_such_dataset_xyz"):
        sources.make_source("tfds:no_such_dataset_xyz:train:text")
    assert not any(tmp_path.iterdir()), "nothing may be written into the data dir"
    assert sources._parse_tfds("lm1b:1.1.0:train[:10%]:text") == (
        "lm1b:1.1.0",
        "train[:10%]",
        "text",
    )


# ----------------------------------------------------------------------------------------
# Errors a user can cause
# ----------------------------------------------------------------------------------------
def test_missing_paths_and_empty_corpora(tmp_path):
    with pytest.raises(sources.DataError, match=re.escape(str(tmp_path / "nope.txt"))):
        sources.make_source(str(tmp_path / "nope.txt"))
    with pytest.raises(sources.DataError, match="matches no files"):
        sources.make_source(str(tmp_path / "*.jsonl"))
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(sources.DataError, match="empty"):
        sources.make_source(str(tmp_path / "empty_dir"))
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "a.txt").write_text("")
    (tmp_path / "blank" / "b.txt").write_text("")
    with pytest.raises(sources.DataError, match=r"blank.*corpus is empty"):
        sources.make_source(str(tmp_path / "blank"))
    _write_jsonl(tmp_path / "e.jsonl", [{"text": ""}, {"text": ""}])
    with pytest.raises(sources.DataError, match="corpus is empty"):
        sources.make_source(str(tmp_path / "e.jsonl"))
    with pytest.raises(data.DataError, match="corpus is empty"):
        data.make_pipeline(
            str(tmp_path / "e.jsonl"),
            seq_len=SEQ,
            global_batch_size=2,
            seed=0,
            process_index=0,
            process_count=1,
        )


def test_malformed_jsonl_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n\n{"text": "broken\n{"text": "ok"}\n')
    with pytest.raises(sources.DataError, match=re.escape(f"{path}:3: not valid JSON")):
        sources.make_source(str(path))
    _write_jsonl(path, [{"text": "ok"}, {"body": "no text"}])
    with pytest.raises(sources.DataError, match=re.escape(f"{path}:2: expected")):
        sources.make_source(str(path))
    _write_jsonl(path, [{"text": "plain"}])
    with pytest.raises(sources.DataError, match=re.escape(f"{path}:1")):
        sources.make_source(f"chat:{path}")


def test_chat_with_unknown_role_names_file_and_line(tmp_path):
    path = _write_jsonl(
        tmp_path / "chat.jsonl",
        [
            {"messages": CHATS[0]},
            {
                "messages": [
                    {"role": "human", "content": "hi"},
                    {"role": "assistant", "content": "yo"},
                ]
            },
        ],
    )
    with pytest.raises(
        sources.DataError, match=re.escape(f"{path}:2: message 0 has unknown role 'human'")
    ):
        sources.make_source(str(path))
    # A chat that passes the structural check but not harmony's is still reported by line.
    _write_jsonl(
        path,
        [
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "tool", "content": "x"},
                    {"role": "assistant", "content": "yo"},
                ]
            }
        ],
    )
    with pytest.raises(data.DataError, match=re.escape(f"{path}:1: message")):
        next(_pipe(str(path)))


def test_invalid_utf8_is_replaced_counted_and_warned_once(tmp_path, caplog, tok):
    (tmp_path / "d").mkdir()
    bad = tmp_path / "d" / "bad.txt"
    bad.write_bytes(b"caf\xc3 ok \xff\xfe end")  # 3 invalid bytes
    rng = np.random.default_rng(0)
    noise = tmp_path / "d" / "noise.txt"
    noise.write_bytes(rng.integers(0, 256, 200_000, dtype=np.uint8).tobytes())
    caplog.set_level(logging.WARNING)
    p = _pipe(str(tmp_path / "d"), shuffle=False, num_epochs=3, global_batch_size=8)
    batches = list(p)
    per_file = sources.replaced_bytes(p.source)
    assert per_file[str(bad)] == 3 and per_file[str(noise)] > 50_000
    warnings = [r.getMessage() for r in caplog.records if str(bad) in r.getMessage()]
    assert warnings == [f"{bad}: 3 bytes are not valid UTF-8 and were replaced by U+FFFD"]
    ids = tok.encode("caf\ufffd ok \ufffd\ufffd end")
    assert _stream(batches)[: len(ids)] == _expected_stream([ids + [EOS]])[: len(ids)]
