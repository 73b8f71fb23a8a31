"""CUDA streams that one owner uses alone.

torch.cuda.Stream() hands out, in turn, one of a pool of 32 streams per device and priority, so once a process has
drawn 32, two engines in it share streams. cuBLAS keeps one workspace per (handle, stream) and a CUDA graph keeps
the workspace its capture used: graphs of two engines captured on one stream share that workspace, and when both run
at once their GEMMs race on it. On an H200 two engines stepping side by side in one process gave wrong predictions
(0.12 off) or a kernel that never ended (bench/LOG.md section 71). So an engine's streams are its own: created like
torch's (non-blocking), each lent to one owner at a time and lent again once that owner has let go of it. They are
never destroyed, as torch's are not: torch's allocator and cuBLAS keep what they tied to a stream for the process's
life (destroying one aborted a later garbage collection).
"""
import ctypes
import ctypes.util
import sys

import torch

_NON_BLOCKING = 0x01  # cudaStreamNonBlocking: no implicit wait on the legacy default stream, as torch's streams
_cudart = None  # the CUDA runtime torch loaded (ctypes), False where none could be found
# (device index, priority) -> handles whose owner let go of them. No lock: setdefault, pop and append are each atomic
# under the GIL, and a lock taken in __del__, which a garbage collection may run inside the lock's block, would
# deadlock.
_let_go: dict[tuple[int, int], list[int]] = {}


class _OwnStream(torch.cuda.ExternalStream):
    """A stream lent to its holder: its handle goes back to _let_go when the object is collected. __del__, not
    weakref.finalize: finalizers registered per stream made the interpreter's exit crash in weakref's exit hook."""

    def __del__(self, let_go=_let_go):  # bound now: module globals may be gone when the interpreter exits
        let_go.setdefault(self.lent_as, []).append(self.cuda_stream)


def own_stream(device, priority: int = 0) -> torch.cuda.Stream:
    """A stream on `device` that nobody else holds: none of torch's pooled ones, none another live owner holds.
    Lower `priority` runs first, as with torch's. Lent again once the returned object is collected (work already
    enqueued on it runs first). Where the CUDA runtime cannot be found, torch's pooled stream, with a warning."""
    device = torch.device(device)
    runtime = _runtime()
    if not runtime:
        return torch.cuda.Stream(device, priority=priority)
    key = (torch.cuda.current_device() if device.index is None else device.index, priority)
    try:
        handle = _let_go.setdefault(key, []).pop()
    except IndexError:
        handle = None
    if handle is None:
        created = ctypes.c_void_p()
        with torch.cuda.device(key[0]):
            error = runtime.cudaStreamCreateWithPriority(ctypes.byref(created), _NON_BLOCKING, priority)
        if error:
            raise RuntimeError(f"cudaStreamCreateWithPriority on {device} failed: "
                               f"{runtime.cudaGetErrorString(error).decode()}")
        handle = created.value
    stream = _OwnStream(handle, device=torch.device("cuda", key[0]))
    stream.lent_as = key
    return stream


def _runtime():
    """The CUDA runtime library torch uses (the one mapped into this process), or False."""
    global _cudart
    if _cudart is None:
        path = _mapped("libcudart.so") or ctypes.util.find_library("cudart")
        try:
            _cudart = ctypes.CDLL(path) if path else False
        except OSError:
            _cudart = False
        if _cudart:
            _cudart.cudaStreamCreateWithPriority.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint,
                                                             ctypes.c_int]
            _cudart.cudaGetErrorString.restype = ctypes.c_char_p
        else:
            sys.stderr.write("[cuda streams] the CUDA runtime library was not found: engines use torch's pooled "
                             "streams, which two engines in one process may share (their steps must not overlap)\n")
    return _cudart


def _mapped(name):
    """The path of the first library mapped into this process whose file name starts with `name`, or None."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if path.rsplit("/", 1)[-1].startswith(name):
                    return path
    except OSError:
        pass
    return None
