"""The mLSTM's input side in one pass: the causal convolution, the block-diagonal q/k/v maps and the gate
projection, as partial sums that mlstm_step finishes; a step's rows grouped in sequences (kernels/_common.py).

xc = silu(conv(xm)) with the conv state shifted at the sequences' slots through their rows in order (as
kernels/causal_conv_update.py does); per row, q = Wq xc, k = Wk xc, v = Wv xm blockwise over blocks of 4 channels;
gates = W_gate concat(q, k, v) + b_gate. The gate projection reads every channel, so each program returns the
part of it over its CHUNK channels: parts [P, B, G], bias in part 0, and mlstm_step sums the parts as it reads its
gates. No kernel sits between the two, where a separate [B, 3 inner] x [3 inner, G] product took three
(bench/LOG.md, section 13). A program per (sequence, chunk) loads its conv taps once, takes the sequence's rows
in turn and stores the taps once; rows from seq_starts[G] on (padding) are left unwritten.

The widths are compile-time constants: the masks and the gate weights' offsets then fold into the code (sm_90,
compiled offline by Triton 3.9: 56 registers a thread, against 139 with them as arguments, where the row loop
holds the gate weights' addresses and masks; the one-row kernel before it took 32, with fewer of its weight loads
in flight at once). The weights are loaded once before the row loop, which otherwise reloads them every row
(64 symbols x 4 rows: 1,124 -> 611 us a step, bench/LOG.md section 49).
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels._common import check_input, check_plan, check_state, next_pow2, use_triton
from kernels._math import sigmoid
from kernels.causal_conv_update import causal_conv_update_ref

QKV_BLOCK = 4
CHUNK = 64  # channels per program: 64 programs per row at the full model's 4096


def pack_qkv_weight(q_weight, k_weight, v_weight):
    """BlockLinear weights [inner / 4, 4, 4] (out, in) of q, k, v -> the op's qkv_weight [inner / 4, 3, 4, 4]."""
    return torch.stack([q_weight, k_weight, v_weight], dim=1).float().contiguous()


