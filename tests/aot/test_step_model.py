"""gpt_oss_train.aot.step_model: the per-step account of a compiled program read from its
optimized HLO, against numbers counted by hand: a shard_map program compiled on the 8 CPU
devices, a hand-written module in TPU's forms (no known trip count, on-chip buffers, async
collective fusions, a reduce-scatter fusion, a padded convolution, a Pallas call), the
replica-group syntaxes, and the estimate's formula."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from gpt_oss_train import hardware
from gpt_oss_train.aot import hlo_text, step_model
from gpt_oss_train.aot.check import memory_report
from gpt_oss_train.aot.hlo_costs import _landing
from gpt_oss_train.aot.maxtext import maxtext_topology
from gpt_oss_train.tools.aot_compile import _bare_json_to_stdout

TRIPS = 5
# Per device: x [8, 16] @ w [16, 32] -> y [8, 32] f32, summed over "model" (4 devices),
# then gathered over "data" (2 devices) to [16, 32].
DOT_FLOPS = 2 * 8 * 32 * 16
PSUM_BYTES, GATHER_BYTES = 8 * 32 * 4, 16 * 32 * 4


def _program_text() -> str:
    """A fori_loop of TRIPS trips whose body does one matmul, a psum over "model" and an
    all_gather over "data", on a (data=2, model=4) mesh whose devices are in transposed
    order: XLA's group ids are positions in the mesh, not device ids, so a parser mapping
    them through the device ids would find the wrong axes."""
    devices = np.array(jax.devices()[:8]).reshape(4, 2).T  # ids [[0,2,4,6],[1,3,5,7]]
    mesh = Mesh(devices, ("data", "model"))

    def body(_, carry):
        x, w = carry
        y = jax.lax.psum(x @ w, "model")
        g = jax.lax.all_gather(y, "data", tiled=True)
        return x + g[: x.shape[0], : x.shape[1]], w

    def f(x, w):
        return jax.lax.fori_loop(0, TRIPS, body, (x, w))[0]

    step = jax.jit(
        jax.shard_map(
            f,
            mesh=mesh,
            in_specs=(P("data", "model"), P("model", None)),
            out_specs=P("data", "model"),
        )
    )
    x = jax.device_put(jnp.ones((16, 64), jnp.float32), jax.NamedSharding(mesh, P("data", "model")))
    w = jax.device_put(jnp.ones((64, 32), jnp.float32), jax.NamedSharding(mesh, P("model", None)))
    return step.lower(x, w).compile().as_text()


@pytest.fixture(scope="module")
def program():
    return _program_text()


MESH = hlo_text.MeshSpec(("data", "model"), (2, 4))


def _collectives(acct):
    return sorted(
        (c.kind, c.result_bytes, c.group_size, c.axes, c.runs, c.link_bytes)
        for c in acct.collectives
    )


def test_a_compiled_loop_is_counted_times_its_trips(program):
    acct = step_model.account(program, MESH)
    assert [(lp.trip_count, lp.source) for lp in acct.loops] == [(TRIPS, "xla")]
    assert acct.flops == TRIPS * DOT_FLOPS
    assert _collectives(acct) == [
        ("all-gather", GATHER_BYTES, 2, ("data",), TRIPS, GATHER_BYTES / 2),  # (n-1)/n
        ("all-reduce", PSUM_BYTES, 4, ("model",), TRIPS, 2 * 3 / 4 * PSUM_BYTES),  # 2(n-1)/n
    ]
    assert acct.hbm_bytes > TRIPS * (PSUM_BYTES + GATHER_BYTES)  # the collectives alone
    assert not acct.notes, acct.notes


def test_trip_count_read_from_the_loop_or_flagged(program):
    # libtpu prints no known_trip_count: the count comes from the loop's own condition.
    bare = re.sub(r'"known_trip_count":\{"n":"\d+"\},?', "", program)
    acct = step_model.account(bare, MESH)
    assert [(lp.trip_count, lp.source) for lp in acct.loops] == [(TRIPS, "condition")]
    assert acct.flops == TRIPS * DOT_FLOPS
    # A condition of another form: counted once, and said so.
    assert "direction=LT" in bare
    odd = step_model.account(bare.replace("direction=LT", "direction=NE"), MESH)
    assert [(lp.trip_count, lp.source) for lp in odd.loops] == [(None, "unknown")]
    assert odd.flops == DOT_FLOPS and {c.runs for c in odd.collectives} == {1}
    assert any("no known trip count" in n for n in odd.notes), odd.notes


# TPU's forms, written by hand: a loop of 3 trips with no known_trip_count (its counter
# behind a copy), on-chip `S(1)` buffers, a weight stack read one layer a trip, a
# reduce-scatter fusion, an all-gather split into an async start and done fusion, a
# permute, a padded convolution, TPU's ragged-dot kernel and an unknown Pallas kernel.
TPU_LIKE = """HloModule tpu_like, entry_computation_layout={()->f32[4,8]}, num_partitions=4

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%slice_layer (p0: f32[3,4,8], p1: s32[]) -> f32[4,8] {
  %p0 = f32[3,4,8]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %z = s32[] constant(0)
  %ds = f32[1,4,8]{2,1,0} dynamic-slice(%p0, %p1, %z, %z), dynamic_slice_sizes={1,4,8}
  ROOT %r = f32[4,8]{1,0} bitcast(%ds)
}

