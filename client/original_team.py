"""Team code written for the original event: its names, and the adapter that runs its process_batch here.

A team file in the event's style subclasses BaseInferenceClient and answers

    process_batch(requests_by_symbol: Dict[str, List[PendingRequest]]) -> InferenceResponse

with each symbol's queued requests in arrival order (several a symbol), answering them in any order; what it leaves
out is handed to it again (OriginalStyleClient._until_answered). The team
client (`--team-dir`) and the local evaluator construct its ExampleModel with the engine, as they do the project's
own (it is `self.engine`), and present it to the runtime through OriginalStyleClient: a client that takes
lists of requests a symbol (``requests_per_symbol = "many"``: the runtime's batches, {symbol: [(unique_id,
features), ...]}), builds the PendingRequests, and turns the InferenceResponse into the runtime's answer. The
runtime keeps its per-symbol order and its batching; a subclass that also has submit_batch (the same input, an
object whose result() is the InferenceResponse) is pipelined as the project's example is.

Imports no torch: `from client import BaseInferenceClient, PendingRequest, InferenceResponse` stays light.
"""
import threading
import time
from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List

import numpy as np

from client import team_api
from client.constants import NUM_TOWERS
from client.engine.base import PendingStep


@dataclass
class PendingRequest:
    """One request waiting for its answer: its id, its symbol and its 79 features, as the wire carried them."""
    unique_id: int
    symbol: str
    features: List[float]


@dataclass
class InferenceResponse:
    """What process_batch answers: predictions[i] (4 floats, tower order xLSTM, Mamba2, RetNet, Hawk) for
    unique_ids[i], in any order."""
    unique_ids: List[int]
    predictions: List[List[float]]
    client_timestamp: float = field(default_factory=time.time)


class BaseInferenceClient(ABC):
    """The event's team-client base class. Subclass it and write process_batch; `self.engine` is the model the
    team client or the evaluator was started with (client/engine: step(symbols, features) -> predictions)."""

    def __init__(self, engine=None):
        self.engine = engine

    @abstractmethod
    def process_batch(self, requests_by_symbol: Dict[str, List[PendingRequest]]) -> InferenceResponse:
        """Each symbol's queued requests, oldest first -> an InferenceResponse answering every one of them."""


def as_runtime_client(team_client):
    """The client the runtime and the evaluator call: team code in the event's style through the adapter, the
    project's own as it is."""
    return OriginalStyleClient(team_client) if isinstance(team_client, BaseInferenceClient) else team_client


def takes_several_requests(team_class) -> bool:
    """Whether a step may hand `team_class` several requests of one symbol: a class in the event's style always
    (the adapter gives it each symbol's list), another where it declares requests_per_symbol MANY."""
    return (issubclass(team_class, BaseInferenceClient)
            or getattr(team_class, "requests_per_symbol", team_api.ONE) == team_api.MANY)


