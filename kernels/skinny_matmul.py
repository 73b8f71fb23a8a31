"""y = x @ W^T (+ bias, then ReLU) with W streamed from memory once: a step's few rows, or a step of many.

At a step's few rows (M <= 64) a product is a matrix-vector product in disguise: its cost is reading W. cuBLAS's
fp32 kernels run on the FMA units with the rows padded to 64 or more, so from B = 4 on they are compute-bound well
below the memory bandwidth (bench/LOG.md, sections 5 and 11). Here one program owns BLOCK_N output columns and
every row of the step, and walks K with a pipelined load of its W slice.

Past 64 rows (steps that carry several requests of a symbol: 256-512 rows) the product is a GEMM, and cuBLAS's
true fp32 is bound by the FMA units (~4 ms a step at 256 rows for the model's 2 GB of fp32 weights). A second
dimension of programs then tiles the rows by BLOCK_M; the row tiles of one column block are launched next to each
other (grouped by GROUP_M), so they run at the same time and read each W tile from memory once, the others from L2.

fp32 accuracy on fp16 tensor cores ("split fp16"): W is stored once as W = W_hi + W_lo / 2^11 (two fp16
tensors, 4 bytes per weight like fp32), x is split the same way in registers, and
x W^T = x_hi W_hi^T + (x_hi W_lo^T + x_lo W_hi^T) / 2^11, dropping only x_lo W_lo^T: about 22 bits of each
product, relative error ~1e-6 where TF32 gives ~1e-3. RetNet's tower needs that (docs/facts.md, "Precision").
W_lo may cover only W's first rows (a product whose leading rows need fp32 and the rest fp16, as the mLSTM's fused
x/gate projection: bench/LOG.md section 34); the other rows are plain fp16.
16-bit weights alone multiply x cast to their dtype and accumulate in fp32, as cuBLAS does.

x reaches fp16 as it is: the engine sends this kernel normalised activations only. The tensor cores' fp32
accumulation keeps fewer bits than cuBLAS's FMA units (measured on an H100 at K = 4096: ~5e-6 of a row's scale
against cuBLAS fp32's ~4e-7, bench/LOG.md section 40), ample where activations are O(1); input_down's input, which
carries a feed's unnormalised features (columns up to 1e5) straight into the residual stream and the prediction,
takes cuBLAS's fp32 instead (client/engine/fast/layers.py, Linear's wide_input). row_scales and split_rows cast such
rows to fp16 without overflow where their weights are fp16.
"""
import contextlib

import torch
import triton
import triton.language as tl

from kernels._common import check_input, next_pow2, use_triton

ONE_TILE_ROWS = 64  # up to this many rows one program holds them all (the launch of a step's few rows)
DTYPES = (torch.float16, torch.bfloat16)
LO_SCALE = 2048.0  # 2^11: W_lo and x_lo keep the 11 bits below fp16's mantissa, in fp16's normal range
SMEM_BUDGET = 160 * 1024  # bytes of pipelined tiles per program, inside an H100 SM's 227 KB
MIN_PROGRAMS = 128  # about one per SM of an H100 or H200 (132): every SM streams W, or multiplies
MIN_SPLIT_PROGRAMS = 96  # a split tile's three products keep its SM busy: 96 tiles of 128 x 128 beat 160-192 smaller
GROUP_M = 8  # row tiles launched next to each other per column block (W tile read once, then from L2)
SUM_BLOCK = 1024  # outputs a program of the split-K sum
MAX_SPLIT_K = 2  # slices of K a GEMM's programs may sum apart (each slice's fp32 partials: M x N x 4 bytes)
MIN_K_SLICE = 512  # K terms a slice sums at least
# Split (fp32) weights: each BLOCK_K chunk's x_hi W_hi product summed from zero by the tensor cores and added to the
# running fp32 sum by an fp32 add (as DeepSeek-V3 promotes its FP8 partial sums). Given the running sum as its
# accumulator, an MMA adds its products to it in its own arithmetic: on an H100 up to 4e-6-1.4e-5 of a row's scale
# at K = 2,048-8,192 (cuBLAS's fp32 1e-6), 3-7e-7 promoted, and RetNet at a backlog of 8 went from 1.0e-2 to 1.5e-3
# of the fp64 prediction (bench/LOG.md section 54). fp16 weights' own rounding (~3e-4) dwarfs it: never promoted.
PROMOTE_PARTIALS = True
ROW_MAX_EXP = 14  # rows are scaled so that max |x| lies in [2^14, 2^15): one binade below fp16's 65504


