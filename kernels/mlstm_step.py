"""mLSTM cell steps (xLSTM's matrix memory) over a step's sequences against a slot-indexed state table.

Per head and row, in each sequence's order: lf = logsigmoid(fp); m_new = max(ip, m + lf); i' = exp(ip - m_new);
f' = exp(lf + m - m_new); k <- k / sqrt(E); C <- f' C + i' k v^T; n <- f' n + i' k; m <- m_new;
h = (q^T C) / (max(|q . n|, exp(-m_new)) + 1e-6).
The gate pre-activations ip, fp may come as partial sums [P, B, NH] (kernels/mlstm_input.py), summed here.

Two kernels: a prepare kernel per (sequence, head) carries m and n through the sequence's rows on chip and writes
each row's f', i' k and denominator; kernels/outer_product_update.py then advances C with them and reads it out.
C may be stored in fp16/bf16 (kernels/state_rounding.py): it stays fp32 through a sequence's rows and only its
store rounds.
"""
import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.outer_product_update import launch as launch_outer_product, outer_product_update_ref
from kernels._common import check_input, check_plan, check_state, next_pow2, row_positions, use_triton
from kernels._math import logsigmoid
from kernels.state_rounding import STATE_DTYPES, check_rounding

DEN_EPS = 1e-6
# fp32 values of C streamed per program per chunk (64 per thread at 4 warps); measured on an H100 against
# 2048/4096 and 8 warps: fastest at 1-4 rows, equal (2.75 TB/s) at 64 rows
MAX_TILE = 8192


def _check(C, n, m, q, k, v, ip, fp, seq_slots, seq_starts, rounding):
    if not isinstance(C, torch.Tensor) or C.dim() != 4:
        raise ValueError(f"C must be a [S, NH, E, E] tensor, got {getattr(C, 'shape', type(C).__name__)}")
    slots, heads, head_dim, _ = C.shape
    device = C.device
    check_state("C", C, (slots, heads, head_dim, head_dim), device, STATE_DTYPES)
    check_state("n", n, (slots, heads, head_dim), device)
    check_state("m", m, (slots, heads), device)
    rows = q.shape[0] if isinstance(q, torch.Tensor) and q.dim() == 3 else None
    q = check_input("q", q, (rows, heads, head_dim), device)
    k = check_input("k", k, (rows, heads, head_dim), device)
    v = check_input("v", v, (rows, heads, head_dim), device)
    parts = ip.shape[0] if isinstance(ip, torch.Tensor) and ip.dim() == 3 else None
    gate_shape = (rows, heads) if parts is None else (parts, rows, heads)
    ip = check_input("ip", ip, gate_shape, device)
    fp = check_input("fp", fp, gate_shape, device)
    check_plan(seq_slots, seq_starts, device)
    return q, k, v, ip, fp, check_rounding(rounding, slots, device)


def mlstm_step_ref(C, n, m, q, k, v, ip, fp, seq_slots, seq_starts, rounding=None):
    """PyTorch reference of mlstm_step, same signature and in-place semantics: the gates, m and n row position
    by row position, then C through outer_product_update_ref."""
    q, k, v, ip, fp, rounding = _check(C, n, m, q, k, v, ip, fp, seq_slots, seq_starts, rounding)
    rows, heads, head_dim = q.shape
    if ip.dim() == 3:  # summed in fp32, as the kernel does (a 16-bit sum would round the gates)
        ip, fp = ip.float().sum(0), fp.float().sum(0)
    ip, lf = ip.float(), F.logsigmoid(fp.float())
    q, k = q.float(), k.float() / math.sqrt(head_dim)
    f_gates = torch.zeros(rows, heads, device=q.device)
    dens = torch.ones(rows, heads, device=q.device)
    k_in = torch.zeros_like(k)  # i' k
    slots, positions = row_positions(seq_slots, seq_starts, rows, C.shape[0])
    m_seq, n_seq = m[slots], n[slots]
    for which, rs in positions:  # row position j of every sequence longer than j
        m_old = m_seq[which]
        m_new = torch.maximum(ip[rs], m_old + lf[rs])
        i_gate = torch.exp(ip[rs] - m_new)[..., None]
        f_gate = torch.exp(lf[rs] + m_old - m_new)
        n_seq[which] = f_gate[..., None] * n_seq[which] + i_gate * k[rs]
        m_seq[which] = m_new
        f_gates[rs] = f_gate
        k_in[rs] = i_gate * k[rs]
        dens[rs] = torch.maximum((q[rs] * n_seq[which]).sum(-1).abs(), torch.exp(-m_new)) + DEN_EPS
    n[slots], m[slots] = n_seq, m_seq
    return outer_product_update_ref(C, q, k_in, v, f_gates, dens, seq_slots, seq_starts, rounding)


