"""Configuration: defaults, model presets, and validation with one-line errors.

A config is an `ml_collections.ConfigDict` with these parts:

  config.model            the architecture (what a checkpoint carries with it)
  config.dtype ...        how to compute it (dtype, scan, remat, MoE strategy)
  config.kernels          which implementation of each operation (kernels/registry.py)
  config.mesh, mesh_dcn   device mesh sizes per axis (one may be -1)
  config.logical_axis_rules   logical array axis -> mesh axes
  config.train, config.data, config.checkpoint   the training job
  config.dpo, config.rl   DPO's and GRPO's settings (train.objective "dpo", "grpo")

`configs/*.py` are thin `get_config()` files over `default_config()`; any field can be
overridden from the command line (`--config.model.num_layers=4`).

Each name a field accepts is declared once, where it is owned (see "Names" below).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

import ml_collections

from gpt_oss_train import architecture, sharding
from gpt_oss_train import runtime as runtime_lib
from gpt_oss_train.architecture import LORA_TARGETS, PRESETS
from gpt_oss_train.errors import ConfigError
from gpt_oss_train.kernels import Kernels, registry
from gpt_oss_train.kernels.xla import attention as xla_attention
from gpt_oss_train.sharding import MESH_AXES

# Logical axis names used by the model, and the mesh axes they shard over by default.
# Parameters: vocab, embed, heads, kv_heads, head_dim, mlp, exp, layers.
# Activations: batch, length, act_embed (the model dimension of activations, kept apart
# from the parameters' `embed` so FSDP can shard weights without sharding activations
# twice over `fsdp`) and moe_batch (tokens inside the expert-parallel MoE, where the
# `expert` axis is busy with experts).
DEFAULT_RULES = (
    ("batch", ("data", "fsdp", "expert")),
    ("moe_batch", ("data", "fsdp")),
    ("length", "context"),  # a no-op at mesh.context=1
    ("act_embed", None),
    # Weights split over context as over fsdp (MaxText does the same): a layer's weights
    # are gathered for its step either way, and a long-context mesh (context 4-16) would
    # otherwise hold a whole copy of them on every context shard.
    ("embed", ("fsdp", "context")),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("exp", "expert"),
    ("layers", None),
    # The KV cache: rows like the batch, KV heads like the attention's, slots over the
    # context axis (a 131,072-slot cache split where one chip cannot hold it).
    ("cache_batch", ("data", "fsdp", "expert")),
    ("cache_length", "context"),
    ("cache_kv_heads", "tensor"),
    ("cache_head_dim", None),
)

# Names. This module sits above kernels and below the model (tests/e2e/test_layering.py), so a
# name list is declared once where its owner and this module can both see it: the kernels'
# names in kernels/registry.py; the model's registries of code (model/remat.POLICIES,
# model/moe.EXPERT_IMPLS) keep theirs and refuse an unknown config.remat_policy or
# config.moe_impl themselves when a ModelDef is made, before any compute; the lists that
# are plain data sit on a floor this module reads, below the model that takes them from
# there: BASE_FORMATS here (model/frozen_base.py), and architecture.LORA_TARGETS, the table
# of the weights LoRA can adapt, by which a LoraSpec orders its targets. So do the names
# of training's and post-training's options, declared here and read from here above: the
# objectives (training/objectives.py's OBJECTIVES table holds one entry for each, checked
# when it is imported), GRPO's averagings (training/rl_losses.py's AVERAGINGS) and the
# reasoning efforts (post_training/prompts.py checks a prompt's own against them).
DTYPES = ("float32", "bfloat16", "float16")
OBJECTIVES = ("lm", "dpo", "grpo")  # config.train.objective
GRPO_AVERAGINGS = ("sequence", "token", "dr_grpo")  # config.rl.averaging: TRL's loss_type names
REASONING_EFFORTS = ("low", "medium", "high")  # config.rl.reasoning_effort, Harmony's
# config.dtype may also be "auto": bfloat16 where the hardware multiplies it natively,
# float32 elsewhere (runtime.resolve_dtype, for the platform the program runs on); inference
# under "auto" also keeps the weights in that dtype (inference/loading.py).
COMPUTE_DTYPES = ("auto",) + DTYPES
# How a LoRA run stores its frozen base (model/frozen_base.py): as trained (param_dtype),
# bfloat16, int8 with a scale per output channel, or the published checkpoints' MXFP4
# experts (blocks + scales).
BASE_FORMATS = ("param_dtype", "bfloat16", "int8", "mxfp4")


def model_preset(name: str) -> ml_collections.ConfigDict:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    return ml_collections.ConfigDict(dict(PRESETS[name]))


def default_config() -> ml_collections.ConfigDict:
    """Every option, with defaults right for the common case."""
    c = ml_collections.ConfigDict()
    c.model = model_preset("tiny")

    # How to compute: parameters stored in param_dtype, matmuls in dtype; norms, softmax,
    # router, RoPE angles and the loss always run in float32.
    c.dtype = "auto"  # one of COMPUTE_DTYPES
    c.param_dtype = "float32"
    c.scan_layers = True  # lax.scan over 2-layer (banded, full) blocks
    c.remat_policy = "full"  # a name in model/remat.POLICIES
    c.attention_block = 512  # query block of the blockwise attention
    c.moe_impl = "ragged"  # a name in model/moe.EXPERT_IMPLS
    # moe_impl="sharded": > 0 runs each shard's rows in rounds of this multiple of its
    # share under balanced routing, buffers of that size (still exact: rounds past the
    # first run while rows are left); 0 sizes one pass for the worst routing (every pair
    # on one shard).
    c.moe_capacity_factor = 0.0
    c.moe_token_tile = 0  # > 0: the MoE runs in tiles of this many tokens (long context)
    c.seed = 0
    # Per operation: "auto" (the platform's default), "xla" (the reference) or the name of
    # an implementation in kernels/registry.py.
    c.kernels = ml_collections.ConfigDict({op: registry.AUTO for op in registry.OPS})

    c.mesh = ml_collections.ConfigDict(dict(data=1, fsdp=-1, context=1, tensor=1, expert=1))
    c.mesh_dcn = ml_collections.ConfigDict(dict(data=1, fsdp=1, context=1, tensor=1, expert=1))
    c.logical_axis_rules = DEFAULT_RULES

    c.train = _train_defaults()
    c.data = ml_collections.ConfigDict(
        dict(
            source="stdlib",  # see sources.py for the accepted forms
            eval_source="",  # "" with source=stdlib: a held-out slice of it
            shuffle=True,
            num_workers=0,  # grain worker processes (0: in the main process)
            max_docs=0,  # 0: all documents
        )
    )
    c.checkpoint = ml_collections.ConfigDict(
        dict(
            every=50,
            keep=3,
            async_save=True,
            init_from="",  # Orbax or HF dir: start from its params (fine-tuning)
            # Failed saves a run survives (each tried again at the next checkpoint step);
            # the one after them stops the run (exit 1). 0: stop at the first.
            max_failed_saves=0,
        )
    )
    c.dpo, c.rl = _post_training_defaults()
    # LoRA (off at rank 0): the base is frozen in base_format; only the adapters train.
    c.lora = ml_collections.ConfigDict(
        dict(
            rank=0,
            alpha=16.0,  # the adapters' output is scaled by alpha / rank
            targets="q,k,v,o,gate_up,down",  # any of LORA_TARGETS, comma-separated
            base_format="param_dtype",  # one of BASE_FORMATS
        )
    )
    return c


def _train_defaults() -> ml_collections.ConfigDict:
    """config.train: the objective, the batch, the optimizer and its schedule, the losses,
    and how often to log and evaluate."""
    return ml_collections.ConfigDict(
        dict(
            # "lm": next-token loss on the loss mask. "dpo": preference pairs (data source
            # pairs:PATH, two rows a pair) against a frozen reference policy (config.dpo).
            # "grpo": completions sampled from the policy and rewarded (config.rl).
            objective="lm",
            steps=100,
            global_batch_size=8,  # sequences per optimizer step, over all devices
            seq_len=256,
            grad_accum_steps=1,  # microbatches per step (global_batch_size splits into them)
            learning_rate=3e-4,
            warmup_steps=10,
            end_lr_ratio=0.1,  # cosine decays to learning_rate * end_lr_ratio
            b1=0.9,
            b2=0.95,
            eps=1e-8,
            weight_decay=0.1,
            grad_clip_norm=1.0,
            aux_loss_coef=0.01,  # MoE load balancing
            z_loss_coef=0.0,
            loss_chunk_size=1024,  # tokens per chunk of the vocabulary projection + loss
            # With the unembedding split over FSDP: gather it once for all loss chunks,
            # forward and backward, and reduce-scatter each chunk's gradient to its shard
            # (model/logprobs.py), instead of the partitioner's all-gather per chunk (and
            # again in the recompute) and all-reduce of whole gradients. The gathered matrix
            # stays in memory through the loss.
            loss_gather_once=False,
            log_every=10,
            eval_every=0,  # 0: no periodic eval
            eval_batches=4,
            peak_flops_per_device=0.0,  # 0: look it up from the device kind
            # A step whose loss or gradient norm is not finite is skipped (parameters and
            # optimizer state unchanged); this many in a row stop the run (exit 1).
            max_nonfinite_steps=5,
        )
    )


def _post_training_defaults() -> tuple[ml_collections.ConfigDict, ml_collections.ConfigDict]:
    """config.dpo and config.rl: the settings of train.objective "dpo" and "grpo"."""
    # Direct preference optimisation (train.objective="dpo"): the sigmoid loss of
    # -log sigmoid(beta * (chosen - rejected log-ratio to the reference)), with label
    # smoothing as cDPO. The reference is the base with the adapters off under LoRA, else
    # a frozen copy of the starting parameters.
    dpo = ml_collections.ConfigDict(dict(beta=0.1, label_smoothing=0.0))
    # GRPO (train.objective="grpo", post_training/rollouts.py): each step samples group_size
    # completions of global_batch_size / group_size prompts (data.source: a chat JSONL of
    # prompts, or rl:reasoning_gym:TASK) from the live policy, rewards them, and takes
    # num_iterations optimizer updates on the clipped objective with group-normalised
    # advantages.
    rl = ml_collections.ConfigDict(
        dict(
            group_size=4,  # completions per prompt
            max_prompt_tokens=256,  # longer prompts stop the run before the first rollout
            max_new_tokens=128,  # train.seq_len must hold both
            temperature=1.0,
            top_p=1.0,
            reasoning_effort="low",  # one of REASONING_EFFORTS, for prompts that name none
            # Reward functions "pkg.module:function,..." (built-ins: exact_answer, format);
            # "" takes the prompt source's own (rl:reasoning_gym:TASK's scorer).
            rewards="",
            reward_weights="",  # comma-separated, one per reward ("": all 1)
            scale_rewards=True,  # divide advantages by the group's std (False: Dr. GRPO)
            averaging="token",  # one of GRPO_AVERAGINGS (TRL's loss_type names)
            epsilon_low=0.2,
            epsilon_high=0.2,
            kl_coef=0.0,  # > 0: k3 KL to the reference (the base, adapters off, under LoRA)
            # Optimizer updates per rollout batch (TRL's num_iterations); from the second
            # on, the clipped ratio moves away from 1.
            num_iterations=1,
        )
    )
    return dpo, rl


def from_file(path: str, arg: str | None = None) -> ml_collections.ConfigDict:
    """The config a `configs/*.py` file's get_config() returns, as `--config=path[:arg]`
    would give it (for tests, notebooks and tools that are not absl apps)."""
    spec = importlib.util.spec_from_file_location("gpt_oss_train_config_file", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config() if arg is None else module.get_config(arg)


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """What adapters a model carries (model/lora.py builds them). Hashable: part of the
    (static) ModelConfig."""

    rank: int
    alpha: float
    targets: tuple[str, ...]
    adapters: int = 0  # 0: one adapter; n > 0: n stacked, chosen per batch row

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def stacked(self, n: int) -> "LoraSpec":
        """n adapters padded to this rank with their scales folded into B (scale 1)."""
        return dataclasses.replace(self, alpha=float(self.rank), adapters=n)

    def to_json(self) -> dict:
        return {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "LoraSpec":
        return cls(int(d["rank"]), float(d["alpha"]), parse_targets(d["targets"]))


def parse_targets(targets, field: str = "config.lora.targets") -> tuple[str, ...]:
    """ "q,v,gate_up" (or a sequence) -> ("q", "v", "gate_up") in declaration order."""
    choices = tuple(LORA_TARGETS)
    names = targets.split(",") if isinstance(targets, str) else list(targets)
    names = [n.strip() for n in names if n.strip()]
    unknown = [n for n in names if n not in LORA_TARGETS]
    if unknown:
        raise ConfigError(f"{field}: unknown LoRA target {unknown[0]!r}; choose from {choices}")
    if not names:
        raise ConfigError(f"{field}: no LoRA target given; choose from {choices}")
    return tuple(t for t in choices if t in names)


def spec_from_config(lora_config) -> LoraSpec | None:
    """The spec `config.lora` asks for; None when LoRA is off (rank 0)."""
    if not lora_config.rank:
        return None
    return LoraSpec(
        int(lora_config.rank), float(lora_config.alpha), parse_targets(lora_config.targets)
    )


def model_arch(config: ml_collections.ConfigDict) -> dict[str, Any]:
    """The architecture part of a config, as a plain dict (what checkpoints store)."""
    return {k: config.model[k] for k in architecture.FIELDS}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """What the model code reads: the architecture plus how to compute it. Hashable, so
    it can be a static argument of jitted functions."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    experts_per_token: int
    intermediate_size: int
    sliding_window: int
    rope_theta: float
    rope_scaling_factor: float
    rope_original_max_position: int
    rope_beta_fast: float
    rope_beta_slow: float
    rope_truncate: bool
    max_position_embeddings: int
    rms_norm_eps: float
    swiglu_limit: float
    swiglu_alpha: float = architecture.SWIGLU_ALPHA
    initializer_range: float = 0.02
    dtype: str = "bfloat16"
    param_dtype: str = "float32"
    scan_layers: bool = True
    remat_policy: str = "full"
    attention_block: int = 512
    moe_impl: str = "ragged"
    moe_capacity_factor: float = 0.0
    moe_token_tile: int = 0
    lora: LoraSpec | None = None  # adapters the network carries (None: none)
    kernels: Kernels = Kernels()  # the implementation of each operation ("auto": platform's)

    @property
    def num_blocks(self) -> int:
        return self.num_layers // 2

    @classmethod
    def from_config(
        cls,
        config: ml_collections.ConfigDict,
        arch: dict | None = None,
        platform: str | None = None,
    ) -> "ModelConfig":
        """`arch` (default config.model) computed as `config` says, on `platform` (default:
        sharding.platform(), the active mesh's) where "auto" choices depend on it."""
        arch = model_arch(config) if arch is None else arch
        # The other fields are the config's top-level settings of the same names.
        runtime = {f.name: config[f.name] for f in dataclasses.fields(cls) if f.name in config}
        runtime["dtype"] = runtime_lib.resolve_dtype(config.dtype, platform or sharding.platform())
        runtime["lora"] = spec_from_config(config.lora) if "lora" in config else None
        runtime["kernels"] = (
            Kernels.from_config(config.kernels) if "kernels" in config else Kernels()
        )
        return cls(**arch, **runtime)

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)