def split_fp16(t):
    """fp32 t -> (hi, lo) fp16 with t ~= hi + lo / LO_SCALE (about 22 significant bits), for |t| inside fp16's
    normal range (weights; x goes through split_rows)."""
    hi = t.to(torch.float16)
    return hi, ((t - hi.float()) * LO_SCALE).to(torch.float16)


def pow2(s):
    """2^s in fp32, exactly, for an int32 tensor s in [-126, 127] (built from its bits: no exp2 rounding)."""
    return ((s + 127) << 23).view(torch.float32)


def row_scales(x):
    """int32 s [M] such that each row's max |x| * 2^s lies in [2^14, 2^15), clamped to [-126, 126] so that 2^s and
    2^-s are normal fp32 (a row below 2^-112 is scaled by 2^126 only: still inside fp16's range, as is all of
    fp32's normal range)."""
    biased = (x.float().abs().amax(1).view(torch.int32) >> 23) & 0xFF  # the largest |x|'s biased exponent
    return (127 + ROW_MAX_EXP - biased).clamp(-126, 126)


@contextlib.contextmanager
def promoted_partials(on: bool = True):
    """PROMOTE_PARTIALS set to `on` inside the block (engines built there capture their products with it), the
    setting before restored after."""
    global PROMOTE_PARTIALS
    before, PROMOTE_PARTIALS = PROMOTE_PARTIALS, on
    try:
        yield
    finally:
        PROMOTE_PARTIALS = before


def split_rows(x):
    """x [M, K] -> (x_hi, x_lo, unscale [M, 1] fp32): each row scaled by 2^s (row_scales) and split, so that
    x = (x_hi + x_lo / LO_SCALE) * unscale to about 22 bits for any row in fp32's range (x_hi alone: to 11 bits,
    the fp16 cast of x without overflow)."""
    s = row_scales(x)
    x_hi, x_lo = split_fp16(x.float() * pow2(s)[:, None])
    return x_hi, x_lo, pow2(-s)[:, None]


def check_weights(weight, weight_lo, dtypes=DTYPES):
    """A product's W: a contiguous 2-D [N, K] tensor of one of `dtypes`, with weight_lo (if any) the fp16 low halves
    of its first rows (split_fp16). Returns (N, K)."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.dtype not in dtypes:
        names = "/".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"weight must be a 2-D {names} [N, K] tensor, got "
                         f"{getattr(weight, 'shape', type(weight).__name__)} {getattr(weight, 'dtype', '')}")
    if not weight.is_contiguous():
        raise ValueError("weight must be contiguous")
    N, K = weight.shape
    if weight_lo is not None and (weight_lo.dim() != 2 or not 0 < weight_lo.shape[0] <= N
                                  or weight_lo.shape[1] != K or weight_lo.dtype != torch.float16
                                  or weight.dtype != torch.float16 or not weight_lo.is_contiguous()):
        raise ValueError(f"a split weight is two contiguous float16 tensors (hi [N, K], lo [N_lo <= N, K] of "
                         f"hi's first rows), got {tuple(weight.shape)} {weight.dtype} and "
                         f"{tuple(getattr(weight_lo, 'shape', ()))} {getattr(weight_lo, 'dtype', '')}")
    return N, K


def _check(x, weight, bias, weight_lo):
    N, K = check_weights(weight, weight_lo)
    x = check_input("x", x, (None, K), weight.device)
    bias = None if bias is None else check_input("bias", bias, (N,), weight.device)
    return x, bias


def skinny_matmul_ref(x, weight, bias=None, relu=False, out_dtype=torch.float32, weight_lo=None):
    """PyTorch reference, exact in fp64: x rounded to W's dtype, or split like W for the rows weight_lo covers."""
    x, bias = _check(x, weight, bias, weight_lo)
    if weight_lo is not None:
        x_hi, x_lo = (t.double() for t in split_fp16(x.float()))
    else:
        x_hi, x_lo = x.to(weight.dtype).double(), None
    y = x_hi @ weight.double().t()
    if weight_lo is not None:
        rows = weight_lo.shape[0]
        y[:, :rows] += (x_hi @ weight_lo.double().t() + x_lo @ weight[:rows].double().t()) / LO_SCALE
    if bias is not None:
        y += bias.double()
    return (y.clamp_min(0) if relu else y).to(out_dtype)


