"""The state table's tiers on the CPU: slots allocated once, slot reuse, LRU offload to host memory and return
byte for byte, idle expiry, the capacity error, a table spanning several devices; the host tier allocated once,
returns started ahead of their step (prefetch, ready), a slow copy delaying only its own symbol. The same on
real CUDA streams where there is a GPU."""
import argparse
import contextlib
import mmap
import multiprocessing
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from client.engine.fast.state_table import (ALIGN, HOST_HEADROOM_BYTES, HOST_HEADROOM_SHARE, PAD_SLOT, CapacityError,
                                            StateTable, host_memory, host_slot_bytes, host_symbols_for, host_tier_budget,
                                            slot_layout)
from client.engine.options import add_engine_arguments
from conftest import checkout_env

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

LAYOUT = {"h": ((3, 5), torch.float32, 0.0), "m": ((4,), torch.float32, float("-inf")),
          "C": ((2, 2), torch.float16, 0.0), "count": ((), torch.int32, 0)}


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def table(capacity=3, **kwargs):
    return StateTable((LAYOUT, "cpu"), capacity, **kwargs)


def write(t, slot, value):
    """Give a slot's state a recognisable value in every component."""
    for view in t.tensors.values():
        view[slot] = value


def state_of(t, slot):
    return {name: view[slot].clone() for name, view in t.tensors.items()}


def test_components_are_aligned_views_of_one_block_per_slot():
    offsets, size = slot_layout(LAYOUT)
    assert size % ALIGN == 0 and all(offset % ALIGN == 0 for offset in offsets.values())
    t = table()
    assert [chunk.shape for chunk, _ in t.parts[0].chunks] == [(4, size)]  # one block per slot
    for name, (shape, dtype, init) in LAYOUT.items():
        view = t.tensors[name]
        assert view.shape == (4, *shape) and view.dtype == dtype
        assert (view == init).all()  # every slot starts at the initial state
    write(t, 2, 7)
    assert all((view[2] == 7).all() and not (view[1] == 7).any() for view in t.tensors.values())


def test_new_symbols_get_free_slots_and_keep_them():
    t = table()
    assert t.slots_for(["A", "B"]) == [1, 2]
    assert t.slots_for(["B", "C", "A"]) == [2, 3, 1]
    assert PAD_SLOT not in t.resident.values()


def test_released_slot_is_reset_and_reused():
    t = table()
    t.slots_for(["A", "B"])
    write(t, 1, 3)
    t.release(["A", "unknown"])
    assert t.symbols() == ["B"] and t.stats["released"] == 1
    assert t.slots_for(["D"]) == [3]  # free slots are handed out oldest first
    assert t.slots_for(["E"]) == [1]
    assert all((t.tensors[name][1] == init).all() for name, (_, _, init) in LAYOUT.items())


def test_least_recently_used_moves_to_host_and_returns_byte_for_byte():
    t = table(capacity=2, host_capacity=4)
    t.slots_for(["A"])
    t.slots_for(["B"])
    write(t, 1, 5)  # A's state
    saved = state_of(t, 1)
    t.slots_for(["B"])  # A is now the least recently used
    assert t.slots_for(["C"]) == [1]  # A's slot, reset for C
    assert list(t.offloaded) == ["A"] and t.stats["offloaded"] == 1
    assert all((t.tensors[name][1] == init).all() for name, (_, _, init) in LAYOUT.items())
    slot = t.slots_for(["A"])[0]  # B is least recently used now: it goes to the host, A comes back
    assert list(t.offloaded) == ["B"] and t.stats["restored"] == 1
    assert all(torch.equal(t.tensors[name][slot], saved[name]) for name in LAYOUT)


def test_a_buffer_per_component_moves_states_the_same_way():
    t = table(capacity=2, host_capacity=4, separate=True)
    assert len(t.parts[0].chunks) == len(LAYOUT)
    t.slots_for(["A"])
    write(t, 1, 6)
    saved = state_of(t, 1)
    t.slots_for(["B"])
    t.slots_for(["C"])  # A out
    assert all((t.tensors[name][1] == init).all() for name, (_, _, init) in LAYOUT.items())
    slot = t.slots_for(["A"])[0]
    assert all(torch.equal(t.tensors[name][slot], saved[name]) for name in LAYOUT)


def test_symbols_of_one_step_are_never_offloaded_for_each_other():
    t = table(capacity=2, host_capacity=4)
    t.slots_for(["A", "B"])
    slots = t.slots_for(["B", "C"])  # A goes, B stays
    assert slots[0] == 2 and list(t.offloaded) == ["A"]


def test_symbol_beyond_every_tier_is_refused_and_nothing_changes():
    t = table(capacity=2, host_capacity=1)
    t.slots_for(["A", "B"])
    t.slots_for(["C"])
    write(t, 1, 9)
    before = (dict(t.resident), list(t.offloaded), state_of(t, 1))
    assert t.unplaceable(["A", "D"]) == ["D"] and t.unplaceable(["D", "E"]) == ["D", "E"]
    with pytest.raises(CapacityError, match=r"2 on the CPU and 1 in host memory") as error:
        t.slots_for(["A", "D"])
    assert error.value.symbols == ["D"]
    assert (dict(t.resident), list(t.offloaded)) == before[:2]
    assert all(torch.equal(t.tensors[name][1], before[2][name]) for name in LAYOUT)
    assert t.slots_for(["A", "B"])  # the known symbols go on


def test_a_step_larger_than_the_gpu_tier_is_refused():
    t = table(capacity=2, host_capacity=10)
    with pytest.raises(CapacityError):
        t.slots_for(["A", "B", "C"])


def test_idle_symbols_expire_and_make_room():
    clock = Clock()
    t = table(capacity=1, host_capacity=1, idle_timeout_s=10, clock=clock)
    t.slots_for(["A"])
    clock.now = 5
    t.slots_for(["B"])  # A offloaded
    assert t.unplaceable(["C"]) == ["C"]
    clock.now = 16  # A idle 16 s, B 11 s: both expired
    assert t.unplaceable(["C"]) == []
    assert t.slots_for(["C"]) == [1] and t.symbols() == ["C"] and t.stats["expired"] == 2


