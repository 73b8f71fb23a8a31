"""kernels/outer_product_update.py: the shared matrix-state kernel of mlstm_step and retention_step over a step's
sequences, against its reference (sequences of 0, 1, 2 and 5 rows, empty sequences, padding rows; one and several
d chunks), against row-at-a-time calls bit for bit, with 16-bit state rounded once per sequence, and the reference
against float64 equations. Triton cases run on a GPU when there is one, else under the interpreter in a child
process; full sizes need a GPU."""
import importlib

import pytest
import torch

import kernels
from kernels._common import INTERPRET, plan
from sequence_checks import (Layout, assert_same_bits, check_against_reference, check_against_row_at_a_time,
                             check_half_state, poison)
from test_kernels import assert_close
from test_state_storage import assert_alike, assert_within_one_ulp

HAS_CUDA = torch.cuda.is_available()
RUNS_TRITON = INTERPRET or HAS_CUDA
DEVICE = "cuda" if HAS_CUDA and not INTERPRET else "cpu"
runs_triton = pytest.mark.skipif(not RUNS_TRITON, reason="runs in the TRITON_INTERPRET=1 child process")
cuda_only = pytest.mark.skipif(not HAS_CUDA or INTERPRET, reason="needs a CUDA GPU")
outer_module = importlib.import_module("kernels.outer_product_update")  # the package's name is the function's
ROWS = dict(q=0, k=0, v=0, a=0, den=0)
STATES = ("M",)
op = kernels.outer_product_update
ref = kernels.outer_product_update_ref


