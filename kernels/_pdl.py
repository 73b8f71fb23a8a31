"""Programmatic dependent launch (Hopper on): a kernel launched with it may start before the kernel ahead of it on
the stream has ended, and waits for that one's end (and its stores) at `gdc_wait`, not at its launch.

kernels/gemv.py launches with it and loads its weights (which no kernel of the step writes) before the wait: its
programs start as soon as the kernel ahead's programs have exited (the trigger every kernel makes at its end),
without waiting for the launch behind a finished kernel. Kernels do not trigger earlier: dependents launched at
the start of the kernel ahead held their SMs while they waited and slowed the other towers' kernels beside them
(bench/LOG.md section 57).

The chain stays ordered: a kernel launched with PDL waits before its first dependent load and any store, and ends
only after its wait returned. Kernels launched without it wait for the whole kernel ahead, as always. Stream
capture records the relation in a CUDA graph.
"""
import torch

from kernels._common import INTERPRET

PDL = True  # kernels/gemv.py launches with PDL where the device and Triton take it (switch for A/B measurements)
_SUPPORTED = {}


def _triton_launches_pdl() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


def launch_pdl(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL: a CUDA device of compute capability 9.0 or more, a Triton
    that takes `launch_pdl`, not the interpreter, and PDL on."""
    if not PDL or INTERPRET or device.type != "cuda":
        return False
    index = torch.cuda.current_device() if device.index is None else device.index
    if index not in _SUPPORTED:
        _SUPPORTED[index] = torch.cuda.get_device_capability(index)[0] >= 9 and _triton_launches_pdl()
    return _SUPPORTED[index]