def test_a_symbol_seen_again_is_not_expired_with_those_idle_since_before_it():
    clock = Clock()
    t = table(capacity=2, host_capacity=2, idle_timeout_s=10, clock=clock)
    t.slots_for(["A", "B"])
    clock.now = 3
    t.slots_for(["C"])  # A offloaded
    clock.now = 8
    t.slots_for(["A"])  # back on the GPU, seen again: its idle time starts over
    clock.now = 12  # B idle 12 s (expired), C 9 s, A 4 s
    t.slots_for(["D"])
    assert t.stats["expired"] == 1 and sorted(t.symbols()) == ["A", "C", "D"]
    clock.now = 19  # C idle 16 s, D 7 s, A 11 s: C and A expired, the order of use kept
    t.slots_for(["E"])
    assert t.stats["expired"] == 3 and sorted(t.symbols()) == ["D", "E"]


def test_a_symbol_whose_request_came_is_not_idle_while_it_waits_for_a_slot():
    """Idle time ends when a request arrives (prefetch), not at its step: a symbol in host memory that prefetch
    could not bring back (no slot free) was forgotten by another symbol's step in between, and its request, which
    came within the timeout, started from a fresh state."""
    clock = Clock()
    t = table(capacity=2, host_capacity=1, idle_timeout_s=10, clock=clock)
    t.take_expired()  # keep them from now on
    t.slots_for(["A", "B"])
    clock.now = 1
    t.slots_for(["B", "C"])  # A to the host tier, now full
    clock.now = 9
    t.prefetch(["A"])  # A's request came (idle 9 s); no slot for it while B and C's step is under way
    assert "A" in t.offloaded
    clock.now = 10.5
    t.slots_for(["C"])  # A was last seen at its request's arrival, 1.5 s ago
    assert t.take_expired() == [] and "A" in t.offloaded
    clock.now = 19.5
    t.slots_for(["C"])  # idle 10.5 s since that request: forgotten now (with B, idle 18.5 s)
    assert sorted(t.take_expired()) == ["A", "B"]


def test_idle_times_stay_in_time_order_when_a_touch_comes_late():
    """A step's placement reads the clock once and may wait (for a pinned host slot) while other threads touch
    symbols: its later touch must not put an older time behind a newer one, which expiry reads in order."""
    clock = Clock()
    t = table(capacity=4, host_capacity=2, idle_timeout_s=10, clock=clock)
    t.slots_for(["A", "B"])
    clock.now = 8
    t.slots_for(["A"])
    t._touch("B", 5)  # a placement that read the clock at 5 touches B after A's touch at 8
    assert list(t.last_seen) == ["A", "B"] and list(t.last_seen.values()) == [8, 8]


def test_reserve_keeps_free_slots_ready():
    t = table(capacity=3, host_capacity=5, reserve=1)
    t.slots_for(["A", "B"])
    assert len(t.free) == 1 and not t.offloaded
    t.slots_for(["C"])  # the last free slot taken: the least recently used moves out ahead of need
    assert len(t.free) == 1 and list(t.offloaded) == ["A"]


def test_table_over_several_devices_gives_a_symbol_one_slot_everywhere():
    other = {"S": ((4,), torch.float32, 1.0)}
    t = StateTable([(LAYOUT, "cpu"), (other, "cpu")], 1, host_capacity=2)
    assert len(t.parts) == 2 and set(t.tensors) == {*LAYOUT, "S"}
    t.slots_for(["A"])
    t.parts[1].tensors["S"][1] = 4.0
    t.slots_for(["B"])
    assert (t.parts[1].tensors["S"][1] == 1.0).all()  # reset for B
    t.slots_for(["A"])
    assert (t.parts[1].tensors["S"][1] == 4.0).all()  # A's part on the second device came back too


def test_the_host_symbols_help_states_the_headroom_the_host_tier_leaves():
    """--help said the default host tier left max(4 GiB, 5%) of the host's memory: it leaves 15% since bench/LOG.md
    section 48."""
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert f"max({HOST_HEADROOM_BYTES >> 30} GiB, {HOST_HEADROOM_SHARE:.0%})" in " ".join(parser.format_help().split())


@pytest.mark.parametrize("kwargs", [{"capacity": 0}, {"host_capacity": -1}, {"reserve": -2},
                                    {"idle_timeout_s": 0}, {"capacity": 2.5}, {"host_capacity": 1.5}])
def test_bad_limits_are_rejected(kwargs):
    with pytest.raises(ValueError):
        table(**{"capacity": 2, **kwargs})


