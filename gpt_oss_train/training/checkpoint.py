"""Orbax checkpoints: training state, data-iterator state and the model config together.

A checkpoint is a step folder `<dir>/<step>/` holding named items:

  model_config   JSON: the architecture (architecture.FIELDS), so decode and fine-tuning
                 rebuild the exact network with no flags
  params         the parameter tree (sharded arrays; restored straight into shardings)
  opt_state      optimizer state                       (training checkpoints only)
  meta           JSON: step, seed, and what wrote it   (training checkpoints only)
  data           the grain iterator's position         (training checkpoints only)

`tools/convert_checkpoint.py` writes the first two; `train` writes all five. Training
checkpoints live in `<workdir>/checkpoints`.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from typing import Any

import jax
import orbax.checkpoint as ocp
from absl import logging

from gpt_oss_train.model import architecture

MODEL_CONFIG = "model_config"
PARAMS = "params"
OPT_STATE = "opt_state"
META = "meta"
DATA = "data"
ALL_ITEMS = (MODEL_CONFIG, PARAMS, OPT_STATE, META, DATA)


class CheckpointError(ValueError):
    """A checkpoint that cannot be used as asked; the message names the folder."""


def _manager(
    directory: str, *, keep: int | None = None, async_save: bool = True, read_only: bool = False
) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep,
        enable_async_checkpointing=async_save,
        create=not read_only,
        read_only=read_only,
    )
    return ocp.CheckpointManager(os.path.abspath(directory), options=options, item_names=ALL_ITEMS)


def is_orbax_checkpoint(path: str) -> bool:
    """A checkpoint root (step folders inside) or one step folder of it."""
    return find_step_dir(path) is not None


def find_step_dir(path: str) -> tuple[str, int] | None:
    """(root directory, step) for the latest step under `path`: accepts a training workdir,
    its `checkpoints/` folder, a converted checkpoint root, or a step folder itself."""
    path = os.path.abspath(path)
    for root in (os.path.join(path, "checkpoints"), path):
        if os.path.isdir(root):
            steps = [
                int(n)
                for n in os.listdir(root)
                if n.isdigit() and os.path.isdir(os.path.join(root, n, MODEL_CONFIG))
            ]
            if steps:
                return root, max(steps)
    if os.path.isdir(os.path.join(path, MODEL_CONFIG)) and os.path.basename(path).isdigit():
        return os.path.dirname(path), int(os.path.basename(path))
    return None


def read_model_config(path: str) -> dict[str, Any]:
    """The architecture stored with a checkpoint (no arrays are read)."""
    found = find_step_dir(path)
    if found is None:
        raise CheckpointError(f"{path}: no Orbax checkpoint with a model config found here")
    root, step = found
    item_dir = os.path.join(root, str(step), MODEL_CONFIG)
    files = [f for f in os.listdir(item_dir) if f.endswith(".json") or "metadata" in f]
    for name in sorted(files):
        with open(os.path.join(item_dir, name)) as f:
            text = f.read()
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            continue
        if isinstance(data, dict) and "hidden_size" in data:
            return architecture.from_json(json.dumps(data), item_dir)
    raise CheckpointError(f"{item_dir}: model config JSON not found or unreadable")


def check_same_architecture(stored: dict, wanted: dict, where: str):
    diffs = [
        f"{k}: checkpoint {stored.get(k)!r} vs config {wanted.get(k)!r}"
        for k in architecture.FIELDS
        if stored.get(k) != wanted.get(k)
    ]
    if diffs:
        raise CheckpointError(
            f"{where} holds a checkpoint of a different model ({'; '.join(diffs)}). Use a new "
            "--workdir, or set the config to the checkpoint's shape; the checkpoint was not "
            "touched."
        )


def save_params_only(directory: str, params, arch: dict, step: int = 0):
    """A params-only checkpoint (what convert_checkpoint writes). Refuses to write into a
    folder that already has checkpoints."""
    if find_step_dir(directory) is not None:
        raise CheckpointError(f"{directory} already holds a checkpoint; choose an empty folder")
    mngr = _manager(directory, async_save=False)
    mngr.save(
        step,
        args=ocp.args.Composite(
            **{MODEL_CONFIG: ocp.args.JsonSave(dict(arch)), PARAMS: ocp.args.StandardSave(params)}
        ),
    )
    mngr.wait_until_finished()
    mngr.close()


def read_meta(path: str) -> dict[str, Any]:
    """The `meta` item of the newest checkpoint under `path` ({} if it has none)."""
    found = find_step_dir(path)
    if found is None:
        raise CheckpointError(f"{path}: not an Orbax checkpoint written by gpt_oss_train")
    root, step = found
    if not os.path.isdir(os.path.join(root, str(step), META)):
        return {}
    mngr = _manager(root, read_only=True)
    try:
        return dict(
            mngr.restore(step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))[META]
        )
    finally:
        mngr.close()


def load_params(path: str, abstract_params) -> tuple[Any, dict, int]:
    """(params restored into the shardings of `abstract_params`, model config, step)."""
    found = find_step_dir(path)
    if found is None:
        raise CheckpointError(f"{path}: not an Orbax checkpoint written by gpt_oss_train")
    root, step = found
    arch = read_model_config(path)
    mngr = _manager(root, read_only=True)
    try:
        restored = mngr.restore(
            step, args=ocp.args.Composite(**{PARAMS: ocp.args.StandardRestore(abstract_params)})
        )
    except Exception as e:  # shape/structure mismatch: say which checkpoint
        raise CheckpointError(f"{root}/{step}: could not restore params ({e})") from e
    finally:
        mngr.close()
    return restored[PARAMS], arch, step


class TrainCheckpointer:
    """Saves and resumes a training run in `<workdir>/checkpoints`.

    Preemption: SIGTERM sets a flag (and Orbax's multi-host preemption sync point is
    consulted on TPU); `should_stop(step)` turns it into one decision every process agrees
    on, and the loop saves and exits cleanly.
    """

    def __init__(
        self,
        workdir: str,
        *,
        arch: dict,
        every: int,
        keep: int,
        async_save: bool = True,
        extra_meta: dict | None = None,
    ):
        self.directory = os.path.join(os.path.abspath(workdir), "checkpoints")
        self.arch = dict(arch)
        self.extra_meta = dict(extra_meta or {})  # more of `meta` (LoRA: spec and base)
        self.every = every
        found = find_step_dir(self.directory)
        if found is not None:
            # Check before creating a manager that could garbage-collect anything.
            check_same_architecture(read_model_config(self.directory), self.arch, self.directory)
        self._mngr = _manager(self.directory, keep=keep, async_save=async_save)
        self._sigterm = threading.Event()
        self._previous_handler = None

    def latest_step(self) -> int | None:
        return self._mngr.latest_step()

    def install_sigterm_handler(self):
        def handler(signum, frame):
            logging.warning("SIGTERM received: saving a checkpoint at the end of this step")
            self._sigterm.set()

        self._previous_handler = signal.signal(signal.SIGTERM, handler)

    def should_stop(self, step: int) -> bool:
        flag = self._sigterm.is_set()
        if jax.process_count() > 1:
            import numpy as np
            from jax.experimental import multihost_utils

            flag = bool(multihost_utils.process_allgather(np.array(flag)).any())
        return flag or self._mngr.reached_preemption(step)

    def save(self, step: int, params, opt_state, data_iterator, seed: int, *, force=False) -> bool:
        if not force and not (self.every and step % self.every == 0):
            return False
        meta = {"step": int(step), "seed": int(seed), "writer": "gpt_oss_train.train"}
        meta.update(self.extra_meta)
        import grain

        self._mngr.save(
            step,
            args=ocp.args.Composite(
                **{
                    MODEL_CONFIG: ocp.args.JsonSave(self.arch),
                    PARAMS: ocp.args.StandardSave(params),
                    OPT_STATE: ocp.args.StandardSave(opt_state),
                    META: ocp.args.JsonSave(meta),
                    DATA: grain.checkpoint.CheckpointSave(data_iterator),
                }
            ),
            force=True,
        )
        return True

    def restore(self, step: int, abstract_params, abstract_opt_state, data_iterator):
        import grain

        restored = self._mngr.restore(
            step,
            args=ocp.args.Composite(
                **{
                    PARAMS: ocp.args.StandardRestore(abstract_params),
                    OPT_STATE: ocp.args.StandardRestore(abstract_opt_state),
                    META: ocp.args.JsonRestore(),
                    DATA: grain.checkpoint.CheckpointRestore(data_iterator),
                }
            ),
        )
        return restored[PARAMS], restored[OPT_STATE], restored[META]

    def close(self):
        self._mngr.wait_until_finished()
        self._mngr.close()
        if self._previous_handler is not None:
            signal.signal(signal.SIGTERM, self._previous_handler)
