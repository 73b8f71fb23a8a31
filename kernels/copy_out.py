"""Device memory copied into pinned host memory by a kernel: a copy that no copy engine carries.

A step's predictions (and the sequence slots it read, `taken`) come back this way. The copy engines also carry the
host tier's moves (146 MiB a state, ~3 ms each way) and the state exports: a step's own small copy to the host
queued behind an eviction's, and the hot answers whose step ran beside a move came ~1.9 ms later at p50, most of it
the evictions' (bench/LOG.md section 84). The GPU maps pinned host memory at its host address (unified
addressing), so a kernel's stores reach it over PCIe beside whatever the engines copy; they are visible to the host
once an event recorded after the kernel has completed, as a copy's are.

Elements of 4 bytes are copied as 32-bit words, so the host never sees part of one (a step's `taken` is read while
the step runs). The length is not specialised on: one compile (for 16-byte aligned tensors, as every allocation's
start is) serves every length, so a caller compiles it once before capturing graphs and never while serving.
"""
import torch
import triton
import triton.language as tl

from kernels._common import use_triton

BLOCK = 1024  # words a program: a 64-row step's predictions in one


def _words(name, t):
    if not isinstance(t, torch.Tensor) or t.element_size() != 4 or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous tensor of 4-byte elements, got "
                         f"{getattr(t, 'dtype', type(t).__name__)} {list(getattr(t, 'shape', ()))}")
    return t.reshape(-1).view(torch.int32)


def _check(dst, src):
    dst_words, src_words = _words("dst", dst), _words("src", src)
    if dst.shape != src.shape or dst.dtype != src.dtype:
        raise ValueError(f"dst and src must have one shape and dtype, got {list(dst.shape)} {dst.dtype} and "
                         f"{list(src.shape)} {src.dtype}")
    return dst_words, src_words


def copy_out_ref(dst, src):
    """PyTorch reference of copy_out: dst[:] = src."""
    _check(dst, src)
    dst.copy_(src)


@triton.jit(do_not_specialize=["n"])
def _copy_out_kernel(dst_ptr, src_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(dst_ptr + offsets, tl.load(src_ptr + offsets, mask=mask), mask=mask)


def copy_out(dst, src):
    """dst[:] = src: src on the current GPU, dst of its shape and dtype in pinned host memory (contiguous, 4-byte
    elements), enqueued on the current stream (and capturable in a CUDA graph); the reference where Triton does not
    run (src on the CPU)."""
    dst_words, src_words = _check(dst, src)
    if not use_triton(src):
        return copy_out_ref(dst, src)
    # Triton launches on the current GPU; host memory that is not pinned it refuses itself ("cannot be accessed")
    if src.is_cuda and src.device.index != torch.cuda.current_device():
        raise ValueError(f"src must be on the current GPU (cuda:{torch.cuda.current_device()}), got {src.device}")
    n = src_words.numel()
    if n:
        _copy_out_kernel[(triton.cdiv(n, BLOCK),)](dst_words, src_words, n, BLOCK=BLOCK)
