"""The model behind a small interface: one batched step over requests of several symbols, run now or submitted.

A step's rows are requests: a symbol may appear several times, in arrival order, and row i of the result is the
prediction after request i (the symbol's state advanced through its earlier rows of the step first)."""
import numbers
import sys
import threading
from abc import ABC, abstractmethod

import numpy as np

from client.constants import NUM_FEATURES, NUM_TOWERS  # noqa: F401  (NUM_TOWERS: for engines)


def symbol_list(symbols) -> list:
    """The symbols given to step, release or prefetch, as a list of strings (a numpy str_ is one). A lone string is
    refused: iterated, it was one symbol per character (release("AAPL") forgot A, P and L, and kept AAPL); so is an
    element that is no string, as step's rows are (release ignored an int, bytes or None, and the fast engine's
    prefetch gave each a slot of its state table)."""
    if isinstance(symbols, (str, bytes)):
        raise ValueError(f"symbols must be a list of strings, got the string {symbols!r}")
    try:
        symbols = list(symbols)
    except TypeError:
        raise ValueError(f"symbols must be a list of strings, got {symbols!r}") from None
    _check_strings(symbols)
    return symbols


def _check_strings(symbols) -> None:
    for row, symbol in enumerate(symbols):
        if not isinstance(symbol, str):  # the row named, as client/streams.py names it
            raise ValueError(f"symbols must be strings; row {row} holds {symbol!r} ({type(symbol).__name__})")


def state_symbol(symbol) -> str:
    """The symbol given to export_state or import_state: one string, refused otherwise as symbol_list refuses."""
    if not isinstance(symbol, str):
        raise ValueError(f"a symbol must be a string, got {symbol!r} ({type(symbol).__name__})")
    return symbol


def state_data(data, size) -> np.ndarray:
    """The bytes given to import_state as a 1-D uint8 array (bytes-like, or the array export gave): ValueError
    naming the sizes where it is not `size` bytes."""
    array = data if isinstance(data, np.ndarray) else np.frombuffer(data, dtype=np.uint8)
    if array.dtype != np.uint8 or array.ndim != 1:
        raise ValueError(f"a state is bytes or a 1-D uint8 array, got {array.dtype} of shape {array.shape}")
    if array.size != size:
        raise ValueError(f"a state of this engine is {size} bytes, got {array.size}")
    return array


