"""kernels/mlstm_input.py: the reference against the model's own mLSTM input side, the Triton kernel against
the reference (on a CPU through the interpreter, in a child process), and its bad inputs."""

import pytest
import torch
import torch.nn.functional as F

from client.model.xlstm import MLSTMBlock
from kernels._common import INTERPRET, plan
from kernels.mlstm_input import CHUNK, mlstm_input, mlstm_input_ref, num_parts, pack_qkv_weight

RUNS_TRITON = INTERPRET or torch.cuda.is_available()
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"


def make(rows, inner, heads, slots, seed=0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    blocks = inner // 4
    args = dict(xm=torch.randn(rows, inner, generator=g), conv_state=torch.randn(slots, inner, 3, generator=g),
                conv_weight=torch.randn(inner, 4, generator=g) * 0.5, conv_bias=torch.randn(inner, generator=g),
                qkv_weight=torch.randn(blocks, 3, 4, 4, generator=g) * 0.5,
                gate_weight=torch.randn(2 * heads, 3 * inner, generator=g) / inner**0.5,
                gate_bias=torch.randn(2 * heads, generator=g))
    return {k: v.to(device) for k, v in args.items()}


def test_reference_matches_the_model():
    """Against MLSTMBlock's own modules: conv1d + silu, the q/k/v BlockLinears, the igate/fgate projections."""
    torch.manual_seed(0)
    hidden, heads, rows = 40, 2, 3
    block = MLSTMBlock(hidden, heads)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)
    inner = 2 * hidden
    xm, conv = torch.randn(rows, inner), torch.randn(rows, inner, 3)
    with torch.no_grad():
        xc, conv_next = block.conv1d(xm, conv)
        xc = F.silu(xc)
        q, k, v = block.q_proj(xc), block.k_proj(xc), block.v_proj(xm)
        qkv = torch.cat([q, k, v], dim=-1)
        gates = torch.cat([block.mlstm_cell.igate_proj(qkv), block.mlstm_cell.fgate_proj(qkv)], dim=-1)
        cell = block.mlstm_cell
        state = conv.clone()
        got_xc, got_qkv, parts = mlstm_input_ref(
            xm, state, block.conv1d.conv.weight[:, 0, :], block.conv1d.conv.bias,
            pack_qkv_weight(block.q_proj.weight, block.k_proj.weight, block.v_proj.weight),
            torch.cat([cell.igate_proj.weight, cell.fgate_proj.weight]),
            torch.cat([cell.igate_proj.bias, cell.fgate_proj.bias]), *plan(range(rows), [1] * rows))
    torch.testing.assert_close(got_xc, xc, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_qkv.reshape(rows, -1), qkv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(parts.sum(0), gates, rtol=1e-5, atol=1e-5)
    assert parts.shape == (num_parts(inner), rows, 2 * heads)
    torch.testing.assert_close(state, conv_next)


@pytest.mark.skipif(not RUNS_TRITON, reason="runs in the TRITON_INTERPRET=1 child process")
@pytest.mark.parametrize("rows,inner,heads", [(1, 8, 1), (3, 2 * CHUNK + 12, 2), (2, 4096, 8)])
@pytest.mark.parametrize("padding_rows", [0, 2])
def test_triton_matches_reference(rows, inner, heads, padding_rows):
    """One row per sequence on distinct slots, padding rows after them and as many empty sequences on a
    NaN-poisoned padding slot, strided xm (a column slice of the fused x/gate projection); untouched slots (the
    padding slot too) keep their state bit for bit. Several rows per sequence: tests/test_mlstm_input_ragged.py."""
    slots = rows + 3
    args = make(rows + padding_rows, 2 * inner, heads, slots, seed=rows)
    args["xm"] = args["xm"][:, :inner]
    args["conv_state"] = args["conv_state"][:, :inner].contiguous()
    args["conv_weight"], args["conv_bias"] = args["conv_weight"][:inner], args["conv_bias"][:inner]
    args["qkv_weight"] = args["qkv_weight"][:inner // 4].contiguous()
    args["gate_weight"] = args["gate_weight"][:, :3 * inner].contiguous()
    pad = slots - 1
    args["conv_state"][pad] = float("nan")
    seq_slots, seq_starts = plan(list(range(rows - 1, -1, -1)) + [pad] * padding_rows,
                                 [1] * rows + [0] * padding_rows, device=DEVICE)
    ref_state = args["conv_state"].clone()
    out = mlstm_input(**args, seq_slots=seq_slots, seq_starts=seq_starts)
    expected = mlstm_input_ref(**{**args, "conv_state": ref_state}, seq_slots=seq_slots, seq_starts=seq_starts)
    for got, want in zip(out, expected):
        assert got.dtype == torch.float32
        if got.dim() == 3 and got.shape[0] == num_parts(inner):
            got, want = got[:, :rows], want[:, :rows]
        else:
            got, want = got[:rows], want[:rows]
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(args["conv_state"], ref_state, rtol=0, atol=0, equal_nan=True)


INTERPRETER_CASES = "triton_matches"  # run on a CPU through the interpreter (tests/triton_interpreter.py)


@pytest.mark.skipif(RUNS_TRITON, reason="already running the Triton kernel in this process")
def test_triton_under_interpreter(interpreter_cases):
    interpreter_cases.check(__file__)


@pytest.mark.parametrize("name,make_bad,match", [
    ("xm", lambda t: t[:, :6], "multiple of 4"),
    ("conv_state", lambda t: t[:, :, :2], r"conv_state must have shape \[\*, 8, 3\]"),
    ("qkv_weight", lambda t: t[:, :2], r"qkv_weight must have shape \[2, 3, 4, 4\]"),
    ("gate_weight", lambda t: t[:, :5], r"gate_weight must have shape \[2, 24\]"),
    ("gate_bias", lambda t: t[:1], r"gate_bias must have shape \[2\]"),
    ("xm", lambda t: t[0], r"xm must be a \[B, inner\] tensor"),
])
def test_bad_inputs_are_clear_errors(name, make_bad, match):
    args = make(2, 8, 1, 3, device="cpu")
    args[name] = make_bad(args[name])
    with pytest.raises(ValueError, match=match):
        mlstm_input(**args, seq_slots=torch.tensor([0, 2], dtype=torch.int32),
                    seq_starts=torch.tensor([0, 1, 2], dtype=torch.int32))


@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs CUDA")
@pytest.mark.parametrize("rows", [20, 64])
def test_gpu_full_size_many_rows(rows):
    """Thousands of programs at once: each shifts its conv state only after all of its threads read it."""
    for seed in range(3):
        args = make(rows, 4096, 8, rows + 2, seed=seed)
        seq_slots, seq_starts = plan(torch.randperm(rows + 2)[:rows], [1] * rows, device="cuda")
        ref_state = args["conv_state"].clone()
        out = mlstm_input(**args, seq_slots=seq_slots, seq_starts=seq_starts)
        expected = mlstm_input_ref(**{**args, "conv_state": ref_state}, seq_slots=seq_slots, seq_starts=seq_starts)
        for got, want in zip(out, expected):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(args["conv_state"], ref_state, rtol=0, atol=0)
