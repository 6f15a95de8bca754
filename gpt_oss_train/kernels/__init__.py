"""Kernels: the operations the model, the loss and the optimizer compute, called by name.

Model code holds a `Kernels` (ModelConfig.kernels, made from `config.kernels`) and calls
its operations: `kernels.attention(...)`, `kernels.grouped_matmul(...)`. Which
implementation runs is decided here, never by the caller: from the platform of the mesh
the program is traced for (`sharding.platform()`, so an ahead-of-time compile for a TPU
on a CPU host picks TPU kernels) and the config's choice per operation, "auto" by default.
registry.py holds the table and the rules; xla/ the references; cpu/, gpu/, tpu/ the
platform kernels; platforms.py the platforms' layout facts (what is not a kernel).

    python -m gpt_oss_train.train ... --config.kernels.grouped_matmul=xla   # one op
"""

from __future__ import annotations

import dataclasses
import functools

from absl import logging

from gpt_oss_train import sharding
from gpt_oss_train.kernels import registry
from gpt_oss_train.kernels.registry import AUTO, OPS, REFERENCE
from gpt_oss_train.kernels.xla import context_parallel


@dataclasses.dataclass(frozen=True)
class Kernels:
    """The config's choice per operation ("auto" where not named). Hashable: a static
    part of ModelConfig, so a jitted function traced with one choice is never reused
    for another."""

    choices: tuple[tuple[str, str], ...] = ()

    def __post_init__(self):
        for op, name in self.choices:
            registry.validate_choice(op, name)

    @classmethod
    def of(cls, **choices: str) -> "Kernels":
        """Kernels(attention="xla", ...); unnamed operations stay "auto"."""
        return cls(tuple(sorted((op, name) for op, name in choices.items() if name != AUTO)))

    @classmethod
    def from_config(cls, section) -> "Kernels":
        """From `config.kernels` (a ConfigDict of op -> name)."""
        return cls.of(**dict(section))

    @classmethod
    def everywhere(cls, name: str) -> "Kernels":
        """The same choice for every operation ("xla": the references only)."""
        return cls.of(**{op: name for op in OPS})

    def choice(self, op: str) -> str:
        return dict(self.choices).get(op, AUTO)

    def impl(self, op: str, platform: str | None = None) -> registry.Impl:
        """The implementation that runs `op` on `platform` (default: the one being traced
        for); a kernel this machine cannot build leaves the reference, logged once."""
        impl, why = registry.resolve(op, self.choice(op), platform or sharding.platform())
        if why:
            _log_once(f"kernels: {op} takes {REFERENCE} ({why})")
        return impl

    def _run(self, op: str, *args, **kwargs):
        impl = self.impl(op)
        if impl is not OPS[op].reference and impl.takes(*args, **kwargs):
            return impl.call(*args, **kwargs)
        return OPS[op].reference.call(*args, **kwargs)

    # ------------------------------------------------------------------ the operations

    def attention(self, q, k, v, sinks, *, positions, segment_ids, window, block=512):
        """Self-attention over whole sequences (training, prefill): q [b, s, n, h], k/v
        [b, s, kh, h], sinks [n], positions and segment ids [b, s] (0: padding); `window`
        None for full causal layers; `block`: the blockwise variant's query block. Where the
        rules split the sequence over devices (mesh.context > 1), context parallelism runs
        (kernels/xla/context_parallel.py), each shard the chosen kernel's split kernel
        (splash's) where it has one, else the XLA one."""
        if axes := context_parallel.length_axes(q.shape[1], window):
            local = self._split_attention()
            _log_once(
                f"kernels: attention over sequences split on {axes}: context parallel, "
                f"each shard by {local.__module__.rsplit('.', 1)[1] if local else 'xla'}"
            )
            return context_parallel.attention(
                q,
                k,
                v,
                sinks,
                positions=positions,
                segment_ids=segment_ids,
                window=window,
                block=block,
                local=local or context_parallel.blockwise,
            )
        return self._run(
            "attention",
            q,
            k,
            v,
            sinks,
            positions=positions,
            segment_ids=segment_ids,
            window=window,
            block=block,
        )

    def _split_attention(self):
        """The chosen attention's per-shard kernel for split sequences, or None. Only one
        that has such a kernel is resolved: resolving a CPU kernel builds it."""
        platform = sharding.platform()
        if registry.chosen("attention", self.choice("attention"), platform).context_parallel:
            return self.impl("attention", platform).split_kernel()
        return None

    def cache_attention(self, q, cache, layer, sinks, *, positions, window):
        """q [b, s, n, h] at `positions` over layer `layer` of the stacked KV cache, whose
        keys for these positions are already written."""
        return self._run(
            "cache_attention", q, cache, layer, sinks, positions=positions, window=window
        )

    def grouped_matmul(self, x, w, group_sizes, out_dtype=None):
        """x [M, K] times w[g] [K, N] for each group g's contiguous rows -> [M, N],
        accumulated in float32 and written in it, or in `out_dtype`. Rows past
        sum(group_sizes) are undefined (megablox leaves them unwritten); their gradient
        is zero."""
        return self._run("grouped_matmul", x, w, group_sizes, out_dtype=out_dtype)

    def gated_activation(self, gate, up, bias_gate, bias_up, experts, *, limit, alpha, dtype):
        """The experts' clamped SwiGLU of gate/up [R, F] (float32, or the compute dtype)
        plus each row's expert's biases -> the activation in `dtype`."""
        return self._run(
            "gated_activation",
            gate,
            up,
            bias_gate,
            bias_up,
            experts,
            limit=limit,
            alpha=alpha,
            dtype=dtype,
        )

    def moe_decode(self, x, weights, idx, w, *, limit, alpha, dtype):
        """A decode-sized batch through its chosen experts only, float32 [T, D]; None when
        the batch is too large for every implementation (then grouped matmuls run)."""
        op, kw = OPS["moe_decode"], dict(limit=limit, alpha=alpha, dtype=dtype)
        for impl in (self.impl("moe_decode"), op.reference):
            if impl.takes(x, weights, idx, w, **kw):
                return impl.call(x, weights, idx, w, **kw)
        return None

    def moe_decode_per_shard(self, x, weights, idx, w, *, limit, alpha, dtype):
        """`moe_decode` inside the expert-parallel shard_map, on one shard's rows and local
        experts: the chosen implementation where the registry says it runs there
        (Impl.per_shard) and it takes these operands; else None (grouped matmuls run).
        Only such an implementation is resolved: resolving a CPU kernel builds it."""
        platform = sharding.platform()
        if not registry.chosen("moe_decode", self.choice("moe_decode"), platform).per_shard:
            return None
        impl, kw = self.impl("moe_decode", platform), dict(limit=limit, alpha=alpha, dtype=dtype)
        if not impl.takes(x, weights, idx, w, **kw):
            return None
        return impl.call(x, weights, idx, w, **kw)

    def expert_parallel(
        self,
        experts,
        x,
        wts,
        idx,
        *,
        local_e,
        expert_axes,
        token_axes,
        mlp_axes,
        out_bias,
        capacity_factor=0.0,
    ):
        """Inside shard_map: this device's tokens x [t, d] (weights, experts [t, k]) through
        their experts, sharded `local_e` a device over `expert_axes`, by
        `experts(rows, key, group_sizes)` (kernels/xla/expert_parallel.py) plus each local
        expert's `out_bias` [local_e, d] -> float32 [t, d], summed over the tensor
        (`mlp_axes`) shards. capacity_factor > 0: rows in rounds of that multiple of a
        shard's balanced share (config.moe_capacity_factor)."""
        return self._run(
            "expert_parallel",
            experts,
            x,
            wts,
            idx,
            local_e=local_e,
            expert_axes=expert_axes,
            token_axes=token_axes,
            mlp_axes=mlp_axes,
            out_bias=out_bias,
            capacity_factor=capacity_factor,
        )

    def matmul(self, spec, x, w, *, dtype):
        """einsum(spec, x, w) in `dtype`, float32 results: x's dimensions after [b, s]
        contract with w's leading ones (w may be a layer view)."""
        return self._run("matmul", spec, x, w, dtype=dtype)

    def cross_entropy(self, h, w, targets):
        """A loss chunk: (log p(target), log-sum-exp) [b, c] of h [b, c, d] @ w [d, v]."""
        return self._run("cross_entropy", h, w, targets)

    def optimizer_update(self, tx, t, schedule, decays, grads, n, grad_norm, params, opt_state):
        """(params, opt_state) after one step (kernels/xla/optimizer.py)."""
        return self._run(
            "optimizer_update", tx, t, schedule, decays, grads, n, grad_norm, params, opt_state
        )

    def reads_in_place(self, dtype, stack) -> bool:
        """Whether the grouped matmul that runs reads layers of this weight stack in place
        (the model then hands it layer views, arrays/layer_views.py)."""
        return self.impl("grouped_matmul").reads_stack(dtype, stack)

    def check(self, platform: str) -> None:
        """A ConfigError (one line) where a chosen kernel cannot run on `platform`; builds
        nothing, so commands call it before any expensive work."""
        for op in OPS:
            registry.chosen(op, self.choice(op), platform)

    def describe(self, platform: str) -> str:
        """The start-up line: `kernels: attention=cpu grouped_matmul=cpu ...`, with why a
        chosen kernel is not the one that runs."""
        parts = []
        for op in OPS:
            impl, why = registry.resolve(op, self.choice(op), platform)
            parts.append(f"{op}={impl.name}" + (f" ({why})" if why else ""))
        return f"kernels on {platform}: " + " ".join(parts)


AUTO_KERNELS = Kernels()


@functools.lru_cache(maxsize=None)
def _log_once(message: str) -> None:
    logging.info(message)
