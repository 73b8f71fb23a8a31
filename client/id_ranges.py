"""A set of integer ids kept as sorted disjoint ranges: the runtime's ids whose answers left the cache.

Servers number requests in order and answers leave the cache about in that order, so the ids collapse to a few
ranges (the runtime adds the rejected or failed requests' ids too, as their neighbours leave the cache, else each
would split a range) instead of a set entry per request (~75 B, 60 MB at 1M requests). Ids in no order cost what a
set costs: an id that would make or merge ranges far from the end of the sorted lists goes to a plain set instead,
since moving the ranges after it cost each add time in proportion to the ranges held (~0.1 ms an answer at 1M
random ids, on the event loop), and two ranges that an id joins far from the end are left touching. Once half the
pieces (ranges, loose ids) touch the next, one pass joins them: the ids of a burst answered late (a shard late to
answer holds its symbols' requests back, and their ids then fill holes far from the end) each kept a piece of their
own for good. IdBits keeps ids in no ranges (every few ids) a bit each.
"""
import heapq
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
        self._touching = 0  # pairs of pieces (ranges, loose ids) that touch: what a tidy joins
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
        if joins_left and joins_right and near_end:
            self._ends[i] = self._ends.pop(i + 1)
            del self._starts[i + 1]
        elif joins_left and joins_right:  # one range's end moved: ranges that touch still hold exactly their ids
            self._ends[i] = uid + 1
            self._touching += 1
        elif joins_left:
            self._ends[i] = uid + 1
        elif joins_right:
            self._starts[i + 1] = uid
        elif near_end:
            self._starts.insert(i + 1, uid)
            self._ends.insert(i + 1, uid + 1)
        else:
            self._loose.add(uid)
        if self._loose:  # a loose id beside it touches it (beside a range's end there is none)
            self._touching += (uid - 1 in self._loose) + (uid + 1 in self._loose)
        if self._touching >= MAX_MOVED and 2 * self._touching >= len(self._starts) + len(self._loose):
            self._tidy()

    def add_range(self, start: int, end: int) -> None:
        """Add every id of [start, end): as one range where it lies past every id held (a restarted client's ids of
        its journal's deleted segments, before any other), else id by id."""
        if start >= end:
            return
        if self._loose or (self._ends and start < self._ends[-1]):
            for uid in range(start, end):
                self.add(uid)
            return
        self._count += end - start
        if self._ends and start == self._ends[-1]:
            self._ends[-1] = end
        else:
            self._starts.append(start)
            self._ends.append(end)

    def _tidy(self) -> None:
        """Join every two pieces that touch: done once MAX_MOVED and half the pieces do, the pass over the ranges costs
        each join a few steps. Left apart, each id of a burst answered late kept ~77 B for good (a burst of 25,000
        ids answered 200,000 later: 23,976 ranges more)."""
        starts, ends = [], []
        for start, end in heapq.merge(zip(self._starts, self._ends), ((uid, uid + 1) for uid in sorted(self._loose))):
            if ends and ends[-1] == start:
                ends[-1] = end
            else:
                starts.append(start)
                ends.append(end)
        self._starts, self._ends, self._loose, self._touching = starts, ends, set(), 0

    def ranges(self) -> int:
        """How many ranges hold the ids (what the set's memory grows with), each loose id one."""
        return len(self._starts) + len(self._loose)


# Ids a chunk of IdBits holds, a bit each: a chunk is kept once one of its ids is added.
BITS_CHUNK = 1024


class IdBits:
    """A set of integer ids as bits, in chunks of BITS_CHUNK consecutive ids (~0.25 B an id of the chunks kept): the
    runtime's ids refused long ago, told apart from the answers gone from the cache beside them (a lost shard's
    symbols' requests, every few ids: a set took ~60 B an id, ranges a range each)."""

    def __init__(self):
        self._chunks: dict[int, bytearray] = {}

    def __contains__(self, uid: int) -> bool:
        chunk = self._chunks.get(uid // BITS_CHUNK)
        return chunk is not None and (chunk[(uid % BITS_CHUNK) >> 3] >> (uid & 7)) & 1 == 1

    def add(self, uid: int) -> None:
        chunk = self._chunks.get(uid // BITS_CHUNK)
        if chunk is None:
            chunk = self._chunks[uid // BITS_CHUNK] = bytearray(BITS_CHUNK // 8)
        chunk[(uid % BITS_CHUNK) >> 3] |= 1 << (uid & 7)
