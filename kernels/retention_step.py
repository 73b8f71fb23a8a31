"""RetNet recurrent retention steps (rotary, state update, readout) over a step's sequences against a
slot-indexed state table.

Per row, in each sequence's order: theta = float(offset) * angle; q~ = q cos theta + rot(q) sin theta, k~ likewise
on k * D^-1/2, with rot(u)[2j], rot(u)[2j+1] = -u[2j+1], u[2j];  S <- S * decay + k~ v^T;
scale <- scale * decay + 1;  o = (q~ S) / sqrt(scale);  offset <- offset + 1.

Two kernels: a prepare kernel per sequence carries scale and offset through its rows on chip and writes each row's
q~, k~ and sqrt(scale); kernels/outer_product_update.py then advances S with them and reads it out. S may be
stored in fp16/bf16 (kernels/state_rounding.py): it stays fp32 through a sequence's rows and only its store rounds.
"""
import torch
import triton
import triton.language as tl

from kernels.outer_product_update import launch as launch_outer_product, outer_product_update_ref
from kernels._common import INTERPRET, check_input, check_plan, check_state, next_pow2, row_positions, use_triton
from kernels.state_rounding import STATE_DTYPES, check_rounding

# fp32 values of S streamed per program per chunk (32 per thread at 4 warps)
MAX_TILE = 4096

if not INTERPRET:  # the interpreter has no libdevice; numpy's cos/sin are exact enough there
    from triton.language.extra import libdevice


def _rotate(u):
    """rot(u): pairs (u[2j], u[2j+1]) -> (-u[2j+1], u[2j])."""
    pairs = u.unflatten(-1, (-1, 2))
    return torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(-2)


def _check(S, scale, offset, q, k, v, decay, angle, seq_slots, seq_starts, rounding):
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
    check_plan(seq_slots, seq_starts, device)
    return q, k, v, decay, angle, check_rounding(rounding, slots, device)


def retention_step_ref(S, scale, offset, q, k, v, decay, angle, seq_slots, seq_starts, rounding=None):
    """PyTorch reference of retention_step, same signature and in-place semantics: rotary, scale and offset row
    position by row position, then S through outer_product_update_ref."""
    q, k, v, decay, angle, rounding = _check(S, scale, offset, q, k, v, decay, angle, seq_slots, seq_starts, rounding)
    rows, heads, head_dim = q.shape
    decay, angle = decay.float(), angle.float()
    q, k = q.float(), k.float() * head_dim**-0.5
    q_rot, k_rot = torch.zeros_like(q), torch.zeros_like(k)
    norm = torch.ones(rows, heads, device=q.device)
    slots, positions = row_positions(seq_slots, seq_starts, rows, S.shape[0])
    scale_seq, offset_seq = scale[slots], offset[slots]
    for which, rs in positions:  # row position j of every sequence longer than j
        theta = offset_seq[which].float()[:, None, None] * angle[None, None, :]
        cos, sin = torch.cos(theta), torch.sin(theta)
        q_rot[rs] = q[rs] * cos + _rotate(q[rs]) * sin
        k_rot[rs] = k[rs] * cos + _rotate(k[rs]) * sin
        scale_seq[which] = scale_seq[which] * decay + 1
        norm[rs] = torch.sqrt(scale_seq[which])
        offset_seq[which] += 1
    scale[slots], offset[slots] = scale_seq, offset_seq
    return outer_product_update_ref(S, q_rot, k_rot, v, decay.expand(rows, heads), norm, seq_slots, seq_starts,
                                          rounding)


