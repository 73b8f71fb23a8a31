"""One step of a causal depthwise convolution (kernel 4) against a slot-indexed state table.

window = (conv_state[slot, c, 0..2], x[c]) oldest first; out[c] = sum_j weight[c, j] * window[j] + bias[c]
(then silu if asked); conv_state[slot] <- window[1:].
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels._common import check_input, check_slot_ids, check_state, use_triton
from kernels._math import sigmoid

KERNEL_SIZE = 4
ACTIVATIONS = (None, "silu")


def _check(x, conv_state, weight, bias, slot_ids, activation):
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
    check_slot_ids(slot_ids, rows, device)
    return x, weight, bias


def causal_conv_update_ref(x, conv_state, weight, bias, slot_ids, activation=None):
    """PyTorch reference of causal_conv_update, same signature and in-place semantics."""
    x, weight, bias = _check(x, conv_state, weight, bias, slot_ids, activation)
    index = slot_ids.long()
    window = torch.cat([conv_state[index], x.float()[:, :, None]], dim=-1)
    out = (window * weight.float()).sum(-1) + bias.float()
    conv_state[index] = window[:, :, 1:]
    return F.silu(out) if activation == "silu" else out


@triton.jit
def _causal_conv_update_kernel(
    x_ptr, state_ptr, weight_ptr, bias_ptr, slot_ptr, out_ptr,
    channels, stride_x_row, stride_state_slot, stride_out_row,
    SILU: tl.constexpr, BLOCK_C: tl.constexpr,
):
    row = tl.program_id(0)
    ch = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = ch < channels
    slot = tl.load(slot_ptr + row).to(tl.int64)
    state = state_ptr + slot * stride_state_slot + ch * 3
    s0 = tl.load(state, mask=mask, other=0.0)
    s1 = tl.load(state + 1, mask=mask, other=0.0)
    s2 = tl.load(state + 2, mask=mask, other=0.0)
    x = tl.load(x_ptr + row * stride_x_row + ch, mask=mask, other=0.0).to(tl.float32)
    w = weight_ptr + ch * 4
    w0 = tl.load(w, mask=mask, other=0.0).to(tl.float32)
    w1 = tl.load(w + 1, mask=mask, other=0.0).to(tl.float32)
    w2 = tl.load(w + 2, mask=mask, other=0.0).to(tl.float32)
    w3 = tl.load(w + 3, mask=mask, other=0.0).to(tl.float32)
    out = w0 * s0 + w1 * s1 + w2 * s2 + w3 * x
    out += tl.load(bias_ptr + ch, mask=mask, other=0.0).to(tl.float32)
    if SILU:
        out = out * sigmoid(out)
    tl.store(state, s1, mask=mask)
    tl.store(state + 1, s2, mask=mask)
    tl.store(state + 2, x, mask=mask)
    tl.store(out_ptr + row * stride_out_row + ch, out, mask=mask)


def causal_conv_update(x, conv_state, weight, bias, slot_ids, activation=None):
    """Convolve one new input per row and shift it into that row's slot of the state table.

    x [B, C] (fp32/bf16/fp16), conv_state [S, C, 3] fp32 (updated in place), weight [C, 4] or [C, 1, 4],
    bias [C], slot_ids [B] int32 (distinct, except padding rows sharing a padding slot),
    activation None or "silu". Returns out [B, C] float32.
    """
    if not use_triton(x):
        return causal_conv_update_ref(x, conv_state, weight, bias, slot_ids, activation)
    x, weight, bias = _check(x, conv_state, weight, bias, slot_ids, activation)
    rows, channels = x.shape
    out = torch.empty(rows, channels, device=x.device, dtype=torch.float32)
    if rows == 0:
        return out
    block_c = 128
    grid = (rows, triton.cdiv(channels, block_c))
    _causal_conv_update_kernel[grid](
        x, conv_state, weight, bias, slot_ids, out,
        channels, x.stride(0), conv_state.stride(0), out.stride(0),
        SILU=activation == "silu", BLOCK_C=block_c, num_warps=4,
    )
    return out
