"""Loading a model for inference: a checkpoint placed on a mesh, the run-time options
decoding shares, its limits, and the helpers that turn generated ids into text.

The decode command (decode/: cli.py, the JSONL modes in requests.py, chat, the
benchmarks) and the serving engine (engine.py) all start from `load_model`. The
architecture always comes from the checkpoint; the runtime config only says how to run
it (mesh, dtype, kernels).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from typing import Any, Sequence

import jax
from absl import flags, logging

from gpt_oss_train import architecture, runtime, sharding
from gpt_oss_train import config as config_lib
from gpt_oss_train.checkpoints import checkpoint as ckpt_lib
from gpt_oss_train.errors import UserError
from gpt_oss_train.inference import adapters as adapters_lib
from gpt_oss_train.inference.generate import Generator, SamplingParams
from gpt_oss_train.io import hf, storage
from gpt_oss_train.io import tokenizer as tok_lib
from gpt_oss_train.kernels import platforms
from gpt_oss_train.model import frozen_base, quantize
from gpt_oss_train.model.transformer import ModelDef

# Raw text ends on <|endoftext|> as well as Harmony's end-of-turn ids (HF's eos ids).
TEXT_STOP_IDS = tuple(sorted({tok_lib.ENDOFTEXT_ID, *tok_lib.Tokenizer.stop_ids}))


class DecodeError(UserError):
    """A flag, input or checkpoint that cannot be used; the message says which and why."""


def default_runtime_config():
    """The runtime used without --config: no remat (nothing is differentiated), ragged MoE,
    the platform's kernels, scanned layers, the default mesh (FSDP over every process's devices)."""
    c = config_lib.default_config()
    c.remat_policy = "none"
    c.moe_impl = "ragged"
    c.scan_layers = True
    return c


@dataclasses.dataclass(frozen=True)
class Options:
    """The run-time knobs shared by the modes (the CLI fills it from flags)."""

    max_new_tokens: int = 256
    sampling: SamplingParams = SamplingParams()
    seed: int = 0
    batch_size: int = 8
    prefill_chunk: int = 256
    int8_kv_cache: bool = False
    reasoning_effort: str = "medium"
    max_cache_len: int = 0  # 0: the model's max_position_embeddings
    show_analysis: bool = False


@functools.cache
def tokenizer() -> tok_lib.Tokenizer:
    return tok_lib.Tokenizer()


def checkpoint_kind(path: str) -> str:
    """'orbax' or 'hf'; anything else is refused here, before any compute."""
    if not path:
        raise DecodeError("--checkpoint is required: an Orbax checkpoint or a Hugging Face folder")
    if not storage.isdir(path):
        raise DecodeError(f"--checkpoint={path}: no such folder")
    if ckpt_lib.is_orbax_checkpoint(path):
        return "orbax"
    if storage.is_remote(path):
        raise DecodeError(
            f"--checkpoint={path}: no Orbax checkpoint there (a Hugging Face folder is read "
            "from local disk only)"
        )
    if os.path.isfile(os.path.join(path, "config.json")):
        return "hf"
    raise DecodeError(
        f"--checkpoint={path} is neither an Orbax checkpoint written by gpt_oss_train (a "
        "training workdir, its checkpoints/ folder, or a step folder with a model_config "
        "item) nor a Hugging Face gpt-oss folder (config.json + *.safetensors)"
    )


def read_architecture(path: str, kind: str) -> dict:
    try:
        arch = (
            ckpt_lib.read_model_config(path)
            if kind == "orbax"
            else hf.HFCheckpoint(path).model_config
        )
        arch = architecture.validate(arch)
    except (ValueError, OSError) as e:
        raise DecodeError(f"--checkpoint={path}: {e}") from None
    return arch


@dataclasses.dataclass
class LoadedModel:
    md: ModelDef
    params: Any
    mesh: jax.sharding.Mesh
    rules: tuple
    kind: str  # "orbax" | "hf" | "random"
    path: str
    config: Any  # the runtime config it was loaded with
    # LoRA adapters added to the base (inference/adapters.py), by name; with several (or
    # named ones) they are stacked and a request names its own (slot = index + 1).
    adapters: tuple[str, ...] = ()
    _compiled: dict = dataclasses.field(default_factory=dict)

    @property
    def cfg(self):
        return self.md.cfg

    def kept(self, key, make):
        """make(), made once per key and kept: compiled functions are reused by later calls
        on this model (chat turns, repeated runs in one process)."""
        if key not in self._compiled:
            self._compiled[key] = make()
        return self._compiled[key]

    def generator(self, prefill_chunk: int, int8_kv_cache: bool, on_token=None) -> Generator:
        """The Generator for these settings (kept)."""
        return self.kept(
            ("generator", prefill_chunk, int8_kv_cache, on_token),
            lambda: Generator(
                self.md,
                self.params,
                prefill_chunk=prefill_chunk,
                int8_kv_cache=int8_kv_cache,
                on_token=on_token,
            ),
        )

    def scope(self):
        """Model calls trace under this: activations are constrained to the mesh."""
        return sharding.use_mesh(self.mesh, self.rules)


def define_weights_flag():
    """decode's and serve's --weights: load_model's `weights`."""
    flags.DEFINE_enum(
        "weights",
        "param_dtype",
        list(frozen_base.FORMATS),
        "Keep the weights as: param_dtype (the runtime config's), bfloat16, int8, or mxfp4 "
        "(the experts as MXFP4 blocks and scales, as the published checkpoints store them, "
        "decoded inside the layers; the other matrices bfloat16).",
    )


