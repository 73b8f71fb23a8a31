"""One mLSTM cell step (xLSTM's matrix memory) against a slot-indexed state table.

Per head: lf = logsigmoid(fp); m_new = max(ip, m + lf); i' = exp(ip - m_new); f' = exp(lf + m - m_new);
k <- k / sqrt(E); C <- f' C + i' k v^T; n <- f' n + i' k; m <- m_new;
h = (q^T C) / (max(|q . n|, exp(-m_new)) + 1e-6).
The gate pre-activations ip, fp may come as partial sums [P, B, NH] (kernels/mlstm_input.py), summed here.
C may be stored in fp16/bf16 (kernels/state_rounding.py): the math and the readout use the fp32 C, and only
its store rounds.
"""
import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels._common import check_input, check_slot_ids, check_state, next_pow2, split_block, use_triton
from kernels._math import logsigmoid
from kernels.state_rounding import (STATE_DTYPES, check_rounding, kernel_args, row_seed, store_ref, store_state,
                                    to_fp32)

DEN_EPS = 1e-6
# fp32 values of C streamed per program per loop iteration (64 per thread at 4 warps); measured on an
# H100 against 2048/4096 and 8 warps: fastest at 1-4 rows, equal (2.75 TB/s) at 64 rows
MAX_TILE = 8192
NUM_WARPS = 4


def _check(C, n, m, q, k, v, ip, fp, slot_ids, rounding):
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
    check_slot_ids(slot_ids, rows, device)
    return q, k, v, ip, fp, check_rounding(rounding, slots, device)


def mlstm_step_ref(C, n, m, q, k, v, ip, fp, slot_ids, rounding=None):
    """PyTorch reference of mlstm_step, same signature and in-place semantics."""
    q, k, v, ip, fp, rounding = _check(C, n, m, q, k, v, ip, fp, slot_ids, rounding)
    head_dim = q.shape[-1]
    index = slot_ids.long()
    if ip.dim() == 3:
        ip, fp = ip.sum(0), fp.sum(0)
    ip, m_old = ip.float(), m[index]
    lf = F.logsigmoid(fp.float())
    m_new = torch.maximum(ip, m_old + lf)
    i_gate = torch.exp(ip - m_new)[..., None]
    f_gate = torch.exp(lf + m_old - m_new)[..., None]
    q, v = q.float(), v.float()
    k = k.float() / math.sqrt(head_dim)
    C_new = f_gate[..., None] * C[index].float() + i_gate[..., None] * k[..., :, None] * v[..., None, :]
    n_new = f_gate * n[index] + i_gate * k
    store_ref(C, slot_ids, C_new, rounding)
    n[index] = n_new
    m[index] = m_new
    num = torch.einsum("bhd,bhde->bhe", q, C_new)
    den = torch.maximum((q * n_new).sum(-1).abs(), torch.exp(-m_new)) + DEN_EPS
    return num / den[..., None]


