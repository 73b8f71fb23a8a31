"""Which towers run on which GPU when the step is spread over several.

The four towers are independent until their four predictions, so each GPU can run some of them on its own
state table, reading only their weights. A GPU's step time is about the larger of two terms: its towers'
weight bytes over the memory bandwidth (they share it), and its longest tower chain alone (a tower is a chain
of small dependent kernels; the xLSTM tower's is the longest). The placement minimises the slowest GPU's
estimate over every assignment (at most 4^N of them), most balanced bytes first among equals.
"""
import itertools

import torch

from client.model.config import TOWER_NAMES

from client.engine.precision import TOWER_PARTS, resolve_precision

# Each tower alone at B=1 (ms, H100; the chain term of the estimate): xLSTM, Mamba2 and RetNet measured
# (bench/LOG.md sections 16 and 19), Hawk estimated from its bytes (0.77 GB, the shortest chain).
TOWER_ALONE_MS = {"xlstm": 1.08, "mamba2": 0.75, "retnet": 0.95, "hawk": 0.45}
BANDWIDTH = 2.4e12  # bytes/s reached by the concurrent step at B=1 (bench/h100.json: 4.9 GB in 2.1 ms)


# Where each weight group of client.engine.precision.TOWER_PARTS lies in a tower's state dict.
PART_KEYS = {
    "input_down": (".input_down.",), "mlp": (".mlp.",), "slstm": (".layer.slstm.",),
    "mlstm_x": (".mlstm.x_proj.",), "mlstm_gate": (".mlstm.gate_proj.",),
    "mlstm_qkv": (".mlstm.q_proj.", ".mlstm.k_proj.", ".mlstm.v_proj."), "mlstm_down": (".mlstm.proj_down.",),
    "in_proj": (".input_proj.", ".b_proj.", ".c_proj.", ".z_proj."),
    "qkvg": (".q_proj.", ".k_proj.", ".v_proj.", ".g_proj."), "out_proj": (".layer.out_proj.",),
    "gate_rec": (".gate_proj.", ".recurrent_proj."), "rglru_gates": (".rglru.input_gate.", ".rglru.recurrence_gate."),
}


def _part_of(tower, key):
    return next((part for part in TOWER_PARTS[tower] if any(k in key for k in PART_KEYS[part])), None)


def tower_weight_bytes(model, precision=None) -> dict[str, int]:
    """Bytes of each tower's weights in the engine's precision, weight group by weight group (input_up in fp32,
    as the runner keeps it; the small tensors outside every group in the tower's dtype)."""
    precision = resolve_precision(precision)
    sizes = {name: 0 for name in TOWER_NAMES}
    for key, tensor in model.state_dict().items():
        if not key.startswith("towers."):
            continue
        name = TOWER_NAMES[int(key.split(".")[1])]
        part = _part_of(name, key)
        dtype = torch.float32 if ".input_up." in key else precision.get(f"{name}.{part}", precision[name])
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