def _check(cond: bool, field: str, msg: str):
    if not cond:
        raise ConfigError(f"config.{field}: {msg}")


def validate(config: ml_collections.ConfigDict):
    """Checks a whole config before any compute. Raises ConfigError (one line). The names
    of the model's registries of code (remat_policy, moe_impl) are the model's to check,
    when a ModelDef is made ("Names" above)."""
    defaults = default_config()
    _check_known(config, defaults)
    architecture.validate(config.model.to_dict())
    sections = ("train", "data", "checkpoint", "mesh", "mesh_dcn", "lora", "kernels", "dpo", "rl")
    for section in sections:
        _check_known(config[section], defaults[section], f"{section}.")
    _validate_compute(config)
    for name in ("mesh", "mesh_dcn"):
        _validate_mesh(name, config[name])
    t = config.train
    _validate_train(t)
    _validate_context(config)
    if t.objective == "dpo":
        _validate_dpo(config.dpo, t)
    if t.objective == "grpo":
        _validate_rl(config.rl, t)
    _check(config.checkpoint.every >= 0, "checkpoint.every", "must be >= 0 (0: only at the end)")
    _check(config.checkpoint.max_failed_saves >= 0, "checkpoint.max_failed_saves", "must be >= 0")
    _check(config.checkpoint.keep >= 1, "checkpoint.keep", "must be >= 1")
    _validate_lora(config.lora)
    _check(
        config.model.max_position_embeddings >= t.seq_len,
        "train.seq_len",
        f"{t.seq_len} exceeds model.max_position_embeddings={config.model.max_position_embeddings}",
    )


