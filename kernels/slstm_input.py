"""The xLSTM block's input side, up to the sLSTM's gate maps, in one pass per row, a step's rows grouped in
sequences (kernels/_common.py):

x += delta (+ bias), in place; xin = x / sqrt(mean(x^2) + rms_eps) * norm_weight (the block's norm1);
xn = layer_norm(xin) * ln_weight (the sLSTM's LayerNorm: eps 1e-5, no bias);
xc = silu(causal conv of xn) against the sequence's slot of the conv state, which shifts (as causal_conv_update),
through the sequence's rows in order.

These were three kernels on the xLSTM tower's chain (add_rms_norm, F.layer_norm, causal_conv_update; ~9 us per
block at one row, where the chain sets the step's length at small batches). One program per sequence holds the
whole width and the conv state's three taps, loaded once and stored once, and takes the sequence's rows in turn,
so the two row reductions and the convolution read every value once; as many warps as there are pairs of values
keep the most loads in flight on that one SM (H100, one row of 2,048: 5.8 us with 32 warps, 6.7 with 8; the three
kernels took 7.2). Rows from seq_starts[G] on (padding) are left as they are: x not updated, outputs unwritten.
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels._common import check_input, next_pow2, use_triton
from kernels._math import sigmoid
from kernels.add_rms_norm import _check as _check_add, add_rms_norm_ref
from kernels.causal_conv_update import _check as _check_conv, causal_conv_update_ref
from kernels.slstm_output import NORM_EPS


def _check(x, delta, bias, norm_weight, ln_weight, conv_state, conv_weight, conv_bias, seq_slots, seq_starts):
    delta, bias, norm_weight = _check_add(x, delta, bias, norm_weight)
    ln_weight = check_input("ln_weight", ln_weight, x.shape[1:], x.device)
    _, conv_weight, conv_bias = _check_conv(x, conv_state, conv_weight, conv_bias, seq_slots, seq_starts, "silu")
    return delta, bias, norm_weight, ln_weight, conv_weight, conv_bias


def slstm_input_ref(x, delta, bias, norm_weight, rms_eps, ln_weight, conv_state, conv_weight, conv_bias, seq_slots,
                    seq_starts):
    """PyTorch reference of slstm_input, same signature and in-place semantics (x and conv_state); the norms of
    padding rows are computed as any row's, their xc is zero."""
    _check(x, delta, bias, norm_weight, ln_weight, conv_state, conv_weight, conv_bias, seq_slots, seq_starts)
    xin = add_rms_norm_ref(x, delta, bias, norm_weight, rms_eps)
    xn = F.layer_norm(xin, xin.shape[-1:], ln_weight.float(), None, NORM_EPS)
    return xin, xn, causal_conv_update_ref(xn, conv_state, conv_weight, conv_bias, seq_slots, seq_starts, "silu")


