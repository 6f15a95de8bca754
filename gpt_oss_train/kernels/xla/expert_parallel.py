"""Expert parallelism inside shard_map: this device's tokens to the shards that hold their
chosen experts, the local experts over what arrives, the results back and summed.

Both implementations run the same local computation, `experts(rows, key, group_sizes)`:
rows sorted by local expert (`key`, `local_e` for a row no local expert takes), group
sizes per local expert, outputs (float32, or the compute dtype where the platform keeps
expert products in it) without the experts' output bias and undefined where key ==
local_e; each implementation adds `out_bias` [local_e, d] and zeroes those rows where it
costs least. They differ in what crosses the links, per device with t tokens, k choices,
n expert shards of d-wide rows:

  gather      (the reference) every token to every shard of its `expert` group: all_gather
              of the tokens, (n - 1) t d sent; the outputs summed back by psum_scatter.
  all_to_all  each (token, choice) pair only to the shard of its expert: a ragged
              all-to-all of ~(n - 1)/n t k d, and back. k / n of gather's bytes: for
              gpt-oss-120b (k 4) over 16 expert shards, a quarter.

Buffers are sized for the worst case (every pair on one shard: n t k rows), so no token
is ever dropped. `gather` can instead run its rows in rounds of a capacity, a multiple
(`capacity_factor`) of a shard's share under balanced routing: still exact, since the
rounds continue until every row of this shard has run (a round past the last row is
skipped), with buffers of the capacity, not of the worst case.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gpt_oss_train import sharding
from gpt_oss_train.kernels.xla import experts as experts_lib


def gather(
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
    """x [t, d], wts / idx [t, k] this device's tokens -> their outputs float32 [t, d]."""
    for ax in token_axes:
        x, wts, idx = (jax.lax.all_gather(a, ax, axis=0, tiled=True) for a in (x, wts, idx))
    t, k = idx.shape
    flat = idx.reshape(-1) - sharding.axes_index(expert_axes) * local_e
    key = jnp.where((flat >= 0) & (flat < local_e), flat, local_e)  # not mine: at the end
    order = jnp.argsort(key, stable=True)
    group_sizes = jnp.bincount(key, length=local_e + 1)[:local_e].astype(jnp.int32)
    capacity = round_capacity(capacity_factor * t * k / sharding.axes_size(expert_axes))
    if 0 < capacity < t * k:
        out = _in_rounds(experts, x, wts, key, order, group_sizes, capacity, out_bias)
    else:
        y = experts(x[order // k], key[order], group_sizes)
        out = experts_lib.weighted_sum(wts, y, order, out_bias, key)
    if mlp_axes:
        out = jax.lax.psum(out, mlp_axes)
    for ax in reversed(token_axes):
        out = jax.lax.psum_scatter(out, ax, scatter_dimension=0, tiled=True)
    others = tuple(a for a in expert_axes if a not in token_axes)
    return jax.lax.psum(out, others) if others else out  # experts over a non-token axis


def round_capacity(rows: float) -> int:
    """Rows of a round: at least `rows`, in whole tiles (128 rows; 8 below that)."""
    tile = 128 if rows > 128 else 8
    return int(-(-rows // tile) * tile) if rows > 0 else 0


def _in_rounds(experts, x, wts, key, order, group_sizes, capacity, out_bias):
    """`gather`'s sorted rows through `experts` `capacity` at a time -> float32 [t, d].

    Rounds run over the sorted pairs in order and stop mattering at the last row this
    shard holds (sum(group_sizes)): a round that starts past it is skipped. Each round is
    rematerialized in the backward pass, so one round's activations are live at a time."""
    t, k = wts.shape
    rows = t * k
    rounds = -(-rows // capacity)
    pad = rounds * capacity - rows
    local_e = group_sizes.shape[0]
    key_s = jnp.pad(key[order], (0, pad), constant_values=local_e)  # padding: not mine
    token_s = jnp.pad(order // k, (0, pad))
    weight_s = jnp.pad(wts.reshape(-1)[order].astype(jnp.float32), (0, pad))
    mine = group_sizes.sum()
    window = lambda a, start: jax.lax.dynamic_slice_in_dim(a, start, capacity)

    def run(start):
        keys = window(key_s, start)
        sizes = jnp.bincount(keys, length=local_e + 1)[:local_e].astype(jnp.int32)
        y = experts(x[window(token_s, start)], keys, sizes)
        return window(weight_s, start)[:, None] * experts_lib.finish_rows(y, out_bias, keys)

    # The checkpoint outside the conditional: its residuals are then its inputs, the
    # round's start and the loop's constants (the tokens, this layer's experts), which the
    # scan keeps once; inside, the branch's inputs would leave the conditional as
    # residuals and be stacked once per round.
    @jax.checkpoint
    def contribution(start):
        skip = lambda start: jnp.zeros((capacity, x.shape[1]), jnp.float32)
        return jax.lax.cond(start < mine, run, skip, start)

    def one_round(out, r):
        start = r * capacity
        return out.at[window(token_s, start)].add(contribution(start)), None

    out, _ = jax.lax.scan(one_round, jnp.zeros((t, x.shape[1]), jnp.float32), jnp.arange(rounds))
    return out


def all_to_all(
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
    """As `gather`, exchanging only the pairs each shard computes (see the docstring). Its
    receive buffer stays sized for the worst case: `capacity_factor` is not used here."""
    t, k = idx.shape
    n = sharding.axes_size(expert_axes)
    pairs = t * k  # the most rows one device sends to, or gets back from, another
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # by destination shard, then by its expert
    # [senders, receivers, local experts]: every device's counts (n^2 local_e integers)
    counts = jax.lax.all_gather(
        jnp.bincount(flat, length=n * local_e).reshape(n, local_e).astype(jnp.int32),
        expert_axes,
        tiled=False,
    )
    me = sharding.axes_index(expert_axes)
    sizes = counts.sum(-1)  # [senders, receivers]
    starts = _exclusive_cumsum(sizes, axis=1)  # where each sender's chunk for j begins
    lands = _exclusive_cumsum(sizes, axis=0)  # where it lands in receiver j's rows
    received = counts[:, me]  # [senders, local experts]
    # Out: sorted pairs to their shards; arrive grouped by sender, then by local expert.
    rows = _exchange(
        x[order // k], n * pairs, starts[me], sizes[me], lands[me], sizes[:, me], expert_axes, pairs
    )
    key = _expert_of_received_rows(received, local_e, n * pairs)
    by_expert = jnp.argsort(key, stable=True)
    y = experts(rows[by_expert], key[by_expert], received.sum(0))
    y = experts_lib.unsort_rows(y, by_expert)
    # Back: each sender's rows return to where they left its sorted buffer. Only rows that
    # arrived go back, so the undefined ones stay here; the output bias is added at home,
    # in the weighted sum, from every expert's (a few MB): a pass over the pairs a device
    # sent rather than over the receive buffer, n times their rows.
    y = _exchange(
        y, pairs, lands[:, me], sizes[:, me], starts[:, me], sizes[me], expert_axes, pairs
    )
    every_bias = jax.lax.all_gather(out_bias, expert_axes, axis=0, tiled=True)
    out = experts_lib.weighted_sum(wts, y, order, every_bias, flat)
    # (tokens are split over every expert axis here: all_to_all_accepts)
    return jax.lax.psum(out, mlp_axes) if mlp_axes else out


def all_to_all_accepts(
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
    """Tokens sharded over every expert axis (else each shard must see them all: gather),
    on a platform whose compiler takes the exchange (libtpu refuses ragged all-to-all on
    v5e: "not supported in limited ICI routing settings")."""
    return set(token_axes) == set(expert_axes) and not _is_v5e()


def _is_v5e() -> bool:
    ctx = sharding.active()
    return ctx is not None and "v5 lite" in ctx[0].devices.flat[0].device_kind.lower()


def _exclusive_cumsum(a, axis):
    return jnp.cumsum(a, axis=axis) - a


def _expert_of_received_rows(received, local_e, capacity):
    """The local expert of each received row ([senders, local experts] counts, rows
    grouped by sender then expert); local_e past the last row."""
    n = received.shape[0]
    ids = jnp.tile(jnp.arange(local_e, dtype=jnp.int32), n)
    key = jnp.repeat(ids, received.reshape(-1), total_repeat_length=capacity)
    return jnp.where(jnp.arange(capacity) < received.sum(), key, local_e)


def _exchange(operand, capacity, starts, send_sizes, lands, recv_sizes, axes, chunk):
    """Rows starts[j] : starts[j] + send_sizes[j] of `operand` [rows, d] to device j of
    `axes`, at its rows lands[j]...; returns [capacity, d] with what arrived (zeros
    elsewhere). No chunk is longer than `chunk` rows."""
    out = jnp.zeros((capacity, operand.shape[1]), operand.dtype)
    if sharding.platform() == "cpu":  # XLA:CPU has no ragged-all-to-all
        return _dense_exchange(operand, out, starts, send_sizes, lands, recv_sizes, axes, chunk)
    return jax.lax.ragged_all_to_all(
        operand, out, starts, send_sizes, lands, recv_sizes, axis_name=axes
    )


def _dense_exchange(operand, out, starts, send_sizes, lands, recv_sizes, axes, chunk):
    """ragged_all_to_all's result from a dense all_to_all of per-receiver chunks padded
    to `chunk` rows: the same rows moved, n times the bytes (CPU, tests)."""
    rows = operand.shape[0]
    n = send_sizes.shape[0]
    r = jnp.arange(chunk)
    src = starts[:, None] + r[None, :]  # [receivers, chunk]
    sent = r[None, :] < send_sizes[:, None]
    chunks = jnp.where(sent[..., None], operand[jnp.clip(src, 0, rows - 1)], 0)
    got = jax.lax.all_to_all(chunks, axes, 0, 0, tiled=True)  # [senders, chunk, d]
    # Row q of the output holds sender i's row q - lands_i, where lands_i <= q < ends_i;
    # `lands` here are where this device's chunks land elsewhere, so ask each sender.
    arrive = jax.lax.all_to_all(lands.reshape(n, 1), axes, 0, 0, tiled=True).reshape(n)
    q = jnp.arange(out.shape[0])
    mine = (q[None, :] >= arrive[:, None]) & (q[None, :] < (arrive + recv_sizes)[:, None])
    sender = jnp.argmax(mine, axis=0)
    within = jnp.clip(q - arrive[sender], 0, chunk - 1)
    return jnp.where(mine.any(0)[:, None], got[sender, within], out)