%all-reduce-scatter.1 (x0: f32[8,8]) -> f32[2,8] {
  %x0 = f32[8,8]{1,0} parameter(0)
  %ar = f32[8,8]{1,0} all-reduce(%x0), channel_id=3, replica_groups=mesh['axis_0'=4] {'axis_0'}, use_global_device_ids=true, to_apply=%add
  %pid = u32[] partition-id()
  %two = u32[] constant(2)
  %off = u32[] multiply(%pid, %two)
  %zero = u32[] constant(0)
  ROOT %share = f32[2,8]{1,0} dynamic-slice(%ar, %off, %zero), dynamic_slice_sizes={2,8}
}

%gather_start (g0: f32[1,8]) -> (f32[1,8], f32[4,8]) {
  %g0 = f32[1,8]{1,0} parameter(0)
  %ag = f32[4,8]{1,0} all-gather(%g0), channel_id=4, replica_groups=[1,4]<=[4], dimensions={0}, use_global_device_ids=true, frontend_attributes={chain_id="0"}
  ROOT %st = (f32[1,8]{1,0}, f32[4,8]{1,0}) custom-call(%ag), custom_call_target="AsyncCollectiveStart"
}

%gather_done (h0: f32[1,8], h1: f32[4,8]) -> f32[4,8] {
  %h0 = f32[1,8]{1,0} parameter(0)
  %h1 = f32[4,8]{1,0} parameter(1)
  %ag2 = f32[4,8]{1,0} all-gather(%h0), channel_id=4, replica_groups=[1,4]<=[4], dimensions={0}, use_global_device_ids=true, frontend_attributes={chain_id="0"}
  ROOT %dn = f32[4,8]{1,0} custom-call(%h0, %h1, %ag2), custom_call_target="AsyncCollectiveDone"
}

%sparse_core_work (p: f32[2]) -> f32[2] {
  %p = f32[2]{0:S(1)} parameter(0)
  ROOT %q = f32[2]{0:S(1)} add(%p, %p)
}, execution_thread="sparsecore"

%body (t: (s32[], f32[4,8], f32[3,4,8])) -> (s32[], f32[4,8], f32[3,4,8]) {
  %t = (s32[]{:S(1)}, f32[4,8]{1,0:S(1)}, /*index=2*/f32[3,4,8]{2,1,0}) parameter(0)
  %i = s32[]{:S(1)} get-tuple-element(%t), index=0
  %ic = s32[]{:S(1)} copy(%i)
  %one = s32[]{:S(1)} constant(1)
  %next = s32[]{:S(1)} add(%ic, %one)
  %h = f32[4,8]{1,0:S(1)} get-tuple-element(%t), index=1
  %ws = f32[3,4,8]{2,1,0} get-tuple-element(%t), index=2
  %w = f32[4,8]{1,0:S(1)} fusion(%ws, %i), kind=kLoop, calls=%slice_layer, metadata={op_name="jit(step)/while/body/layer" source_line=7}
  %d = f32[4,4]{1,0:S(1)} dot(%h, %w), lhs_contracting_dims={1}, rhs_contracting_dims={1}
  %cp = f32[4,8]{1,0:S(1)} collective-permute(%h), channel_id=5, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %nh = f32[4,8]{1,0:S(1)} add(%cp, %w)
  ROOT %out = (s32[]{:S(1)}, f32[4,8]{1,0:S(1)}, f32[3,4,8]{2,1,0}) tuple(%next, %nh, %ws)
}

%cond (c: (s32[], f32[4,8], f32[3,4,8])) -> pred[] {
  %c = (s32[]{:S(1)}, f32[4,8]{1,0:S(1)}, f32[3,4,8]{2,1,0}) parameter(0)
  %ci = s32[]{:S(1)} get-tuple-element(%c), index=0
  %n = s32[]{:S(1)} constant(3)
  ROOT %lt = pred[]{:S(1)} compare(%ci, %n), direction=LT
}

