"""Residual add fused with the next RMSNorm: x += delta (+ bias), in place; y = x / sqrt(mean(x^2) + eps) * w.

delta + bias is rounded before it joins x, as the reference's Linear adds its bias to the product: where x is large
(a feed's unnormalised columns carry a residual of ~1e3), adding the bias to x separately rounds x once more per
block, an error the reference does not make (bench/LOG.md section 47).

Each block of a tower ends with `x = x + fc2(...)` and the next starts with `norm1(x)`; each layer's output is
added and normalised by norm2 the same way. One row per program reads x and delta once and writes x and y once
(y in the dtype of the product it feeds, so no separate cast), where PyTorch needs three to four kernels.
"""
import torch
import triton
import triton.language as tl

from kernels._common import check_input, next_pow2, use_triton


def _check(x, delta, bias, weight):
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype != torch.float32 or x.stride(-1) != 1:
        raise ValueError(f"x must be a float32 [B, H] residual with unit last stride, got "
                         f"{getattr(x, 'shape', type(x).__name__)} {getattr(x, 'dtype', '')}")
    rows, width = x.shape
    delta = check_input("delta", delta, (rows, width), x.device)
    bias = None if bias is None else check_input("bias", bias, (width,), x.device)
    weight = check_input("weight", weight, (width,), x.device)
    return delta, bias, weight


def add_rms_norm_ref(x, delta, bias, weight, eps, out_dtype=torch.float32):
    """PyTorch reference of add_rms_norm, same signature and in-place semantics."""
    delta, bias, weight = _check(x, delta, bias, weight)
    x += delta.float() if bias is None else delta.float() + bias.float()
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(out_dtype)


@triton.jit
def _add_rms_norm_kernel(x_ptr, delta_ptr, bias_ptr, weight_ptr, y_ptr, width, stride_x, stride_delta, stride_y,
                         eps, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    col = tl.arange(0, BLOCK)
    mask = col < width
    x = tl.load(x_ptr + row * stride_x + col, mask=mask, other=0.0)
    delta = tl.load(delta_ptr + row * stride_delta + col, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(weight_ptr + col, mask=mask, other=0.0).to(tl.float32)  # before the reduction, which it would wait for
    if HAS_BIAS:  # the bias joins the product before the residual, as in the reference's Linear
        delta += tl.load(bias_ptr + col, mask=mask, other=0.0).to(tl.float32)
    x += delta
    tl.store(x_ptr + row * stride_x + col, x, mask=mask)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / width + eps)
    tl.store(y_ptr + row * stride_y + col, (x * inv * w).to(y_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x, delta, bias, weight, eps, out_dtype=torch.float32):
    """x [B, H] fp32 residual (updated in place), delta [B, H], bias [H] or None, weight [H] -> y [B, H]."""
    if not use_triton(x):
        return add_rms_norm_ref(x, delta, bias, weight, eps, out_dtype)
    delta, bias, weight = _check(x, delta, bias, weight)
    rows, width = x.shape
    y = torch.empty(rows, width, device=x.device, dtype=out_dtype)
    if rows:
        block = next_pow2(width)
        _add_rms_norm_kernel[(rows,)](x, delta, bias if bias is not None else weight, weight, y, width,
                                      x.stride(0), delta.stride(0), y.stride(0), eps, HAS_BIAS=bias is not None,
                                      BLOCK=block, num_warps=max(1, min(16, block // 256)))
    return y
