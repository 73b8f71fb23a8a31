"""The fast engine: GPU-resident state table, fused 16-bit step with Triton state kernels, CUDA graphs.

Layered like a serving engine: the state table (where state lives, state_table.py), the step runner and its
graphs (how a step runs, runner.py, layers.py); who goes into a step is the client's scheduler.
"""
import sys
import time

import numpy as np
import torch

from client.engine.base import NUM_TOWERS, Engine, PendingStep, check_step_inputs
from client.engine.precision import describe_precision, resolve_precision

from .runner import BUCKETS, DEFAULT_PRECISION, GraphedStep, StepRunner, input_bytes, input_views
from .state_table import PAD_SLOT, StateTable

__all__ = ["FastEngine", "RING", "StepRunner", "GraphedStep", "StateTable", "PAD_SLOT", "DEFAULT_PRECISION", "BUCKETS"]

# Pinned staging buffers for submitted steps, each with its own set of graphs: one more than the runtime keeps
# in flight (2), so that reusing one never has to wait for its previous step.
RING = 3


def _progress(label):
    def report(done, total):
        sys.stderr.write(f"\r[fast engine] {label} {done}/{total}")
        if done == total:
            sys.stderr.write("\n")
    return report


class _Staging:
    """One submitted step's pinned host buffers, and the event recorded after its read-back was enqueued."""

    def __init__(self, max_batch, num_features):
        self.inputs = torch.zeros(input_bytes(max_batch, max_batch, num_features), dtype=torch.uint8,
                                  pin_memory=True)  # laid out like GraphedStep.inputs
        slots, features = input_views(self.inputs, max_batch, num_features)
        self.slots, self.features = slots.numpy(), features.numpy()
        self.out = torch.empty(max_batch, NUM_TOWERS, dtype=torch.float32, pin_memory=True)
        self.done = torch.cuda.Event()
        self.step: PendingStep | None = None  # the last step that used these buffers

    def read_back(self, batch):
        self.done.synchronize()  # releases the GIL while the GPU finishes
        return self.out[:batch].numpy().copy()  # a copy: the buffer is reused by a later step


class FastEngine(Engine):
    name = "fast"

    def __init__(self, model, device=None, *, max_batch=64, graphs=None, precision=None, capacity=None,
                 progress=True, compile=False):
        """precision: a spec string ("auto", "bf16", "bf16,retnet=fp32": client/engine/precision.py), or a
        {tower or "<tower>.mlp": dtype} dict of overrides of DEFAULT_PRECISION. compile: each block through
        torch.compile (compiled.py), compiled here, before any graph is captured; CompileUnavailable if it
        cannot run."""
        precision = resolve_precision(precision)
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if device.type == "cuda":
            # The fp32 parts (RetNet tower, gates) must be true fp32 products, not TF32.
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
        start = time.perf_counter()
        self.device = device
        self.max_batch = max_batch
        self.compile_s = None  # seconds of compiling: torch.compile's probe, then every graph the step needs
        if compile:
            from .compiled import check_compile, warm_up
            check_compile(device)  # before the weights are converted: where it cannot run, fail at once
            self.compile_s = time.perf_counter() - start
        self.runner = StepRunner(model, device, precision, capacity=capacity or max_batch, compile=compile)
        if compile:
            self.compile_s += warm_up(self.runner, max_batch, progress)
        self._ring = None  # without CUDA every step is synchronous
        if device.type == "cuda":
            self._ring = [_Staging(max_batch, self.runner.num_features) for _ in range(RING)]
        use_graphs = device.type == "cuda" if graphs is None else graphs
        self.graphed = None
        if use_graphs:
            buckets = [b for b in BUCKETS if b < max_batch] + [max_batch]
            self.graphed = GraphedStep(self.runner, buckets, progress=_progress("capturing graphs") if progress else None,
                                       staging=[(st.inputs, st.out) for st in self._ring or ()])
            self.graphed.capture()
        self._next = 0
        self.startup_s = time.perf_counter() - start
        if progress:
            compiled = "" if self.compile_s is None else f", compiled in {self.compile_s:.1f} s"
            sys.stderr.write(f"[fast engine] ready on {device} in {self.startup_s:.1f} s{compiled}; precision "
                             f"{describe_precision(self.runner.precision)}\n")

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
                "capacity": self.runner.table.capacity, "max_batch": self.max_batch,
                "compile": self.runner.compiled, "compile_s": self.compile_s, "startup_s": self.startup_s}

    def slots_for(self, symbols) -> torch.Tensor:
        return torch.tensor(self._slot_list(symbols), dtype=torch.int32).to(self.device, non_blocking=True)

    def _slot_list(self, symbols) -> list[int]:
        slots = self.runner.table.slots_for(symbols)
        if self.graphed is not None and self.graphed.version != self.runner.table.version:
            # The table grew, so the next replay captures the graphs again, freeing the old graphs and their
            # outputs; and a capture fails if another thread makes CUDA calls meanwhile (the runtime's
            # completer waiting on an event). So first finish every step in flight and copy its result out.
            self._drain()
        return slots

    def _drain(self):
        for staging in self._ring or ():
            if staging.step is not None:
                staging.step.result()

    @torch.no_grad()
    def step_slots(self, slot_ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """Predictions [B, 4] on the device; valid until the next call (graph outputs are reused)."""
        if self.graphed is not None:
            return self.graphed(slot_ids, features)
        return self.runner(slot_ids, features)

    def step(self, symbols, features):
        return self.submit(symbols, features).result()

    @torch.no_grad()
    def submit(self, symbols, features) -> PendingStep:
        """Enqueue a step on the current CUDA stream and return at once; result() waits for its predictions.

        Without CUDA, and for batches larger than max_batch, the step runs synchronously. Not thread-safe:
        submit (and step) from one thread; result() may be called from another.
        """
        symbols = list(symbols)
        features = check_step_inputs(symbols, features)
        if self._ring is None or not symbols or len(symbols) > self.max_batch:
            return PendingStep.completed(self._step_now(symbols, features))
        batch = len(symbols)
        index, staging = self._next, self._ring[self._next]
        self._next = (self._next + 1) % len(self._ring)
        if staging.step is not None:
            # Its previous step may still be reading these inputs, or its result not yet be copied out of
            # `out`: finish it (its PendingStep keeps the copy for whoever collects it later).
            staging.step.result()
        staging.slots[:batch] = self._slot_list(symbols)
        staging.slots[batch:] = PAD_SLOT
        staging.features[:batch] = features
        if self.graphed is not None:
            self.graphed.replay_staged(index, batch)  # copies in, step, predictions out: one launch
        else:
            slot_ids = torch.from_numpy(staging.slots[:batch]).to(self.device, non_blocking=True)
            out = self.runner(slot_ids, torch.from_numpy(staging.features[:batch]).to(self.device, non_blocking=True))
            staging.out[:batch].copy_(out, non_blocking=True)
        staging.done.record(torch.cuda.current_stream(self.device))
        staging.step = PendingStep(lambda: staging.read_back(batch))
        return staging.step

    def _step_now(self, symbols, features):
        if not symbols:
            return np.zeros((0, NUM_TOWERS), dtype=np.float32)
        out = np.empty((len(symbols), NUM_TOWERS), dtype=np.float32)
        for start in range(0, len(symbols), self.max_batch):  # larger steps run as several buckets
            chunk = symbols[start:start + self.max_batch]
            slots = self.slots_for(chunk)
            feats = torch.from_numpy(features[start:start + len(chunk)]).to(self.device, non_blocking=True)
            out[start:start + len(chunk)] = self.step_slots(slots, feats).cpu().numpy()
        return out
