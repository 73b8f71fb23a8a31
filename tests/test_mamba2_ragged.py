"""kernels/mamba2_update.py with several rows per sequence (seq_slots, seq_starts): the Triton kernel against the
reference and against row-at-a-time calls of itself (tests/ragged_checks.py; on a CPU through the interpreter, in
a child process), a 16-bit h held in fp32 through a sequence's rows and rounded once at the store, the reference
against float64 equations over a sequence, and a bad plan."""
import math

import pytest
import torch

import kernels
from kernels._common import INTERPRET, next_pow2, plan
from kernels.mamba2_update import SEVERAL_ROWS_WARPS
from kernels.state_rounding import StochasticRounding, round_ref, stochastic_bits_ref
from ragged_checks import (PADDING_SLOT, SLOTS, RaggedOp, assert_close, assert_same_bits, check_against_reference,
                           check_cuda_graph, check_kept, check_row_at_a_time, layout, live_rows, poison,
                           written_slots)
from test_state_storage import assert_within_one_ulp

HAS_CUDA = torch.cuda.is_available()
RUNS_TRITON = INTERPRET or HAS_CUDA
DEVICE = "cuda" if HAS_CUDA and not INTERPRET else "cpu"
runs_triton = pytest.mark.skipif(not RUNS_TRITON, reason="runs in the TRITON_INTERPRET=1 child process")
cuda_only = pytest.mark.skipif(not HAS_CUDA or INTERPRET, reason="needs a CUDA GPU")
ROW_INPUTS = ("x", "t", "b", "c")
SMALL = dict(heads=3, head_dim=6, state_dim=10, hidden=20)
FULL = dict(heads=64, head_dim=64, state_dim=128, hidden=2048)


def spec(heads, head_dim, state_dim, hidden, dtype=torch.float32):
    def make(rows, slots, seed, device):
        g = torch.Generator().manual_seed(seed)

        def randn(*shape):
            return torch.randn(*shape, generator=g)
        args = dict(h=randn(slots, heads, head_dim, state_dim), x=randn(rows, heads, head_dim).to(dtype),
                    t=randn(rows, hidden).to(dtype), dt_weight=(randn(heads, hidden) * 2 / math.sqrt(hidden)).to(dtype),
                    dt_bias=randn(heads).to(dtype), a=(-(torch.rand(heads, generator=g) * 15 + 1)).to(dtype),
                    b=randn(rows, state_dim).to(dtype), c=randn(rows, state_dim).to(dtype), d=randn(heads).to(dtype))
        return {k: v.to(device) for k, v in args.items()}
    return RaggedOp(kernels.mamba2_state_update, kernels.mamba2_state_update_ref, make, ("h",), ROW_INPUTS,
                    lambda out, args: [out])


def several_rows_tiling(dims):
    """The tiling of a step of several rows a sequence (a whole head a program), given to the row-at-a-time calls
    too: each tiling sums dt's and the readout's products in its own order, so only the same tiling is bit for bit
    (the default's against the reference: test_triton_matches_reference)."""
    return dict(block_p=next_pow2(dims["head_dim"]), num_warps=SEVERAL_ROWS_WARPS)


INTERPRETER_CASES = "triton and not interpreter"  # run on a CPU through the interpreter (tests/triton_interpreter.py)


@pytest.mark.skipif(RUNS_TRITON, reason="this process runs the Triton kernels directly")
def test_triton_under_interpreter(interpreter_cases):
    interpreter_cases.check(__file__)


@runs_triton
@pytest.mark.parametrize("dims", [SMALL, dict(heads=2, head_dim=20, state_dim=24, hidden=300)],
                         ids=["3x6x10", "2x20x24"])
def test_triton_matches_reference(dims):
    check_against_reference(spec(**dims), DEVICE)


@runs_triton
def test_triton_half_inputs_match_reference():
    check_against_reference(spec(**SMALL, dtype=torch.bfloat16), DEVICE)


@runs_triton
@pytest.mark.parametrize("dims", [SMALL, dict(heads=2, head_dim=20, state_dim=24, hidden=300)],
                         ids=["3x6x10", "2x20x24"])
def test_triton_equals_row_at_a_time(dims):
    check_row_at_a_time(spec(**dims), 0, DEVICE, extra=several_rows_tiling(dims))


def test_reference_agrees_with_row_at_a_time():
    """Within fp32 rounding only: PyTorch's CPU kernels treat a tensor's tail apart from its vectorised body."""
    check_row_at_a_time(spec(**SMALL), 1, "cpu", exact=False)