@triton.jit
def tile_products(x_ptrs, w_ptr, w_lo_ptr, w_offsets, rm, rn, M, N, N_LO, K, SPLIT: tl.constexpr,
                  LO_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  MASK_K: tl.constexpr, PROMOTE: tl.constexpr):
    """This program's [BLOCK_M, BLOCK_N] of x @ W^T in fp32; with SPLIT, its columns below N_LO split. Without
    MASK_K, K % BLOCK_K == 0 (the launcher checks): the loads need no mask along K. PROMOTE: each chunk's leading
    product summed from zero, then added to the running sum in fp32 (PROMOTE_PARTIALS)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    corr = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # the split's lower-order terms, x LO_SCALE
    for k in range(0, K, BLOCK_K):
        x_mask, w_mask = rm[:, None] < M, rn[:, None] < N
        if MASK_K:
            k_mask = (k + tl.arange(0, BLOCK_K) < K)[None, :]
            x_mask, w_mask = x_mask & k_mask, w_mask & k_mask
        x = tl.load(x_ptrs, mask=x_mask, other=0.0)
        w = tl.load(w_ptr + w_offsets, mask=w_mask, other=0.0)
        x_hi = x.to(w_ptr.dtype.element_ty)
        if PROMOTE:  # a nonzero max_num_imprecise_acc keeps Triton from folding the add into the MMA's accumulator
            acc += tl.dot(x_hi, tl.trans(w), max_num_imprecise_acc=BLOCK_K)
        else:
            acc = tl.dot(x_hi, tl.trans(w), acc)
        if SPLIT:
            x_lo = ((x.to(tl.float32) - x_hi.to(tl.float32)) * LO_SCALE).to(tl.float16)
            w_lo = tl.load(w_lo_ptr + w_offsets, mask=w_mask & (rn[:, None] < N_LO), other=0.0)
            corr = tl.dot(x_hi, tl.trans(w_lo), corr)
            corr = tl.dot(x_lo, tl.trans(w), corr)
        x_ptrs += BLOCK_K
        w_offsets += BLOCK_K
    if SPLIT:  # rows past N_LO are plain fp16 products: their x_lo W_hi term is dropped
        acc += tl.where(rn[None, :] < N_LO, corr, 0.0) * (1.0 / LO_SCALE)
    return acc


@triton.jit
def _skinny_matmul_kernel(x_ptr, w_ptr, w_lo_ptr, b_ptr, y_ptr, M, N, N_LO, K, stride_xm, stride_ym, stride_yk,
                          HAS_BIAS: tl.constexpr, RELU: tl.constexpr, SPLIT: tl.constexpr,
                          LO_SCALE: tl.constexpr, ROW_TILES: tl.constexpr, SPLIT_K: tl.constexpr,
                          GROUP_M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, PROMOTE: tl.constexpr):
    """With SPLIT_K > 1, program (., k) sums the k-th of SPLIT_K equal slices of K and stores its fp32 partial
    product at y_ptr + k * stride_yk, bias and ReLU left to _sum_parts_kernel."""
    if ROW_TILES:
        # groups of GROUP_M row tiles; inside a group the row tiles of one column block are consecutive programs,
        # so they run together and share each W tile through L2
        pid = tl.program_id(0)
        row_tiles = tl.cdiv(M, BLOCK_M)
        per_group = GROUP_M * tl.cdiv(N, BLOCK_N)
        first = (pid // per_group) * GROUP_M
        group_rows = tl.minimum(row_tiles - first, GROUP_M)
        pid_m = first + (pid % per_group) % group_rows
        pid_n = (pid % per_group) // group_rows
    else:  # one row tile: a program per column block (the launch of a step's few rows)
        pid_m = 0
        pid_n = tl.program_id(0)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_part = K // SPLIT_K
    rk = tl.program_id(1) * k_part + tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :]
    w_offsets = rn[:, None] * K + rk[None, :]
    # a program wholly past the split rows streams W alone: one loop of each kind, each pipelined
    split = False
    if SPLIT:
        split = pid_n * BLOCK_N < N_LO
    if split:
        acc = tile_products(x_ptrs, w_ptr, w_lo_ptr, w_offsets, rm, rn, M, N, N_LO, k_part, True, LO_SCALE,
                            BLOCK_M, BLOCK_N, BLOCK_K, False, PROMOTE)
    else:
        acc = tile_products(x_ptrs, w_ptr, w_lo_ptr, w_offsets, rm, rn, M, N, N_LO, k_part, False, LO_SCALE,
                            BLOCK_M, BLOCK_N, BLOCK_K, False, PROMOTE)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLIT_K > 1:
        tl.store(y_ptr + tl.program_id(1) * stride_yk + rm[:, None] * stride_ym + rn[None, :], acc, mask=mask)
        return
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    if RELU:
        acc = tl.maximum(acc, 0.0)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sum_parts_kernel(parts_ptr, b_ptr, y_ptr, M, N, stride_part, stride_ym, HAS_BIAS: tl.constexpr,
                      RELU: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    """y = sum over k of parts[k] (in order: the same bits every run) + bias, then ReLU, in y's dtype."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < M * N
    m, n = offsets // N, offsets % N
    acc = tl.load(parts_ptr + m * N + n, mask=mask, other=0.0)
    for k in tl.static_range(1, SPLIT_K):
        acc += tl.load(parts_ptr + k * stride_part + m * N + n, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=mask, other=0.0).to(tl.float32)
    if RELU:
        acc = tl.maximum(acc, 0.0)
    tl.store(y_ptr + m * stride_ym + n, acc.to(y_ptr.dtype.element_ty), mask=mask)


