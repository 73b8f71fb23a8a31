"""y = x @ W^T (+ bias, then ReLU) for a step's few rows (B <= 64): each weight streamed from memory once.

At these shapes a product is a matrix-vector product in disguise: its cost is reading W. cuBLAS picks tiles
made for large M, and its fp32 kernels run on the FMA units with the rows padded to 64 or more, so they are
compute-bound at 1.1-1.6 TB/s on an H100 (bench/LOG.md, section 5). Here one program owns BLOCK_N output
columns and every row of the step, and walks K with a pipelined load of its W slice. fp32 weights use tensor
cores through three TF32 products ("tf32x3": x = hi + lo in TF32, the lo*lo term dropped), which keeps about
fp32 accuracy (relative error ~1e-6 per product, not TF32's ~1e-3): RetNet's tower needs fp32 (MODEL.md).
16-bit weights multiply x cast to their dtype and accumulate in fp32, as cuBLAS does.
"""
import torch
import triton
import triton.language as tl

from kernels._common import check_input, next_pow2, use_triton

MAX_ROWS = 64
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SMEM_BUDGET = 160 * 1024  # bytes of pipelined tiles per program, inside an H100 SM's 227 KB


def _check(x, weight, bias):
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.dtype not in DTYPES:
        raise ValueError(f"weight must be a 2-D float32/float16/bfloat16 [N, K] tensor, got "
                         f"{getattr(weight, 'shape', type(weight).__name__)} {getattr(weight, 'dtype', '')}")
    if weight.stride(-1) != 1:
        raise ValueError("weight must have a unit last stride")
    N, K = weight.shape
    x = check_input("x", x, (None, K), weight.device)
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"skinny_matmul takes at most {MAX_ROWS} rows, got {x.shape[0]}")
    bias = None if bias is None else check_input("bias", bias, (N,), weight.device)
    return x, bias


def skinny_matmul_ref(x, weight, bias=None, relu=False, out_dtype=torch.float32):
    """PyTorch reference: x rounded to W's dtype, the product in fp32 (fp64 accumulation here)."""
    x, bias = _check(x, weight, bias)
    y = x.to(weight.dtype).double() @ weight.double().t()
    if bias is not None:
        y += bias.double()
    return (y.clamp_min(0) if relu else y).to(out_dtype)


@triton.jit
def _skinny_matmul_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                          HAS_BIAS: tl.constexpr, RELU: tl.constexpr, PRECISION: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rm = tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :]
    w_ptrs = w_ptr + rn[:, None] * stride_wn + rk[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):  # K % BLOCK_K == 0 (checked by the launcher)
        x = tl.load(x_ptrs, mask=rm[:, None] < M, other=0.0).to(w_ptr.dtype.element_ty)
        w = tl.load(w_ptrs, mask=rn[:, None] < N, other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    if RELU:
        acc = tl.maximum(acc, 0.0)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def default_config(M, N, K, dtype):
    """(BLOCK_N, BLOCK_K, num_stages, num_warps): at least ~128 programs so that every SM streams W, and as
    many K tiles in flight per program as shared memory holds."""
    block_m = max(16, next_pow2(M))
    block_n = max(16, min(64, next_pow2(N) // 128))
    block_k = 128
    while K % block_k:
        block_k //= 2
    size = torch.tensor([], dtype=dtype).element_size()
    stages = max(2, min(5, SMEM_BUDGET // ((block_m + block_n) * block_k * size)))
    return block_n, block_k, stages, 4


def supports(M, N, K) -> bool:
    """Shapes the kernel takes: few rows, K a multiple of 16 (one tl.dot step)."""
    return 1 <= M <= MAX_ROWS and K % 16 == 0 and N >= 16


def skinny_matmul(x, weight, bias=None, relu=False, out_dtype=torch.float32, config=None):
    """x [M <= 64, K] (any float dtype), weight [N, K] -> [M, N] in out_dtype, accumulated in fp32.
    `config` = (BLOCK_N, BLOCK_K, num_stages, num_warps) overrides default_config (for benchmarks)."""
    if not use_triton(weight):
        return skinny_matmul_ref(x, weight, bias, relu, out_dtype)
    x, bias = _check(x, weight, bias)
    (M, K), N = x.shape, weight.shape[0]
    y = torch.empty(M, N, device=x.device, dtype=out_dtype)
    if M == 0:
        return y
    if not supports(M, N, K):
        raise ValueError(f"skinny_matmul does not take M={M}, N={N}, K={K} (needs M <= {MAX_ROWS}, K % 16 == 0, "
                         f"N >= 16)")
    block_n, block_k, stages, warps = config or default_config(M, N, K, weight.dtype)
    if K % block_k:
        raise ValueError(f"BLOCK_K={block_k} must divide K={K}")
    precision = "tf32x3" if weight.dtype == torch.float32 else "tf32"  # the latter unused for 16-bit inputs
    _skinny_matmul_kernel[(triton.cdiv(N, block_n),)](
        x, weight, bias if bias is not None else weight, y, M, N, K, x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, RELU=relu, PRECISION=precision, BLOCK_M=max(16, next_pow2(M)),
        BLOCK_N=block_n, BLOCK_K=block_k, num_stages=stages, num_warps=warps)
    return y
