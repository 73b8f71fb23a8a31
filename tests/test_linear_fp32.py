"""kernels/linear_fp32.py: Triton fp32 products against the float64 reference."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels._common import INTERPRET
from kernels.linear_fp32 import linear_fp32, linear_fp32_ref

REPO = Path(__file__).resolve().parents[1]
RUNS_TRITON = INTERPRET or torch.cuda.is_available()
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
SHAPES = [(1, 96, 64), (5, 200, 130), (20, 128, 256)] if INTERPRET else \
    [(1, 8192, 2048), (3, 2048, 2048), (20, 2048, 4096), (64, 4096, 2048), (17, 100, 130)]


def test_reference_is_fp32_exact_to_float64():
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(3, 50, generator=g), torch.randn(7, 50, generator=g), torch.randn(7, generator=g)
    expect = x.double() @ w.double().t() + b.double()
    torch.testing.assert_close(linear_fp32_ref(x, w, b).double(), expect, rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(not RUNS_TRITON, reason="runs in the TRITON_INTERPRET=1 child process")
@pytest.mark.parametrize("rows,n,k", SHAPES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_triton_matches_reference(rows, n, k, with_bias):
    g = torch.Generator().manual_seed(rows * n + k)
    x = torch.randn(rows, k, generator=g).to(DEVICE)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(DEVICE)
    b = torch.randn(n, generator=g).to(DEVICE) if with_bias else None
    y = linear_fp32(x, w, b)
    ref = linear_fp32_ref(x, w, b)
    # fp32 accumulation in another order: errors ~ sqrt(K) ulp, far below TF32's 1e-3
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=2e-5)


@pytest.mark.skipif(not RUNS_TRITON, reason="runs in the TRITON_INTERPRET=1 child process")
def test_strided_rows():
    x = torch.randn(4, 2 * 64, device=DEVICE)[:, :64]
    w = torch.randn(96, 64, device=DEVICE)
    torch.testing.assert_close(linear_fp32(x, w), linear_fp32_ref(x, w), rtol=1e-5, atol=1e-5)


def test_bad_inputs_are_clear_errors():
    with pytest.raises(ValueError, match="weight must be a contiguous float32"):
        linear_fp32(torch.zeros(2, 8), torch.zeros(4, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="x must have shape"):
        linear_fp32(torch.zeros(2, 7), torch.zeros(4, 8))


@pytest.mark.skipif(RUNS_TRITON, reason="already running the Triton kernel in this process")
def test_triton_under_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", __file__, "-k", "triton_matches or strided"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
