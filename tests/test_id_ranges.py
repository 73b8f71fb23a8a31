"""IdRanges holds exactly the ids added, and ids added about in order take a few ranges."""
import random

from client.id_ranges import IdRanges


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
