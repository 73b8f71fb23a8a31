"""xLSTM layer end fused with the enclosing block's residual and norm2:
layer_out = layer_norm(m + s_out) (final_norm, weight only); x += layer_out, in place;
t2 = x / sqrt(mean(x^2) + rms_eps) * rms_weight in out_dtype.

The mLSTM block's skip add, the final LayerNorm, the block's residual add and norm2 in one pass per row,
where PyTorch needs six to seven kernels.
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels._common import check_input, next_pow2, use_triton
from kernels.slstm_output import NORM_EPS, check_out_dtype


def _check(x, m, s_out, ln_weight, rms_weight, out_dtype):
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype != torch.float32 or x.stride(-1) != 1:
        raise ValueError(f"x must be a float32 [B, H] residual with unit last stride, got "
                         f"{getattr(x, 'shape', type(x).__name__)} {getattr(x, 'dtype', '')}")
    rows, width = x.shape
    m = check_input("m", m, (rows, width), x.device)
    s_out = check_input("s_out", s_out, (rows, width), x.device)
    ln_weight = check_input("ln_weight", ln_weight, (width,), x.device)
    rms_weight = check_input("rms_weight", rms_weight, (width,), x.device)
    check_out_dtype(out_dtype)
    return m, s_out, ln_weight, rms_weight


def xlstm_residual_ref(x, m, s_out, ln_weight, rms_weight, rms_eps, out_dtype=torch.float32):
    """PyTorch reference of xlstm_residual, same signature and in-place semantics."""
    m, s_out, ln_weight, rms_weight = (t.float() for t in _check(x, m, s_out, ln_weight, rms_weight, out_dtype))
    x += F.layer_norm(m + s_out, x.shape[-1:], ln_weight, None, NORM_EPS)
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + rms_eps) * rms_weight).to(out_dtype)


@triton.jit
def _xlstm_residual_kernel(x_ptr, m_ptr, s_out_ptr, ln_weight_ptr, rms_weight_ptr, t2_ptr, width, stride_x,
                           stride_m, stride_s_out, stride_t2, ln_eps, rms_eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    col = tl.arange(0, BLOCK)
    mask = col < width
    # every load first: at one row the kernel is a chain of memory round trips, and a load placed after a
    # reduction waits for it
    v = tl.load(m_ptr + row * stride_m + col, mask=mask, other=0.0).to(tl.float32)
    v += tl.load(s_out_ptr + row * stride_s_out + col, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + row * stride_x + col, mask=mask, other=0.0)
    ln_w = tl.load(ln_weight_ptr + col, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(rms_weight_ptr + col, mask=mask, other=0.0).to(tl.float32)
    d = tl.where(mask, v - tl.sum(v, axis=0) / width, 0.0)
    inv = 1.0 / tl.sqrt(tl.sum(d * d, axis=0) / width + ln_eps)
    x += d * inv * ln_w
    tl.store(x_ptr + row * stride_x + col, x, mask=mask)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / width + rms_eps)
    tl.store(t2_ptr + row * stride_t2 + col, (x * inv * w).to(t2_ptr.dtype.element_ty), mask=mask)


def xlstm_residual(x, m, s_out, ln_weight, rms_weight, rms_eps, out_dtype=torch.float32):
    """x [B, H] fp32 residual (updated in place), m [B, H], s_out [B, H], ln_weight/rms_weight [H] -> t2 [B, H]."""
    if not use_triton(x):
        return xlstm_residual_ref(x, m, s_out, ln_weight, rms_weight, rms_eps, out_dtype)
    m, s_out, ln_weight, rms_weight = _check(x, m, s_out, ln_weight, rms_weight, out_dtype)
    rows, width = x.shape
    t2 = torch.empty(rows, width, device=x.device, dtype=out_dtype)
    if rows:
        block = next_pow2(width)
        _xlstm_residual_kernel[(rows,)](x, m, s_out, ln_weight, rms_weight, t2, width, x.stride(0), m.stride(0),
                                        s_out.stride(0), t2.stride(0), NORM_EPS, rms_eps, BLOCK=block,
                                        num_warps=max(1, min(16, block // 256)))
    return t2
