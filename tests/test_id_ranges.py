"""IdRanges holds exactly the ids added, and ids added about in order take a few ranges."""
import random

import pytest

from client.id_ranges import IdBits, IdRanges


def test_same_members_as_a_set_in_any_order():
    rng = random.Random(0)
    for trial in range(50):
        ids, added = IdRanges(), set()
        for _ in range(300):
            uid = rng.randrange(-40, 40) if trial % 2 else rng.randrange(2**64)
            ids.add(uid)
            added.add(uid)
            assert len(ids) == len(added)
        probe = range(-45, 45) if trial % 2 else added
        assert all((uid in ids) == (uid in added) for uid in probe)
        if trial % 2:
            # ranges are maximal: as many as runs of consecutive members
            runs = sum(1 for uid in added if uid - 1 not in added)
            assert ids.ranges() == runs


def test_ids_about_in_order_collapse_to_their_holes():
    rng = random.Random(1)
    ids = list(range(100_000))
    for start in range(0, len(ids), 64):  # answered out of order within each step of 64
        block = ids[start:start + 64]
        rng.shuffle(block)
        ids[start:start + 64] = block
    holes = set(rng.sample(range(100_000), 10))  # rejected requests: never cached, never evicted
    evicted = IdRanges()
    for uid in ids:
        if uid not in holes:
            evicted.add(uid)
    assert len(evicted) == 100_000 - 10
    assert evicted.ranges() <= 11
    assert all(uid not in evicted for uid in holes)
    assert 99_999 in evicted or 99_999 in holes
    assert -1 not in evicted and 100_000 not in evicted


class _CountingList(list):
    """A list that counts the items its inserts and pops in the middle move (what they cost)."""
    moved = 0

    def insert(self, index, item):
        _CountingList.moved += max(len(self) - index, 0)
        super().insert(index, item)

    def pop(self, index=-1):
        _CountingList.moved += len(self) - 1 - (index % len(self))
        return super().pop(index)

    def __delitem__(self, index):
        _CountingList.moved += len(self) - 1 - (index % len(self))
        super().__delitem__(index)


@pytest.mark.parametrize("order", ["random", "evens_then_odds"])
def test_ids_in_no_order_cost_each_add_what_a_set_costs(order):
    """Ids in no order (a server's random ids, or ones that fill the holes between earlier ones) each made or merged
    ranges in the middle of the sorted lists: every add moved the ranges after it, ~0.1 ms an answer at 1M ids on
    the event loop."""
    n = 20_000
    if order == "random":
        ids = random.Random(2).sample(range(2**62), n)
    else:
        ids = list(range(0, n, 2)) + list(range(1, n, 2))  # each odd id joins two ranges
    evicted = IdRanges()
    evicted._starts, evicted._ends = _CountingList(), _CountingList()
    _CountingList.moved = 0
    for uid in ids:
        evicted.add(uid)
    assert _CountingList.moved <= 2 * 1024 * n  # at most a short tail a list and an add (before: ~n / 2 each)
    assert len(evicted) == n and all(uid in evicted for uid in ids)
    assert not any(uid in evicted for uid in (-1, n, n + 1) if uid not in ids)


@pytest.mark.parametrize("held_symbols", [(0,), (1, 0, 2)])
def test_ids_of_bursts_answered_late_leave_no_ranges_behind(held_symbols):
    """A shard late to answer holds its symbols' requests back while the others' answers leave the cache; their ids,
    answered later, fill holes far from the end of the ranges, and were left apart: two ranges touching, or loose ids
    (a middle one answered first), each for good (23,976 ranges for a burst of 25,000, ~77 B an id). Joined once
    they are half the pieces, a few stay."""
    evicted, bursts, every, held_for = IdRanges(), 6, 100_000, 40_000
    for first in range(0, bursts * every, every):
        for uid in range(first, first + every):
            if uid % 8 not in held_symbols or uid >= first + held_for:
                evicted.add(uid)
            if uid == first + held_for:  # their answers, a symbol at a time
                for symbol in held_symbols:
                    for late in range(first + symbol, first + held_for, 8):
                        evicted.add(late)
    assert len(evicted) == bursts * every and all(uid in evicted for uid in range(0, bursts * every, 7))
    assert -1 not in evicted and bursts * every not in evicted
    assert evicted.ranges() <= 2 * 1024  # before: 4,000-8,700 more a burst


def test_id_bits_hold_the_same_members_as_a_set():
    rng = random.Random(3)
    for trial in range(40):
        bits, added = IdBits(), set()
        for _ in range(300):
            uid = rng.randrange(-3000, 3000) if trial % 2 else rng.randrange(-2**64, 2**64)
            bits.add(uid)
            added.add(uid)
        probe = range(-3100, 3100) if trial % 2 else added | {uid + 1 for uid in added} | {uid - 1 for uid in added}
        assert all((uid in bits) == (uid in added) for uid in probe)
