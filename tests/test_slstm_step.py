"""kernels/slstm_step.py over a step's sequences, one launch per row position (max_rows): sequences of 0, 1, 2 and
5 rows, empty sequences and padding rows against the reference and against row-at-a-time calls with slstm_output
storing y between them (bit for bit), and the reference against float64 equations over a sequence; the same with
fp32 input maps split over fp16 state maps, and all eight maps split (fp32), which must come within a twentieth of
the 16-bit maps' error of the float64 cell. Triton cases run on a GPU when there is one, else under the interpreter in a child process; full
sizes need a GPU. (One row per sequence: tests/test_kernels.py.)"""
import math

import pytest
import torch

import kernels
from kernels._common import INTERPRET, plan
from kernels.skinny_matmul import LO_SCALE
from kernels.slstm_step import pack_weights
from sequence_checks import (Layout, assert_same_bits, assert_within_ulps, check_against_reference,
                             check_against_row_at_a_time, poison)
from test_kernels import FULL_DIMS, assert_close, make_args

HAS_CUDA = torch.cuda.is_available()
RUNS_TRITON = INTERPRET or HAS_CUDA
DEVICE = "cuda" if HAS_CUDA and not INTERPRET else "cpu"
runs_triton = pytest.mark.skipif(not RUNS_TRITON, reason="runs in the TRITON_INTERPRET=1 child process")
# Two ways to the same products (a whole step or one call per row position, the input maps hoisted or not, tiles of
# 16 or 32 sequences): bit for bit on a GPU; within a few ulps under the interpreter, whose numpy sums the gate maps'
# products in an order that follows the block's shape and the host's SIMD (on some CPUs the two ways differ).
SAME_SUMS = assert_within_ulps if INTERPRET else assert_same_bits
cuda_only = pytest.mark.skipif(not HAS_CUDA or INTERPRET, reason="needs a CUDA GPU")
STATES = ("c", "n", "m", "y")
ROWS = dict(xc=0, xn=0)
SMALL = dict(blocks=2, size=40)
op, ref = kernels.slstm_step, kernels.slstm_step_ref


def ragged(layout, dims=SMALL, fresh=False, dtype=torch.float32):
    args = make_args("slstm_step", layout.rows, layout.slots, dims, dtype=dtype, device=layout.device)
    if fresh:  # c = n = y = 0, m = -inf
        for name in ("c", "n", "y"):
            args[name].zero_()
        args["m"].fill_(float("-inf"))
    poison(args, STATES, layout.unwritten)
    return args


SPLITS = ["split", "all-split"]  # fp32 input maps over fp16 state maps; all eight maps fp32


def split(args, kind="split", seed=5):
    """args with new gate maps, packed split (pack_weights) as `kind` says: (args, weight_lo, the fp32 maps
    [2, 4, NB, s, s])."""
    weight = args["weight"]
    gen = torch.Generator(device=weight.device).manual_seed(seed)
    maps = torch.randn(weight.shape, generator=gen, device=weight.device) / math.sqrt(2 * weight.shape[-1])
    state_dtype = torch.float32 if kind == "all-split" else torch.float16
    weight, weight_lo = pack_weights(maps[0], maps[1], torch.float32, state_dtype)
    return {**args, "weight": weight}, weight_lo, maps


def store_y(args, out, rows, step):
    """What the caller does after slstm_step: slstm_output stores each sequence's last y."""
    width = out.shape[1]
    ones = torch.ones(width, device=out.device)
    kernels.slstm_output(out, out, ones, ones, ones, 4, torch.float32, args["y"], **step)


