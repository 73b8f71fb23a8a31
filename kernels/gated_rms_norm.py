"""Mamba2's output gate and norm in one pass: out = rms_norm(y * silu(z)) * w, in the dtype of out_proj.

PyTorch needs three kernels for it (the gate, F.rms_norm, the cast to the product's dtype), and at a step's few
rows each costs its launch more than its bytes. One row per program.
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels._common import FLOAT_DTYPES, check_input, next_pow2, use_triton
from kernels._math import sigmoid


def _check(y, z, weight, out_dtype):
    if not isinstance(y, torch.Tensor) or y.dim() != 2:
        raise ValueError(f"y must be a [B, W] tensor, got {getattr(y, 'shape', type(y).__name__)}")
    rows, width = y.shape
    y = check_input("y", y, (rows, width), y.device)
    z = check_input("z", z, (rows, width), y.device)
    weight = check_input("weight", weight, (width,), y.device)
    if out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"out_dtype must be float32, bfloat16 or float16, got {out_dtype}")
    return y, z, weight


def gated_rms_norm_ref(y, z, weight, eps, out_dtype=torch.float32):
    """PyTorch reference of gated_rms_norm, same signature."""
    y, z, weight = _check(y, z, weight, out_dtype)
    gated = y.float() * F.silu(z.float())
    return F.rms_norm(gated, gated.shape[-1:], weight.float(), eps).to(out_dtype)


@triton.jit
def _gated_rms_norm_kernel(y_ptr, z_ptr, weight_ptr, out_ptr, width, stride_y, stride_z, stride_out, eps,
                           BLOCK: tl.constexpr):
    row = tl.program_id(0)
    col = tl.arange(0, BLOCK)
    mask = col < width
    z = tl.load(z_ptr + row * stride_z + col, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(y_ptr + row * stride_y + col, mask=mask, other=0.0).to(tl.float32) * z * sigmoid(z)
    w = tl.load(weight_ptr + col, mask=mask, other=0.0).to(tl.float32)  # before the reduction, which it would wait for
    inv = 1.0 / tl.sqrt(tl.sum(g * g, axis=0) / width + eps)
    tl.store(out_ptr + row * stride_out + col, (g * inv * w).to(out_ptr.dtype.element_ty), mask=mask)


def gated_rms_norm(y, z, weight, eps, out_dtype=torch.float32):
    """y [B, W], z [B, W] (e.g. a column slice of a fused projection), weight [W] -> [B, W] in out_dtype."""
    if not use_triton(y):
        return gated_rms_norm_ref(y, z, weight, eps, out_dtype)
    y, z, weight = _check(y, z, weight, out_dtype)
    rows, width = y.shape
    out = torch.empty(rows, width, device=y.device, dtype=out_dtype)
    if rows:
        block = next_pow2(width)
        _gated_rms_norm_kernel[(rows,)](y, z, weight, out, width, y.stride(0), z.stride(0), out.stride(0), eps,
                                        BLOCK=block, num_warps=max(1, min(16, block // 256)))
    return out
