"""The fast engine: GPU-resident state table, fused 16-bit step with Triton state kernels, CUDA graphs.

Layered like a serving engine: where state lives (state_table.py), how a step runs (runner.py, layers.py, and its
CUDA graphs), the towers' placement over GPUs (placement.py), and the engine that puts them together behind the
Engine interface (engine.py); who goes into a step is the client's scheduler.
"""
from client.engine.precision import DEFAULT_PRECISION

from .engine import RESERVE, RING, STATE_MEMORY, FastEngine
from .runner import BUCKETS, GraphedStep, StepRunner
from .state_table import PAD_SLOT, CapacityError, StateTable

__all__ = ["FastEngine", "RING", "RESERVE", "STATE_MEMORY", "StepRunner", "GraphedStep", "StateTable", "CapacityError",
           "PAD_SLOT", "DEFAULT_PRECISION", "BUCKETS"]