def wait_until(condition, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def same_state(t, slot, saved):
    return all(torch.equal(t.tensors[name][slot].cpu(), saved[name].cpu()) for name in saved)


def test_the_host_tier_is_allocated_once_and_nothing_is_allocated_while_states_move(monkeypatch):
    t = table(capacity=3, host_capacity=6, reserve=1)
    pool = t.parts[0].host
    assert pool.slots.shape == (7, t.parts[0].slot_bytes)  # the tier, and one spare slot for a swap
    assert pool.stride % mmap.PAGESIZE == 0 and t.host_bytes == 7 * pool.stride
    address = pool.slots.data_ptr()
    calls = []

    def counting(name, real):
        def allocate(*args, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)
        return allocate

    for name in ("empty", "zeros", "ones", "full", "empty_like", "zeros_like", "frombuffer", "tensor"):
        monkeypatch.setattr(torch, name, counting(name, getattr(torch, name)))
    monkeypatch.setattr(mmap, "mmap", counting("mmap", mmap.mmap))
    rng = random.Random(0)
    symbols = [f"S{i}" for i in range(9)]
    for step in range(80):
        batch = rng.sample(symbols, rng.randint(1, 3))
        t.prefetch(rng.sample(symbols, 2))
        t.ready(batch[0])
        t.slots_for(batch)
        if step % 20 == 19:
            t.release([batch[0]])
    assert t.stats["offloaded"] > 20 and t.stats["restored"] > 20 and t.stats["restored_ahead"] > 5
    assert calls == [] and pool.slots.data_ptr() == address


def test_a_dropped_table_is_collected_and_its_copy_threads_end():
    """The CPU's copy thread held its last copy's closure while it waited for the next, and with it the table's
    slots (its tensors) and the queue whose collection ends the thread: every engine dropped on a CPU left its
    states in memory."""
    import gc
    import weakref

    from client.engine.fast import state_table

    before = set(state_table._COPY_THREADS.values())
    t = table(capacity=2, host_capacity=4)
    for symbols in (["A"], ["B"], ["C"], ["A"]):  # A to the host and back: both copy threads have run
        t.slots_for(symbols)
    assert t.stats["offloaded"] == 2 and t.stats["restored"] == 1
    threads = set(state_table._COPY_THREADS.values()) - before
    assert len(threads) == 2
    dropped = [weakref.ref(t), weakref.ref(t.parts[0])]
    del t
    gc.collect()
    assert all(ref() is None for ref in dropped)
    for thread in threads:
        thread.join(timeout=10)
        assert not thread.is_alive()


def test_a_host_tier_beyond_the_hosts_memory_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"a host tier of \d+ symbols needs .* GiB .*lower --host-symbols") as error:
        table(capacity=2, host_capacity=10**12)
    assert "\n" not in str(error.value)
    total, available = host_memory()
    assert 0 < available <= total and 0 <= host_tier_budget() < available
    size = slot_layout(LAYOUT)[1]
    assert host_symbols_for(10 * mmap.PAGESIZE, [size]) == 9  # a page a slot here, one kept spare
    assert host_symbols_for(0, [size]) == 0


def test_a_host_tier_counts_a_cpu_state_table_in_the_hosts_memory(monkeypatch):
    """Without a GPU the state table is in host memory too, allocated after the host tier's check: a tier that fit
    the memory left only without the table passed, and the two together could exhaust the host's memory."""
    from client.engine.fast import state_table as module

    pool = 11 * host_slot_bytes(slot_layout(LAYOUT)[1])  # 10 symbols, one slot spare
    monkeypatch.setattr(module, "host_tier_budget", lambda: pool + 4096)
    table(capacity=2, host_capacity=10)  # 3 slots of 1 KiB fit beside it
    with pytest.raises(ValueError, match=r"host tier of 10 symbols .* beside the state table's .*--host-symbols"):
        table(capacity=100, host_capacity=10)


def test_host_memory_where_the_system_says_less(monkeypatch):
    """No /proc/meminfo and no count of available pages (macOS): the total stands for it; nothing said at all
    (Windows: no sysconf): zeros, and the reference engine's CPU table takes its default size."""
    from client.engine.fast import state_table
    from client.engine.reference import ReferenceEngine
    from client.model import load_model

    monkeypatch.setattr(state_table, "_read", lambda path: None)
    real = os.sysconf

    def macos(name):
        if name == "SC_AVPHYS_PAGES":
            raise ValueError("unrecognized configuration name")
        return real(name)

    monkeypatch.setattr(os, "sysconf", macos)
    total, available = host_memory()
    assert available == total == real("SC_PHYS_PAGES") * real("SC_PAGE_SIZE") > 0
    monkeypatch.delattr(os, "sysconf")
    assert host_memory() == (0, 0)
    engine = ReferenceEngine(load_model("tiny", seed=0)[0], progress=False)
    assert engine.describe()["capacity"] == state_table.CPU_CAPACITY


def test_prefetch_starts_a_return_ahead_of_its_step_and_the_step_then_waits_for_nothing():
    t = table(capacity=4, host_capacity=4, reserve=1)
    t.slots_for(["X"])
    write(t, 1, 7)
    saved = state_of(t, 1)
    t.slots_for(["A", "B", "C"])  # X, least recently used, moves out to keep a slot free
    t.slots_for(["A"])
    assert list(t.offloaded) == ["X"]
    t.prefetch(["X", "NEW"])  # a request of each arrived: X comes back into the free slot, B makes room for NEW
    assert t.stats["restored_ahead"] == 1 and "X" not in t.offloaded and "NEW" in t.slot_of
    assert list(t.offloaded) == ["B", "C"]  # C: the reserve refilled
    wait_until(lambda: t.ready("X") and t.ready("NEW"))
    waits = t.stats["step_waits"]
    slots = t.slots_for(["X", "NEW"])
    assert t.stats["step_waits"] == waits  # its state had arrived: the step waited for no copy
    assert same_state(t, slots[0], saved)
    assert all((t.tensors[name][slots[1]] == init).all() for name, (_, _, init) in LAYOUT.items())
    assert t.ready("UNKNOWN")  # its step places it


def test_prefetch_leaves_a_symbol_beyond_every_tier_to_its_step():
    t = table(capacity=1, host_capacity=1)
    t.slots_for(["A"])
    t.slots_for(["B"])
    before = (t.slot_of, list(t.offloaded))
    t.prefetch(["C"])
    assert (t.slot_of, list(t.offloaded)) == before and t.ready("C")
    with pytest.raises(CapacityError):
        t.slots_for(["C"])


def test_prefetch_counts_no_room_of_idle_symbols_it_keeps():
    """A full table (3 GPU slots, 1 host slot) whose idle symbols A and B are in the prefetch too: they are not
    forgotten (their requests came), so there is no room for a new D. Counted as room, D took C's slot and C the
    host tier's spare slot: 5 symbols held in room for 4, and the next step of A, held all along and placeable
    by unplaceable(), failed with a CapacityError (no host slot left to swap through)."""
    clock = Clock()
    t = table(capacity=3, host_capacity=1, idle_timeout_s=1, clock=clock)
    t.slots_for(["A", "B"])
    clock.now = 0.5
    t.slots_for(["C"])
    clock.now = 0.6
    t.slots_for(["E"])  # A to the host tier, now full
    clock.now = 1.2  # A and B idle, C and E not
    t.prefetch(["D", "A", "B"])
    assert sorted(t.symbols()) == ["A", "B", "C", "E"] and len(t.offloaded) <= t.host_capacity
    assert t.unplaceable(["A"]) == [] and t.slots_for(["A"])
    assert t.unplaceable(["D"]) == ["D"]