def _check_known(given: ml_collections.ConfigDict, defaults, prefix: str = ""):
    """Every field of `given` (the config or one of its sections) is one `defaults` has."""
    valid = sorted(defaults.keys())
    for k in given.keys():
        _check(k in defaults, f"{prefix}{k}", f"unknown field; valid fields are {valid}")


def _validate_compute(config: ml_collections.ConfigDict):
    """The top-level settings of how to compute: dtypes, kernels, attention and MoE."""
    _check(
        config.dtype in COMPUTE_DTYPES, "dtype", f"{config.dtype!r} is not one of {COMPUTE_DTYPES}"
    )
    _check(
        config.moe_capacity_factor >= 0,
        "moe_capacity_factor",
        f"{config.moe_capacity_factor} must be >= 0 (0: one pass sized for the worst routing)",
    )
    _check(config.moe_token_tile >= 0, "moe_token_tile", "must be >= 0 (0: no tiling)")
    _check(
        config.param_dtype in DTYPES,
        "param_dtype",
        f"{config.param_dtype!r} is not one of {DTYPES}",
    )
    for op, name in config.kernels.items():
        registry.validate_choice(op, name)
    _check(config.attention_block > 0, "attention_block", "must be > 0")


def _validate_mesh(name: str, sizes: ml_collections.ConfigDict):
    """config.mesh (one axis may be -1: the devices left over) or config.mesh_dcn."""
    for ax in MESH_AXES:
        _check(ax in sizes, f"{name}.{ax}", "missing mesh axis")
        v = sizes[ax]
        _check(
            isinstance(v, int) and (v >= 1 or (v == -1 and name == "mesh")),
            f"{name}.{ax}",
            f"must be a positive integer{' or -1' if name == 'mesh' else ''}, got {v!r}",
        )
    _check(
        sum(1 for ax in MESH_AXES if sizes[ax] == -1) <= 1,
        name,
        "at most one axis may be -1 (it takes the devices left over)",
    )