@triton.jit
def _mlstm_prepare_kernel(
    n_ptr, m_ptr, q_ptr, k_ptr, ip_ptr, fp_ptr, seq_slot_ptr, seq_start_ptr, k_in_ptr, f_gate_ptr, den_ptr,
    heads, head_dim, parts, k_div, den_eps,
    stride_n_slot, stride_m_slot,
    stride_q_row, stride_q_head, stride_k_row, stride_k_head, stride_ip_part, stride_ip_row, stride_fp_part,
    stride_fp_row, BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """Per (sequence, head): gates, m and n (owned by this program alone, held on chip through the sequence's
    rows) and each row's readout denominator, leaving (f', i' k, den) per row in temporaries for the C kernel,
    which never reads m or n."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    d = tl.arange(0, BLOCK_E)
    mask = d < head_dim
    p = tl.arange(0, BLOCK_P)
    start = tl.load(seq_start_ptr + seq)
    end = tl.load(seq_start_ptr + seq + 1)
    live = start < end  # an empty sequence touches no state
    slot = tl.load(seq_slot_ptr + seq).to(tl.int64)
    m_ptrs = m_ptr + slot * stride_m_slot + head
    m = tl.load(m_ptrs, mask=live, other=0.0)
    n_ptrs = n_ptr + slot * stride_n_slot + head * head_dim + d
    n_mask = d < tl.where(live, head_dim, 0)  # (not mask & live: the interpreter makes that int32)
    n = tl.load(n_ptrs, mask=n_mask, other=0.0)
    for row in tl.range(start, end, num_stages=1):  # unpipelined: a prologue would cost the one-row step
        ip = tl.load(ip_ptr + p * stride_ip_part + row * stride_ip_row + head, mask=p < parts, other=0.0)
        fp = tl.load(fp_ptr + p * stride_fp_part + row * stride_fp_row + head, mask=p < parts, other=0.0)
        k = tl.load(k_ptr + row * stride_k_row + head * stride_k_head + d, mask=mask, other=0.0).to(tl.float32)
        k = k / k_div
        q = tl.load(q_ptr + row * stride_q_row + head * stride_q_head + d, mask=mask, other=0.0).to(tl.float32)
        ip = tl.sum(ip.to(tl.float32), axis=0)
        lf = logsigmoid(tl.sum(fp.to(tl.float32), axis=0))
        m_new = tl.maximum(ip, m + lf)
        i_gate = tl.exp(ip - m_new)
        f_gate = tl.exp(lf + m - m_new)
        n = f_gate * n + i_gate * k
        m = m_new
        tmp = row * heads + head
        tl.store(k_in_ptr + tmp * head_dim + d, i_gate * k, mask=mask)
        tl.store(f_gate_ptr + tmp, f_gate)
        tl.store(den_ptr + tmp, tl.maximum(tl.abs(tl.sum(q * n, axis=0)), tl.exp(-m)) + den_eps)
    # every thread has read the old m (a scalar each thread loads) and n (replicated across threads at small
    # head sizes) before one stores the new
    tl.debug_barrier()
    tl.store(n_ptrs, n, mask=n_mask)
    tl.store(m_ptrs, m, mask=live)


def mlstm_step(C, n, m, q, k, v, ip, fp, seq_slots, seq_starts, rounding=None):
    """Advance each sequence's mLSTM memory through its rows, reading it out after each.

    C [S, NH, E, E] fp32, fp16 or bf16, n [S, NH, E] and m [S, NH] fp32: updated in place at seq_slots (zeros
    at start); each may be a slot-major view (kernels/_common.py). q, k, v [B, NH, E] (k unscaled: / sqrt(E)
    inside), ip, fp [B, NH] gate pre-activations (or [P, B, NH] partial sums of them); seq_slots [G] and
    seq_starts [G + 1] int32 (kernels/_common.py). rounding: how a 16-bit C is stored, None or "nearest", or
    StochasticRounding(counter, salt) (kernels/state_rounding.py); an fp32 C is stored as is. Returns h
    [B, NH, E] float32 (before the output GroupNorm), read from the fp32 C; padding rows' are left unwritten.
    """
    if not use_triton(C):
        return mlstm_step_ref(C, n, m, q, k, v, ip, fp, seq_slots, seq_starts, rounding)
    q, k, v, ip, fp, rounding = _check(C, n, m, q, k, v, ip, fp, seq_slots, seq_starts, rounding)
    rows, heads, head_dim = q.shape
    sequences = seq_slots.shape[0]
    device = C.device
    h = torch.empty(rows, heads, head_dim, device=device, dtype=torch.float32)
    if rows == 0 or sequences == 0:
        return h
    k_in = torch.empty(rows, heads, head_dim, device=device, dtype=torch.float32)
    f_gate, den = torch.empty(2, rows, heads, device=device, dtype=torch.float32)
    if ip.dim() == 2:
        ip, fp = ip[None], fp[None]
    _mlstm_prepare_kernel[(sequences, heads)](
        n, m, q, k, ip, fp, seq_slots, seq_starts, k_in, f_gate, den,
        heads, head_dim, ip.shape[0], math.sqrt(head_dim), DEN_EPS,
        n.stride(0), m.stride(0),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), ip.stride(0), ip.stride(1), fp.stride(0),
        fp.stride(1), BLOCK_E=next_pow2(head_dim), BLOCK_P=next_pow2(ip.shape[0]), num_warps=4,
    )
    return launch_outer_product(C, q, k_in, v, f_gate, den, seq_slots, seq_starts, rounding, h, max_tile=MAX_TILE)
