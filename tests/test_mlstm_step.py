"""kernels/mlstm_step.py over a step's sequences: sequences of 0, 1, 2 and 5 rows, empty sequences and padding rows
against the reference and against row-at-a-time calls (bit for bit), 16-bit C rounded once per sequence, and the
reference against float64 equations over a sequence. Triton cases run on a GPU when there is one, else under the
interpreter in a child process; full sizes need a GPU. (One row per sequence: tests/test_kernels.py.)"""
import importlib
import math

import pytest
import torch

import kernels
from kernels._common import INTERPRET
from sequence_checks import (Layout, assert_same_bits, check_against_reference, check_against_row_at_a_time,
                             check_half_state, poison)
from test_kernels import FULL_DIMS, assert_close, make_args
from test_state_storage import assert_alike, assert_within_one_ulp

HAS_CUDA = torch.cuda.is_available()
RUNS_TRITON = INTERPRET or HAS_CUDA
DEVICE = "cuda" if HAS_CUDA and not INTERPRET else "cpu"
runs_triton = pytest.mark.skipif(not RUNS_TRITON, reason="runs in the TRITON_INTERPRET=1 child process")
cuda_only = pytest.mark.skipif(not HAS_CUDA or INTERPRET, reason="needs a CUDA GPU")
STATES = ("C", "n", "m")
ROWS = dict(q=0, k=0, v=0, ip=0, fp=0)
SMALL = dict(heads=2, head_dim=24)
op, ref = kernels.mlstm_step, kernels.mlstm_step_ref
MANY = (1, 2, 0, 5, 1, 3) * 4  # enough sequences at full size for several d chunks of C


def ragged(layout, dims=SMALL, dtype=torch.float32, parts=None):
    args = make_args("mlstm_step", layout.rows, layout.slots, dims, dtype=dtype, device=layout.device)
    if parts:  # the gates as partial sums [P, B, NH], as mlstm_input returns them
        gen = torch.Generator().manual_seed(5)
        for name in ("ip", "fp"):
            extra = torch.randn(parts - 1, *args[name].shape, generator=gen).to(args[name])
            args[name] = torch.cat([args[name][None], extra])
    poison(args, STATES, layout.unwritten)
    return args


def row_dims(args):
    return {**ROWS, "ip": args["ip"].dim() - 2, "fp": args["fp"].dim() - 2}


def test_reference_matches_equations():
    """A sequence of 3 rows (and an empty one, and one of 2) against docs/model/xlstm.md's cell in float64, row by
    row."""
    heads, head_dim = 2, 5
    layout = Layout(lengths=(3, 0, 2), padding_rows=1, device="cpu")
    args = make_args("mlstm_step", layout.rows, layout.slots, dict(heads=heads, head_dim=head_dim), seed=7)
    before = {name: t.clone() for name, t in args.items()}
    out = ref(**args, **layout.plan)
    starts = layout.seq_starts.tolist()
    for s, slot in enumerate(layout.seq_slots.tolist()[:3]):
        for hd in range(heads):
            C, n = before["C"][slot, hd].double(), before["n"][slot, hd].double()
            m = before["m"][slot, hd].item()
            for row in range(starts[s], starts[s + 1]):
                ip, fp = before["ip"][row, hd].item(), before["fp"][row, hd].item()
                lf = -math.log1p(math.exp(-fp))
                m_new = max(ip, m + lf)
                i_gate, f_gate = math.exp(ip - m_new), math.exp(lf + m - m_new)
                q, v = before["q"][row, hd].double(), before["v"][row, hd].double()
                k = before["k"][row, hd].double() / math.sqrt(head_dim)
                C = f_gate * C + i_gate * torch.outer(k, v)
                n = f_gate * n + i_gate * k
                m = m_new
                den = max(abs(float(q @ n)), math.exp(-m)) + 1e-6
                assert_close(out[row, hd].double(), (q @ C) / den)
            assert_close(args["C"][slot, hd].double(), C)
            assert_close(args["n"][slot, hd].double(), n)
            assert args["m"][slot, hd].item() == pytest.approx(m, rel=1e-6)
    for name in STATES:
        assert torch.equal(args[name][layout.unwritten], before[name][layout.unwritten])


