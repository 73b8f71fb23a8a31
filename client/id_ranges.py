"""A set of integer ids kept as sorted disjoint ranges: the runtime's ids whose answers left the cache.

Servers number requests in order and answers leave the cache about in that order, so the ids collapse to a few
ranges (one per id never answered: a rejected or failed request) instead of a set entry per request (~75 B,
60 MB at 1M requests). Ids in no order cost what a set costs.
"""
from bisect import bisect_right


class IdRanges:
    def __init__(self):
        self._starts: list[int] = []  # range i holds starts[i] <= id < ends[i]; ranges neither overlap nor touch
        self._ends: list[int] = []
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def __contains__(self, uid: int) -> bool:
        i = bisect_right(self._starts, uid) - 1
        return i >= 0 and uid < self._ends[i]

    def add(self, uid: int) -> None:
        i = bisect_right(self._starts, uid) - 1  # the last range starting at or before uid
        if i >= 0 and uid < self._ends[i]:
            return
        self._count += 1
        joins_left = i >= 0 and self._ends[i] == uid
        joins_right = i + 1 < len(self._starts) and self._starts[i + 1] == uid + 1
        if joins_left and joins_right:
            self._ends[i] = self._ends.pop(i + 1)
            del self._starts[i + 1]
        elif joins_left:
            self._ends[i] = uid + 1
        elif joins_right:
            self._starts[i + 1] = uid
        else:
            self._starts.insert(i + 1, uid)
            self._ends.insert(i + 1, uid + 1)

    def ranges(self) -> int:
        """How many ranges hold the ids (what the set's memory grows with)."""
        return len(self._starts)
