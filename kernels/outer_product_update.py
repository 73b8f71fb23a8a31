"""A decayed outer-product state update with readout over a step's sequences: the matrix memory of the mLSTM (C,
kernels/mlstm_step.py) and of RetNet (S, kernels/retention_step.py), which prepare its per-row inputs.

Per sequence s (state M = table[seq_slots[s]], kernels/_common.py) and head h, for each of its rows r in order:
    M <- a[r, h] M + k[r, h] v[r, h]^T        M [D, E], k and q [D], v [E]
    o[r, h] = (q[r, h]^T M) / den[r, h]
M may be stored in fp16/bf16 (kernels/state_rounding.py): it stays fp32 on chip through the sequence's rows (each
readout reads the fp32 M) and is rounded once, at its store, seeded from the slot's step counter.

One program per (sequence, head, tile of value columns e) loads M[:, e-tile] once, in d chunks of BLOCK_D rows. Each
chunk is advanced through all of the sequence's rows before the next is loaded, so each row's readout is a sum over
the chunks, kept in the output row between chunks (the accumulator's place: a sequence's row count is only known on
the device). A step of few symbols takes the one-row step's tiling: value tiles fine enough for two programs per SM
(down to 16 columns), d chunks of at most MAX_TILE / BLOCK_E values (the op's). Once the grid fills the GPU with
64-column tiles (a captured shape of 5 sequences for the mLSTM's C, 9 for RetNet's S, live or not), the chunks grow
to MANY_SYMBOLS_TILE values: C 512 x 512 a head in two chunks, S 256 x 256 in one, so each of a sequence's rows
keeps fewer partial readouts in the output row. scripts/tile_sweep.py timed the kernel alone on an H100 against
16/32/64-column tiles, 4,096-16,384-value chunks, 4 and 8 warps and a pipelined row loop
(bench/tile_sweep_h100.json, bench/LOG.md section 44): at 20 and 64 symbols of several rows each the large chunks
were the best of them, 10-20% faster than the chunks before; at one row a symbol they were within a few percent; the
times of a step of few symbols were bound by the sweep's launches and say nothing. The steps of one symbol (1, 2 or
4 requests) took the same time with the large chunks as with the one-row step's tiling, which steps of few symbols
keep. The row loop stays unpipelined (a prologue would cost the one-row step, and Triton's pipelined loop was no faster
at the best tilings) but for the readout's partial sum, loaded a row ahead: the one load that waits on memory written
earlier (C 64x8 -4% on an H200, bench/LOG.md section 80; q, k and v a row ahead too won 2% more on C and lost on S).
"""
import torch
import triton
import triton.language as tl

from kernels._common import check_input, check_plan, check_state, next_pow2, row_positions, split_block, use_triton
from kernels.state_rounding import (STATE_DTYPES, check_rounding, kernel_args, row_seed, store_ref, store_state,
                                    to_fp32)

# fp32 values of M streamed per program per chunk (64 per thread at 4 warps) unless an op asks otherwise
MAX_TILE = 8192
# Steps of many symbols: value tiles this wide (each row of a tile one 256-byte segment of fp32) fill the GPU, and
# their chunks hold this many values (128 per thread at 4 warps)
WIDE_BLOCK_E = 64
MANY_SYMBOLS_TILE = 16384
NUM_WARPS = 4


def _check(M, q, k, v, a, den, seq_slots, seq_starts, rounding):
    if not isinstance(M, torch.Tensor) or M.dim() != 4:
        raise ValueError(f"M must be a [S, H, D, E] tensor, got {getattr(M, 'shape', type(M).__name__)}")
    slots, heads, d_size, e_size = M.shape
    device = M.device
    check_state("M", M, (slots, heads, d_size, e_size), device, STATE_DTYPES)
    rows = q.shape[0] if isinstance(q, torch.Tensor) and q.dim() == 3 else None
    q = check_input("q", q, (rows, heads, d_size), device)
    k = check_input("k", k, (rows, heads, d_size), device)
    v = check_input("v", v, (rows, heads, e_size), device)
    a = check_input("a", a, (rows, heads), device)
    den = check_input("den", den, (rows, heads), device)
    check_plan(seq_slots, seq_starts, device)
    return q, k, v, a, den, check_rounding(rounding, slots, device)


