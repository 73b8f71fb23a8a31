"""Triton's in-process kernel caches, for the engine's startup (client/engine/fast/runner.precompile).

A JIT kernel's first call with new specialisations compiles it (or loads it from Triton's disk cache); its first
launch of each compiled kernel then builds the launcher (with Triton 3.6, a C module per signature) and loads the
binary on the device. precompile runs the compiles side by side in threads under `compile_only` and the first
launches one at a time after them, since twice in hundreds of starts (Triton 3.6, warm cache, threads launching
side by side) a first launch got a launcher that took other arguments than its kernel's, and kept it
(bench/LOG.md sections 45, 67). `forget_compiled` drops every compiled kernel from the JIT's caches, so that a
retry specialises, loads and launches afresh.
"""
import contextlib
import sys
import threading

_FORGOTTEN = []  # compiled kernels dropped from the caches, kept alive: a captured CUDA graph may launch them


def jit_kernels() -> list:
    """Every JIT kernel that the modules of kernels/ define (none where Triton interprets: nothing compiles)."""
    from triton.runtime.jit import JITFunction

    found = {}
    for name, module in list(sys.modules.items()):
        if module is not None and (name == "kernels" or name.startswith("kernels.")):
            found.update((id(v), v) for v in vars(module).values() if isinstance(v, JITFunction))
    return list(found.values())


_thread = threading.local()  # compile_only: whether this thread's calls compile only
_lock = threading.Lock()
_holders = 0  # compile_only blocks open, over all threads
_wrapped = {}  # id -> kernel whose run compile_only wraps while any block is open


def _run(kernel, *args, grid, warmup, **kwargs):
    warmup = warmup or getattr(_thread, "compile_only", False)
    return type(kernel).run(kernel, *args, grid=grid, warmup=warmup, **kwargs)


@contextlib.contextmanager
def compile_only(kernels):
    """Within it, a call of any of `kernels` from this thread compiles what it would launch (specialised on the
    arguments as a launch is) and launches nothing: Triton's own warm-up. Other threads' calls launch as always
    (an engine may serve while another starts)."""
    global _holders
    with _lock:
        for kernel in kernels:
            kernel.run = _run.__get__(kernel)  # `kernel[grid](...)` calls the instance's run
            _wrapped[id(kernel)] = kernel
        _holders += 1
    before, _thread.compile_only = getattr(_thread, "compile_only", False), True
    try:
        yield
    finally:
        _thread.compile_only = before
        with _lock:
            _holders -= 1
            if _holders == 0:
                for kernel in _wrapped.values():
                    vars(kernel).pop("run", None)
                _wrapped.clear()


def compiled_count(kernels) -> int:
    """How many compiled kernels the caches of `kernels` hold, over every device."""
    return sum(len(caches[0]) for kernel in kernels for caches in kernel.device_caches.values())


def unlaunched(kernels) -> list:
    """Names of the compiled kernels in the caches of `kernels` that were never launched (no binary loaded)."""
    return [kernel.fn.__name__ for kernel in kernels for caches in kernel.device_caches.values()
            for compiled in caches[0].values() if compiled.module is None]


def forget_compiled(kernels) -> None:
    """Drop the compiled kernels (with their launchers) from the JIT caches of `kernels`: the next call of each
    specialises its arguments again and builds its kernel anew, from Triton's disk cache. The dropped ones stay
    alive (Triton unloads a compiled kernel's binary when it is collected)."""
    for kernel in kernels:
        _FORGOTTEN.extend(compiled for caches in kernel.device_caches.values() for compiled in caches[0].values())
        kernel.device_caches.clear()