class OriginalStyleClient:
    """Presents a BaseInferenceClient to the runtime as a client that takes lists of requests a symbol."""

    requests_per_symbol = team_api.MANY

    def __init__(self, team_client: BaseInferenceClient):
        self.team_client = team_client
        # Team code in the event's style was written for one thread; pipelined, the leftovers of one step are asked
        # of process_batch on the runtime's completing thread while its submitting thread calls submit_batch.
        self._team_code = threading.RLock()
        self._uncollected = []  # _submit_batch's steps whose answers nobody has taken yet, oldest first
        if callable(getattr(team_client, "submit_batch", None)):
            self.submit_batch = self._submit_batch  # the runtime pipelines a client that has it
        if callable(getattr(team_client, "release", None)) or callable(getattr(self.engine, "release", None)):
            self.release = self._release  # the runtime's idle_timeout_s forgets through it, journaled

    @property
    def steps_in_background(self) -> bool:
        """Only where the team code says so itself (client/team_api.py): its submit_batch may compute the step."""
        return getattr(self.team_client, "steps_in_background", False) is True

    @property
    def engine(self):
        """The team code's engine (the evaluator closes it and reports a sharded engine's losses)."""
        return getattr(self.team_client, "engine", None)

    def _release(self, symbols) -> None:
        """Forget these symbols' states: the team code's release where it has one, else its engine's (the event's
        base class has none), which forgets what the engine's own idle timeout would, between steps where a journal
        can place it."""
        with self._team_code:
            own = getattr(self.team_client, "release", None)
            (own if callable(own) else self.engine.release)(list(symbols))

    def process_batch(self, requests_by_symbol) -> dict:
        batch = pending_requests(requests_by_symbol)
        return self._until_answered(batch, self._process_batch(batch))

    def _process_batch(self, batch):
        with self._team_code:
            return self.team_client.process_batch(_copy(batch))

    def _submit_batch(self, requests_by_symbol) -> PendingStep:
        batch = pending_requests(requests_by_symbol)
        # What a step leaves out is asked of process_batch when its answer is taken: an earlier step of one of these
        # symbols is taken first, or its leftovers would step after this step's requests (team code stepping one
        # request a symbol a call, pipelined by the runtime, got 31% of its predictions right).
        for step in self._uncollected:
            if not step.symbols.isdisjoint(batch):
                try:
                    step.result()
                except Exception:  # the runtime hears of it when it takes that step's answer
                    pass
        self._uncollected = [step for step in self._uncollected if not step.collected]
        with self._team_code:
            pending = self.team_client.submit_batch(_copy(batch))
        step = _AdapterStep(lambda: self._until_answered(batch, pending.result()), getattr(pending, "done", None),
                            batch)
        self._uncollected.append(step)
        return step

    def _until_answered(self, batch, response) -> dict:
        """The runtime's {"unique_ids", "predictions" float32 [n, 4], "errors"} for `batch`, from the team code's
        response and from process_batch called again with what it left out, each symbol's requests in order: the
        event's client called process_batch while requests stayed queued, and team code that answers one request a
        symbol a call (as its best-known solutions stepped) answers the rest in the calls that follow. A call that
        answers nothing ends it: what is left is an error, as it is when a call after the first raises or breaks the
        contract (the answers before it stand)."""
        answered, rows = checked_response(batch, response)
        ids, predictions, why = [], [], "process_batch did not answer it"
        while True:
            ids += answered
            predictions.append(rows)
            answered = set(answered)
            batch = {symbol: left for symbol, requests in batch.items()
                     if (left := [r for r in requests if r.unique_id not in answered])}
            if not batch or not answered:
                break
            try:
                answered, rows = checked_response(batch, self._process_batch(batch))
            except Exception as exc:  # not the whole batch failed: the requests answered have advanced their states
                why = f"process_batch failed: {type(exc).__name__}: {exc}"
                break
        errors = {r.unique_id: why for requests in batch.values() for r in requests}
        return {"unique_ids": ids, "predictions": np.concatenate(predictions), "errors": errors}


class _AdapterStep(PendingStep):
    """A pipelined step of team code in the event's style: the symbols it carries, and whether its answer (with its
    leftovers asked again) has been taken."""

    def __init__(self, fetch, poll, symbols):
        self.symbols, self.collected, self._failure = frozenset(symbols), False, None

        def collect():
            # A failure is raised again, not fetched again: a later step's submit takes this answer before the
            # runtime does, and fetching again ran the team code's step again (its states advanced twice).
            if self._failure is not None:
                raise self._failure
            try:
                return fetch()
            except Exception as exc:
                self._failure = exc
                raise
            finally:
                self.collected = True

        super().__init__(collect, poll=poll)


def pending_requests(requests_by_symbol) -> Dict[str, List[PendingRequest]]:
    """{symbol: [PendingRequest, ...]} of a batch in either of client/team_api.py's formats."""
    return {symbol: [PendingRequest(int(uid), symbol, np.asarray(features, dtype=np.float32).tolist())
                     for uid, features in team_api.queued(queue)]
            for symbol, queue in requests_by_symbol.items()}


def _copy(batch):
    """The lists the team code gets, its own: it may consume them (pop what it steps)."""
    return {symbol: list(requests) for symbol, requests in batch.items()}


def checked_response(batch: Dict[str, List[PendingRequest]], response) -> tuple[List[int], np.ndarray]:
    """(unique_ids, predictions float32 [n, 4]) of an InferenceResponse to `batch`; an id it was not given, or gave
    twice, is the team code's mistake."""
    expected = f"process_batch must return InferenceResponse(unique_ids, predictions [n][{NUM_TOWERS}])"
    try:
        ids = [int(uid) for uid in response.unique_ids]
        predictions = np.asarray(response.predictions, dtype=np.float32)
    except (AttributeError, TypeError, ValueError) as exc:
        raise ValueError(f"{expected}, got {type(response).__name__}: {exc}") from None
    if not ids and predictions.size == 0:
        predictions = predictions.reshape(0, NUM_TOWERS)  # [] for no answer
    # The shape itself, not a reshape: tower-major predictions [4][n] would reshape to [n][4] scrambled.
    if predictions.shape != (len(ids), NUM_TOWERS):
        raise ValueError(f"{expected}, got predictions of shape {list(predictions.shape)} for {len(ids)} unique_ids")
    given = {request.unique_id for requests in batch.values() for request in requests}
    unknown = sorted(set(ids) - given)
    repeated = sorted(uid for uid, times in Counter(ids).items() if times > 1)
    if unknown or repeated:
        raise ValueError(f"process_batch answered ids it was not given {unknown[:5]} or answered twice "
                         f"{repeated[:5]}")
    return ids, predictions
