"""RG-LRU steps (Hawk's recurrence) against a slot-indexed state table, fused with the output gate, a step's rows
grouped in sequences (kernels/_common.py).

For each row of a sequence, in order: i = sigmoid(i_pre); r = sigmoid(r_pre); alpha = a^(c r) = exp(c r log a);
h <- alpha h + sqrt(1 - alpha^2) (i u); returns gelu(gate_pre) * h (exact erf GELU).
A program per (sequence, block of columns) holds its h through the sequence's rows: loaded once, stored once.
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels._common import check_input, check_plan, check_state, row_positions, use_triton
from kernels._math import sigmoid

BLOCK = 512


def _check(gate_pre, u, i_pre, r_pre, a, h, seq_slots, seq_starts):
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
    check_plan(seq_slots, seq_starts, device)
    return (*inputs, a)


def rglru_step_ref(gate_pre, u, i_pre, r_pre, a, h, seq_slots, seq_starts, c=8.0):
    """PyTorch reference of rglru_step, same signature and in-place semantics (padding rows: zeros)."""
    gate_pre, u, i_pre, r_pre, a = (t.float() for t in _check(gate_pre, u, i_pre, r_pre, a, h, seq_slots,
                                                                seq_starts))
    # the per-row terms of the update, which do not depend on the state
    alpha = torch.exp(c * torch.sigmoid(r_pre) * torch.log(a))
    drive = torch.sqrt(1 - alpha * alpha) * (torch.sigmoid(i_pre) * u)
    slots, positions = row_positions(seq_slots, seq_starts, u.shape[0], h.shape[0])
    state = h[slots]
    out = torch.zeros(u.shape, dtype=torch.float32, device=u.device)
    for active, rows in positions:
        state[active] = alpha[rows] * state[active] + drive[rows]
        out[rows] = F.gelu(gate_pre[rows]) * state[active]
    h[slots] = state
    return out


@triton.jit
def _rglru_step_kernel(
    gate_ptr, u_ptr, i_ptr, r_ptr, a_ptr, h_ptr, seq_slots_ptr, seq_starts_ptr, out_ptr,
    width, stride_gate_row, stride_u_row, stride_i_row, stride_r_row, stride_h_slot, stride_out_row,
    c, BLOCK: tl.constexpr,
):
    seq = tl.program_id(0)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    start = tl.load(seq_starts_ptr + seq)
    end = tl.load(seq_starts_ptr + seq + 1)
    mask = col < tl.where(start < end, width, 0)  # an empty sequence touches no state
    slot = tl.load(seq_slots_ptr + seq).to(tl.int64)
    a = tl.load(a_ptr + col, mask=mask, other=1.0).to(tl.float32)
    h_ptrs = h_ptr + slot * stride_h_slot + col
    h = tl.load(h_ptrs, mask=mask, other=0.0)
    for row in range(start, end):
        gate = tl.load(gate_ptr + row * stride_gate_row + col, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + row * stride_u_row + col, mask=mask, other=0.0).to(tl.float32)
        i = sigmoid(tl.load(i_ptr + row * stride_i_row + col, mask=mask, other=0.0).to(tl.float32))
        r = sigmoid(tl.load(r_ptr + row * stride_r_row + col, mask=mask, other=0.0).to(tl.float32))
        alpha = tl.exp(c * r * tl.log(a))
        h = alpha * h + tl.sqrt_rn(1.0 - alpha * alpha) * (i * u)
        gelu = 0.5 * gate * (1.0 + tl.erf(gate * 0.7071067811865476))
        tl.store(out_ptr + row * stride_out_row + col, gelu * h, mask=mask)
    tl.store(h_ptrs, h, mask=mask)


def rglru_step(gate_pre, u, i_pre, r_pre, a, h, seq_slots, seq_starts, c=8.0):
    """Advance each sequence's RG-LRU state through its rows in order and apply the GELU output gate.

    gate_pre [B, Hd] (gate_proj output), u [B, Hd] (conv output), i_pre, r_pre [B, Hd] (block-linear
    outputs before the sigmoid), a [Hd] in (0, 1), h [S, Hd] fp32 updated in place at the sequences' slots,
    seq_slots int32 [G] and seq_starts int32 [G + 1] (kernels/_common.py), c the RG-LRU constant.
    Returns gelu(gate_pre) * h_new [B, Hd] float32; rows from seq_starts[G] on are left unwritten.
    """
    if not use_triton(h):
        return rglru_step_ref(gate_pre, u, i_pre, r_pre, a, h, seq_slots, seq_starts, c)
    gate_pre, u, i_pre, r_pre, a = _check(gate_pre, u, i_pre, r_pre, a, h, seq_slots, seq_starts)
    rows, width = u.shape
    sequences = seq_slots.shape[0]
    out = torch.empty(rows, width, device=h.device, dtype=torch.float32)
    if rows == 0 or sequences == 0:
        return out
    _rglru_step_kernel[(sequences, triton.cdiv(width, BLOCK))](
        gate_pre, u, i_pre, r_pre, a, h, seq_slots, seq_starts, out,
        width, gate_pre.stride(0), u.stride(0), i_pre.stride(0), r_pre.stride(0), h.stride(0), out.stride(0),
        float(c), BLOCK=BLOCK, num_warps=4,
    )
    return out
