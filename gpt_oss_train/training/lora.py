"""LoRA training: the frozen base a run holds beside its adapters, where it comes from,
and what an adapter checkpoint records about it.

The train state of a LoRA run is the usual {"step", "params", "opt_state"} with
`params` the adapters only, so gradients, optimizer state and checkpoints cover the
adapters alone. The base (a `FrozenBase`) is an extra, non-donated argument of the
jitted step, bound by `WithFrozen` so train.py, tools/aot_compile.py and
tools/bench_model.py call the step as they call a full fine-tuning one. It is loaded once,
in its format, from `checkpoint.init_from` (an HF folder, MXFP4 experts read as blocks,
never dequantized on the host; or an Orbax checkpoint) or made from `config.seed`.
"""

from __future__ import annotations

import jax
from flax import nnx

from gpt_oss_train import sharding
from gpt_oss_train.checkpoints import checkpoint as ckpt_lib
from gpt_oss_train.checkpoints.checkpoint import LORA_META_KEY
from gpt_oss_train.errors import ConfigError
from gpt_oss_train.io import hf, storage
from gpt_oss_train.model import frozen_base, lora
from gpt_oss_train.model.transformer import ModelDef, Transformer


class FrozenBase:
    """A LoRA run's base: its abstract tree in the config's format, with shardings, and
    the arrays, read on first use."""

    def __init__(self, config, model_def: ModelDef, mesh, rules):
        self.format = config.lora.base_format
        init_from = config.checkpoint.init_from
        self.source = storage.normalize(init_from) if init_from else ""
        self.seed = int(config.seed)
        self.mesh, self.rules = mesh, rules
        self.dense_def = ModelDef(model_def.cfg.replace(lora=None))
        self.dense = self.dense_def.abstract_params(mesh, rules)
        self.abstract = frozen_base.abstract(self.dense, self.format, mesh, rules)
        self.shardings = frozen_base.shardings(self.abstract)
        self._arrays = None

    def arrays(self):
        if self._arrays is None:
            self._arrays = self.load()
        return self._arrays

    def load(self, dense=None):
        """The base in its format, from `dense` (a loaded param tree) or its source."""
        with sharding.use_mesh(self.mesh, self.rules):
            tree = self._read() if dense is None else dense
            return frozen_base.place(tree, self.format, self.abstract)

    def _read(self):
        if not self.source:
            return self.dense_def.init(self.seed, self.mesh, self.rules)
        if ckpt_lib.is_orbax_checkpoint(self.source):
            return ckpt_lib.load_params(self.source, self.dense)[0]
        targets = frozen_base.read_targets(self.dense, self.format, self.abstract)
        return hf.load_sharded(self.source, targets)

    def reference(self) -> dict:
        """What an adapter checkpoint records about its base."""
        return {"source": self.source, "seed": self.seed, "format": self.format}


class WithFrozen:
    """A jitted fn(*args, frozen) called as fn(*args): the base is bound here."""

    def __init__(self, fn, base: FrozenBase):
        self.fn, self.base = fn, base

    def __call__(self, *args):
        return self.fn(*args, self.base.arrays())

    def lower(self, *args):
        return self.fn.lower(*args, self.base.abstract)


def init_adapters(model_def: ModelDef, seed: int, mesh, rules, shardings) -> dict:
    """Fresh adapters (A random, B zero: the adapted model starts as the base), created
    under jit straight into their shardings; the base's initialisers are dead code there."""
    cfg = model_def.cfg

    def make():
        return lora.split(nnx.state(Transformer(cfg, rngs=nnx.Rngs(seed))).to_pure_dict())[1]

    with sharding.use_mesh(mesh, rules):
        return jax.jit(make, out_shardings=shardings)()


# ----------------------------------------------------------------------------- checkpoints


def checkpoint_meta(setup) -> dict:
    """The `meta` entries an adapter checkpoint carries: the spec and the base's reference."""
    if setup.frozen is None:
        return {}
    return {LORA_META_KEY: {**setup.model_cfg.lora.to_json(), "base": setup.frozen.reference()}}


def check_workdir(ckpt: ckpt_lib.TrainCheckpointer, setup):
    """A workdir's newest checkpoint must be of the same kind (adapters of the same rank
    and targets, or full parameters) as this run trains; checked before any restore."""
    step = ckpt.latest_step()
    if step is None:
        return
    stored = ckpt_lib.read_meta(ckpt.directory).get(LORA_META_KEY)
    wanted = checkpoint_meta(setup).get(LORA_META_KEY)
    describe = lambda m: "full parameters" if not m else f"rank-{m['rank']} LoRA on {m['targets']}"
    if (stored is None) != (wanted is None) or (
        stored and (stored["rank"], list(stored["targets"])) != (wanted["rank"], wanted["targets"])
    ):
        raise ConfigError(
            f"{ckpt.directory} holds {describe(stored)} at step {step} but config.lora asks "
            f"for {describe(wanted)}: use a new --workdir or the checkpoint's settings"
        )
