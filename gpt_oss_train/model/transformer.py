"""The GPT-OSS network in Flax NNX.

    tokens -> embed -> [ (banded layer, full layer) x num_layers/2 ] -> RMSNorm -> unembed

Each layer is pre-norm: x += attn(norm(x)); x += moe(norm(x)). Even layers (0, 2, ...)
attend to the last `sliding_window` keys including the current one, odd layers to all
earlier keys. The two layers of a pair form a `Block`; blocks are stacked on a leading
`layers` axis and run under `jax.lax.scan` (or a Python loop: same parameters, same
numbers), each block under `jax.checkpoint` with the configured remat policy. Where the
platform streams weights (CPU inference) the expert matrices and attention projections
stay out of the scan and each block reads what it uses from the stacks
(streamed_weights.py).

Every parameter carries logical axis names (`out_sharding` metadata) and activations are
constrained by logical names through `sharding.constrain`; no mesh axis is named here.
Attention, the projections and the experts' products are the kernel registry's
operations (`cfg.kernels`, gpt_oss_train/kernels/): which implementation runs is never
decided here.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx

from gpt_oss_train import sharding
from gpt_oss_train.config import ModelConfig
from gpt_oss_train.kernels.xla import attention as xla_attention
from gpt_oss_train.model import embedding, kv_cache, lora, parameters, remat, streamed_weights
from gpt_oss_train.model import moe as moe_lib

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def _init(kind: str, std: float):
    if kind == "normal":
        return lambda key, shape, dtype: std * jax.random.normal(key, shape, dtype)
    return lambda key, shape, dtype: (jnp.zeros if kind == "zeros" else jnp.ones)(shape, dtype)


def _param(cfg: ModelConfig, p: parameters.Param, shape, axes, rngs) -> nnx.Param:
    init = _init(p.init, cfg.initializer_range)
    value = init(rngs.params() if rngs is not None else None, shape, DTYPES[cfg.param_dtype])
    # eager_sharding=False: the logical names are mapped to the mesh by our own rules when
    # the parameters are created under jit (see `ModelDef.init`), not by NNX.
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


def declared_params(cfg: ModelConfig, prefix: str, rngs: nnx.Rngs | None) -> dict[str, nnx.Param]:
    """The parameters params.py declares for one module ("attn", "moe", "final_norm", ...),
    created with their initializers and tagged with their logical axes; with cfg.lora, the
    module's adapters too."""
    sizes = parameters.dim_sizes(cfg)
    out = {
        leaf: _param(cfg, p, parameters.shape(p.dims, sizes), p.axes, rngs)
        for leaf, p in parameters.group(prefix).items()
    }
    for leaf, p in lora.module_decls(cfg.lora, prefix).items():
        shape, axes = lora.leaf_shape(p, cfg, cfg.lora), lora.leaf_axes(p, cfg.lora)
        out[leaf] = _param(cfg, p, shape, axes, rngs)
    return out


# ----------------------------------------------------------------------------- RoPE