def test_ready_starts_a_return_not_yet_under_way():
    t = table(capacity=3, host_capacity=4, reserve=1)
    t.slots_for(["X"])
    write(t, 1, 3)
    saved = state_of(t, 1)
    t.slots_for(["A", "B"])  # X out, to keep a slot free
    t.ready("X")  # the scheduler asks about a symbol whose request came without a prefetch
    assert t.stats["restored_ahead"] == 1 and "X" in t.slot_of
    wait_until(lambda: t.ready("X"))
    assert same_state(t, t.slots_for(["X"])[0], saved)


def test_ready_never_waits_for_the_lock():
    """While another thread holds the table (a prefetch enqueueing a move), ready() answers at once: True for a
    resident symbol whose copies are done, False for one in host memory, whose return it leaves to later."""
    t = table(capacity=3, host_capacity=4, reserve=1)
    t.slots_for(["X"])
    t.slots_for(["A", "B"])  # X moves out to keep the reserve
    holding, release = threading.Event(), threading.Event()

    def hold():
        with t._lock:
            holding.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert holding.wait(10)
        answers = []
        asker = threading.Thread(target=lambda: answers.extend([t.ready("A"), t.ready("X")]))
        asker.start()
        asker.join(5)
        assert answers == [True, False] and t.stats["restored_ahead"] == 0
    finally:
        release.set()
        holder.join()
    assert not t.ready("X") and t.stats["restored_ahead"] == 1  # the lock free: its return starts
    wait_until(lambda: t.ready("X"))


def test_ready_sends_no_state_that_awaits_its_step_away_for_another():
    """S and O await their step (their requests came), O on the host, and one slot lies outside the last step:
    O's ready() took S's slot, S's ready() took it back, and so at every look of the runtime's scheduler: neither
    was ever ready, no step formed, and the states crossed to the host and back for good (tests/test_served_fuzz.py).
    A return goes only into a slot whose state awaits no step; where there is none, O's step places it."""
    t = table(capacity=3, host_capacity=4)
    t.slots_for(["O"])
    t.slots_for(["S"])
    t.slots_for(["L1", "L2"])  # O, least recently used, to the host
    assert list(t.offloaded) == ["O"]
    t.prefetch(["S", "O"])
    wait_until(lambda: t.ready("S"))
    moved = t.stats["offloaded"]
    for _ in range(3):  # the scheduler's looks, in the order of their requests
        assert (t.ready("O"), t.ready("S")) == (True, True)
    assert t.stats["offloaded"] == moved and t.slots_for(["O", "S"])


def test_a_slow_copy_of_one_symbol_delays_no_other_symbol():
    """X's return blocks on its copy queue until released: the other symbols' steps, a new symbol's placement
    and a state leaving for the host all go on meanwhile; X is not ready until its copy is done, then returns
    byte for byte."""
    release = threading.Event()

    def before_copy(symbol, direction):
        if (symbol, direction) == ("X", "to_gpu"):
            assert release.wait(30)

    t = table(capacity=4, host_capacity=4, reserve=1, before_copy=before_copy)
    t.slots_for(["X"])
    write(t, 1, 7)
    saved = state_of(t, 1)
    t.slots_for(["A", "B", "C"])
    assert list(t.offloaded) == ["X"]
    began = time.perf_counter()
    t.prefetch(["X"])
    assert not t.ready("X")
    a_b = t.slots_for(["A", "B"])  # C moves out to keep a slot free; X, awaiting its step, stays
    assert "X" in t.slot_of and list(t.offloaded) == ["C"]
    t.prefetch(["NEW"])
    wait_until(lambda: t.ready("NEW"), timeout_s=5)  # its slot came from C's move, which X does not hold up
    assert t.slots_for(["NEW", "A"])[1] == a_b[0]
    assert not t.ready("X") and time.perf_counter() - began < 5
    release.set()
    wait_until(lambda: t.ready("X"))
    waits = t.stats["step_waits"]
    assert same_state(t, t.slots_for(["X"])[0], saved) and t.stats["step_waits"] == waits


def test_a_step_for_a_symbol_still_in_flight_waits_for_its_copy():
    """Prefetched too late: the step's slots_for waits for X's own copy and X's state is whole."""
    def before_copy(symbol, direction):
        if (symbol, direction) == ("X", "to_gpu"):
            time.sleep(0.2)

    t = table(capacity=2, host_capacity=2, before_copy=before_copy)
    t.slots_for(["X"])
    write(t, 1, 5)
    saved = state_of(t, 1)
    t.slots_for(["A", "B"])
    t.prefetch(["X"])
    waits = t.stats["step_waits"]
    slot = t.slots_for(["X"])[0]
    assert t.stats["step_waits"] == waits + 1 and same_state(t, slot, saved)