def runtime_config(config=None, dtype: str | None = None):
    config = default_runtime_config() if config is None else config
    if dtype:
        config = config.copy_and_resolve_references()
        config.dtype = dtype
    config_lib.validate(config)
    return config


_UNITS = ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB"), (1, "B"))


def _in_units_of(whole: int):
    """n -> '48.1 MiB', in the largest unit that leaves `whole` at 10 or more."""
    unit, name = next((u for u in _UNITS if whole >= 10 * u[0]), _UNITS[-1])
    return lambda n: f"{n / unit:.1f} {name}"


def held_bytes(params) -> tuple[int, int]:
    """(bytes of the distinct shards this process's devices hold, bytes of the whole
    model): a replicated shard counts once per process."""
    held = total = 0
    for a in jax.tree.leaves(params):
        total += a.nbytes
        seen = set()
        for shard in a.addressable_shards:
            index = tuple(s.indices(n) for s, n in zip(shard.index, a.shape))
            if index not in seen:
                seen.add(index)
                held += shard.data.nbytes
    return held, total


def _loaded_line(kind: str, path: str, seconds: float, params, read) -> str:
    """The log line that says the model is here and what this process took of it. `read`:
    an hf.ReadCount (bytes read from the files, of the bytes the model takes from them),
    an int (bytes TensorStore read: said beside the bytes of the shards held) or None."""
    what = f"Loaded {kind} model {path}" if path else f"Made {kind} model"
    if hasattr(read, "total"):
        size = _in_units_of(read.total)
        took = f"read {size(read.read)} of {size(read.total)}"
    else:
        held, total = held_bytes(params)
        size = _in_units_of(total)
        took = f"holds {size(held)} of {size(total)}"
    line = f"{what} in {seconds:.1f} s: this process {took} (its devices' shards)"
    if isinstance(read, int):
        line += f"; TensorStore read {size(read)}"
    return line


def _place(
    config, arch: dict, read_params, kind, path, int8_weights: bool, devices=None, adapters=()
):
    """A LoadedModel whose params `read_params(model_def, mesh, rules)` creates on the
    mesh of the runtime config (over `devices`, default every process's), int8-quantized
    if asked, with `adapters` ([(name, folder)]) beside the base. read_params returns
    (params, what it read: see _loaded_line)."""
    rules = sharding.validate_rules(config.logical_axis_rules)
    devices = jax.devices() if devices is None else devices
    mesh = sharding.make_mesh(config.mesh, config.mesh_dcn, devices=devices)
    platform = sharding.platform(mesh)
    if config.dtype == "auto":
        # The platform's compute dtype, and the weights kept in it, as vLLM serves: a
        # decode step is bound by reading the weights, and the CPU kernels read bfloat16
        # ones at half float32's bytes.
        config = config.copy_and_resolve_references()
        config.dtype = config.param_dtype = runtime.resolve_dtype("auto", platform)
    # The adapters, not the runtime config, say what LoRA the model carries.
    cfg = config_lib.ModelConfig.from_config(config, arch, platform).replace(lora=None)
    md = ModelDef(cfg)
    cfg.kernels.check(platform)
    logging.info(
        "Loading %s model %s: compute %s, mesh %s", kind, path, md.cfg.dtype, dict(mesh.shape)
    )
    start = time.perf_counter()
    params, read = read_params(md, mesh, rules)
    logging.info("%s", _loaded_line(kind, path, time.perf_counter() - start, params, read))
    model = LoadedModel(md, params, mesh, rules, kind, path, config)
    if int8_weights:
        with model.scope():
            model.params = jax.jit(quantize.quantize_params)(model.params)
    if adapters:
        adapters_lib.attach(model, adapters)
    platforms.place_weights(model.params, platform)
    logging.info("%s", cfg.kernels.describe(platform))
    return model