ENTRY %main (x: f32[2,5,3], k: f32[3,3,4], ws: f32[3,4,8], g: f32[8,8], s: f32[1,8]) -> f32[4,8] {
  %x = f32[2,5,3]{2,1,0:S(1)} parameter(0)
  %k = f32[3,3,4]{2,1,0:S(1)} parameter(1)
  %conv = f32[2,5,4]{2,1,0:S(1)} convolution(%x, %k), window={size=3 pad=1_1}, dim_labels=b0f_0io->b0f
  %ws = f32[3,4,8]{2,1,0} parameter(2)
  %zero = f32[]{:S(1)} constant(0)
  %h0 = f32[4,8]{1,0:S(1)} broadcast(%zero), dimensions={}
  %i0 = s32[]{:S(1)} constant(0)
  %i0c = s32[]{:S(1)} copy(%i0)
  %init = (s32[]{:S(1)}, f32[4,8]{1,0:S(1)}, f32[3,4,8]{2,1,0}) tuple(%i0c, %h0, %ws)
  %loop = (s32[]{:S(1)}, f32[4,8]{1,0:S(1)}, f32[3,4,8]{2,1,0}) while(%init), condition=%cond, body=%body
  %g = f32[8,8]{1,0} parameter(3)
  %rs = f32[2,8]{1,0:S(1)} fusion(%g), kind=kCustom, calls=%all-reduce-scatter.1
  %s = f32[1,8]{1,0:S(1)} parameter(4)
  %start = (f32[1,8]{1,0:S(1)}, f32[4,8]{1,0:S(1)}) fusion(%s), kind=kCustom, calls=%gather_start
  %s0 = f32[1,8]{1,0:S(1)} get-tuple-element(%start), index=0
  %s1 = f32[4,8]{1,0:S(1)} get-tuple-element(%start), index=1
  %done = f32[4,8]{1,0:S(1)} fusion(%s0, %s1), kind=kCustom, calls=%gather_done
  %lhs = f32[6,4]{1,0:S(1)} broadcast(%zero), dimensions={}
  %rhs = f32[2,4,5]{2,1,0:S(1)} broadcast(%zero), dimensions={}
  %ragged-dot-none.2 = f32[6,5]{1,0:S(1)} custom-call(%lhs, %rhs), custom_call_target="tpu_custom_call", frontend_attributes={kernel_metadata={
"xprof_metadata":"{}"
}}
  %my_kernel.7 = f32[6,5]{1,0:S(1)} custom-call(%lhs), custom_call_target="tpu_custom_call"
  %dy = f32[6,5]{1,0:S(1)} broadcast(%zero), dimensions={}
  %gmm.3 = f32[6,5]{1,0:S(1)} custom-call(%i0, %lhs, %rhs), custom_call_target="tpu_custom_call"
  %tgmm.1 = f32[2,4,5]{2,1,0:S(1)} custom-call(%i0, %lhs, %dy), custom_call_target="tpu_custom_call"
  %out = f32[4,8]{1,0:S(1)} get-tuple-element(%loop), index=1
  %pairs = f32[6,4]{1,0:S(1)} broadcast(%zero), dimensions={}
  %space = f32[24,4]{1,0:S(1)} broadcast(%zero), dimensions={}
  %offsets = s32[4]{0:S(1)} broadcast(%i0), dimensions={}
  %ra = f32[24,4]{1,0:S(1)} ragged-all-to-all(%pairs, %space, %offsets, %offsets, %offsets, /*index=5*/%offsets), channel_id=9, replica_groups={{0,1,2,3}}
  ROOT %r = (f32[4,8]{1,0:S(1)}, f32[2,5,4]{2,1,0:S(1)}, f32[2,8]{1,0:S(1)}, f32[4,8]{1,0:S(1)}) tuple(%out, %conv, %rs, %done)
}
"""  # noqa: E501  (HLO as XLA prints it, one instruction a line)


def test_tpu_forms_counted_by_hand():
    acct = step_model.account(TPU_LIKE, hlo_text.MeshSpec(("x",), (4,)))
    assert [(lp.trip_count, lp.source) for lp in acct.loops] == [(3, "condition")]
    # Convolution: of 3 x 5 (kernel tap, output) pairs per row, 2 land on padding: 13 valid,
    # x 2 batch x 4 output x 3 input features (not 3 x 5 = 15 pairs: padding is no work).
    conv = 2 * 2 * 4 * 3 * 13
    dot = 3 * 2 * 4 * 4 * 8  # 3 trips of [4, 8] x [4, 8]^T
    ragged = 2 * 6 * 4 * 5  # each of 6 rows meets one [4, 5] group
    # megablox: gmm as the ragged dot; tgmm's weight gradient [2, 4, 5] from 6 rows, each
    # in one group (its lhs passed [m, k])
    ragged *= 3
    assert acct.custom_call_flops == ragged
    assert acct.flops == conv + dot + ragged
    # HBM: only arrays outside S(1). The loop reads one [4, 8] f32 layer of the stack a
    # trip (not the whole [3, 4, 8]); the reduce-scatter fusion reads its [8, 8] input.
    assert acct.hbm_bytes == 3 * 4 * 8 * 4 + 8 * 8 * 4
    # ... and those two, largest first, name where the HBM term goes
    assert [(t.bytes, t.runs, t.opcode, t.source) for t in acct.traffic] == [
        (3 * 4 * 8 * 4, 3, "fusion", "jit(step)/while/body/layer"),
        (8 * 8 * 4, 1, "fusion", ""),
    ]
    assert _collectives(acct) == [
        ("all-gather", 4 * 8 * 4, 4, ("x",), 1, 3 / 4 * 128),  # start and done: once
        ("collective-permute", 4 * 8 * 4, 2, ("x",), 3, 128),
        # its output has room for every chip's 6 rows; what moves is the chip's own 6
        ("ragged-all-to-all", 6 * 4 * 4, 4, ("x",), 1, 3 / 4 * 96),
        ("reduce-scatter", 2 * 8 * 4, 4, ("x",), 1, 3 * 64),  # (n-1) x the share
    ]
    assert {c.kernel: c.flops for c in acct.custom_calls} == {
        "ragged-dot-none": ragged / 3,
        "my_kernel": None,
        "gmm": ragged / 3,
        "tgmm": ragged / 3,
    }
    assert any("not costed" in n and "my_kernel" in n for n in acct.notes), acct.notes
    # Expert parallelism's buffers hold data in 1/4 of their rows: the kernel's FLOPs are
    # counted for those (its bytes are not changed), and a note says so.
    quarter = step_model.account(TPU_LIKE, hlo_text.MeshSpec(("x",), (4,)), ragged_rows=0.25)
    assert quarter.custom_call_flops == ragged / 4
    assert quarter.flops == conv + dot + ragged / 4 and quarter.hbm_bytes == acct.hbm_bytes
    assert any("ragged dots" in n for n in quarter.notes), quarter.notes


SCATTER_IN_PLACE = """HloModule scatter_in_place

