"""y = x @ W^T (+ bias, then ReLU) for a step's few rows (B <= 64): each weight streamed from memory once.

At these shapes a product is a matrix-vector product in disguise: its cost is reading W. cuBLAS's fp32 kernels
run on the FMA units with the rows padded to 64 or more, so from B = 4 on they are compute-bound well below the
memory bandwidth (bench/LOG.md, sections 5 and 11). Here one program owns BLOCK_N output columns and every row
of the step, and walks K with a pipelined load of its W slice.

fp32 accuracy on fp16 tensor cores ("split fp16"): W is stored once as W = W_hi + W_lo / 2^11 (two fp16
tensors, 4 bytes per weight like fp32), x is split the same way in registers, and
x W^T = x_hi W_hi^T + (x_hi W_lo^T + x_lo W_hi^T) / 2^11, dropping only x_lo W_lo^T: about 22 bits of each
product, relative error ~1e-6 where TF32 gives ~1e-3. RetNet's tower needs that (FACTS.md, "Precision").
W_lo may cover only W's first rows (a product whose leading rows need fp32 and the rest fp16, as the mLSTM's fused
x/gate projection: bench/LOG.md section 34); the other rows are plain fp16.
16-bit weights alone multiply x cast to their dtype and accumulate in fp32, as cuBLAS does.
"""
import torch
import triton
import triton.language as tl

from kernels._common import check_input, next_pow2, use_triton

MAX_ROWS = 64
DTYPES = (torch.float16, torch.bfloat16)
LO_SCALE = 2048.0  # 2^11: W_lo and x_lo keep the 11 bits below fp16's mantissa, in fp16's normal range
SMEM_BUDGET = 160 * 1024  # bytes of pipelined tiles per program, inside an H100 SM's 227 KB


def split_fp16(t):
    """fp32 t -> (hi, lo) fp16 with t ~= hi + lo / LO_SCALE (about 22 significant bits)."""
    hi = t.to(torch.float16)
    return hi, ((t - hi.float()) * LO_SCALE).to(torch.float16)


def _check(x, weight, bias, weight_lo):
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.dtype not in DTYPES:
        raise ValueError(f"weight must be a 2-D float16/bfloat16 [N, K] tensor, got "
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
    x = check_input("x", x, (None, K), weight.device)
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"skinny_matmul takes at most {MAX_ROWS} rows, got {x.shape[0]}")
    bias = None if bias is None else check_input("bias", bias, (N,), weight.device)
    return x, bias


def skinny_matmul_ref(x, weight, bias=None, relu=False, out_dtype=torch.float32, weight_lo=None):
    """PyTorch reference, exact in fp64: x rounded to W's dtype, or split like W for the rows weight_lo covers."""
    x, bias = _check(x, weight, bias, weight_lo)
    y = x.to(weight.dtype).double() @ weight.double().t()
    if weight_lo is not None:
        x_hi, x_lo = (t.double() for t in split_fp16(x.float()))
        rows = weight_lo.shape[0]
        y[:, :rows] += (x_hi @ weight_lo.double().t() + x_lo @ weight[:rows].double().t()) / LO_SCALE
    if bias is not None:
        y += bias.double()
    return (y.clamp_min(0) if relu else y).to(out_dtype)


