"""Orbax checkpoints: training state, data-iterator state and the model config together.

A checkpoint is a step folder `<dir>/<step>/` holding named items:

  model_config   JSON: the architecture (architecture.FIELDS), so decode and fine-tuning
                 rebuild the exact network with no flags
  params         the parameter tree (sharded arrays; restored straight into shardings)
  opt_state      optimizer state                       (training checkpoints only)
  meta           JSON: step, seed, and what wrote it   (training checkpoints only)
  data           the grain iterator's position, one    (training checkpoints only)
                 process_<i>-of-<n>.json per process

and `file_sizes.json` (integrity.py), written once the save has finished. Folders may be
local or gs:// (io/storage.py). `tools/convert_checkpoint.py` writes the first two items;
`train` writes all five, in `<workdir>/checkpoints`.

What is never lost: a save is atomic (Orbax); a failed save is reported as soon as it
finishes and its partial folder removed (the previous checkpoints are untouched); a
restore checks the files first and falls back to the newest step that restores, moving a
damaged step to `<workdir>/damaged_checkpoints/` (never deleting it).
"""

from __future__ import annotations

import json
import re
import signal
import threading
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from absl import logging
from jax.experimental import multihost_utils

from gpt_oss_train import architecture
from gpt_oss_train.checkpoints import integrity
from gpt_oss_train.errors import UserError
from gpt_oss_train.io import storage

MODEL_CONFIG = "model_config"
PARAMS = "params"
OPT_STATE = "opt_state"
META = "meta"
DATA = "data"
ALL_ITEMS = (MODEL_CONFIG, PARAMS, OPT_STATE, META, DATA)
DAMAGED_DIR = "damaged_checkpoints"
# The entry of `meta` a LoRA adapter checkpoint carries: its spec and the base's reference
# (training/lora.py writes it; inference/adapters.py and tools/export_lora.py read it).
LORA_META_KEY = "lora"


class CheckpointError(UserError):
    """A checkpoint that cannot be used as asked; the message names the folder."""


def _manager(
    directory: str, *, keep: int | None = None, async_save: bool = True, read_only: bool = False
) -> ocp.CheckpointManager:
    # create=False: the folder appears with the first save, so a run that fails before it
    # leaves no empty checkpoints/ behind.
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, enable_async_checkpointing=async_save, create=False, read_only=read_only
    )
    return ocp.CheckpointManager(storage.as_epath(directory), options=options, item_names=ALL_ITEMS)


def is_orbax_checkpoint(path: str) -> bool:
    """A checkpoint root (step folders inside) or one step folder of it."""
    return find_step_dir(path) is not None


def _steps(root: str) -> list[int]:
    """The steps under a checkpoint root that hold a model config, newest first."""
    if not storage.isdir(root):
        return []
    names = storage.listdir(root)
    return sorted(
        (
            int(n)
            for n in names
            if n.isdigit() and storage.isdir(storage.join(root, n, MODEL_CONFIG))
        ),
        reverse=True,
    )


def find_step_dir(path: str) -> tuple[str, int] | None:
    """(root directory, step) for the latest step under `path`: accepts a training workdir,
    its `checkpoints/` folder, a converted checkpoint root, or a step folder itself."""
    path = storage.normalize(path)
    for root in (storage.join(path, "checkpoints"), path):
        steps = _steps(root)
        if steps:
            return root, steps[0]
    name = storage.basename(path)
    if name.isdigit() and storage.isdir(storage.join(path, MODEL_CONFIG)):
        return storage.dirname(path), int(name)
    return None


def read_model_config(path: str) -> dict[str, Any]:
    """The architecture stored with a checkpoint (no arrays are read): a step folder's
    own; for a workdir or checkpoint root, the newest step's whose model config reads (a
    damaged newer step is skipped here as load_params skips it)."""
    found = find_step_dir(path)
    if found is None:
        raise CheckpointError(f"{path}: no Orbax checkpoint with a model config found here")
    root, newest = found
    named = storage.basename(storage.normalize(path)) == str(newest)
    for step in [newest] if named else _steps(root):
        arch = _stored_model_config(root, step)
        if arch is not None:
            if step != newest:
                logging.warning(
                    "The model config of step %d under %s is unreadable; reading step %d's",
                    newest,
                    root,
                    step,
                )
            return arch
    item_dir = storage.join(root, str(newest), MODEL_CONFIG)
    raise CheckpointError(f"{item_dir}: model config JSON not found or unreadable")


