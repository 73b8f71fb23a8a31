"""kernels/gated_rms_norm.py: the reference against the model's Mamba2 output norm, the Triton kernel against
the reference (on a CPU through the interpreter, in a child process)."""

import pytest
import torch
import torch.nn.functional as F

from client.model.modules import RMSNorm
from kernels._common import INTERPRET
from kernels.gated_rms_norm import gated_rms_norm, gated_rms_norm_ref

RUNS_TRITON = INTERPRET or torch.cuda.is_available()
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"


def test_reference_matches_the_model_norm():
    torch.manual_seed(0)
    norm = RMSNorm(12, eps=1e-5)
    torch.nn.init.uniform_(norm.weight, 0.5, 1.5)
    y, z = torch.randn(3, 12), torch.randn(3, 12)
    with torch.no_grad():
        torch.testing.assert_close(gated_rms_norm_ref(y, z, norm.weight, 1e-5), norm(y * F.silu(z)))


@pytest.mark.skipif(not RUNS_TRITON, reason="runs in the TRITON_INTERPRET=1 child process")
@pytest.mark.parametrize("rows,width", [(1, 64), (3, 100), (2, 4096)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
def test_triton_matches_reference(rows, width, out_dtype):
    g = torch.Generator().manual_seed(rows)
    y = torch.randn(rows, width, generator=g).to(DEVICE)
    z = torch.randn(rows, 2 * width, generator=g).to(DEVICE)[:, width:]  # a column slice, as in the engine
    w = (torch.rand(width, generator=g) + 0.5).to(DEVICE)
    got, want = gated_rms_norm(y, z, w, 1e-5, out_dtype), gated_rms_norm_ref(y, z, w, 1e-5, out_dtype)
    assert got.dtype == out_dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-3 if out_dtype == torch.float16 else 1e-5,
                               atol=1e-5)


INTERPRETER_CASES = "triton_matches"  # run on a CPU through the interpreter (tests/triton_interpreter.py)


@pytest.mark.skipif(RUNS_TRITON, reason="already running the Triton kernel in this process")
def test_triton_under_interpreter(interpreter_cases):
    interpreter_cases.check(__file__)


def test_bad_inputs_are_clear_errors():
    with pytest.raises(ValueError, match=r"z must have shape \[2, 8\]"):
        gated_rms_norm(torch.zeros(2, 8), torch.zeros(2, 7), torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="out_dtype"):
        gated_rms_norm(torch.zeros(2, 8), torch.zeros(2, 8), torch.ones(8), 1e-5, torch.int8)