def make(rows, slots, heads, d_size, e_size, device=DEVICE, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    def rand(*shape):
        return torch.rand(*shape, generator=gen).to(device)

    return dict(M=randn(slots, heads, d_size, e_size), q=randn(rows, heads, d_size).to(dtype),
                k=randn(rows, heads, d_size).to(dtype), v=randn(rows, heads, e_size).to(dtype),
                a=(rand(rows, heads) * 0.5 + 0.5).to(dtype), den=(rand(rows, heads) * 4 + 0.5).to(dtype))


def ragged(layout, dims, **kwargs):
    args = make(layout.rows, layout.slots, *dims, device=layout.device, **kwargs)
    poison(args, STATES, layout.unwritten)
    return args


# (heads, d, e): the value tile is one d chunk at MAX_TILE; the second has several d chunks and value tiles when
# MAX_TILE is cut to 16 x 16
SMALL = [(2, 24, 20), (2, 40, 40)]


def test_reference_matches_equations():
    """A sequence of 3 rows and one of 2 (and an empty one) against the update and readout in float64, row by
    row; the other slots unchanged."""
    heads, d_size, e_size = 2, 4, 3
    layout = Layout(lengths=(3, 0, 2), padding_rows=1, device="cpu")
    args = make(layout.rows, layout.slots, heads, d_size, e_size, device="cpu")
    before = {name: t.clone() for name, t in args.items()}
    out = ref(**args, **layout.plan)
    starts = layout.seq_starts.tolist()
    for s, slot in enumerate(layout.seq_slots.tolist()[:3]):
        M = before["M"][slot].double()
        for row in range(starts[s], starts[s + 1]):
            for h in range(heads):
                a, den = before["a"][row, h].item(), before["den"][row, h].item()
                M[h] = a * M[h] + torch.outer(before["k"][row, h].double(), before["v"][row, h].double())
                assert_close(out[row, h].double(), (before["q"][row, h].double() @ M[h]) / den)
        assert_close(args["M"][slot].double(), M)
    unwritten = layout.unwritten
    assert torch.equal(args["M"][unwritten], before["M"][unwritten])


def test_reference_row_at_a_time():
    layout = Layout(device="cpu")
    check_against_row_at_a_time(ref, ragged(layout, SMALL[0]), STATES, ROWS, layout)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_reference_half_state_rounds_once_per_sequence(dtype, stochastic):
    layout = Layout(device="cpu")
    check_half_state(ref, ragged(layout, SMALL[0]), STATES, "M", layout, dtype, stochastic, assert_alike)


@pytest.mark.parametrize("make_bad,match", [
    (lambda args, plan_: args.update(M=args["M"][0]), r"M must be a \[S, H, D, E\] tensor"),
    (lambda args, plan_: args.update(v=args["v"][..., :-1]), r"v must have shape \[10, 2, 20\]"),
    (lambda args, plan_: args.update(den=args["den"][:, :1]), r"den must have shape \[10, 2\]"),
    (lambda args, plan_: plan_.update(seq_starts=plan_["seq_starts"][:-1]), "seq_starts must have one more entry"),
    (lambda args, plan_: plan_.update(seq_slots=plan_["seq_slots"].long()), "seq_slots must be a one-dimensional"),
], ids=["M-rank", "v-width", "den-heads", "starts-length", "slots-dtype"])
def test_bad_input_is_rejected(make_bad, match):
    layout = Layout(device="cpu")
    args, step = make(layout.rows, layout.slots, *SMALL[0], device="cpu"), dict(layout.plan)
    make_bad(args, step)
    with pytest.raises((ValueError, TypeError), match=match):
        op(**args, **step)


# ---------------------------------------------------------------------------------------------------------
# Triton

INTERPRETER_CASES = "triton_small"  # run on a CPU through the interpreter (tests/triton_interpreter.py)


@pytest.mark.skipif(RUNS_TRITON, reason="this process runs the Triton kernels directly")
def test_triton_under_interpreter(interpreter_cases):
    interpreter_cases.check(__file__)


@runs_triton
@pytest.mark.parametrize("dims", SMALL, ids=["one-chunk", "chunks"])
def test_triton_small_matches_reference(dims, monkeypatch):
    monkeypatch.setattr(outer_module, "MAX_TILE", 16 * 16 if dims == SMALL[1] else outer_module.MAX_TILE)
    layout = Layout(device=DEVICE)
    check_against_reference(op, ref, ragged(layout, dims), STATES, layout, assert_close)


@runs_triton
@pytest.mark.parametrize("dims", SMALL, ids=["one-chunk", "chunks"])
def test_triton_small_row_at_a_time(dims, monkeypatch):
    """A sequence of k rows gives bit for bit what k calls of one row give (the same G, so the same tiling)."""
    monkeypatch.setattr(outer_module, "MAX_TILE", 16 * 16 if dims == SMALL[1] else outer_module.MAX_TILE)
    layout = Layout(device=DEVICE)
    check_against_row_at_a_time(op, ragged(layout, dims), STATES, ROWS, layout)


def test_tiling_of_few_and_many_symbols():
    """The full sizes (8 heads; C 512 x 512, S 256 x 256): one symbol keeps the one-row step's narrow tiles and the
    op's chunk; 64 symbols fill the GPU with 64-column tiles, in chunks of MANY_SYMBOLS_TILE values."""
    tiling = outer_module.tiling
    assert tiling(1, 8, 512, 512, 8192) == (16, 512)
    assert tiling(4, 8, 512, 512, 8192) == (32, 256)
    assert tiling(64, 8, 512, 512, 8192) == (64, 256)  # C in two chunks
    assert tiling(1, 8, 256, 256, 4096) == (16, 256)
    assert tiling(64, 8, 256, 256, 4096) == (64, 256)  # S in one chunk
    assert tiling(1, 8, 512, 512, 8192, block_e=64) == (64, 128)  # a block_e given: the op's chunk, sized for it
    assert tiling(64, 8, 256, 256, 4096, many_symbols_tile=4096) == (64, 64)  # RetNet's S keeps its chunks


@runs_triton
def test_triton_small_many_symbols_tiling(monkeypatch):
    """The many-symbols tiling at small sizes (every grid counted as full; its chunks cut to 64 x 16 values, so
    a 40-row M takes three): against the reference, sequences of 0 to 5 rows."""
    monkeypatch.setattr(importlib.import_module("kernels._common"), "TARGET_PROGRAMS", 1)
    monkeypatch.setattr(outer_module, "MANY_SYMBOLS_TILE", 64 * 16)
    assert outer_module.tiling(3, 2, 40, 40, outer_module.MAX_TILE) == (64, 16)
    layout = Layout(device=DEVICE)
    check_against_reference(op, ref, ragged(layout, SMALL[1]), STATES, layout, assert_close)


@runs_triton
def test_triton_small_half_inputs():
    layout = Layout(device=DEVICE)
    check_against_reference(op, ref, ragged(layout, SMALL[0], dtype=torch.bfloat16), STATES, layout, assert_close)


@runs_triton
def test_triton_small_one_row_per_sequence():
    """Today's step: plan(slots, [1] * B) with padding rows after the sequences."""
    layout = Layout(lengths=(1, 1, 1), padding_rows=2, device=DEVICE)
    check_against_reference(op, ref, ragged(layout, SMALL[0]), STATES, layout, assert_close)


@runs_triton
def test_triton_small_empty_step_touches_nothing():
    args = make(3, 4, *SMALL[0])
    before = args["M"].clone()
    seq_slots, seq_starts = plan([], [], 3, DEVICE)
    op(**args, seq_slots=seq_slots, seq_starts=seq_starts)
    assert_same_bits(args["M"], before, "M")


@runs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("dims", SMALL, ids=["one-chunk", "chunks"])
def test_triton_small_half_state_rounds_once_per_sequence(dtype, stochastic, dims, monkeypatch):
    monkeypatch.setattr(outer_module, "MAX_TILE", 16 * 16 if dims == SMALL[1] else outer_module.MAX_TILE)
    layout = Layout(device=DEVICE)
    check_half_state(op, ragged(layout, dims), STATES, "M", layout, dtype, stochastic, assert_alike, ref=ref,
                     assert_within_one_ulp=assert_within_one_ulp)


# ---------------------------------------------------------------------------------------------------------
# GPU, full sizes: mLSTM's C [8, 512, 512] and RetNet's S [8, 256, 256]; few sequences (one d chunk) and many
# (several d chunks)

FULL = [(8, 512, 512), (8, 256, 256)]
MANY = (1, 2, 0, 5, 1, 3) * 4


@cuda_only
@pytest.mark.parametrize("dims", FULL, ids=["mlstm", "retnet"])
@pytest.mark.parametrize("lengths", [(2, 0, 5, 1), MANY], ids=["few", "many"])
def test_gpu_full_size(dims, lengths):
    layout = Layout(lengths=lengths, device="cuda")
    args = ragged(layout, dims)
    check_against_reference(op, ref, args, STATES, layout, assert_close)
    check_against_row_at_a_time(op, args, STATES, ROWS, layout)


@cuda_only
@pytest.mark.parametrize("dims", FULL, ids=["mlstm", "retnet"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_gpu_half_state_full_size(dims, dtype):
    layout = Layout(lengths=MANY, device="cuda")
    check_half_state(op, ragged(layout, dims), STATES, "M", layout, dtype, True, assert_alike, ref=ref,
                     assert_within_one_ulp=assert_within_one_ulp)


@cuda_only
def test_gpu_cuda_graph_replays_other_plans():
    """Captured for G sequences and B rows; replayed with other lengths (and empty sequences) written into the
    captured seq_slots and seq_starts: the grid depends on G alone."""
    layout = Layout(lengths=(1, 1, 1, 1), padding_rows=2, device="cuda")
    args = make(layout.rows, layout.slots, *FULL[0], device="cuda", seed=3)
    ref_args = {**args, "M": args["M"].clone()}
    step = {name: t.clone() for name, t in layout.plan.items()}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up compiles the kernel outside the capture
        op(**{**args, "M": args["M"].clone()}, **step)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op(**args, **step)
    for lengths in ((1, 1, 1, 1), (4, 0, 2), (0, 0, 0, 6)):
        new = Layout(lengths=lengths, padding_rows=layout.rows - sum(lengths), empty_tail=6 - len(lengths),
                     device="cuda", seed=len(lengths))
        for name in step:
            step[name].copy_(new.plan[name])
        graph.replay()
        expected = ref(**ref_args, **new.plan)
        assert_close(out[:new.live_rows], expected[:new.live_rows])
        assert_close(args["M"], ref_args["M"])
