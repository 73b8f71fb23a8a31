"""Which towers run on which GPU when the step is spread over several.

The four towers are independent until their four predictions, so each GPU can run some of them on its own
state table, reading only their weights. A GPU's step time is about the larger of two terms: its towers'
weight bytes over the memory bandwidth (they share it), and its longest tower chain alone (a tower is a chain
of small dependent kernels; the xLSTM tower's is the longest). The placement minimises the slowest GPU's
estimate over every assignment (at most 4^N of them), most balanced bytes first among equals.
"""
import itertools

import torch

from client.engine.precision import DEFAULT_PRECISION, WEIGHT_GROUPS
from client.model.config import TOWER_NAMES

# Each tower alone at B=1 (ms, H100; the chain term of the estimate): xLSTM, Mamba2 and RetNet measured
# (bench/LOG.md sections 16 and 19), Hawk estimated from its bytes (0.77 GB, the shortest chain).
TOWER_ALONE_MS = {"xlstm": 1.08, "mamba2": 0.75, "retnet": 0.95, "hawk": 0.45}
BANDWIDTH = 2.4e12  # bytes/s reached by the concurrent step at B=1 (bench/h100.json: 4.9 GB in 2.1 ms)


def weight_group_of(tower, key):
    """The weight group (WEIGHT_GROUPS) that a state-dict key of the tower lies in, or None."""
    return next((group for group, keys in WEIGHT_GROUPS[tower].items() if any(k in key for k in keys)), None)


def tower_weight_bytes(model, precision=DEFAULT_PRECISION) -> dict[str, int]:
    """Bytes of each tower's weights in the engine's Precision, weight group by weight group (input_up in fp32,
    or fp64 with an fp64 input path, as the runner keeps it; the small tensors outside every group in the tower's
    dtype)."""
    sizes = {name: 0 for name in TOWER_NAMES}
    for key, tensor in model.state_dict().items():
        if not key.startswith("towers."):
            continue
        name = TOWER_NAMES[int(key.split(".")[1])]
        if ".input_up." in key:
            dtype = torch.float64 if precision.dtype_of(name, "input_down") == torch.float64 else torch.float32
        else:
            dtype = precision.dtype_of(name, weight_group_of(name, key))
        sizes[name] += tensor.numel() * dtype.itemsize
    return sizes


def estimate_ms(towers, weight_bytes) -> float:
    if not towers:
        return 0.0
    return max(sum(weight_bytes[t] for t in towers) / BANDWIDTH * 1e3, max(TOWER_ALONE_MS[t] for t in towers))


def place_towers(model, precision, gpus: int) -> list[list[str]]:
    """Towers per GPU (in tower order within each); with more GPUs than towers the extra ones stay idle."""
    if gpus < 1:
        raise ValueError(f"the number of GPUs must be positive, got {gpus}")
    if gpus == 1:
        return [list(TOWER_NAMES)]
    weight_bytes = tower_weight_bytes(model, precision)
    used = min(gpus, len(TOWER_NAMES))
    best = None
    for assignment in itertools.product(range(used), repeat=len(TOWER_NAMES)):
        groups = [[t for t, g in zip(TOWER_NAMES, assignment) if g == gpu] for gpu in range(used)]
        if any(not group for group in groups):
            continue
        estimates = [estimate_ms(group, weight_bytes) for group in groups]
        loads = [sum(weight_bytes[t] for t in group) for group in groups]
        key = (max(estimates), max(loads) - min(loads))
        if best is None or key < best[0]:
            best = (key, groups)
    return best[1]