%assign (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  ROOT %b = f32[] parameter(1)
}

%write_rows (buf: f32[1024,64], idx: s32[4,1], upd: f32[4,64]) -> f32[1024,64] {
  %buf = f32[1024,64]{1,0} parameter(0)
  %idx = s32[4,1]{1,0} parameter(1)
  %upd = f32[4,64]{1,0} parameter(2)
  ROOT %sc = f32[1024,64]{1,0} scatter(%buf, %idx, %upd), update_window_dims={1}, inserted_window_dims={0}, scatter_dims_to_operand_dims={0}, index_vector_dim=1, to_apply=%assign
}

ENTRY %main (cache: f32[1024,64], rows: s32[4,1], new: f32[4,64]) -> f32[1024,64] {
  %cache = f32[1024,64]{1,0} parameter(0)
  %rows = s32[4,1]{1,0} parameter(1)
  %new = f32[4,64]{1,0} parameter(2)
  ROOT %f = f32[1024,64]{1,0} fusion(%cache, %rows, %new), kind=kLoop, calls=%write_rows
}
"""  # noqa: E501


def test_a_scatter_writes_only_its_updates():
    # A KV cache written at 4 rows: the fusion reads the rows and indices and writes the
    # 4 x 64 floats in place, not the whole 256 KiB buffer (read, then written again).
    acct = step_model.account(SCATTER_IN_PLACE)
    assert acct.hbm_bytes == 4 * 64 * 4 + 4 * 4 + 4 * 64 * 4
    # The same scatter unfused: its updates read and written (indices not counted).
    bare = SCATTER_IN_PLACE.replace(
        "ROOT %f = f32[1024,64]{1,0} fusion(%cache, %rows, %new), kind=kLoop, calls=%write_rows",
        "ROOT %f = f32[1024,64]{1,0} scatter(%cache, %rows, %new), update_window_dims={1}, "
        "inserted_window_dims={0}, scatter_dims_to_operand_dims={0}, index_vector_dim=1, "
        "to_apply=%assign",
    )
    assert step_model.account(bare).hbm_bytes == 2 * 4 * 64 * 4


OVERFLOW = """HloModule overflow

