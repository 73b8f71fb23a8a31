"""kernels/slstm_step.py over a step's sequences, one launch per row position (max_rows): sequences of 0, 1, 2 and
5 rows, empty sequences and padding rows against the reference and against row-at-a-time calls with slstm_output
storing y between them (bit for bit), and the reference against float64 equations over a sequence. Triton cases
run on a GPU when there is one, else under the interpreter in a child process; full sizes need a GPU. (One row per
sequence: tests/test_kernels.py.)"""
import math

import pytest
import torch

import kernels
from kernels._common import INTERPRET, plan
from sequence_checks import Layout, assert_same_bits, check_against_reference, check_against_row_at_a_time, poison
from test_kernels import FULL_DIMS, assert_close, make_args
from triton_interpreter import run_under_interpreter

HAS_CUDA = torch.cuda.is_available()
RUNS_TRITON = INTERPRET or HAS_CUDA
DEVICE = "cuda" if HAS_CUDA and not INTERPRET else "cpu"
runs_triton = pytest.mark.skipif(not RUNS_TRITON, reason="runs in the TRITON_INTERPRET=1 child process")
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


# ---------------------------------------------------------------------------------------------------------
# Triton

@pytest.mark.skipif(RUNS_TRITON, reason="this process runs the Triton kernels directly")
def test_triton_under_interpreter():
    run_under_interpreter(__file__, "triton_small")


@runs_triton
@pytest.mark.parametrize("fresh", [False, True], ids=["running", "first-step"])
def test_triton_small_matches_reference(fresh):
    layout = Layout(device=DEVICE)
    check_against_reference(op, ref, ragged(layout, fresh=fresh), STATES, layout, assert_close, max_rows=5)


@runs_triton
def test_triton_small_row_at_a_time():
    """A sequence of k rows in k launches gives bit for bit what k calls of one row give, slstm_output storing
    each call's y (the same G, so the same tiling)."""
    layout = Layout(device=DEVICE)
    check_against_row_at_a_time(op, ragged(layout), STATES, ROWS, layout, after_row=store_y,
                                whole_extra=dict(max_rows=5))


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
def test_triton_small_empty_step_touches_nothing():
    args = make_args("slstm_step", 3, 4, SMALL, device=DEVICE)
    before = {name: args[name].clone() for name in STATES}
    seq_slots, seq_starts = plan([], [], 3, DEVICE)
    op(**args, seq_slots=seq_slots, seq_starts=seq_starts, max_rows=2)
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
