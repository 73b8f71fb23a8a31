"""A set of integer ids kept as sorted disjoint ranges: the runtime's ids whose answers left the cache.

Servers number requests in order and answers leave the cache about in that order, so the ids collapse to a few
ranges (the runtime adds the rejected or failed requests' ids too, as their neighbours leave the cache, else each
would split a range) instead of a set entry per request (~75 B, 60 MB at 1M requests). Ids in no order cost what a
set costs: an id that would make or merge ranges far from the end of the sorted lists goes to a plain set instead,
since moving the ranges after it cost each add time in proportion to the ranges held (~0.1 ms an answer at 1M
random ids, on the event loop).
"""
from bisect import bisect_right

# Ranges after an id's place that an add may move (a short memmove); an id further from the end goes to the set.
MAX_MOVED = 1024


class IdRanges:
    def __init__(self):
        # range i holds starts[i] <= id < ends[i]; ranges never overlap, and touch only where an add far from the end
        # joined two (their ids are still exactly the ranges')
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._loose: set[int] = set()  # ids in no range, added where a range would have moved many others
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def __contains__(self, uid: int) -> bool:
        i = bisect_right(self._starts, uid) - 1
        return i >= 0 and uid < self._ends[i] or uid in self._loose

    def add(self, uid: int) -> None:
        i = bisect_right(self._starts, uid) - 1  # the last range starting at or before uid
        if i >= 0 and uid < self._ends[i] or uid in self._loose:
            return
        self._count += 1
        joins_left = i >= 0 and self._ends[i] == uid
        joins_right = i + 1 < len(self._starts) and self._starts[i + 1] == uid + 1
        near_end = len(self._starts) - (i + 1) <= MAX_MOVED
        if joins_left and joins_right:
            if not near_end:  # one range's end moved instead: ranges that touch still hold exactly their ids
                self._ends[i] = uid + 1
                return
            self._ends[i] = self._ends.pop(i + 1)
            del self._starts[i + 1]
        elif joins_left:
            self._ends[i] = uid + 1
        elif joins_right:
            self._starts[i + 1] = uid
        elif near_end:
            self._starts.insert(i + 1, uid)
            self._ends.insert(i + 1, uid + 1)
        else:
            self._loose.add(uid)

    def ranges(self) -> int:
        """How many ranges hold the ids (what the set's memory grows with), each loose id one."""
        return len(self._starts) + len(self._loose)
