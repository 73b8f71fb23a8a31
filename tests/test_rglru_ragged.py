"""kernels/rglru.py with several rows per sequence (seq_slots, seq_starts): the Triton kernel against the
reference and against row-at-a-time calls of itself (tests/ragged_checks.py; on a CPU through the interpreter, in
a child process), the reference against float64 equations over a sequence, and a bad plan."""
import math

import pytest
import torch

import kernels
from kernels._common import INTERPRET, plan
from ragged_checks import RaggedOp, check_against_reference, check_cuda_graph, check_row_at_a_time, layout

HAS_CUDA = torch.cuda.is_available()
RUNS_TRITON = INTERPRET or HAS_CUDA
DEVICE = "cuda" if HAS_CUDA and not INTERPRET else "cpu"
runs_triton = pytest.mark.skipif(not RUNS_TRITON, reason="runs in the TRITON_INTERPRET=1 child process")
cuda_only = pytest.mark.skipif(not HAS_CUDA or INTERPRET, reason="needs a CUDA GPU")
ROW_INPUTS = ("gate_pre", "u", "i_pre", "r_pre")


def spec(width, dtype=torch.float32):
    def make(rows, slots, seed, device):
        g = torch.Generator().manual_seed(seed)
        args = {name: torch.randn(rows, width, generator=g).to(dtype) for name in ROW_INPUTS}
        args.update(a=(torch.rand(width, generator=g) * 0.15 + 0.85).to(dtype),
                    h=torch.randn(slots, width, generator=g))
        return {k: v.to(device) for k, v in args.items()}
    return RaggedOp(kernels.rglru_step, kernels.rglru_step_ref, make, ("h",), ROW_INPUTS, lambda out, args: [out])


INTERPRETER_CASES = "triton and not interpreter"  # run on a CPU through the interpreter (tests/triton_interpreter.py)


@pytest.mark.skipif(RUNS_TRITON, reason="this process runs the Triton kernels directly")
def test_triton_under_interpreter(interpreter_cases):
    interpreter_cases.check(__file__)


@runs_triton
@pytest.mark.parametrize("width", [50, 700])
def test_triton_matches_reference(width):
    check_against_reference(spec(width), DEVICE)


@runs_triton
def test_triton_half_inputs_match_reference():
    check_against_reference(spec(50, torch.float16), DEVICE)


@runs_triton
@pytest.mark.parametrize("width", [50, 700])
def test_triton_equals_row_at_a_time(width):
    check_row_at_a_time(spec(width), 0, DEVICE)


def test_reference_agrees_with_row_at_a_time():
    """Within fp32 rounding only: PyTorch's CPU kernels treat a tensor's tail apart from its vectorised body."""
    check_row_at_a_time(spec(50), 1, "cpu", exact=False)


def test_reference_matches_equations_over_sequences():
    """Sequences of 3 and 2 rows in float64: h advances through each sequence's rows in order from its slot's
    state, each row's output gated by its own GELU; the slot ends holding the last h."""
    width, c = 6, 8.0
    s = spec(width)
    sequences = [(2, 3), (0, 2)]
    seq_slots, seq_starts, rows, firsts = layout(sequences, trailing_empty=0, padding_rows=0)
    args = s.make(rows, 3, 7, "cpu")
    before = args["h"].clone()
    out = kernels.rglru_step_ref(**args, seq_slots=seq_slots, seq_starts=seq_starts, c=c)
    for (slot, length), first in zip(sequences, firsts):
        for j in range(width):
            h = before[slot, j].item()
            for r in range(first, first + length):
                gate, u = args["gate_pre"][r, j].item(), args["u"][r, j].item()
                i = 1 / (1 + math.exp(-args["i_pre"][r, j].item()))
                alpha = args["a"][j].item() ** (c / (1 + math.exp(-args["r_pre"][r, j].item())))
                h = alpha * h + math.sqrt(1 - alpha**2) * (i * u)
                gelu = 0.5 * gate * (1 + math.erf(gate / math.sqrt(2)))
                assert out[r, j].item() == pytest.approx(gelu * h, rel=1e-5, abs=1e-6)
            assert args["h"][slot, j].item() == pytest.approx(h, rel=1e-5, abs=1e-6)
    assert torch.equal(args["h"][1], before[1])


def test_bad_plan_is_rejected():
    args = spec(8).make(2, 3, 0, "cpu")
    seq_slots, seq_starts = plan([0, 2], [1, 1])
    with pytest.raises(ValueError, match="seq_starts must be a one-dimensional int32 tensor"):
        kernels.rglru_step(**args, seq_slots=seq_slots, seq_starts=seq_starts.long())


@cuda_only
def test_gpu_full_size():
    s = spec(2048)
    check_against_reference(s, "cuda")
    check_row_at_a_time(s, 0, "cuda")


@cuda_only
def test_gpu_cuda_graph_replays_other_plans():
    check_cuda_graph(spec(2048))
