"""Where state lives: one preallocated tensor per state component, with a slot dimension.

A symbol owns a slot for its life. Slot 0 is reserved for padding rows: whatever they write lands there and
never in a live slot. Capacity grows (outside any graph) when new symbols arrive; `version` counts the
reallocations so that captured graphs know to be captured again.
"""
import torch

PAD_SLOT = 0


class StateTable:
    def __init__(self, layout, capacity: int, device):
        """layout: {name: (per-slot shape, dtype, initial value)}; capacity: live slots (plus the pad slot)."""
        self.layout = dict(layout)
        self.device = torch.device(device)
        self.slot_of: dict[str, int] = {}
        self.version = 0
        self.tensors = self._allocate(capacity + 1)

    @property
    def capacity(self) -> int:
        return next(iter(self.tensors.values())).shape[0] - 1

    @property
    def bytes_per_slot(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self.tensors.values())

    def _allocate(self, slots):
        tensors = {}
        for name, (shape, dtype, init) in self.layout.items():
            tensors[name] = torch.full((slots, *shape), init, dtype=dtype, device=self.device)
        return tensors

    def _grow(self, needed):
        slots = max(needed, 2 * self.capacity) + 1
        grown = self._allocate(slots)
        for name, old in self.tensors.items():
            grown[name][: old.shape[0]].copy_(old)
        self.tensors = grown
        self.version += 1

    def slots_for(self, symbols) -> list[int]:
        """The slot of each symbol; a new symbol gets a fresh slot, which holds its initial state already: slots
        are allocated (and grown) filled with it, and nothing writes a slot before it is given out (padding rows
        write the padding slot). Filling it again would cost a launch per state tensor (~240 in the full preset,
        ~2.5 ms of host time on a symbol's first request; bench/LOG.md section 27)."""
        new = [s for s in dict.fromkeys(symbols) if s not in self.slot_of]
        if new:
            needed = len(self.slot_of) + len(new)
            if needed > self.capacity:
                self._grow(needed)
            for symbol in new:
                self.slot_of[symbol] = len(self.slot_of) + 1  # never freed: a symbol's state is its memory
        return [self.slot_of[s] for s in symbols]
