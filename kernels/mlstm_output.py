"""mLSTM block output gate: out = (group_norm(h) + skip * xc) * silu(xg), in one pass.

out = ((F.group_norm(h, groups, gn_weight, gn_bias, 1e-5) + skip * xc) * F.silu(xg)) in out_dtype (the dtype
of proj_down's product, so no separate cast). xg may be a strided row view (e.g. the second half of the fused
x_proj/gate_proj product). One row per program, held as a [groups, inner / groups] tile (see slstm_output),
where PyTorch needs five to six kernels. Any inner divisible by groups works.
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels._common import check_input, use_triton
from kernels._math import sigmoid
from kernels.slstm_output import NORM_EPS, check_groups, check_out_dtype, group_normalize, group_tile, row_tile


def _check(h, xc, xg, skip, gn_weight, gn_bias, groups, out_dtype):
    if not isinstance(h, torch.Tensor) or h.dim() != 2:
        raise ValueError(f"h must be a [B, inner] tensor, got {getattr(h, 'shape', type(h).__name__)}")
    rows, width = h.shape
    rows_inputs = [check_input(name, t, (rows, width), h.device) for name, t in (("h", h), ("xc", xc), ("xg", xg))]
    params = [check_input(name, t, (width,), h.device)
              for name, t in (("skip", skip), ("gn_weight", gn_weight), ("gn_bias", gn_bias))]
    check_groups(groups, width)
    check_out_dtype(out_dtype)
    return (*rows_inputs, *params)


def mlstm_output_ref(h, xc, xg, skip, gn_weight, gn_bias, groups, out_dtype=torch.float32):
    """PyTorch reference of mlstm_output, same signature."""
    h, xc, xg, skip, gn_weight, gn_bias = (t.float() for t in _check(h, xc, xg, skip, gn_weight, gn_bias, groups,
                                                                     out_dtype))
    return ((F.group_norm(h, groups, gn_weight, gn_bias, NORM_EPS) + skip * xc) * F.silu(xg)).to(out_dtype)


@triton.jit
def _mlstm_output_kernel(h_ptr, xc_ptr, xg_ptr, skip_ptr, gn_weight_ptr, gn_bias_ptr, out_ptr, group_size,
                         stride_h, stride_xc, stride_xg, stride_out, eps, GROUPS: tl.constexpr,
                         GROUPS_BLOCK: tl.constexpr, GROUP_BLOCK: tl.constexpr):
    row = tl.program_id(0)
    col, mask = row_tile(GROUPS, GROUPS_BLOCK, GROUP_BLOCK, group_size)
    # every load first: at one row the kernel is a chain of memory round trips, and a load placed after a
    # reduction waits for it
    h = tl.load(h_ptr + row * stride_h + col, mask=mask, other=0.0).to(tl.float32)
    gn_w = tl.load(gn_weight_ptr + col, mask=mask, other=0.0).to(tl.float32)
    gn_b = tl.load(gn_bias_ptr + col, mask=mask, other=0.0).to(tl.float32)
    xc = tl.load(xc_ptr + row * stride_xc + col, mask=mask, other=0.0).to(tl.float32)
    skip = tl.load(skip_ptr + col, mask=mask, other=0.0).to(tl.float32)
    xg = tl.load(xg_ptr + row * stride_xg + col, mask=mask, other=0.0).to(tl.float32)
    v = group_normalize(h, mask, group_size, eps) * gn_w + gn_b + skip * xc
    tl.store(out_ptr + row * stride_out + col, (v * xg * sigmoid(xg)).to(out_ptr.dtype.element_ty), mask=mask)


def mlstm_output(h, xc, xg, skip, gn_weight, gn_bias, groups, out_dtype=torch.float32):
    """h, xc, xg [B, inner] (any row stride), skip/gn_weight/gn_bias [inner], inner divisible by groups
    -> out [B, inner] out_dtype."""
    if not use_triton(h):
        return mlstm_output_ref(h, xc, xg, skip, gn_weight, gn_bias, groups, out_dtype)
    h, xc, xg, skip, gn_weight, gn_bias = _check(h, xc, xg, skip, gn_weight, gn_bias, groups, out_dtype)
    rows, width = h.shape
    out = torch.empty(rows, width, device=h.device, dtype=out_dtype)
    if rows:
        _mlstm_output_kernel[(rows,)](h, xc, xg, skip, gn_weight, gn_bias, out, width // groups, h.stride(0),
                                      xc.stride(0), xg.stride(0), out.stride(0), NORM_EPS,
                                      **group_tile(groups, width))
    return out
