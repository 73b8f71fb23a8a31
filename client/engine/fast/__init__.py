"""The fast engine: GPU-resident state table, fused 16-bit step with Triton state kernels, CUDA graphs.

Layered like a serving engine: the state table (where state lives, state_table.py), the step runner and its
graphs (how a step runs, runner.py, layers.py); who goes into a step is the client's scheduler.
"""
import sys
import time

import numpy as np
import torch

from client.engine.base import Engine, check_step_inputs

from .runner import BUCKETS, DEFAULT_PRECISION, GraphedStep, StepRunner
from .state_table import PAD_SLOT, StateTable

__all__ = ["FastEngine", "StepRunner", "GraphedStep", "StateTable", "PAD_SLOT", "DEFAULT_PRECISION", "BUCKETS"]


def _progress(label):
    def report(done, total):
        sys.stderr.write(f"\r[fast engine] {label} {done}/{total}")
        if done == total:
            sys.stderr.write("\n")
    return report


class FastEngine(Engine):
    name = "fast"

    def __init__(self, model, device=None, *, max_batch=64, graphs=None, precision=None, capacity=None,
                 progress=True):
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if device.type == "cuda":
            # The fp32 parts (RetNet tower, gates) must be true fp32 products, not TF32.
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
        start = time.perf_counter()
        self.device = device
        self.max_batch = max_batch
        self.runner = StepRunner(model, device, precision, capacity=capacity or max_batch)
        use_graphs = device.type == "cuda" if graphs is None else graphs
        self.graphed = None
        if use_graphs:
            buckets = [b for b in BUCKETS if b < max_batch] + [max_batch]
            self.graphed = GraphedStep(self.runner, buckets, progress=_progress("capturing graphs") if progress else None)
            self.graphed.capture()
        self.startup_s = time.perf_counter() - start
        if progress:
            sys.stderr.write(f"[fast engine] ready on {device} in {self.startup_s:.1f} s "
                             f"({self.describe()['precision']})\n")

    @property
    def symbols(self):
        return list(self.runner.table.slot_of)

    @property
    def weight_bytes(self) -> int:
        return self.runner.weight_bytes

    @property
    def state_bytes(self) -> int:
        """Bytes of state per symbol (the padding-free row of the state table)."""
        return self.runner.table.bytes_per_slot

    def describe(self):
        return {"device": str(self.device), "graphs": self.graphed is not None,
                "precision": {k: str(v).removeprefix("torch.") for k, v in self.runner.precision.items()},
                "weight_bytes": self.weight_bytes, "state_bytes_per_symbol": self.state_bytes,
                "capacity": self.runner.table.capacity, "max_batch": self.max_batch}

    def slots_for(self, symbols) -> torch.Tensor:
        slots = self.runner.table.slots_for(symbols)
        return torch.tensor(slots, dtype=torch.int32).to(self.device, non_blocking=True)

    @torch.no_grad()
    def step_slots(self, slot_ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """Predictions [B, 4] on the device; valid until the next call (graph outputs are reused)."""
        if self.graphed is not None:
            return self.graphed(slot_ids, features)
        return self.runner(slot_ids, features)

    def step(self, symbols, features):
        features = check_step_inputs(list(symbols), features)
        if not symbols:
            return np.zeros((0, 4), dtype=np.float32)
        out = np.empty((len(symbols), 4), dtype=np.float32)
        for start in range(0, len(symbols), self.max_batch):  # larger steps run as several buckets
            chunk = list(symbols[start:start + self.max_batch])
            slots = self.slots_for(chunk)
            feats = torch.from_numpy(features[start:start + len(chunk)]).to(self.device, non_blocking=True)
            out[start:start + len(chunk)] = self.step_slots(slots, feats).cpu().numpy()
        return out
