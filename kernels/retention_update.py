"""One RetNet recurrent retention step (rotary, state update, readout) against a slot-indexed state table,
and the fused output gate silu(g) * rmsnorm_per_head(o).

theta = float(offset) * angle; q~ = q cos theta + rot(q) sin theta, k~ likewise on k * D^-1/2, with
rot(u)[2j], rot(u)[2j+1] = -u[2j+1], u[2j];  S <- S * decay + k~ v^T;  scale <- scale * decay + 1;
o = (q~ S) / sqrt(scale);  offset <- offset + 1.
S may be stored in fp16/bf16 (kernels/state_rounding.py): the math and the readout use the fp32 S, and only its
store rounds.
"""
import torch
import triton
import triton.language as tl

from kernels._common import INTERPRET, check_input, check_slot_ids, check_state, next_pow2, split_block, use_triton
from kernels.state_rounding import (STATE_DTYPES, check_rounding, kernel_args, row_seed, store_ref, store_state,
                                    to_fp32)

RMS_EPS = 1e-6
# fp32 values of S streamed per program per loop iteration (32 per thread at 4 warps)
MAX_TILE = 4096
NUM_WARPS = 4

if not INTERPRET:  # the interpreter has no libdevice; numpy's cos/sin are exact enough there
    from triton.language.extra import libdevice


def _rotate(u):
    """rot(u): pairs (u[2j], u[2j+1]) -> (-u[2j+1], u[2j])."""
    pairs = u.unflatten(-1, (-1, 2))
    return torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(-2)


def _check_step(S, scale, offset, q, k, v, decay, angle, slot_ids, rounding):
    if not isinstance(S, torch.Tensor) or S.dim() != 4:
        raise ValueError(f"S must be a [S, Hh, D, D] tensor, got {getattr(S, 'shape', type(S).__name__)}")
    slots, heads, head_dim, _ = S.shape
    if head_dim % 2:
        raise ValueError(f"the head size D must be even for rotary pairs, got {head_dim}")
    device = S.device
    check_state("S", S, (slots, heads, head_dim, head_dim), device, STATE_DTYPES)
    check_state("scale", scale, (slots, heads), device)
    if not isinstance(offset, torch.Tensor) or offset.dtype != torch.int32:
        raise ValueError(f"offset must be an int32 tensor, got {getattr(offset, 'dtype', type(offset).__name__)}")
    check_state("offset", offset, (slots,), device, (torch.int32,))
    rows = q.shape[0] if isinstance(q, torch.Tensor) and q.dim() == 3 else None
    q = check_input("q", q, (rows, heads, head_dim), device)
    k = check_input("k", k, (rows, heads, head_dim), device)
    v = check_input("v", v, (rows, heads, head_dim), device)
    decay = check_input("decay", decay, (heads,), device)
    angle = check_input("angle", angle, (head_dim,), device)
    check_slot_ids(slot_ids, rows, device)
    return q, k, v, decay, angle, check_rounding(rounding, slots, device)


def retention_step_ref(S, scale, offset, q, k, v, decay, angle, slot_ids, rounding=None):
    """PyTorch reference of retention_step, same signature and in-place semantics."""
    q, k, v, decay, angle, rounding = _check_step(S, scale, offset, q, k, v, decay, angle, slot_ids, rounding)
    head_dim = q.shape[-1]
    index = slot_ids.long()
    decay = decay.float()
    theta = offset[index].float()[:, None, None] * angle.float()[None, None, :]
    cos, sin = torch.cos(theta), torch.sin(theta)
    q = q.float()
    k = k.float() * head_dim**-0.5
    q_rot = q * cos + _rotate(q) * sin
    k_rot = k * cos + _rotate(k) * sin
    S_new = S[index].float() * decay[None, :, None, None] + k_rot[..., :, None] * v.float()[..., None, :]
    scale_new = scale[index] * decay + 1
    store_ref(S, slot_ids, S_new, rounding)
    scale[index] = scale_new
    offset[index] = offset[index] + 1
    return torch.einsum("bhd,bhde->bhe", q_rot, S_new) / torch.sqrt(scale_new)[..., None]