def check_step_inputs(symbols, features) -> np.ndarray:
    """Validate one step's inputs; return the features as C-contiguous float32 [B, 79].

    Engines call this before touching any state, so a bad step leaves every symbol as it was.
    """
    _check_strings(symbols)
    torch = sys.modules.get("torch")  # loaded where a tensor is given: the client's names import without it
    if torch is not None and isinstance(features, torch.Tensor):  # numpy reads none that requires grad or is bf16
        features = features.detach().cpu()
        # float64 kept for the range check below (cast here, a value past float32's range was told as not finite)
        features = features.float() if features.is_floating_point() and features.dtype != torch.float64 else features
    features = np.asarray(features)
    # no rows as an empty list ([]) has no width to read: it is the (0, 79) step; with symbols, the error below names
    # the shape given, (0,), not (0, 79)
    if features.shape == (0,) and len(symbols) == 0:
        features = features.reshape(0, NUM_FEATURES)
    if features.shape != (len(symbols), NUM_FEATURES):
        raise ValueError(f"features must have shape ({len(symbols)}, {NUM_FEATURES}) for "
                         f"{len(symbols)} symbols, got {features.shape}")
    if features.dtype.kind != "f":
        raise ValueError(f"features must be floating point, got {features.dtype}")
    if features.dtype.itemsize > 4:  # cast, a finite float64 past float32's range became inf, told as not finite
        big = np.flatnonzero((np.abs(features) > np.finfo(np.float32).max) & np.isfinite(features))
        if big.size:
            bad_rows = np.unique(big // NUM_FEATURES)
            raise ValueError(f"features in rows {_rows(bad_rows, symbols)} exceed float32's range (max |value| "
                             f"{np.abs(features.reshape(-1)[big]).max():.4g})")
    features = np.ascontiguousarray(features, dtype=np.float32)
    if not np.isfinite(features).all():
        bad_rows = np.flatnonzero(~np.isfinite(features).all(axis=1))
        raise ValueError(f"non-finite features in rows {_rows(bad_rows, symbols)}")
    return features


def _rows(rows, symbols) -> str:
    """The first rows of a step, with their symbols, as its errors name them."""
    return f"{rows.tolist()[:8]} (symbols {[symbols[i] for i in rows[:8]]})"


def is_count(value, minimum) -> bool:
    """Whether value is a whole number (not a bool) of at least minimum, as the engines' counts of symbols must be
    (a float such as 2.5 was taken, and failed later in a step or an allocation with an error naming neither)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= minimum


def idle_symbols(last_seen, now, idle_timeout_s, exclude) -> list[str]:
    """The symbols of `last_seen` (an ordered map symbol -> last use, least recent first) idle past idle_timeout_s
    (None: never), outside `exclude`: its front, read up to the first one seen since, not the whole table (a step's
    placement is on its latency path: whole scans, three a step, took 4 ms a step with 20,000 symbols)."""
    if idle_timeout_s is None:
        return []
    idle = []
    for symbol, seen in last_seen.items():
        if now - seen <= idle_timeout_s:
            break
        if symbol not in exclude:
            idle.append(symbol)
    return idle


class CapacityError(RuntimeError):
    """Symbols that fit in no tier of an engine's state table; `symbols` lists them."""

    def __init__(self, message, symbols):
        super().__init__(message)
        self.symbols = list(symbols)

    def __reduce__(self):  # pickled whole (a shard's error crossing a process or Ray)
        return type(self), (str(self), self.symbols)

    @classmethod
    def no_room(cls, rejected, tiers, raise_option):
        """The error that names the limits: `tiers` says what they hold ("342 on the GPU"), `raise_option` which
        option gives the first tier more."""
        return cls(f"no room for the state of {len(rejected)} symbol(s) ({', '.join(rejected[:5])}"
                   f"{', ...' if len(rejected) > 5 else ''}): {tiers} are all in use; raise {raise_option} or "
                   f"--host-symbols, or let idle symbols expire (--idle-timeout)", rejected)


class Sequences:
    """A step's rows grouped by symbol: `symbols` distinct, in order of first appearance; `order` the row
    indices symbol by symbol, each symbol's in arrival order; `lengths` rows per symbol. Row order[i] of the
    step is row i of the grouped step."""

    def __init__(self, symbols):
        rows: dict[str, list[int]] = {}
        for row, symbol in enumerate(symbols):
            rows.setdefault(symbol, []).append(row)
        self.symbols = list(rows)
        self.lengths = [len(r) for r in rows.values()]
        self.order = np.fromiter((row for r in rows.values() for row in r), dtype=np.int64, count=len(symbols))
        self.max_length = max(self.lengths, default=0)

    def rounds(self) -> list[np.ndarray]:
        """Row indices of the step by occurrence: round j holds the j-th request of every symbol that has one,
        so stepping the rounds in order, each a batch of distinct symbols, is stepping the requests in order."""
        rounds: list[list[int]] = [[] for _ in range(self.max_length)]
        start = 0
        for length in self.lengths:
            for j in range(length):
                rounds[j].append(int(self.order[start + j]))
            start += length
        return [np.asarray(r, dtype=np.int64) for r in rounds]


class PendingStep:
    """A submitted step's outcome: result() blocks until it is ready and returns it, the same object on
    every call and from any thread (the lock makes the first caller the only one that fetches it).

    done() says, without waiting, whether result() would return at once: `poll` (a callable) is asked while the
    step is on its way; a step without one cannot tell and says True (its result() then waits)."""

    def __init__(self, fetch=None, *, value=None, poll=None):
        self._fetch, self._value, self._poll = fetch, value, poll
        self._lock = threading.Lock()

    @classmethod
    def completed(cls, value) -> "PendingStep":
        return cls(value=value)

    def done(self) -> bool:
        return self._fetch is None or self._poll is None or bool(self._poll())

    def result(self):
        with self._lock:
            if self._fetch is not None:
                self._value = self._fetch()
                self._fetch = None
            return self._value


class Engine(ABC):
    """Keeps one recurrent state per symbol and advances the given symbols by one request each.

    A symbol gets a fresh state on first sight, so the number of symbols is never needed up front.
    """

    name: str = "engine"

    @abstractmethod
    def step(self, symbols: list[str], features: np.ndarray) -> np.ndarray:
        """Advance each symbol's state through its rows, in order (a symbol may appear several times: one
        request each); return float32 predictions [B, 4] in tower order, row i the prediction after request i.

        Raises ValueError on a wrong shape or non-finite features, touching no state.
        """

    def submit(self, symbols: list[str], features: np.ndarray) -> PendingStep:
        """Start a step; its PendingStep's result() gives step's predictions. Steps submitted one after
        another advance the states in submission order. Validation errors raise here, touching no state.

        This default runs the step at once; engines that can overlap the host with the device override it.
        """
        return PendingStep.completed(self.step(symbols, features))

    @property
    @abstractmethod
    def symbols(self) -> list[str]:
        """The symbols whose state this engine holds, in order of first sight."""

    @abstractmethod
    def release(self, symbols) -> None:
        """Forget these symbols' states (they left); unknown symbols are ignored."""

    def expired(self) -> list[str]:
        """The symbols this engine forgot as idle (its idle timeout) since the last call and holds no state of now
        (a sharded engine's shards report them with each step's answer). The first call starts keeping them: an
        engine never asked keeps none. None by default (an engine that never forgets a symbol)."""
        return []

    # Whether prefetch and ready have anything to do (a state may be away from where steps run): an engine that
    # overrides them says so.
    moves_states = False

    def prefetch(self, symbols) -> None:
        """Requests for these symbols arrived: an engine that keeps states in tiers starts moving theirs to where
        its steps run, without waiting. Thread-safe: the runtime calls it on receive while another thread steps.
        A no-op by default, which refuses a lone string as every engine does."""
        symbol_list(symbols)

    def ready(self, symbol) -> bool:
        """False while the symbol's state is still on its way (after prefetch), so that the scheduler holds the
        symbol back while others step. Thread-safe; True by default."""
        return True

    def unplaceable(self, symbols) -> dict[str, str]:
        """{symbol: why} for the symbols of a step that this engine has no room for, without side effects. An
        engine without a bound on its symbols has room for all. A lone string is refused, as step refuses it."""
        symbol_list(symbols)
        return {}

    def state_layout(self) -> dict | None:
        """A JSON-able description of the bytes export_state gives: the engine, its total "bytes", and every
        component's name, shape and dtype in order (where it lies, where that depends on more). Two engines with
        equal layouts import each other's exports bit for bit. None by default: this engine cannot export. Asked
        by whoever will export: an engine may make ready for exports here (the fast engine's buffers)."""
        return None

    def export_state(self, symbol) -> PendingStep:
        """One symbol's state, as every step submitted before this call leaves it and none submitted after: its
        result() is a 1-D, C-contiguous uint8 array of its own (state_layout's bytes), or None where the engine
        holds no state of the symbol (never seen, released, forgotten as idle: its next request starts afresh).
        Changes no state. Called from the thread that submits, between submits, for a symbol that no submitted
        step holds a request of; result() may be fetched from another thread. ValueError for a symbol that is no
        string; by default NotImplementedError: this engine cannot."""
        raise NotImplementedError(f"the {self.name} engine cannot export a symbol's state")

    def import_state(self, symbol, data) -> None:
        """Set the symbol's state to `data` (bytes-like, or the array export_state gave), placed as a step places
        it (a new symbol takes room: CapacityError where there is none), before any step submitted after this
        call. ValueError naming the sizes for data of the wrong size, touching no state. By default
        NotImplementedError: this engine cannot."""
        raise NotImplementedError(f"the {self.name} engine cannot import a symbol's state")

    def describe(self) -> dict:
        """What the engine is and how it was set up, for summaries and benchmark reports."""
        return {"engine": self.name}

    @property
    def losses(self) -> list[dict]:
        """The parts of this engine lost while it played (a sharded engine's shards: a record each, its "line"
        saying it in words); an engine of one part loses none."""
        return []

    def on_loss(self, listener) -> None:
        """Call listener(record) with each part lost from now on; a no-op for an engine of one part."""

    def close(self) -> None:
        """Release what the engine holds beyond memory (processes, connections); a no-op by default."""

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()
