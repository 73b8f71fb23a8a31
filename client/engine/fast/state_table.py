"""Where state lives: a table allocated once, one contiguous block of bytes per slot, and a host tier behind it.

Each slot's block holds every state component of one symbol (components are strided views with the slot as
their leading dimension), so moving a symbol's state is one copy. Slot 0 is the padding slot: padding rows
write there and never in a live slot. The table never grows, so CUDA graphs that index it by slot stay valid.
A table may span several devices (towers placed on several GPUs): each device holds its part of every slot,
and a symbol has the same slot on all of them.

Tiers: a symbol holds a GPU slot while it is used; the least recently used symbols' states move to host memory
to keep `reserve` slots free ahead of need, or when a symbol needs a slot and none is free. The host tier is
allocated once, at start, and on a GPU pinned in a background thread, in pieces of PIECE_BYTES, so that no step
allocates or pins memory; each slot joins the tier once pinned. Pinning runs at ~2.4 GB/s (page faults;
bench/LOG.md section 46: ~50-60 s for the H100 host's 116 GiB), so the engine serves meanwhile (pausing it only
while it captures its graphs); until it is done, a step that must move a state out of a full GPU while no pinned
host slot is spare (one stays free for a state's return) waits for the next one (the tier's size never changes, so
no symbol is refused for it).

States move on two copy streams per device (to the host, and back to the GPU), in copies within the pieces, each
waiting only for what it touches: the steps enqueued before it (for a state leaving the GPU), the last copy of its
GPU slot and of its host slot. A step waits only for the copies of its own symbols' slots.

Returns start early: `prefetch(symbols)` (called when a request ARRIVES, from any thread) places the symbols,
starting the copy back for those in host memory (and giving new ones a free slot); `ready(symbol)` says whether a
symbol's state is on the GPU with its copies done, so that a scheduler can hold back a symbol still in flight
while the others step. A step for a symbol whose copy is not done (no prefetch, or too late) is still correct:
its stream waits for that copy. Without CUDA the copies run on a thread standing in for each copy stream (its
completions are futures), so the CPU runs the same ordering as the GPU.

A symbol's state is exported (export) without moving it: from its GPU slot through a staging buffer, copied on the
step stream, then to pinned memory in pieces and into an array of its own on the table's export thread; from its
host slot on that thread, a read that later copies into that host slot wait for. import writes a slot placed by
slots_for (write).

A symbol idle for `idle_timeout_s` is forgotten (a later request starts a fresh state, as a new symbol would). A
symbol that fits in no tier gets a CapacityError naming the limits, and nothing else changes.

Thread safety: one lock guards the table's bookkeeping; slots_for, unplaceable and release come from the thread
that steps, prefetch and ready from any thread. The symbols of the last slots_for stay on the GPU until the next
slots_for (by then their step is enqueued, or done on the CPU), so a prefetch from another thread never moves a
state that a step being enqueued uses.
"""
import atexit
import contextlib
import ctypes
import mmap
import os
import queue
import sys
import threading
import time
import weakref
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from client.engine.base import CapacityError, PendingStep, idle_symbols, is_count
from client.engine.cuda_streams import copy_pieces, own_stream

