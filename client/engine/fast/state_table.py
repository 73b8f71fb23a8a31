"""Where state lives: a table allocated once, one contiguous block of bytes per slot, and a host tier behind it.

Each slot's block holds every state component of one symbol (components are strided views with the slot as
their leading dimension), so moving a symbol's state is one copy. Slot 0 is the padding slot: padding rows
write there and never in a live slot. The table never grows, so CUDA graphs that index it by slot stay valid.
A table may span several devices (towers placed on several GPUs): each device holds its part of every slot,
and a symbol has the same slot on all of them.

Tiers: a symbol holds a GPU slot while it is used; when no free slot is left, the least recently used
symbol's state moves to host memory (copied on a side stream, ordered after every step already enqueued) and
its slot goes to the newcomer. A symbol that comes back has its state copied back, byte for byte, before its
step runs. A symbol idle for `idle_timeout_s` is forgotten (a later request starts a fresh state, as a new
symbol would). A symbol that fits in no tier gets a CapacityError naming the limits, and nothing else changes.
"""
import time
from collections import OrderedDict, deque

import torch

PAD_SLOT = 0
ALIGN = 256  # bytes: every component starts at a multiple of this within a slot (vector loads, any dtype)


class CapacityError(RuntimeError):
    """Symbols that fit in no tier of the state table; `symbols` lists them."""

    def __init__(self, message, symbols):
        super().__init__(message)
        self.symbols = list(symbols)


def _numel(shape):
    numel = 1
    for extent in shape:
        numel *= extent
    return numel


