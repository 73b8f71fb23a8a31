"""sLSTM block output: s_out = group_norm(y) + xin, and the mLSTM block's LayerNorm of it, in one pass.
Given the state table y and a step's sequences (seq_slots, seq_starts: kernels/_common.py), it also stores each
sequence's last row of y at its slot, the state after the sequence (slstm_step leaves that to it).

s_out = F.group_norm(y, groups, gn_weight, gn_bias, 1e-5) + xin (fp32: it is the mLSTM block's skip);
xn = F.layer_norm(s_out, (H,), ln_weight, None, 1e-5) in out_dtype (the dtype of the product it feeds).
One row per program, where PyTorch needs four to five kernels; program s also stores sequence s's last y. The
row is held as a [groups, H / groups] tile (each side padded to a power of two), so per-group statistics are sums
along one axis of the tile and the whole-row statistics sums along both: any H divisible by groups works, no
reshape needed.
"""
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels._common import FLOAT_DTYPES, check_input, check_plan, check_state, next_pow2, use_triton

NORM_EPS = 1e-5  # F.group_norm / F.layer_norm defaults, as in the model


def check_groups(groups, width: int) -> None:
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise ValueError(f"groups must be a positive int, got {groups!r}")
    if width % groups:
        raise ValueError(f"width {width} must be divisible by groups {groups}")


def check_out_dtype(out_dtype) -> None:
    if out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"out_dtype must be float32, bfloat16 or float16, got {out_dtype}")


