"""kernels/skinny_matmul.py: the Triton kernel against its fp64 reference, for fp16 weights and for fp32 weights
split in two fp16 halves (which must keep about fp32 accuracy, far better than TF32). On a CPU it runs through
the interpreter in a child process."""

import pytest
import torch

from kernels._common import INTERPRET
from kernels.skinny_matmul import default_config, skinny_matmul, skinny_matmul_ref, split_fp16, supports
from triton_interpreter import run_under_interpreter

RUNS_TRITON = INTERPRET or torch.cuda.is_available()
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"


def make(M, N, K, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(dtype)
    b = torch.randn(N, generator=g)
    return x.to(DEVICE), w.to(DEVICE), b.to(DEVICE)


def weights_of(w):
    """kwargs of skinny_matmul for w: fp32 weights as a split (hi, lo) pair."""
    if w.dtype != torch.float32:
        return {"weight": w}
    hi, lo = split_fp16(w)
    return {"weight": hi, "weight_lo": lo}


def test_split_keeps_fp32_accuracy():
    x, w, _ = make(4, 64, 512, torch.float32, 1)
    hi, lo = split_fp16(w)
    assert hi.dtype == lo.dtype == torch.float16
    assert (hi.double() + lo.double() / 2048 - w.double()).abs().max() <= 2**-21 * w.abs().max()
    exact = x.double() @ w.double().t()
    split = skinny_matmul_ref(x, hi, weight_lo=lo)
    fp16 = skinny_matmul_ref(x, hi)
    scale = exact.abs().max().item()
    assert (split.double() - exact).abs().max().item() < 2e-6 * scale
    assert (fp16.double() - exact).abs().max().item() > 1e-4 * scale  # what the split buys


def test_reference_matches_equations():
    x, w, b = make(3, 24, 32, torch.float16, 0)
    y = skinny_matmul_ref(x, w, b, relu=True)
    expect = torch.relu(x.half().double() @ w.double().t() + b.double())
    torch.testing.assert_close(y.double(), expect, rtol=1e-6, atol=1e-6)
    assert (y >= 0).all() and (y == 0).any()


@pytest.mark.skipif(not RUNS_TRITON, reason="runs in the TRITON_INTERPRET=1 child process")
@pytest.mark.parametrize("M", [1, 5, 20, 64])
@pytest.mark.parametrize("N,K", [(48, 64), (256, 256)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_matches_reference(M, N, K, dtype):
    x, w, b = make(M, N, K, dtype, M + N)
    y = skinny_matmul(x, **weights_of(w))
    ref = skinny_matmul_ref(x, **weights_of(w))
    assert y.shape == (M, N) and y.dtype == torch.float32
    scale = ref.abs().max().item()
    assert (y - ref).abs().max().item() <= 2e-6 * scale, (y - ref).abs().max().item() / scale
    if dtype == torch.float32:  # against the fp32 weights themselves: about fp32, where TF32 gives ~1e-3
        exact = x.double() @ w.double().t()
        assert (y.double() - exact).abs().max().item() <= 1e-5 * scale


def split_rows(w, rows):
    """kwargs of skinny_matmul for w with its first `rows` rows split (about fp32) and the others fp16."""
    hi, lo = split_fp16(w[:rows])
    return {"weight": torch.cat([hi, w[rows:].half()]).contiguous(), "weight_lo": lo.contiguous()}


@pytest.mark.skipif(not RUNS_TRITON, reason="runs in the TRITON_INTERPRET=1 child process")
@pytest.mark.parametrize("M", [1, 20])
@pytest.mark.parametrize("rows", [128, 40])  # a whole number of programs' columns, and not
def test_split_rows_then_fp16_rows(M, rows):
    x, w, _ = make(M, 256, 128, torch.float32, M + rows)
    y = skinny_matmul(x, **split_rows(w, rows))
    ref = skinny_matmul_ref(x, **split_rows(w, rows))
    scale = ref.abs().max().item()
    assert (y - ref).abs().max().item() <= 2e-6 * scale
    exact = x.double() @ w.double().t()
    assert (y[:, :rows].double() - exact[:, :rows]).abs().max().item() <= 1e-5 * scale  # about fp32
    fp16 = skinny_matmul_ref(x, w[rows:].half())  # the other rows: the fp16 product, x rounded to fp16
    assert (y[:, rows:] - fp16).abs().max().item() <= 2e-6 * scale
    b = torch.randn(256, device=DEVICE)  # the bias and ReLU epilogue over both kinds of rows
    fused = skinny_matmul(x, **split_rows(w, rows), bias=b, relu=True)
    assert (fused - torch.relu(ref + b)).abs().max().item() <= 2e-6 * scale


@pytest.mark.skipif(not RUNS_TRITON, reason="runs in the TRITON_INTERPRET=1 child process")
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
def test_bias_relu_epilogue(out_dtype):
    x, w, b = make(7, 96, 128, torch.float32, 3)
    y = skinny_matmul(x, **weights_of(w), bias=b, relu=True, out_dtype=out_dtype)
    ref = skinny_matmul_ref(x, **weights_of(w), bias=b, relu=True, out_dtype=torch.float32)
    assert y.dtype == out_dtype and (y >= 0).all()
    torch.testing.assert_close(y.float(), ref, rtol=2e-3, atol=2e-3)


@pytest.mark.skipif(not RUNS_TRITON, reason="runs in the TRITON_INTERPRET=1 child process")
def test_explicit_config_and_strided_rows():
    x, w, _ = make(9, 64, 256, torch.float32, 5)
    wide = torch.zeros(9, 300, device=DEVICE)
    wide[:, :256] = x  # rows with a stride of 300
    y = skinny_matmul(wide[:, :256], **weights_of(w), config=(16, 64, 2, 4))
    torch.testing.assert_close(y, skinny_matmul_ref(x, **weights_of(w)), rtol=1e-5, atol=1e-5)


def test_shapes_and_errors():
    assert supports(1, 2048, 2048) and supports(64, 16, 16)
    assert not supports(65, 2048, 2048) and not supports(1, 2048, 100) and not supports(1, 8, 64)
    block_n, block_k, stages, warps = default_config(1, 8192, 2048, split=True)
    assert 8192 // block_n >= 128 and 2048 % block_k == 0 and stages >= 2
    w = torch.zeros(32, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="x must have shape"):
        skinny_matmul(torch.zeros(2, 63), w)
    with pytest.raises(ValueError, match="at most 64 rows"):
        skinny_matmul(torch.zeros(65, 64), w)
    with pytest.raises(ValueError, match="weight must be"):
        skinny_matmul(torch.zeros(2, 64), torch.zeros(32, 64))  # fp32 weights go in as a split pair
    with pytest.raises(ValueError, match="split weight"):
        skinny_matmul(torch.zeros(2, 64), w, weight_lo=torch.zeros(32, 63, dtype=torch.float16))
    with pytest.raises(ValueError, match="split weight"):  # more low rows than W has
        skinny_matmul(torch.zeros(2, 64), w, weight_lo=torch.zeros(33, 64, dtype=torch.float16))
    with pytest.raises(ValueError, match="bias must have shape"):
        skinny_matmul(torch.zeros(2, 64), w, torch.zeros(31))


@pytest.mark.skipif(RUNS_TRITON, reason="already running the Triton kernel in this process")
def test_triton_under_interpreter():
    run_under_interpreter(__file__, "triton_matches or epilogue or explicit_config or split_rows")
