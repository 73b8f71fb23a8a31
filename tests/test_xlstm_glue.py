"""kernels/slstm_output.py, mlstm_output.py, xlstm_residual.py: each Triton kernel against its PyTorch
reference, and each reference against the equations in float64. On a CPU the Triton kernels run through the
interpreter in a child process."""

import pytest
import torch

from kernels._common import INTERPRET
from kernels.mlstm_output import mlstm_output, mlstm_output_ref
from kernels.slstm_output import slstm_output, slstm_output_ref
from kernels.xlstm_residual import xlstm_residual, xlstm_residual_ref

RUNS_TRITON = INTERPRET or torch.cuda.is_available()
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
OUT_DTYPES = [torch.float32, torch.float16]


def make(seed, *shapes):
    """Random tensors on DEVICE: [B, H] ones scaled and shifted so the norms have work to do; [H] ones (weights,
    biases) in [0.5, 1.5)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for shape in shapes:
        t = torch.randn(*shape, generator=g) * 2 + 0.5 if len(shape) == 2 else torch.rand(*shape, generator=g) + 0.5
        out.append(t.to(DEVICE))
    return out


def group_norm64(v, groups, weight, bias):
    rows, width = v.shape
    grouped = v.double().reshape(rows, groups, width // groups)
    mean = grouped.mean(-1, keepdim=True)
    var = ((grouped - mean) ** 2).mean(-1, keepdim=True)
    return ((grouped - mean) / torch.sqrt(var + 1e-5)).reshape(rows, width) * weight.double() + bias.double()


def layer_norm64(v, weight):
    v = v.double()
    mean = v.mean(-1, keepdim=True)
    return (v - mean) / torch.sqrt(((v - mean) ** 2).mean(-1, keepdim=True) + 1e-5) * weight.double()


def assert_close(actual, expected, out_dtype):
    assert actual.dtype == out_dtype
    torch.testing.assert_close(actual.float(), expected.float(), rtol=2e-3 if out_dtype == torch.float16 else 1e-5,
                               atol=1e-5)


def test_slstm_output_reference_matches_equations():
    y, xin, gn_weight, gn_bias, ln_weight = make(0, (3, 12), (3, 12), (12,), (12,), (12,))
    s_out, xn = slstm_output_ref(y, xin, gn_weight, gn_bias, ln_weight, 4)
    s_expect = group_norm64(y, 4, gn_weight, gn_bias) + xin.double()
    assert s_out.dtype == torch.float32 and xn.dtype == torch.float32
    torch.testing.assert_close(s_out.double(), s_expect, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(xn.double(), layer_norm64(s_expect, ln_weight), rtol=1e-5, atol=1e-5)


def test_mlstm_output_reference_matches_equations():
    h, xc, xg, skip, gn_weight, gn_bias = make(1, (3, 24), (3, 24), (3, 24), (24,), (24,), (24,))
    out = mlstm_output_ref(h, xc, xg, skip, gn_weight, gn_bias, 8)
    xg64 = xg.double()
    expect = (group_norm64(h, 8, gn_weight, gn_bias) + skip.double() * xc.double()) * xg64 / (1 + torch.exp(-xg64))
    torch.testing.assert_close(out.double(), expect, rtol=1e-5, atol=1e-5)


def test_xlstm_residual_reference_matches_equations():
    x, m, s_out, ln_weight, rms_weight = make(2, (3, 10), (3, 10), (3, 10), (10,), (10,))
    x_expect = x.double() + layer_norm64(m.double() + s_out.double(), ln_weight)
    t2 = xlstm_residual_ref(x, m, s_out, ln_weight, rms_weight, 1e-6)
    t2_expect = x_expect / torch.sqrt((x_expect ** 2).mean(-1, keepdim=True) + 1e-6) * rms_weight.double()
    torch.testing.assert_close(x.double(), x_expect, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(t2.double(), t2_expect, rtol=1e-5, atol=1e-5)


# Widths: powers of two, a non-power-of-two group size (25), a non-power-of-two group count (3), and the
# largest model sizes the engine uses (hidden 2048, inner 4096).
@pytest.mark.skipif(not RUNS_TRITON, reason="runs in the TRITON_INTERPRET=1 child process")
@pytest.mark.parametrize("rows,width,groups", [(1, 64, 4), (5, 100, 4), (5, 96, 3), (1, 2048, 4)])
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_triton_matches_reference_slstm_output(rows, width, groups, out_dtype):
    y, xin_wide, gn_weight, gn_bias, ln_weight = make(rows, (rows, width), (rows, 2 * width), (width,), (width,),
                                                      (width,))
    xin = xin_wide[:, width:]  # a strided row view
    s_out, xn = slstm_output(y, xin, gn_weight, gn_bias, ln_weight, groups, out_dtype)
    s_ref, xn_ref = slstm_output_ref(y, xin, gn_weight, gn_bias, ln_weight, groups, out_dtype)
    assert_close(s_out, s_ref, torch.float32)
    assert_close(xn, xn_ref, out_dtype)


@pytest.mark.skipif(not RUNS_TRITON, reason="runs in the TRITON_INTERPRET=1 child process")
@pytest.mark.parametrize("rows,width,groups", [(1, 64, 8), (5, 200, 8), (5, 96, 3), (1, 4096, 8)])
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_triton_matches_reference_mlstm_output(rows, width, groups, out_dtype):
    h, xc, xm_xg, skip, gn_weight, gn_bias = make(rows, (rows, width), (rows, width), (rows, 2 * width), (width,),
                                                  (width,), (width,))
    xg = xm_xg[:, width:].to(out_dtype)  # the gate half of the fused product, in its dtype
    out = mlstm_output(h, xc, xg, skip, gn_weight, gn_bias, groups, out_dtype)
    assert_close(out, mlstm_output_ref(h, xc, xg, skip, gn_weight, gn_bias, groups, out_dtype), out_dtype)


@pytest.mark.skipif(not RUNS_TRITON, reason="runs in the TRITON_INTERPRET=1 child process")
@pytest.mark.parametrize("rows,width", [(1, 64), (5, 100), (3, 2048)])
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_triton_matches_reference_xlstm_residual(rows, width, out_dtype):
    x, m, s_out, ln_weight, rms_weight = make(rows, (rows, width), (rows, width), (rows, width), (width,), (width,))
    x_ref = x.clone()
    t2 = xlstm_residual(x, m, s_out, ln_weight, rms_weight, 1e-6, out_dtype)
    t2_ref = xlstm_residual_ref(x_ref, m, s_out, ln_weight, rms_weight, 1e-6, out_dtype)
    torch.testing.assert_close(x, x_ref, rtol=1e-6, atol=1e-6)
    assert_close(t2, t2_ref, out_dtype)


def test_slstm_output_bad_inputs_are_clear_errors():
    y, w = torch.zeros(2, 8), torch.ones(8)
    with pytest.raises(ValueError, match="y must be a"):
        slstm_output(torch.zeros(8), y, w, w, w, 4)
    with pytest.raises(ValueError, match="xin"):
        slstm_output(y, torch.zeros(2, 7), w, w, w, 4)
    with pytest.raises(ValueError, match="gn_bias"):
        slstm_output(y, y, w, torch.ones(7), w, 4)
    with pytest.raises(ValueError, match="y must be float32"):
        slstm_output(y.double(), y, w, w, w, 4)
    with pytest.raises(ValueError, match="divisible by groups 3"):
        slstm_output(y, y, w, w, w, 3)
    with pytest.raises(ValueError, match="groups must be a positive int"):
        slstm_output(y, y, w, w, w, 0)
    with pytest.raises(ValueError, match="out_dtype"):
        slstm_output(y, y, w, w, w, 4, torch.int32)


def test_mlstm_output_bad_inputs_are_clear_errors():
    h, w = torch.zeros(2, 8), torch.ones(8)
    with pytest.raises(ValueError, match="h must be a"):
        mlstm_output(torch.zeros(2, 2, 2), h, h, w, w, w, 4)
    with pytest.raises(ValueError, match="xg"):
        mlstm_output(h, h, torch.zeros(3, 8), w, w, w, 4)
    with pytest.raises(ValueError, match="skip"):
        mlstm_output(h, h, h, torch.ones(4), w, w, 4)
    with pytest.raises(ValueError, match="groups must be a positive int"):
        mlstm_output(h, h, h, w, w, w, 2.0)
    with pytest.raises(ValueError, match="divisible by groups 5"):
        mlstm_output(h, h, h, w, w, w, 5)
    with pytest.raises(ValueError, match="out_dtype"):
        mlstm_output(h, h, h, w, w, w, 4, torch.float64)


def test_xlstm_residual_bad_inputs_are_clear_errors():
    x, w = torch.zeros(2, 8), torch.ones(8)
    with pytest.raises(ValueError, match="x must be a float32"):
        xlstm_residual(x.half(), x, x, w, w, 1e-6)
    with pytest.raises(ValueError, match="s_out"):
        xlstm_residual(x, x, torch.zeros(2, 9), w, w, 1e-6)
    with pytest.raises(ValueError, match="rms_weight"):
        xlstm_residual(x, x, x, w, torch.ones(2, 8), 1e-6)
    with pytest.raises(ValueError, match="out_dtype"):
        xlstm_residual(x, x, x, w, w, 1e-6, "float16")


INTERPRETER_CASES = "triton_matches"  # run on a CPU through the interpreter (tests/triton_interpreter.py)


@pytest.mark.skipif(RUNS_TRITON, reason="already running the Triton kernels in this process")
def test_triton_under_interpreter(interpreter_cases):
    interpreter_cases.check(__file__)