def slot_layout(layout):
    """({name: byte offset}, bytes per slot) for layout {name: (shape, dtype, init)}."""
    offsets, size = {}, 0
    for name, (shape, dtype, _) in layout.items():
        offsets[name] = size
        size += -(-_numel(shape) * dtype.itemsize // ALIGN) * ALIGN
    return offsets, size


def capacity_for_memory(slot_bytes, share, device) -> int:
    """Live slots that `share` of the device's free memory holds (the padding slot counted)."""
    if not 0 < share <= 0.95:
        raise ValueError(f"--state-memory must be a share of free GPU memory in (0, 0.95], got {share}")
    free, _ = torch.cuda.mem_get_info(device)
    slots = int(share * free) // slot_bytes - 1
    if slots < 1:
        raise ValueError(f"{share:.0%} of the {free / 2**30:.1f} GiB free on {device} holds no symbol's state "
                         f"({slot_bytes / 2**20:.1f} MiB each); raise --state-memory or free GPU memory")
    return slots


class _Part:
    """One device's share of every slot: the bytes, the component views, and a side stream for copies.

    Packed (the default), a slot's components lie in one block of bytes, moved with one copy. Separate, each
    component has its own buffer (torch.compile's functionalization does not take in-place updates of inputs
    that are views of one storage), and moving a slot is one copy per component."""

    def __init__(self, layout, device, slots, separate=False):
        self.layout, self.device = dict(layout), torch.device(device)
        self.offsets, self.slot_bytes = slot_layout(self.layout)
        # chunks: (buffer [slots, bytes], first byte within the slot's block)
        if separate:
            ends = [*sorted(self.offsets.values())[1:], self.slot_bytes]
            self.chunks = [(torch.empty(slots, end - start, dtype=torch.uint8, device=self.device), start)
                           for start, end in zip(sorted(self.offsets.values()), ends)]
        else:
            self.chunks = [(torch.empty(slots, self.slot_bytes, dtype=torch.uint8, device=self.device), 0)]
        self.initial = torch.zeros(1, self.slot_bytes, dtype=torch.uint8, device=self.device)
        for name, (_, _, init) in self.layout.items():
            self._view(self.initial, 0, name).fill_(init)
        self.tensors = {}
        for name, start in self.offsets.items():
            buffer, chunk_start = next(chunk for chunk in reversed(self.chunks) if chunk[1] <= start)
            self.tensors[name] = self._view(buffer, chunk_start, name)
        for buffer, start in self.chunks:
            buffer.copy_(self._initial(start, buffer).expand_as(buffer))
        cuda = self.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(self.device) if cuda else None
        self.pending: dict[int, torch.cuda.Event] = {}  # slot -> its last copy's completion

    def _view(self, block, block_start, name):
        shape, dtype, _ = self.layout[name]
        start = self.offsets[name] - block_start
        return block[:, start:start + _numel(shape) * dtype.itemsize].view(dtype).view(block.shape[0], *shape)

    def _initial(self, start, buffer):
        return self.initial[:, start:start + buffer.shape[1]]

    def new_host_buffer(self):
        return torch.empty(self.slot_bytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda")

    def copy(self, slot, copies):
        """Run `copies` (touching `slot`) after every step enqueued so far on this device; note when done."""
        if self.copy_stream is None:
            copies()
            return
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_stream):  # one stream: copies touching one slot stay in order
            copies()
        event = torch.cuda.Event()
        event.record(self.copy_stream)
        self.pending[slot] = event

    def offload(self, slot, host):
        def copies():
            for buffer, start in self.chunks:
                host[start:start + buffer.shape[1]].copy_(buffer[slot], non_blocking=True)
                buffer[slot:slot + 1].copy_(self._initial(start, buffer))  # ready for a new symbol

        self.copy(slot, copies)

    def restore(self, slot, host):
        def copies():
            for buffer, start in self.chunks:
                buffer[slot].copy_(host[start:start + buffer.shape[1]], non_blocking=True)

        self.copy(slot, copies)

    def reset(self, slot):
        def copies():
            for buffer, start in self.chunks:
                buffer[slot:slot + 1].copy_(self._initial(start, buffer))

        self.copy(slot, copies)

    def wait_for(self, slot):
        """Make the device's current stream wait for the slot's pending copies (if any)."""
        event = self.pending.pop(slot, None)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
        return event


class StateTable:
    def __init__(self, parts, capacity: int, *, host_capacity: int = 0, idle_timeout_s=None, reserve: int = 0,
                 separate=False, clock=time.monotonic):
        """parts: [(layout {name: (per-slot shape, dtype, initial value)}, device)], one per device (a single
        (layout, device) pair is one part); capacity: live GPU slots; host_capacity: symbols whose state may
        wait in host memory; reserve: free slots kept ready by moving least recently used states to the host
        ahead of need, so that a new symbol's step does not wait for that copy; separate: a buffer per component
        (for torch.compile) instead of one block per slot."""
        if isinstance(parts, tuple) and len(parts) == 2 and isinstance(parts[0], dict):
            parts = [parts]
        if capacity < 1 or host_capacity < 0 or reserve < 0:
            raise ValueError(f"need capacity >= 1, host_capacity >= 0 and reserve >= 0, got {capacity}, "
                             f"{host_capacity}, {reserve}")
        if idle_timeout_s is not None and not idle_timeout_s > 0:
            raise ValueError(f"idle_timeout_s must be positive (or None: never), got {idle_timeout_s}")
        self.parts = [_Part(layout, device, capacity + 1, separate) for layout, device in parts]
        self.host_capacity, self.idle_timeout_s, self.reserve, self.clock = host_capacity, idle_timeout_s, reserve, clock
        self.resident: OrderedDict[str, int] = OrderedDict()  # symbol -> slot, least recently used first
        self.offloaded: dict[str, list[torch.Tensor]] = {}     # symbol -> its state in host memory, per part
        self.last_seen: dict[str, float] = {}
        self.free = deque(range(1, capacity + 1))
        self._host_pool: list[tuple[list[torch.Tensor], list]] = []  # reusable host buffers, with their reads
        self.stats = {"offloaded": 0, "restored": 0, "expired": 0, "released": 0}

    # ---- sizes and views --------------------------------------------------------------------------
    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """Every component's view (the first part's, for a single-device table)."""
        return {name: view for part in self.parts for name, view in part.tensors.items()}

    @property
    def capacity(self) -> int:
        return self.parts[0].chunks[0][0].shape[0] - 1

    @property
    def bytes_per_slot(self) -> int:
        """Bytes of state one symbol holds (the components, without alignment padding)."""
        return sum(t[0].numel() * t.element_size() for t in self.tensors.values())

    @property
    def slot_of(self) -> dict[str, int]:
        return dict(self.resident)

    def symbols(self) -> list[str]:
        """Every symbol with a state, on the GPU or in host memory."""
        return [*self.resident, *self.offloaded]

    # ---- placing symbols --------------------------------------------------------------------------
    def unplaceable(self, symbols) -> list[str]:
        """The symbols of one step that fit in no tier (no side effects; idle symbols count as gone)."""
        batch = list(dict.fromkeys(symbols))
        if len(batch) > self.capacity:
            return batch[self.capacity:]
        new = [s for s in batch if s not in self.resident and s not in self.offloaded]
        room = self.capacity + self.host_capacity - len(self.resident) - len(self.offloaded)
        room += len(self._expired(self.clock(), exclude=set(batch)))
        return new[max(room, 0):]

    def slots_for(self, symbols) -> list[int]:
        """The GPU slot of each symbol of one step (distinct symbols), placing the ones not resident: a new
        symbol gets a slot holding the initial state, an offloaded one its own state back. Copies run on a side
        stream; each device's current stream waits for them, so the next step enqueued sees them done."""
        symbols = list(symbols)
        rejected = self.unplaceable(symbols)
        if rejected:
            raise self.capacity_error(rejected)
        now = self.clock()
        batch = set(symbols)
        for symbol in self._expired(now, exclude=batch):
            self._forget(symbol)
            self.stats["expired"] += 1
        for symbol in symbols:
            if symbol not in self.resident:
                slot = self._take_slot(exclude=batch)
                if symbol in self.offloaded:
                    self._restore(symbol, slot)
                self.resident[symbol] = slot
            self.resident.move_to_end(symbol)
            self.last_seen[symbol] = now
            for part in self.parts:
                part.wait_for(self.resident[symbol])
        self._keep_reserve(exclude=batch)
        return [self.resident[s] for s in symbols]

    def capacity_error(self, rejected) -> CapacityError:
        """The error that names the limits for symbols that fit in no tier."""
        return CapacityError(
            f"no room for the state of {len(rejected)} symbol(s) ({', '.join(rejected[:5])}"
            f"{', ...' if len(rejected) > 5 else ''}): {self.capacity} on the GPU and {self.host_capacity} in "
            f"host memory are all in use; raise --state-memory or --host-symbols, or let idle symbols "
            f"expire (--idle-timeout)", rejected)

    def release(self, symbols) -> None:
        """Forget these symbols' states (they left); unknown symbols are ignored."""
        for symbol in symbols:
            if symbol in self.resident or symbol in self.offloaded:
                self._forget(symbol)
                self.stats["released"] += 1

    # ---- internals --------------------------------------------------------------------------------
    def _expired(self, now, exclude):
        if self.idle_timeout_s is None:
            return []
        return [s for s, seen in self.last_seen.items() if now - seen > self.idle_timeout_s and s not in exclude]

    def _forget(self, symbol):
        self.last_seen.pop(symbol, None)
        if symbol in self.resident:
            slot = self.resident.pop(symbol)
            for part in self.parts:
                part.reset(slot)
            self.free.append(slot)
        else:
            self._host_pool.append((self.offloaded.pop(symbol), []))

    def _take_slot(self, exclude) -> int:
        if not self.free:
            self._offload_lru(exclude)
        return self.free.popleft()

    def _offload_lru(self, exclude):
        """Move the least recently used resident symbol outside `exclude` to host memory; free its slot."""
        symbol = next(s for s in self.resident if s not in exclude)
        slot = self.resident.pop(symbol)
        hosts = self._host_buffers()
        for part, host in zip(self.parts, hosts):
            part.offload(slot, host)
        self.offloaded[symbol] = hosts
        self.free.append(slot)
        self.stats["offloaded"] += 1

    def _restore(self, symbol, slot):
        hosts = self.offloaded.pop(symbol)
        for part, host in zip(self.parts, hosts):
            part.restore(slot, host)
        self._host_pool.append((hosts, [part.pending.get(slot) for part in self.parts]))
        self.stats["restored"] += 1

    def _keep_reserve(self, exclude):
        while (len(self.free) < self.reserve and len(self.offloaded) < self.host_capacity
               and any(s not in exclude for s in self.resident)):
            self._offload_lru(exclude)

    def _host_buffers(self) -> list[torch.Tensor]:
        if self._host_pool:
            buffers, reads = self._host_pool.pop()
            for event in reads:
                if event is not None:
                    event.synchronize()  # its copy back to the GPU may still read it (rare: copies are quick)
            return buffers
        return [part.new_host_buffer() for part in self.parts]
