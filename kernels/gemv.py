"""y = x @ W^T (+ bias, then ReLU) for a step's one row: W read at the memory's rate by every SM at once.

At a step's one row a product is a read of W (4-64 MB in the full preset). cuBLAS's GEMV for it, and
kernels/skinny_matmul.py's tensor-core tiles (16 rows, 15 of them padding), start slower and end later than the
read itself takes: each program here loads its whole slice of W, BLOCK_N rows by K (at most TILE_BYTES), in one go
before anything else, at least MIN_PROGRAMS programs (two an SM), then reads x and sums on the FMA units. Launched
with programmatic dependent launch (kernels/_pdl.py), its programs start as the kernel ahead's programs exit, and
load W before they wait for that kernel's stores. Measured on an H100 (bench/LOG.md section 57): 1-5 us a product
faster than cuBLAS (15-25%), each tower alone 5-12% faster, the four-tower step at one row ~3.5%; at two live rows
the step was 4.6% slower than through cuBLAS (every program reads all of x), and from three rows more.

A second row is taken for one case: a step of one symbol launched with a row of room for a request that may join
it before it starts (client/engine/fast/engine.py, JOIN_ROOM). Most such steps start with the room unused; the
kernel reads the step's live row count when it runs (live_rows, on the device) and multiplies the second row only
when a request took it, so the step costs what a one-row step costs.

Arithmetic, per weight dtype: 16-bit weights multiply x rounded to their dtype and sum in fp32 (as cuBLAS and
kernels/skinny_matmul.py); fp32 weights multiply x in fp32; a split weight (W = W_hi + W_lo / LO_SCALE, fp16
halves, skinny_matmul.split_fp16) is put back together in fp32 and multiplies x in fp32, for the rows that
weight_lo covers (the others are plain fp16).
"""
import torch
import triton
import triton.language as tl

from kernels._common import check_input, next_pow2, use_triton
from kernels._pdl import launch_pdl
from kernels.skinny_matmul import LO_SCALE, check_weights

TILE_BYTES = 16 * 1024  # W bytes a program loads at once (16 KB beat 32 and 64 at one row: bench/LOG.md section 57)
MIN_PROGRAMS = 256  # two programs an SM of an H100 (132): one streams while the other waits or sums
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check(x, weight, bias, weight_lo, live_rows):
    N, K = check_weights(weight, weight_lo, DTYPES)
    x = check_input("x", x, (None, K), weight.device)
    if x.shape[0] != 1 and (x.shape[0] != 2 or live_rows is None):
        raise ValueError(f"gemv takes one row, or two with live_rows; got {x.shape[0]} rows"
                         f"{'' if live_rows is None else ' and live_rows'}")
    if live_rows is not None and (not isinstance(live_rows, torch.Tensor) or live_rows.numel() != 1
                                  or live_rows.dtype != torch.int32 or live_rows.device != weight.device):
        raise ValueError(f"live_rows must be a one-element int32 tensor on {weight.device}")
    bias = None if bias is None else check_input("bias", bias, (N,), weight.device)
    return x, bias


def gemv_ref(x, weight, bias=None, relu=False, out_dtype=torch.float32, weight_lo=None, live_rows=None):
    """PyTorch reference, exact in fp64: x rounded to a 16-bit W's dtype, exact for fp32 W and for the rows
    weight_lo covers (W_hi + W_lo / LO_SCALE); rows from live_rows on are zeros."""
    x, bias = _check(x, weight, bias, weight_lo, live_rows)
    w = weight.double()
    x_w = x.double() if weight.dtype == torch.float32 else x.to(weight.dtype).double()
    y = x_w @ w.t()
    if weight_lo is not None:
        rows = weight_lo.shape[0]
        y[:, :rows] = x.double() @ (w[:rows] + weight_lo.double() / LO_SCALE).t()
    if bias is not None:
        y += bias.double()
    y = y.clamp_min(0) if relu else y
    if live_rows is not None:
        y[int(live_rows.reshape(())):] = 0
    return y.to(out_dtype)