@triton.jit
def _mlstm_gates_kernel(
    n_ptr, m_ptr, q_ptr, k_ptr, ip_ptr, fp_ptr, slot_ptr, gates_ptr,
    heads, head_dim, parts, k_div, den_eps,
    stride_n_slot, stride_m_slot,
    stride_q_row, stride_q_head, stride_k_row, stride_k_head, stride_ip_part, stride_ip_row, stride_fp_part,
    stride_fp_row, BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """Per (row, head): gates, m and n (owned by this program alone) and the readout's denominator,
    leaving (f', i', den) in a temporary for the C kernel, which never reads m or n."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    d = tl.arange(0, BLOCK_E)
    mask = d < head_dim
    # every load first (the state's once the slot is known): each is a memory round trip
    slot = tl.load(slot_ptr + row).to(tl.int64)
    p = tl.arange(0, BLOCK_P)
    ip = tl.load(ip_ptr + p * stride_ip_part + row * stride_ip_row + head, mask=p < parts, other=0.0)
    fp = tl.load(fp_ptr + p * stride_fp_part + row * stride_fp_row + head, mask=p < parts, other=0.0)
    k = tl.load(k_ptr + row * stride_k_row + head * stride_k_head + d, mask=mask, other=0.0).to(tl.float32) / k_div
    q = tl.load(q_ptr + row * stride_q_row + head * stride_q_head + d, mask=mask, other=0.0).to(tl.float32)
    m_ptrs = m_ptr + slot * stride_m_slot + head
    m = tl.load(m_ptrs)
    n_ptrs = n_ptr + slot * stride_n_slot + head * head_dim + d
    n = tl.load(n_ptrs, mask=mask, other=0.0)
    ip = tl.sum(ip.to(tl.float32), axis=0)
    lf = logsigmoid(tl.sum(fp.to(tl.float32), axis=0))
    m_new = tl.maximum(ip, m + lf)
    i_gate = tl.exp(ip - m_new)
    f_gate = tl.exp(lf + m - m_new)
    n = f_gate * n + i_gate * k
    tl.store(n_ptrs, n, mask=mask)
    tl.debug_barrier()  # every thread has read the old m (a scalar each thread loads) before one stores m_new
    tl.store(m_ptrs, m_new)
    den = tl.maximum(tl.abs(tl.sum(q * n, axis=0)), tl.exp(-m_new)) + den_eps

    gates = gates_ptr + (row * heads + head) * 3
    tl.store(gates, f_gate)
    tl.store(gates + 1, i_gate)
    tl.store(gates + 2, den)


@triton.jit(do_not_specialize=["salt"])
def _mlstm_state_kernel(
    C_ptr, q_ptr, k_ptr, v_ptr, slot_ptr, gates_ptr, h_ptr, counter_ptr,
    heads, head_dim, k_div, salt,
    stride_C_slot, stride_C_head, stride_C_row, stride_counter,
    stride_q_row, stride_q_head, stride_k_row, stride_k_head, stride_v_row, stride_v_head,
    stride_h_row, stride_h_head,
    STOCHASTIC: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr,
):
    """One program per (row, head, tile of value columns e): streams C[:, e-tile] once, in d chunks."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    e = tl.program_id(2) * BLOCK_E + tl.arange(0, BLOCK_E)
    e_mask = e < head_dim
    slot = tl.load(slot_ptr + row).to(tl.int64)
    gates = gates_ptr + (row * heads + head) * 3
    f_gate = tl.load(gates)
    i_gate = tl.load(gates + 1)
    den = tl.load(gates + 2)
    v = tl.load(v_ptr + row * stride_v_row + head * stride_v_head + e, mask=e_mask, other=0.0).to(tl.float32)
    C_slot = C_ptr + slot * stride_C_slot
    q_row = q_ptr + row * stride_q_row + head * stride_q_head
    k_row = k_ptr + row * stride_k_row + head * stride_k_head
    acc = tl.zeros([BLOCK_E], dtype=tl.float32)
    for d0 in range(0, head_dim, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        d_mask = d < head_dim
        q = tl.load(q_row + d, mask=d_mask, other=0.0).to(tl.float32)
        k = tl.load(k_row + d, mask=d_mask, other=0.0).to(tl.float32) / k_div
        index = head * stride_C_head + d[:, None] * stride_C_row + e[None, :]  # within the slot's C
        tile_mask = d_mask[:, None] & e_mask[None, :]
        C = tl.load(C_slot + index, mask=tile_mask, other=0.0)
        if STOCHASTIC:  # the counter loaded in the loop, beside the tile: a seed hoisted out would wait for it
            seed = row_seed(tl.load(counter_ptr + slot * stride_counter), salt)
        else:
            seed = 0
        C = f_gate * to_fp32(C) + (i_gate * k)[:, None] * v[None, :]
        store_state(C_slot + index, C, tile_mask, STOCHASTIC, seed, index)
        acc += tl.sum(q[:, None] * C, axis=0)
    tl.store(h_ptr + row * stride_h_row + head * stride_h_head + e, acc / den, mask=e_mask)


def mlstm_step(C, n, m, q, k, v, ip, fp, slot_ids, rounding=None):
    """Advance each row's mLSTM memory by one step and read it out.

    C [S, NH, E, E] fp32, fp16 or bf16, n [S, NH, E] and m [S, NH] fp32: updated in place at slot_ids (zeros
    at start); each may be a slot-major view (kernels/_common.py). q, k, v [B, NH, E] (k unscaled: / sqrt(E)
    inside), ip, fp [B, NH] gate pre-activations (or [P, B, NH] partial sums of them), slot_ids [B] int32.
    rounding: how a 16-bit C is stored, None or "nearest", or StochasticRounding(counter, salt)
    (kernels/state_rounding.py); an fp32 C is stored as is. Returns h [B, NH, E] float32 (before the output
    GroupNorm), read from the fp32 C before its rounding.
    """
    if not use_triton(C):
        return mlstm_step_ref(C, n, m, q, k, v, ip, fp, slot_ids, rounding)
    q, k, v, ip, fp, rounding = _check(C, n, m, q, k, v, ip, fp, slot_ids, rounding)
    rows, heads, head_dim = q.shape
    device = C.device
    h = torch.empty(rows, heads, head_dim, device=device, dtype=torch.float32)
    if rows == 0:
        return h
    k_div = math.sqrt(head_dim)
    gates = torch.empty(rows, heads, 3, device=device, dtype=torch.float32)
    if ip.dim() == 2:
        ip, fp = ip[None], fp[None]
    _mlstm_gates_kernel[(rows, heads)](
        n, m, q, k, ip, fp, slot_ids, gates,
        heads, head_dim, ip.shape[0], k_div, DEN_EPS,
        n.stride(0), m.stride(0),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), ip.stride(0), ip.stride(1), fp.stride(0),
        fp.stride(1), BLOCK_E=next_pow2(head_dim), BLOCK_P=next_pow2(ip.shape[0]), num_warps=4,
    )
    block_e = split_block(head_dim, rows * heads, max_block=64, min_block=16)
    block_d = max(1, min(next_pow2(head_dim), MAX_TILE // block_e))
    counter, stride_counter, salt, stochastic = kernel_args(C, rounding, slot_ids)
    _mlstm_state_kernel[(rows, heads, triton.cdiv(head_dim, block_e))](
        C, q, k, v, slot_ids, gates, h, counter,
        heads, head_dim, k_div, salt,
        C.stride(0), head_dim * head_dim, head_dim, stride_counter,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        h.stride(0), h.stride(1),
        STOCHASTIC=stochastic, BLOCK_D=block_d, BLOCK_E=block_e, num_warps=NUM_WARPS,
    )
    return h