def _stored_model_config(root: str, step: int) -> dict[str, Any] | None:
    """The architecture stored with step `step` under `root`, validated; None where its
    JSON cannot be found or read (a damaged step)."""
    item_dir = storage.join(root, str(step), MODEL_CONFIG)
    try:
        files = [f for f in storage.listdir(item_dir) if f.endswith(".json") or "metadata" in f]
    except FileNotFoundError:
        return None
    for name in files:
        try:
            data = json.loads(storage.read_text(storage.join(item_dir, name)))
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        if isinstance(data, dict) and "hidden_size" in data:
            return architecture.from_json(json.dumps(data), item_dir)
    return None


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
    if jax.process_index() == 0:
        integrity.record(storage.join(directory, str(step)))


def first_line(e: BaseException, limit: int = 400) -> str:
    """The first line of an exception's message, cut to `limit` characters."""
    text = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return text if len(text) <= limit else text[: limit - 3] + "..."


def innermost(e: BaseException) -> BaseException:
    """The exception at the bottom of a chain: Orbax wraps TensorStore's error (which
    names the item folder and the array) in one that does not."""
    while e.__cause__ is not None or (e.__context__ is not None and not e.__suppress_context__):
        e = e.__cause__ or e.__context__
    return e


def _agree(problem: str | None) -> str | None:
    """A problem any process found, on every process (restores read different shards)."""
    if jax.process_count() == 1:
        return problem

    found = multihost_utils.process_allgather(np.array(problem is not None))
    if problem is None and found.any():
        return f"process {int(np.argmax(found))} could not read it (its log says which file)"
    return problem


def _newest_that_restores(root: str, steps: list[int], restore_one) -> tuple[int, Any] | None:
    """(step, restore_one(step)) for the newest of `steps` whose files check out and that
    restores; each damaged one is logged loudly on the way. Raises CheckpointError when
    there are checkpoints but none restores. restore_one may raise CheckpointError for a
    problem that is not damage (it propagates)."""
    damaged = []
    for step in steps:
        try:
            result = restore_one(step)
            problem = None
        except CheckpointError:
            raise
        except Exception as e:  # TensorStore, JSON, grain: whatever a damaged file causes
            result, problem = None, first_line(innermost(e))
        problem = _agree(problem)
        if problem is None:
            return step, result
        damaged.append(step)
        logging.error(
            "CHECKPOINT DAMAGED: step %d in %s cannot be restored: %s. Trying the previous "
            "checkpoint; this one is kept for inspection.",
            step,
            root,
            problem,
        )
    if damaged:
        raise CheckpointError(
            f"{root}: no checkpoint can be restored (damaged steps {damaged}; the log names "
            "each file). Nothing was changed; move them away to start afresh"
        )
    return None


def read_meta(path: str) -> dict[str, Any]:
    """The `meta` item of the newest checkpoint under `path` ({} if it has none)."""
    found = find_step_dir(path)
    if found is None:
        raise CheckpointError(f"{path}: not an Orbax checkpoint written by gpt_oss_train")
    root, step = found
    if not storage.isdir(storage.join(root, str(step), META)):
        return {}
    mngr = _manager(root, read_only=True)
    try:
        return dict(
            mngr.restore(step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))[META]
        )
    finally:
        mngr.close()


