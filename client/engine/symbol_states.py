"""The reference engine's per-symbol states in a bounded table, with the fast engine's tiers and limits.

`capacity` symbols hold their state on the engine's device; when a step needs room, the least recently used
states move to host memory (up to `host_capacity` of them) and come back, unchanged, on their next request; a
symbol idle for `idle_timeout_s` is forgotten (its next request starts a fresh state, as a new symbol's does). A
symbol that fits in no tier gets a CapacityError naming the limits, and nothing else changes. On a CPU device
the host tier is the same memory: it only adds room.

The step reads and writes states through the mapping interface (`symbol in states`, `states.get(symbol)`,
`states.update(...)`) after `place(symbols)` has made every symbol of the step resident.
"""
import heapq
import time
from collections import OrderedDict
from collections.abc import MutableMapping

from client.engine.base import CapacityError, idle_symbols, is_count


class SymbolStates(MutableMapping):
    def __init__(self, device, capacity: int, host_capacity: int = 0, idle_timeout_s=None, clock=time.monotonic):
        if not (is_count(capacity, 1) and is_count(host_capacity, 0)):
            raise ValueError(f"need whole numbers capacity >= 1 and host_capacity >= 0, got {capacity!r} and "
                             f"{host_capacity!r}")
        if idle_timeout_s is not None and not idle_timeout_s > 0:
            raise ValueError(f"idle_timeout_s must be positive (or None: never), got {idle_timeout_s}")
        self.device, self.capacity, self.host_capacity = device, capacity, host_capacity
        self.idle_timeout_s, self.clock = idle_timeout_s, clock
        self._states: dict[str, dict] = {}  # symbol -> its state, in order of first sight
        self._on_host: set[str] = set()      # symbols whose state waits in host memory
        self._last_seen: OrderedDict[str, float] = OrderedDict()  # in order of last use: the idle ones first
        self.stats = {"offloaded": 0, "restored": 0, "expired": 0, "released": 0}
        self._expired: dict[str, None] | None = None  # forgotten as idle since take_expired (None: not asked)

    # ---- the mapping the step reads and writes ------------------------------------------------------
    def __contains__(self, symbol) -> bool:
        return symbol in self._states

    def __getitem__(self, symbol) -> dict:
        if symbol in self._on_host:
            raise RuntimeError(f"the state of {symbol} is in host memory: place() the step's symbols first")
        return self._states[symbol]

    def __setitem__(self, symbol, state) -> None:
        self._states[symbol] = state
        # never before the latest (a clock that steps back), so that idle_symbols reads _last_seen in time order
        now = self.clock()
        self._last_seen[symbol] = max(now, next(reversed(self._last_seen.values()), now))
        self._last_seen.move_to_end(symbol)

    def __delitem__(self, symbol) -> None:
        if symbol not in self._states:
            raise KeyError(symbol)
        self.pop(symbol)

    def __iter__(self):
        return iter(self._states)

    def __len__(self) -> int:
        return len(self._states)

    def pop(self, symbol, default=None):
        """Forget symbol's state (either tier); returns it, or default for a symbol not held."""
        if symbol in self._states:
            self.stats["released"] += 1
        return self._forget(symbol, default)

    def held(self, symbol) -> dict | None:
        """Symbol's state in whichever tier holds it (None for a symbol not held), without moving it."""
        return self._states.get(symbol)

    @property
    def on_host(self) -> int:
        return len(self._on_host)

    # ---- placing a step's symbols -------------------------------------------------------------------
    def unplaceable(self, symbols, at_once=True) -> list[str]:
        """The symbols of one step that fit in no tier (no side effects; idle symbols count as gone). at_once=False:
        a step placed in groups of at most `capacity` symbols, which needs room in the tiers only."""
        batch = list(dict.fromkeys(symbols))
        if at_once and len(batch) > self.capacity:
            return batch[self.capacity:]
        new = [s for s in batch if s not in self._states]
        room = self.capacity + self.host_capacity - len(self._states)
        room += len(idle_symbols(self._last_seen, self.clock(), self.idle_timeout_s, set(batch)))
        return new[max(room, 0):]

    def place(self, symbols, keep=()) -> None:
        """Make every symbol of a step resident on the device, with room for the new ones: forget idle symbols,
        move least recently used ones to host memory, bring this step's back. CapacityError (changing nothing)
        when some fit in no tier. keep: the symbols of the step's other groups (a step placed in groups), which
        are not forgotten as idle meanwhile: their requests are in the step."""
        rejected = self.unplaceable(symbols)
        if rejected:
            raise self.capacity_error(rejected)
        batch = set(symbols)
        for symbol in idle_symbols(self._last_seen, self.clock(), self.idle_timeout_s, batch | set(keep)):
            self._forget(symbol)
            self.stats["expired"] += 1
            if self._expired is not None:
                self._expired[symbol] = None
        back = [s for s in dict.fromkeys(symbols) if s in self._on_host]
        new = sum(1 for s in batch if s not in self._states)
        resident = len(self._states) - len(self._on_host)
        # the least recently used residents, taken in one scan of the table (one scan for each took a step of 64 new
        # symbols 79 ms with 20,000 symbols in host memory)
        for symbol in heapq.nsmallest(resident + len(back) + new - self.capacity,
                                      (s for s in self._states if s not in self._on_host and s not in batch),
                                      key=self._last_seen.__getitem__):
            self._offload(symbol)
        for symbol in back:
            self._states[symbol] = {name: t.to(self.device) for name, t in self._states[symbol].items()}
            self._on_host.discard(symbol)
            self.stats["restored"] += 1

    def take_expired(self) -> list[str]:
        """The symbols forgotten as idle since the last call that hold no state now; the first call starts keeping
        them."""
        expired = [symbol for symbol in self._expired or () if symbol not in self._states]
        self._expired = {}
        return expired

    def capacity_error(self, rejected) -> CapacityError:
        """The error that names the limits for symbols that fit in no tier."""
        return CapacityError.no_room(rejected, f"{self.capacity} on {self.device} and {self.host_capacity} in host "
                                     f"memory", "--state-memory (or --state-slots)")

    # ---- internals ----------------------------------------------------------------------------------
    def _offload(self, symbol) -> None:
        self._states[symbol] = {name: t.to("cpu") for name, t in self._states[symbol].items()}
        self._on_host.add(symbol)
        self.stats["offloaded"] += 1

    def _forget(self, symbol, default=None):
        self._on_host.discard(symbol)
        self._last_seen.pop(symbol, None)
        return self._states.pop(symbol, default)