@triton.jit
def _retention_prepare_kernel(
    scale_ptr, offset_ptr, q_ptr, k_ptr, decay_ptr, angle_ptr, slot_ptr,
    q_rot_ptr, k_rot_ptr, norm_ptr,
    heads, head_dim, k_scale,
    stride_scale_slot, stride_offset_slot, stride_q_row, stride_q_head, stride_k_row, stride_k_head,
    PRECISE_TRIG: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Per row, all heads at once: rotary q~, k~ into temporaries, sqrt(scale_new) into a temporary, then
    scale and offset updated in place. One program owns a row's scalars, so nothing reads them after
    they change; the state kernel runs after this one and only reads the temporaries."""
    row = tl.program_id(0)
    hd = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    h_mask = hd < heads
    d_mask = d < head_dim
    mask = h_mask[:, None] & d_mask[None, :]
    # every load first (the state's once the slot is known): at one row each is a memory round trip
    slot = tl.load(slot_ptr + row).to(tl.int64)
    partner = d ^ 1
    q_row = q_ptr + row * stride_q_row + hd[:, None] * stride_q_head
    q = tl.load(q_row + d[None, :], mask=mask, other=0.0).to(tl.float32)
    q_partner = tl.load(q_row + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    k_row = k_ptr + row * stride_k_row + hd[:, None] * stride_k_head
    k = tl.load(k_row + d[None, :], mask=mask, other=0.0).to(tl.float32) * k_scale
    k_partner = tl.load(k_row + partner[None, :], mask=mask, other=0.0).to(tl.float32) * k_scale
    angle = tl.load(angle_ptr + d, mask=d_mask, other=0.0).to(tl.float32)
    decay = tl.load(decay_ptr + hd, mask=h_mask, other=0.0).to(tl.float32)
    offset = tl.load(offset_ptr + slot * stride_offset_slot)
    scale_ptrs = scale_ptr + slot * stride_scale_slot + hd
    scale = tl.load(scale_ptrs, mask=h_mask, other=0.0) * decay + 1.0

    theta = offset.to(tl.float32) * angle
    if PRECISE_TRIG:
        cos = libdevice.cos(theta)
        sin = libdevice.sin(theta)
    else:
        cos = tl.cos(theta)
        sin = tl.sin(theta)
    sign = tl.where(d % 2 == 0, -1.0, 1.0)
    q_rot = q * cos[None, :] + (sign[None, :] * q_partner) * sin[None, :]
    k_rot = k * cos[None, :] + (sign[None, :] * k_partner) * sin[None, :]
    tmp = (row * heads + hd[:, None]) * head_dim + d[None, :]
    tl.store(q_rot_ptr + tmp, q_rot, mask=mask)
    tl.store(k_rot_ptr + tmp, k_rot, mask=mask)

    tl.store(scale_ptrs, scale, mask=h_mask)
    tl.store(norm_ptr + row * heads + hd, tl.sqrt_rn(scale), mask=h_mask)
    tl.debug_barrier()  # every thread has read the old offset (a scalar each thread loads) before one stores it
    tl.store(offset_ptr + slot * stride_offset_slot, offset + 1)


@triton.jit(do_not_specialize=["salt"])
def _retention_state_kernel(
    S_ptr, v_ptr, decay_ptr, slot_ptr, q_rot_ptr, k_rot_ptr, norm_ptr, o_ptr, counter_ptr,
    heads, head_dim, salt,
    stride_S_slot, stride_S_head, stride_S_row, stride_counter,
    stride_v_row, stride_v_head, stride_o_row, stride_o_head,
    STOCHASTIC: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr,
):
    """One program per (row, head, tile of value columns e): streams S[:, e-tile] once, in d chunks."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    e = tl.program_id(2) * BLOCK_E + tl.arange(0, BLOCK_E)
    e_mask = e < head_dim
    slot = tl.load(slot_ptr + row).to(tl.int64)
    decay = tl.load(decay_ptr + head).to(tl.float32)
    v = tl.load(v_ptr + row * stride_v_row + head * stride_v_head + e, mask=e_mask, other=0.0).to(tl.float32)
    S_slot = S_ptr + slot * stride_S_slot
    tmp = (row * heads + head) * head_dim
    acc = tl.zeros([BLOCK_E], dtype=tl.float32)
    for d0 in range(0, head_dim, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        d_mask = d < head_dim
        q_rot = tl.load(q_rot_ptr + tmp + d, mask=d_mask, other=0.0)
        k_rot = tl.load(k_rot_ptr + tmp + d, mask=d_mask, other=0.0)
        index = head * stride_S_head + d[:, None] * stride_S_row + e[None, :]  # within the slot's S
        tile_mask = d_mask[:, None] & e_mask[None, :]
        S = tl.load(S_slot + index, mask=tile_mask, other=0.0)
        if STOCHASTIC:  # the counter loaded in the loop, beside the tile: a seed hoisted out would wait for it
            seed = row_seed(tl.load(counter_ptr + slot * stride_counter), salt)
        else:
            seed = 0
        S = to_fp32(S) * decay + k_rot[:, None] * v[None, :]
        store_state(S_slot + index, S, tile_mask, STOCHASTIC, seed, index)
        acc += tl.sum(q_rot[:, None] * S, axis=0)
    o = acc / tl.load(norm_ptr + row * heads + head)
    tl.store(o_ptr + row * stride_o_row + head * stride_o_head + e, o, mask=e_mask)


def retention_step(S, scale, offset, q, k, v, decay, angle, slot_ids, rounding=None):
    """Advance each row's retention state by one step and read it out (before the per-head RMSNorm).

    S [S, Hh, D, D] fp32, fp16 or bf16, scale [S, Hh] fp32, offset [S] int32: all updated in place at
    slot_ids; each may be a slot-major view (kernels/_common.py). q, k, v [B, Hh, D] (k unscaled: D^-1/2 is
    applied inside), decay [Hh], angle [D], slot_ids [B] int32. rounding: how a 16-bit S is stored, None or
    "nearest", or StochasticRounding(counter, salt) (kernels/state_rounding.py); an fp32 S is stored as is.
    Returns o [B, Hh, D] float32, read from the fp32 S before its rounding.
    """
    if not use_triton(S):
        return retention_step_ref(S, scale, offset, q, k, v, decay, angle, slot_ids, rounding)
    q, k, v, decay, angle, rounding = _check_step(S, scale, offset, q, k, v, decay, angle, slot_ids, rounding)
    rows, heads, head_dim = q.shape
    device = S.device
    o = torch.empty(rows, heads, head_dim, device=device, dtype=torch.float32)
    if rows == 0:
        return o
    q_rot = torch.empty(rows, heads, head_dim, device=device, dtype=torch.float32)
    k_rot = torch.empty_like(q_rot)
    norm = torch.empty(rows, heads, device=device, dtype=torch.float32)
    _retention_prepare_kernel[(rows,)](
        scale, offset, q, k, decay, angle, slot_ids, q_rot, k_rot, norm,
        heads, head_dim, head_dim**-0.5,
        scale.stride(0), offset.stride(0), q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        PRECISE_TRIG=not INTERPRET, BLOCK_H=next_pow2(heads), BLOCK_D=next_pow2(head_dim), num_warps=4,
    )
    block_e = split_block(head_dim, rows * heads, max_block=64, min_block=16)
    block_d = max(1, min(next_pow2(head_dim), MAX_TILE // block_e))
    counter, stride_counter, salt, stochastic = kernel_args(S, rounding, slot_ids)
    _retention_state_kernel[(rows, heads, triton.cdiv(head_dim, block_e))](
        S, v, decay, slot_ids, q_rot, k_rot, norm, o, counter,
        heads, head_dim, salt,
        S.stride(0), head_dim * head_dim, head_dim, stride_counter,
        v.stride(0), v.stride(1), o.stride(0), o.stride(1),
        STOCHASTIC=stochastic, BLOCK_D=block_d, BLOCK_E=block_e, num_warps=NUM_WARPS,
    )
    return o


def _check_output(o, g):
    if not isinstance(o, torch.Tensor) or o.dim() != 3:
        raise ValueError(f"o must be a [B, Hh, D] tensor, got {getattr(o, 'shape', type(o).__name__)}")
    rows, heads, head_dim = o.shape
    o = check_input("o", o, (rows, heads, head_dim), o.device)
    g = check_input("g", g, (rows, heads * head_dim), o.device)
    return o, g


def retnet_output_ref(o, g):
    """PyTorch reference of retnet_output."""
    o, g = _check_output(o, g)
    o = o.float()
    normed = o / torch.sqrt(o.pow(2).mean(-1, keepdim=True) + RMS_EPS)
    g = g.float()
    return g * torch.sigmoid(g) * normed.flatten(1)


@triton.jit
def _retnet_output_kernel(
    o_ptr, g_ptr, out_ptr, heads, head_dim,
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
    o, g = _check_output(o, g)
    rows, heads, head_dim = o.shape
    out = torch.empty(rows, heads * head_dim, device=o.device, dtype=torch.float32)
    if rows == 0:
        return out
    _retnet_output_kernel[(rows, heads)](
        o, g, out, heads, head_dim,
        o.stride(0), o.stride(1), g.stride(0), out.stride(0),
        RMS_EPS, BLOCK_D=next_pow2(head_dim), num_warps=2,
    )
    return out