def test_prefetch_from_another_thread_while_steps_go_on_keeps_every_state():
    """Prefetches from one thread and steps from another through a tight table: each symbol's step counter ends
    at the number of steps it took part in (a lost or mixed-up state would show)."""
    layout = {"count": ((), torch.int64, 0)}
    t = StateTable((layout, "cpu"), 3, host_capacity=12, reserve=1)
    symbols = [f"S{i}" for i in range(12)]
    stepped = dict.fromkeys(symbols, 0)
    stop = threading.Event()

    def prefetching():  # as requests arriving on the event loop's thread would
        rng = random.Random(1)
        while not stop.is_set():
            t.prefetch(rng.sample(symbols, 2))
            t.ready(rng.choice(symbols))
            time.sleep(0.0005)

    thread = threading.Thread(target=prefetching)
    thread.start()
    rng = random.Random(2)
    try:
        for _ in range(300):
            batch = rng.sample(symbols, rng.randint(1, 3))
            for symbol, slot in zip(batch, t.slots_for(batch)):
                t.tensors["count"][slot] += 1
                stepped[symbol] += 1
    finally:
        stop.set()
        thread.join()
    counts = {s: int(t.tensors["count"][t.slots_for([s])[0]]) for s in symbols}
    assert counts == stepped and t.stats["offloaded"] > 50


def test_a_process_ending_while_states_move_exits_cleanly():
    """The CPU's copy threads finish their queues at exit: stopped by the interpreter inside a torch copy, they
    would abort the process ("terminate called without an active exception")."""
    code = ("import torch\n"
            "from client.engine.fast.state_table import StateTable\n"
            "t = StateTable(({'h': ((16 << 20,), torch.float32, 0.0)}, 'cpu'), 2, host_capacity=8, reserve=1)\n"
            "for s in 'ABCDEFGH':\n"
            "    t.prefetch([s])\n")
    _exits_cleanly(code, runs=2)


def _exits_cleanly(code, runs):
    """Run `code` in fresh interpreters from the checkout: each exits 0, with no abort on the way out."""
    repo = Path(__file__).resolve().parents[1]
    for _ in range(runs):
        done = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, timeout=120,
                              env=checkout_env(repo))
        assert done.returncode == 0 and "terminate" not in done.stderr, done.stderr[-2000:]


@cuda
def test_a_process_ending_while_the_host_tier_pins_exits_cleanly():
    """Pinning stops at exit between two registrations: the interpreter stopping its thread as a registration
    returns would abort the process ("terminate called without an active exception"), as a run that ends before
    its host tier is pinned does."""
    code = ("import torch\n"
            "from client.engine.fast.state_table import StateTable\n"
            "t = StateTable(({'h': ((16 << 20,), torch.float32, 0.0)}, 'cuda'), 2, host_capacity=64)\n"
            "assert t.pinning\n")
    _exits_cleanly(code, runs=3)


def test_stopping_the_pinning_keeps_what_is_pinned_and_pins_no_more():
    """stop_pinning (at exit) returns once the piece under way is registered; nothing more is, and the tier holds
    what was pinned, one slot spare. On the CPU, through the pool's registration."""
    import weakref

    from client.engine.fast import state_table as module

    t = table(capacity=2, host_capacity=6)
    pool = t.parts[0].host
    registered, go_on = [], threading.Event()

    def pin_piece(offset, nbytes):
        registered.append(offset)
        if len(registered) == 2:
            go_on.wait()  # the second piece is under way while the stop comes

    pool.pin_piece = pin_piece
    t.free_host.clear()  # as a GPU table starts: every host slot joins the tier once pinned
    pool.pinned = 0
    t._pinning = threading.Thread(target=module._pin_host_tier, args=(weakref.ref(t), t.parts[0].device), daemon=True)
    t._pinning.start()
    while len(registered) < 2:
        time.sleep(0.001)
    stopping = threading.Thread(target=t.stop_pinning)
    stopping.start()
    time.sleep(0.05)
    assert stopping.is_alive()  # waits for the registration under way
    go_on.set()
    stopping.join(5)
    assert not stopping.is_alive() and len(registered) == 2 and not t.pinning
    assert pool.pinned == 2 and t.host_capacity == 1  # the pinned slots, one spare for swaps


@cuda
def test_the_host_tier_is_pinned_at_start_on_gpu():
    t = StateTable((LAYOUT, "cuda"), 3, host_capacity=5)
    reports = []
    t.wait_pinned(lambda done, total: reports.append((done, total)))
    pool = t.parts[0].host
    assert pool.pinned == pool.count == 6 and reports[-1] == (6, 6) and pool.slots.is_pinned()
    assert t.pin_s is not None


@cuda
def test_a_gpu_table_dropped_while_its_tier_pins_is_collected_and_its_pinning_ends():
    """Real registrations (8 GiB of host tier: seconds to pin): the table goes with its last reference, each piece
    is unregistered as its pool is collected (possibly in the pinning thread), and the thread ends."""
    import gc
    import weakref

    t = StateTable(({"s": ((2 << 20,), torch.float32, 0.0)}, "cuda"), 2, host_capacity=1024)
    while t.parts[0].host.pinned < 2:
        time.sleep(0.01)
    thread, dropped = t._pinning, weakref.ref(t)
    del t
    gc.collect()
    thread.join(timeout=30)
    gc.collect()
    assert dropped() is None and not thread.is_alive()
    after = StateTable(({"s": ((2 << 20,), torch.float32, 0.0)}, "cuda"), 2, host_capacity=4)
    after.wait_pinned()  # registrations still work after the unregistrations
    assert after.parts[0].host.slots.is_pinned()


@cuda
def test_a_slow_copy_delays_only_its_own_symbol_on_gpu():
    """On real streams: X's return sits behind a long sleep on its copy stream; a step of other symbols on the
    compute stream finishes without it, and X comes back byte for byte once ready."""
    def before_copy(symbol, direction):
        if (symbol, direction) == ("X", "to_gpu"):
            torch.cuda._sleep(2_000_000_000)  # about a second at GPU clocks

    def step(symbols):  # a "step" on the compute stream
        slots = t.slots_for(symbols)
        for name in LAYOUT:
            t.tensors[name][slots] += 1

    t = StateTable((LAYOUT, "cuda"), 4, host_capacity=4, reserve=1, before_copy=before_copy)
    t.wait_pinned()
    t.slots_for(["X"])
    write(t, 1, 7)
    saved = state_of(t, 1)
    # The step's kernels run once first: CUDA loads a kernel's module at its first launch (lazy loading), and
    # that load waits for the device to be idle, the sleep below included (seen on an H100, bench/LOG.md
    # section 37). The engine's kernels are all launched at startup (precompile, graph capture).
    step(["A", "B", "C"])  # X out, to keep a slot free
    torch.cuda.synchronize()
    assert list(t.offloaded) == ["X"]
    t.prefetch(["X"])  # into the free slot: nothing else moves
    began = time.perf_counter()
    for _ in range(5):
        step(["A", "B"])
    torch.cuda.current_stream().synchronize()
    quick = time.perf_counter() - began
    assert not t.ready("X"), (quick, t.stats, {slot: str(c) for slot, c in t.parts[0].slot_copy.items()})
    wait_until(lambda: t.ready("X"), timeout_s=30)
    slow = time.perf_counter() - began
    assert quick < slow / 4, (quick, slow)
    assert same_state(t, t.slots_for(["X"])[0], saved)


