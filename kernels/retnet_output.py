"""RetNet's output gate: silu(g) * rmsnorm_per_head(o), flattened, the input of the RetNet out_proj. One program
per (row, head)."""
import torch
import triton
import triton.language as tl

from kernels._common import check_input, next_pow2, use_triton

RMS_EPS = 1e-6


def _check(o, g):
    if not isinstance(o, torch.Tensor) or o.dim() != 3:
        raise ValueError(f"o must be a [B, Hh, D] tensor, got {getattr(o, 'shape', type(o).__name__)}")
    rows, heads, head_dim = o.shape
    o = check_input("o", o, (rows, heads, head_dim), o.device)
    g = check_input("g", g, (rows, heads * head_dim), o.device)
    return o, g


def retnet_output_ref(o, g):
    """PyTorch reference of retnet_output."""
    o, g = _check(o, g)
    o = o.float()
    normed = o / torch.sqrt(o.pow(2).mean(-1, keepdim=True) + RMS_EPS)
    g = g.float()
    return g * torch.sigmoid(g) * normed.flatten(1)


@triton.jit
def _retnet_output_kernel(
    o_ptr, g_ptr, out_ptr, head_dim,
    stride_o_row, stride_o_head, stride_g_row, stride_out_row,
    eps, BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    mask = d < head_dim
    col = head * head_dim + d
    o = tl.load(o_ptr + row * stride_o_row + head * stride_o_head + d, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * stride_g_row + col, mask=mask, other=0.0).to(tl.float32)  # before the reduction
    rms = tl.sqrt_rn(tl.sum(o * o, axis=0) / head_dim + eps)
    tl.store(out_ptr + row * stride_out_row + col, g / (1.0 + tl.exp(-g)) * (o / rms), mask=mask)


def retnet_output(o, g):
    """silu(g) * rmsnorm_per_head(o) (eps 1e-6, no weight), flattened: o [B, Hh, D], g [B, Hh*D]
    -> [B, Hh*D] float32, the input of the RetNet out_proj."""
    if not use_triton(o):
        return retnet_output_ref(o, g)
    o, g = _check(o, g)
    rows, heads, head_dim = o.shape
    out = torch.empty(rows, heads * head_dim, device=o.device, dtype=torch.float32)
    if rows == 0:
        return out
    _retnet_output_kernel[(rows, heads)](
        o, g, out, head_dim,
        o.stride(0), o.stride(1), g.stride(0), out.stride(0),
        RMS_EPS, BLOCK_D=next_pow2(head_dim), num_warps=2,
    )
    return out
