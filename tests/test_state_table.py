"""The state table's tiers on the CPU: slots allocated once, slot reuse, LRU offload to host memory and return
byte for byte, idle expiry, the capacity error, a table spanning several devices."""
import pytest
import torch

from client.engine.fast.state_table import ALIGN, PAD_SLOT, CapacityError, StateTable, slot_layout

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
    with pytest.raises(CapacityError, match=r"2 on the GPU and 1 in host memory") as error:
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


@pytest.mark.parametrize("kwargs", [{"capacity": 0}, {"host_capacity": -1}, {"reserve": -2},
                                    {"idle_timeout_s": 0}])
def test_bad_limits_are_rejected(kwargs):
    with pytest.raises(ValueError):
        table(**{"capacity": 2, **kwargs})
