"""Steps of a causal depthwise convolution (kernel 4) against a slot-indexed state table, a step's rows grouped
in sequences (kernels/_common.py).

For each row of a sequence, in order: window = (conv_state[slot, c, 0..2], x[c]) oldest first;
out[c] = sum_j weight[c, j] * window[j] + bias[c] (then silu if asked); conv_state[slot] <- window[1:].
A program per (sequence, block of channels) loads its three taps once, carries them through the sequence's rows
and stores them once.
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels._common import check_input, check_plan, check_state, row_positions, use_triton
from kernels._math import sigmoid

KERNEL_SIZE = 4
ACTIVATIONS = (None, "silu")
BLOCK_C = 128


def _check(x, conv_state, weight, bias, seq_slots, seq_starts, activation):
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be None or 'silu', got {activation!r}")
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be a [B, C] tensor, got {getattr(x, 'shape', type(x).__name__)}")
    rows, channels = x.shape
    device = x.device
    x = check_input("x", x, (rows, channels), device)
    check_state("conv_state", conv_state, (None, channels, KERNEL_SIZE - 1), device)
    if isinstance(weight, torch.Tensor) and weight.dim() == 3:  # nn.Conv1d layout [C, 1, 4]
        weight = weight.reshape(weight.shape[0], -1)
    weight = check_input("weight", weight, (channels, KERNEL_SIZE), device).contiguous()
    bias = check_input("bias", bias, (channels,), device)
    check_plan(seq_slots, seq_starts, device)
    return x, weight, bias


def causal_conv_update_ref(x, conv_state, weight, bias, seq_slots, seq_starts, activation=None):
    """PyTorch reference of causal_conv_update, same signature and in-place semantics (padding rows: zeros)."""
    x, weight, bias = _check(x, conv_state, weight, bias, seq_slots, seq_starts, activation)
    slots, positions = row_positions(seq_slots, seq_starts, x.shape[0], conv_state.shape[0])
    taps = conv_state[slots]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for active, rows in positions:
        window = torch.cat([taps[active], x[rows].float()[:, :, None]], dim=-1)
        out[rows] = (window * weight.float()).sum(-1) + bias.float()
        taps[active] = window[:, :, 1:]
    conv_state[slots] = taps
    return F.silu(out) if activation == "silu" else out


@triton.jit
def _causal_conv_update_kernel(
    x_ptr, state_ptr, weight_ptr, bias_ptr, seq_slots_ptr, seq_starts_ptr, out_ptr,
    channels, stride_x_row, stride_state_slot, stride_out_row,
    SILU: tl.constexpr, BLOCK_C: tl.constexpr,
):
    seq = tl.program_id(0)
    ch = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    start = tl.load(seq_starts_ptr + seq)
    end = tl.load(seq_starts_ptr + seq + 1)
    mask = ch < tl.where(start < end, channels, 0)  # an empty sequence touches no state
    slot = tl.load(seq_slots_ptr + seq).to(tl.int64)
    state = state_ptr + slot * stride_state_slot + ch * 3
    s0 = tl.load(state, mask=mask, other=0.0)
    s1 = tl.load(state + 1, mask=mask, other=0.0)
    s2 = tl.load(state + 2, mask=mask, other=0.0)
    w = weight_ptr + ch * 4
    w0 = tl.load(w, mask=mask, other=0.0).to(tl.float32)
    w1 = tl.load(w + 1, mask=mask, other=0.0).to(tl.float32)
    w2 = tl.load(w + 2, mask=mask, other=0.0).to(tl.float32)
    w3 = tl.load(w + 3, mask=mask, other=0.0).to(tl.float32)
    bias = tl.load(bias_ptr + ch, mask=mask, other=0.0).to(tl.float32)
    for row in range(start, end):
        x = tl.load(x_ptr + row * stride_x_row + ch, mask=mask, other=0.0).to(tl.float32)
        out = w0 * s0 + w1 * s1 + w2 * s2 + w3 * x
        out += bias
        if SILU:
            out = out * sigmoid(out)
        tl.store(out_ptr + row * stride_out_row + ch, out, mask=mask)
        s0, s1, s2 = s1, s2, x
    tl.store(state, s0, mask=mask)
    tl.store(state + 1, s1, mask=mask)
    tl.store(state + 2, s2, mask=mask)


def causal_conv_update(x, conv_state, weight, bias, seq_slots, seq_starts, activation=None):
    """Convolve each sequence's rows in order, shifting them into the sequence's slot of the state table.

    x [B, C] (fp32/bf16/fp16), conv_state [S, C, 3] fp32 (updated in place), weight [C, 4] or [C, 1, 4],
    bias [C], seq_slots int32 [G] and seq_starts int32 [G + 1] (kernels/_common.py), activation None or "silu".
    Returns out [B, C] float32; rows from seq_starts[G] on are left unwritten.
    """
    if not use_triton(x):
        return causal_conv_update_ref(x, conv_state, weight, bias, seq_slots, seq_starts, activation)
    x, weight, bias = _check(x, conv_state, weight, bias, seq_slots, seq_starts, activation)
    rows, channels = x.shape
    sequences = seq_slots.shape[0]
    out = torch.empty(rows, channels, device=x.device, dtype=torch.float32)
    if rows == 0 or sequences == 0:
        return out
    _causal_conv_update_kernel[(sequences, triton.cdiv(channels, BLOCK_C))](
        x, conv_state, weight, bias, seq_slots, seq_starts, out,
        channels, x.stride(0), conv_state.stride(0), out.stride(0),
        SILU=activation == "silu", BLOCK_C=BLOCK_C, num_warps=4,
    )
    return out
