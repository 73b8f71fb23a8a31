"""One Mamba2 SSM step against a slot-indexed state table (like mamba_ssm's selective_state_update), with its
dt projection:

dt = softplus(t w_dt^T + b_dt); h <- exp(a*dt) h + dt * x b^T; y = h c + d x   (per head; h is [P, N]).

dt_proj is a [heads, hidden] fp32 product: as a cuBLAS call it cost two kernels per block at one row (a dot and a
reduction) and an FMA-bound GEMM at 20 rows, on the Mamba2 tower's chain. Here each program computes its head's
dt from t (a row of hidden values, read from L2 by the head's programs after the first).

h may be stored in fp16/bf16 (kernels/state_rounding.py): the math and the readout use the fp32 h, and only its
store rounds.
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels._common import check_input, check_slot_ids, check_state, split_block, use_triton
from kernels._math import softplus
from kernels.state_rounding import (STATE_DTYPES, check_rounding, kernel_args, row_seed, store_ref, store_state,
                                    to_fp32)

# A [BLOCK_P, N] tile of h per program, at most this many fp32 values (16 per thread at 4 warps)
MAX_TILE = 2048
NUM_WARPS = 4


def _check(h, x, t, dt_weight, dt_bias, a, b, c, d, slot_ids, rounding):
    if not isinstance(h, torch.Tensor) or h.dim() != 4:
        raise ValueError(f"h must be a [S, H, P, N] tensor, got {getattr(h, 'shape', type(h).__name__)}")
    slots, heads, head_dim, state_dim = h.shape
    device = h.device
    check_state("h", h, (None, heads, head_dim, state_dim), device, STATE_DTYPES)
    rows = x.shape[0] if isinstance(x, torch.Tensor) and x.dim() == 3 else None
    x = check_input("x", x, (rows, heads, head_dim), device)
    t = check_input("t", t, (rows, None), device)
    dt_weight = check_input("dt_weight", dt_weight, (heads, t.shape[1]), device)
    dt_bias = check_input("dt_bias", dt_bias, (heads,), device)
    a = check_input("a", a, (heads,), device)
    b = check_input("b", b, (rows, state_dim), device)
    c = check_input("c", c, (rows, state_dim), device)
    d = check_input("d", d, (heads,), device)
    check_slot_ids(slot_ids, rows, device)
    return x, t, dt_weight, dt_bias, a, b, c, d, check_rounding(rounding, slots, device)


def mamba2_state_update_ref(h, x, t, dt_weight, dt_bias, a, b, c, d, slot_ids, rounding=None):
    """PyTorch reference of mamba2_state_update, same signature and in-place semantics."""
    x, t, dt_weight, dt_bias, a, b, c, d, rounding = _check(h, x, t, dt_weight, dt_bias, a, b, c, d, slot_ids,
                                                            rounding)
    x, b, c = x.float(), b.float(), c.float()
    index = slot_ids.long()
    dt = F.softplus(t.float() @ dt_weight.float().t() + dt_bias.float())
    decay = torch.exp(a.float() * dt)
    h_new = decay[:, :, None, None] * h[index].float() + dt[:, :, None, None] * x[:, :, :, None] * b[:, None, None, :]
    store_ref(h, slot_ids, h_new, rounding)
    return (h_new * c[:, None, None, :]).sum(-1) + d.float()[:, None] * x


@triton.jit(do_not_specialize=["salt"])
def _mamba2_state_update_kernel(
    h_ptr, x_ptr, t_ptr, dt_w_ptr, dt_b_ptr, a_ptr, b_ptr, c_ptr, d_ptr, slot_ptr, y_ptr, counter_ptr,
    head_dim, state_dim, hidden, salt,
    stride_h_slot, stride_h_head, stride_h_p, stride_counter,
    stride_x_row, stride_x_head, stride_t_row, stride_dt_w, stride_b_row, stride_c_row,
    stride_y_row, stride_y_head,
    STOCHASTIC: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    p_mask = p < head_dim
    n_mask = n < state_dim
    # every load first (the state's once the slot is known): each is a memory round trip
    slot = tl.load(slot_ptr + row).to(tl.int64)
    k = tl.arange(0, BLOCK_K)
    t = tl.load(t_ptr + row * stride_t_row + k, mask=k < hidden, other=0.0).to(tl.float32)
    dt_w = tl.load(dt_w_ptr + head * stride_dt_w + k, mask=k < hidden, other=0.0).to(tl.float32)
    dt_b = tl.load(dt_b_ptr + head).to(tl.float32)
    a = tl.load(a_ptr + head).to(tl.float32)
    skip = tl.load(d_ptr + head).to(tl.float32)
    x = tl.load(x_ptr + row * stride_x_row + head * stride_x_head + p, mask=p_mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + row * stride_b_row + n, mask=n_mask, other=0.0).to(tl.float32)
    c = tl.load(c_ptr + row * stride_c_row + n, mask=n_mask, other=0.0).to(tl.float32)
    index = head * stride_h_head + p[:, None] * stride_h_p + n[None, :]  # within the slot's h
    tile = h_ptr + slot * stride_h_slot + index
    tile_mask = p_mask[:, None] & n_mask[None, :]
    h = tl.load(tile, mask=tile_mask, other=0.0)
    if STOCHASTIC:
        seed = row_seed(tl.load(counter_ptr + slot * stride_counter), salt)
    else:
        seed = 0

    dt = softplus(tl.sum(t * dt_w, axis=0) + dt_b)
    h = tl.exp(a * dt) * to_fp32(h) + (dt * x)[:, None] * b[None, :]
    store_state(tile, h, tile_mask, STOCHASTIC, seed, index)

    y = tl.sum(h * c[None, :], axis=1) + skip * x
    tl.store(y_ptr + row * stride_y_row + head * stride_y_head + p, y, mask=p_mask)


def mamba2_state_update(h, x, t, dt_weight, dt_bias, a, b, c, d, slot_ids, rounding=None):
    """Advance each row's Mamba2 state by one step and read it out.

    h [S, H, P, N] fp32, fp16 or bf16 (updated in place at slot_ids; may be a slot-major view), x [B, H, P]
    (conv+silu output viewed per head), t [B, K] (the layer's input) with dt_weight [H, K] and dt_bias [H]
    (dt_proj; softplus applied inside), a [H] (negative), b [B, N], c [B, N], d [H], slot_ids [B] int32.
    rounding: how a 16-bit h is stored, None or "nearest", or StochasticRounding(counter, salt)
    (kernels/state_rounding.py); an fp32 h is stored as is. Returns y [B, H, P] float32, read from the fp32 h
    before its rounding.
    """
    if not use_triton(h):
        return mamba2_state_update_ref(h, x, t, dt_weight, dt_bias, a, b, c, d, slot_ids, rounding)
    x, t, dt_weight, dt_bias, a, b, c, d, rounding = _check(h, x, t, dt_weight, dt_bias, a, b, c, d, slot_ids,
                                                            rounding)
    dt_weight = dt_weight.contiguous()
    rows, heads, head_dim = x.shape
    state_dim = h.shape[3]
    y = torch.empty(rows, heads, head_dim, device=h.device, dtype=torch.float32)
    if rows == 0:
        return y
    block_n = triton.next_power_of_2(state_dim)
    block_p = split_block(head_dim, rows * heads, max_block=max(1, MAX_TILE // block_n), min_block=4)
    grid = (rows, heads, triton.cdiv(head_dim, block_p))
    counter, stride_counter, salt, stochastic = kernel_args(h, rounding, slot_ids)
    _mamba2_state_update_kernel[grid](
        h, x, t, dt_weight, dt_bias, a, b, c, d, slot_ids, y, counter,
        head_dim, state_dim, t.shape[1], salt,
        h.stride(0), head_dim * state_dim, state_dim, stride_counter,
        x.stride(0), x.stride(1), t.stride(0), dt_weight.stride(0), b.stride(0), c.stride(0),
        y.stride(0), y.stride(1),
        STOCHASTIC=stochastic, BLOCK_P=block_p, BLOCK_N=block_n, BLOCK_K=triton.next_power_of_2(t.shape[1]),
        num_warps=NUM_WARPS,
    )
    return y
