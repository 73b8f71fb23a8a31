"""kernels/skinny_matmul.py: the Triton kernel against its fp64 reference, for fp16 weights and for fp32 weights
split in two fp16 halves (which must keep about fp32 accuracy, far better than TF32), at a step's few rows and in
row tiles, and for rows far outside fp16's range. On a CPU it runs through the interpreter in a child process; on
a GPU the model's own shapes run too."""

import pytest
import torch

from kernels._common import INTERPRET
from kernels.skinny_matmul import (MIN_PROGRAMS, MIN_SPLIT_PROGRAMS, default_config, row_scales, skinny_matmul,
                                   skinny_matmul_ref, split_fp16, split_rows, supports)

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
@pytest.mark.parametrize("M", [1, 5, 20, 64, 65, 200])  # one row tile, and several (default_config's GEMM tiles)
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


@pytest.mark.skipif(not RUNS_TRITON, reason="runs in the TRITON_INTERPRET=1 child process")
@pytest.mark.parametrize("M", [20, 200])  # one row tile, and GEMM tiles
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_promoted_partials_match_the_reference(M, dtype):
    """promote: each K chunk's product summed from zero and added to the running sum in fp32; the same product."""
    x, w, b = make(M, 96, 512, dtype, 7 * M)
    for config in (None, (64, 32, 64, 2, 4, 2)):  # the default, and K in two slices
        y = skinny_matmul(x, **weights_of(w), bias=b, config=config, promote=True)
        ref = skinny_matmul_ref(x, **weights_of(w), bias=b)
        assert (y - ref).abs().max().item() <= 2e-6 * ref.abs().max().item()


def mixed_weights(w, rows):
    """kwargs of skinny_matmul for w with its first `rows` rows split (about fp32) and the others fp16."""
    hi, lo = split_fp16(w[:rows])
    return {"weight": torch.cat([hi, w[rows:].half()]).contiguous(), "weight_lo": lo.contiguous()}


@pytest.mark.skipif(not RUNS_TRITON, reason="runs in the TRITON_INTERPRET=1 child process")
@pytest.mark.parametrize("M", [1, 20, 150])
@pytest.mark.parametrize("rows", [128, 40])  # a whole number of programs' columns, and not
def test_split_rows_then_fp16_rows(M, rows):
    x, w, _ = make(M, 256, 128, torch.float32, M + rows)
    y = skinny_matmul(x, **mixed_weights(w, rows))
    ref = skinny_matmul_ref(x, **mixed_weights(w, rows))
    scale = ref.abs().max().item()
    assert (y - ref).abs().max().item() <= 2e-6 * scale
    exact = x.double() @ w.double().t()
    assert (y[:, :rows].double() - exact[:, :rows]).abs().max().item() <= 1e-5 * scale  # about fp32
    fp16 = skinny_matmul_ref(x, w[rows:].half())  # the other rows: the fp16 product, x rounded to fp16
    assert (y[:, rows:] - fp16).abs().max().item() <= 2e-6 * scale
    b = torch.randn(256, device=DEVICE)  # the bias and ReLU epilogue over both kinds of rows
    fused = skinny_matmul(x, **mixed_weights(w, rows), bias=b, relu=True)
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
@pytest.mark.parametrize("M,config", [
    (9, (16, 16, 64, 2, 4)),
    (40, (16, 32, 64, 2, 4)),     # three row tiles of a step's few rows
    (150, (16, 16, 32, 2, 4)),    # ten row tiles: a full group of GROUP_M = 8 and a partial one
    (300, (128, 128, 32, 2, 8)),  # the GEMM tile, the last row tile partial
    (150, (64, 32, 32, 2, 4, 4)),  # K in four slices, summed by a second kernel
    (9, (16, 16, 64, 2, 4, 2)),   # split K at a step's few rows
])
def test_explicit_config_and_strided_rows(M, config):
    x, w, b = make(M, 64 if M < 300 else 256, 256, torch.float32, M)
    wide = torch.zeros(M, 300, device=DEVICE)
    wide[:, :256] = x  # rows with a stride of 300
    for kwargs in (weights_of(w), weights_of(w.half())):
        y = skinny_matmul(wide[:, :256], **kwargs, bias=b, config=config)
        torch.testing.assert_close(y, skinny_matmul_ref(x, **kwargs, bias=b), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not RUNS_TRITON, reason="runs in the TRITON_INTERPRET=1 child process")
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
def test_split_k_bias_relu_and_mixed_rows(out_dtype):
    """K in slices: the bias and ReLU after the slices' sum, over split fp32 rows and fp16 rows alike; each
    slice's partial summed in order, so the same bits on every call."""
    x, w, b = make(70, 96, 256, torch.float32, 11)
    weights = mixed_weights(w, 40)
    config = (64, 32, 32, 2, 4, 4)
    y = skinny_matmul(x, **weights, bias=b, relu=True, out_dtype=out_dtype, config=config)
    ref = skinny_matmul_ref(x, **weights, bias=b, relu=True, out_dtype=torch.float32)
    tolerance = 2e-3 if out_dtype == torch.float16 else 1e-5
    torch.testing.assert_close(y.float(), ref, rtol=tolerance, atol=tolerance)
    again = skinny_matmul(x, **weights, bias=b, relu=True, out_dtype=out_dtype, config=config)
    assert torch.equal(y, again)
    with pytest.raises(ValueError, match="SPLIT_K"):
        skinny_matmul(x, **weights, config=(64, 32, 32, 2, 4, 3))  # 256 is no multiple of 32 x 3


