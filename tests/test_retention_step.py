"""kernels/retention_step.py over a step's sequences: sequences of 0, 1, 2 and 5 rows, empty sequences and padding
rows against the reference and against row-at-a-time calls (bit for bit), 16-bit S rounded once per sequence, and
the reference against float64 equations over a sequence. Triton cases run on a GPU when there is one, else under
the interpreter in a child process; full sizes need a GPU. (One row per sequence: tests/test_kernels.py.)"""
import importlib
import math

import pytest
import torch

import kernels
from kernels._common import INTERPRET
from sequence_checks import Layout, check_against_reference, check_against_row_at_a_time, check_half_state, poison
from test_kernels import FULL_DIMS, assert_close, make_args
from test_state_storage import assert_alike, assert_within_one_ulp

HAS_CUDA = torch.cuda.is_available()
RUNS_TRITON = INTERPRET or HAS_CUDA
DEVICE = "cuda" if HAS_CUDA and not INTERPRET else "cpu"
runs_triton = pytest.mark.skipif(not RUNS_TRITON, reason="runs in the TRITON_INTERPRET=1 child process")
cuda_only = pytest.mark.skipif(not HAS_CUDA or INTERPRET, reason="needs a CUDA GPU")
STATES = ("S", "scale", "offset")
ROWS = dict(q=0, k=0, v=0)
SMALL = dict(heads=3, head_dim=10)
op, ref = kernels.retention_step, kernels.retention_step_ref
MANY = (1, 2, 0, 5, 1, 3) * 4  # enough sequences at full size for several d chunks of S


def ragged(layout, dims=SMALL, dtype=torch.float32):
    args = make_args("retention_step", layout.rows, layout.slots, dims, dtype=dtype, device=layout.device)
    poison(args, STATES, layout.unwritten)
    return args


def test_reference_matches_equations():
    """A sequence of 3 rows (and an empty one, and one of 2) against docs/model/retnet.md's retention in float64, row
    by row: the offset advancing by one per row."""
    heads, head_dim = 2, 6
    layout = Layout(lengths=(3, 0, 2), padding_rows=1, device="cpu")
    args = make_args("retention_step", layout.rows, layout.slots, dict(heads=heads, head_dim=head_dim), seed=7)
    before = {name: t.clone() for name, t in args.items()}
    out = ref(**args, **layout.plan)
    starts = layout.seq_starts.tolist()

    def rotary(u, theta):
        rotated = torch.empty_like(u)
        for j in range(head_dim // 2):
            a0, a1 = u[2 * j], u[2 * j + 1]
            rotated[2 * j] = a0 * math.cos(theta[2 * j]) - a1 * math.sin(theta[2 * j])
            rotated[2 * j + 1] = a1 * math.cos(theta[2 * j + 1]) + a0 * math.sin(theta[2 * j + 1])
        return rotated

    for s, slot in enumerate(layout.seq_slots.tolist()[:3]):
        offset = before["offset"][slot].item()
        for hd in range(heads):
            S, scale = before["S"][slot, hd].double(), before["scale"][slot, hd].item()
            decay = before["decay"][hd].item()
            for j, row in enumerate(range(starts[s], starts[s + 1])):
                theta = (torch.tensor(float(offset + j)) * before["angle"]).double()  # fp32, as docs/model/retnet.md
                q_rot = rotary(before["q"][row, hd].double(), theta)
                k_rot = rotary(before["k"][row, hd].double() / math.sqrt(head_dim), theta)
                S = S * decay + torch.outer(k_rot, before["v"][row, hd].double())
                scale = scale * decay + 1
                assert_close(out[row, hd].double(), (q_rot @ S) / math.sqrt(scale))
            assert_close(args["S"][slot, hd].double(), S)
            assert args["scale"][slot, hd].item() == pytest.approx(scale, rel=1e-6)
        assert args["offset"][slot].item() == offset + starts[s + 1] - starts[s]
    for name in STATES:
        assert torch.equal(args[name][layout.unwritten], before[name][layout.unwritten])


def test_reference_row_at_a_time():
    layout = Layout(device="cpu")
    check_against_row_at_a_time(ref, ragged(layout), STATES, ROWS, layout)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_reference_half_state_rounds_once_per_sequence(dtype, stochastic):
    layout = Layout(device="cpu")
    check_half_state(ref, ragged(layout), STATES, "S", layout, dtype, stochastic, assert_alike)


# ---------------------------------------------------------------------------------------------------------
# Triton

INTERPRETER_CASES = "triton_small"  # run on a CPU through the interpreter (tests/triton_interpreter.py)


@pytest.mark.skipif(RUNS_TRITON, reason="this process runs the Triton kernels directly")
def test_triton_under_interpreter(interpreter_cases):
    interpreter_cases.check(__file__)


def _tiles(monkeypatch, chunks):
    """Small tiles force several d chunks and value tiles of S (head size 40)."""
    if chunks:
        monkeypatch.setattr(importlib.import_module("kernels.retention_step"), "MAX_TILE", 16 * 16)
    return dict(heads=2, head_dim=40) if chunks else SMALL


@runs_triton
@pytest.mark.parametrize("chunks", [False, True], ids=["one-chunk", "chunks"])
def test_triton_small_matches_reference(chunks, monkeypatch):
    layout = Layout(device=DEVICE)
    check_against_reference(op, ref, ragged(layout, _tiles(monkeypatch, chunks)), STATES, layout, assert_close)


@runs_triton
@pytest.mark.parametrize("chunks", [False, True], ids=["one-chunk", "chunks"])
def test_triton_small_row_at_a_time(chunks, monkeypatch):
    """A sequence of k rows gives bit for bit what k calls of one row give (the same G, so the same tiling)."""
    layout = Layout(device=DEVICE)
    check_against_row_at_a_time(op, ragged(layout, _tiles(monkeypatch, chunks)), STATES, ROWS, layout)


@runs_triton
def test_triton_small_half_inputs():
    layout = Layout(device=DEVICE)
    check_against_reference(op, ref, ragged(layout, dtype=torch.bfloat16), STATES, layout, assert_close)


@runs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_triton_small_half_state_rounds_once_per_sequence(dtype, stochastic):
    layout = Layout(device=DEVICE)
    check_half_state(op, ragged(layout), STATES, "S", layout, dtype, stochastic, assert_alike, ref=ref,
                     assert_within_one_ulp=assert_within_one_ulp)


# ---------------------------------------------------------------------------------------------------------
# GPU, full size

@cuda_only
@pytest.mark.parametrize("lengths", [(2, 0, 5, 1), MANY], ids=["few", "many"])
def test_gpu_full_size(lengths):
    layout = Layout(lengths=lengths, device="cuda")
    args = ragged(layout, FULL_DIMS["retention_step"])
    check_against_reference(op, ref, args, STATES, layout, assert_close)
    check_against_row_at_a_time(op, args, STATES, ROWS, layout)


@cuda_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_gpu_half_state_full_size(dtype):
    layout = Layout(lengths=MANY, device="cuda")
    check_half_state(op, ragged(layout, FULL_DIMS["retention_step"]), STATES, "S", layout, dtype, True, assert_alike,
                     ref=ref, assert_within_one_ulp=assert_within_one_ulp)