def load_model(
    path: str,
    config=None,
    *,
    dtype: str | None = None,
    int8_weights: bool = False,
    devices=None,
    adapters: Sequence[tuple[str, str]] = (),
    weights: str = "param_dtype",
) -> LoadedModel:
    """The checkpoint's parameters, placed on the mesh of the runtime config (over
    `devices`, default every process's), with LoRA `adapters` [(name, folder)] beside them
    (name "": the one adapter every request uses). `weights`: the form they are kept in
    (frozen_base.FORMATS): "param_dtype" as the runtime config says, else "bfloat16",
    "int8" or "mxfp4" (the experts as the published checkpoints store them, decoded
    inside the layer scan: a quarter of bfloat16's bytes), read straight into it."""
    if weights not in frozen_base.FORMATS:
        raise DecodeError(f"--weights={weights}: choose one of {', '.join(frozen_base.FORMATS)}")
    if weights != "param_dtype" and int8_weights:
        raise DecodeError("--int8_weights and --weights: give one (--weights=int8 is the former)")
    config = runtime_config(config, dtype)
    kind = checkpoint_kind(path)
    arch = read_architecture(path, kind)

    def read(md, mesh, rules):
        dense = md.abstract_params(mesh, rules)
        packed = (
            None if weights == "param_dtype" else frozen_base.abstract(dense, weights, mesh, rules)
        )
        try:
            if kind == "orbax":
                before = ckpt_lib.storage_bytes_read()
                params = ckpt_lib.load_params(path, dense)[0]
                after = ckpt_lib.storage_bytes_read()
                took = None if before is None else after - before
            else:
                took = hf.ReadCount()
                targets = (
                    dense if packed is None else frozen_base.read_targets(dense, weights, packed)
                )
                params = hf.load_sharded(path, targets, took)
        except (ValueError, OSError) as e:
            raise DecodeError(f"--checkpoint={path}: {e}") from None
        if packed is not None:
            with sharding.use_mesh(mesh, rules):
                params = frozen_base.place(params, weights, packed)
        return params, took

    return _place(
        config, arch, read, kind, storage.normalize(path), int8_weights, devices, adapters
    )


def random_model(config=None, *, int8_weights: bool = False, devices=None) -> LoadedModel:
    """config.model's architecture with random parameters (seed config.seed): for
    benchmarks and capacity planning, no checkpoint needed."""
    config = runtime_config(config)
    arch = architecture.validate(config_lib.model_arch(config))

    def init(md, mesh, rules):
        return md.init(config.seed, mesh, rules), None

    return _place(config, arch, init, "random", "", int8_weights, devices)


def cache_limit(max_positions: int, opts: Options) -> int:
    """The most positions a sequence may use: --max_cache_len, else the model's
    max_position_embeddings (`max_positions`)."""
    if opts.max_cache_len > max_positions:
        raise DecodeError(
            f"--max_cache_len={opts.max_cache_len} exceeds the model's "
            f"max_position_embeddings={max_positions}"
        )
    return opts.max_cache_len or max_positions


def pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def batch_rows(n: int, batch_size: int) -> int:
    """Rows of a compiled call for n requests: padding to a power of two (at most
    batch_size) keeps the number of compiled shapes small."""
    return min(batch_size, pow2_at_least(n))


def prefill_chunk_for(prefill_chunk: int, longest: int) -> int:
    """A chunk no longer than the longest prompt needs: short prompts are not padded to a
    256-token chunk (prefill cost is the padded length)."""
    return min(prefill_chunk, max(16, pow2_at_least(longest)))


def stop_slots(stop_ids: Sequence[int], multiple: int = 4) -> list[int]:
    """Stop ids padded with distinct negative ids (never generated) to a multiple of 4.
    The decode loop is compiled per number of stop ids; this way Harmony's 2, raw text's
    3 and most per-line lists share one compiled loop. (Distinct, because the Generator
    drops duplicates.)"""
    ids = sorted(set(stop_ids))
    pad = -len(ids) % multiple
    return ids + list(range(-1, -pad - 1, -1))


def completion_text(tokens: list[int], stop_reason: str) -> str | None:
    body = tokens[:-1] if stop_reason == "stop" and tokens else tokens
    try:
        return tokenizer().decode(body)
    except ValueError:  # ids the o200k_harmony vocabulary does not have (toy models)
        return None
