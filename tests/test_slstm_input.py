"""kernels/slstm_input.py: the reference against the model's own modules (the block's norm1, the sLSTM's
LayerNorm and convolution), the Triton kernel against the reference (on a CPU through the interpreter, in a
child process), and its bad inputs."""

import pytest
import torch
import torch.nn.functional as F

from client.model.modules import FP32_EPS, RMSNorm
from client.model.xlstm import SLSTMBlock
from kernels._common import INTERPRET, plan
from kernels.slstm_input import slstm_input, slstm_input_ref

RUNS_TRITON = INTERPRET or torch.cuda.is_available()
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"


def make(rows, width, slots, seed=0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    args = dict(x=torch.randn(rows, width, generator=g) * 2, delta=torch.randn(rows, width, generator=g),
                bias=torch.randn(width, generator=g), norm_weight=torch.rand(width, generator=g) + 0.5,
                rms_eps=FP32_EPS, ln_weight=torch.rand(width, generator=g) + 0.5,
                conv_state=torch.randn(slots, width, 3, generator=g), conv_weight=torch.randn(width, 4, generator=g),
                conv_bias=torch.randn(width, generator=g))
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def test_reference_matches_the_model():
    """Against RMSNorm (norm1) and SLSTMBlock's LayerNorm, conv1d and silu."""
    torch.manual_seed(0)
    hidden, rows = 32, 3
    norm1, block = RMSNorm(hidden), SLSTMBlock(hidden)
    for p in [*norm1.parameters(), *block.parameters()]:
        torch.nn.init.normal_(p, mean=0.5, std=0.3)
    x, delta, bias = torch.randn(rows, hidden), torch.randn(rows, hidden), torch.randn(hidden)
    conv = torch.randn(rows, hidden, 3)
    with torch.no_grad():
        residual = x + delta + bias
        xin = norm1(residual)
        xn = block.norm(xin)
        xc, conv_next = block.conv1d(xn, conv)
        xc = F.silu(xc)
        state = conv.clone()
        got_x = x.clone()
        got = slstm_input_ref(got_x, delta, bias, norm1.weight, FP32_EPS, block.norm.weight, state,
                              block.conv1d.conv.weight, block.conv1d.conv.bias, *plan(range(rows), [1] * rows))
    torch.testing.assert_close(got_x, residual)
    for mine, model in zip(got, (xin, xn, xc)):
        torch.testing.assert_close(mine, model, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, conv_next)


@pytest.mark.skipif(not RUNS_TRITON, reason="runs in the TRITON_INTERPRET=1 child process")
@pytest.mark.parametrize("rows,width", [(1, 8), (3, 100), (2, 2048)])
@pytest.mark.parametrize("padding_rows", [0, 2])
@pytest.mark.parametrize("with_bias", [True, False])
def test_triton_matches_reference(rows, width, padding_rows, with_bias):
    """One row per sequence on distinct slots, padding rows after them and as many empty sequences on a
    NaN-poisoned padding slot, a strided delta; untouched slots (the padding slot too) keep their state bit for
    bit, padding rows are left as they are. Several rows per sequence: tests/test_slstm_input_ragged.py."""
    slots = rows + 3
    args = make(rows + padding_rows, width, slots, seed=rows + width)
    args["delta"] = torch.cat([args["delta"], args["delta"]], dim=1)[:, width // 2:width // 2 + width]
    args["bias"] = args["bias"] if with_bias else None
    pad = slots - 1
    args["conv_state"][pad] = float("nan")
    seq = plan(list(range(rows - 1, -1, -1)) + [pad] * padding_rows, [1] * rows + [0] * padding_rows, device=DEVICE)
    x_before = args["x"].clone()
    ref = {**args, "x": args["x"].clone(), "conv_state": args["conv_state"].clone()}
    out = slstm_input(**args, seq_slots=seq[0], seq_starts=seq[1])
    expected = slstm_input_ref(**ref, seq_slots=seq[0], seq_starts=seq[1])
    for got, want in zip(out, expected):
        assert got.dtype == torch.float32 and got.shape == want.shape
        assert torch.isfinite(got[:rows]).all()
        torch.testing.assert_close(got[:rows], want[:rows], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(args["x"][:rows], ref["x"][:rows], rtol=1e-6, atol=1e-6)
    assert torch.equal(args["x"][rows:], x_before[rows:])
    # live slots shift in xn (equal to rounding), the others keep their state bit for bit
    torch.testing.assert_close(args["conv_state"][:rows], ref["conv_state"][:rows], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(args["conv_state"][rows:], ref["conv_state"][rows:], rtol=0, atol=0, equal_nan=True)


INTERPRETER_CASES = "triton_matches"  # run on a CPU through the interpreter (tests/triton_interpreter.py)


@pytest.mark.skipif(RUNS_TRITON, reason="already running the Triton kernel in this process")
def test_triton_under_interpreter(interpreter_cases):
    interpreter_cases.check(__file__)


@pytest.mark.parametrize("name,make_bad,match", [
    ("delta", lambda t: t[:, :7], r"delta must have shape \[2, 8\]"),
    ("norm_weight", lambda t: t[:7], r"weight must have shape \[8\]"),
    ("ln_weight", lambda t: t[:7], r"ln_weight must have shape \[8\]"),
    ("conv_state", lambda t: t[:, :, :2], r"conv_state must have shape \[\*, 8, 3\]"),
    ("conv_weight", lambda t: t[:, :3], r"weight must have shape \[8, 4\]"),
    ("x", lambda t: t.double(), "x must be a float32"),
])
def test_bad_inputs_are_clear_errors(name, make_bad, match):
    args = make(2, 8, 3, device="cpu")
    args[name] = make_bad(args[name])
    with pytest.raises(ValueError, match=match):
        slstm_input(**args, seq_slots=torch.tensor([0, 2], dtype=torch.int32),
                    seq_starts=torch.tensor([0, 1, 2], dtype=torch.int32))


@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 20, 64])
def test_gpu_full_size_many_rows(rows):
    """Full width: each row shifts its conv state only after all of its threads read it (a thread that shifted
    early would leave another thread's old taps overwritten)."""
    for seed in range(3):
        args = make(rows, 2048, rows + 2, seed=seed)
        slots = torch.randperm(rows + 2)[:rows]
        seq_slots, seq_starts = plan(slots, [1] * rows, device="cuda")
        ref = {**args, "x": args["x"].clone(), "conv_state": args["conv_state"].clone()}
        out = slstm_input(**args, seq_slots=seq_slots, seq_starts=seq_starts)
        expected = slstm_input_ref(**ref, seq_slots=seq_slots, seq_starts=seq_starts)
        for got, want in zip(out, expected):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(args["x"], ref["x"], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(args["conv_state"], ref["conv_state"], rtol=1e-5, atol=1e-5)
        # the shift itself is exact: the two oldest taps of each live slot are the previous newest two
        live = slots.cuda()
        torch.testing.assert_close(args["conv_state"][live, :, :2], ref["conv_state"][live, :, :2], rtol=0, atol=0)
