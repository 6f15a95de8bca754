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

No token is ever dropped. With `capacity_factor` 0 the buffers are sized for the worst
case (every pair on one shard: n t k rows). Else rows run in rounds of a capacity, that
multiple of a shard's share under balanced routing, with buffers of the capacity: the
first round always runs and the others only while rows are left (`overflow_rounds`), so
the result is the same whatever the routing, and under routing within the capacity one
round of the capacity's rows is all a layer pays for.
"""

from __future__ import annotations

import functools

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

    Rounds run over the sorted pairs in order. The first always runs; the rest run only
    while this shard has rows left (start < sum(group_sizes)), so with a capacity at or
    above a shard's pairs only the first does (`overflow_rounds`)."""
    t, k = wts.shape
    rows = t * k
    rounds = -(-rows // capacity)
    pad = rounds * capacity - rows
    local_e = group_sizes.shape[0]
    key_s = jnp.pad(key[order], (0, pad), constant_values=local_e)  # padding: not mine
    token_s = jnp.pad(order // k, (0, pad))
    weight_s = jnp.pad(wts.reshape(-1)[order].astype(jnp.float32), (0, pad))
    window = lambda a, start: jax.lax.dynamic_slice_in_dim(a, start, capacity)

    def add_round(out, start):
        keys = window(key_s, start)
        sizes = jnp.bincount(keys, length=local_e + 1)[:local_e].astype(jnp.int32)
        y = experts(x[window(token_s, start)], keys, sizes)
        y = window(weight_s, start)[:, None] * experts_lib.finish_rows(y, out_bias, keys)
        return out.at[window(token_s, start)].add(y)

    out = add_round(jnp.zeros((t, x.shape[1]), jnp.float32), 0)
    return overflow_rounds(add_round, out, rounds, capacity, group_sizes.sum())


# The name scope of the rounds past the first, which run only when a shard's rows exceed
# one round's capacity: the step model (aot/step_model.py) finds their conditionals by it,
# leaving them out of its estimate under balanced routing and counting them in the upper
# bound.
OVERFLOW_SCOPE = "moe_overflow_round"


def overflow_rounds(add_round, carry, rounds: int, capacity: int, rows_here):
    """`carry = add_round(carry, start)` for the rounds 1 .. rounds - 1 (start = r x
    capacity) that hold rows (start < rows_here), in a scan of conditionals; a round past
    the rows passes the carry on untouched. `add_round` adds to its carry (the carry's
    gradient is the cotangent itself), so the backward pass is written here: a round
    that did not run adds nothing to any gradient either. Differentiated by autodiff, a
    skipped round would still add its zero gradient of every value it closes over (the
    experts' weights: three [experts, d, f] matrices a round) to the running sums."""
    if rounds <= 1:
        return carry
    # Every value add_round closes over becomes an explicit operand, the integer ones too
    # (jax.closure_convert keeps those closed over, and they would leak into the backward
    # pass's trace under shard_map).
    closed = jax.make_jaxpr(add_round)(carry, jnp.zeros((), jnp.int32))
    consts = closed.consts
    fn = lambda c, s, *cs: jax.core.eval_jaxpr(closed.jaxpr, cs, c, s)[0]
    starts = jnp.arange(1, rounds, dtype=jnp.int32) * capacity
    return _overflow(fn, rows_here, starts, carry, *consts)


def _each_round(starts, rows_here, carry, run):
    """carry = run(carry, start) for each start below rows_here, in a scan."""

    def step(carry, start):
        with jax.named_scope(OVERFLOW_SCOPE):
            return jax.lax.cond(start < rows_here, run, lambda c, s: c, carry, start), None

    return jax.lax.scan(step, carry, starts)[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _overflow(fn, rows_here, starts, carry, *consts):
    return _each_round(starts, rows_here, carry, lambda c, s: fn(c, s, *consts))


def _overflow_fwd(fn, rows_here, starts, carry, *consts):
    return _overflow(fn, rows_here, starts, carry, *consts), (rows_here, starts, consts)


def _overflow_bwd(fn, res, ct):
    """Each round that ran, again (rematerialized), its gradients added to running sums
    that a skipped round passes on untouched."""
    rows_here, starts, consts = res

    wrt = [i for i, c in enumerate(consts) if jnp.issubdtype(c.dtype, jnp.inexact)]

    def run(sums, start):
        # the round's own addition to the carry, pulled back (any carry will do: ct's)
        def round_of(*floats):
            cs = list(consts)
            for i, f in zip(wrt, floats, strict=True):
                cs[i] = f
            return fn(ct, start, *cs)

        _, pull = jax.vjp(round_of, *(consts[i] for i in wrt))
        return tuple(a + g for a, g in zip(sums, pull(ct), strict=True))

    sums = _each_round(starts, rows_here, tuple(jnp.zeros_like(consts[i]) for i in wrt), run)
    grads = [None] * len(consts)
    for i, g in zip(wrt, sums, strict=True):
        grads[i] = g
    return (None, None, ct, *grads)


_overflow.defvjp(_overflow_fwd, _overflow_bwd)


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
    """As `gather`, exchanging only the pairs each shard computes (see the docstring).

    A shard's received rows are one list: by sender, then by local expert. A round takes
    the window [start, start + capacity) of every shard's list at once: each sender sends
    the part of its chunk for j that lands in j's window, j runs its window through its
    experts, and the results go back to where they left. Round 0 always runs; the rest
    only while some shard of the group has rows left, decided alike on every shard (the
    counts are shared) since each round exchanges."""
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
    worst = n * pairs  # every pair of the group on this shard
    capacity = round_capacity(capacity_factor * pairs)
    capacity = capacity if 0 < capacity < worst else worst
    rounds = -(-worst // capacity)
    received = counts[:, me]  # [senders, local experts]
    key_all = _expert_of_received_rows(received, local_e, rounds * capacity)
    x_sorted = x[order // k]

    def add_round(y_pairs, start):
        # the part of each sender's chunk for j that falls in j's window: [a, b) of j's rows
        a = jnp.maximum(lands, start)
        cnt = jnp.maximum(jnp.minimum(lands + sizes, start + capacity) - a, 0)
        send_from = jnp.where(cnt > 0, starts + a - lands, 0)  # [senders, receivers]
        land_at = jnp.where(cnt > 0, a - start, 0)
        chunk = min(pairs, capacity)
        # Out: my sorted pairs to their shards' windows, arriving by sender then expert.
        rows = _exchange(
            x_sorted, capacity, send_from[me], cnt[me], land_at[me], cnt[:, me], expert_axes, chunk
        )
        key = jax.lax.dynamic_slice_in_dim(key_all, start, capacity)
        by_expert = jnp.argsort(key, stable=True)
        group_sizes = jnp.bincount(key, length=local_e + 1)[:local_e].astype(jnp.int32)
        y = experts_lib.unsort_rows(experts(rows[by_expert], key[by_expert], group_sizes), by_expert)
        # Back: each sender's rows return to where they left its sorted buffer. Only rows
        # that arrived go back, so the undefined ones stay here.
        back = _exchange(
            y, pairs, land_at[:, me], cnt[:, me], send_from[:, me], cnt[me], expert_axes, chunk
        )
        return back if y_pairs is None else y_pairs + back

    y = add_round(None, 0)
    # Every device takes the same branch of each round, whatever its group: a round's
    # exchange then never waits on a device that skipped it (one integer's all-reduce).
    rows_max = sizes.sum(0).max()
    if rounds > 1:
        rows_max = jax.lax.pmax(rows_max, sharding.active()[0].axis_names)
    y = overflow_rounds(add_round, y, rounds, capacity, rows_max)
    # The output bias is added at home, in the weighted sum, from every expert's (a few
    # MB): a pass over the pairs a device sent rather than over the receive buffer.
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
