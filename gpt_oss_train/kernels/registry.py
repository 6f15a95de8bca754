"""The table of operations and their implementations, by platform.

Every operation has an XLA reference (`xla`: plain jax, any platform, the numbers the
others are tested against) and may have platform kernels that compute the same thing
faster. An implementation is named by "module:function" under gpt_oss_train.kernels and
imported on first use, so this table is cheap to read (config.py validates names with it)
and the Pallas GPU modules load only where they are chosen.

Choosing, once per program (`resolve`): `config.kernels.<op>` is "auto" (the platform's
default below), "xla" or an implementation's name. A name that cannot run on the platform
is a config error; a kernel this machine cannot provide (no C++ compiler, a CPU without
the instructions, `GPT_OSS_TRAIN_CPU_KERNELS=0`) leaves the reference in its place, and
the start-up line says why. Calling (`kernels.Kernels`): the chosen implementation runs
where it takes the operands (`accepts`: dtypes, shapes, a one-device mesh, ...) and the
reference runs otherwise.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Callable

from gpt_oss_train.errors import ConfigError
from gpt_oss_train.kernels.gpu import interpret

PLATFORMS = ("cpu", "gpu", "tpu")
ANY = frozenset(PLATFORMS)
AUTO, REFERENCE = "auto", "xla"


def _load(path: str) -> Callable:
    module, name = path.split(":")
    return getattr(importlib.import_module(f"gpt_oss_train.kernels.{module}"), name)


@dataclasses.dataclass(frozen=True)
class Impl:
    """One implementation of an operation. `fn`, `accepts` and `unavailable` are
    "module:function" paths: fn(*operands) computes the op; accepts(*operands) -> bool
    says whether it takes these operands (default: all); unavailable(platform) -> None or
    the reason this machine cannot run it (checked once, before compiling)."""

    name: str
    platforms: frozenset[str]
    fn: str
    accepts: str | None = None
    unavailable: str | None = None
    # "module:function", (dtype, stack) -> bool: whether the model should hand this weight
    # stack to the implementation as layer views it reads in place (arrays/layer_views.py)
    reads_in_place: str | None = None
    # attention: "module:function", the per-shard kernel of a sequence the rules split
    # (`local` of kernels/xla/context_parallel.py); None: the XLA one runs there
    context_parallel: str | None = None
    # moe_decode: also runs inside the expert-parallel shard_map (the `sharded` MoE's local
    # experts, kernels/xla/expert_parallel.py), on one shard's rows sorted by local expert.
    # Set where that was built and checked for: the TPU kernel, for the serving configs;
    # the CPU and GPU kernels are not measured there (their platforms' grouped matmuls run)
    per_shard: bool = False

    def call(self, *args, **kwargs):
        return _load(self.fn)(*args, **kwargs)

    def takes(self, *args, **kwargs) -> bool:
        return self.accepts is None or bool(_load(self.accepts)(*args, **kwargs))

    def why_unavailable(self, platform: str) -> str | None:
        return None if self.unavailable is None else _load(self.unavailable)(platform)

    def split_kernel(self) -> Callable | None:
        return None if self.context_parallel is None else _load(self.context_parallel)

    def reads_stack(self, dtype, stack) -> bool:
        return self.reads_in_place is not None and bool(_load(self.reads_in_place)(dtype, stack))


@dataclasses.dataclass(frozen=True)
class Op:
    name: str
    summary: str
    impls: tuple[Impl, ...]  # the first is the XLA reference
    defaults: tuple[tuple[str, str], ...] = ()  # (platform, the implementation "auto" picks)

    @property
    def reference(self) -> Impl:
        return self.impls[0]

    def impl(self, name: str) -> Impl:
        return next(i for i in self.impls if i.name == name)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(i.name for i in self.impls)

    def default(self, platform: str) -> str:
        return dict(self.defaults).get(platform, REFERENCE)


def _cpu(module: str, fn: str, **extra) -> Impl:
    """A C++ kernel: its module under cpu/ says which operands it takes and whether this
    machine built it."""
    path = f"cpu.{module}"
    return Impl(
        "cpu", frozenset({"cpu"}), f"{path}:{fn}", f"{path}:accepts", f"{path}:unavailable", **extra
    )


GPU, TPU = frozenset({"gpu"}), frozenset({"tpu"})

# Not formatted (a registry table: an Op an entry, an Impl a line; ruff would spread
# each Impl over up to six lines).
# fmt: off
OPS: dict[str, Op] = {op.name: op for op in (
    Op("attention",
       "self-attention with sinks over whole sequences (training, prefill), fwd + bwd",
       (Impl("xla", ANY, "xla.attention:self_attention"),
        Impl("blockwise", ANY, "xla.attention:blockwise_self_attention"),
        _cpu("self_attention", "self_attention"),
        Impl("flash", GPU, "gpu.flash_attention:self_attention",
             unavailable="gpu.flash_attention:unavailable"),
        Impl("splash", TPU, "tpu.splash_attention:self_attention",
             "tpu.splash_attention:accepts",
             context_parallel="tpu.splash_attention:context_parallel")),
       (("cpu", "cpu"), ("tpu", "splash"))),
    Op("cache_attention",
       "a step's queries over one layer of the stacked KV cache (decode, prefill chunks)",
       (Impl("xla", ANY, "xla.attention:cache_attention"),
        _cpu("decode_attention", "cache_attention")),
       (("cpu", "cpu"),)),
    Op("grouped_matmul",
       "the MoE's rows-grouped-by-expert matmul, fwd + dx + dW",
       (Impl("xla", ANY, "xla.grouped_matmul:tiled"),
        _cpu("grouped_matmul", "grouped_matmul",
             reads_in_place="cpu.grouped_matmul:reads_in_place"),
        Impl("mosaic_gpu", GPU, "gpu.grouped_matmul:grouped_matmul",
             "gpu.grouped_matmul:accepts"),
        Impl("ragged_dot", TPU, "tpu.ragged_dot:grouped_matmul"),
        Impl("megablox", TPU, "tpu.megablox:grouped_matmul", "tpu.megablox:accepts")),
       (("cpu", "cpu"), ("gpu", "mosaic_gpu"), ("tpu", "megablox"))),
    Op("gated_activation",
       "the experts' clamped SwiGLU with their biases, fwd + bwd",
       (Impl("xla", ANY, "xla.experts:gated_activation"),
        _cpu("glu", "gated_activation"),
        Impl("pallas", TPU, "tpu.glu:gated_activation", "tpu.glu:accepts")),
       (("cpu", "cpu"), ("tpu", "pallas"))),
    Op("moe_decode",
       "a decode-sized batch through its chosen experts only (declines larger batches)",
       (Impl("xla", ANY, "xla.experts:moe_decode", "xla.experts:moe_decode_accepts"),
        _cpu("moe_decode", "moe_decode"),
        Impl("pallas_gpu", GPU, "gpu.moe_decode:moe_decode", "gpu.moe_decode:accepts",
             "gpu.moe_decode:unavailable"),
        Impl("pallas_tpu", TPU, "tpu.mxfp4_experts:moe_decode", "tpu.mxfp4_experts:accepts",
             per_shard=True)),
       (("cpu", "cpu"),)),
    Op("expert_parallel",
       "tokens to the shards of their experts and back (inside shard_map), fwd + bwd",
       (Impl("xla", ANY, "xla.expert_parallel:gather"),
        Impl("all_to_all", ANY, "xla.expert_parallel:all_to_all",
             "xla.expert_parallel:all_to_all_accepts")),
       (("tpu", "all_to_all"),)),
    Op("matmul",
       "projections and the unembedding: x times a (layer of a) weight, fwd + bwd",
       (Impl("xla", ANY, "xla.matmul:matmul"),
        _cpu("matmul", "matmul")),
       (("cpu", "cpu"),)),
    Op("cross_entropy",
       "a loss chunk's logits, log-sum-exp and target log-probability, fwd + bwd",
       (Impl("xla", ANY, "xla.cross_entropy:chunk_logprobs"),
        _cpu("cross_entropy", "chunk_logprobs")),
       (("cpu", "cpu"),)),
    Op("optimizer_update",
       "the optimizer's step on the summed gradients (AdamW: one pass per parameter)",
       (Impl("xla", ANY, "xla.optimizer:update"),
        _cpu("fused_adamw", "update")),
       (("cpu", "cpu"),)),
)}
# fmt: on


def choices_of(op: str) -> tuple[str, ...]:
    """What config.kernels.<op> accepts."""
    return (AUTO, *OPS[op].names)


def validate_choice(op: str, name: str) -> None:
    """One line, naming the field and the choices, for an unknown op or name."""
    if op not in OPS:
        raise ConfigError(f"config.kernels.{op}: unknown operation; operations are {tuple(OPS)}")
    if name not in choices_of(op):
        raise ConfigError(f"config.kernels.{op}: {name!r} is not one of {choices_of(op)}")


def chosen(op: str, choice: str, platform: str) -> Impl:
    """The implementation config value `choice` names for `platform`, before asking this
    machine whether it can run it; a ConfigError where it cannot run on the platform.
    Cheap (builds nothing): what commands check before any expensive work."""
    validate_choice(op, choice)
    entry = OPS[op]
    impl = entry.impl(entry.default(platform) if choice == AUTO else choice)
    if platform not in impl.platforms and not _interpreted(impl):
        raise ConfigError(
            f"config.kernels.{op}={impl.name!r} runs on {sorted(impl.platforms)}, not on this "
            f"program's {platform}; use 'auto' or 'xla'"
        )
    return impl


def resolve(op: str, choice: str, platform: str) -> tuple[Impl, str]:
    """(the implementation that runs `op` on `platform` for config value `choice`, and
    why it is not the one asked for: "" when it is). Builds a CPU kernel on first use."""
    impl = chosen(op, choice, platform)
    reason = _unavailable(op, impl.name, platform)
    if reason:
        return OPS[op].reference, f"{impl.name}: {reason}"
    return impl, ""


@functools.lru_cache(maxsize=None)
def _unavailable(op: str, name: str, platform: str) -> str | None:
    """Checked once per process: a C++ build, CPU flags."""
    return OPS[op].impl(name).why_unavailable(platform)


def _interpreted(impl: Impl) -> bool:
    """Pallas GPU kernels also run on any platform in interpret mode (CPU tests)."""
    if impl.fn.startswith("gpu."):
        return interpret.interpreting()
    return False
