"""32-bit words copied between the GPU and pinned host memory by a kernel: a copy that no copy engine carries.

A step's inputs go in and its predictions (and the sequence slots it read, `taken`) come back this way. The copy
engines also carry the host tier's moves (146 MiB a state, ~3 ms each way) and the state exports: a step's own
small copies queued behind a move's pieces, and the hot answers whose step ran beside a move came ~1.9 ms later at
p50, its predictions behind an eviction's pieces, its inputs behind a return's (bench/LOG.md section 84; by kernel
the predictions took ~1 ms off that, the inputs nothing more measurable, section 85). The GPU maps pinned host
memory at its host address (unified addressing), so a kernel's loads and stores reach it over PCIe beside whatever
the engines copy; the stores are visible to the host once an event recorded after the kernel has completed, as a
copy's are.

Whole 32-bit words, so that neither side sees part of one: a step's `taken` is read while the step runs, and a
request joins a queued step by writing its slot last (runner.StepInputs.join). The loads are volatile (relaxed at
system scope): each word is read from host memory when the kernel runs, never from a cache, so a copy launched
before the host wrote a word sees it if the word was written before the kernel ran. Neither the length nor the
pointers' alignment is specialised on: one compile serves every copy (a step's inputs start 4 bytes a sequence
into a buffer), so a caller compiles it once before capturing graphs and never while serving.
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


def copy_words_ref(dst, src):
    """PyTorch reference of copy_words: dst[:] = src."""
    _check(dst, src)
    dst.copy_(src)


@triton.jit(do_not_specialize=["n"], do_not_specialize_on_alignment=["dst_ptr", "src_ptr"])
def _copy_words_kernel(dst_ptr, src_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(dst_ptr + offsets, tl.load(src_ptr + offsets, mask=mask, volatile=True), mask=mask)


def copy_words(dst, src):
    """dst[:] = src, one of them on the current GPU and the other of its shape and dtype in pinned host memory
    (contiguous, 4-byte elements), enqueued on the current stream (and capturable in a CUDA graph); the reference
    where Triton does not run (both on the CPU, without the interpreter)."""
    dst_words, src_words = _check(dst, src)
    gpu = src if src.is_cuda else dst
    if not use_triton(gpu):
        return copy_words_ref(dst, src)
    if dst.is_cuda and src.is_cuda:
        raise ValueError(f"one of dst and src must be in host memory, got {dst.device} and {src.device}")
    # Triton launches on the current GPU; host memory that is not pinned it refuses itself ("cannot be accessed")
    if gpu.is_cuda and gpu.device.index != torch.cuda.current_device():
        raise ValueError(f"the GPU side must be on the current GPU (cuda:{torch.cuda.current_device()}), got "
                         f"{gpu.device}")
    n = src_words.numel()
    if n:
        _copy_words_kernel[(triton.cdiv(n, BLOCK),)](dst_words, src_words, n, BLOCK=BLOCK)
