"""One sLSTM cell step (xLSTM's scalar memory) against slot-indexed state tables.

lf = m + logsigmoid(f); m_new = max(i, lf); i' = exp(i - m_new); f' = exp(lf - m_new);
c <- f' c + i' tanh(z); n <- f' n + i'; y <- sigmoid(o) c / (n + 1e-6).
m starts at -inf: f' is then selected to be exactly 0 (never computed from -inf - -inf).
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels._common import check_input, check_slot_ids, check_state, use_triton
from kernels._math import logsigmoid, sigmoid, tanh

Y_EPS = 1e-6
BLOCK = 512


def _check(i, f, z, o, c, n, m, y, slot_ids):
    if not isinstance(c, torch.Tensor) or c.dim() != 2:
        raise ValueError(f"c must be a [S, Hd] tensor, got {getattr(c, 'shape', type(c).__name__)}")
    slots, width = c.shape
    device = c.device
    for name, state in (("c", c), ("n", n), ("m", m), ("y", y)):
        check_state(name, state, (slots, width), device)
    rows = i.shape[0] if isinstance(i, torch.Tensor) and i.dim() == 2 else None
    gates = [check_input(name, t, (rows, width), device) for name, t in (("i", i), ("f", f), ("z", z), ("o", o))]
    check_slot_ids(slot_ids, rows, device)
    return gates


def slstm_cell_ref(i, f, z, o, c, n, m, y, slot_ids):
    """PyTorch reference of slstm_cell, same signature and in-place semantics."""
    i, f, z, o = (t.float() for t in _check(i, f, z, o, c, n, m, y, slot_ids))
    index = slot_ids.long()
    lf = m[index] + F.logsigmoid(f)
    m_new = torch.maximum(i, lf)
    i_gate = torch.exp(i - m_new)
    f_gate = torch.where(lf == float("-inf"), torch.zeros_like(lf), torch.exp(lf - m_new))
    c_new = f_gate * c[index] + i_gate * torch.tanh(z)
    n_new = f_gate * n[index] + i_gate
    y_new = torch.sigmoid(o) * c_new / (n_new + Y_EPS)
    c[index], n[index], m[index], y[index] = c_new, n_new, m_new, y_new
    return y_new


@triton.jit
def _slstm_cell_kernel(
    i_ptr, f_ptr, z_ptr, o_ptr, c_ptr, n_ptr, m_ptr, y_ptr, slot_ptr, out_ptr,
    width, stride_i_row, stride_f_row, stride_z_row, stride_o_row, stride_state_slot, stride_out_row,
    y_eps, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = col < width
    slot = tl.load(slot_ptr + row).to(tl.int64)
    i = tl.load(i_ptr + row * stride_i_row + col, mask=mask, other=0.0).to(tl.float32)
    f = tl.load(f_ptr + row * stride_f_row + col, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + row * stride_z_row + col, mask=mask, other=0.0).to(tl.float32)
    o = tl.load(o_ptr + row * stride_o_row + col, mask=mask, other=0.0).to(tl.float32)
    state = slot * stride_state_slot + col
    c = tl.load(c_ptr + state, mask=mask, other=0.0)
    n = tl.load(n_ptr + state, mask=mask, other=0.0)
    m = tl.load(m_ptr + state, mask=mask, other=0.0)

    lf = m + logsigmoid(f)
    m_new = tl.maximum(i, lf)
    i_gate = tl.exp(i - m_new)
    f_gate = tl.where(lf == float("-inf"), 0.0, tl.exp(lf - m_new))
    c = f_gate * c + i_gate * tanh(z)
    n = f_gate * n + i_gate
    y = sigmoid(o) * c / (n + y_eps)

    tl.store(c_ptr + state, c, mask=mask)
    tl.store(n_ptr + state, n, mask=mask)
    tl.store(m_ptr + state, m_new, mask=mask)
    tl.store(y_ptr + state, y, mask=mask)
    tl.store(out_ptr + row * stride_out_row + col, y, mask=mask)


def slstm_cell(i, f, z, o, c, n, m, y, slot_ids):
    """Advance each row's sLSTM cell by one step.

    i, f, z, o [B, Hd] gate pre-activations; c, n, m, y [S, Hd] fp32 states updated in place at slot_ids
    (c = n = y = 0, m = -inf at start); slot_ids [B] int32. Returns the new y [B, Hd] float32.
    """
    if not use_triton(c):
        return slstm_cell_ref(i, f, z, o, c, n, m, y, slot_ids)
    i, f, z, o = _check(i, f, z, o, c, n, m, y, slot_ids)
    rows, width = i.shape
    out = torch.empty(rows, width, device=c.device, dtype=torch.float32)
    if rows == 0:
        return out
    _slstm_cell_kernel[(rows, triton.cdiv(width, BLOCK))](
        i, f, z, o, c, n, m, y, slot_ids, out,
        width, i.stride(0), f.stride(0), z.stride(0), o.stride(0), c.stride(0), out.stride(0),
        Y_EPS, BLOCK=BLOCK, num_warps=4,
    )
    return out
