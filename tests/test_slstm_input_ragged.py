"""kernels/slstm_input.py with several rows per sequence (seq_slots, seq_starts): the norms per row, the conv state
per sequence. The Triton kernel against the reference and against row-at-a-time calls of itself
(tests/ragged_checks.py; on a CPU through the interpreter, in a child process), padding rows left as they are,
the reference against float64 equations over a sequence."""
import pytest
import torch

import kernels
from client.model.modules import FP32_EPS
from kernels._common import INTERPRET
from ragged_checks import (RaggedOp, assert_close, check_against_reference, check_cuda_graph, check_row_at_a_time,
                           layout)

HAS_CUDA = torch.cuda.is_available()
RUNS_TRITON = INTERPRET or HAS_CUDA
DEVICE = "cuda" if HAS_CUDA and not INTERPRET else "cpu"
runs_triton = pytest.mark.skipif(not RUNS_TRITON, reason="runs in the TRITON_INTERPRET=1 child process")
cuda_only = pytest.mark.skipif(not HAS_CUDA or INTERPRET, reason="needs a CUDA GPU")


def spec(width, with_bias=True):
    def make(rows, slots, seed, device):
        g = torch.Generator().manual_seed(seed)
        args = dict(x=torch.randn(rows, width, generator=g) * 2, delta=torch.randn(rows, width, generator=g),
                    bias=torch.randn(width, generator=g) if with_bias else None,
                    norm_weight=torch.rand(width, generator=g) + 0.5, ln_weight=torch.rand(width, generator=g) + 0.5,
                    conv_state=torch.randn(slots, width, 3, generator=g),
                    conv_weight=torch.randn(width, 4, generator=g),
                    conv_bias=torch.randn(width, generator=g))
        return {**{k: v.to(device) if v is not None else v for k, v in args.items()}, "rms_eps": FP32_EPS}
    return RaggedOp(kernels.slstm_input, kernels.slstm_input_ref, make, ("conv_state",), ("x", "delta"),
                    lambda out, args: [*out, args["x"]])  # x: the residual, updated in place


INTERPRETER_CASES = "triton and not interpreter"  # run on a CPU through the interpreter (tests/triton_interpreter.py)


@pytest.mark.skipif(RUNS_TRITON, reason="this process runs the Triton kernels directly")
def test_triton_under_interpreter(interpreter_cases):
    interpreter_cases.check(__file__)


@runs_triton
@pytest.mark.parametrize("width,with_bias", [(8, True), (100, False)])
def test_triton_matches_reference(width, with_bias):
    check_against_reference(spec(width, with_bias), DEVICE, rtol=1e-5)


@runs_triton
@pytest.mark.parametrize("width", [8, 100])
def test_triton_equals_row_at_a_time(width):
    check_row_at_a_time(spec(width), 0, DEVICE)


@runs_triton
def test_triton_leaves_padding_rows():
    """Rows after the last sequence: the residual x not updated."""
    s = spec(40)
    seq_slots, seq_starts, rows, _ = layout(device=DEVICE)
    args = s.make(rows, 8, 0, DEVICE)
    x_before = args["x"].clone()
    kernels.slstm_input(**args, seq_slots=seq_slots, seq_starts=seq_starts)
    padding = torch.arange(int(seq_starts[-1]), rows)
    assert len(padding) and torch.equal(args["x"][padding], x_before[padding])


def test_reference_agrees_with_row_at_a_time():
    """Within fp32 rounding only: PyTorch's CPU kernels treat a tensor's tail apart from its vectorised body."""
    check_row_at_a_time(spec(40), 1, "cpu", exact=False)


def test_reference_matches_equations_over_sequences():
    """Sequences of 3 and 2 rows in float64: each row's residual add and two norms on its own, the convolution over
    the sequence's normalised rows after the slot's three taps; the slot ends holding the last three."""
    width = 6
    s = spec(width)
    sequences = [(2, 3), (0, 2)]
    seq_slots, seq_starts, rows, firsts = layout(sequences, trailing_empty=0, padding_rows=0)
    args = s.make(rows, 3, 7, "cpu")
    x0, state0 = args["x"].double(), args["conv_state"].clone()
    xin, xn, xc = kernels.slstm_input_ref(**args, seq_slots=seq_slots, seq_starts=seq_starts)
    f64 = {k: v.double() for k, v in args.items() if isinstance(v, torch.Tensor)}
    for (slot, length), first in zip(sequences, firsts):
        taps = list(state0[slot].double().unbind(-1))
        for r in range(first, first + length):
            residual = x0[r] + f64["delta"][r] + f64["bias"]
            assert_close(args["x"][r].double(), residual)
            normed = residual / torch.sqrt((residual**2).mean() + FP32_EPS) * f64["norm_weight"]
            assert_close(xin[r].double(), normed)
            centred = normed - normed.mean()
            layer = centred / torch.sqrt((centred**2).mean() + 1e-5) * f64["ln_weight"]
            assert_close(xn[r].double(), layer, rtol=1e-5)
            taps.append(layer)
            value = sum(f64["conv_weight"][:, j] * taps[-4 + j] for j in range(4)) + f64["conv_bias"]
            assert_close(xc[r].double(), value * torch.sigmoid(value), rtol=1e-5)
        assert_close(args["conv_state"][slot].double(), torch.stack(taps[-3:], -1), rtol=1e-5)
    assert torch.equal(args["conv_state"][1], state0[1])


@cuda_only
def test_gpu_full_size():
    s = spec(2048)
    check_against_reference(s, "cuda", rtol=1e-5)
    check_row_at_a_time(s, 0, "cuda")


@cuda_only
def test_gpu_cuda_graph_replays_other_plans():
    check_cuda_graph(spec(2048))
