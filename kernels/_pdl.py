"""Programmatic dependent launch (Hopper on): a kernel launched with it may start before the kernel ahead of it on
the stream has ended, and waits for that one's end (and its stores) at `gdc_wait`, not at its launch.

kernels/gemv.py launches with it and loads its weights (which no kernel of the step writes) before the wait: its
programs start as soon as the kernel ahead's programs have exited (the trigger every kernel makes at its end),
without waiting for the launch behind a finished kernel. Kernels do not trigger earlier: dependents launched at
the start of the kernel ahead held their SMs while they waited and slowed the other towers' kernels beside them
(bench/LOG.md section 57).

Every other kernel of a step launches with it too (`options`) and waits first thing, before any load, store or
return: what it saves is the launch behind the kernel ahead (its programs are placed while that kernel's stores
drain), on each of the ~160 kernels of a tower's chain at one row.

The chain stays ordered: a kernel launched with PDL waits before its first dependent load and any store, and ends
only after its wait returned (so the kernel behind it, waiting for its end, also waits for the ones ahead of it).
Kernels launched without it wait for the whole kernel ahead, as always. Stream capture records the relation in a
CUDA graph.
"""
import torch

from kernels._common import INTERPRET

PDL = True  # kernels/gemv.py launches with PDL where the device and Triton take it (switch for A/B measurements)
EVERY_KERNEL = True  # the step's other kernels too (switch for A/B measurements)
EARLY_TRIGGER = True  # a one-row step's norms let the product behind them load its weights meanwhile (A/B switch)
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


def options(device: torch.device, trigger=None) -> dict:
    """A step kernel's launch arguments: its PDL constexpr (wait for the kernel ahead first thing), and Triton's
    launch_pdl where it is on. trigger (a kernel with a TRIGGER constexpr): whether it lets the kernel behind it
    launch as soon as its own wait returns (EARLY_TRIGGER and PDL on)."""
    on = EVERY_KERNEL and launch_pdl(device)
    args = {"PDL": on, "launch_pdl": True} if on else {"PDL": False}
    if trigger is not None:
        args["TRIGGER"] = bool(on and trigger and EARLY_TRIGGER)
    return args