@triton.jit
def _row_product(x_ptr, rk, K, w32, bias, rn, N_LO, w_dtype, HAS_BIAS: tl.constexpr, RELU: tl.constexpr,
                 SPLIT: tl.constexpr):
    x = tl.load(x_ptr + rk, mask=rk < K, other=0.0).to(tl.float32)
    x_w = x.to(w_dtype).to(tl.float32)  # 16-bit W: x rounded to its dtype (fp32: as it is)
    if SPLIT:
        acc = tl.sum(w32 * tl.where((rn < N_LO)[:, None], x[None, :], x_w[None, :]), axis=1)
    else:
        acc = tl.sum(w32 * x_w[None, :], axis=1)
    if HAS_BIAS:
        acc += bias
    if RELU:
        acc = tl.maximum(acc, 0.0)
    return acc


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, w_lo_ptr, b_ptr, y_ptr, live_ptr, N, N_LO, K, stride_xm, stride_ym,
                 HAS_BIAS: tl.constexpr, RELU: tl.constexpr, SPLIT: tl.constexpr, LO_SCALE: tl.constexpr,
                 ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    w_mask = (rn[:, None] < N) & (rk[None, :] < K)
    offsets = rn[:, None] * K + rk[None, :]
    # what no kernel of the step writes, loaded before the wait
    w = tl.load(w_ptr + offsets, mask=w_mask, other=0.0)
    if SPLIT:
        w_lo = tl.load(w_lo_ptr + offsets, mask=w_mask & (rn[:, None] < N_LO), other=0.0)
    bias = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_wait()
    w32 = w.to(tl.float32)
    if SPLIT:
        w32 += w_lo.to(tl.float32) * (1.0 / LO_SCALE)
    acc = _row_product(x_ptr, rk, K, w32, bias, rn, N_LO, w_ptr.dtype.element_ty, HAS_BIAS, RELU, SPLIT)
    tl.store(y_ptr + rn, acc.to(y_ptr.dtype.element_ty), mask=rn < N)
    if ROWS == 2:  # a step's second row, multiplied only when live (a room row no request took stays zeros)
        second = tl.zeros((BLOCK_N,), dtype=tl.float32)
        if tl.load(live_ptr) > 1:
            second = _row_product(x_ptr + stride_xm, rk, K, w32, bias, rn, N_LO, w_ptr.dtype.element_ty,
                                  HAS_BIAS, RELU, SPLIT)
        tl.store(y_ptr + stride_ym + rn, second.to(y_ptr.dtype.element_ty), mask=rn < N)


def config(N, K, split, element_size):
    """(BLOCK_N, BLOCK_K, num_warps): the most rows of W a program holds within TILE_BYTES (a split weight's two
    halves counted) that still give MIN_PROGRAMS programs, all of K."""
    block_k = next_pow2(K)
    bytes_per_row = block_k * element_size * (2 if split else 1)
    block_n = 16
    while block_n > 1 and (block_n * bytes_per_row > TILE_BYTES or triton.cdiv(N, block_n) < MIN_PROGRAMS):
        block_n //= 2
    return block_n, block_k, 8 if block_n * block_k >= 8192 else 4


def supports(N, K) -> bool:
    """Shapes of W it takes: a row within TILE_BYTES (fp32: K <= 4,096)."""
    return N >= 1 and 1 <= K and next_pow2(K) * 4 <= TILE_BYTES


def gemv(x, weight, bias=None, relu=False, out_dtype=torch.float32, weight_lo=None, live_rows=None):
    """x [1, K] (any float dtype), weight [N, K] fp32/fp16/bf16 (with weight_lo: fp16 hi and lo halves of fp32 rows,
    skinny_matmul.split_fp16) -> [1, N] in out_dtype, summed in fp32. With live_rows (int32 [1] on the device, read
    when the kernel runs) x may have two rows: the second is multiplied when live_rows > 1, else its output is
    zeros (a step captured with a row of room that no request took)."""
    if not use_triton(weight):
        return gemv_ref(x, weight, bias, relu, out_dtype, weight_lo, live_rows)
    x, bias = _check(x, weight, bias, weight_lo, live_rows)
    N, K = weight.shape
    y = torch.empty(x.shape[0], N, device=x.device, dtype=out_dtype)
    if not supports(N, K):
        raise ValueError(f"gemv does not take W [{N}, {K}] (needs K <= {TILE_BYTES // 4})")
    split = weight_lo is not None
    block_n, block_k, warps = config(N, K, split, weight.element_size())
    pdl = launch_pdl(x.device)
    _gemv_kernel[(triton.cdiv(N, block_n),)](
        x, weight, weight_lo if split else weight, bias if bias is not None else weight, y,
        live_rows if live_rows is not None else y, N, weight_lo.shape[0] if split else 0, K, x.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, RELU=relu, SPLIT=split, LO_SCALE=LO_SCALE, ROWS=x.shape[0], BLOCK_N=block_n,
        BLOCK_K=block_k, PDL=pdl, num_warps=warps, **({"launch_pdl": True} if pdl else {}))
    return y