@triton.jit
def _products(x_ptrs, w_ptr, w_lo_ptr, w_offsets, rm, rn, M, N, N_LO, K, SPLIT: tl.constexpr,
              LO_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """This program's [BLOCK_M, BLOCK_N] of x @ W^T in fp32; with SPLIT, its columns below N_LO split."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    corr = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # the split's lower-order terms, x LO_SCALE
    for k in range(0, K, BLOCK_K):  # K % BLOCK_K == 0 (checked by the launcher)
        x = tl.load(x_ptrs, mask=rm[:, None] < M, other=0.0)
        w = tl.load(w_ptr + w_offsets, mask=rn[:, None] < N, other=0.0)
        x_hi = x.to(w_ptr.dtype.element_ty)
        acc = tl.dot(x_hi, tl.trans(w), acc)
        if SPLIT:
            x_lo = ((x.to(tl.float32) - x_hi.to(tl.float32)) * LO_SCALE).to(tl.float16)
            w_lo = tl.load(w_lo_ptr + w_offsets, mask=rn[:, None] < N_LO, other=0.0)
            corr = tl.dot(x_hi, tl.trans(w_lo), corr)
            corr = tl.dot(x_lo, tl.trans(w), corr)
        x_ptrs += BLOCK_K
        w_offsets += BLOCK_K
    if SPLIT:  # rows past N_LO are plain fp16 products: their x_lo W_hi term is dropped
        acc += tl.where(rn[None, :] < N_LO, corr, 0.0) * (1.0 / LO_SCALE)
    return acc


@triton.jit
def _skinny_matmul_kernel(x_ptr, w_ptr, w_lo_ptr, b_ptr, y_ptr, M, N, N_LO, K, stride_xm, stride_ym,
                          HAS_BIAS: tl.constexpr, RELU: tl.constexpr, SPLIT: tl.constexpr, LO_SCALE: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rm = tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :]
    w_offsets = rn[:, None] * K + rk[None, :]
    # a program wholly past the split rows streams W alone: one loop of each kind, each pipelined
    split = False
    if SPLIT:
        split = tl.program_id(0) * BLOCK_N < N_LO
    if split:
        acc = _products(x_ptrs, w_ptr, w_lo_ptr, w_offsets, rm, rn, M, N, N_LO, K, True, LO_SCALE, BLOCK_M,
                        BLOCK_N, BLOCK_K)
    else:
        acc = _products(x_ptrs, w_ptr, w_lo_ptr, w_offsets, rm, rn, M, N, N_LO, K, False, LO_SCALE, BLOCK_M,
                        BLOCK_N, BLOCK_K)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    if RELU:
        acc = tl.maximum(acc, 0.0)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def default_config(M, N, K, split):
    """(BLOCK_N, BLOCK_K, num_stages, num_warps): at least ~128 programs so that every SM streams W, and as
    many K tiles in flight per program as shared memory holds."""
    block_m = max(16, next_pow2(M))
    block_n = max(16, min(64, next_pow2(N) // 128))
    block_k = 128
    while K % block_k:
        block_k //= 2
    tile_bytes = (2 * block_m + (2 if split else 1) * 2 * block_n) * block_k  # x fp32, W fp16 (hi and lo)
    stages = max(2, min(5, SMEM_BUDGET // tile_bytes))
    return block_n, block_k, stages, 4


def supports(M, N, K) -> bool:
    """Shapes the kernel takes: few rows, K a multiple of 16 (one tl.dot step)."""
    return 1 <= M <= MAX_ROWS and K % 16 == 0 and N >= 16


def skinny_matmul(x, weight, bias=None, relu=False, out_dtype=torch.float32, weight_lo=None, config=None):
    """x [M <= 64, K] (any float dtype), weight [N, K] fp16/bf16 -> [M, N] in out_dtype, accumulated in fp32;
    with weight_lo (split_fp16 of an fp32 weight: weight, weight_lo = hi, lo) about fp32 accuracy, for the
    first weight_lo.shape[0] rows (the others are fp16).
    `config` = (BLOCK_N, BLOCK_K, num_stages, num_warps) overrides default_config (for benchmarks)."""
    if not use_triton(weight):
        return skinny_matmul_ref(x, weight, bias, relu, out_dtype, weight_lo)
    x, bias = _check(x, weight, bias, weight_lo)
    (M, K), N = x.shape, weight.shape[0]
    y = torch.empty(M, N, device=x.device, dtype=out_dtype)
    if M == 0:
        return y
    if not supports(M, N, K):
        raise ValueError(f"skinny_matmul does not take M={M}, N={N}, K={K} (needs M <= {MAX_ROWS}, K % 16 == 0, "
                         f"N >= 16)")
    split = weight_lo is not None
    block_n, block_k, stages, warps = config or default_config(M, N, K, split)
    if K % block_k:
        raise ValueError(f"BLOCK_K={block_k} must divide K={K}")
    _skinny_matmul_kernel[(triton.cdiv(N, block_n),)](
        x, weight, weight_lo if split else weight, bias if bias is not None else weight, y, M, N,
        weight_lo.shape[0] if split else 0, K, x.stride(0),
        y.stride(0), HAS_BIAS=bias is not None, RELU=relu, SPLIT=split, LO_SCALE=LO_SCALE,
        BLOCK_M=max(16, next_pow2(M)), BLOCK_N=block_n, BLOCK_K=block_k, num_stages=stages, num_warps=warps)
    return y