def group_tile(groups: int, width: int) -> dict:
    """Launch constants of a [groups, width / groups] row tile, and warps for its padded size."""
    groups_block, group_block = next_pow2(groups), next_pow2(width // groups)
    return dict(GROUPS=groups, GROUPS_BLOCK=groups_block, GROUP_BLOCK=group_block,
                num_warps=max(1, min(16, groups_block * group_block // 256)))


@triton.jit
def row_tile(GROUPS: tl.constexpr, GROUPS_BLOCK: tl.constexpr, GROUP_BLOCK: tl.constexpr, group_size):
    """Column index of each element of a [GROUPS_BLOCK, GROUP_BLOCK] tile of one row, and its mask."""
    g = tl.arange(0, GROUPS_BLOCK)[:, None]
    j = tl.arange(0, GROUP_BLOCK)[None, :]
    return g * group_size + j, (g < GROUPS) & (j < group_size)


@triton.jit
def group_normalize(v, mask, group_size, eps):
    """(v - mean) / sqrt(var + eps) per tile row (= group), biased variance; masked elements give 0."""
    mean = tl.sum(v, axis=1) / group_size
    d = tl.where(mask, v - mean[:, None], 0.0)
    var = tl.sum(d * d, axis=1) / group_size
    return d * (1.0 / tl.sqrt(var + eps))[:, None]


def _check(y, xin, gn_weight, gn_bias, ln_weight, groups, out_dtype, y_state, seq_slots, seq_starts):
    if not isinstance(y, torch.Tensor) or y.dim() != 2:
        raise ValueError(f"y must be a [B, H] tensor, got {getattr(y, 'shape', type(y).__name__)}")
    rows, width = y.shape
    y = check_input("y", y, (rows, width), y.device)
    if not (y_state is None) == (seq_slots is None) == (seq_starts is None):
        raise ValueError("y_state, seq_slots and seq_starts go together")
    if y_state is not None:
        check_state("y_state", y_state, (None, width), y.device)
        check_plan(seq_slots, seq_starts, y.device)
    xin = check_input("xin", xin, (rows, width), y.device)
    params = [check_input(name, t, (width,), y.device)
              for name, t in (("gn_weight", gn_weight), ("gn_bias", gn_bias), ("ln_weight", ln_weight))]
    check_groups(groups, width)
    check_out_dtype(out_dtype)
    return (y, xin, *params)


def store_last_rows(y_state, y, seq_slots, seq_starts):
    """y_state[seq_slots[s]] = y[seq_starts[s + 1] - 1] for every non-empty sequence s, with no device->host sync
    (torch.compile traces slstm_output_ref into the step): an empty sequence repeats the first non-empty
    sequence's store (with none, it stores its own slot's values back), so that a slot named twice is given one
    value whichever store lands last."""
    rows, sequences = y.shape[0], seq_slots.shape[0]
    if rows == 0 or sequences == 0:
        return
    slots, starts, ends = seq_slots.long(), seq_starts[:-1].long(), seq_starts[1:].long()
    live = ends > starts
    # the first non-empty sequence (or 0 if none is), as a [1] index: a 0-d tensor index would be read on the host
    first = torch.argmax(live.to(torch.int32)).view(1)
    any_live = live.any()
    target = torch.where(live, slots, torch.where(any_live, slots.index_select(0, first), slots))
    source = torch.where(live, ends - 1, ends.index_select(0, first) - 1).clamp(0, rows - 1)
    y_state[target] = torch.where((live | any_live)[:, None], y[source].float(), y_state[target])


def slstm_output_ref(y, xin, gn_weight, gn_bias, ln_weight, groups, out_dtype=torch.float32, y_state=None,
                     seq_slots=None, seq_starts=None):
    """PyTorch reference of slstm_output, same signature and in-place semantics."""
    y, xin, gn_weight, gn_bias, ln_weight = (t.float() for t in _check(y, xin, gn_weight, gn_bias, ln_weight, groups,
                                                                       out_dtype, y_state, seq_slots, seq_starts))
    if y_state is not None:
        store_last_rows(y_state, y, seq_slots, seq_starts)
    s_out = F.group_norm(y, groups, gn_weight, gn_bias, NORM_EPS) + xin
    return s_out, F.layer_norm(s_out, s_out.shape[-1:], ln_weight, None, NORM_EPS).to(out_dtype)


@triton.jit
def _slstm_output_kernel(y_ptr, xin_ptr, gn_weight_ptr, gn_bias_ptr, ln_weight_ptr, s_out_ptr, xn_ptr,
                         y_state_ptr, seq_slot_ptr, seq_start_ptr, rows, sequences, width, group_size, stride_y,
                         stride_xin, stride_s_out, stride_xn, stride_y_state, eps, STORE_Y: tl.constexpr,
                         GROUPS: tl.constexpr, GROUPS_BLOCK: tl.constexpr, GROUP_BLOCK: tl.constexpr):
    """Row `pid` (if a row) and the store of sequence `pid`'s last y (if a sequence and not empty)."""
    pid = tl.program_id(0)
    col, mask = row_tile(GROUPS, GROUPS_BLOCK, GROUP_BLOCK, group_size)
    row_mask = tl.where(pid < rows, mask, False)  # (not mask & (pid < rows): the interpreter makes that int32)
    # every load first: at one row the kernel is a chain of memory round trips, and a load placed after a
    # reduction waits for it
    y = tl.load(y_ptr + pid * stride_y + col, mask=row_mask, other=0.0).to(tl.float32)
    gn_w = tl.load(gn_weight_ptr + col, mask=mask, other=0.0).to(tl.float32)
    gn_b = tl.load(gn_bias_ptr + col, mask=mask, other=0.0).to(tl.float32)
    xin = tl.load(xin_ptr + pid * stride_xin + col, mask=row_mask, other=0.0).to(tl.float32)
    w = tl.load(ln_weight_ptr + col, mask=mask, other=0.0).to(tl.float32)
    if STORE_Y:
        is_seq = pid < sequences
        last = tl.load(seq_start_ptr + pid + 1, mask=is_seq, other=0) - 1
        slot = tl.load(seq_slot_ptr + pid, mask=is_seq, other=0).to(tl.int64)
        stored = is_seq & (last >= tl.load(seq_start_ptr + pid, mask=is_seq, other=0))
        store_mask = tl.where(stored, mask, False)  # (not mask & stored: the interpreter makes that int32)
        y_last = tl.load(y_ptr + last * stride_y + col, mask=store_mask, other=0.0).to(tl.float32)
        tl.store(y_state_ptr + slot * stride_y_state + col, y_last, mask=store_mask)
    s = group_normalize(y, mask, group_size, eps) * gn_w + gn_b + xin
    tl.store(s_out_ptr + pid * stride_s_out + col, s, mask=row_mask)
    mean = tl.sum(tl.sum(s, axis=1), axis=0) / width
    d = tl.where(mask, s - mean, 0.0)
    inv = 1.0 / tl.sqrt(tl.sum(tl.sum(d * d, axis=1), axis=0) / width + eps)
    tl.store(xn_ptr + pid * stride_xn + col, (d * inv * w).to(xn_ptr.dtype.element_ty), mask=row_mask)


def slstm_output(y, xin, gn_weight, gn_bias, ln_weight, groups, out_dtype=torch.float32, y_state=None,
                 seq_slots=None, seq_starts=None):
    """y [B, H], xin [B, H], gn_weight/gn_bias/ln_weight [H], H divisible by groups
    -> (s_out [B, H] fp32, xn [B, H] out_dtype). With y_state [S, H] fp32 and a step's sequences seq_slots [G],
    seq_starts [G + 1] int32 (kernels/_common.py), also y_state[seq_slots[s]] = y[last row of s] for each
    non-empty sequence s: the sLSTM's y after the sequence. Padding rows and empty sequences store nothing."""
    if not use_triton(y):
        return slstm_output_ref(y, xin, gn_weight, gn_bias, ln_weight, groups, out_dtype, y_state, seq_slots,
                                seq_starts)
    y, xin, gn_weight, gn_bias, ln_weight = _check(y, xin, gn_weight, gn_bias, ln_weight, groups, out_dtype,
                                                   y_state, seq_slots, seq_starts)
    rows, width = y.shape
    s_out = torch.empty(rows, width, device=y.device, dtype=torch.float32)
    xn = torch.empty(rows, width, device=y.device, dtype=out_dtype)
    store_y = y_state is not None
    sequences = seq_slots.shape[0] if store_y else 0
    if rows:
        _slstm_output_kernel[(max(rows, sequences),)](
            y, xin, gn_weight, gn_bias, ln_weight, s_out, xn,
            y_state if store_y else y, seq_slots if store_y else y, seq_starts if store_y else y, rows, sequences,
            width, width // groups, y.stride(0), xin.stride(0), s_out.stride(0), xn.stride(0),
            y_state.stride(0) if store_y else 0, NORM_EPS, STORE_Y=store_y, **group_tile(groups, width))
    return s_out, xn
