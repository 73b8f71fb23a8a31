"""The fp32 reference engine: per-symbol batch-1 states, stacked into one batched forward per round of a step
(round j: the j-th request of every symbol in the step, so a symbol's requests advance its state in order).

The states live in a bounded table (client/engine/symbol_states.py) with the fast engine's limits: capacity on
the device (state_slots, or a share of free memory), a host tier, idle expiry."""
import sys

import numpy as np
import torch

from client.engine.base import (NUM_TOWERS, Engine, PendingStep, Sequences, check_step_inputs, state_data,
                                state_symbol, symbol_list)
from client.engine.precision import fp32_products
from client.engine.symbol_states import SymbolStates
from client.model.state import split_state, stack_states


class ReferenceEngine(Engine):
    name = "reference"

    def __init__(self, model, device=None, *, capacity=None, state_memory=None, host_symbols=None,
                 idle_timeout_s=None, progress=False):
        """capacity (symbols on the device) or state_memory (by the fast engine's rules: a share of the free GPU
        memory, or of the available host memory on a CPU, STATE_MEMORY by default, at most CPU_CAPACITY symbols on
        a CPU); host_symbols: states that may wait in host memory when the device's table is full (default none:
        on a CPU it is the same memory); idle_timeout_s: forget a symbol idle this long (default never)."""
        if device is None:
            device = next(model.parameters()).device
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        if capacity is not None and state_memory is not None:
            raise ValueError("give the state table's capacity or its memory share, not both")
        # a symbol's state components in the model's order: (name, shape without the batch, dtype)
        initial = model.init_state(1, device="meta")
        self._components = [(name, tuple(t.shape[1:]), t.dtype) for name, t in initial.items()]
        self.state_bytes = sum(t.numel() * t.element_size() for t in initial.values())
        if capacity is None:
            capacity = self._capacity_for_memory(state_memory)
        if host_symbols is None:
            host_symbols = 0
        self._states = SymbolStates(self.device, capacity, host_symbols, idle_timeout_s)
        if progress:
            expiry = "never" if idle_timeout_s is None else f"after {idle_timeout_s:g} s idle"
            sys.stderr.write(f"[reference engine] state table: {capacity} symbols on {self.device} "
                             f"({self.state_bytes / 2**20:.2f} MiB each), {host_symbols} in host memory; "
                             f"idle symbols forgotten: {expiry}\n")

    def _capacity_for_memory(self, share) -> int:
        """Symbols that `share` of the device's memory holds, as the fast engine counts them: its capacity_for_memory
        on a GPU; on a CPU the same share of the available host memory, at most CPU_CAPACITY."""
        from client.engine.fast.state_table import CPU_CAPACITY, STATE_MEMORY, capacity_for_memory, host_memory

        share = STATE_MEMORY if share is None else share
        if self.device.type == "cuda":
            return capacity_for_memory(self.state_bytes, share, self.device)
        if not 0 < share <= 0.95:
            raise ValueError(f"--state-memory must be a share in (0, 0.95], got {share}")
        available = host_memory()[1]
        if not available:  # a host that says nothing of its memory (no /proc, no sysconf)
            return CPU_CAPACITY
        return max(1, min(CPU_CAPACITY, int(share * available) // self.state_bytes))

    @property
    def symbols(self) -> list[str]:
        return list(self._states)

    def release(self, symbols) -> None:
        for symbol in symbol_list(symbols):
            self._states.pop(symbol, None)

    def expired(self) -> list[str]:
        return self._states.take_expired()

    def unplaceable(self, symbols) -> dict[str, str]:
        """{symbol: why} for the symbols of a step that the state table cannot hold (no side effects)."""
        # a lone string, iterated, was a symbol per character: "AAPL" held, and A, P and L said to have no room
        rejected = self._states.unplaceable(symbol_list(symbols), at_once=False)
        return dict.fromkeys(rejected, str(self._states.capacity_error(rejected))) if rejected else {}

    def describe(self) -> dict:
        return {"engine": self.name, "device": str(self.device), "symbols": len(self._states),
                "state_bytes_per_symbol": self.state_bytes, "capacity": self._states.capacity,
                "host_symbols": self._states.host_capacity, "idle_timeout_s": self._states.idle_timeout_s}

    def state_layout(self) -> dict:
        return {"engine": self.name, "bytes": self.state_bytes,
                "components": [[name, list(shape), str(dtype).removeprefix("torch.")]
                               for name, shape, dtype in self._components]}

    def export_state(self, symbol) -> PendingStep:
        """The components' bytes in the model's order (steps are synchronous: the state as it stands)."""
        state = self._states.held(state_symbol(symbol))
        if state is None:
            return PendingStep.completed(None)
        return PendingStep.completed(np.concatenate([state[name].detach().cpu().contiguous().view(torch.uint8)
                                                     .reshape(-1).numpy() for name, _, _ in self._components]))

    def import_state(self, symbol, data) -> None:
        data = state_data(data, self.state_bytes)
        self._states.place([state_symbol(symbol)])  # room as a step makes it (CapacityError changing nothing)
        state, start = {}, 0
        for name, shape, dtype in self._components:
            size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            state[name] = (torch.from_numpy(data[start:start + size].copy()).view(dtype).reshape(1, *shape)
                           .to(self.device))
            start += size
        self._states[symbol] = state

    def step(self, symbols, features):
        symbols = symbol_list(symbols)
        features = check_step_inputs(symbols, features)
        rejected = self._states.unplaceable(symbols, at_once=False)
        if rejected:
            raise self._states.capacity_error(rejected)
        out = np.empty((len(symbols), NUM_TOWERS), dtype=np.float32)
        # More symbols than the device holds run in groups that fit it, each placed in turn (the host tier takes
        # the others' states meanwhile)
        distinct = list(dict.fromkeys(symbols))
        for first in range(0, len(distinct), self._states.capacity):
            group = set(distinct[first:first + self._states.capacity])
            rows = np.flatnonzero([symbol in group for symbol in symbols])
            out[rows] = self._step_group([symbols[i] for i in rows], features[rows], keep=distinct)
        return out

    def _step_group(self, symbols, features, keep):
        """step's predictions for the rows of at most `capacity` symbols; keep: the step's symbols, none of which
        an earlier group's placement may forget as idle (the later groups' would then start from a fresh state)."""
        self._states.place(symbols, keep)  # every symbol resident, with room for the new ones (or CapacityError)
        states = {}  # the states as the step advances them, stored only after every round succeeded
        out = np.empty((len(symbols), NUM_TOWERS), dtype=np.float32)
        for rows in Sequences(symbols).rounds():
            batch = [symbols[i] for i in rows]
            before = [states.get(s) or self._states.get(s) or self.model.init_state(1, device=self.device)
                      for s in batch]
            with torch.no_grad(), fp32_products():  # fp32 whatever the process set (a team module's TF32)
                predictions, after = self.model(torch.from_numpy(features[rows]).to(self.device),
                                                stack_states(before))
            states.update(zip(batch, split_state(after)))
            out[rows] = predictions.detach().to("cpu", torch.float32).numpy()
        self._states.update(states)
        return out