def load_params(path: str, abstract_params) -> tuple[Any, dict, int]:
    """(params restored into the shardings of `abstract_params`, model config, step). For a
    workdir or checkpoint root: the newest step whose params restore (damaged ones are
    logged and skipped, never changed); for a step folder: that step."""
    found = find_step_dir(path)
    if found is None:
        raise CheckpointError(f"{path}: not an Orbax checkpoint written by gpt_oss_train")
    root, newest = found
    arch = read_model_config(path)
    named = storage.basename(storage.normalize(path)) == str(newest)
    mngr = _manager(root, read_only=True)

    def restore_one(step):
        problem = integrity.problem(storage.join(root, str(step)), (MODEL_CONFIG, PARAMS))
        if problem:
            raise ValueError(problem)
        args = ocp.args.Composite(**{PARAMS: ocp.args.StandardRestore(abstract_params)})
        return mngr.restore(step, args=args)[PARAMS]

    try:
        if named:  # the user asked for this step: no fallback
            try:
                return restore_one(newest), arch, newest
            except Exception as e:  # shape/structure mismatch or damage: say which
                raise CheckpointError(
                    f"{root}/{newest}: could not restore params ({first_line(innermost(e))})"
                ) from None
        step, params = _newest_that_restores(root, _steps(root), restore_one)
        return params, arch, step
    finally:
        mngr.close()


# TensorStore's storage drivers (under Orbax's OCDBT layer, which has no byte count of
# its own): what each has read from files or object stores.
_STORAGE_DRIVERS = ("file", "gcs", "gcs_grpc", "s3", "http")


def storage_bytes_read() -> int | None:
    """Bytes TensorStore (Orbax's storage layer) has read in this process so far, over all
    its storage drivers; the difference around a restore is what the restore read (Orbax
    reads only the chunks under this process's shards, where TensorStore merges nearby
    reads into one). None where TensorStore keeps no metrics."""
    try:
        metrics = ts.experimental_collect_matching_metrics("/tensorstore/kvstore/")
    except (ImportError, AttributeError):
        return None
    wanted = {f"/tensorstore/kvstore/{d}/bytes_read" for d in _STORAGE_DRIVERS}
    return sum(int(v.get("value", 0)) for m in metrics if m["name"] in wanted for v in m["values"])


# ----------------------------------------------------------------------------- training


def _root_cause(e: BaseException) -> str:
    """The innermost cause of a failed save, cut to its last clause: TensorStore's
    'RESOURCE_EXHAUSTED: Error writing ...: Failed to write N bytes: No space left on
    device [os_error_code=28]' becomes 'No space left on device'."""
    text = first_line(innermost(e), limit=10_000)
    text = re.sub(r"\s*\[os_error_code=[^\]]*\]", "", text)
    return first_line(ValueError(text.rsplit(": ", 1)[-1] if len(text) > 200 else text))


