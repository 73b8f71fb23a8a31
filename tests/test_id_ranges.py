"""IdRanges holds exactly the ids added, and ids added about in order take a few ranges."""
import random

import pytest

from client import id_ranges
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


def _touching(ids):
    """Pairs of an IdRanges' pieces (ranges, loose ids) that touch, counted from its lists."""
    pieces = sorted([*zip(ids._starts, ids._ends), *((uid, uid + 1) for uid in ids._loose)])
    return sum(end == start for (_, end), (start, _) in zip(pieces, pieces[1:]))


def _orders(n, rng):
    ids, tenth = list(range(n)), n // 10
    # one symbol's ids (every 8th) answered a tenth of the stream late, each alone or a tenth's at once
    late_alone = sorted(ids, key=lambda uid: uid + tenth + 0.5 if uid % 8 == 3 else uid)
    bursts = [uid for first in range(0, n + 2 * tenth, tenth) for uid in
              [uid for uid in ids[first:first + tenth] if uid % 8 != 3] +
              [uid for uid in ids[first - 2 * tenth:first - tenth] if uid % 8 == 3 and first >= 2 * tenth]]
    return {
        "in order": ids, "reverse": ids[::-1], "random": rng.sample(ids, n),
        "evens then odds": ids[0::2] + ids[1::2], "strides of 3": ids[0::3] + ids[1::3] + ids[2::3],
        "pairs far apart": ids[0::4] + ids[2::4] + ids[1::4] + ids[3::4],
        "middle out": [uid for pair in zip(ids[n // 2:], ids[n // 2 - 1::-1]) for uid in pair],
        "late alone": late_alone, "late in bursts": bursts,
    }.items()


@pytest.mark.parametrize("max_moved", [2, 16, 1024])
def test_any_order_keeps_exact_members_and_touching_pieces_and_tidies_in_linear_time(max_moved, monkeypatch):
    """The count of touching pieces is what a tidy joins and when it runs: one too few left pieces apart for good,
    one too many ran the pass over every range again and again. Against a set and a count from the lists, in orders
    that touch pieces far from the end (a short reach, 2 or 16, makes every order do that often)."""
    monkeypatch.setattr(id_ranges, "MAX_MOVED", max_moved)
    n = 30_000 if max_moved == 1024 else 3_000
    for name, order in _orders(n, random.Random(max_moved)):
        assert sorted(order) == list(range(n)), name
        ids, added, tidied = IdRanges(), set(), [0]
        tidy = ids._tidy

        def counted_tidy():
            tidied[0] += ids.ranges()
            tidy()
        ids._tidy = counted_tidy
        for step, uid in enumerate(order):
            ids.add(uid)
            added.add(uid)
            if step % (n // 7) == 0:
                assert ids._touching == _touching(ids), name
        assert len(ids) == len(added) == n, name
        assert ids._touching == _touching(ids), name
        assert all((uid in ids) == (uid in added) for uid in range(-3, n + 3)), name
        assert tidied[0] <= 4 * n, name  # each tidy's pieces are at most twice the pairs, each an add's or two


def test_a_range_added_whole_holds_its_ids_and_joins_or_falls_back_to_each_id():
    """add_range past every id held (a restart's ids of its journal's deleted segments) is one range, joined to one
    it touches; a range among the ids held, or with loose ids, is added id by id: the same members as a set."""
    ids = IdRanges()
    ids.add_range(0, 10)
    ids.add_range(10, 20)
    ids.add_range(30, 35)
    ids.add_range(5, 5)  # empty
    assert ids.ranges() == 2 and len(ids) == 25 and all(uid in ids for uid in [*range(20), *range(30, 35)])
    assert 20 not in ids and 29 not in ids and 35 not in ids
    ids.add_range(18, 32)  # among them: id by id
    assert len(ids) == 35 and ids.ranges() == 1 and all(uid in ids for uid in range(35))