def default_config(M, N, K, split):
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps, SPLIT_K).
    Up to ONE_TILE_ROWS rows: one row tile, at least ~128 programs so that every SM streams W, and as many K
    tiles in flight per program as shared memory holds. More rows: a GEMM, the largest tile that gives
    MIN_PROGRAMS programs (compute-bound: every SM multiplies), counting K split in up to MAX_SPLIT_K slices of at
    least MIN_K_SLICE (a narrow product: 2,048 outputs at 256 rows are 32 tiles of 128 x 128); fewer programs where
    the shape has fewer. Searched at 256 rows on an H100 (scripts/bench_matmul.py --search, bench/LOG.md section
    51): K in two slices, 64 at a time below the widest tiles, paid on the narrow split products (2,048 x 4,096:
    49.5 -> 34.9 us, 2,048 x 2,048: 28.5 -> 23.8 us); four slices did not. Split tiles (section 55, the partial
    sums promoted): MIN_SPLIT_PROGRAMS, and 8 warps from 128 x 64, where 4 spill the three fp32 tiles (acc, the
    split's corr, the chunk's product) and ran 2-3x slower."""
    if M <= ONE_TILE_ROWS:
        block_m = max(16, next_pow2(M))
        block_n = max(16, min(64, next_pow2(N) // 128))
        block_k = 128
        while K % block_k:
            block_k //= 2
        # x counted at 2 bytes an element (the configs bench/matmul_h200.json measured), W fp16 (hi and lo)
        tile_bytes = (2 * block_m + (2 if split else 1) * 2 * block_n) * block_k
        return block_m, block_n, block_k, max(2, min(5, SMEM_BUDGET // tile_bytes)), 4, 1
    tiles = ((128, 128), (128, 64), (64, 64), (64, 32), (64, 16))
    min_programs = MIN_SPLIT_PROGRAMS if split else MIN_PROGRAMS
    for block_m, block_n in tiles:
        programs, split_k = triton.cdiv(M, block_m) * triton.cdiv(N, block_n), 1
        while (programs * split_k < min_programs and split_k < MAX_SPLIT_K
               and K % (2 * split_k * 64) == 0 and K // (2 * split_k) >= MIN_K_SLICE):
            split_k *= 2
        if programs * split_k >= min_programs:
            break
    # a split tile holds x in fp32 and W twice (4 bytes per element of each): the widest tiles take K 32 at a time
    block_k = 32 if split and block_n > 64 else 64
    while K % (block_k * split_k):
        block_k //= 2
    tile_bytes = (4 * block_m + (2 if split else 1) * 2 * block_n) * block_k
    wide = block_m * block_n >= (128 * 64 if split else 128 * 128)  # the fp32 tiles in registers: 8 warps
    return block_m, block_n, block_k, max(2, min(5, SMEM_BUDGET // tile_bytes)), 8 if wide else 4, split_k


def supports(M, N, K) -> bool:
    """Shapes the kernel takes: any rows, K a multiple of 16 (one tl.dot step)."""
    return M >= 1 and K % 16 == 0 and N >= 16


def skinny_matmul(x, weight, bias=None, relu=False, out_dtype=torch.float32, weight_lo=None, config=None,
                  promote=None):
    """x [M, K] (any float dtype), weight [N, K] fp16/bf16 -> [M, N] in out_dtype, accumulated in fp32;
    with weight_lo (split_fp16 of an fp32 weight: weight, weight_lo = hi, lo) about fp32 accuracy, for the
    first weight_lo.shape[0] rows (the others are fp16).
    `config` = (BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps[, SPLIT_K]) overrides default_config (for
    benchmarks); SPLIT_K > 1 sums K in that many slices, in programs of their own, then adds them in order.
    promote: with weight_lo, each K chunk's product added to the running sum in fp32 (default PROMOTE_PARTIALS)."""
    if not use_triton(weight):
        return skinny_matmul_ref(x, weight, bias, relu, out_dtype, weight_lo)
    x, bias = _check(x, weight, bias, weight_lo)
    (M, K), N = x.shape, weight.shape[0]
    y = torch.empty(M, N, device=x.device, dtype=out_dtype)
    if M == 0:
        return y
    if not supports(M, N, K):
        raise ValueError(f"skinny_matmul does not take M={M}, N={N}, K={K} (needs K % 16 == 0, N >= 16)")
    split = weight_lo is not None
    block_m, block_n, block_k, stages, warps, split_k = (*(config or default_config(M, N, K, split)), 1)[:6]
    if K % (block_k * split_k) or block_m < 16 or block_m != next_pow2(block_m):
        raise ValueError(f"BLOCK_K={block_k} x SPLIT_K={split_k} must divide K={K}, and BLOCK_M={block_m} be a power "
                         f"of two >= 16")
    row_tiles = triton.cdiv(M, block_m)
    # split K: each slice's fp32 partial product, summed in order by a second kernel with the bias and ReLU
    parts = y if split_k == 1 else torch.empty(split_k, M, N, device=x.device, dtype=torch.float32)
    _skinny_matmul_kernel[(row_tiles * triton.cdiv(N, block_n), split_k)](
        x, weight, weight_lo if split else weight, bias if bias is not None else weight, parts, M, N,
        weight_lo.shape[0] if split else 0, K, x.stride(0), parts.stride(-2), parts.stride(0),
        HAS_BIAS=bias is not None, RELU=relu, SPLIT=split, LO_SCALE=LO_SCALE, ROW_TILES=row_tiles > 1,
        SPLIT_K=split_k, GROUP_M=GROUP_M, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        PROMOTE=split and (PROMOTE_PARTIALS if promote is None else promote), num_stages=stages, num_warps=warps)
    if split_k > 1:
        _sum_parts_kernel[(triton.cdiv(M * N, SUM_BLOCK),)](
            parts, bias if bias is not None else parts, y, M, N, parts.stride(0), y.stride(0),
            HAS_BIAS=bias is not None, RELU=relu, SPLIT_K=split_k, BLOCK=SUM_BLOCK)
    return y