def _validate_context(config: ml_collections.ConfigDict):
    """config.mesh.context > 1 cuts each training sequence into that many equal pieces,
    each at least as long as a banded layer's reach into the previous one. (A -1 context
    is sized by the devices and checked when the step is traced.)"""
    ways = config.mesh.context * config.mesh_dcn.context
    if ways <= 1:
        return
    seq_len = config.train.seq_len
    _check(
        seq_len % ways == 0,
        "mesh.context",
        f"{ways} pieces do not divide train.seq_len={seq_len}; make it a multiple",
    )
    reach = xla_attention.lead_keys(config.model.sliding_window)
    _check(
        seq_len // ways >= reach,
        "mesh.context",
        f"{ways} pieces of train.seq_len={seq_len} are {seq_len // ways} tokens, shorter than "
        f"the {reach} keys a banded layer reads from the previous piece; use fewer pieces or "
        "longer sequences",
    )


def _validate_train(t: ml_collections.ConfigDict):
    """config.train: the batch, the optimizer, the loss and the objective's name."""
    _check(t.steps > 0, "train.steps", f"must be > 0, got {t.steps}")
    _check(t.global_batch_size > 0, "train.global_batch_size", "must be > 0")
    _check(t.seq_len > 1, "train.seq_len", "must be > 1")
    _check(t.grad_accum_steps >= 1, "train.grad_accum_steps", "must be >= 1")
    _check(
        t.global_batch_size % t.grad_accum_steps == 0,
        "train.grad_accum_steps",
        f"global_batch_size={t.global_batch_size} is not divisible by "
        f"grad_accum_steps={t.grad_accum_steps}",
    )
    _check(t.learning_rate >= 0, "train.learning_rate", "must be >= 0")
    _check(0 <= t.warmup_steps, "train.warmup_steps", "must be >= 0")
    _check(0 <= t.end_lr_ratio <= 1, "train.end_lr_ratio", "must be in [0, 1]")
    _check(0 <= t.b1 < 1 and 0 <= t.b2 < 1, "train.b1", "b1 and b2 must be in [0, 1)")
    _check(t.grad_clip_norm >= 0, "train.grad_clip_norm", "must be >= 0 (0 disables)")
    _check(t.loss_chunk_size > 0, "train.loss_chunk_size", "must be > 0")
    _check(t.log_every > 0, "train.log_every", "must be > 0")
    _check(t.max_nonfinite_steps >= 1, "train.max_nonfinite_steps", "must be >= 1")
    _check(
        t.objective in OBJECTIVES, "train.objective", f"{t.objective!r} is not one of {OBJECTIVES}"
    )