def move_states_on_real_streams(_=None):
    """200 steps of 1-3 of 9 symbols through 3 GPU slots and 8 host slots, with prefetches: (each symbol's count
    as its state holds it, as the steps made it, states restored ahead, torch's pinned allocations during the
    steps). Counted before the counts are read back: reading a CUDA scalar stages it through a pinned block of
    torch's host allocator, which the steps never use. Run in a process of its own: torch counts pinned
    allocations process-wide, and earlier tests' threads (a pipeline's engine) may allocate meanwhile."""
    t = StateTable((LAYOUT, "cuda"), 3, host_capacity=8, reserve=1)
    t.wait_pinned()
    host_allocations = torch.cuda.host_memory_stats().get("num_host_alloc", 0)
    rng = random.Random(3)
    symbols = [f"S{i}" for i in range(9)]
    counts = dict.fromkeys(symbols, 0)
    for _ in range(200):
        batch = rng.sample(symbols, rng.randint(1, 3))
        t.prefetch(rng.sample(symbols, 2))
        for symbol, slot in zip(batch, t.slots_for(batch)):
            t.tensors["count"][slot] += 1
            counts[symbol] += 1
    torch.cuda.synchronize()
    allocated = torch.cuda.host_memory_stats().get("num_host_alloc", 0) - host_allocations
    got = {s: int(t.tensors["count"][t.slots_for([s])[0]]) for s in symbols}
    return got, counts, t.stats["restored_ahead"], allocated


