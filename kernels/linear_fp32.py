"""y = x @ W^T (+ b) in fp32 for a few rows (B <= 64): the RetNet tower's products, which must stay fp32.

cuBLAS picks kernels for this shape that reach 1.1-1.6 TB/s on an H100. Here each program owns a tile of
outputs and a slice of K, streams its [BLOCK_N, K-slice] of W once with all rows of x at a time (a plain fp32
FMA dot: "ieee", never TF32), and writes a partial sum; the partials over K slices are added afterwards.
Enough slices are used to give every SM a couple of programs even when N is small.
"""
import torch
import triton
import triton.language as tl

from kernels._common import TARGET_PROGRAMS, check_input, next_pow2, use_triton

BLOCK_N = 64
BLOCK_K = 64
MAX_ROWS = 64


def _check(x, weight, bias):
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.dtype != torch.float32 \
            or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous float32 [N, K] tensor, got "
                         f"{getattr(weight, 'shape', type(weight).__name__)} {getattr(weight, 'dtype', '')}")
    n, k = weight.shape
    x = check_input("x", x, (None, k), weight.device)
    if x.dtype != torch.float32:
        raise ValueError(f"x must be float32, got {x.dtype}")
    if bias is not None:
        bias = check_input("bias", bias, (n,), weight.device)
    return x, bias


def linear_fp32_ref(x, weight, bias=None):
    """PyTorch reference of linear_fp32 (true fp32, no TF32), same signature."""
    x, bias = _check(x, weight, bias)
    y = (x.double() @ weight.double().t()).float()
    return y if bias is None else y + bias


@triton.jit
def _linear_fp32_kernel(x_ptr, w_ptr, part_ptr, rows, n, k, k_per_split, stride_x, stride_part_split,
                        BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rb = tl.arange(0, BLOCK_B)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    k_start = split * k_per_split
    acc = tl.zeros((BLOCK_B, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_start + k_per_split, BLOCK_K):
        kk = k0 + rk
        x = tl.load(x_ptr + rb[:, None] * stride_x + kk[None, :], mask=(rb[:, None] < rows) & (kk[None, :] < k),
                    other=0.0)
        w = tl.load(w_ptr + rn[:, None] * k + kk[None, :], mask=(rn[:, None] < n) & (kk[None, :] < k), other=0.0)
        acc += tl.dot(x, tl.trans(w), input_precision="ieee")
    out = part_ptr + split * stride_part_split + rb[:, None] * n + rn[None, :]
    tl.store(out, acc, mask=(rb[:, None] < rows) & (rn[None, :] < n))


def linear_fp32(x, weight, bias=None):
    """x [B, K] fp32 (unit last stride), weight [N, K] fp32 contiguous, bias [N] -> y [B, N] fp32."""
    if not use_triton(weight) or x.shape[0] > MAX_ROWS:
        if not use_triton(weight):
            return linear_fp32_ref(x, weight, bias)
        return torch.nn.functional.linear(x, weight, bias)
    x, bias = _check(x, weight, bias)
    rows, (n, k) = x.shape[0], weight.shape
    tiles = triton.cdiv(n, BLOCK_N)
    splits = max(1, min(triton.cdiv(k, BLOCK_K), TARGET_PROGRAMS // tiles))
    k_per_split = triton.cdiv(triton.cdiv(k, splits), BLOCK_K) * BLOCK_K
    splits = triton.cdiv(k, k_per_split)
    part = torch.empty(splits, rows, n, device=x.device, dtype=torch.float32)
    if rows:
        _linear_fp32_kernel[(tiles, splits)](x, weight, part, rows, n, k, k_per_split, x.stride(0), part.stride(0),
                                             BLOCK_B=max(16, next_pow2(rows)), BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                                             num_warps=4, num_stages=3)
    y = part[0] if splits == 1 else part.sum(0)
    return y if bias is None else y + bias