def _validate_dpo(dpo: ml_collections.ConfigDict, t: ml_collections.ConfigDict):
    _check(dpo.beta > 0, "dpo.beta", f"must be > 0, got {dpo.beta}")
    _check(
        0 <= dpo.label_smoothing < 0.5,
        "dpo.label_smoothing",
        f"must be in [0, 0.5), got {dpo.label_smoothing}",
    )
    _check(
        t.global_batch_size % (2 * t.grad_accum_steps) == 0,
        "train.global_batch_size",
        f"{t.global_batch_size} rows must hold whole preference pairs (two rows each) "
        f"in each of the {t.grad_accum_steps} microbatches",
    )


def _validate_rl(rl: ml_collections.ConfigDict, t: ml_collections.ConfigDict):
    _check(
        isinstance(rl.group_size, int) and rl.group_size >= 2,
        "rl.group_size",
        f"must be an integer >= 2 (advantages compare completions of a prompt), got "
        f"{rl.group_size!r}",
    )
    _check(
        t.global_batch_size % rl.group_size == 0,
        "train.global_batch_size",
        f"{t.global_batch_size} rows must hold whole groups of rl.group_size={rl.group_size}",
    )
    _check(
        t.grad_accum_steps == 1,
        "train.grad_accum_steps",
        "GRPO takes its rollout batch in one step (grad_accum_steps=1)",
    )
    _check(
        rl.max_prompt_tokens > 0 and rl.max_new_tokens > 0,
        "rl.max_new_tokens",
        "rl.max_prompt_tokens and rl.max_new_tokens must be > 0",
    )
    _check(
        t.seq_len >= rl.max_prompt_tokens + rl.max_new_tokens,
        "train.seq_len",
        f"{t.seq_len} cannot hold rl.max_prompt_tokens + rl.max_new_tokens = "
        f"{rl.max_prompt_tokens + rl.max_new_tokens}",
    )
    _check(rl.temperature > 0, "rl.temperature", "must be > 0: a group needs different samples")
    _check(0 < rl.top_p <= 1, "rl.top_p", "must be in (0, 1]")
    _check(
        rl.averaging in GRPO_AVERAGINGS,
        "rl.averaging",
        f"{rl.averaging!r} is not one of {GRPO_AVERAGINGS}",
    )
    _check(rl.epsilon_low >= 0 and rl.epsilon_high >= 0, "rl.epsilon_low", "epsilons must be >= 0")
    _check(rl.kl_coef >= 0, "rl.kl_coef", "must be >= 0")
    _check(
        isinstance(rl.num_iterations, int) and rl.num_iterations >= 1,
        "rl.num_iterations",
        f"must be an integer >= 1, got {rl.num_iterations!r}",
    )
    *others, last = REASONING_EFFORTS
    _check(
        rl.reasoning_effort in REASONING_EFFORTS,
        "rl.reasoning_effort",
        f"must be {', '.join(others)} or {last}",
    )


def _validate_lora(c: ml_collections.ConfigDict):
    _check(isinstance(c.rank, int) and c.rank >= 0, "lora.rank", "must be >= 0 (0: no LoRA)")
    _check(c.alpha > 0, "lora.alpha", f"must be > 0, got {c.alpha}")
    _check(
        c.base_format in BASE_FORMATS,
        "lora.base_format",
        f"{c.base_format!r} is not one of {BASE_FORMATS}",
    )
    _check(
        c.rank > 0 or c.base_format == "param_dtype",
        "lora.base_format",
        f"a {c.base_format} base is frozen, so training it needs LoRA adapters: set "
        "config.lora.rank > 0 (or base_format=param_dtype for full fine-tuning)",
    )
    if c.rank:
        parse_targets(c.targets)