def test_reference_matches_equations():
    """Sequences of 3 and 2 rows (and an empty one) against docs/model/xlstm.md's cell in float64, row by row: a row's
    y_prev is the previous row's output (the inputs to the gate maps rounded to the weights' fp16, as the op
    specifies)."""
    blocks, size = 2, 5
    width = blocks * size
    layout = Layout(lengths=(3, 0, 2), padding_rows=1, device="cpu")
    args = make_args("slstm_step", layout.rows, layout.slots, dict(blocks=blocks, size=size), seed=7)
    before = {name: t.clone() for name, t in args.items()}
    out = ref(**args, **layout.plan, max_rows=3)
    w = before["weight"].double()
    starts = layout.seq_starts.tolist()
    for s, slot in enumerate(layout.seq_slots.tolist()[:3]):
        c, n, m = (before[name][slot].double() for name in ("c", "n", "m"))
        for row in range(starts[s], starts[s + 1]):
            y_prev = (before["y"][slot] if row == starts[s] else out[row - 1]).half().double()
            xc, xn = before["xc"][row].half().double(), before["xn"][row].half().double()
            pre = torch.empty(4, width, dtype=torch.float64)
            for g, x in enumerate((xc, xc, xn, xn)):
                for h in range(blocks):
                    span = slice(h * size, (h + 1) * size)
                    pre[g, span] = w[0, g, h] @ x[span] + w[1, g, h] @ y_prev[span]
                pre[g] += before["bias"][g].double()
            i, f, z, o = pre
            lf = m - torch.log1p(torch.exp(-f))
            m_new = torch.maximum(i, lf)
            i_gate, f_gate = torch.exp(i - m_new), torch.exp(lf - m_new)
            c, n, m = f_gate * c + i_gate * torch.tanh(z), f_gate * n + i_gate, m_new
            assert_close(out[row].double(), torch.sigmoid(o) * c / (n + 1e-6))
        for name, value in (("c", c), ("n", n), ("m", m)):
            assert_close(args[name][slot].double(), value)
    assert torch.equal(args["y"], before["y"])
    for name in STATES:
        assert torch.equal(args[name][layout.unwritten], before[name][layout.unwritten])


def test_reference_row_at_a_time():
    layout = Layout(device="cpu")
    check_against_row_at_a_time(ref, ragged(layout), STATES, ROWS, layout, after_row=store_y,
                                whole_extra=dict(max_rows=5))


def test_reference_refuses_a_sequence_longer_than_max_rows():
    layout = Layout(device="cpu")
    with pytest.raises(ValueError, match="a sequence has 5 rows, more than max_rows=4"):
        ref(**ragged(layout), **layout.plan, max_rows=4)


@pytest.mark.parametrize("max_rows", [0, True, 2.0, None])
def test_bad_max_rows_is_rejected(max_rows):
    layout = Layout(device="cpu")
    with pytest.raises(ValueError, match="max_rows must be a positive int"):
        op(**ragged(layout), **layout.plan, max_rows=max_rows)