def test_shapes_and_errors():
    assert supports(1, 2048, 2048) and supports(64, 16, 16) and supports(512, 8192, 2048) and supports(5000, 16, 16)
    assert not supports(0, 2048, 2048) and not supports(1, 2048, 100) and not supports(1, 8, 64)
    # a step's few rows: the launch bench/matmul_h200.json measured, one row tile
    assert default_config(1, 8192, 2048, split=True) == (16, 64, 128, 4, 4, 1)
    assert default_config(64, 2048, 4096, split=False) == (64, 16, 128, 5, 4, 1)
    assert default_config(20, 4096, 2048, split=True) == (32, 32, 128, 5, 4, 1)
    for M in (65, 128, 256, 512):  # the model's shapes in row tiles: every SM gets a program, K split if need be
        for N, K in ((8192, 2048), (4096, 2048), (2048, 4096), (2048, 2048)):
            for split in (True, False):
                block_m, block_n, block_k, stages, warps, split_k = default_config(M, N, K, split)
                min_programs = MIN_SPLIT_PROGRAMS if split else MIN_PROGRAMS
                assert -(-M // block_m) * (N // block_n) * split_k >= min_programs and stages >= 2
                assert K % (block_k * split_k) == 0 and K // split_k >= 512
    assert default_config(512, 8192, 2048, split=True) == (128, 128, 32, 5, 8, 1)
    assert default_config(256, 2048, 4096, split=True) == (128, 64, 64, 3, 8, 2)  # 64 tiles, K in two slices
    assert default_config(256, 2048, 4096, split=False)[4] == 4  # one fp32 tile: 4 warps hold it
    assert default_config(384, 2048, 2048, split=True) == (128, 128, 32, 5, 8, 2)  # 48 tiles x 2 slices: 96
    w = torch.zeros(32, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="x must have shape"):
        skinny_matmul(torch.zeros(2, 63), w)
    with pytest.raises(ValueError, match="weight must be"):
        skinny_matmul(torch.zeros(2, 64), torch.zeros(32, 64))  # fp32 weights go in as a split pair
    with pytest.raises(ValueError, match="split weight"):
        skinny_matmul(torch.zeros(2, 64), w, weight_lo=torch.zeros(32, 63, dtype=torch.float16))
    with pytest.raises(ValueError, match="split weight"):  # more low rows than W has
        skinny_matmul(torch.zeros(2, 64), w, weight_lo=torch.zeros(33, 64, dtype=torch.float16))
    with pytest.raises(ValueError, match="bias must have shape"):
        skinny_matmul(torch.zeros(2, 64), w, torch.zeros(31))


def wide_range_rows(M, K, seed, device=DEVICE):
    """x [M, K] far outside fp16's range: row scales 1e-6 .. 1e6, half the rows with columns of scale 1e-2 .. 1e5
    rising along K (each K tile's max above the last: the kernel's running scale drops every tile), one row spanning
    1e-35 .. 1e35 (fp32's range), one row of zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * torch.logspace(-6, 6, M)[:, None]
    x[::2] *= torch.logspace(-2, 5, K)
    x[M // 2] = torch.randn(K, generator=g) * torch.logspace(-35, 35, K)
    x[M // 3] = 0
    return x.to(device)


def row_errors(y, exact):
    """Per row, the largest error against the row's largest |exact| (rows of zeros: against 1)."""
    return ((y.double() - exact).abs().amax(1) / exact.abs().amax(1).clamp_min(1e-300)).cpu()


def test_row_scaling_keeps_the_split_exact_over_fp32s_range():
    x = wide_range_rows(24, 256, 0, "cpu")
    s = row_scales(x)
    amax = x.abs().amax(1)
    scaled = amax * torch.pow(2.0, s.double())
    assert ((scaled >= 2**14) & (scaled < 2**15) | (amax == 0)).all() and s.abs().max() <= 126
    x_hi, x_lo, unscale = split_rows(x)
    assert torch.isfinite(x_hi).all() and torch.isfinite(x_lo).all()
    back = (x_hi.double() + x_lo.double() / 2048) * unscale.double()
    large = x.abs() >= amax[:, None] * 2**-26  # elements within 26 binades of their row's max: every bit kept
    assert ((back - x.double()).abs() <= 2**-21 * x.double().abs())[large].all()
    small = (back - x.double()).abs()[~large]  # the rest: errors 2^-50 below the row's max, far under its noise
    assert (small <= 2**-48 * amax[:, None].double().expand_as(x)[~large]).all()
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(1)) / 16
    hi, lo = split_fp16(w)
    exact = x.double() @ w.double().t()
    split = (x_hi.double() @ hi.double().t() + (x_hi.double() @ lo.double().t() + x_lo.double() @ hi.double().t())
             / 2048) * unscale.double()
    assert row_errors(split, exact).max() < 2e-6  # ~fp32 on every row, whatever its scale
    fp16 = (x_hi.double() @ w.half().double().t()) * unscale.double()  # x cast row by row: no inf, 11 bits a row
    assert torch.isfinite(fp16).all() and row_errors(fp16, exact).max() < 3e-3
    # what the scaling buys: the plain split overflows on large rows, and loses bits on rows below 2^-14
    naive_hi, naive_lo = split_fp16(x)
    naive = skinny_matmul_ref(x, hi, weight_lo=lo)  # x split as it is
    tiny = (amax > 0) & (amax < 2**-14)
    assert not torch.isfinite(naive_hi).all() and not torch.isfinite(naive).all()
    assert tiny.any() and row_errors(naive, exact)[tiny].min() > 1e-6


