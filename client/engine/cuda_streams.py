"""CUDA streams that one owner uses alone, for as long as the process runs.

torch.cuda.Stream() hands out, in turn, one of a pool of 32 streams per device and priority, so once a process has
drawn 32, two engines in it share streams. cuBLAS keeps one workspace per (handle, stream) and a CUDA graph keeps
the workspace its capture used: graphs of two engines captured on one stream share that workspace, and when both run
at once their GEMMs race on it. On an H200 two engines stepping side by side in one process gave wrong predictions
(0.12 off) or a kernel that never ended (bench/LOG.md section 71). So the streams an engine keeps (its step, tower,
copy and capture streams) are its own: created like torch's (non-blocking), never handed to anyone else, never
destroyed. Not destroyed, as torch's are not: torch's allocator and cuBLAS keep what they tied to a stream for the
process's life (destroying one aborted a later garbage collection). Not lent again once their owner is collected
either: a graph of that owner still queued on the GPU would share its workspace with the next holder. A process
that builds many engines keeps 9 streams for each. Short-lived streams that run no captured work (warm-ups) stay
torch's: no graph holds their workspaces, and eager cuBLAS calls in one thread on one stream run in order.

The host tier's moves enqueue their pieces here too (copy_pieces), through the same runtime.
"""
import ctypes
import re
import sys
import weakref

import torch

_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: the direction from the pointers (unified addressing)
_NON_BLOCKING = 0x01  # cudaStreamNonBlocking: no implicit wait on the legacy default stream, as torch's streams
_CUDART_FILE = re.compile(r"libcudart(-[0-9a-f]+)?\.so")  # pip's and the toolkit's names, and auditwheel's hashed ones
_cudart = None  # the CUDA runtime torch loaded (ctypes), False where it is not a library of its own


def own_stream(device, priority: int = 0) -> torch.cuda.Stream:
    """A new stream on `device` that no other caller of torch.cuda.Stream() or of this function is ever handed.
    Lower `priority` runs first, as with torch's. Where torch's CUDA runtime is not a library of its own (linked
    statically), torch's pooled stream, with a warning."""
    device = torch.device(device)
    runtime = _runtime()
    if not runtime:
        return torch.cuda.Stream(device, priority=priority)
    index = torch.cuda.current_device() if device.index is None else device.index
    handle = ctypes.c_void_p()
    with torch.cuda.device(index):
        error = runtime.cudaStreamCreateWithPriority(ctypes.byref(handle), _NON_BLOCKING, priority)
    if error:
        runtime.cudaGetLastError()  # else torch's next launch check reports it against a kernel of its own
        raise RuntimeError(f"cudaStreamCreateWithPriority on {device} failed: "
                           f"{runtime.cudaGetErrorString(error).decode()}")
    return torch.cuda.ExternalStream(handle.value, device=torch.device("cuda", index))


def copy_pieces(dst, src, bounds):
    """dst[begin:end] = src[begin:end] for each (begin, end) of `bounds`: one-dimensional byte tensors, one on the
    current stream's GPU and one in host memory CUDA has pinned (or both on the CPU), enqueued on the current stream.

    One cudaMemcpyAsync a piece through ctypes, which lets the GIL go while the driver enqueues it. With torch's copy_
    (~12 us of the calling thread a piece, the GIL held) a cold request's arrival, whose return and eviction are ~40
    pieces of 8 MiB, held the state table's lock and the GIL 1.56 ms at p99 while the steps beside it waited for
    both; this way 1.00 (bench/LOG.md section 85). No allocator learns of these copies: the caller keeps both tensors
    alive until the stream has passed them (the state table's buffers live as long as it). torch's copy_ where the
    runtime is not a library of its own, and on the CPU."""
    runtime = _runtime() if dst.is_cuda or src.is_cuda else False
    if not runtime:
        for begin, end in bounds:
            dst[begin:end].copy_(src[begin:end], non_blocking=True)
        return
    for t in (dst, src):
        if t.dim() != 1 or t.element_size() != 1 or not t.is_contiguous():
            raise ValueError(f"copy_pieces copies one-dimensional byte tensors, got {t.dtype} {list(t.shape)}")
    if any(not 0 <= begin <= end <= min(dst.numel(), src.numel()) for begin, end in bounds):
        raise ValueError(f"pieces {bounds} out of range for {dst.numel()} and {src.numel()} bytes")
    device = (dst if dst.is_cuda else src).device
    to, of = dst.data_ptr(), src.data_ptr()
    with torch.cuda.device(device):
        stream = ctypes.c_void_p(torch.cuda.current_stream(device).cuda_stream)
        for begin, end in bounds:
            error = runtime.cudaMemcpyAsync(to + begin, of + begin, end - begin, _MEMCPY_DEFAULT, stream)
            if error:
                runtime.cudaGetLastError()  # else torch's next launch check reports it against a kernel of its own
                raise RuntimeError(f"cudaMemcpyAsync of {end - begin} bytes on {device} failed: "
                                   f"{runtime.cudaGetErrorString(error).decode()}")


def reset_graphs_when_dropped(owner, device, *holders):
    """When `owner` is collected, reset the CUDA graphs in `holders` (dicts or lists, as they stand then) with
    `device` current. Torch destroys a graph on the thread's current device, and a thread that never set one (any
    thread that drops the last reference) would make a CUDA context on GPU 0 for it: ~0.5 GiB of another GPU's
    memory (bench/LOG.md sections 74, 75)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # "cuda": the GPU current now, as at the capture, not the
        device = torch.device("cuda", torch.cuda.current_device())  # dropping thread's (GPU 0 in a fresh thread)
    finalizer = weakref.finalize(owner, _reset_graphs, device, holders)
    finalizer.atexit = False  # at exit the process ends with its graphs, as torch leaves them


def _reset_graphs(device, holders):
    with torch.cuda.device(device):
        for holder in holders:
            for graph in holder.values() if isinstance(holder, dict) else holder:
                graph.reset()


def _runtime():
    """The CUDA runtime library mapped into this process (torch's: another one would keep state of its own), or
    False."""
    global _cudart
    if _cudart is None:
        path = _mapped(_CUDART_FILE)
        runtime = False
        if path:
            try:
                runtime = ctypes.CDLL(path)
                runtime.cudaStreamCreateWithPriority.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint,
                                                                 ctypes.c_int]
                runtime.cudaGetErrorString.restype = ctypes.c_char_p
                runtime.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                    ctypes.c_void_p]
            except (OSError, AttributeError):
                runtime = False
        if not runtime:
            sys.stderr.write("[cuda streams] torch's CUDA runtime is not a library of its own here: engines use "
                             "torch's pooled streams, which two engines in one process may share (their steps must "
                             "not overlap)\n")
        _cudart = runtime  # set once complete: another thread reads it without a lock
    return _cudart


def _mapped(file_name: re.Pattern):
    """The path of the first file mapped into this process whose name `file_name` matches from its start, or
    None."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if file_name.match(path.rsplit("/", 1)[-1]):
                    return path
    except OSError:
        pass
    return None