@triton.jit
def _retention_prepare_kernel(
    scale_ptr, offset_ptr, q_ptr, k_ptr, decay_ptr, angle_ptr, seq_slot_ptr, seq_start_ptr,
    q_rot_ptr, k_rot_ptr, norm_ptr,
    heads, head_dim, k_scale,
    stride_scale_slot, stride_offset_slot, stride_q_row, stride_q_head, stride_k_row, stride_k_head,
    PRECISE_TRIG: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Per sequence, all heads at once: scale and offset held on chip through its rows; per row rotary q~, k~
    and sqrt(scale) into temporaries. One program owns a sequence's scalars, so nothing reads them after they
    change; the state kernel runs after this one and only reads the temporaries."""
    seq = tl.program_id(0)
    hd = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    h_mask = hd < heads
    d_mask = d < head_dim
    mask = h_mask[:, None] & d_mask[None, :]
    partner = d ^ 1
    sign = tl.where(d % 2 == 0, -1.0, 1.0)
    start = tl.load(seq_start_ptr + seq)
    end = tl.load(seq_start_ptr + seq + 1)
    live = start < end  # an empty sequence touches no state
    slot = tl.load(seq_slot_ptr + seq).to(tl.int64)
    angle = tl.load(angle_ptr + d, mask=d_mask, other=0.0).to(tl.float32)
    decay = tl.load(decay_ptr + hd, mask=h_mask, other=0.0).to(tl.float32)
    offset_ptrs = offset_ptr + slot * stride_offset_slot
    offset = tl.load(offset_ptrs, mask=live, other=0)
    scale_ptrs = scale_ptr + slot * stride_scale_slot + hd
    scale_mask = hd < tl.where(live, heads, 0)  # (not h_mask & live: the interpreter makes that int32)
    scale = tl.load(scale_ptrs, mask=scale_mask, other=0.0)
    for row in tl.range(start, end, num_stages=1):  # unpipelined: a prologue would cost the one-row step
        q_row = q_ptr + row * stride_q_row + hd[:, None] * stride_q_head
        q = tl.load(q_row + d[None, :], mask=mask, other=0.0).to(tl.float32)
        q_partner = tl.load(q_row + partner[None, :], mask=mask, other=0.0).to(tl.float32)
        k_row = k_ptr + row * stride_k_row + hd[:, None] * stride_k_head
        k = tl.load(k_row + d[None, :], mask=mask, other=0.0).to(tl.float32) * k_scale
        k_partner = tl.load(k_row + partner[None, :], mask=mask, other=0.0).to(tl.float32) * k_scale
        theta = offset.to(tl.float32) * angle
        if PRECISE_TRIG:
            cos = libdevice.cos(theta)
            sin = libdevice.sin(theta)
        else:
            cos = tl.cos(theta)
            sin = tl.sin(theta)
        q_rot = q * cos[None, :] + (sign[None, :] * q_partner) * sin[None, :]
        k_rot = k * cos[None, :] + (sign[None, :] * k_partner) * sin[None, :]
        tmp = (row * heads + hd[:, None]) * head_dim + d[None, :]
        tl.store(q_rot_ptr + tmp, q_rot, mask=mask)
        tl.store(k_rot_ptr + tmp, k_rot, mask=mask)
        scale = scale * decay + 1.0
        tl.store(norm_ptr + row * heads + hd, tl.sqrt_rn(scale), mask=h_mask)
        offset += 1
    # every thread has read the old offset (a scalar each thread loads) and scale (replicated across threads)
    # before one stores the new
    tl.debug_barrier()
    tl.store(scale_ptrs, scale, mask=scale_mask)
    tl.store(offset_ptrs, offset, mask=live)


def retention_step(S, scale, offset, q, k, v, decay, angle, seq_slots, seq_starts, rounding=None):
    """Advance each sequence's retention state through its rows, reading it out after each (before the per-head
    RMSNorm, kernels/retnet_output.py).

    S [S, Hh, D, D] fp32, fp16 or bf16, scale [S, Hh] fp32, offset [S] int32: all updated in place at seq_slots;
    each may be a slot-major view (kernels/_common.py). q, k, v [B, Hh, D] (k unscaled: D^-1/2 is applied
    inside), decay [Hh], angle [D]; seq_slots [G] and seq_starts [G + 1] int32 (kernels/_common.py). rounding:
    how a 16-bit S is stored, None or "nearest", or StochasticRounding(counter, salt) (kernels/state_rounding.py);
    an fp32 S is stored as is. Returns o [B, Hh, D] float32, read from the fp32 S; padding rows' are left
    unwritten.
    """
    if not use_triton(S):
        return retention_step_ref(S, scale, offset, q, k, v, decay, angle, seq_slots, seq_starts, rounding)
    q, k, v, decay, angle, rounding = _check(S, scale, offset, q, k, v, decay, angle, seq_slots, seq_starts, rounding)
    rows, heads, head_dim = q.shape
    sequences = seq_slots.shape[0]
    device = S.device
    o = torch.empty(rows, heads, head_dim, device=device, dtype=torch.float32)
    if rows == 0 or sequences == 0:
        return o
    q_rot, k_rot = torch.empty(2, rows, heads, head_dim, device=device, dtype=torch.float32)
    norm = torch.empty(rows, heads, device=device, dtype=torch.float32)
    _retention_prepare_kernel[(sequences,)](
        scale, offset, q, k, decay, angle, seq_slots, seq_starts, q_rot, k_rot, norm,
        heads, head_dim, head_dim**-0.5,
        scale.stride(0), offset.stride(0), q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        PRECISE_TRIG=not INTERPRET, BLOCK_H=next_pow2(heads), BLOCK_D=next_pow2(head_dim), num_warps=4,
    )
    # S keeps the one-row step's chunks at every size: the only backlog accuracy run with the larger chunks of a
    # full grid (K = 8) put RetNet on feed_mix at 99.78% within 1e-3, under the gate, where these passed (bench/LOG.md
    # section 46); they cost ~0.2 ms at 64x4
    return launch_outer_product(S, q_rot, k_rot, v, decay.expand(rows, heads), norm, seq_slots, seq_starts,
                                rounding, o, max_tile=MAX_TILE, many_symbols_tile=MAX_TILE)