def test_linear_routes_by_rows_and_wide_inputs():
    """layers.Linear: which products go through the kernel (SKINNY_MAX_ROWS per kind, on top of skinny_pays); a
    product of unnormalised input (wide_input: input_down's) never does, and casts x to fp16 rows scaled (no inf)."""
    from client.engine.fast import layers
    g = torch.Generator().manual_seed(0)
    first, second = torch.randn(48, 64, generator=g) / 8, torch.randn(32, 64, generator=g) / 8
    mixed = layers.Linear([first, second], None, [torch.float32, torch.float16], "cpu")
    x = torch.randn(16, 64, generator=g)
    exact = x.double() @ torch.cat([first, second]).double().t()
    assert row_errors(mixed.product(x)[:, :48], exact[:, :48]).max() < 2e-6  # the split through cuBLAS
    x = wide_range_rows(16, 64, 0, "cpu")
    exact = x.double() @ second.double().t()
    for dtype, bound in ((torch.float32, 2e-6), (torch.float16, 3e-3)):
        wide = layers.Linear(second, None, dtype, "cpu", wide_input=True)
        wide.use_skinny(True)
        assert wide.skinny is None  # cuBLAS: fp32's accumulation, and 16-bit casts scaled by row
        y = wide.product(x)
        assert torch.isfinite(y).all() and row_errors(y, exact).max() < bound
    assert not torch.isfinite(layers.Linear(second, None, torch.float16, "cpu").product(x)).all()  # unscaled: inf
    wide = {dtype: layers.Linear(torch.randn(2048, 64, generator=g), None, dtype, "cpu")
            for dtype in (torch.float32, torch.float16)}
    assert [mixed.kind, wide[torch.float32].kind, wide[torch.float16].kind] == ["fp32+fp16", "float32", "float16"]
    for linear in wide.values():
        linear.skinny = {"weight": linear.weight.half()}  # as use_skinny(True) leaves it where Triton runs
        limit = layers.SKINNY_MAX_ROWS[linear.kind]
        for M in (1, 3, 64, 65, 512):
            expected = layers.skinny_pays(M, 2048) and (limit is None or M <= limit)
            assert linear._use_skinny(torch.zeros(M, 64)) == expected
    assert not wide[torch.float32]._use_skinny(torch.zeros(1, 64))  # cuBLAS's GEMV at one row, N = 2048
    assert wide[torch.float32]._use_skinny(torch.zeros(512, 64))  # many rows of fp32 weights: the kernel


