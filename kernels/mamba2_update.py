"""Mamba2 SSM steps against a slot-indexed state table (like mamba_ssm's selective_state_update), with its
dt projection, a step's rows grouped in sequences (kernels/_common.py). For each row of a sequence, in order:

dt = softplus(t w_dt^T + b_dt); h <- exp(a*dt) h + dt * x b^T; y = h c + d x   (per head; h is [P, N]).

A program per (sequence, head, block of P) holds its [BLOCK_P, N] tile of h in registers through the sequence's
rows: loaded once, stored once.

dt_proj is a [heads, hidden] fp32 product: as a cuBLAS call it cost two kernels per block at one row (a dot and a
reduction) and an FMA-bound GEMM at 20 rows, on the Mamba2 tower's chain. Here each program computes its head's
dt from t (a row of hidden values, read from L2 by the head's programs after the first).

The sizes are compile-time constants: the masks and the tile's offsets then fold into the code, which keeps the
registers that the row loop holds (the tile, its addresses and masks, dt_w) near those of the one-row kernel before
it (sm_90, compiled offline by Triton 3.9, BLOCK_P 8 / 16: 64 / 96 registers a thread; 106 / 137 with the sizes as
arguments; the one-row kernel 54 / 103).

h may be stored in fp16/bf16 (kernels/state_rounding.py): the math and the readout use the fp32 h, which stays
fp32 through a sequence's rows; only its one store rounds (stochastically: seeded from the slot's counter, which the
caller advances by the sequence's length after the step).
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels._common import check_input, check_plan, check_state, row_positions, split_block, use_triton
from kernels._math import softplus
from kernels.state_rounding import (STATE_DTYPES, check_rounding, kernel_args, row_seed, store_ref, store_state,
                                    to_fp32)

# A [BLOCK_P, N] tile of h per program, at most this many fp32 values (16 per thread at 4 warps)
MAX_TILE = 2048
NUM_WARPS = 4
# Steps of several rows a sequence: a whole head a program, over 8 warps. Each of a head's programs projects every
# row's dt from 8 KB of t inside the serial row loop; one program a head reads them once (bench/LOG.md section 49:
# 64 symbols x 4 rows 150 -> 145 us, x 8 rows 228+ -> 216 us; one row a sequence keeps the tile above)
SEVERAL_ROWS_WARPS = 8


def _check(h, x, t, dt_weight, dt_bias, a, b, c, d, seq_slots, seq_starts, rounding):
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
    check_plan(seq_slots, seq_starts, device)
    return x, t, dt_weight, dt_bias, a, b, c, d, check_rounding(rounding, slots, device)


def mamba2_state_update_ref(h, x, t, dt_weight, dt_bias, a, b, c, d, seq_slots, seq_starts, rounding=None):
    """PyTorch reference of mamba2_state_update, same signature and in-place semantics (padding rows: zeros)."""
    x, t, dt_weight, dt_bias, a, b, c, d, rounding = _check(h, x, t, dt_weight, dt_bias, a, b, c, d, seq_slots,
                                                            seq_starts, rounding)
    x, b, c = x.float(), b.float(), c.float()
    # the per-row terms of the update, which do not depend on the state
    dt = F.softplus(t.float() @ dt_weight.float().t() + dt_bias.float())
    decay = torch.exp(a.float() * dt)
    drive = dt[:, :, None, None] * x[:, :, :, None] * b[:, None, None, :]
    slots, positions = row_positions(seq_slots, seq_starts, x.shape[0], h.shape[0])
    state = h[slots].float()  # fp32 through the sequences' rows, rounded once at the store
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for active, rows in positions:
        state[active] = decay[rows][:, :, None, None] * state[active] + drive[rows]
        y[rows] = (state[active] * c[rows][:, None, None, :]).sum(-1) + d.float()[:, None] * x[rows]
    store_ref(h, slots, state, rounding)
    return y


@triton.jit(do_not_specialize=["salt"])
def _mamba2_state_update_kernel(
    h_ptr, x_ptr, t_ptr, dt_w_ptr, dt_b_ptr, a_ptr, b_ptr, c_ptr, d_ptr, seq_slots_ptr, seq_starts_ptr, y_ptr,
    counter_ptr, salt, stride_h_slot, stride_counter,
    stride_x_row, stride_x_head, stride_t_row, stride_dt_w, stride_b_row, stride_c_row,
    stride_y_row, stride_y_head,
    HEAD_DIM: tl.constexpr, STATE_DIM: tl.constexpr, HIDDEN: tl.constexpr,
    STOCHASTIC: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    start = tl.load(seq_starts_ptr + seq)
    end = tl.load(seq_starts_ptr + seq + 1)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    p_mask = p < HEAD_DIM
    n_mask = n < STATE_DIM
    k_mask = k < HIDDEN
    # every load first (the state's once the slot is known): each is a memory round trip
    slot = tl.load(seq_slots_ptr + seq).to(tl.int64)
    dt_w = tl.load(dt_w_ptr + head * stride_dt_w + k, mask=k_mask, other=0.0).to(tl.float32)
    dt_b = tl.load(dt_b_ptr + head).to(tl.float32)
    a = tl.load(a_ptr + head).to(tl.float32)
    skip = tl.load(d_ptr + head).to(tl.float32)
    index = head * (HEAD_DIM * STATE_DIM) + p[:, None] * STATE_DIM + n[None, :]  # within the slot's h
    tile = h_ptr + slot * stride_h_slot + index
    tile_mask = p_mask[:, None] & n_mask[None, :]
    live = start < end  # an empty sequence touches no state
    if live:
        h = to_fp32(tl.load(tile, mask=tile_mask, other=0.0))
    else:
        h = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    if STOCHASTIC:
        seed = row_seed(tl.load(counter_ptr + slot * stride_counter), salt)
    else:
        seed = 0

    for row in range(start, end):
        t = tl.load(t_ptr + row * stride_t_row + k, mask=k_mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + row * stride_x_row + head * stride_x_head + p, mask=p_mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + row * stride_b_row + n, mask=n_mask, other=0.0).to(tl.float32)
        c = tl.load(c_ptr + row * stride_c_row + n, mask=n_mask, other=0.0).to(tl.float32)
        dt = softplus(tl.sum(t * dt_w, axis=0) + dt_b)
        h = tl.exp(a * dt) * h + (dt * x)[:, None] * b[None, :]
        y = tl.sum(h * c[None, :], axis=1) + skip * x
        tl.store(y_ptr + row * stride_y_row + head * stride_y_head + p, y, mask=p_mask)
    if live:
        store_state(tile, h, tile_mask, STOCHASTIC, seed, index)


def mamba2_state_update(h, x, t, dt_weight, dt_bias, a, b, c, d, seq_slots, seq_starts, rounding=None, *,
                        block_p=None, num_warps=None):
    """Advance each sequence's Mamba2 state through its rows in order and read it out at each.

    h [S, H, P, N] fp32, fp16 or bf16 (updated in place at the sequences' slots; may be a slot-major view),
    x [B, H, P] (conv+silu output viewed per head), t [B, K] (the layer's input) with dt_weight [H, K] and
    dt_bias [H] (dt_proj; softplus applied inside), a [H] (negative), b [B, N], c [B, N], d [H],
    seq_slots int32 [G] and seq_starts int32 [G + 1] (kernels/_common.py).
    rounding: how a 16-bit h is stored, None or "nearest", or StochasticRounding(counter, salt)
    (kernels/state_rounding.py; seeded from counter[slot] once per sequence); an fp32 h is stored as is.
    Returns y [B, H, P] float32, read from the fp32 h before its rounding; rows from seq_starts[G] on are left
    unwritten. block_p, num_warps: the tiling, chosen here unless given (scripts/tile_sweep.py compares tilings).
    """
    if not use_triton(h):
        return mamba2_state_update_ref(h, x, t, dt_weight, dt_bias, a, b, c, d, seq_slots, seq_starts, rounding)
    x, t, dt_weight, dt_bias, a, b, c, d, rounding = _check(h, x, t, dt_weight, dt_bias, a, b, c, d, seq_slots,
                                                            seq_starts, rounding)
    dt_weight = dt_weight.contiguous()
    rows, heads, head_dim = x.shape
    sequences = seq_slots.shape[0]
    state_dim = h.shape[3]
    y = torch.empty(rows, heads, head_dim, device=h.device, dtype=torch.float32)
    if rows == 0 or sequences == 0:
        return y
    block_n = triton.next_power_of_2(state_dim)
    if rows > sequences:  # a shape of several rows a sequence
        block_p, num_warps = block_p or triton.next_power_of_2(head_dim), num_warps or SEVERAL_ROWS_WARPS
    block_p = block_p or split_block(head_dim, sequences * heads, max_block=max(1, MAX_TILE // block_n), min_block=4)
    num_warps = num_warps or NUM_WARPS
    grid = (sequences, heads, triton.cdiv(head_dim, block_p))
    counter, stride_counter, salt, stochastic = kernel_args(h, rounding, seq_slots)
    _mamba2_state_update_kernel[grid](
        h, x, t, dt_weight, dt_bias, a, b, c, d, seq_slots, seq_starts, y, counter, salt, h.stride(0), stride_counter,
        x.stride(0), x.stride(1), t.stride(0), dt_weight.stride(0), b.stride(0), c.stride(0), y.stride(0), y.stride(1),
        HEAD_DIM=head_dim, STATE_DIM=state_dim, HIDDEN=t.shape[1], STOCHASTIC=stochastic, BLOCK_P=block_p,
        BLOCK_N=block_n, BLOCK_K=triton.next_power_of_2(t.shape[1]), num_warps=num_warps,
    )
    return y
