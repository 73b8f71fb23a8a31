"""kernels/mlstm_input.py with several rows per sequence (seq_slots, seq_starts): the conv state per sequence, the
q/k/v blocks and gate parts per row. The Triton kernel against the reference and against row-at-a-time calls of
itself (tests/ragged_checks.py; on a CPU through the interpreter, in a child process), the reference against
float64 equations over a sequence."""
import pytest
import torch

import kernels
from kernels._common import INTERPRET
from kernels.mlstm_input import CHUNK
from ragged_checks import RaggedOp, assert_close, check_against_reference, check_cuda_graph, check_row_at_a_time, layout

HAS_CUDA = torch.cuda.is_available()
RUNS_TRITON = INTERPRET or HAS_CUDA
DEVICE = "cuda" if HAS_CUDA and not INTERPRET else "cpu"
runs_triton = pytest.mark.skipif(not RUNS_TRITON, reason="runs in the TRITON_INTERPRET=1 child process")
cuda_only = pytest.mark.skipif(not HAS_CUDA or INTERPRET, reason="needs a CUDA GPU")


def spec(inner, gates):
    def make(rows, slots, seed, device):
        g = torch.Generator().manual_seed(seed)
        args = dict(xm=torch.randn(rows, inner, generator=g), conv_state=torch.randn(slots, inner, 3, generator=g),
                    conv_weight=torch.randn(inner, 4, generator=g) * 0.5, conv_bias=torch.randn(inner, generator=g),
                    qkv_weight=torch.randn(inner // 4, 3, 4, 4, generator=g) * 0.5,
                    gate_weight=torch.randn(gates, 3 * inner, generator=g) / inner**0.5,
                    gate_bias=torch.randn(gates, generator=g))
        return {k: v.to(device) for k, v in args.items()}
    # the gate parts [P, B, G] with their rows first
    return RaggedOp(kernels.mlstm_input, kernels.mlstm_input_ref, make, ("conv_state",), ("xm",),
                    lambda out, args: [out[0], out[1], out[2].transpose(0, 1)])


INTERPRETER_CASES = "triton and not interpreter"  # run on a CPU through the interpreter (tests/triton_interpreter.py)


@pytest.mark.skipif(RUNS_TRITON, reason="this process runs the Triton kernels directly")
def test_triton_under_interpreter(interpreter_cases):
    interpreter_cases.check(__file__)


@runs_triton
@pytest.mark.parametrize("inner,gates", [(8, 2), (2 * CHUNK + 12, 4)])
def test_triton_matches_reference(inner, gates):
    check_against_reference(spec(inner, gates), DEVICE, rtol=1e-5)


@runs_triton
@pytest.mark.parametrize("inner,gates", [(8, 2), (2 * CHUNK + 12, 4)])
def test_triton_equals_row_at_a_time(inner, gates):
    check_row_at_a_time(spec(inner, gates), 0, DEVICE)


def test_reference_agrees_with_row_at_a_time():
    """Within fp32 rounding only: PyTorch's CPU kernels treat a tensor's tail apart from its vectorised body."""
    check_row_at_a_time(spec(2 * CHUNK + 12, 4), 1, "cpu", exact=False)


def test_reference_matches_equations_over_sequences():
    """Sequences of 3 and 2 rows in float64: the convolution over the sequence's rows after the slot's three taps,
    each row's q, k (from its xc) and v (from its xm) by 4x4 blocks, its gates from concat(q, k, v)."""
    inner, gates = 8, 2
    s = spec(inner, gates)
    sequences = [(2, 3), (0, 2)]
    seq_slots, seq_starts, rows, firsts = layout(sequences, trailing_empty=0, padding_rows=0)
    args = s.make(rows, 3, 7, "cpu")
    state0 = args["conv_state"].clone()
    xc, qkv, parts = kernels.mlstm_input_ref(**args, seq_slots=seq_slots, seq_starts=seq_starts)
    f64 = {k: v.double() for k, v in args.items()}
    w = f64["qkv_weight"]  # [blocks, 3, out, in]
    for (slot, length), first in zip(sequences, firsts):
        taps = list(state0[slot].double().unbind(-1))
        for r in range(first, first + length):
            taps.append(f64["xm"][r])
            value = sum(f64["conv_weight"][:, j] * taps[-4 + j] for j in range(4)) + f64["conv_bias"]
            conv = value * torch.sigmoid(value)
            assert_close(xc[r].double(), conv)
            expected = [torch.cat([w[blk, m] @ src[4 * blk:4 * blk + 4] for blk in range(inner // 4)])
                        for m, src in enumerate((conv, conv, f64["xm"][r]))]
            assert_close(qkv[r].double(), torch.stack(expected))
            assert_close(parts[:, r].sum(0).double(), f64["gate_weight"] @ torch.cat(expected) + f64["gate_bias"])
        assert torch.equal(args["conv_state"][slot], torch.stack(taps[-3:], -1).float())
    assert torch.equal(args["conv_state"][1], state0[1])


@cuda_only
def test_gpu_full_size():
    s = spec(4096, 16)
    check_against_reference(s, "cuda", rtol=1e-5)
    check_row_at_a_time(s, 0, "cuda")


@cuda_only
def test_gpu_cuda_graph_replays_other_plans():
    check_cuda_graph(spec(4096, 16))