@triton.jit
def _slstm_input_kernel(x_ptr, delta_ptr, bias_ptr, norm_w_ptr, ln_w_ptr, state_ptr, conv_w_ptr, conv_b_ptr,
                        seq_slots_ptr, seq_starts_ptr, xin_ptr, xn_ptr, xc_ptr, width, stride_x, stride_delta,
                        stride_state, stride_out, rms_eps, ln_eps, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    seq = tl.program_id(0)
    col = tl.arange(0, BLOCK)
    mask = col < width
    # every load first: at one row the kernel is a chain of memory round trips, and a load placed after a
    # reduction waits for it
    start = tl.load(seq_starts_ptr + seq)
    end = tl.load(seq_starts_ptr + seq + 1)
    norm_w = tl.load(norm_w_ptr + col, mask=mask, other=0.0).to(tl.float32)
    ln_w = tl.load(ln_w_ptr + col, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + col, mask=mask, other=0.0).to(tl.float32)
    w = conv_w_ptr + col * 4
    w0 = tl.load(w, mask=mask, other=0.0).to(tl.float32)
    w1 = tl.load(w + 1, mask=mask, other=0.0).to(tl.float32)
    w2 = tl.load(w + 2, mask=mask, other=0.0).to(tl.float32)
    w3 = tl.load(w + 3, mask=mask, other=0.0).to(tl.float32)
    conv_b = tl.load(conv_b_ptr + col, mask=mask, other=0.0).to(tl.float32)
    state_mask = col < tl.where(start < end, width, 0)  # an empty sequence touches no state
    slot = tl.load(seq_slots_ptr + seq).to(tl.int64)
    state = state_ptr + slot * stride_state + col * 3
    s0 = tl.load(state, mask=state_mask, other=0.0)
    s1 = tl.load(state + 1, mask=state_mask, other=0.0)
    s2 = tl.load(state + 2, mask=state_mask, other=0.0)
    for row in range(start, end):
        x = tl.load(x_ptr + row * stride_x + col, mask=mask, other=0.0)
        delta = tl.load(delta_ptr + row * stride_delta + col, mask=mask, other=0.0).to(tl.float32)
        x += delta
        if HAS_BIAS:
            x += bias
        tl.store(x_ptr + row * stride_x + col, x, mask=mask)
        inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / width + rms_eps)
        xin = x * inv * norm_w
        out = row * stride_out + col
        tl.store(xin_ptr + out, xin, mask=mask)
        d = tl.where(mask, xin - tl.sum(xin, axis=0) / width, 0.0)
        inv = 1.0 / tl.sqrt(tl.sum(d * d, axis=0) / width + ln_eps)
        xn = d * inv * ln_w
        tl.store(xn_ptr + out, xn, mask=mask)
        xc = w0 * s0 + w1 * s1 + w2 * s2 + w3 * xn + conv_b
        tl.store(xc_ptr + out, xc * sigmoid(xc), mask=mask)
        s0, s1, s2 = s1, s2, xn
    tl.debug_barrier()  # every thread has read the old state before any stores the new (kernels/mlstm_input.py)
    tl.store(state, s0, mask=state_mask)
    tl.store(state + 1, s1, mask=state_mask)
    tl.store(state + 2, s2, mask=state_mask)


def slstm_input(x, delta, bias, norm_weight, rms_eps, ln_weight, conv_state, conv_weight, conv_bias, seq_slots,
                seq_starts):
    """x [B, H] fp32 residual (updated in place), delta [B, H], bias [H] or None,
    norm_weight [H] (norm1), ln_weight [H] (the sLSTM's LayerNorm), conv_state [S, H, 3] fp32 (updated in place
    at the sequences' slots), conv_weight [H, 4] or [H, 1, 4], conv_bias [H], seq_slots int32 [G] and
    seq_starts int32 [G + 1] (kernels/_common.py) -> (xin, xn, xc), each fp32 [B, H]; rows from seq_starts[G] on
    are padding, left as they are."""
    if not use_triton(x):
        return slstm_input_ref(x, delta, bias, norm_weight, rms_eps, ln_weight, conv_state, conv_weight, conv_bias,
                               seq_slots, seq_starts)
    delta, bias, norm_weight, ln_weight, conv_weight, conv_bias = _check(
        x, delta, bias, norm_weight, ln_weight, conv_state, conv_weight, conv_bias, seq_slots, seq_starts)
    rows, width = x.shape
    sequences = seq_slots.shape[0]
    xin, xn, xc = (torch.empty(rows, width, device=x.device, dtype=torch.float32) for _ in range(3))
    if rows and sequences:
        block = next_pow2(width)
        _slstm_input_kernel[(sequences,)](x, delta, bias if bias is not None else norm_weight, norm_weight, ln_weight,
                                          conv_state, conv_weight, conv_bias, seq_slots, seq_starts, xin, xn, xc,
                                          width, x.stride(0), delta.stride(0), conv_state.stride(0), xin.stride(0),
                                          rms_eps, NORM_EPS, HAS_BIAS=bias is not None, BLOCK=block,
                                          num_warps=max(1, min(32, block // 64)))
    return xin, xn, xc