def outer_product_update_ref(M, q, k, v, a, den, seq_slots, seq_starts, rounding=None):
    """PyTorch reference of outer_product_update, same signature and in-place semantics; padding rows read 0."""
    q, k, v, a, den, rounding = _check(M, q, k, v, a, den, seq_slots, seq_starts, rounding)
    out = torch.zeros(*v.shape, device=v.device, dtype=torch.float32)
    slots, positions = row_positions(seq_slots, seq_starts, q.shape[0], M.shape[0])
    if not positions:
        return out
    state = M[slots].float()
    for which, rows in positions:  # row position j of every sequence longer than j
        state[which] = (a[rows].float()[..., None, None] * state[which]
                        + k[rows].float()[..., :, None] * v[rows].float()[..., None, :])
        out[rows] = torch.einsum("bhd,bhde->bhe", q[rows].float(), state[which]) / den[rows].float()[..., None]
    store_ref(M, slots, state, rounding)
    return out


@triton.jit(do_not_specialize=["salt"])
def _outer_product_kernel(
    M_ptr, q_ptr, k_ptr, v_ptr, a_ptr, den_ptr, o_ptr, seq_slot_ptr, seq_start_ptr, counter_ptr,
    d_size, e_size, salt,
    stride_M_slot, stride_M_head, stride_M_row, stride_counter,
    stride_q_row, stride_q_head, stride_k_row, stride_k_head, stride_v_row, stride_v_head,
    stride_a_row, stride_a_head, stride_den_row, stride_den_head, stride_o_row, stride_o_head,
    STOCHASTIC: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr, ONE_CHUNK: tl.constexpr,
    ROW_STAGES: tl.constexpr,
):
    """One program per (sequence, head, tile of value columns e): streams M[:, e-tile] once, in d chunks, each
    through all of the sequence's rows."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    e = tl.program_id(2) * BLOCK_E + tl.arange(0, BLOCK_E)
    e_mask = e < e_size
    start = tl.load(seq_start_ptr + seq)
    end = tl.load(seq_start_ptr + seq + 1)
    slot = tl.load(seq_slot_ptr + seq).to(tl.int64)
    state_mask = e < tl.where(start < end, e_size, 0)  # an empty sequence touches no state
    M_slot = M_ptr + slot * stride_M_slot
    for d0 in range(0, d_size, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        d_mask = d < d_size
        index = head * stride_M_head + d[:, None] * stride_M_row + e[None, :]  # within the slot's M
        tile_mask = d_mask[:, None] & state_mask[None, :]
        M = to_fp32(tl.load(M_slot + index, mask=tile_mask, other=0.0))
        if STOCHASTIC:  # the counter loaded in the loop, beside the tile: a seed hoisted out would wait for it
            seed = row_seed(tl.load(counter_ptr + slot * stride_counter), salt)
        else:
            seed = 0
        if not ONE_CHUNK:  # the readout's sum so far, loaded a row ahead: it alone waits on memory written earlier
            o_next = tl.load(o_ptr + start * stride_o_row + head * stride_o_head + e,
                             mask=e < tl.where((start < end) & (d0 > 0), e_size, 0), other=0.0)
        for row in tl.range(start, end, num_stages=ROW_STAGES):
            if not ONE_CHUNK:
                o_sum = o_next
                o_next = tl.load(o_ptr + (row + 1) * stride_o_row + head * stride_o_head + e,
                                 mask=e < tl.where((row + 1 < end) & (d0 > 0), e_size, 0), other=0.0)
            q = tl.load(q_ptr + row * stride_q_row + head * stride_q_head + d, mask=d_mask, other=0.0).to(tl.float32)
            k = tl.load(k_ptr + row * stride_k_row + head * stride_k_head + d, mask=d_mask, other=0.0).to(tl.float32)
            v = tl.load(v_ptr + row * stride_v_row + head * stride_v_head + e, mask=e_mask, other=0.0).to(tl.float32)
            a = tl.load(a_ptr + row * stride_a_row + head * stride_a_head).to(tl.float32)
            den = tl.load(den_ptr + row * stride_den_row + head * stride_den_head).to(tl.float32)
            M = a * M + k[:, None] * v[None, :]
            part = tl.sum(q[:, None] * M, axis=0)
            o_ptrs = o_ptr + row * stride_o_row + head * stride_o_head + e
            if ONE_CHUNK:
                tl.store(o_ptrs, part / den, mask=e_mask)
            else:  # the readout's sum over the chunks so far, kept in the output row
                acc = o_sum + part
                tl.store(o_ptrs, tl.where(d0 + BLOCK_D >= d_size, acc / den, acc), mask=e_mask)
        store_state(M_slot + index, M, tile_mask, STOCHASTIC, seed, index)
        if not ONE_CHUNK:
            tl.debug_barrier()  # every thread's partial readouts stored before any thread reads them back


def tiling(sequences, heads, d_size, e_size, max_tile, block_e=None, many_symbols_tile=None) -> tuple[int, int]:
    """(BLOCK_E, BLOCK_D) of a step's grid (`sequences`: the captured shape's, live or not): the one-row step's
    tiling (chunks of max_tile values, the op's), with chunks of many_symbols_tile values (MANY_SYMBOLS_TILE by
    default) once the grid fills the GPU with the widest tiles. A given block_e is kept, and the chunk sized for
    it."""
    widest = split_block(e_size, sequences * heads, max_block=WIDE_BLOCK_E, min_block=16)
    if widest == WIDE_BLOCK_E:  # the grid fills the GPU with the widest tiles
        max_tile = many_symbols_tile or MANY_SYMBOLS_TILE
    block_e = block_e or widest
    return block_e, max(1, min(next_pow2(d_size), max_tile // block_e))


def launch(M, q, k, v, a, den, seq_slots, seq_starts, rounding, out, max_tile=None, *, many_symbols_tile=None,
           block_e=None, block_d=None, num_warps=NUM_WARPS, row_stages=1):
    """The kernel on checked arguments, writing the live rows of `out` [B, H, E] fp32: for the ops, whose
    prepared inputs may be strided views (any row and head strides, unit last stride). max_tile: fp32 values of
    M per chunk (default MAX_TILE); many_symbols_tile: per chunk once the grid is full (tiling). block_e, block_d,
    num_warps, row_stages (the row loop's software pipeline, 1: none): the tiling, chosen here unless given
    (scripts/tile_sweep.py compares tilings)."""
    max_tile = max_tile or MAX_TILE
    sequences = seq_slots.shape[0]
    slots, heads, d_size, e_size = M.shape
    if sequences == 0 or q.shape[0] == 0:
        return out
    block_e, chosen_d = tiling(sequences, heads, d_size, e_size, max_tile, block_e, many_symbols_tile)
    block_d = block_d or chosen_d
    counter, stride_counter, salt, stochastic = kernel_args(M, rounding, seq_slots)
    _outer_product_kernel[(sequences, heads, triton.cdiv(e_size, block_e))](
        M, q, k, v, a, den, out, seq_slots, seq_starts, counter,
        d_size, e_size, salt,
        M.stride(0), d_size * e_size, e_size, stride_counter,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        a.stride(0), a.stride(1), den.stride(0), den.stride(1), out.stride(0), out.stride(1),
        STOCHASTIC=stochastic, BLOCK_D=block_d, BLOCK_E=block_e, ONE_CHUNK=block_d >= d_size, ROW_STAGES=row_stages,
        num_warps=num_warps,
    )
    return out


def outer_product_update(M, q, k, v, a, den, seq_slots, seq_starts, rounding=None):
    """Advance each sequence's matrix state through its rows and read it out after each row.

    M [S, H, D, E] fp32, fp16 or bf16: updated in place at seq_slots (a slot-major view is fine,
    kernels/_common.py). q, k [B, H, D], v [B, H, E], a, den [B, H]; seq_slots [G], seq_starts [G + 1] int32.
    rounding: how a 16-bit M is stored, None or "nearest", or StochasticRounding(counter, salt)
    (kernels/state_rounding.py). Returns o [B, H, E] float32, read from the fp32 M before its rounding; padding
    rows' outputs are left unwritten.
    """
    if not use_triton(M):
        return outer_product_update_ref(M, q, k, v, a, den, seq_slots, seq_starts, rounding)
    q, k, v, a, den, rounding = _check(M, q, k, v, a, den, seq_slots, seq_starts, rounding)
    out = torch.empty(*v.shape, device=M.device, dtype=torch.float32)
    return launch(M, q, k, v, a, den, seq_slots, seq_starts, rounding, out)
