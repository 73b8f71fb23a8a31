"""kernels/causal_conv_update.py with several rows per sequence (seq_slots, seq_starts): the Triton kernel against
the reference and against row-at-a-time calls of itself (tests/ragged_checks.py; on a CPU through the interpreter,
in a child process), the reference against float64 equations over a sequence, and bad plans."""
import pytest
import torch

import kernels
from kernels._common import INTERPRET, plan
from ragged_checks import (RaggedOp, assert_close, check_against_reference, check_cuda_graph, check_row_at_a_time,
                           layout)

HAS_CUDA = torch.cuda.is_available()
RUNS_TRITON = INTERPRET or HAS_CUDA
DEVICE = "cuda" if HAS_CUDA and not INTERPRET else "cpu"
runs_triton = pytest.mark.skipif(not RUNS_TRITON, reason="runs in the TRITON_INTERPRET=1 child process")
cuda_only = pytest.mark.skipif(not HAS_CUDA or INTERPRET, reason="needs a CUDA GPU")


def spec(channels, activation="silu", dtype=torch.float32):
    def make(rows, slots, seed, device):
        g = torch.Generator().manual_seed(seed)
        args = dict(x=torch.randn(rows, channels, generator=g).to(dtype),
                    conv_state=torch.randn(slots, channels, 3, generator=g),
                    weight=(torch.randn(channels, 4, generator=g) * 0.5).to(dtype),
                    bias=torch.randn(channels, generator=g).to(dtype))
        return {**{k: v.to(device) for k, v in args.items()}, "activation": activation}
    return RaggedOp(kernels.causal_conv_update, kernels.causal_conv_update_ref, make, ("conv_state",), ("x",),
                    lambda out, args: [out])


INTERPRETER_CASES = "triton and not interpreter"  # run on a CPU through the interpreter (tests/triton_interpreter.py)


@pytest.mark.skipif(RUNS_TRITON, reason="this process runs the Triton kernels directly")
def test_triton_under_interpreter(interpreter_cases):
    interpreter_cases.check(__file__)


@runs_triton
@pytest.mark.parametrize("channels,activation", [(37, "silu"), (300, None)])
def test_triton_matches_reference(channels, activation):
    check_against_reference(spec(channels, activation), DEVICE)


@runs_triton
def test_triton_half_inputs_match_reference():
    check_against_reference(spec(37, dtype=torch.bfloat16), DEVICE)


@runs_triton
@pytest.mark.parametrize("channels", [37, 300])
def test_triton_equals_row_at_a_time(channels):
    check_row_at_a_time(spec(channels), 0, DEVICE)


@runs_triton
def test_triton_only_empty_sequences_write_nothing():
    """A step of empty sequences and padding rows only: no state changes."""
    s = spec(37)
    args = s.make(3, 4, 0, DEVICE)
    before = args["conv_state"].clone()
    seq_slots, seq_starts = plan([2], [0], 3, device=DEVICE)
    kernels.causal_conv_update(**args, seq_slots=seq_slots, seq_starts=seq_starts)
    assert torch.equal(args["conv_state"], before)


def test_reference_agrees_with_row_at_a_time():
    """Within fp32 rounding only: PyTorch's CPU kernels treat a tensor's tail apart from its vectorised body, so
    a row's last bits may depend on the rows beside it."""
    check_row_at_a_time(spec(37), 1, "cpu", exact=False)


def test_reference_matches_equations_over_sequences():
    """Sequences of 3 and 2 rows in float64: each row convolves the last three inputs (the state's taps, then the
    sequence's own earlier rows) and its own; the state ends holding the last three."""
    channels = 5
    s = spec(channels)
    sequences = [(2, 3), (0, 2)]
    seq_slots, seq_starts, rows, firsts = layout(sequences, trailing_empty=0, padding_rows=0)
    args = s.make(rows, 3, 7, "cpu")
    before = args["conv_state"].clone()
    out = kernels.causal_conv_update_ref(**args, seq_slots=seq_slots, seq_starts=seq_starts)
    w, b, x = args["weight"].double(), args["bias"].double(), args["x"].double()
    for (slot, length), first in zip(sequences, firsts):
        history = list(before[slot].double().unbind(-1))  # oldest first, [C] each
        for r in range(first, first + length):
            window = history[-3:] + [x[r]]
            value = sum(w[:, j] * window[j] for j in range(4)) + b
            assert_close(out[r].double(), value * torch.sigmoid(value))
            history.append(x[r])
        assert torch.equal(args["conv_state"][slot], torch.stack(history[-3:], -1).float())
    assert torch.equal(args["conv_state"][1], before[1])


@pytest.mark.parametrize("make_bad,match", [
    (lambda slots, starts: (slots.long(), starts), "seq_slots must be a one-dimensional int32 tensor"),
    (lambda slots, starts: (slots, starts[:-1]), "seq_starts must have one more entry than seq_slots"),
    (lambda slots, starts: (slots, starts[None]), "seq_starts must be a one-dimensional int32 tensor"),
    (lambda slots, starts: (slots.to("meta"), starts), "seq_slots is on meta"),
    (lambda slots, starts: (slots.tolist(), starts), "seq_slots must be a torch.Tensor"),
], ids=["dtype", "length", "rank", "device", "list"])
def test_bad_plans_are_rejected(make_bad, match):
    args = spec(8).make(2, 3, 0, "cpu")
    seq_slots, seq_starts = make_bad(*plan([0, 2], [1, 1]))
    with pytest.raises((ValueError, TypeError), match=match):
        kernels.causal_conv_update(**args, seq_slots=seq_slots, seq_starts=seq_starts)


@cuda_only
@pytest.mark.parametrize("channels", [4352, 2048])  # Mamba2's x/b/c and Hawk's convolution
def test_gpu_full_size(channels):
    s = spec(channels)
    check_against_reference(s, "cuda")
    check_row_at_a_time(s, 0, "cuda")


@cuda_only
def test_gpu_cuda_graph_replays_other_plans():
    check_cuda_graph(spec(4352))