def num_parts(inner: int) -> int:
    return -(-inner // CHUNK)


def _check(xm, conv_state, conv_weight, conv_bias, qkv_weight, gate_weight, gate_bias, seq_slots, seq_starts):
    if not isinstance(xm, torch.Tensor) or xm.dim() != 2:
        raise ValueError(f"xm must be a [B, inner] tensor, got {getattr(xm, 'shape', type(xm).__name__)}")
    rows, inner = xm.shape
    device = xm.device
    if inner % QKV_BLOCK:
        raise ValueError(f"inner width {inner} must be a multiple of {QKV_BLOCK}")
    xm = check_input("xm", xm, (rows, inner), device)
    check_state("conv_state", conv_state, (None, inner, 3), device)
    conv_weight = check_input("conv_weight", conv_weight, (inner, 4), device).contiguous()
    conv_bias = check_input("conv_bias", conv_bias, (inner,), device)
    qkv_weight = check_input("qkv_weight", qkv_weight, (inner // QKV_BLOCK, 3, QKV_BLOCK, QKV_BLOCK),
                             device).contiguous()
    gates = gate_weight.shape[0] if isinstance(gate_weight, torch.Tensor) and gate_weight.dim() == 2 else None
    gate_weight = check_input("gate_weight", gate_weight, (gates, 3 * inner), device).contiguous()
    gate_bias = check_input("gate_bias", gate_bias, (gates,), device)
    check_plan(seq_slots, seq_starts, device)
    return xm, conv_weight, conv_bias, qkv_weight, gate_weight, gate_bias


def mlstm_input_ref(xm, conv_state, conv_weight, conv_bias, qkv_weight, gate_weight, gate_bias, seq_slots,
                    seq_starts):
    """PyTorch reference of mlstm_input, same signature and in-place semantics (fp32 throughout; padding rows
    computed from a zero xc)."""
    xm, conv_weight, conv_bias, qkv_weight, gate_weight, gate_bias = _check(
        xm, conv_state, conv_weight, conv_bias, qkv_weight, gate_weight, gate_bias, seq_slots, seq_starts)
    rows, inner = xm.shape
    xc = causal_conv_update_ref(xm, conv_state, conv_weight, conv_bias, seq_slots, seq_starts, "silu")
    blocks = inner // QKV_BLOCK
    w = qkv_weight.float()
    q, k, v = (torch.einsum("bgi,goi->bgo", x.float().view(rows, blocks, QKV_BLOCK), w[:, t]).reshape(rows, inner)
               for t, x in enumerate((xc, xc, xm)))
    qkv = torch.stack([q, k, v], dim=1)  # [B, 3, inner]
    parts = num_parts(inner)
    pad = parts * CHUNK - inner
    chunks = F.pad(qkv, (0, pad)).view(rows, 3, parts, CHUNK)
    w_gate = F.pad(gate_weight.float().view(-1, 3, inner), (0, pad)).view(-1, 3, parts, CHUNK)
    gate_parts = torch.einsum("btpc,gtpc->pbg", chunks, w_gate).contiguous()
    gate_parts[0] += gate_bias.float()
    return xc, qkv, gate_parts


@triton.jit
def _four_columns(w, mask):
    """W[block, o, i] for i = 0..3 of a map's [GROUPS, 4] tile of (block, o) addresses at i = 0."""
    return (tl.load(w, mask=mask, other=0.0), tl.load(w + 1, mask=mask, other=0.0),
            tl.load(w + 2, mask=mask, other=0.0), tl.load(w + 3, mask=mask, other=0.0))


@triton.jit
def _mlstm_input_kernel(
    xm_ptr, state_ptr, conv_w_ptr, conv_b_ptr, qkv_w_ptr, gate_w_ptr, gate_b_ptr, seq_slots_ptr, seq_starts_ptr,
    xc_ptr, qkv_ptr, parts_ptr, rows, stride_xm, stride_state, stride_xc, stride_qkv,
    INNER: tl.constexpr, GATES: tl.constexpr, CHUNK: tl.constexpr, GATES_BLOCK: tl.constexpr,
):
    seq = tl.program_id(0)
    chunk = tl.program_id(1)
    GROUPS: tl.constexpr = CHUNK // 4
    g = tl.arange(0, GROUPS)
    e = tl.arange(0, 4)
    ch = chunk * CHUNK + g[:, None] * 4 + e[None, :]  # [GROUPS, 4]: channel of (block, place in block)
    start = tl.load(seq_starts_ptr + seq)
    end = tl.load(seq_starts_ptr + seq + 1)
    mask = ch < tl.where(start < end, INNER, 0)  # an empty sequence touches no state and loads nothing
    slot = tl.load(seq_slots_ptr + seq).to(tl.int64)

    # the causal convolution's (kernel 4) state keeps the last three inputs
    state = state_ptr + slot * stride_state + ch * 3
    s0 = tl.load(state, mask=mask, other=0.0)
    s1 = tl.load(state + 1, mask=mask, other=0.0)
    s2 = tl.load(state + 2, mask=mask, other=0.0)
    cw = conv_w_ptr + ch * 4
    cw0 = tl.load(cw, mask=mask, other=0.0)
    cw1 = tl.load(cw + 1, mask=mask, other=0.0)
    cw2 = tl.load(cw + 2, mask=mask, other=0.0)
    cw3 = tl.load(cw + 3, mask=mask, other=0.0)
    conv_b = tl.load(conv_b_ptr + ch, mask=mask, other=0.0)
    o = tl.arange(0, GATES_BLOCK)
    gw = gate_w_ptr + o[:, None, None] * (3 * INNER) + ch[None, :, :]  # [G, GROUPS, 4]
    gw_mask = (o < GATES)[:, None, None] & mask[None, :, :]
    gate_b = tl.load(gate_b_ptr + o, mask=o < GATES, other=0.0) * (chunk == 0).to(tl.float32)
    # the weights once, before the row loop: the compiler reloads them every row otherwise (the loop's stores
    # may alias them), ~12 KB a row from L2 for each of a step's (sequence, chunk) programs
    w = qkv_w_ptr + (chunk * GROUPS + g)[:, None] * 48 + e[None, :] * 4  # W[block, 0, o, 0]
    wq0, wq1, wq2, wq3 = _four_columns(w, mask)
    wk0, wk1, wk2, wk3 = _four_columns(w + 16, mask)
    wv0, wv1, wv2, wv3 = _four_columns(w + 32, mask)
    gw_q = tl.load(gw, mask=gw_mask, other=0.0)
    gw_k = tl.load(gw + INNER, mask=gw_mask, other=0.0)
    gw_v = tl.load(gw + 2 * INNER, mask=gw_mask, other=0.0)

    for row in range(start, end):
        xm = tl.load(xm_ptr + row * stride_xm + ch, mask=mask, other=0.0).to(tl.float32)
        xc = cw0 * s0 + cw1 * s1 + cw2 * s2 + cw3 * xm + conv_b
        xc = xc * sigmoid(xc)
        tl.store(xc_ptr + row * stride_xc + ch, xc, mask=mask)
        s0, s1, s2 = s1, s2, xm

        # q, k, v: out[block, o] = sum_i W[block, o, i] x[block, i], as [GROUPS, 4] tiles over (block, o);
        # x[block, i] broadcast over o
        xc0 = tl.sum(tl.where(e[None, :] == 0, xc, 0.0), axis=1)[:, None]
        xc1 = tl.sum(tl.where(e[None, :] == 1, xc, 0.0), axis=1)[:, None]
        xc2 = tl.sum(tl.where(e[None, :] == 2, xc, 0.0), axis=1)[:, None]
        xc3 = tl.sum(tl.where(e[None, :] == 3, xc, 0.0), axis=1)[:, None]
        xm0 = tl.sum(tl.where(e[None, :] == 0, xm, 0.0), axis=1)[:, None]
        xm1 = tl.sum(tl.where(e[None, :] == 1, xm, 0.0), axis=1)[:, None]
        xm2 = tl.sum(tl.where(e[None, :] == 2, xm, 0.0), axis=1)[:, None]
        xm3 = tl.sum(tl.where(e[None, :] == 3, xm, 0.0), axis=1)[:, None]
        q = wq0 * xc0 + wq1 * xc1 + wq2 * xc2 + wq3 * xc3
        k = wk0 * xc0 + wk1 * xc1 + wk2 * xc2 + wk3 * xc3
        v = wv0 * xm0 + wv1 * xm1 + wv2 * xm2 + wv3 * xm3
        out = qkv_ptr + row * stride_qkv + ch
        tl.store(out, q, mask=mask)
        tl.store(out + INNER, k, mask=mask)
        tl.store(out + 2 * INNER, v, mask=mask)

        # this chunk's part of the gate projection over concat(q, k, v)
        acc = gw_q * q[None, :, :] + gw_k * k[None, :, :] + gw_v * v[None, :, :]
        part = tl.sum(tl.sum(acc, axis=2), axis=1) + gate_b
        tl.store(parts_ptr + (chunk * rows + row) * GATES + o, part, mask=o < GATES)

    # A tile smaller than the program's threads is held by several threads each: without this barrier one
    # copy's shifted state could land before another copy has read the old one.
    tl.debug_barrier()
    tl.store(state, s0, mask=mask)
    tl.store(state + 1, s1, mask=mask)
    tl.store(state + 2, s2, mask=mask)


def mlstm_input(xm, conv_state, conv_weight, conv_bias, qkv_weight, gate_weight, gate_bias, seq_slots, seq_starts):
    """xm [B, inner] (the mLSTM's x projection), conv_state [S, inner, 3] fp32 (updated in place at the sequences'
    slots), conv_weight [inner, 4], conv_bias [inner], qkv_weight [inner / 4, 3, 4, 4] (pack_qkv_weight),
    gate_weight [G, 3 inner] and gate_bias [G] (the input and forget gate projections, stacked), seq_slots int32
    [G] and seq_starts int32 [G + 1] (kernels/_common.py)
    -> (xc [B, inner] fp32: the convolved input; qkv [B, 3, inner] fp32: q, k, v; gate_parts [P, B, G] fp32,
    whose sum over P is the gates); rows from seq_starts[G] on are left unwritten."""
    if not use_triton(xm):
        return mlstm_input_ref(xm, conv_state, conv_weight, conv_bias, qkv_weight, gate_weight, gate_bias, seq_slots,
                               seq_starts)
    xm, conv_weight, conv_bias, qkv_weight, gate_weight, gate_bias = _check(
        xm, conv_state, conv_weight, conv_bias, qkv_weight, gate_weight, gate_bias, seq_slots, seq_starts)
    rows, inner = xm.shape
    sequences = seq_slots.shape[0]
    gates = gate_weight.shape[0]
    xc = torch.empty(rows, inner, device=xm.device, dtype=torch.float32)
    qkv = torch.empty(rows, 3, inner, device=xm.device, dtype=torch.float32)
    parts = torch.empty(num_parts(inner), rows, gates, device=xm.device, dtype=torch.float32)
    if rows == 0 or sequences == 0:
        return xc, qkv, parts
    _mlstm_input_kernel[(sequences, num_parts(inner))](
        xm, conv_state, conv_weight, conv_bias, qkv_weight, gate_weight, gate_bias, seq_slots, seq_starts, xc, qkv,
        parts, rows, xm.stride(0), conv_state.stride(0), xc.stride(0), qkv.stride(0), INNER=inner, GATES=gates,
        CHUNK=CHUNK, GATES_BLOCK=next_pow2(gates), num_warps=4,
    )
    return xc, qkv, parts
