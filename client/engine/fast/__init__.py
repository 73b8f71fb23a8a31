"""The fast engine: GPU-resident state table, fused 16-bit step with Triton state kernels, CUDA graphs.

Layered like a serving engine: where state lives (state_table.py), how a step runs (runner.py, layers.py, and its
CUDA graphs), the towers' placement over GPUs (placement.py), and the engine that puts them together behind the
Engine interface (engine.py); who goes into a step is the client's scheduler.
"""
import importlib

from client.engine.precision import DEFAULT_PRECISION

# Each name is imported from its module on first use, not with the package: the reference engine takes its memory
# rules from state_table.py, which must not import the Triton kernels (pip installs Triton on Linux alone).
_HOMES = {"FastEngine": "engine", "RING": "engine", "RESERVE": "engine", "STATE_MEMORY": "state_table",
          "StepRunner": "runner", "GraphedStep": "runner", "BUCKETS": "runner", "StateTable": "state_table",
          "CapacityError": "state_table", "PAD_SLOT": "state_table"}

__all__ = [*_HOMES, "DEFAULT_PRECISION"]


def __getattr__(name):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
