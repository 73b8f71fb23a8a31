"""Per-symbol FIFO queues and micro-batches of at most one request per symbol, oldest first.

Each symbol's requests reach the model strictly in arrival order, and no queue ever discards one:
a dropped request would desynchronise that symbol's state from the server's for the rest of the stream.
Not thread-safe: the runtime guards it with its own lock.
"""
import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Request:
    unique_id: int
    symbol: str
    features: np.ndarray  # float32 [79]
    received_at: float = 0.0  # time.perf_counter() on arrival, for local latency accounting
    seq: int = field(default=-1, compare=False)  # arrival sequence, set by Scheduler.push


class Scheduler:
    def __init__(self):
        self._queues: dict[str, deque[Request]] = {}
        # (seq of the queue's head, symbol) for every non-empty queue: the oldest heads pop first.
        self._heads: list[tuple[int, str]] = []
        self._arrivals = itertools.count()
        self._pending = 0

    def __len__(self) -> int:
        """Requests waiting in all queues."""
        return self._pending

    def push(self, request: Request) -> None:
        """Queue a request behind its symbol's earlier ones (call in arrival order)."""
        request.seq = next(self._arrivals)
        queue = self._queues.setdefault(request.symbol, deque())
        if not queue:
            heapq.heappush(self._heads, (request.seq, request.symbol))
        queue.append(request)
        self._pending += 1

    def waiting_symbols(self) -> int:
        """Symbols with at least one queued request: the size of the next batch (before max_batch)."""
        return len(self._heads)

    def next_batch(self, max_batch: int | None = None) -> list[Request]:
        """Dequeue the oldest head of up to `max_batch` symbols (all symbols with work when None)."""
        if max_batch is not None and max_batch < 1:
            raise ValueError(f"max_batch must be a positive integer or None, got {max_batch!r}")
        batch = []
        while self._heads and (max_batch is None or len(batch) < max_batch):
            _, symbol = heapq.heappop(self._heads)
            batch.append(self._queues[symbol].popleft())
        # Re-enter the symbols' next heads only now, so that no symbol appears twice in one batch.
        for request in batch:
            queue = self._queues[request.symbol]
            if queue:
                heapq.heappush(self._heads, (queue[0].seq, request.symbol))
        self._pending -= len(batch)
        return batch