class TrainCheckpointer:
    """Saves and resumes a training run in `<workdir>/checkpoints`.

    Saves: `save` starts one (asynchronous unless async_save=False); `poll()` each step
    notices when it has finished, records its file sizes, or turns its failure into
    `self.failure` (one line) after removing the partial folder. `wait()` blocks for it.

    Preemption: SIGTERM sets a flag (and Orbax's multi-host preemption sync point is
    consulted on TPU); `stop_requested(step)` reports it, and the loop, once every process
    agrees, saves and exits cleanly.
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
        self.workdir = storage.normalize(workdir)
        self.directory = storage.join(self.workdir, "checkpoints")
        self.arch = dict(arch)
        self.extra_meta = dict(extra_meta or {})  # more of `meta` (LoRA: spec and base)
        self.every = every
        self._keep, self._async = keep, async_save
        # Check before creating a manager that could garbage-collect anything: a step of
        # another model refuses the workdir, each step judged by its own model config (one
        # whose config cannot be read is damaged: restore_newest falls back past it).
        for step in _steps(self.directory):
            stored = _stored_model_config(self.directory, step)
            if stored is not None:
                self._check_architecture(step, stored)
        self._mngr = _manager(self.directory, keep=keep, async_save=async_save)
        self._saving: int | None = None  # the step of the save under way
        self.failure: str | None = None  # the last failed save, one line
        self._sigterm = threading.Event()
        self._previous_handler = None

    def _check_architecture(self, step: int, stored: dict) -> None:
        """CheckpointError (a refusal, not damage) if `step` holds another model."""
        check_same_architecture(stored, self.arch, storage.join(self.directory, str(step)))

    def latest_step(self) -> int | None:
        return self._mngr.latest_step()

    # -- preemption -------------------------------------------------------------------

    def install_sigterm_handler(self):
        def handler(signum, frame):
            also = " (every process must reach it)" if jax.process_count() > 1 else ""
            logging.warning(
                "SIGTERM received: a checkpoint will be saved at the end of this step%s", also
            )
            self._sigterm.set()

        self._previous_handler = signal.signal(signal.SIGTERM, handler)

    def stop_requested(self, step: int) -> bool:
        """This process got SIGTERM, or a preemption sync point (TPU) is reached."""
        return self._sigterm.is_set() or self._mngr.reached_preemption(step)

    # -- saving -----------------------------------------------------------------------

    def due(self, step: int) -> bool:
        """Whether `step` is a checkpoint step (every `every` steps)."""
        return bool(self.every and step % self.every == 0)

    def save(
        self, step: int, params, opt_state, data_iterator, seed: int, *, force=False, meta=None
    ) -> bool:
        """Starts saving `step` if it is due (or `force`); whether it started."""
        if not (force or self.due(step)):
            return False
        meta = {
            "step": int(step),
            "seed": int(seed),
            "writer": "gpt_oss_train.train",
            **self.extra_meta,
            **(meta or {}),
        }
        import grain  # lazy: start-up (~0.25 s; serve never saves)

        args = ocp.args.Composite(
            **{
                MODEL_CONFIG: ocp.args.JsonSave(self.arch),
                PARAMS: ocp.args.StandardSave(params),
                OPT_STATE: ocp.args.StandardSave(opt_state),
                META: ocp.args.JsonSave(meta),
                DATA: grain.checkpoint.CheckpointSave(data_iterator),
            }
        )
        if self._saving is not None:
            # The previous save is still under way: settle it first (Orbax would wait for
            # it inside save() anyway), so its step gets its integrity record.
            self._settle()
        cannot_write = _agree(self._cannot_write())
        if cannot_write:
            self._fail(step, cannot_write)
            return False
        try:
            self._mngr.save(step, args=args, force=True)
        except Exception as e:  # a synchronous save, or the previous one, failed
            self._fail(step if self._saving is None else self._saving, _root_cause(e), e)
            return False
        self._saving = step
        if not self._async:
            self._settle()
        return True

    def poll(self) -> None:
        """Notices, without waiting, a save that has finished (see the class docstring)."""
        if self._saving is not None and not self._mngr.is_saving_in_progress():
            self._settle()

    def wait(self) -> None:
        """Waits for the save under way to finish (see the class docstring)."""
        if self._saving is not None:
            self._settle()

    def _settle(self) -> None:
        step, self._saving = self._saving, None
        try:
            self._mngr.wait_until_finished()
        except Exception as e:
            self._fail(step, _root_cause(e), e)
            return
        if jax.process_index() == 0:
            integrity.record(storage.join(self.directory, str(step)))

    def _cannot_write(self) -> str | None:
        """Why this process cannot write into the checkpoint folder, or None. Checked before
        each save: when Orbax cannot create a step folder (a read-only disk), its other
        threads wait 300 s for that folder before the save fails."""
        probe = storage.join(self.directory, f".write_probe.{jax.process_index()}")
        try:
            storage.makedirs(self.directory)
            storage.write_atomic(probe, b"")
            storage.remove(probe)
        except OSError as e:
            return e.strerror or first_line(e)
        return None

    def _fail(self, step: int, cause: str, e: BaseException | None = None) -> None:
        """Records a failed save, removes what it left, and starts a fresh manager (Orbax's
        raises the same error again at every later call)."""
        if e is not None:
            logging.info("Checkpoint save of step %d failed: %s", step, first_line(e, 2000))
        self.failure = f"saving checkpoint step {step} to {self.directory} failed: {cause}"
        self._mngr = _manager(self.directory, keep=self._keep, async_save=self._async)
        if jax.process_index() == 0:
            self._remove_partial(step)

    def _remove_partial(self, step: int) -> None:
        """The temporary folders of a failed save (and on object storage, where Orbax
        writes in place, the step folder if it was never finalized)."""
        if not storage.isdir(self.directory):
            return
        finalized = set(self._mngr.all_steps())
        for name in storage.listdir(self.directory):
            partial = name.startswith(f"{step}.") and "tmp" in name
            if partial or (name == str(step) and step not in finalized):
                try:
                    storage.rmtree(storage.join(self.directory, name), missing_ok=True)
                    logging.info("Removed the partial checkpoint %s", name)
                except OSError as e:
                    logging.error("Could not remove the partial checkpoint %s: %s", name, e)

    # -- restoring --------------------------------------------------------------------

    def restore(
        self, step: int, abstract_params, abstract_opt_state, data_iterator, *, whole_batches=False
    ):
        """(params, opt_state, meta) of `step`, its files and its model config checked first
        (CheckpointError if it holds another model); the data iterator is set to the saved
        position (see `_data_state`)."""
        step_dir = storage.join(self.directory, str(step))
        problem = integrity.problem(step_dir, ALL_ITEMS)
        if problem:
            raise ValueError(problem)
        stored = _stored_model_config(self.directory, step)  # this step's own architecture
        if stored is None:
            raise ValueError(f"{MODEL_CONFIG}/: model config JSON not found or unreadable")
        self._check_architecture(step, stored)
        data_file = self._data_state_file(step_dir, whole_batches)
        state = json.loads(storage.read_text(data_file))
        restored = self._mngr.restore(
            step,
            args=ocp.args.Composite(
                **{
                    PARAMS: ocp.args.StandardRestore(abstract_params),
                    OPT_STATE: ocp.args.StandardRestore(abstract_opt_state),
                    META: ocp.args.JsonRestore(),
                }
            ),
        )
        data_iterator.set_state(state)
        return restored[PARAMS], restored[OPT_STATE], restored[META]

    def _data_state_file(self, step_dir: str, whole_batches: bool) -> str:
        """This process's iterator state. A pipeline whose every process reads the whole
        batch (whole_batches) has the same state on all, so a checkpoint of any process
        count serves; a per-process pipeline needs the same count."""
        folder = storage.join(step_dir, DATA)
        names = [n for n in storage.listdir(folder) if re.fullmatch(r"process_\d+-of-\d+\.json", n)]
        if not names:
            raise ValueError(f"{DATA}/: no iterator state")
        counts = {int(re.search(r"-of-(\d+)", n).group(1)) for n in names}
        i, n = jax.process_index(), jax.process_count()
        if whole_batches:
            return storage.join(folder, f"process_0-of-{max(counts)}.json")
        if counts != {n}:
            raise CheckpointError(
                f"{step_dir} was written by {max(counts)} processes and this run has {n}: "
                "this data source is read per process, so its position cannot move to another "
                "process count. Resume with the same count, or pre-tokenize the corpus "
                "(python -m gpt_oss_train.tools.pretokenize), whose order is the same on any count"
            )
        return storage.join(folder, f"process_{i}-of-{n}.json")

    def restore_newest(self, abstract_params, abstract_opt_state, data_iterator, **kw):
        """(step, (params, opt_state, meta)) of the newest checkpoint that restores, or None
        when there is none. Damaged ones are logged loudly and moved to
        <workdir>/damaged_checkpoints/ once an older one has restored."""
        steps = sorted(self._mngr.all_steps(), reverse=True)
        restore_one = lambda s: self.restore(
            s, abstract_params, abstract_opt_state, data_iterator, **kw
        )
        found = _newest_that_restores(self.directory, steps, restore_one)
        if found is not None:
            self._set_aside([s for s in steps if s > found[0]])
        return found

    def _set_aside(self, steps: list[int]) -> None:
        """Moves damaged steps out of Orbax's sight: a new save of the same step, or the
        keep-N rotation, would otherwise replace or delete them."""
        if not steps:
            return
        if jax.process_index() == 0:
            for step in steps:
                target = storage.join(self.workdir, DAMAGED_DIR, str(step))
                k = 1
                while storage.exists(target):
                    k += 1
                    target = storage.join(self.workdir, DAMAGED_DIR, f"{step}-{k}")
                storage.move(storage.join(self.directory, str(step)), target)
                logging.error("CHECKPOINT DAMAGED: step %d moved to %s (not deleted)", step, target)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("gpt_oss_train:damaged_checkpoints_moved")
        self._mngr.reload()

    def close(self):
        """Waits for the save under way; then `self.failure` says whether it failed."""
        self.wait()
        try:
            self._mngr.close()
        finally:
            if self._previous_handler is not None:
                signal.signal(signal.SIGTERM, self._previous_handler)