def test_reference_row_at_a_time():
    layout = Layout(device="cpu")
    args = ragged(layout)
    check_against_row_at_a_time(ref, args, STATES, row_dims(args), layout)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_reference_sums_16_bit_gate_parts_in_fp32(dtype):
    """16-bit partial sums [P, B, NH] act as their fp32 sum (all math is fp32, as the kernel sums them), not as a
    sum rounded to 16 bits."""
    layout = Layout(device="cpu")
    parts = ragged(layout, dtype=dtype, parts=8)
    summed = {**parts, **{name: parts[name].float().sum(0) for name in ("ip", "fp")}}
    summed.update({name: parts[name].clone() for name in STATES})
    out, expected = ref(**parts, **layout.plan), ref(**summed, **layout.plan)
    live = slice(0, layout.live_rows)
    assert torch.equal(out[live], expected[live])
    for name in STATES:
        assert_same_bits(parts[name], summed[name], name)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_reference_half_state_rounds_once_per_sequence(dtype, stochastic):
    layout = Layout(device="cpu")
    check_half_state(ref, ragged(layout), STATES, "C", layout, dtype, stochastic, assert_alike)


# ---------------------------------------------------------------------------------------------------------
# Triton

INTERPRETER_CASES = "triton_small"  # run on a CPU through the interpreter (tests/triton_interpreter.py)


@pytest.mark.skipif(RUNS_TRITON, reason="this process runs the Triton kernels directly")
def test_triton_under_interpreter(interpreter_cases):
    interpreter_cases.check(__file__)


def _tiles(monkeypatch, chunks):
    """Small tiles force several d chunks and value tiles of C (head size 40)."""
    if chunks:
        monkeypatch.setattr(importlib.import_module("kernels.mlstm_step"), "MAX_TILE", 16 * 16)
    return dict(heads=2, head_dim=40) if chunks else SMALL


@runs_triton
@pytest.mark.parametrize("chunks", [False, True], ids=["one-chunk", "chunks"])
@pytest.mark.parametrize("parts", [None, 3], ids=["gates", "gate-parts"])
def test_triton_small_matches_reference(chunks, parts, monkeypatch):
    layout = Layout(device=DEVICE)
    check_against_reference(op, ref, ragged(layout, _tiles(monkeypatch, chunks), parts=parts), STATES, layout,
                            assert_close)


@runs_triton
@pytest.mark.parametrize("chunks", [False, True], ids=["one-chunk", "chunks"])
def test_triton_small_row_at_a_time(chunks, monkeypatch):
    """A sequence of k rows gives bit for bit what k calls of one row give (the same G, so the same tiling)."""
    layout = Layout(device=DEVICE)
    args = ragged(layout, _tiles(monkeypatch, chunks), parts=2)
    check_against_row_at_a_time(op, args, STATES, row_dims(args), layout)


@runs_triton
def test_triton_small_half_inputs():
    layout = Layout(device=DEVICE)
    check_against_reference(op, ref, ragged(layout, dtype=torch.bfloat16), STATES, layout, assert_close)


@runs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_triton_small_half_state_rounds_once_per_sequence(dtype, stochastic):
    layout = Layout(device=DEVICE)
    check_half_state(op, ragged(layout), STATES, "C", layout, dtype, stochastic, assert_alike, ref=ref,
                     assert_within_one_ulp=assert_within_one_ulp)


# ---------------------------------------------------------------------------------------------------------
# GPU, full size

@cuda_only
@pytest.mark.parametrize("lengths", [(2, 0, 5, 1), MANY], ids=["few", "many"])
def test_gpu_full_size(lengths):
    layout = Layout(lengths=lengths, device="cuda")
    args = ragged(layout, FULL_DIMS["mlstm_step"], parts=4)
    check_against_reference(op, ref, args, STATES, layout, assert_close)
    check_against_row_at_a_time(op, args, STATES, row_dims(args), layout)


@cuda_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_gpu_half_state_full_size(dtype):
    layout = Layout(lengths=MANY, device="cuda")
    check_half_state(op, ragged(layout, FULL_DIMS["mlstm_step"]), STATES, "C", layout, dtype, True, assert_alike,
                     ref=ref, assert_within_one_ulp=assert_within_one_ulp)
