"""One RG-LRU step (Hawk's recurrence) against a slot-indexed state table, fused with the output gate.

i = sigmoid(i_pre); r = sigmoid(r_pre); alpha = a^(c r) = exp(c r log a);
h <- alpha h + sqrt(1 - alpha^2) (i u); returns gelu(gate_pre) * h (exact erf GELU).
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels._common import check_input, check_slot_ids, check_state, use_triton
from kernels._math import sigmoid

BLOCK = 512


def _check(gate_pre, u, i_pre, r_pre, a, h, slot_ids):
    if not isinstance(h, torch.Tensor) or h.dim() != 2:
        raise ValueError(f"h must be a [S, Hd] tensor, got {getattr(h, 'shape', type(h).__name__)}")
    width = h.shape[1]
    device = h.device
    check_state("h", h, (None, width), device)
    rows = u.shape[0] if isinstance(u, torch.Tensor) and u.dim() == 2 else None
    inputs = [
        check_input(name, t, (rows, width), device)
        for name, t in (("gate_pre", gate_pre), ("u", u), ("i_pre", i_pre), ("r_pre", r_pre))
    ]
    a = check_input("a", a, (width,), device)
    check_slot_ids(slot_ids, rows, device)
    return (*inputs, a)


def rglru_step_ref(gate_pre, u, i_pre, r_pre, a, h, slot_ids, c=8.0):
    """PyTorch reference of rglru_step, same signature and in-place semantics."""
    gate_pre, u, i_pre, r_pre, a = (t.float() for t in _check(gate_pre, u, i_pre, r_pre, a, h, slot_ids))
    index = slot_ids.long()
    alpha = torch.exp(c * torch.sigmoid(r_pre) * torch.log(a))
    h_new = alpha * h[index] + torch.sqrt(1 - alpha * alpha) * (torch.sigmoid(i_pre) * u)
    h[index] = h_new
    return F.gelu(gate_pre) * h_new


@triton.jit
def _rglru_step_kernel(
    gate_ptr, u_ptr, i_ptr, r_ptr, a_ptr, h_ptr, slot_ptr, out_ptr,
    width, stride_gate_row, stride_u_row, stride_i_row, stride_r_row, stride_h_slot, stride_out_row,
    c, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = col < width
    slot = tl.load(slot_ptr + row).to(tl.int64)
    gate = tl.load(gate_ptr + row * stride_gate_row + col, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u_row + col, mask=mask, other=0.0).to(tl.float32)
    i = sigmoid(tl.load(i_ptr + row * stride_i_row + col, mask=mask, other=0.0).to(tl.float32))
    r = sigmoid(tl.load(r_ptr + row * stride_r_row + col, mask=mask, other=0.0).to(tl.float32))
    a = tl.load(a_ptr + col, mask=mask, other=1.0).to(tl.float32)
    h_ptrs = h_ptr + slot * stride_h_slot + col
    h = tl.load(h_ptrs, mask=mask, other=0.0)

    alpha = tl.exp(c * r * tl.log(a))
    h = alpha * h + tl.sqrt_rn(1.0 - alpha * alpha) * (i * u)
    tl.store(h_ptrs, h, mask=mask)
    gelu = 0.5 * gate * (1.0 + tl.erf(gate * 0.7071067811865476))
    tl.store(out_ptr + row * stride_out_row + col, gelu * h, mask=mask)


def rglru_step(gate_pre, u, i_pre, r_pre, a, h, slot_ids, c=8.0):
    """Advance each row's RG-LRU state by one step and apply the GELU output gate.

    gate_pre [B, Hd] (gate_proj output), u [B, Hd] (conv output), i_pre, r_pre [B, Hd] (block-linear
    outputs before the sigmoid), a [Hd] in (0, 1), h [S, Hd] fp32 updated in place at slot_ids,
    slot_ids [B] int32, c the RG-LRU constant. Returns gelu(gate_pre) * h_new [B, Hd] float32.
    """
    if not use_triton(h):
        return rglru_step_ref(gate_pre, u, i_pre, r_pre, a, h, slot_ids, c)
    gate_pre, u, i_pre, r_pre, a = _check(gate_pre, u, i_pre, r_pre, a, h, slot_ids)
    rows, width = u.shape
    out = torch.empty(rows, width, device=h.device, dtype=torch.float32)
    if rows == 0:
        return out
    _rglru_step_kernel[(rows, triton.cdiv(width, BLOCK))](
        gate_pre, u, i_pre, r_pre, a, h, slot_ids, out,
        width, gate_pre.stride(0), u.stride(0), i_pre.stride(0), r_pre.stride(0), h.stride(0), out.stride(0),
        float(c), BLOCK=BLOCK, num_warps=4,
    )
    return out