%run (a: f32[64,64]) -> f32[64,64] {
  %a = f32[64,64]{1,0} parameter(0)
  ROOT %d = f32[64,64]{1,0} dot(%a, %a), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%skip (b: f32[64,64]) -> f32[64,64] {
  ROOT %b = f32[64,64]{1,0} parameter(0)
}

ENTRY %main (x: f32[64,64], go: pred[]) -> f32[64,64] {
  %x = f32[64,64]{1,0} parameter(0)
  %go = pred[] parameter(1)
  %first = f32[64,64]{1,0} dot(%x, %x), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %more = f32[64,64]{1,0} conditional(%go, %first, %first), true_computation=%run, false_computation=%skip, metadata={op_name="jit(step)/shard_map/moe_overflow_round/cond"}
}
"""  # noqa: E501


def test_moe_rounds_past_the_first_count_in_the_upper_bound_only():
    """A conditional under OVERFLOW_SCOPE (the MoE's rounds past the first): the estimate
    and the lower bound leave its branches out, the upper bound counts them (here one
    dot of 2 x 64^3 FLOPs and 3 x 16 KiB of traffic, the same again as the first)."""
    assert step_model.OVERFLOW_SCOPE in OVERFLOW
    dot_flops, dot_bytes = 2.0 * 64**3, 3 * 64 * 64 * 4
    acct = step_model.account(OVERFLOW)
    assert (acct.flops, acct.hbm_bytes) == (dot_flops, dot_bytes)
    assert (acct.every_round.flops, acct.every_round.hbm_bytes) == (2 * dot_flops, 2 * dot_bytes)
    chip = hardware.Chip(1e12, None, 1e9, ici_bandwidth=4e9)
    e = step_model.estimate(acct, chip)
    assert e["step_s"] == pytest.approx(max(dot_flops / 1e12, dot_bytes / 1e9), rel=1e-12)
    assert e["step_lower_s"] == e["step_s"]
    assert e["step_upper_s"] == pytest.approx(2 * (dot_flops / 1e12 + dot_bytes / 1e9), rel=1e-12)
    assert any("counted in the upper bound" in n for n in acct.notes)
    # Unnamed, the same conditional counts everywhere, as if it ran.
    plain = step_model.account(OVERFLOW.replace("moe_overflow_round/", ""))
    assert plain.every_round is None and plain.hbm_bytes == 2 * dot_bytes


NESTED_PASS_THROUGH = """HloModule nested_pass_through

%as_is (p0: bf16[256,128]) -> bf16[256,128] {
  %p0 = bf16[256,128]{1,0} parameter(0)
  ROOT %b0 = bf16[256,128]{1,0} bitcast(%p0)
}

%first_rows (q0: bf16[256,128]) -> bf16[8,128] {
  %q0 = bf16[256,128]{1,0} parameter(0)
  ROOT %s0 = bf16[8,128]{1,0} slice(%q0), slice={[0:8], [0:128]}
}

%bias_grad (onehot: bf16[256,8], g: bf16[256,128]) -> f32[8,128] {
  %onehot = bf16[256,8]{1,0} parameter(0)
  %g = bf16[256,128]{1,0} parameter(1)
  %gb = bf16[256,128]{1,0} fusion(%g), kind=kLoop, calls=%as_is
  ROOT %conv = f32[8,128]{1,0} convolution(%onehot, %gb), dim_labels=fb_io->bf
}

%head (r0: bf16[256,128]) -> bf16[8,128] {
  %r0 = bf16[256,128]{1,0} parameter(0)
  ROOT %h0 = bf16[8,128]{1,0} fusion(%r0), kind=kLoop, calls=%first_rows
}

ENTRY %main (onehot: bf16[256,8], g: bf16[256,128]) -> (f32[8,128], bf16[8,128]) {
  %onehot = bf16[256,8]{1,0} parameter(0)
  %g = bf16[256,128]{1,0} parameter(1)
  %f = f32[8,128]{1,0} fusion(%onehot, %g), kind=kOutput, calls=%bias_grad
  %h = bf16[8,128]{1,0} fusion(%g), kind=kLoop, calls=%head
  ROOT %t = (f32[8,128]{1,0}, bf16[8,128]{1,0}) tuple(%f, %h)
}
"""  # noqa: E501


def test_a_nested_fusion_passing_its_operand_on_counts_the_read():
    # The product reads all of g through a nested fusion that only bitcasts it (as XLA:TPU
    # writes a one-hot bias gradient); the other fusion's nested one reads 8 of its rows.
    acct = step_model.account(NESTED_PASS_THROUGH)
    product = 256 * 8 * 2 + 256 * 128 * 2 + 8 * 128 * 4
    head = 8 * 128 * 2 + 8 * 128 * 2
    assert acct.hbm_bytes == product + head


@pytest.mark.parametrize(
    "attrs, groups",
    [
        ("replica_groups={{0,1},{2,3}}", [[0, 1], [2, 3]]),
        ("replica_groups={}", [[0, 1, 2, 3]]),
        ("replica_groups=[2,4]<=[8]", [[0, 1, 2, 3], [4, 5, 6, 7]]),
        # iota(8) as [2, 4], transposed: [[0,4],[1,5],[2,6],[3,7]], cut in groups of 2
        ("replica_groups=[4,2]<=[2,4]T(1,0)", [[0, 4], [1, 5], [2, 6], [3, 7]]),
        ("replica_groups=[2,4]<=[2,2,2]T(2,1,0)", [[0, 4, 2, 6], [1, 5, 3, 7]]),
        ("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}", [[0, 4], [1, 5], [2, 6], [3, 7]]),
        ("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}", [[0, 1, 2, 3], [4, 5, 6, 7]]),
        # a sub-axis: 'a' of 8 as [2, 2, 2], the middle 2 grouped
        ("replica_groups=mesh['a'=8] {'a':(2)2}", [[0, 2], [1, 3], [4, 6], [5, 7]]),
        ("replica_groups=mesh['a'=2,'b'=2], device_ids=(3,2,1,0) {'a'}", [[3, 1], [2, 0]]),
        # device ids as iota shaped [2, 2] and transposed: 0, 2, 1, 3
        ("replica_groups=mesh['a'=2,'b'=2], device_ids=([2,2]T(1,0)) {'a'}", [[0, 1], [2, 3]]),
        ("source_target_pairs={{0,1},{1,2}}", [[0, 1], [1, 2]]),
    ],
)
def test_replica_group_syntaxes(attrs, groups):
    assert hlo_text.replica_groups(attrs + ", use_global_device_ids=true", 4) == groups


def test_groups_map_to_the_mesh_axes_they_span():
    mesh = hlo_text.MeshSpec(("data", "model"), (2, 4))
    assert hlo_text.mesh_axes([[0, 4], [1, 5]], mesh) == ("data",)
    assert hlo_text.mesh_axes([[0, 1, 2, 3]], mesh) == ("model",)
    assert hlo_text.mesh_axes([[0, 1, 4, 5]], mesh) == ("data", "model")
    assert hlo_text.mesh_axes([[0, 8]], mesh) is None  # not this mesh's program


def test_estimate_is_the_stated_formula(program):
    chip = hardware.Chip(1e12, None, 1e9, ici_bandwidth=4e9, dcn_bandwidth=1e8)
    acct = step_model.account(program, MESH)
    link = TRIPS * (2 * 3 / 4 * PSUM_BYTES + GATHER_BYTES / 2)
    step = max(acct.flops / 1e12, acct.hbm_bytes / 1e9) + link / 2e9  # one way: half of ICI
    e = step_model.estimate(acct, chip, model_flops=3e4, tokens=100)
    assert e["step_s"] == pytest.approx(step, rel=1e-12)
    assert e["mfu"] == pytest.approx(3e4 / step / 1e12, rel=1e-12)
    assert e["tokens_per_s_per_chip"] == pytest.approx(100 / step, rel=1e-12)
    # Two slices along "data": the gather crosses them and is timed at the DCN figure.
    sliced = hlo_text.MeshSpec(("data", "model"), (2, 4), slice_ids=(0,) * 4 + (1,) * 4)
    e = step_model.estimate(step_model.account(program, sliced), chip)
    assert e["dcn_s"] == pytest.approx(TRIPS * GATHER_BYTES / 2 / 1e8, rel=1e-12)
    assert e["ici_s"] == pytest.approx(TRIPS * 1.5 * PSUM_BYTES / 2e9, rel=1e-12)
    # No interconnect figure: no step time, and the estimate says why.
    e = step_model.estimate(acct, hardware.Chip(1e12, None, 1e9))
    assert e["step_s"] is None and any("no interconnect figure" in n for n in e["notes"])


def test_bounds_are_every_part_overlapped_and_none(program):
    """The lower bound is the slowest of compute, HBM and the links (all overlapped), the
    upper one their sum (none overlapped); the single estimate lies between."""
    chip = hardware.Chip(1e12, None, 1e9, ici_bandwidth=4e9, dcn_bandwidth=1e8)
    acct = step_model.account(program, MESH)
    compute, hbm = acct.flops / 1e12, acct.hbm_bytes / 1e9
    ici = TRIPS * (2 * 3 / 4 * PSUM_BYTES + GATHER_BYTES / 2) / 2e9
    e = step_model.estimate(acct, chip)
    assert e["step_lower_s"] == pytest.approx(max(compute, hbm, ici), rel=1e-12)
    assert e["step_upper_s"] == pytest.approx(compute + hbm + ici, rel=1e-12)
    assert e["step_lower_s"] <= e["step_s"] <= e["step_upper_s"]
    assert e["host_s"] == 0.0
    e = step_model.estimate(acct, hardware.Chip(1e12, None, 1e9))  # no link figures
    assert e["step_lower_s"] is None and e["step_upper_s"] is None


def test_host_transfers_count_in_the_bounds_only_at_a_stated_bandwidth():
    """SPARSE_CORE offloads 1,024 bytes a step: without a host figure the upper bound is
    unknown and the lower one leaves them out; at a stated figure (a chip's, shared by
    its devices) both count them; the single estimate never does."""
    acct = step_model.account(SPARSE_CORE, hlo_text.MeshSpec(("fsdp",), (4,)))
    chip = hardware.Chip(1e6, None, 1e6, ici_bandwidth=1e6, devices_per_chip=2)
    e = step_model.estimate(acct, chip)
    parts = [e["compute_s"], e["hbm_s"], e["ici_s"], e["dcn_s"]]
    assert e["step_upper_s"] is None and e["step_lower_s"] == pytest.approx(max(parts))
    assert any("no upper bound" in n for n in e["notes"]), e["notes"]
    assert acct.host_bytes == 1024
    slow = 8.0  # bytes/s a chip: 4 a device, so the 1,024 bytes take 256 s
    e = step_model.estimate(acct, chip, host_bandwidth=slow)
    assert e["host_s"] == pytest.approx(256.0)
    assert e["step_lower_s"] == pytest.approx(256.0)
    assert e["step_upper_s"] == pytest.approx(sum(parts) + 256.0)
    assert e["step_s"] == pytest.approx(max(parts[:2]) + parts[2] + parts[3])
    # charged afterwards on a result (aot_compile --host_gbps): the same bounds
    result = {"device_kind": "TPU7x", "estimate": step_model.estimate(acct, hardware.chip("TPU7x"))}
    step_model.charge_host(result, 8e-9)
    want = step_model.estimate(acct, hardware.chip("TPU7x"), host_bandwidth=8.0)
    assert {k: result["estimate"][k] for k in want} == want


def test_a_chip_shown_as_two_devices_splits_its_figures(program):
    """TPU7x: libtpu shows each chip as two devices; the account is one device's, so the
    device gets half the chip's peak and HBM bandwidth and half its share of the links,
    and a chip's tokens/s is two devices'."""
    tpu7x = hardware.chip("TPU7x")
    assert tpu7x.devices_per_chip == 2
    assert tpu7x.peak_flops == 2307e12 / 2 and tpu7x.hbm_bandwidth == 7.38e12 / 2
    assert tpu7x.hbm_bytes == 96 * hardware.GiB and tpu7x.ici_bandwidth == 1200e9
    two = hardware.Chip(1e12, None, 1e9, ici_bandwidth=4e9, dcn_bandwidth=1e8, devices_per_chip=2)
    acct = step_model.account(program, MESH)
    link = TRIPS * (2 * 3 / 4 * PSUM_BYTES + GATHER_BYTES / 2)
    step = max(acct.flops / 1e12, acct.hbm_bytes / 1e9) + link / 1e9  # a quarter of ICI
    e = step_model.estimate(acct, two, model_flops=3e4, tokens=100)
    assert e["step_s"] == pytest.approx(step, rel=1e-12)
    assert e["tokens_per_s_per_chip"] == pytest.approx(200 / step, rel=1e-12)
    assert e["mfu"] == pytest.approx(3e4 / step / 1e12, rel=1e-12)


# The forms of TPU7x programs built with libtpu's SparseCore and host-offload flags (as
# MaxText's recipes set them), by hand: in a loop of 2 trips, an all-gather the
# SparseCores run, in a computation an async call-start calls (announced by
# PrepareAsyncCall markers); a Pallas kernel that declares its cost estimate; and a
# layer input sent to host memory `S(5)` and brought back, by copies and by async
# slice updates into (and slices out of) a buffer held there, as remat offload does.
SPARSE_CORE = """HloModule sparse_core, num_partitions=4

%sc_gather (w: f32[2,8], tk: token[]) -> f32[8,8] {
  %tk = token[] parameter(1)
  %w = f32[2,8]{1,0} parameter(0)
  ROOT %ag = f32[8,8]{1,0} all-gather(%w), channel_id=3, replica_groups=mesh['axis_0'=4] {'axis_0'}, dimensions={0}, use_global_device_ids=true, backend_config={"device_type":"DEVICE_TYPE_SPARSECORE"}
}, execution_thread="sparsecore"

%body (t: (s32[], f32[2,8], f32[4,8])) -> (s32[], f32[2,8], f32[4,8]) {
  %t = (s32[]{:S(1)}, f32[2,8]{1,0}, f32[4,8]{1,0}) parameter(0)
  %i = s32[]{:S(1)} get-tuple-element(%t), index=0
  %one = s32[]{:S(1)} constant(1)
  %next = s32[]{:S(1)} add(%i, %one)
  %w = f32[2,8]{1,0} get-tuple-element(%t), index=1
  %x = f32[4,8]{1,0} get-tuple-element(%t), index=2
  %ps = s32[]{:S(2)} custom-call(), custom_call_target="PrepareAsyncCallStart"
  %pd = token[] custom-call(%ps), custom_call_target="PrepareAsyncCallDone"
  %cs = ((f32[2,8]{1,0}, token[]), f32[8,8]{1,0}) call-start(%w, %pd), async_execution_thread="sparsecore", to_apply=%sc_gather
  %cd = f32[8,8]{1,0} call-done(%cs)
  %off = (f32[4,8]{1,0:S(5)}, f32[4,8]{1,0}, u32[]{:S(2)}) copy-start(%x)
  %on_host = f32[4,8]{1,0:S(5)} copy-done(%off)
  %back = (f32[4,8]{1,0}, f32[4,8]{1,0:S(5)}, u32[]{:S(2)}) copy-start(%on_host)
  %x2 = f32[4,8]{1,0} copy-done(%back)
  %hb = f32[3,4,8]{2,1,0:S(5)} custom-call(), custom_call_target="AllocateBuffer"
  %z = s32[]{:S(1)} constant(0)
  %x3 = f32[1,4,8]{2,1,0} bitcast(%x2)
  %dus = ((f32[3,4,8]{2,1,0:S(5)}, f32[1,4,8]{2,1,0}, s32[]{:S(1)}, s32[]{:S(1)}, s32[]{:S(1)}), f32[3,4,8]{2,1,0:S(5)}, u32[]{:S(2)}) dynamic-update-slice-start(%hb, %x3, %i, %z, %z)
  %stored = f32[3,4,8]{2,1,0:S(5)} dynamic-update-slice-done(%dus)
  %dss = ((f32[3,4,8]{2,1,0:S(5)}, s32[]{:S(1)}, s32[]{:S(1)}, s32[]{:S(1)}), f32[1,4,8]{2,1,0}, u32[]{:S(2)}) dynamic-slice-start(%stored, %i, %z, %z), dynamic_slice_sizes={1,4,8}
  %loaded = f32[1,4,8]{2,1,0} dynamic-slice-done(%dss)
  %attn.4 = f32[4,8]{1,0} custom-call(%x2, %cd), custom_call_target="tpu_custom_call", backend_config={"custom_call_config":{"body":"...","cost_estimate":{"flops":"1000","transcendentals":"64","bytes_accessed":"384","remote_bytes_transferred":"0"}}}
  ROOT %out = (s32[]{:S(1)}, f32[2,8]{1,0}, f32[4,8]{1,0}) tuple(%next, %w, %attn.4)
}

%cond (c: (s32[], f32[2,8], f32[4,8])) -> pred[] {
  %c = (s32[]{:S(1)}, f32[2,8]{1,0}, f32[4,8]{1,0}) parameter(0)
  %ci = s32[]{:S(1)} get-tuple-element(%c), index=0
  %n = s32[]{:S(1)} constant(2)
  ROOT %lt = pred[]{:S(1)} compare(%ci, %n), direction=LT
}

ENTRY %main (w: f32[2,8], x: f32[4,8]) -> f32[4,8] {
  %w = f32[2,8]{1,0} parameter(0)
  %x = f32[4,8]{1,0} parameter(1)
  %i0 = s32[]{:S(1)} constant(0)
  %init = (s32[]{:S(1)}, f32[2,8]{1,0}, f32[4,8]{1,0}) tuple(%i0, %w, %x)
  %loop = (s32[]{:S(1)}, f32[2,8]{1,0}, f32[4,8]{1,0}) while(%init), condition=%cond, body=%body
  ROOT %r = f32[4,8]{1,0} get-tuple-element(%loop), index=2
}
"""  # noqa: E501


def test_sparse_core_collectives_declared_kernel_costs_and_host_offload():
    acct = step_model.account(SPARSE_CORE, hlo_text.MeshSpec(("fsdp",), (4,)))
    assert [(lp.trip_count, lp.source) for lp in acct.loops] == [(2, "condition")]
    # the SparseCores' all-gather: f32 [8, 8] gathered over 4 devices, twice
    assert _collectives(acct) == [("all-gather", 8 * 8 * 4, 4, ("fsdp",), 2, 3 / 4 * 256)]
    assert [c.sparse_core for c in acct.collectives] == [True]
    assert any("1 collective(s) run on the SparseCores" in n for n in acct.notes), acct.notes
    # the kernel's own declared FLOPs, per run
    assert [(c.kernel, c.flops, c.runs) for c in acct.custom_calls] == [("attn", 1000.0, 2)]
    assert acct.flops == acct.custom_call_flops == 2 * 1000
    # host offload: [4, 8] f32 out and back, each trip, twice (copies, slices); apart
    # from HBM traffic
    assert acct.host_bytes == 2 * 2 * 2 * 4 * 8 * 4
    # HBM a trip: the gather reads its [2, 8] share and writes [8, 8] (the call-start and
    # -done and the markers move nothing of their own); each way to host reads [4, 8] of
    # HBM, each way back writes it; the kernel reads [4, 8] and [8, 8] and writes [4, 8]
    per_trip = (2 * 8 + 8 * 8) * 4 + 2 * 2 * 4 * 8 * 4 + (4 * 8 + 8 * 8 + 4 * 8) * 4
    assert acct.hbm_bytes == 2 * per_trip
    e = step_model.estimate(acct, hardware.chip("TPU7x"))
    assert any("host offload" in n and "not charged" in n for n in e["notes"]), e["notes"]


# Two slices of 2 chips: a multi-slice TPU program reduces across slices (DCN) with
# send/recv pairs for the megascale runtime, not with an all-reduce instruction.
TWO_SLICES = """HloModule two_slices, num_partitions=4

ENTRY %main (m: f32[2,8]) -> f32[2,8] {
  %m = f32[2,8]{1,0} parameter(0)
  %tok = token[] after-all()
  %send = (f32[2,8]{1,0}, u32[], token[]) send(%m, %tok), channel_id=7, is_host_transfer=true, frontend_attributes={_xla_megascale_transfer_type="ALL_REDUCE"}
  %recv = (f32[2,8]{1,0}, u32[], token[]) recv(%tok), channel_id=6, is_host_transfer=true, frontend_attributes={_xla_megascale_transfer_type="ALL_REDUCE"}
  %recv-done = (f32[2,8]{1,0}, token[]) recv-done(%recv), channel_id=6, is_host_transfer=true
  %send-done = token[] send-done(%send), channel_id=7, is_host_transfer=true
  ROOT %out = f32[2,8]{1,0} get-tuple-element(%recv-done), index=0
}
"""  # noqa: E501


def test_cross_slice_transfers_are_dcn_collectives():
    mesh = hlo_text.MeshSpec(("data", "fsdp"), (2, 2), slice_ids=(0, 0, 1, 1))
    acct = step_model.account(TWO_SLICES, mesh)
    assert _collectives(acct) == [("all-reduce", 64, 2, ("data",), 1, 64.0)]  # 2(n-1)/n
    assert [c.dcn for c in acct.collectives] == [True]
    assert acct.hbm_bytes == 64 + 64  # the send reads the data, the recv-done writes it


def test_a_bare_json_flag_means_stdout():
    assert _bare_json_to_stdout(["x", "--json"]) == ["x", "--json=-"]
    assert _bare_json_to_stdout(["x", "--json", "--topology=v5e:2x2"])[1] == "--json=-"
    assert _bare_json_to_stdout(["x", "--json", "out.json"]) == ["x", "--json", "out.json"]
    assert _bare_json_to_stdout(["x", "--json=a.json"]) == ["x", "--json=a.json"]


# XLA's memory-usage report (the form libtpu writes, shortened): the first table is the
# temporaries; each table after it is one allocation of an argument.
MEMORY_REPORT = """\
Memory Space: default (color=0)
Total bytes: 3221225472 (3.00GiB)
  cumulative_size;       size;       offset; used_by_n_values; shapes_list
  ------------------------------------------------------------
    2.00GiB( 67%);    2.00GiB;            0;                3; 3×bf16[32,2880,2880]
    2.50GiB( 83%);  512.00MiB;   2147483648;                1; f32[8192,2880]
  The rest 12 values are less than 5% of the total size and not shown.

  cumulative_size;       size;       offset; used_by_n_values; shapes_list
  ------------------------------------------------------------
    1.52GiB(100%);    1.52GiB;            0;                1; u32[12,32,360,2880]

Memory Space: 1 (color=1)
Total bytes: 1024 (1.00KiB)
"""


def test_memory_report_lists_the_temporaries_only(tmp_path):
    (tmp_path / "module_0001.jit_train_step.memory-usage-report.txt").write_text(MEMORY_REPORT)
    total, rows = memory_report(str(tmp_path), 5)
    assert total == 3 * 2**30
    assert [r.split()[0] for r in rows] == ["2.00GiB", "512.00MiB"]  # not the argument's


def test_maxtext_names_a_slice_by_its_chips_or_cores():
    assert maxtext_topology("v5e:16x16") == "v5e-256"
    assert maxtext_topology("v6e:8x8") == "v6e-64"
    assert maxtext_topology("v5p:8x8x8") == "v5p-1024"  # two TensorCores a chip
    assert maxtext_topology("tpu7x:4x4x4") == "tpu7x-128"


def test_dilated_window_taps_counted_in_closed_form():
    """The (output, kernel) pairs of a dilated convolution window that land on input
    elements, in closed form (a weight gradient written as a convolution can dilate by
    tens of thousands), equal a count over every position."""
    rng = np.random.RandomState(0)
    for _ in range(3000):
        lo, n, c = int(rng.randint(0, 20)), int(rng.randint(0, 50)), int(rng.randint(-30, 30))
        stride, dil = int(rng.randint(1, 9)), int(rng.randint(1, 12))
        want = sum(((lo + j) * stride + c) % dil == 0 for j in range(n))
        assert _landing(lo, n, stride, c, dil) == want, (lo, n, stride, c, dil)
