"""kernels/add_rms_norm.py: the Triton kernel against its PyTorch reference, and the reference against the
equations. On a CPU the Triton kernel runs through the interpreter in a child process."""

import pytest
import torch

from kernels._common import INTERPRET
from kernels.add_rms_norm import add_rms_norm, add_rms_norm_ref

RUNS_TRITON = INTERPRET or torch.cuda.is_available()
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"


def make(rows, width, delta_dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=g) * 3
    delta = torch.randn(rows, width, generator=g).to(delta_dtype)
    bias = torch.randn(width, generator=g)
    weight = torch.rand(width, generator=g) + 0.5
    return [t.to(DEVICE) for t in (x, delta, bias, weight)]


def test_reference_matches_equations():
    x, delta, bias, weight = make(3, 10, torch.float32, 0)
    x0 = x.double().clone()
    y = add_rms_norm_ref(x, delta, bias, weight, 1e-6)
    s = x0 + delta.double() + bias.double()
    expect = s / torch.sqrt((s**2).mean(-1, keepdim=True) + 1e-6) * weight.double()
    torch.testing.assert_close(x.double(), s, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(y.double(), expect, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not RUNS_TRITON, reason="runs in the TRITON_INTERPRET=1 child process")
@pytest.mark.parametrize("rows,width", [(1, 64), (5, 100), (3, 2048)])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
def test_triton_matches_reference(rows, width, with_bias, out_dtype):
    x, delta, bias, weight = make(rows, width, torch.float16 if out_dtype == torch.float16 else torch.float32, rows)
    bias = bias if with_bias else None
    x_ref = x.clone()
    y = add_rms_norm(x, delta, bias, weight, 1e-6, out_dtype)
    y_ref = add_rms_norm_ref(x_ref, delta, bias, weight, 1e-6, out_dtype)
    assert y.dtype == out_dtype
    torch.testing.assert_close(x, x_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=2e-3 if out_dtype == torch.float16 else 1e-5,
                               atol=1e-5)


@pytest.mark.skipif(not RUNS_TRITON, reason="runs in the TRITON_INTERPRET=1 child process")
def test_triton_matches_reference_adding_bias_to_delta_first():
    # x = 2048 has an ulp of 2^-12: delta and bias of 0.4 ulp each round to nothing added to x one at a time, and
    # to one ulp added as their sum, as the reference's Linear (product + bias, then the residual) rounds them
    ulp = 2.0 ** -12
    x = torch.full((2, 64), 2048.0, device=DEVICE)
    delta = torch.full((2, 64), 0.4 * ulp, device=DEVICE)
    bias = torch.full((64,), 0.4 * ulp, device=DEVICE)
    x_ref = x.clone()
    add_rms_norm(x, delta, bias, torch.ones(64, device=DEVICE), 1e-6)
    add_rms_norm_ref(x_ref, delta, bias, torch.ones(64, device=DEVICE), 1e-6)
    assert torch.equal(x, x_ref) and torch.equal(x, torch.full_like(x, 2048.0 + ulp))


def test_bad_inputs_are_clear_errors():
    x = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="delta"):
        add_rms_norm(x, torch.zeros(2, 7), None, torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="x must be a float32"):
        add_rms_norm(x.double(), torch.zeros(2, 8), None, torch.ones(8), 1e-6)


INTERPRETER_CASES = "triton_matches"  # run on a CPU through the interpreter (tests/triton_interpreter.py)


@pytest.mark.skipif(RUNS_TRITON, reason="already running the Triton kernel in this process")
def test_triton_under_interpreter(interpreter_cases):
    interpreter_cases.check(__file__)