def check_half_state(dtype, stochastic, impl, device, dims=SMALL):
    """Multi-row sequences on a 16-bit h, beside an fp32 h from the same values: every row's readout equals the
    fp32 run's (the state stays fp32 through the rows); the stored h is the fp32 run's final h rounded once, with
    the bits of its slot's counter; nothing else in the table (nor the counter) changes. For Triton (impl 0),
    also against the reference from the same 16-bit h: the stored h within one ulp, the readouts close."""
    s = spec(**dims)
    fn = (s.op, s.ref)[impl]
    seq_slots, seq_starts, rows, _ = layout(device=device)
    args = s.make(rows, SLOTS, 0, device)
    poison(args, s.states, PADDING_SLOT)
    args["h"] = args["h"].to(dtype)
    h16, h32, start = args["h"], args["h"].float(), args["h"].clone()
    counter = torch.randint(-2**31, 2**31 - 1, (SLOTS,), dtype=torch.int32,
                            generator=torch.Generator().manual_seed(2)).to(device)
    counter_before = counter.clone()
    rounding = StochasticRounding(counter, 1234) if stochastic else "nearest"
    plan_args = dict(seq_slots=seq_slots, seq_starts=seq_starts)
    y16 = fn(**args, **plan_args, rounding=rounding)
    y32 = fn(**{**args, "h": h32}, **plan_args)
    live = live_rows(seq_starts).to(device)
    written = torch.tensor(written_slots(), device=device)
    noise = stochastic_bits_ref(rounding, written, h16.shape[1:]) if stochastic else None
    expected = round_ref(h32[written], dtype, noise)
    if device == "cpu":
        assert_same_bits(y16[live], y32[live], "readout")
        assert_same_bits(h16[written], expected, "h")
    else:  # two compilations (16- and 32-bit h) may order the dt sum apart
        assert_close(y16[live], y32[live], name="readout")
        assert_within_one_ulp(h16[written], expected, "h")
    check_kept({"h": h16}, {"h": start}, written.tolist(), ("h",))
    assert torch.equal(counter, counter_before)
    if impl == 0:
        ref_h = start.clone()
        ref_y = s.ref(**{**args, "h": ref_h}, **plan_args, rounding=rounding)
        assert_close(y16[live], ref_y[live], name="readout against the reference")
        assert_within_one_ulp(h16[written], ref_h[written], "h against the reference")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_reference_half_state_rounds_once_per_sequence(dtype, stochastic):
    check_half_state(dtype, stochastic, 1, "cpu")


@runs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_triton_half_state_rounds_once_per_sequence(dtype, stochastic):
    check_half_state(dtype, stochastic, 0, DEVICE)


def test_reference_matches_equations_over_sequences():
    """Sequences of 3 and 2 rows in float64: each row's dt from its own t, h advanced through the sequence's rows
    in order from its slot's state, each row read out from the h after it."""
    dims = dict(heads=2, head_dim=3, state_dim=4, hidden=5)
    s = spec(**dims)
    sequences = [(2, 3), (0, 2)]
    seq_slots, seq_starts, rows, firsts = layout(sequences, trailing_empty=0, padding_rows=0)
    args = s.make(rows, 3, 7, "cpu")
    before = args["h"].clone()
    y = kernels.mamba2_state_update_ref(**args, seq_slots=seq_slots, seq_starts=seq_starts)
    f64 = {k: v.double() for k, v in args.items()}
    for (slot, length), first in zip(sequences, firsts):
        h = before[slot].double()
        for r in range(first, first + length):
            dt = torch.nn.functional.softplus(f64["dt_weight"] @ f64["t"][r] + f64["dt_bias"])  # [H]
            decay = torch.exp(f64["a"] * dt)
            h = decay[:, None, None] * h + dt[:, None, None] * f64["x"][r][:, :, None] * f64["b"][r][None, None, :]
            assert_close(y[r].double(), h @ f64["c"][r] + f64["d"][:, None] * f64["x"][r])
        assert_close(args["h"][slot].double(), h)
    assert torch.equal(args["h"][1], before[1])


def test_bad_plan_is_rejected():
    args = spec(**SMALL).make(2, 3, 0, "cpu")
    seq_slots, seq_starts = plan([0, 2], [1, 1])
    with pytest.raises(ValueError, match="seq_starts must have one more entry than seq_slots"):
        kernels.mamba2_state_update(**args, seq_slots=seq_slots, seq_starts=seq_starts[1:])


@cuda_only
def test_gpu_full_size():
    s = spec(**FULL)
    check_against_reference(s, "cuda")
    check_row_at_a_time(s, 0, "cuda", extra=several_rows_tiling(FULL))


@cuda_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_gpu_half_state_full_size(dtype, stochastic):
    check_half_state(dtype, stochastic, 0, "cuda", dims=FULL)


@cuda_only
def test_gpu_cuda_graph_replays_other_plans():
    check_cuda_graph(spec(**FULL))