@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="the model's shapes, on a GPU")
@pytest.mark.parametrize("M", [1, 20, 64, 65, 256, 512])
@pytest.mark.parametrize("kind,N,K", [("fp32", 8192, 2048), ("fp32", 2048, 4096), ("fp32+fp16", 8448, 2048),
                                      ("fp16", 8192, 2048), ("fp16", 2048, 4096)])
def test_model_shapes_on_gpu(M, kind, N, K):
    x = make(M, N, K, torch.float32, M)[0]
    w = torch.randn(N, K, device=DEVICE) / K**0.5
    weights = {"fp32": weights_of(w), "fp32+fp16": mixed_weights(w, 8192), "fp16": weights_of(w.half())}[kind]
    exact = skinny_matmul_ref(x, **weights).double()
    for promote in (False, True):
        y = skinny_matmul(x, **weights, promote=promote)
        # the tensor cores' fp32 accumulation over K terms keeps fewer bits than FMA units (H100: up to 7.9e-6 of a
        # row's scale at K = 4096, 3.9e-6 at K = 2048; cuBLAS's fp32 ~4e-7); promoted, each BLOCK_K chunk's sum is
        # added in fp32 (H100: 3-7e-7 at K = 2,048-8,192). fp16 weights are never promoted: their rounding dominates.
        bound = 2e-8 if promote and kind != "fp16" else 2e-7
        assert torch.isfinite(y).all() and row_errors(y, exact).max() < bound * K**0.5


# run on a CPU through the interpreter (tests/triton_interpreter.py)
INTERPRETER_CASES = "triton_matches or epilogue or explicit_config or split_rows or row_tiles or split_k or promoted"


@pytest.mark.skipif(RUNS_TRITON, reason="already running the Triton kernel in this process")
def test_triton_under_interpreter(interpreter_cases):
    interpreter_cases.check(__file__)