def test_pack_weights_splits_fp32_maps():
    maps = torch.randn(2, 4, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    weight, weight_lo = pack_weights(maps[0], maps[1], torch.bfloat16, torch.bfloat16)
    assert weight_lo is None and torch.equal(weight, maps.bfloat16())
    weight, weight_lo = pack_weights(maps[0], maps[1], torch.float32, torch.float16)
    assert weight.dtype == weight_lo.dtype == torch.float16 and weight_lo.shape == maps[0].shape
    assert torch.equal(weight[1], maps[1].half())
    joined = weight[0].double() + weight_lo.double() / LO_SCALE  # about 22 bits of each weight
    assert ((joined - maps[0].double()).abs() <= maps[0].double().abs() * 2.0 ** -21).all()
    weight, weight_lo = pack_weights(maps[0], maps[1], torch.float32, torch.float32)
    assert weight.dtype == weight_lo.dtype == torch.float16 and weight_lo.shape == maps.shape
    joined = weight.double() + weight_lo.double() / LO_SCALE
    assert ((joined - maps.double()).abs() <= maps.double().abs() * 2.0 ** -21).all()
    with pytest.raises(ValueError, match="one dtype, or fp32 input maps and fp16 state maps"):
        pack_weights(maps[0], maps[1], torch.float32, torch.bfloat16)


@pytest.mark.parametrize("kind, change, match", [
    ("split", lambda w, lo: (w.bfloat16(), lo), "split input maps are float16 halves"),
    ("split", lambda w, lo: (w, lo[:3]), r"weight_lo must have shape \[4, 2, 40, 40\]"),
    ("all-split", lambda w, lo: (w, lo[:, :3]), r"weight_lo must have shape \[2, 4, 2, 40, 40\]"),
])
def test_bad_split_weights_are_rejected(kind, change, match):
    layout = Layout(device="cpu")
    args, weight_lo, _ = split(ragged(layout), kind)
    args["weight"], weight_lo = change(args["weight"], weight_lo)
    with pytest.raises(ValueError, match=match):
        op(**args, **layout.plan, max_rows=5, weight_lo=weight_lo)


def float64_cell(args, out, layout, maps, exact_state_maps=False):
    """docs/model/xlstm.md's cell in float64 along each sequence from the states in args: the input maps exact
    (fp32 `maps[0]`) on unrounded x; the state maps exact too where exact_state_maps, else as both paths store
    them (fp16) on y_prev rounded to fp16, y_prev the state y, then the op's own previous output `out` (both then
    round the same y_prev). Returns the rows' outputs and {name: {slot: value}} of c, n, m."""
    blocks, size = maps.shape[2], maps.shape[3]
    w_in, w_state = maps[0].double(), (maps[1] if exact_state_maps else maps[1].half()).double()

    def blockwise(x, w):
        return torch.einsum("hk,hjk->hj", x.double().view(blocks, size), w).reshape(-1)

    expected, states = torch.zeros_like(out, dtype=torch.float64), {"c": {}, "n": {}, "m": {}}
    starts = layout.seq_starts.tolist()
    for s, slot in enumerate(layout.seq_slots.tolist()[:len(layout.lengths)]):
        c, n, m = (args[name][slot].double() for name in ("c", "n", "m"))
        for row in range(starts[s], starts[s + 1]):
            y_prev = args["y"][slot] if row == starts[s] else out[row - 1]
            y_prev = y_prev if exact_state_maps else y_prev.half()
            i, f, z, o = (blockwise(x[row], w_in[g]) + blockwise(y_prev, w_state[g]) + args["bias"][g].double()
                          for g, x in enumerate((args["xc"], args["xc"], args["xn"], args["xn"])))
            lf = m - torch.log1p(torch.exp(-f))
            m_new = torch.maximum(i, lf)
            i_gate, f_gate = torch.exp(i - m_new), torch.exp(lf - m_new)
            c, n, m = f_gate * c + i_gate * torch.tanh(z), f_gate * n + i_gate, m_new
            expected[row] = torch.sigmoid(o) * c / (n + 1e-6)
        if starts[s + 1] > starts[s]:
            for name, value in (("c", c), ("n", n), ("m", m)):
                states[name][slot] = value
    return expected, states


def check_split_near_float64(fn, max_rows, kind="split", dims=SMALL, device="cpu"):
    """fn (the op or its reference) over ragged sequences of up to max_rows rows, an empty sequence and padding
    rows, with fp32 maps split as `kind` says and with the same maps in fp16: against float64_cell (the state maps
    exact for all-split), the split one's error under a twentieth of the fp16 one's and under an absolute bound;
    slots outside the sequences untouched."""
    layout = Layout(lengths=(max_rows, 0, 1, max(max_rows - 1, 1), max_rows), device=device)
    args, weight_lo, maps = split(ragged(layout, dims), kind)
    errors = {}
    for name, weight, lo in (("split", args["weight"], weight_lo), ("fp16", maps.half(), None)):
        run = {**args, "weight": weight, **{state: args[state].clone() for state in STATES}}
        out = fn(**run, **layout.plan, max_rows=max_rows, weight_lo=lo)
        expected, states = float64_cell(args, out, layout, maps, exact_state_maps=kind == "all-split")
        live = slice(0, layout.live_rows)
        errors[name] = max([(out[live].double() - expected[live]).abs().max().item()]
                           + [(run[state][slot].double() - value).abs().max().item()
                              for state, values in states.items() for slot, value in values.items()])
        for state in STATES:
            assert_same_bits(run[state][layout.unwritten], args[state][layout.unwritten], state)
    assert errors["split"] < errors["fp16"] / 20 and errors["split"] < 2e-5, errors


@pytest.mark.parametrize("kind", SPLITS)
@pytest.mark.parametrize("max_rows", [1, 2, 4])
def test_reference_split_maps_near_float64(max_rows, kind):
    check_split_near_float64(ref, max_rows, kind)


# ---------------------------------------------------------------------------------------------------------
# Triton

INTERPRETER_CASES = "triton_small"  # run on a CPU through the interpreter (tests/triton_interpreter.py)


@pytest.mark.skipif(RUNS_TRITON, reason="this process runs the Triton kernels directly")
def test_triton_under_interpreter(interpreter_cases):
    interpreter_cases.check(__file__)


@runs_triton
@pytest.mark.parametrize("fresh", [False, True], ids=["running", "first-step"])
def test_triton_small_matches_reference(fresh):
    layout = Layout(device=DEVICE)
    check_against_reference(op, ref, ragged(layout, fresh=fresh), STATES, layout, assert_close, max_rows=5)


@runs_triton
@pytest.mark.parametrize("kind", SPLITS)
@pytest.mark.parametrize("fresh", [False, True], ids=["running", "first-step"])
def test_triton_small_split_matches_reference(fresh, kind):
    layout = Layout(device=DEVICE)
    args, weight_lo, _ = split(ragged(layout, fresh=fresh), kind)
    check_against_reference(op, ref, args, STATES, layout, assert_close, max_rows=5, weight_lo=weight_lo)


@runs_triton
@pytest.mark.parametrize("kind", SPLITS)
@pytest.mark.parametrize("max_rows", [1, 2, 4])
def test_triton_small_split_near_float64(max_rows, kind):
    check_split_near_float64(op, max_rows, kind, device=DEVICE)


@runs_triton
def test_triton_small_row_at_a_time():
    """A sequence of k rows in k launches gives bit for bit what k calls of one row give, slstm_output storing
    each call's y (the same G, so the same tiling)."""
    layout = Layout(device=DEVICE)
    check_against_row_at_a_time(op, ragged(layout), STATES, ROWS, layout, after_row=store_y,
                                whole_extra=dict(max_rows=5), same=SAME_SUMS)


@runs_triton
@pytest.mark.parametrize("kind", SPLITS)
def test_triton_small_split_row_at_a_time(kind):
    layout = Layout(device=DEVICE)
    args, weight_lo, _ = split(ragged(layout), kind)
    check_against_row_at_a_time(op, args, STATES, ROWS, layout, after_row=store_y, whole_extra=dict(max_rows=5),
                                same=SAME_SUMS, weight_lo=weight_lo)


@runs_triton
@pytest.mark.parametrize("split_maps", [None, *SPLITS])
def test_triton_small_hoisted_input_maps_give_the_same_bits(split_maps):
    """The input maps' part in a launch of its own before the row positions' (a step of several rows a symbol)
    and inside each of them: the same outputs and states, bit for bit, padding rows and other slots untouched."""
    layout = Layout(device=DEVICE)
    args, weight_lo = ragged(layout), None
    if split_maps:
        args, weight_lo, _ = split(args, split_maps)
    runs = []
    for hoist in (False, True):
        run = {**args, **{name: args[name].clone() for name in STATES}}
        runs.append((op(**run, **layout.plan, max_rows=5, weight_lo=weight_lo, hoist_inputs=hoist), run))
    (fused, fused_run), (hoisted, hoisted_run) = runs
    SAME_SUMS(hoisted[:layout.live_rows], fused[:layout.live_rows], "y")
    for name in STATES:
        SAME_SUMS(hoisted_run[name], fused_run[name], name)
        assert_same_bits(hoisted_run[name][layout.unwritten], args[name][layout.unwritten], name)


@runs_triton
def test_triton_small_launches_past_the_longest_sequence_do_nothing():
    layout = Layout(device=DEVICE)
    args = ragged(layout)
    exact = {**args, **{name: args[name].clone() for name in STATES}}
    spare = {**args, **{name: args[name].clone() for name in STATES}}
    live = slice(0, layout.live_rows)
    assert_same_bits(op(**spare, **layout.plan, max_rows=7)[live], op(**exact, **layout.plan, max_rows=5)[live])
    for name in STATES:
        assert_same_bits(spare[name], exact[name], name)


@runs_triton
def test_triton_small_tiles_of_sequences_do_not_change_the_result():
    """40 sequences in tiles of 16 (three tiles, the last one partial) and of 32: the same bits, and the
    reference's values."""
    layout = Layout(lengths=(1, 2, 0, 3) * 10, device=DEVICE)
    args = ragged(layout)
    runs = []
    for block_m in (16, 32):
        run = {**args, **{name: args[name].clone() for name in STATES}}
        runs.append((op(**run, **layout.plan, max_rows=3, block_m=block_m)[:layout.live_rows], run))
    (out16, run16), (out32, run32) = runs
    SAME_SUMS(out16, out32, "y")
    for name in STATES:
        SAME_SUMS(run16[name], run32[name], name)
    check_against_reference(op, ref, args, STATES, layout, assert_close, max_rows=3)


@runs_triton
@pytest.mark.parametrize("split_maps", [None, *SPLITS])
def test_triton_small_empty_step_touches_nothing(split_maps):
    args, weight_lo = make_args("slstm_step", 3, 4, SMALL, device=DEVICE), None
    if split_maps:
        args, weight_lo, _ = split(args, split_maps)
    before = {name: args[name].clone() for name in STATES}
    seq_slots, seq_starts = plan([], [], 3, DEVICE)
    op(**args, seq_slots=seq_slots, seq_starts=seq_starts, max_rows=2, weight_lo=weight_lo)
    for name in STATES:
        assert_same_bits(args[name], before[name], name)


# ---------------------------------------------------------------------------------------------------------
# GPU, full size

@cuda_only
@pytest.mark.parametrize("lengths", [(2, 0, 5, 1), (1, 2, 0, 5, 1, 3) * 4], ids=["few", "many"])
def test_gpu_full_size(lengths):
    layout = Layout(lengths=lengths, device="cuda")
    args = ragged(layout, FULL_DIMS["slstm_step"])
    check_against_reference(op, ref, args, STATES, layout, assert_close, max_rows=5)
    check_against_row_at_a_time(op, args, STATES, ROWS, layout, after_row=store_y, whole_extra=dict(max_rows=5))


@cuda_only
@pytest.mark.parametrize("kind", SPLITS)
@pytest.mark.parametrize("max_rows", [1, 4])
def test_gpu_full_size_split_near_float64(max_rows, kind):
    check_split_near_float64(op, max_rows, kind, FULL_DIMS["slstm_step"], device="cuda")


@cuda_only
def test_gpu_cuda_graph_replays_other_plans():
    """Captured with max_rows = 3 for G sequences; replayed with other lengths of at most 3 rows."""
    layout = Layout(lengths=(1, 1, 1, 1), padding_rows=2, device="cuda")
    args = make_args("slstm_step", layout.rows, layout.slots, FULL_DIMS["slstm_step"], device="cuda", seed=3)
    ref_args = {**args, **{name: args[name].clone() for name in STATES}}
    step = {name: t.clone() for name, t in layout.plan.items()}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up compiles the kernels outside the capture
        op(**{**args, **{name: args[name].clone() for name in STATES}}, **step, max_rows=3)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op(**args, **step, max_rows=3)
    for lengths in ((1, 1, 1, 1), (3, 0, 2), (0, 0, 3, 3)):
        new = Layout(lengths=lengths, padding_rows=layout.rows - sum(lengths), empty_tail=6 - len(lengths),
                     device="cuda", seed=len(lengths))
        for name in step:
            step[name].copy_(new.plan[name])
        graph.replay()
        expected = ref(**ref_args, **new.plan, max_rows=3)
        assert_close(out[:new.live_rows], expected[:new.live_rows])
        for name in ("c", "n", "m"):
            assert_close(args[name], ref_args[name])
