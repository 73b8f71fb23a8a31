"""The model behind a small interface: one batched step over distinct symbols, run now or submitted."""
import threading
from abc import ABC, abstractmethod

import numpy as np

from client.constants import NUM_FEATURES, NUM_TOWERS  # noqa: F401  (NUM_TOWERS: for engines)


def check_step_inputs(symbols, features) -> np.ndarray:
    """Validate one step's inputs; return the features as C-contiguous float32 [B, 79].

    Engines call this before touching any state, so a bad step leaves every symbol as it was.
    """
    if not all(isinstance(symbol, str) for symbol in symbols):
        raise ValueError("symbols must be strings")
    if len(set(symbols)) != len(symbols):
        duplicates = sorted({s for s in symbols if symbols.count(s) > 1})
        raise ValueError(f"duplicate symbols in one step: {duplicates}; a step takes at most one request per symbol")
    features = np.asarray(features)
    if features.ndim != 2 or features.shape != (len(symbols), NUM_FEATURES):
        raise ValueError(f"features must have shape ({len(symbols)}, {NUM_FEATURES}) for "
                         f"{len(symbols)} symbols, got {features.shape}")
    if not np.issubdtype(features.dtype, np.floating):
        raise ValueError(f"features must be floating point, got {features.dtype}")
    features = np.ascontiguousarray(features, dtype=np.float32)
    bad_rows = np.flatnonzero(~np.isfinite(features).all(axis=1))
    if bad_rows.size:
        raise ValueError(f"non-finite features for symbols {[symbols[i] for i in bad_rows]}")
    return features


class PendingStep:
    """A submitted step's outcome: result() blocks until it is ready and returns it, the same object on
    every call and from any thread (the lock makes the first caller the only one that fetches it)."""

    def __init__(self, fetch=None, *, value=None):
        self._fetch, self._value = fetch, value
        self._lock = threading.Lock()

    @classmethod
    def completed(cls, value) -> "PendingStep":
        return cls(value=value)

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
        """Advance each (distinct) symbol's state once; return float32 predictions [B, 4] in tower order.

        Raises ValueError on duplicate symbols, a wrong shape or non-finite features, touching no state.
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

    def unplaceable(self, symbols) -> dict[str, str]:
        """{symbol: why} for the symbols of a step that this engine has no room for, without side effects. An
        engine without a bound on its symbols has room for all."""
        return {}

    def describe(self) -> dict:
        """What the engine is and how it was set up, for summaries and benchmark reports."""
        return {"engine": self.name}

    def close(self) -> None:
        """Release what the engine holds beyond memory (processes, connections); a no-op by default."""
