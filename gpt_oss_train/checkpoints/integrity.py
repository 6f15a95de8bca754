"""Whether a checkpoint's files are still those its save wrote, checked before a restore.

Orbax makes a save atomic (a temporary folder renamed into place once every process has
written its part) but does not check, when it restores, that the files are still whole. A
truncated data file makes TensorStore fail deep in a restore with a long traceback, and an
emptied JSON file fails in the handler that reads it. So:

- after a save has finished, process 0 records the size of every file of the step in
  `<step>/file_sizes.json` (`record`);
- before a restore, `problem` compares the files with that record and parses every JSON
  file, and names the first file that is missing, has another size, or is unreadable.

A checkpoint whose save finished but whose record was never written (the run was killed
in between) is checked by its JSON files alone; a restore failure still names its item.
Checks read only listings and small JSON files: no array data.
"""

from __future__ import annotations

import json
import posixpath

from gpt_oss_train.errors import json_error
from gpt_oss_train.io import storage

SIZES_FILE = "file_sizes.json"
# Orbax's metadata files and the JSON items (model_config, meta, data) of a training step.
_JSON_NAMES = ("_CHECKPOINT_METADATA", "_METADATA", "metadata")


def record(step_dir: str) -> None:
    """Writes the size of every file of a finished step folder (process 0, once)."""
    sizes = storage.file_sizes(step_dir)
    sizes.pop(SIZES_FILE, None)
    storage.write_atomic(storage.join(step_dir, SIZES_FILE), json.dumps(sizes, sort_keys=True))


def _is_json(relpath: str) -> bool:
    name = posixpath.basename(relpath)
    return name.endswith(".json") or name in _JSON_NAMES


def _json_problem(step_dir: str, relpath: str) -> str | None:
    try:
        text = storage.read_text(storage.join(step_dir, relpath))
    except (OSError, UnicodeDecodeError) as e:
        return f"{relpath}: unreadable ({e})"
    if not text.strip():
        return f"{relpath}: empty"
    try:
        json.loads(text)
    except json.JSONDecodeError as e:
        return f"{relpath}: {json_error(e)}"
    return None


def problem(step_dir: str, items: tuple[str, ...]) -> str | None:
    """The first thing wrong with the files of `items` (and the step's own files) in a
    step folder, as 'params/ocdbt.process_0/d/ab12: 1000 bytes, 95707136 when saved',
    or None if nothing is."""
    try:
        now = storage.file_sizes(step_dir)
    except OSError as e:
        return f"unreadable ({e})"
    wanted = lambda rel: "/" not in rel or rel.split("/", 1)[0] in items
    if SIZES_FILE in now:
        trouble = _json_problem(step_dir, SIZES_FILE)
        if trouble:
            return trouble
        saved = json.loads(storage.read_text(storage.join(step_dir, SIZES_FILE)))
        for rel, size in sorted(saved.items()):
            if not wanted(rel):
                continue
            if rel not in now:
                return f"{rel}: missing"
            if now[rel] != size:
                return f"{rel}: {now[rel]} bytes, {size} when saved"
    for rel in sorted(now):
        if wanted(rel) and _is_json(rel):
            trouble = _json_problem(step_dir, rel)
            if trouble:
                return trouble
    return None