def rope_frequencies(cfg: ModelConfig) -> tuple[np.ndarray, float]:
    """YaRN "NTK-by-parts" inverse frequencies [head_dim/2] and the attention scaling that
    multiplies cos and sin. Bounds are not rounded unless rope_truncate (gpt-oss: not)."""
    dim = cfg.head_dim
    base = cfg.rope_theta
    factor = cfg.rope_scaling_factor
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    if factor <= 1.0:
        return (1.0 / pos_freqs).astype(np.float32), 1.0

    def correction_dim(rotations):
        return (
            dim
            * math.log(cfg.rope_original_max_position / (rotations * 2 * math.pi))
            / (2 * math.log(base))
        )

    low, high = correction_dim(cfg.rope_beta_fast), correction_dim(cfg.rope_beta_slow)
    if cfg.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    extrapolation = 1.0 - ramp  # 1: keep the original frequency (fast dims), 0: interpolate
    inv_freq = (1.0 / (factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * extrapolation
    return inv_freq.astype(np.float32), 0.1 * math.log(factor) + 1.0


def rope_tables(cfg: ModelConfig, positions):
    """cos, sin [b, s, head_dim/2] in float32 (angles in float32, as the reference)."""
    inv_freq, scaling = rope_frequencies(cfg)
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    return jnp.cos(angles) * scaling, jnp.sin(angles) * scaling


def apply_rope(x_bsnh, cos, sin):
    """Rotate-half (NeoX) pairing: dims i and i + head_dim/2 rotate together."""
    x = x_bsnh.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x_bsnh.dtype)


# ----------------------------------------------------------------------------- layers


class RMSNorm(nnx.Module):
    def __init__(self, cfg: ModelConfig, name: str, *, rngs: nnx.Rngs):
        self.eps = cfg.rms_norm_eps
        self.scale = declared_params(cfg, name, rngs)["scale"]

    def __call__(self, x, dtype):
        x = x.astype(jnp.float32)
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        return (x * self.scale[...].astype(jnp.float32)).astype(dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        for name, param in declared_params(cfg, "attn", rngs).items():
            setattr(self, name, param)

    def adapted(self, target: str, x, adapter_ids):
        """The LoRA adapter's term for `target` (float32), or 0 when it is not adapted."""
        spec = self.cfg.lora
        if spec is None or target not in spec.targets:
            return 0.0
        a, b = getattr(self, f"lora_{target}_a")[...], getattr(self, f"lora_{target}_b")[...]
        return spec.scale * lora.delta(x, a, b, dtype=DTYPES[self.cfg.dtype], rows=adapter_ids)

    def __call__(
        self,
        x_bsd,
        rope,
        positions,
        segment_ids,
        window,
        cache: kv_cache.KVCache | None,
        layer=None,
        adapter_ids=None,
    ):
        cfg = self.cfg
        dt, kernels = DTYPES[cfg.dtype], cfg.kernels

        def proj(kernel, bias, target):
            y = kernels.matmul("bsd,dnh->bsnh", x_bsd, kernel[...], dtype=dt)
            y = y + self.adapted(target, x_bsd, adapter_ids)
            return (y + bias[...].astype(jnp.float32)).astype(dt)

        q = apply_rope(proj(self.q_kernel, self.q_bias, "q"), *rope)
        k = apply_rope(proj(self.k_kernel, self.k_bias, "k"), *rope)
        v = proj(self.v_kernel, self.v_bias, "v")
        q = sharding.constrain(q, ("batch", "length", "heads", "head_dim"))
        k = sharding.constrain(k, ("batch", "length", "kv_heads", "head_dim"))
        v = sharding.constrain(v, ("batch", "length", "kv_heads", "head_dim"))

        sinks = self.sinks[...]
        if cache is None:
            out = kernels.attention(
                q,
                k,
                v,
                sinks,
                positions=positions,
                segment_ids=segment_ids,
                window=window,
                block=cfg.attention_block,
            )
            new_cache = None
        elif window is None or q.shape[1] <= cache.pos.shape[2] - window + 1:
            # Write first, then attend over every cached slot of the layer. A banded
            # layer's ring may be written first too when the chunk cannot overwrite a key
            # that one of its queries still needs (chunk <= ring - window + 1).
            new_cache = kv_cache.write(cache, layer, k, v, positions)
            out = kernels.cache_attention(
                q, new_cache, layer, sinks, positions=positions, window=window
            )
        else:
            out, new_cache = _long_chunk_over_ring(q, k, v, sinks, cache, layer, positions, window)

        y = kernels.matmul("bsnh,nhd->bsd", out.astype(dt), self.o_kernel[...], dtype=dt)
        y = y + self.adapted("o", out.astype(dt), adapter_ids)
        y = y + self.o_bias[...].astype(jnp.float32)
        return y.astype(dt), new_cache


def _long_chunk_over_ring(q, k, v, sinks, cache, layer, positions, window):
    """A banded layer's chunk longer than the gap to its oldest needed key: attend over the
    ring as it was plus the new chunk, so every query still sees every key, then write the
    chunk (the ring has at least as many slots as the longest chunk)."""
    ring = kv_cache.layer_of(cache, layer)
    ring_k, ring_v = ring.keys_values(q.dtype)
    keys = jnp.concatenate([ring_k, k.astype(ring_k.dtype)], axis=1)
    vals = jnp.concatenate([ring_v, v.astype(ring_v.dtype)], axis=1)
    kpos = jnp.concatenate([ring.pos, positions.astype(jnp.int32)], axis=1)
    mask = xla_attention.visibility_mask(positions, kpos, window=window)
    out = xla_attention.xla_attention(q, keys, vals, sinks, mask)
    return out, kv_cache.write(cache, layer, k, v, positions)


class MoE(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        for name, param in declared_params(cfg, "moe", rngs).items():
            setattr(self, name, param)

    def router_delta(self, x_bsd, adapter_ids):
        """The router adapter's logits term [b*s, E] (float32, as routing), or None."""
        spec = self.cfg.lora
        if spec is None or "router" not in spec.targets:
            return None
        a, b = self.lora_router_a[...], self.lora_router_b[...]
        d = spec.scale * lora.delta(x_bsd, a, b, dtype=jnp.float32, rows=adapter_ids)
        return d.reshape(-1, d.shape[-1])

    def expert_lora(self, adapter_ids, seq_len: int) -> moe_lib.ExpertLoRA | None:
        """The experts' adapters, their scale folded into B; None when not adapted."""
        spec = self.cfg.lora
        if spec is None or not {"gate_up", "down"} & set(spec.targets):
            return None
        get = lambda name, scale=1.0: (
            getattr(self, name)[...] * scale if hasattr(self, name) else None
        )
        return moe_lib.ExpertLoRA(
            a_in=get("lora_gate_up_a"),
            b_gate=get("lora_gate_up_b_wi_gate", spec.scale),
            b_up=get("lora_gate_up_b_wi_up", spec.scale),
            a_out=get("lora_down_a"),
            b_out=get("lora_down_b", spec.scale),
            rows=None if adapter_ids is None else jnp.repeat(adapter_ids, seq_len),
        )

    def __call__(self, x_bsd, valid_bs, adapter_ids=None):
        """(y [b, s, d], the load-balancing loss). Routing runs over every token at once
        (the router is small, and the loss needs its statistics over all valid tokens);
        past cfg.moe_token_tile tokens the experts run tile by tile (`tiled_experts`)."""
        cfg = self.cfg
        b, s, d = x_bsd.shape
        x = x_bsd.reshape(b * s, d)
        weights, idx, logits = moe_lib.route(
            x,
            self.router_kernel[...],
            self.router_bias[...],
            cfg.experts_per_token,
            self.router_delta(x_bsd, adapter_ids),
        )
        aux = moe_lib.load_balancing_loss(logits, idx, valid_bs.reshape(-1))
        w = moe_lib.ExpertWeights(
            self.wi_gate[...],
            self.bi_gate[...],
            self.wi_up[...],
            self.bi_up[...],
            self.wo[...],
            self.bo[...],
            self.expert_lora(adapter_ids, s),
        )
        if 0 < cfg.moe_token_tile < b * s:
            k = cfg.experts_per_token
            y = self.tiled_experts(x_bsd, weights.reshape(b, s, k), idx.reshape(b, s, k), w)
        else:
            y = self.experts(x, weights, idx, w)
        return y.reshape(b, s, d).astype(DTYPES[cfg.dtype]), aux

    def experts(self, x_td, weights_tk, idx_tk, w: moe_lib.ExpertWeights):
        """The configured strategy (cfg.moe_impl) on routed tokens: [T, d] float32."""
        cfg = self.cfg
        sharded = {"capacity_factor": cfg.moe_capacity_factor} if cfg.moe_impl == "sharded" else {}
        return moe_lib.EXPERT_IMPLS[cfg.moe_impl](
            x_td,
            weights_tk,
            idx_tk,
            w,
            limit=cfg.swiglu_limit,
            alpha=cfg.swiglu_alpha,
            dtype=DTYPES[cfg.dtype],
            kernels=cfg.kernels,
            **sharded,
        )

    def tiled_experts(self, x_bsd, weights_bsk, idx_bsk, w: moe_lib.ExpertWeights):
        """`experts` over tiles of about cfg.moe_token_tile tokens, one at a time, each
        under jax.checkpoint (Unsloth's tiled MLP): the [tokens, k, expert hidden]
        intermediates, forward and in the backward's recompute, are one tile's, not the
        layer's. A tile holds `c` positions of every row, strided over the sequence (tile
        j: positions j, j + n, j + 2n, ...) as the loss's chunks are (logprobs.py), so each
        keeps the batch's sharding and the sequence's (context parallelism: while the
        context shards divide c and c divides s) and no device waits on another's rows.
        A tile is at least one position of each row (b tokens). Each token's output is its
        own, so the grouping changes no number. remat_policy "save_moe" still keeps every
        tile's expert products (tokens x k x (2 F + D)): "full" keeps none of them."""
        b, s, d = x_bsd.shape
        c = min(s, max(1, self.cfg.moe_token_tile // b))
        n = -(-s // c)
        rows = None if w.lora is None else w.lora.rows  # a token's adapter, [b * s] or None
        # Padding positions (past s) get zero routing weights, so they add nothing, and
        # the last real position's experts (`edge`: k distinct ones, as routing picks);
        # their outputs are dropped below.
        pads = ("constant", "constant", "edge", "edge")
        names = (("act_embed",), (None,), (None,), ())
        inputs = (x_bsd, weights_bsk, idx_bsk, None if rows is None else rows.reshape(b, s))
        tiles = [
            None if a is None else self._to_tiles(a, c, n, mode, axes)
            for a, mode, axes in zip(inputs, pads, names)
        ]

        def one(tile):
            x, wts, idx, r = (None if a is None else a.reshape(b * c, *a.shape[2:]) for a in tile)
            lw = w if r is None else w._replace(lora=w.lora._replace(rows=r))
            return self.experts(x, wts, idx, lw).reshape(b, c, d)

        y = jax.lax.map(jax.checkpoint(one, prevent_cse=False), tuple(tiles))  # [n, b, c, d]
        return jnp.moveaxis(y, 0, 2).reshape(b, n * c, d)[:, :s]

    @staticmethod
    def _to_tiles(a_bs, c: int, n: int, mode: str, names: tuple):
        """[b, s, ...] -> [n, b, c, ...], tile j holding positions j, j + n, ... of each row
        (s padded to n * c with `mode`); `names`: the logical axes of the dims after s."""
        b, s = a_bs.shape[:2]
        a = jnp.pad(a_bs, [(0, 0), (0, n * c - s)] + [(0, 0)] * (a_bs.ndim - 2), mode=mode)
        a = jnp.moveaxis(a.reshape(b, c, n, *a.shape[2:]), 2, 0)
        return sharding.constrain(a, (None, "batch", "length", *names))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg, "attn_norm", rngs=rngs)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg, "mlp_norm", rngs=rngs)
        self.moe = MoE(cfg, rngs=rngs)
        self.dtype = DTYPES[cfg.dtype]

    def __call__(
        self, x, rope, positions, segment_ids, valid, window, cache, layer, adapter_ids=None
    ):
        h, new_cache = self.attn(
            self.attn_norm(x, self.dtype),
            rope,
            positions,
            segment_ids,
            window,
            cache,
            layer,
            adapter_ids,
        )
        x = x + h
        h, aux = self.moe(self.mlp_norm(x, self.dtype), valid, adapter_ids)
        x = sharding.constrain(x + h, ("batch", "length", "act_embed"))
        return x, aux, new_cache


class Block(nnx.Module):
    """Two layers: `sliding` (banded to the last `sliding_window` keys), then `full`."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.window = cfg.sliding_window
        self.sliding = DecoderLayer(cfg, rngs=rngs)
        self.full = DecoderLayer(cfg, rngs=rngs)

    def __call__(self, x, rope, positions, segment_ids, valid, cache, layer, adapter_ids=None):
        """`cache`: the KV caches of every block (stacked); this block's is `layer`."""
        cache = cache or {"sliding": None, "full": None}
        x, aux1, c1 = self.sliding(
            x,
            rope,
            positions,
            segment_ids,
            valid,
            self.window,
            cache["sliding"],
            layer,
            adapter_ids,
        )
        x, aux2, c2 = self.full(
            x, rope, positions, segment_ids, valid, None, cache["full"], layer, adapter_ids
        )
        new_cache = None if c1 is None else {"sliding": c1, "full": c2}
        return x, aux1 + aux2, new_cache


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Dict(declared_params(cfg, "embed", rngs))

        @nnx.split_rngs(splits=cfg.num_blocks)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_blocks(rngs):
            return Block(cfg, rngs=rngs)

        self.blocks = make_blocks(rngs)
        self.final_norm = RMSNorm(cfg, "final_norm", rngs=rngs)
        self.unembed = nnx.Dict(declared_params(cfg, "unembed", rngs))

    def __call__(self, tokens, positions=None, segment_ids=None, cache=None, adapter_ids=None):
        """tokens [b, s] int -> (hidden [b, s, d] after the final norm, MoE aux loss (mean
        over layers), new cache or None). Positions default to 0..s-1; segment_ids (0 =
        padding) default to all ones. `cache`: per-block KV caches stacked on a leading
        axis, {"sliding": KVCache, "full": KVCache}, as made by `kv_cache.init`.
        `adapter_ids` [b] int: with stacked adapters (cfg.lora.adapters > 0), the one each
        row uses (default: adapter 0)."""
        cfg = self.cfg
        dt = DTYPES[cfg.dtype]
        b, s = tokens.shape
        if cfg.lora is not None and cfg.lora.adapters and adapter_ids is None:
            adapter_ids = jnp.zeros((b,), jnp.int32)
        if cfg.lora is None or not cfg.lora.adapters:
            adapter_ids = None
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        if segment_ids is None:
            segment_ids = jnp.ones((b, s), jnp.int32)
        valid = (segment_ids > 0) & (positions >= 0)

        x = embedding.lookup(self.embed["embedding"][...], tokens, dt)
        x = sharding.constrain(x, ("batch", "length", "act_embed"))
        rope = rope_tables(cfg, positions)

        graphdef, block_params = nnx.split(self.blocks)
        stacks = training_stacks = None
        if streamed_weights.streams(cache, cfg.num_blocks):
            block_params, stacks = streamed_weights.take(block_params, cfg.num_blocks)
        elif cache is None:
            training_stacks = streamed_weights.training_stacks(
                block_params, lambda stack: cfg.kernels.reads_in_place(dt, stack)
            )

        # The stacked cache rides in the loop's carry: each block writes its new keys into
        # its own layer in place and reads that layer, where slicing it off as a scanned
        # input and stacking it back as an output would copy every layer's cache twice a step.
        def body(carry, xs):
            x, cache = carry
            x = jax.ad_checkpoint.checkpoint_name(x, remat.BLOCK_INPUT)  # "offload_inputs"
            params, layer = xs
            if stacks is not None:
                params = streamed_weights.put(params, stacks)
            if training_stacks:
                params = streamed_weights.put_training(params, training_stacks, layer)
            block = nnx.merge(graphdef, params)
            x, aux, cache = block(x, rope, positions, segment_ids, valid, cache, layer, adapter_ids)
            return (x, cache), aux

        body = remat.wrap(body, cfg.remat_policy, scanned=cfg.scan_layers)
        layers = jnp.arange(cfg.num_blocks, dtype=jnp.int32)
        if cfg.scan_layers:
            (x, new_cache), aux = jax.lax.scan(body, (x, cache), (block_params, layers))
        else:
            carry, auxes = (x, cache), []
            for i in range(cfg.num_blocks):
                carry, a = body(carry, (jax.tree.map(lambda t: t[i], block_params), layers[i]))
                auxes.append(a)
            (x, new_cache), aux = carry, jnp.stack(auxes)
        hidden = self.final_norm(x, dt)
        return hidden, jnp.sum(aux) / cfg.num_layers, new_cache

    def logits(self, hidden_bsd):
        """Float32 logits for (a slice of) hidden states; training uses loss.py instead, which
        never holds [tokens, vocab] logits for the whole batch."""
        w = self.unembed["kernel"][...]
        return self.cfg.kernels.matmul("bsd,dv->bsv", hidden_bsd, w, dtype=DTYPES[self.cfg.dtype])


# ----------------------------------------------------------------------------- functional


class ModelDef:
    """The model as a graph definition plus an abstract state: turns a nested dict of
    arrays (the param tree training, checkpoints and hf.py all use) into a Transformer,
    and creates that tree already sharded."""

    def __init__(self, cfg: ModelConfig):
        # The names of the model's own registries, which config.validate cannot see.
        remat.check_policy(cfg.remat_policy)
        moe_lib.check_impl(cfg.moe_impl)
        self.cfg = cfg
        abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
        self.graphdef, self._abstract_state = nnx.split(abstract)

    def bind(self, params: dict) -> Transformer:
        state = jax.tree.map(
            lambda v: v, self._abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable)
        )
        nnx.replace_by_pure_dict(state, params)
        return nnx.merge(self.graphdef, state)

    def logical_axes(self) -> dict:
        """Nested dict of logical-name tuples, one per parameter."""
        names = jax.tree.map(
            lambda v: tuple(v.get_metadata()["out_sharding"]),
            self._abstract_state,
            is_leaf=lambda x: isinstance(x, nnx.Variable),
        )
        return _to_pure(names)

    def shapes(self) -> dict:
        """Nested dict of jax.ShapeDtypeStruct (no sharding)."""
        return self._abstract_state.to_pure_dict()

    def shardings(self, mesh, rules) -> dict:
        """NamedShardings of every parameter. A dim the rules shard over mesh axes it does
        not divide is replicated over them instead (2880 over 256 devices, say): allowed,
        but it can multiply the memory a device holds, so it is logged."""

        def one(path, names, a):
            wanted = sharding.logical_to_spec(names, rules)
            got = sharding.fit_spec(wanted, a.shape, mesh)
            if tuple(got) != tuple(wanted) + (None,) * (len(got) - len(wanted)):
                name = "/".join(str(getattr(k, "key", k)) for k in path)
                logging.warning(
                    "%s %s: rules ask for %s, mesh %s only allows %s (replicated over the rest)",
                    name,
                    tuple(a.shape),
                    wanted,
                    dict(mesh.shape),
                    got,
                )
            return jax.sharding.NamedSharding(mesh, got)

        return jax.tree_util.tree_map_with_path(
            one, self.logical_axes(), self.shapes(), is_leaf=lambda x: isinstance(x, tuple)
        )

    def abstract_params(self, mesh=None, rules=None) -> dict:
        if mesh is None:
            return self.shapes()
        return jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            self.shapes(),
            self.shardings(mesh, rules),
        )

    def init(self, seed: int, mesh=None, rules=None) -> dict:
        """Random parameters, created under jit straight into their shardings (no host copy
        of the full model)."""
        cfg = self.cfg

        def make():
            return nnx.state(Transformer(cfg, rngs=nnx.Rngs(seed))).to_pure_dict()

        if mesh is None:
            return jax.jit(make)()
        with sharding.use_mesh(mesh, rules):
            return jax.jit(make, out_shardings=self.shardings(mesh, rules))()


def _to_pure(state) -> dict:
    if hasattr(state, "items"):
        return {k: _to_pure(v) for k, v in state.items()}
    return state