@cuda
def test_states_move_on_real_streams_bit_for_bit_with_no_host_allocation():
    """States come back bit for bit, and the steps allocate no host memory (a step never pins)."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        got, counts, restored_ahead, allocated = pool.apply(move_states_on_real_streams)
    assert got == counts and restored_ahead > 10
    assert allocated == 0


def fake_registration(monkeypatch, register):
    """Host tiers pinned (on the CPU nothing is), each registration through register(address, nbytes)."""
    from client.engine.fast import state_table as module

    monkeypatch.setattr(module, "_pins", lambda device: True)
    monkeypatch.setattr(module, "_register_host", register)
    monkeypatch.setattr(module, "_unregister_host", lambda address: None)


def test_host_slots_join_as_they_are_pinned_and_a_step_waits_only_for_a_slot_it_needs(monkeypatch):
    """The engine serves while its host tier pins (on a GPU, at ~3 GB/s): each slot joins the tier once pinned;
    prefetch never waits for one; a step that must move a state out of a full GPU waits for the next pinned slot,
    and the state comes back bit for bit."""
    gate, registered = threading.Event(), []
    fake_registration(monkeypatch, lambda address, nbytes: gate.wait(30) and registered.append(address))
    t = table(capacity=2, host_capacity=3)
    assert not t.free_host and t.pinning
    write(t, t.slots_for(["A"])[0], 5)
    saved = state_of(t, t.slot_of["A"])
    t.slots_for(["B"])
    t.prefetch(["C"])  # no pinned slot to move a state into: left to C's step, at once
    assert "C" not in t.slot_of
    stepped = threading.Thread(target=t.slots_for, args=(["C"],))
    stepped.start()
    stepped.join(0.3)
    assert stepped.is_alive() and "C" not in t.slot_of  # waits for a pinned host slot
    gate.set()
    stepped.join(10)
    assert not stepped.is_alive() and "C" in t.slot_of and list(t.offloaded) == ["A"]
    t.wait_pinned()
    assert not t.pinning and t.pin_s is not None and len(registered) == 4 and t.host_capacity == 3
    assert t.parts[0].host.pinned == 4
    assert same_state(t, t.slots_for(["A"])[0], saved)  # back from the host tier (the CPU's step waits for it)


def test_a_host_tier_that_fails_to_pin_keeps_what_it_pinned_and_refuses_the_rest(monkeypatch, capsys):
    """Pinning runs while the engine serves, so a failure cannot stop the start: the tier shrinks to the slots
    pinned (one kept spare for swaps), wait_pinned says why in one line, and a symbol beyond gets the error naming
    the limits while the others go on."""
    registered = []

    def register(address, nbytes):
        if len(registered) == 2:
            return "out of memory"
        registered.append(address)
    fake_registration(monkeypatch, register)
    t = table(capacity=1, host_capacity=5)
    with pytest.raises(ValueError, match=r"could not be pinned \(pinning host slot 2 of 6 failed: out of memory\)"):
        t.wait_pinned()
    assert t.host_capacity == 1 and len(t.free_host) == 2
    assert capsys.readouterr().err == ("[state table] the host tier holds 1 symbols, not more: pinning host slot 2 "
                                       "of 6 failed: out of memory; lower --host-symbols\n")
    write(t, t.slots_for(["A"])[0], 3)
    saved = state_of(t, t.slot_of["A"])
    t.slots_for(["B"])  # A into the host tier's one slot
    with pytest.raises(CapacityError, match="1 on the CPU and 1 in host memory"):
        t.slots_for(["C"])
    assert same_state(t, t.slots_for(["A"])[0], saved)


def test_a_tier_that_stops_pinning_after_states_moved_out_keeps_a_slot_spare_for_their_return(monkeypatch):
    """A new symbol's state moved into the last pinned host slot left none spare for a swap: once pinning failed,
    the state out there could never come back to the full GPU (each of its steps refused, unplaceable saying it
    fits). A new symbol now waits for a spare slot, and is refused once pinning has failed."""
    gate, registered = threading.Event(), []

    def register(address, nbytes):
        if registered:  # every slot after the first fails, once let go
            gate.wait(30)
            return "out of memory"
        registered.append(address)
    fake_registration(monkeypatch, register)
    t = table(capacity=1, host_capacity=3)
    wait_until(lambda: len(t.free_host) == 1)
    write(t, t.slots_for(["A"])[0], 3)
    saved, outcome = state_of(t, t.slot_of["A"]), []

    def step_b():
        try:
            outcome.append(t.slots_for(["B"]))
        except CapacityError as error:
            outcome.append(error)
    stepped = threading.Thread(target=step_b)
    stepped.start()
    stepped.join(0.3)
    gate.set()
    stepped.join(10)
    with pytest.raises(ValueError, match="could not be pinned"):
        t.wait_pinned()
    for symbol in t.symbols():  # every symbol held still steps
        assert t.unplaceable([symbol]) == []
        t.slots_for([symbol])
    assert isinstance(outcome[0], CapacityError) and outcome[0].symbols == ["B"] and t.symbols() == ["A"]
    assert same_state(t, t.slot_of["A"], saved)


def test_pinning_pauses_with_no_registration_under_way(monkeypatch):
    """pause_pinning (around a CUDA graph capture) returns once no registration runs, and none starts until
    resume_pinning; the tier then pins to the end."""
    running, registered = threading.Lock(), []

    def register(address, nbytes):
        assert running.acquire(blocking=False), "two registrations at once"
        time.sleep(0.002)
        registered.append(address)
        running.release()
    fake_registration(monkeypatch, register)
    t = table(capacity=2, host_capacity=60)
    wait_until(lambda: len(registered) >= 3)
    t.pause_pinning()
    assert not running.locked()
    paused_at = len(registered)
    time.sleep(0.05)
    assert len(registered) == paused_at and t.pinning
    t.resume_pinning()
    t.wait_pinned()
    assert len(registered) == 61 and len(t.free_host) == 61


def test_a_table_dropped_while_its_tier_pins_is_collected_its_memory_unregistered_and_the_thread_ends(monkeypatch):
    """The pinning thread held its table (a bound method) until the whole tier was pinned (a minute on a GPU for
    ~100 GiB): an engine dropped meanwhile kept its GPU states and host tier that long."""
    import gc
    import weakref

    from client.engine.fast import state_table as module

    registered, unregistered = [], []

    def register(address, nbytes):
        time.sleep(0.002)
        registered.append(address)
    fake_registration(monkeypatch, register)
    monkeypatch.setattr(module, "_unregister_host", unregistered.append)
    t = table(capacity=2, host_capacity=200)
    wait_until(lambda: len(registered) >= 3)
    thread, dropped = t._pinning, weakref.ref(t)
    del t
    gc.collect()
    thread.join(timeout=10)
    assert dropped() is None and not thread.is_alive()
    assert 3 <= len(registered) < 201 and sorted(unregistered) == sorted(registered)


def test_a_collected_tier_is_unregistered_on_its_gpu(monkeypatch):
    """Whichever thread collects a table unregisters its host tier: one on GPU 0 made a CUDA context there for a
    table on another GPU (bench/LOG.md section 74). Unregistered where the pinning thread registered it."""
    import contextlib

    from client.engine.fast import state_table as module

    current, unregistered = [None], []

    @contextlib.contextmanager
    def on(device):
        previous, current[0] = current[0], device
        yield
        current[0] = previous
    monkeypatch.setattr(torch.cuda, "device", on)
    gpu = torch.device("cuda", 1)
    module._unregister([1, 2], None, lambda address: unregistered.append((address, current[0])), gpu)
    assert unregistered == [(1, gpu), (2, gpu)] and current[0] is None
    module._unregister([3], None, lambda address: unregistered.append((address, current[0])), torch.device("cpu"))
    assert unregistered[-1] == (3, None)


def test_copies_split_where_the_host_registrations_do(monkeypatch):
    from client.engine.fast import state_table as module

    monkeypatch.setattr(module, "PIECE_BYTES", 16)
    assert module._piece_bounds(0, 40) == [(0, 16), (16, 32), (32, 40)]
    assert module._piece_bounds(10, 30) == [(0, 6), (6, 22), (22, 30)]  # bytes 10..40 of the slot
    assert module._piece_bounds(32, 16) == [(0, 16)] and module._piece_bounds(5, 0) == []
    src, dst = torch.arange(30, dtype=torch.uint8), torch.zeros(30, dtype=torch.uint8)
    module._copy_in_pieces(dst, src, 10)
    assert torch.equal(dst, src)


def test_a_failed_export_read_fails_that_export_alone(monkeypatch):
    """A host slot's read that fails (e.g. no memory for its copy) fails its export, not the copies of that host
    slot after it: the state comes back byte for byte."""
    t = table(capacity=1, host_capacity=2)
    write(t, t.slots_for(["A"])[0], 4)
    saved, exported = state_of(t, 1), t.export("A").result()
    t.slots_for(["B"])  # A to the host
    numpy = torch.Tensor.numpy

    def failing(tensor, *args, **kwargs):
        if threading.current_thread().name.startswith("state-export"):
            raise MemoryError("no memory for the copy")
        return numpy(tensor, *args, **kwargs)
    monkeypatch.setattr(torch.Tensor, "numpy", failing)
    with pytest.raises(MemoryError):
        t.export("A").result()
    monkeypatch.undo()
    slot = t.slots_for(["A"])[0]
    assert all(torch.equal(t.tensors[name][slot], saved[name]) for name in LAYOUT)
    t.slots_for(["C"])  # A to the host again
    assert np.array_equal(t.export("A").result(), exported)


def test_export_buffers_that_failed_to_allocate_are_allocated_at_the_next_try(monkeypatch):
    """A pinned buffer refused (host memory short) leaves none of a part's export buffers half made: the next
    export allocates them all, not a staging buffer without its pinned copy."""
    import client.engine.fast.state_table as state_table

    part = table().parts[0]
    monkeypatch.setattr(part, "device", torch.device("cuda", 0))  # ready_exports' GPU branch, without a GPU
    empty, refused = torch.empty, []

    def allocate(*args, pin_memory=False, device=None, **kwargs):
        if pin_memory and not refused:
            refused.append(True)
            raise RuntimeError("CUDA error: out of memory (pinned)")
        return empty(*args, **kwargs)
    monkeypatch.setattr(torch, "empty", allocate)
    monkeypatch.setattr(state_table, "own_stream", lambda device: "stream")
    with pytest.raises(RuntimeError, match="pinned"):
        part.ready_exports()
    part.ready_exports()
    assert part.staging is not None and part.staged is not None and part.export_stream == "stream"


class _DoneAtOnce:
    """A CUDA event or stream stand-in: the CPU copies it orders are done when enqueued."""

    def record(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def wait_event(self, event):
        pass


def _gpu_exports(monkeypatch, symbols):
    """A table whose exports take the GPU path with CUDA's events and streams stood in (_DoneAtOnce), each symbol's
    state a value of its own; (table, {symbol: its bytes})."""
    for name in ("Event", "current_stream"):
        monkeypatch.setattr(torch.cuda, name, lambda *args: _DoneAtOnce())
    for name in ("stream", "device"):
        monkeypatch.setattr(torch.cuda, name, lambda *args: contextlib.nullcontext())
    t = table(capacity=len(symbols))
    part = t.parts[0]
    part.staging, part.staged = (torch.empty(part.slot_bytes, dtype=torch.uint8) for _ in range(2))
    part.export_stream = _DoneAtOnce()
    for value, slot in enumerate(t.slots_for(symbols), start=1):
        write(t, slot, value)
    want = {symbol: np.concatenate([p.copy_of(t.slot_of[symbol]) for p in t.parts]) for symbol in symbols}
    monkeypatch.setattr(part, "device", torch.device("cuda", 0))  # export's GPU branch
    return t, want


def test_a_gpu_export_is_taken_out_on_the_export_thread_and_kept_by_no_one_else(monkeypatch):
    """The GPU path of export with CUDA's events and streams stood in: the copy out to pinned memory, in pieces, and
    the bytes' own array are made on the table's export thread, never by the thread that exports; the next export
    waits until the buffers are free; the bytes returned are the caller's alone (the table kept the last export's,
    let go on the thread that steps at the next export)."""
    import gc
    import weakref

    from client.engine.fast import state_table as module

    monkeypatch.setattr(module, "PIECE_BYTES", 16)  # several pieces a slot
    t, want = _gpu_exports(monkeypatch, ["A", "B", "C"])
    part, pieces, copy_ = t.parts[0], [], torch.Tensor.copy_

    def copy(dst, src, non_blocking=False):
        if dst.data_ptr() >= part.staged.data_ptr() and dst.data_ptr() < part.staged.data_ptr() + part.slot_bytes:
            pieces.append((threading.current_thread().name, dst.numel()))
        return copy_(dst, src, non_blocking=non_blocking)
    monkeypatch.setattr(torch.Tensor, "copy_", copy)
    exported = {symbol: t.export(symbol) for symbol in "ABC"}
    assert all(np.array_equal(exported[symbol].result(), want[symbol]) for symbol in "ABC")
    assert len(pieces) == 3 * -(-part.slot_bytes // 16) and all(size <= 16 for _, size in pieces)
    assert {name for name, _ in pieces} == {"state-export_0"}
    freed = weakref.ref(exported.pop("C").result())  # the last export
    gc.collect()
    assert freed() is None


def test_a_gpu_export_the_export_thread_refuses_fails_alone(monkeypatch):
    """An export whose hand-over to the export thread is refused (the interpreter shutting down: "cannot schedule
    new futures") raises, and leaves the next export to run: it waited for ever on a release no thread would set."""
    import concurrent.futures.thread as executors

    t, want = _gpu_exports(monkeypatch, ["A", "B"])
    monkeypatch.setattr(executors, "_shutdown", True)
    with pytest.raises(RuntimeError, match="shutdown"):
        t.export("A")
    monkeypatch.setattr(executors, "_shutdown", False)
    taken = {}
    thread = threading.Thread(target=lambda: taken.update(B=t.export("B").result()), daemon=True)
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive(), "the export after a refused one waits for ever"
    assert np.array_equal(taken["B"], want["B"])


def test_timed_transfers_are_placed_on_the_monotonic_clock_and_reset_forgets_them():
    """time_copies: each finished move's span is on time.monotonic()'s clock (where a step's times are), inside the
    window that saw it; transfer_seconds are those spans' lengths; reset_transfer_times starts afresh."""
    t = table(capacity=1, host_capacity=2, time_copies=True)
    began = time.monotonic()
    t.slots_for(["A"])
    t.slots_for(["B"])  # A to the host
    t.slots_for(["A"])  # A back, B out
    deadline = time.monotonic() + 10
    while len(t.transfer_spans()) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    spans = t.transfer_spans()
    assert [direction for direction, _, _ in spans].count("to_host") == 2 and len(spans) == 3
    assert all(began <= start <= end <= time.monotonic() for _, start, end in spans)
    assert [start for _, start, _ in spans] == sorted(start for _, start, _ in spans)
    assert sorted(seconds for _, _, seconds in t.transfer_seconds()) == sorted(end - start for _, start, end in spans)
    t.reset_transfer_times()
    assert t.transfer_spans() == [] and t.transfer_seconds() == []