PAD_SLOT = 0
# The state table's default share of free GPU memory; the host tier's default is the available host memory less a
# headroom (host_tier_budget). README "Symbols at scale" states the rule and what it gives.
STATE_MEMORY = 0.8
CPU_CAPACITY = 1024  # without a GPU the table lives in host memory: a modest default
ALIGN = 256  # bytes: every component starts at a multiple of this within a slot (vector loads, any dtype)
# The default host tier takes the available host memory less this headroom, left to the process's own growth, a
# scoring server on the same machine and the system: the larger of a fixed amount and a share of the host's memory.
HOST_HEADROOM_BYTES = 4 << 30
# 15% of the host's memory is left to everything else: with 5% (6 GiB of 128 GB) both the client's and the scoring
# server's processes stalled for up to 30 ms at times, the swap section's tails; with 15% on the same host, no stall
# and 1,088 symbols held (bench/LOG.md section 48)
HOST_HEADROOM_SHARE = 0.15
# Host slots are registered with CUDA in pieces of this size, and states move in copies within them (a copy may not
# span two registrations): a registration holds up the GPU's launches while it runs (a whole 146 MiB slot: up to
# ~50 ms a launch, ~0.5 s with 8 threads queued; bench/LOG.md section 46), and a copy queued behind a move on a copy
# engine waits for at most one piece, not a whole state (~3 ms). A step's own inputs and predictions go by kernel
# (kernels/copy_words.py), beside the engines.
PIECE_BYTES = 8 << 20
# Stopping the pinning at exit waits this long at most for the piece under way (it takes milliseconds)
PIN_STOP_TIMEOUT_S = 10.0
MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault a range in at once (Python's mmap module names it from 3.13 only)
try:
    _LIBC = ctypes.CDLL(None, use_errno=True)  # a CDLL's calls release the GIL
except OSError:  # no C library to open by name (Windows): host slots are faulted in page by page instead
    _LIBC = None
if hasattr(_LIBC, "madvise"):
    _LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


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


# ---- host memory -----------------------------------------------------------------------------------
def _read(path) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _cgroup_memory() -> tuple[int, int] | None:
    """(limit, bytes still free under it) of this process's memory cgroup (v2, else v1), or None without a
    limit. Reclaimable page cache (inactive files) counts as free, as in MemAvailable."""
    for root, limit_file, usage_file, inactive_key in (("/sys/fs/cgroup", "memory.max", "memory.current",
                                                        "inactive_file"),
                                                       ("/sys/fs/cgroup/memory", "memory.limit_in_bytes",
                                                        "memory.usage_in_bytes", "total_inactive_file")):
        limit, usage = _read(f"{root}/{limit_file}"), _read(f"{root}/{usage_file}")
        if limit is None or usage is None:
            continue
        if limit.strip() == "max" or int(limit) >= 1 << 60:  # v1 says "no limit" with a huge number
            return None
        stat = dict(line.split() for line in (_read(f"{root}/memory.stat") or "").splitlines() if line.count(" ") == 1)
        return int(limit), max(int(limit) - int(usage) + int(stat.get(inactive_key, 0)), 0)
    return None


def _sysconf_bytes(pages_name) -> int:
    """sysconf's count of pages `pages_name` in bytes; 0 where the system does not say it."""
    try:
        return os.sysconf(pages_name) * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows), or not that name (macOS's available)
        return 0


def host_memory() -> tuple[int, int]:
    """(total, available) bytes of host memory for this process: /proc/meminfo's MemTotal and MemAvailable
    (sysconf where there is none), within the memory cgroup's limit."""
    info = {}
    for line in (_read("/proc/meminfo") or "").splitlines():
        key, _, value = line.partition(":")
        fields = value.split()
        if len(fields) == 2 and fields[1] == "kB":
            info[key] = int(fields[0]) * 1024
    total = info.get("MemTotal") or _sysconf_bytes("SC_PHYS_PAGES")
    # macOS says no available pages: its total then (a CPU table is capped at CPU_CAPACITY anyway)
    available = info.get("MemAvailable") or _sysconf_bytes("SC_AVPHYS_PAGES") or total
    cgroup = _cgroup_memory()
    if cgroup is not None:
        total, available = min(total, cgroup[0]), min(available, cgroup[1])
    return total, available


def host_tier_budget() -> int:
    """Bytes the host tier may take: the available host memory less the headroom (HOST_HEADROOM_BYTES, or
    HOST_HEADROOM_SHARE of the host's memory where that is more)."""
    total, available = host_memory()
    return max(available - max(HOST_HEADROOM_BYTES, int(HOST_HEADROOM_SHARE * total)), 0)


def host_slot_bytes(slot_bytes) -> int:
    """A host slot's stride: whole pages, so that each slot is pinned on its own."""
    return -(-slot_bytes // mmap.PAGESIZE) * mmap.PAGESIZE


def host_symbols_for(budget_bytes, slot_bytes) -> int:
    """Symbols a host tier of `budget_bytes` holds; slot_bytes: a symbol's bytes on each device (one host slot
    is kept spare for swaps)."""
    return max(budget_bytes // sum(host_slot_bytes(size) for size in slot_bytes) - 1, 0)


# ---- copies ------------------------------------------------------------------------------------------
_COPY_THREADS: dict = {}  # the CPU's copy threads alive: their queue -> the thread


def _run_copies(tasks):
    """The CPU's copy thread: each task after the completions it waits for, in order, until None. It keeps nothing
    of a finished task while it waits for the next: the last copy's closure holds its table's tensors, and the
    queue's end comes when the table is collected."""
    while (task := tasks.get()) is not None:
        _run_copy(*task)
        del task
    _COPY_THREADS.pop(tasks, None)


def _run_copy(copies, waits, done):
    try:
        for completion in waits:
            completion.result()
        copies()
    except BaseException as exc:  # noqa: BLE001 (handed to whoever waits for this copy)
        done.set_exception(exc)
    else:
        done.set_result(None)


@atexit.register
def _finish_copy_threads():
    """At exit, each CPU copy thread finishes its queue and ends: a daemon thread stopped by the interpreter's
    shutdown in the middle of a torch op aborts the process ("terminate called without an active exception")."""
    threads = list(_COPY_THREADS.items())
    for tasks, _ in threads:
        tasks.put(None)
    for _, thread in threads:
        thread.join()


_PINNING: "weakref.WeakSet[StateTable]" = weakref.WeakSet()  # the tables whose host tier pins in a thread


@atexit.register
def _stop_pinning():
    """At exit, each table's pinning stops between two registrations: a daemon thread stopped by the interpreter's
    shutdown as a registration returns (cudaHostRegister, the GIL released) aborts the process ("terminate called
    without an active exception"), as a run that ended before its host tier was pinned did."""
    for table in list(_PINNING):
        table.stop_pinning()


def _pin_host_tier(table_ref, device):
    """The pinning thread: the host tier slot by slot (registrations hold up the GPU's launches: one at a time,
    short), paused while the table's _pin_go is clear. It holds its table only while a slot pins, so that a table
    dropped before its tier is pinned (up to a minute) is collected, its host memory unregistered and unmapped, and
    the thread ends. It registers on the table's GPU: a thread starts on GPU 0, where a registration would make a
    CUDA context for a table on another GPU."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    began, index = time.perf_counter(), 0
    while (table := table_ref()) is not None:
        try:
            pinning_on = index < table._host_slots and table._pin_slot(index)
        except Exception as exc:  # noqa: BLE001 (the tier keeps what was pinned; wait_pinned raises it)
            table._pin_error, pinning_on = exc, False
        if not pinning_on:
            table._pinned(began)
            return
        del table
        index += 1


class _CopyQueue:
    """Copies run in order, each after the completions it waits for: a CUDA stream on a GPU (completions are
    events), a thread on the CPU (completions are futures)."""

    def __init__(self, device):
        self.device = device
        self.stream = own_stream(device) if device.type == "cuda" else None
        self._tasks = None  # the CPU thread's queue, started on first use

    def enqueue(self, copies, waits, after=None):
        """Run copies() after `waits` and, on a GPU, after the work enqueued so far on stream `after`; return
        its completion."""
        waits = [w for w in waits if w is not None]
        if self.stream is None:
            if self._tasks is None:
                self._tasks = queue.SimpleQueue()
                thread = threading.Thread(target=_run_copies, args=(self._tasks,), name="state-copies", daemon=True)
                _COPY_THREADS[self._tasks] = thread
                thread.start()
                weakref.finalize(self, self._tasks.put, None)  # the thread ends with its queue
            done = Future()
            self._tasks.put((copies, waits, done))
            return done
        with torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_stream(after)
            for completion in waits:
                if isinstance(completion, Future):  # a host slot's read (StateTable.export) ends before it is copied
                    completion.result()
                else:
                    self.stream.wait_event(completion)
            copies()
            done = torch.cuda.Event()
            done.record(self.stream)
        return done


def _piece_bounds(start, size):
    """[(begin, end)] splitting `size` bytes that lie from byte `start` of a slot where its host registrations
    split (multiples of PIECE_BYTES from the slot's start)."""
    bounds, begin = [], 0
    while begin < size:
        end = min(size, (start + begin) // PIECE_BYTES * PIECE_BYTES + PIECE_BYTES - start)
        bounds.append((begin, end))
        begin = end
    return bounds


def _copy_in_pieces(dst, src, start):
    """dst[:] = src (one-dimensional bytes, host and device; byte 0 at byte `start` of its slot), enqueued as
    copies within the slot's host registrations (a copy may not span two)."""
    copy_pieces(dst, src, _piece_bounds(start, dst.shape[0]))


def _done(completion) -> bool:
    if completion is None:
        return True
    return completion.done() if isinstance(completion, Future) else completion.query()


class _HostPool:
    """One part's host tier: `count` slots of host memory mapped at once (page-aligned), pinned on a GPU slot by
    slot with cudaHostRegister. Not torch's pinned allocator: it rounds every allocation up to a power of two
    (256 MiB for a 146 MiB state, 128 GiB for a 95 GiB pool)."""

    def __init__(self, count, slot_bytes, pin: bool):
        self.stride = host_slot_bytes(slot_bytes)
        self.device = None  # the GPU its table's pinning thread registers it on (set by the table): unregistered there
        self.count, self.pin = count, pin and count > 0
        self.pinned = 0 if self.pin else count  # slots pinned so far (every slot counts as pinned off a GPU)
        self._registered = None  # addresses of the pieces registered so far
        if count == 0:
            self.slots = torch.empty(0, slot_bytes, dtype=torch.uint8)
            return
        self._map = mmap.mmap(-1, count * self.stride)
        if hasattr(self._map, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
            self._map.madvise(mmap.MADV_HUGEPAGE)  # fewer pages to fault in and pin
        self.slots = torch.frombuffer(self._map, dtype=torch.uint8).view(count, self.stride)[:, :slot_bytes]

    @property
    def bytes(self) -> int:
        return self.count * self.stride

    def pieces(self, index):
        """[(byte offset in the pool, bytes)] of slot `index`'s registrations: PIECE_BYTES each from the slot's
        start (the last one shorter), so that every copy piece (_copy_in_pieces) lies within one."""
        start, end = index * self.stride, (index + 1) * self.stride
        return [(offset, min(PIECE_BYTES, end - offset)) for offset in range(start, end, PIECE_BYTES)]

    def pin_piece(self, offset, nbytes):
        """Fault one piece's pages in at once, then register it with CUDA (MemoryError if that fails); every
        registered piece is unregistered when the pool is collected."""
        if self._registered is None:
            self._registered = []
            finalizer = weakref.finalize(self, _unregister, self._registered, self._map, _unregister_host,
                                         self.device)
            finalizer.atexit = False  # at exit the system takes everything back
        address = self.slots.data_ptr() + offset
        _populate(address, nbytes)
        error = _register_host(address, nbytes)
        if error is not None:
            raise MemoryError(f"pinning host slot {offset // self.stride} of {self.count} failed: {error}")
        self._registered.append(address)


def _populate(address, nbytes) -> None:
    """Fault a range of host memory in at once (MADV_POPULATE_WRITE), through libc so that the GIL is released
    meanwhile (Python's mmap.madvise holds it: ~4 ms a piece that the serving thread waited through, bench/LOG.md
    section 46). Where the kernel cannot (before Linux 5.14), registration faults the pages in itself."""
    madvise = getattr(_LIBC, "madvise", None)
    if madvise is not None:
        madvise(address, nbytes, MADV_POPULATE_WRITE)


def _pins(device) -> bool:
    """Whether the host tier of a part on `device` is pinned (page-locked, for the GPU's copy engines)."""
    return device.type == "cuda"


def _register_host(address, nbytes) -> str | None:
    """Page-lock host memory for every GPU (cudaHostRegister, portable); the error's text, None on success."""
    cudart = torch.cuda.cudart()
    error = cudart.cudaHostRegister(address, nbytes, 1)  # 1: portable, every GPU
    return None if error == cudart.cudaError.success else cudart.cudaGetErrorString(error)


def _unregister_host(address) -> None:
    torch.cuda.cudart().cudaHostUnregister(address)


def _unregister(addresses, mapping, unregister, device=None):
    # on the pool's GPU: whichever thread collects the pool may be on GPU 0, where cudaHostUnregister would make a
    # CUDA context for a pool of another GPU's table
    with torch.cuda.device(device) if device is not None and device.type == "cuda" else contextlib.nullcontext():
        for address in addresses:
            unregister(address)
    del mapping  # unmapped once every view of it is gone, after the registrations


class DeviceSlots:
    """One device's share of every slot: the bytes, the component views, its host tier, and its copy queues.

    Packed (the default), a slot's components lie in one block of bytes, moved with one copy. Separate, each
    component has its own buffer (torch.compile's functionalization does not take in-place updates of inputs
    that are views of one storage), and moving a slot is one copy per component."""

    def __init__(self, layout, device, slots, host_slots, separate=False):
        self.layout, self.device = dict(layout), torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # the current GPU, named for other threads
            self.device = torch.device("cuda", torch.cuda.current_device())
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
        self.host = _HostPool(host_slots, self.slot_bytes, pin=_pins(self.device))
        self.to_host, self.to_gpu = _CopyQueue(self.device), _CopyQueue(self.device)
        # The stream the steps run on (set by each slots_for): states leave the GPU after its work so far.
        self.step_stream = torch.cuda.current_stream(self.device) if cuda else None
        self.slot_copy = {}  # GPU slot -> completion of its last copy
        self.host_copy = {}  # host slot -> completion of its last copy (or read, StateTable.export)
        self.staging = self.staged = self.export_stream = None  # an export's GPU and pinned buffers (export)
        self.copy_times = None  # [(direction, start, end)] of every transfer, when the table times them
        self.time_origin = None  # (time.monotonic(), an event recorded then): where a GPU's marks are on that clock

    def _view(self, block, block_start, name):
        shape, dtype, _ = self.layout[name]
        start = self.offsets[name] - block_start
        return block[:, start:start + _numel(shape) * dtype.itemsize].view(dtype).view(block.shape[0], *shape)

    def _initial(self, start, buffer):
        return self.initial[:, start:start + buffer.shape[1]]

    def _mark(self, queue_):
        if self.copy_times is None:
            return None
        if queue_.stream is None:
            return time.monotonic()
        event = torch.cuda.Event(enable_timing=True)
        event.record(queue_.stream)
        return event

    def _timed(self, direction, queue_, start):
        if start is not None:
            self.copy_times.append((direction, start, self._mark(queue_)))

    def offload(self, slot, host_slot, before):
        """Copy the slot's state into the host slot, then reset the slot for a new symbol."""
        host = self.host.slots[host_slot]

        def copies():
            before()
            start = self._mark(self.to_host)
            for buffer, begin in self.chunks:
                _copy_in_pieces(host[begin:begin + buffer.shape[1]], buffer[slot], begin)
            self._timed("to_host", self.to_host, start)
            for buffer, begin in self.chunks:
                buffer[slot:slot + 1].copy_(self._initial(begin, buffer))

        done = self.to_host.enqueue(copies, [self.slot_copy.get(slot), self.host_copy.get(host_slot)],
                                    after=self.step_stream)
        self.slot_copy[slot] = self.host_copy[host_slot] = done

    def restore(self, slot, host_slot, before):
        host = self.host.slots[host_slot]

        def copies():
            before()
            start = self._mark(self.to_gpu)
            for buffer, begin in self.chunks:
                _copy_in_pieces(buffer[slot], host[begin:begin + buffer.shape[1]], begin)
            self._timed("to_gpu", self.to_gpu, start)

        done = self.to_gpu.enqueue(copies, [self.slot_copy.get(slot), self.host_copy.get(host_slot)])
        self.slot_copy[slot] = self.host_copy[host_slot] = done

    def reset(self, slot):
        def copies():
            for buffer, begin in self.chunks:
                buffer[slot:slot + 1].copy_(self._initial(begin, buffer))

        self.slot_copy[slot] = self.to_host.enqueue(copies, [self.slot_copy.get(slot)], after=self.step_stream)

    def copy_of(self, slot):
        """The slot's bytes as a numpy array of their own (on the CPU)."""
        return torch.cat([buffer[slot] for buffer, _ in self.chunks]).numpy()

    def read(self, slot, out):
        """out[:] = the slot's bytes (1-D, slot_bytes), enqueued on the current stream."""
        for buffer, begin in self.chunks:
            out[begin:begin + buffer.shape[1]].copy_(buffer[slot], non_blocking=True)

    def write(self, slot, data):
        """The slot's bytes = data (1-D uint8, slot_bytes, on the host), enqueued on the current stream."""
        for buffer, begin in self.chunks:
            buffer[slot].copy_(data[begin:begin + buffer.shape[1]].to(self.device, non_blocking=True))

    def stage(self, slot, copy, stream):
        """The slot copied into the staging buffer on `stream` (after `copy`, its pending copy, if any); the event
        recorded after it. The buffers are allocated on first use (or by ready_exports): the caller makes sure no
        export still reads them (StateTable.export)."""
        self.ready_exports()
        with torch.cuda.stream(stream):
            if copy is not None:
                stream.wait_event(copy)
            self.read(slot, self.staging)
            staged = torch.cuda.Event()
            staged.record(stream)
        return staged

    def copy_out(self, staged):
        """The staging buffer copied into pinned memory once `staged` (stage's event) is reached, in pieces of
        PIECE_BYTES on the export stream, each enqueued once the one before has ended, so that a step's answer read
        back meanwhile waits for one piece (~0.2 ms) at most: the whole state (~3 ms at ~50 GB/s), beside the next
        step, held that step's answer back ~1.2 ms (bench/LOG.md section 83). Returns when done; on the table's
        export thread."""
        with torch.cuda.device(self.device):
            self.export_stream.wait_event(staged)
            with torch.cuda.stream(self.export_stream):
                for begin in range(0, self.slot_bytes, PIECE_BYTES):
                    end = min(begin + PIECE_BYTES, self.slot_bytes)
                    self.staged[begin:end].copy_(self.staging[begin:end], non_blocking=True)
                    self.export_stream.synchronize()

    def ready_exports(self) -> None:
        """Allocate stage's buffers where a GPU's are not yet: allocated by the first export, on the thread that
        steps, they stalled play (a p99 of 23.7 ms at 400 requests/s, bench/LOG.md section 82)."""
        if self.staged is None and self.device.type == "cuda":
            # all or none: one refused (pinned host memory runs short) leaves none behind for the next try
            staging = torch.empty(self.slot_bytes, dtype=torch.uint8, device=self.device)
            staged = torch.empty(self.slot_bytes, dtype=torch.uint8, pin_memory=True)
            self.staging, self.export_stream, self.staged = staging, own_stream(self.device), staged

    def read_host(self, host_slot, reader) -> Future:
        """Host slot's bytes, read on `reader` (an executor) once its last copy is done: that read is its last copy
        from now on, so that no later copy into it runs before the read has ended. That completion fails only as
        the copy before it did: a read that fails (no memory for its copy) fails its export alone, not the host
        slot's next copies (a restore that waited for it failed: its symbol's state was lost)."""
        copy, host = self.host_copy.get(host_slot), self.host.slots[host_slot]
        ended = Future()

        def read():
            try:
                if isinstance(copy, Future):
                    copy.result()
                elif copy is not None:
                    with torch.cuda.device(self.device):
                        copy.synchronize()
            except BaseException as exc:
                ended.set_exception(exc)
                raise
            try:
                return host.numpy().copy()
            finally:
                ended.set_result(None)

        done = reader.submit(read)
        self.host_copy[host_slot] = ended
        return done

    def pending(self, slot):
        """The slot's last copy if it is not done yet (a finished one is forgotten)."""
        completion = self.slot_copy.get(slot)
        if completion is not None and _done(completion):
            del self.slot_copy[slot]
            return None
        return completion

    def wait(self, completion, stream=None):
        """Make the step side wait for a copy: `stream` (default the device's current stream) on a GPU, the
        caller on the CPU."""
        if isinstance(completion, Future):
            completion.result()
        else:
            (stream or torch.cuda.current_stream(self.device)).wait_event(completion)

    def time_copies(self):
        """Time every transfer from now on (forgetting those timed so far); a GPU's events are placed on the host's
        clock against one recorded while the GPU is idle."""
        self.copy_times = []
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):
                torch.cuda.synchronize()
                origin = torch.cuda.Event(enable_timing=True)
                origin.record()
                origin.synchronize()
                self.time_origin = (time.monotonic(), origin)

    def transfer_spans(self):
        """[(direction, began, ended)] of the timed transfers that are done, in time.monotonic() seconds."""
        done = []
        for direction, start, end in self.copy_times or ():
            if isinstance(start, float):
                done.append((direction, start, end))
            elif end.query():
                at, origin = self.time_origin
                done.append((direction, at + origin.elapsed_time(start) / 1e3, at + origin.elapsed_time(end) / 1e3))
        return done


class StateTable:
    def __init__(self, parts, capacity: int, *, host_capacity: int = 0, idle_timeout_s=None, reserve: int = 0,
                 separate=False, clock=time.monotonic, time_copies=False, before_copy=None):
        """parts: [(layout {name: (per-slot shape, dtype, initial value)}, device)], one per device (a single
        (layout, device) pair is one part); capacity: live GPU slots; host_capacity: symbols whose state may
        wait in host memory (refused in one line when the host has not the memory); reserve: free GPU slots kept
        ready by moving least recently used states to the host ahead of need (while the host tier has room), so
        that a symbol arriving takes a slot at once; separate: a buffer per component (for torch.compile) instead
        of one block per slot; time_copies: keep every transfer's time (transfer_seconds); before_copy(symbol,
        direction): called on a copy's queue before it runs (tests use it to slow one symbol's copy down).

        The host tier is pinned in a background thread from now on: pause_pinning() around a CUDA graph capture."""
        if isinstance(parts, tuple) and len(parts) == 2 and isinstance(parts[0], dict):
            parts = [parts]
        if not (is_count(capacity, 1) and is_count(host_capacity, 0) and is_count(reserve, 0)):
            raise ValueError(f"need whole numbers capacity >= 1, host_capacity >= 0 and reserve >= 0, got "
                             f"{capacity!r}, {host_capacity!r}, {reserve!r}")
        if idle_timeout_s is not None and not idle_timeout_s > 0:
            raise ValueError(f"idle_timeout_s must be positive (or None: never), got {idle_timeout_s}")
        # One host slot more than the tier holds: a swap moves a state out before the returning one frees its slot.
        host_slots = host_capacity + 1 if host_capacity else 0
        # a CPU's state table is allocated in host memory after this check: it counts against the same budget
        table_bytes = (capacity + 1) * sum(slot_layout(layout)[1] for layout, device in parts
                                           if torch.device(device).type == "cpu")
        _check_host_tier(host_capacity, host_slots * sum(host_slot_bytes(slot_layout(layout)[1])
                                                         for layout, _ in parts), table_bytes)
        self.parts = [DeviceSlots(layout, device, capacity + 1, host_slots, separate) for layout, device in parts]
        for part in self.parts:  # every part's tier is registered by the pinning thread, on the first part's GPU
            part.host.device = self.parts[0].device
        self.host_capacity, self.idle_timeout_s = host_capacity, idle_timeout_s
        self.reserve, self.clock = reserve, clock
        self.before_copy = before_copy
        for part in self.parts:
            if time_copies:
                part.time_copies()
        self.resident: OrderedDict[str, int] = OrderedDict()  # symbol -> slot, least recently used first
        self.offloaded: dict[str, int] = {}                    # symbol -> its host slot
        self.last_seen: OrderedDict[str, float] = OrderedDict()  # in order of last use: the idle ones first
        self.free = deque(range(1, capacity + 1))
        self._host_slots = host_slots
        self.free_host = deque() if self.parts[0].host.pin else deque(range(host_slots))  # pinned, unused
        self.stats = {"offloaded": 0, "restored": 0, "restored_ahead": 0, "step_waits": 0, "expired": 0,
                      "released": 0}
        self._lock = threading.Lock()
        self._host_slot_pinned = threading.Condition(self._lock)
        self._in_step: set[str] = set()  # the last slots_for's symbols: their step may still be being enqueued
        self._held: set[str] = set()  # a step that runs as parts: its symbols, their room kept until its last part
        # Symbols prefetched and not stepped since: moved out only when nothing else can be (else a tight table could
        # send a returning state back out before its step, again and again).
        self._awaiting: dict[str, None] = {}
        self._expired: dict[str, None] | None = None  # forgotten as idle since take_expired (None: not asked)
        # export: one export at a time uses the parts' staging buffers; one thread (_export_thread) takes the bytes
        # out of them and reads host slots, in the order asked
        self._export_lock = threading.Lock()
        self._last_export = None  # the last export through the staging buffers: set once they are free (_stage)
        self._reader = None  # the export thread (an executor), started by the first export that needs it
        self.pin_s = None  # seconds the host tier took to pin, once it is
        self._pin_error = None
        self._pin_go = threading.Event()  # cleared: pinning paused (a CUDA graph capture is under way)
        self._pin_go.set()
        self._pin_lock = threading.Lock()  # held while a piece registers
        self._pin_stopped = False  # stop_pinning(): no piece registers after the one under way
        self._pinning = None
        if self.parts[0].host.pin:
            self._pinning = threading.Thread(target=_pin_host_tier, args=(weakref.ref(self), self.parts[0].device),
                                             name="pin-host-tier", daemon=True)
            _PINNING.add(self)
            self._pinning.start()

    def _pin_slot(self, index) -> bool:
        """Pin host slot `index` in every part and let the tier have it; False, once pinning is stopped."""
        for part in self.parts:
            for offset, nbytes in part.host.pieces(index):
                if not self._pin_piece(part.host, offset, nbytes):
                    return False
            part.host.pinned += 1
        with self._lock:
            self.free_host.append(index)
            self._host_slot_pinned.notify_all()
        return True

    def _pinned(self, began):
        """Pinning has ended (every slot, or stopped, or failed): the tier holds what was pinned."""
        with self._lock:
            if self._pin_error is not None or self._pin_stopped:  # one pinned slot stays spare for swaps
                self.host_capacity = max(min(self.host_capacity, len(self.free_host) + len(self.offloaded) - 1), 0)
            if self._pin_error is not None:
                sys.stderr.write(f"[state table] the host tier holds {self.host_capacity} symbols, not more: "
                                 f"{self._pin_error}; lower --host-symbols\n")
            self.pin_s = time.perf_counter() - began
            self._host_slot_pinned.notify_all()

    def _pin_piece(self, pool, offset, nbytes) -> bool:
        """Register a piece once pinning is not paused; False, registering nothing, once it is stopped."""
        while True:
            self._pin_go.wait()
            with self._pin_lock:
                if self._pin_stopped:
                    return False
                if self._pin_go.is_set():  # not paused between the wait and the lock
                    pool.pin_piece(offset, nbytes)
                    return True

    def pause_pinning(self):
        """Stop registering host memory until resume_pinning(), returning once no registration is under way (a
        CUDA graph capture must not see one)."""
        self._pin_go.clear()
        with self._pin_lock:
            pass

    def resume_pinning(self):
        self._pin_go.set()

    def stop_pinning(self, timeout_s=PIN_STOP_TIMEOUT_S):
        """Pin no more of the host tier: return once the registration under way has ended (the tier keeps the
        slots pinned so far)."""
        self._pin_stopped = True
        self._pin_go.set()  # a paused thread wakes to see the stop (it registers nothing more)
        if self._pinning is not None:
            self._pinning.join(timeout_s)

    @property
    def pinning(self) -> bool:
        """True while host slots are still being pinned."""
        return self._pinning is not None and self.pin_s is None

    def wait_pinned(self, report=None, every_s=0.5):
        """Wait until the host tier is pinned, calling report(slots pinned, slots) every `every_s` seconds and at
        the end; a failure to pin raises ValueError in one line."""
        total = sum(part.host.count for part in self.parts)
        while self._pinning is not None and self._pinning.is_alive():
            self._pinning.join(every_s)
            if report is not None and self._pinning.is_alive():
                report(sum(part.host.pinned for part in self.parts), total)
        if self._pin_error is not None:
            raise ValueError(f"the host tier could not be pinned ({self._pin_error}); lower --host-symbols")
        if report is not None:
            report(total, total)

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
    def host_bytes(self) -> int:
        """Bytes of host memory the host tier holds (pinned on a GPU)."""
        return sum(part.host.bytes for part in self.parts)

    @property
    def slot_of(self) -> dict[str, int]:
        with self._lock:
            return dict(self.resident)

    def symbols(self) -> list[str]:
        """Every symbol with a state, on the GPU or in host memory."""
        with self._lock:
            return [*self.resident, *self.offloaded]

    def transfer_seconds(self) -> list[tuple[str, int, float]]:
        """[(direction "to_host" or "to_gpu", bytes, seconds)] of every finished transfer (time_copies)."""
        return [(direction, part.slot_bytes, ended - began) for part in self.parts
                for direction, began, ended in part.transfer_spans()]

    def transfer_spans(self) -> list[tuple[str, float, float]]:
        """[(direction, began, ended)] of every finished transfer (time_copies), in time.monotonic() seconds: what a
        step's times can be set against."""
        return sorted((span for part in self.parts for span in part.transfer_spans()), key=lambda span: span[1])

    def reset_transfer_times(self) -> None:
        """Forget the transfers timed so far (time_copies)."""
        with self._lock:
            for part in self.parts:
                if part.copy_times is not None:
                    part.time_copies()

    # ---- placing symbols --------------------------------------------------------------------------
    def unplaceable(self, symbols, at_once=True) -> list[str]:
        """The symbols of one step that fit in no tier (no side effects; idle symbols count as gone). at_once=False:
        a step that runs as parts of at most `capacity` symbols, which need room in the tiers only, not all on the
        GPU together."""
        with self._lock:
            return self._unplaceable(symbols, at_once)

    def hold_room(self, symbols) -> list[str]:
        """For a step that runs as parts: its symbols that fit in no tier (as unplaceable(at_once=False)); if none,
        the room of its symbols is held until release_room(), so that a prefetch from another thread between its
        parts takes none of it, nor forgets one of them (a later part's refusal would come after the earlier parts
        had advanced their states)."""
        with self._lock:
            rejected = self._unplaceable(symbols, at_once=False)
            if not rejected:
                self._held = set(symbols)
            return rejected

    def release_room(self) -> None:
        with self._lock:
            self._held = set()

    def slots_for(self, symbols, streams=None) -> list[int]:
        """The GPU slot of each symbol of one step (distinct symbols), placing the ones not resident: a new
        symbol gets a slot holding the initial state, an offloaded one its own state back. The stream the step
        runs on (streams: one per part; default each device's current stream; the CPU: the caller) then waits for
        these slots' copies still under way, and for no other."""
        symbols = list(symbols)
        with self._lock:
            rejected = self._unplaceable(symbols)
            if rejected:
                raise self.capacity_error(rejected)
            now = self.clock()
            batch = set(symbols)
            self._expire(now, exclude=batch | self._held)
            self._in_step = batch
            for k, part in enumerate(self.parts):
                if part.step_stream is not None:  # a stream the caller names costs no Stream object (~20 us)
                    part.step_stream = streams[k] if streams else torch.cuda.current_stream(part.device)
            for symbol in symbols:
                self._place(symbol, exclude=batch)
                self._touch(symbol, now)
                self._awaiting.pop(symbol, None)
            slots = [self.resident[s] for s in symbols]
            waits = [(part, copy) for slot in slots for part in self.parts
                     if (copy := part.pending(slot)) is not None]
            self.stats["step_waits"] += len({id(copy) for _, copy in waits})
            self._keep_reserve(exclude=batch)
        for part, copy in waits:  # outside the lock: a wait on the CPU blocks until the copy is done
            part.wait(copy, part.step_stream)
        return slots

    def prefetch(self, symbols) -> None:
        """Start placing these symbols ahead of their step (a request arrived): the copy back for those in host
        memory, a free slot for new ones; and keep the reserve. Symbols that fit nowhere are left to their step
        (which answers the capacity error). Returns at once: the copies run on their streams."""
        with self._lock:
            now = self.clock()
            wanted = list(dict.fromkeys(symbols))
            keep = self._in_step | self._held | set(wanted)
            self._expire(now, exclude=keep)
            for symbol in wanted:
                if symbol not in self.resident:
                    # the idle symbols left are in `keep` and stay (their requests came, or their step is under
                    # way): they make no room, and none idle since `now` was forgotten
                    if self._unplaceable([symbol], keep=keep, now=now) \
                            or not self._can_take_slot(keep, swap=symbol in self.offloaded):
                        if symbol in self.offloaded:  # its request came: not idle, though it waits for a slot
                            self._seen(symbol, now)
                        continue
                    restoring = symbol in self.offloaded
                    self._place(symbol, exclude=keep)
                    self.stats["restored_ahead"] += restoring
                self._touch(symbol, now)
                self._awaiting[symbol] = None
            self._keep_reserve(exclude=keep)

    def ready(self, symbol) -> bool:
        """False while the symbol's state is on its way to the GPU (its slot's copies not done); a symbol in host
        memory with no return under way has its return started here, into a slot whose state awaits no step. True
        for a symbol its step will place itself (new, or no such slot now).

        Advisory (its step's slots_for places and waits as needed), so a resident symbol with its copies done is
        answered without the lock, and False while another thread holds the lock: the runtime asks again soon.
        It is asked on the thread that steps, of every waiting symbol at every look (~200,000 times in a swap run),
        and waited there behind each prefetch's move under the lock (bench/LOG.md section 86)."""
        # one read of each map, atomic in Python; a placement records a slot's copy before it hands the slot out
        slot = self.resident.get(symbol)
        if slot is not None and all(_done(part.slot_copy.get(slot)) for part in self.parts):
            return True
        if not self._lock.acquire(blocking=False):
            return False
        try:
            # never the slot of a state awaiting its step: the runtime asks every waiting symbol in turn, and two of
            # them with one slot outside the last step took it from each other at every look, neither ever ready
            if symbol in self.offloaded and self._can_take_slot(self._in_step | {symbol}, awaiting_too=False):
                self._place(symbol, exclude=self._in_step | {symbol})
                self._awaiting[symbol] = None
                self.stats["restored_ahead"] += 1
            slot = self.resident.get(symbol)
            return slot is None or all(part.pending(slot) is None for part in self.parts)
        finally:
            self._lock.release()

    def resident_slot(self, symbol) -> int | None:
        """The GPU slot of a symbol resident there with its copies done, counted as used now (a step already
        queued on the GPU takes it: JoinableStep); None otherwise. A later eviction of it runs after that step,
        as every copy to the host runs after the steps enqueued before it."""
        with self._lock:
            slot = self.resident.get(symbol)
            if slot is None or any(part.pending(slot) is not None for part in self.parts):
                return None
            self._touch(symbol, self.clock())
            self._awaiting.pop(symbol, None)
            self._in_step.add(symbol)
            return slot

    def export(self, symbol, streams=None) -> PendingStep:
        """The symbol's state (every part's slot bytes, in part order) as the steps enqueued so far leave it; None
        for a symbol without one. A resident state on a GPU: copied into each part's staging buffer on the step
        stream (streams: one per part, as slots_for's), then into pinned host memory and an array on the export
        thread (_stage); one in host memory: read from its host slot once its copies are done; on the CPU, once its
        slot's copies are done, a plain copy. From the thread that steps."""
        with self._export_lock:
            if self._last_export is not None:  # its staging buffers are reused: its bytes must be out of them
                self._last_export.result()
                self._last_export = None
            while True:
                with self._lock:
                    slot = self.resident.get(symbol)
                    if slot is None:
                        return self._read_host(self.offloaded[symbol]) if symbol in self.offloaded \
                            else PendingStep.completed(None)
                    copies = [part.pending(slot) for part in self.parts]
                    if self.parts[0].device.type == "cuda":
                        return self._stage(slot, copies, streams)
                    if all(copy is None for copy in copies):
                        return PendingStep.completed(np.concatenate([part.copy_of(slot) for part in self.parts]))
                for part, copy in zip(self.parts, copies):  # the CPU: waited for outside the lock, then again
                    if copy is not None:
                        part.wait(copy)

    def write(self, slot, data) -> None:
        """Slot `slot` (placed by slots_for) holds `data` (1-D uint8 on the host: every part's bytes in part
        order), written on each part's current stream."""
        start = 0
        for part in self.parts:
            part.write(slot, data[start:start + part.slot_bytes])
            start += part.slot_bytes

    def take_expired(self) -> list[str]:
        """The symbols forgotten as idle since the last call that hold no state now; the first call starts keeping
        them."""
        with self._lock:
            expired = [s for s in self._expired or () if s not in self.resident and s not in self.offloaded]
            self._expired = {}
            return expired

    def capacity_error(self, rejected) -> CapacityError:
        """The error that names the limits for symbols that fit in no tier."""
        device = "the GPU" if self.parts[0].device.type == "cuda" else "the CPU"  # without CUDA the table is in RAM
        return CapacityError.no_room(rejected, f"{self.capacity} on {device} and {self.host_capacity} in host memory",
                                     "--state-memory (or --state-slots)")

    def release(self, symbols) -> None:
        """Forget these symbols' states (they left); unknown symbols are ignored. From the thread that steps."""
        with self._lock:
            for symbol in symbols:
                if symbol in self.resident or symbol in self.offloaded:
                    self._forget(symbol)
                    self.stats["released"] += 1

    # ---- internals (holding the lock) ---------------------------------------------------------------
    def _unplaceable(self, symbols, at_once=True, keep=frozenset(), now=None):
        """unplaceable's answer; keep: symbols that the placement will not forget as idle, besides the step's own
        and those held for a step that runs as parts; now: the time its expiry reads (default the clock's)."""
        batch = list(dict.fromkeys(symbols))
        if at_once and len(batch) > self.capacity:
            return batch[self.capacity:]
        new = [s for s in batch if s not in self.resident and s not in self.offloaded]
        held = {s for s in self._held if s not in self.resident and s not in self.offloaded}.difference(batch)
        room = self.capacity + self.host_capacity - len(self.resident) - len(self.offloaded) - len(held)
        if len(new) > room:
            room += len(idle_symbols(self.last_seen, self.clock() if now is None else now, self.idle_timeout_s,
                                     set(batch) | self._held | keep))
        return new[max(room, 0):]

    def _expire(self, now, exclude):
        for symbol in idle_symbols(self.last_seen, now, self.idle_timeout_s, exclude):
            self._forget(symbol)
            self.stats["expired"] += 1
            if self._expired is not None:
                self._expired[symbol] = None

    def _touch(self, symbol, now):
        self.resident.move_to_end(symbol)
        self._seen(symbol, now)

    def _seen(self, symbol, now):
        # never earlier than the newest: a caller's `now` may predate a touch made while _place waited (the lock
        # released), and idle_symbols reads last_seen in time order
        self.last_seen[symbol] = max(now, next(reversed(self.last_seen.values()), now))
        self.last_seen.move_to_end(symbol)

    def _forget(self, symbol):
        self.last_seen.pop(symbol, None)
        self._awaiting.pop(symbol, None)
        if symbol in self.resident:
            slot = self.resident.pop(symbol)
            for part in self.parts:
                part.reset(slot)
            self.free.append(slot)
        else:
            self.free_host.append(self.offloaded.pop(symbol))

    def _can_take_slot(self, exclude, awaiting_too=True, swap=True) -> bool:
        return bool(self.free) or (len(self.free_host) > (not swap) and self._evictable(exclude, awaiting_too)
                                   is not None)

    def _evictable(self, exclude, awaiting_too=True):
        """The least recently used resident symbol outside `exclude`, one not awaiting its step if any (with
        awaiting_too, else None)."""
        first = None
        for symbol in self.resident:
            if symbol in exclude:
                continue
            if symbol not in self._awaiting:
                return symbol
            if first is None:
                first = symbol
        return first if awaiting_too else None

    def _place(self, symbol, exclude):
        """Give a symbol not resident a slot: a free one (one whose copies are done, if any), else the least
        recently used state outside `exclude` moves to the host; an offloaded symbol's state comes back into it."""
        if symbol in self.resident:
            return
        swap = symbol in self.offloaded
        while not self.free and len(self.free_host) <= (not swap) and self.pinning:
            self._host_slot_pinned.wait()  # releases the lock: the pinning thread hands out slots as it goes
        if not self.free and not self._offload_lru(exclude, swap=swap):
            raise self.capacity_error([symbol])  # pinning failed while this step waited for a host slot
        slot = next((s for s in self.free if all(part.pending(s) is None for part in self.parts)), self.free[0])
        self.free.remove(slot)
        if symbol in self.offloaded:
            host_slot = self.offloaded.pop(symbol)
            for part in self.parts:
                part.restore(slot, host_slot, self._before(symbol, "to_gpu"))
            self.free_host.append(host_slot)
            self.stats["restored"] += 1
        self.resident[symbol] = slot

    def _offload_lru(self, exclude, awaiting_too=True, swap=False):
        """Move the least recently used resident symbol outside `exclude` (not awaiting its step, if any) to host
        memory; free its slot. False when there is none, or no free host slot. Unless a returning state frees a host
        slot (swap), one is left spare: while the tier pins, the last one taken left none for a swap, and a pinning
        that failed then kept the states out there from ever coming back to a full GPU."""
        symbol = self._evictable(exclude, awaiting_too)
        if symbol is None or len(self.free_host) <= (not swap):
            return False
        slot, host_slot = self.resident.pop(symbol), self.free_host.popleft()
        for part in self.parts:
            part.offload(slot, host_slot, self._before(symbol, "to_host"))
        self.offloaded[symbol] = host_slot
        self.free.append(slot)
        self.stats["offloaded"] += 1
        return True

    def _keep_reserve(self, exclude):
        """Move states out until `reserve` slots are free (while the host tier has room), never one awaiting
        its step."""
        while (len(self.free) < self.reserve and len(self.offloaded) < self.host_capacity
               and self._offload_lru(exclude, awaiting_too=False)):
            pass

    def _stage(self, slot, copies, streams) -> PendingStep:
        """export's GPU path for a resident slot (holding the lock: no eviction is enqueued before the copy in): the
        slot copied into each part's staging buffer on its step stream; the rest on the export thread (_taken_out),
        so the thread that steps only enqueues that copy. The table keeps only the buffers' release, not the bytes,
        which go where the caller drops them (kept, the next export let 146 MiB go on the thread that steps)."""
        staged = []
        for k, (part, copy) in enumerate(zip(self.parts, copies)):
            stream = streams[k] if streams else torch.cuda.current_stream(part.device)
            part.step_stream = stream  # a later eviction of the slot runs after this copy, as after the steps
            staged.append(part.stage(slot, copy, stream))
        taken_out = Future()  # the next export's to wait for once handed over (refused: nothing would set it)
        value = self._export_thread().submit(_taken_out, self.parts, staged, taken_out)
        self._last_export = taken_out
        return PendingStep(value.result, poll=value.done)

    def _export_thread(self) -> ThreadPoolExecutor:
        if self._reader is None:
            self._reader = ThreadPoolExecutor(1, thread_name_prefix="state-export")
        return self._reader

    def _read_host(self, host_slot) -> PendingStep:
        """export's path for a state in host memory: read on the export thread (holding the lock)."""
        reads = [part.read_host(host_slot, self._export_thread()) for part in self.parts]
        return PendingStep(lambda: np.concatenate([read.result() for read in reads]),
                           poll=lambda: all(read.done() for read in reads))

    def _before(self, symbol, direction):
        hook = self.before_copy
        return (lambda: hook(symbol, direction)) if hook is not None else _nothing


def _nothing():
    pass


def _taken_out(parts, staged, taken_out: Future):
    """(The table's export thread) an export's bytes, out of its parts' staging buffers: copied to pinned memory,
    then into an array of its own; `taken_out` set once the buffers are free again (the next export waits for it)."""
    try:
        for part, event in zip(parts, staged):
            part.copy_out(event)
        return np.concatenate([part.staged.numpy() for part in parts])
    finally:
        taken_out.set_result(None)


def _check_host_tier(symbols, pool_bytes, table_bytes=0):
    """Refuse, in one line, a host tier that the host's memory cannot hold beside everything else (table_bytes: a
    state table in host memory, not yet allocated)."""
    if not pool_bytes:
        return
    budget = host_tier_budget() - table_bytes
    if pool_bytes > budget:
        total, available = host_memory()
        per_symbol = pool_bytes / (symbols + 1)
        table = f" beside the state table's {table_bytes / 2**30:.1f} GiB" if table_bytes else ""
        raise ValueError(f"a host tier of {symbols} symbols needs {pool_bytes / 2**30:.1f} GiB of host memory{table}, "
                         f"but {available / 2**30:.1f} GiB of {total / 2**30:.1f} GiB is available and "
                         f"{(available - budget - table_bytes) / 2**30:.1f} GiB stays free for the rest: at most "
                         f"{max(int(budget // per_symbol) - 1, 0)} symbols fit; lower --host-symbols")
