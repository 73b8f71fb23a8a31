"""Symbols sharded over engines elsewhere (processes on this machine's GPUs, or Ray actors on other hosts): each
symbol's state on exactly one shard, whatever carries the messages.

A symbol is placed on the live shard holding the fewest symbols when first seen (of those with no answer overdue
by LATE_ANSWER_S, and of those with room for it, where any is) and stays there. A step's rows are split by shard,
each symbol's rows in the step's order; each part goes to its shard through that shard's one submitter thread (so
a shard receives its steps, and each symbol its requests, in submission order), and one collector thread per shard
takes the answers in the same order, so a step's parts arrive as each shard completes (`ShardedPendingStep.parts()`,
`arrived()`). A part a shard fails (no room, bad input) fails alone; its step's other parts are answered.

A symbol's state is exported from, or imported into, its shard (import places a new symbol as a step does) through
the same queue as its steps, answered in order with them (export_state, import_state). A lost shard's symbol exports
None, as one held nowhere does: its state went with the shard.

A shard's engine forgets a symbol idle past its idle timeout by its own clock, when a later placement there finds
it idle (its last use: when that shard stepped it, not when the step was submitted here), so the times steps are
submitted here cannot tell which symbols it still holds. Instead each answer carries the symbols the shard forgot
and holds no state of as of that part; the engine forgets them too (its placement table and per-shard counts follow
what each shard holds) unless a later part of theirs is on its way to that shard, which starts them afresh there.

A shard that is lost (its process exits, its Ray actor or node dies, or it answers no step for
`answer_timeout_s`: hung, it is stopped) is reported once, in one line naming the
shard and its symbols. Its unanswered parts, and every later request of its symbols, then follow
`on_shard_loss`: "error" answers them with the loss (`unplaceable` names those symbols, so a caller can skip
them), "reset" places its symbols again on the live shards, where they start from a fresh state, and runs their
unanswered requests there in order (those of a symbol released since fail with the loss: its release went with the
shard). Every other symbol keeps playing. A step says which of its symbols start afresh with it, a reset's first
rows of each (`ShardedPendingStep.restarted()`), so that a journal can say where their old states ended.

The transports (client/engine/shard_process.py, client/engine/shard_ray.py) implement `Shard`; each shard runs
`build_shard_engine`, loading the model from its `ModelSpec`, so no weights travel.
"""
import queue
import sys
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from client.engine.base import (NUM_TOWERS, CapacityError, Engine, PendingStep, check_step_inputs, state_data,
                                state_symbol, symbol_list)

ON_SHARD_LOSS = ("error", "reset")
SHOWN_SYMBOLS = 32  # a loss line names this many of the shard's symbols, then says how many in all
CLOSE_TIMEOUT_S = 30
# A shard that answers no step for this long is taken as hung and lost: a step takes milliseconds on a GPU, and
# until then its symbols wait (the runtime's other steps go on without its parts: client/runtime.py LATE_PARTS_S).
ANSWER_TIMEOUT_S = 60.0
# A shard whose oldest part has waited this long for its answer takes no new symbol while another shard has none
# waiting so long: one hung until answer_timeout_s would hold the new symbols placed on it all that time.
LATE_ANSWER_S = 0.2


@dataclass(frozen=True)
class ModelSpec:
    """How a shard loads the model: a preset with a checkpoint path (on the shard's host) or synthetic weights'
    seed."""
    preset: str
    weights: str | None = None
    seed: int = 0


class ShardError(RuntimeError):
    """A shard failed a step (its message says why)."""


class ShardLost(ShardError):
    """A shard is gone (its process exited, its actor or node died): its symbols' states with it."""


class ShardStartError(ShardError, ValueError):
    """A shard could not start (bad preset or weights, no such device, no room on the cluster): an ordinary
    mistake, reported in one line."""


def check_loss_options(on_shard_loss, answer_timeout_s) -> None:
    """Refuse, in one line, what a sharded engine cannot do when a shard is lost (make_engine asks before it starts
    any shard: they take minutes on GPUs)."""
    if on_shard_loss not in ON_SHARD_LOSS:
        raise ValueError(f"--on-shard-loss {on_shard_loss!r}: choose one of {', '.join(ON_SHARD_LOSS)}")
    if not (isinstance(answer_timeout_s, (int, float)) and answer_timeout_s > 0):
        raise ValueError(f"--shard-timeout-s must be a positive number of seconds, got {answer_timeout_s!r}")


def build_shard_engine(spec: ModelSpec, device: str, engine: str, options: dict):
    """What a shard runs: (its engine, the info it reports when ready), the model loaded from `spec` on `device`."""
    from client.engine import make_engine
    from client.model import ModelLoader

    # the engine keeps the model no longer than it needs
    load = ModelLoader(spec.preset, spec.weights, spec.seed, device)
    options = {**options, "progress": False}  # a shard's startup is reported by the engine that owns it
    built = make_engine(engine, load, device=device, **options)
    built.expired()  # from now on it keeps the symbols it forgets as idle, for submit_placeable to report
    return built, {**built.describe(), "engine": engine, "fingerprint": load.fingerprint,
                   "state_layout": built.state_layout()}


def import_answer(engine, symbol, data):
    """What a shard answers an import with: None, or the error that its engine raised (a CapacityError or
    ValueError whole, for the caller to raise as it is; else a ShardError saying it)."""
    try:
        engine.import_state(symbol, data)
    except (CapacityError, ValueError) as exc:
        return exc
    except Exception as exc:
        return ShardError(f"{type(exc).__name__}: {exc}")
    return None


def share_host_tier(options: dict, engine: str, device, shards_on_host: int) -> dict:
    """make_engine's options for one of the fast-engine shards on a host's GPUs: their host tiers share the host's
    memory (the default budget split between them) rather than each counting all of it as available."""
    if engine != "fast" or not str(device).startswith("cuda") or options.get("host_symbols") is not None:
        return options
    from client.engine.fast.state_table import host_tier_budget
    return {**options, "host_memory": host_tier_budget() // shards_on_host}


def submit_placeable(engine, symbols, features) -> PendingStep:
    """What a shard runs for a part: its engine's submit, or, where some of the part's symbols have no room, the
    others' rows alone. result(): (the predictions, NaN rows for the refused, or a ShardError saying why the step
    failed after it was sent; {row: why} for the refused; the symbols the engine forgot as idle and holds no state
    of once this part is placed: taken right after its submit, so that they say what the shard holds between this
    part and its next)."""
    refused = engine.unplaceable(symbols)
    kept = [row for row, symbol in enumerate(symbols) if symbol not in refused]
    pending = (engine.submit([symbols[row] for row in kept], np.asarray(features)[kept]) if refused
               else engine.submit(symbols, features))
    expired = engine.expired()
    refused_rows = {row: refused[symbol] for row, symbol in enumerate(symbols) if symbol in refused}

    def answer():
        try:
            predictions = pending.result()
        except Exception as exc:  # failed after it was sent (a GPU's read-back): `expired` are forgotten all the same
            return ShardError(f"{type(exc).__name__}: {exc}"), refused_rows, expired
        if not refused:
            return predictions, {}, expired
        out = np.full((len(symbols), NUM_TOWERS), np.nan, dtype=np.float32)
        out[kept] = predictions
        return out, refused_rows, expired
    return PendingStep(answer, poll=pending.done)


def describe_ready(shard) -> str:
    """The line a transport prints when a shard is ready."""
    capacity = shard.info.get("capacity")
    return (f"[sharded engine] shard {shard.index} ready: {shard.where}, engine {shard.info['engine']}"
            + (f", {capacity} symbols" if capacity is not None else ""))


def wait_started(shards, wait, progress):
    """The shards, once wait(shard) has returned for each in turn (it raises what a failed start says), each said
    ready on stderr with progress; a failure stops them all."""
    try:
        for shard in shards:
            wait(shard)
            if progress:
                sys.stderr.write(describe_ready(shard) + "\n")
    except BaseException:
        for shard in shards:
            shard.stop()
        raise
    return shards


class Shard(ABC):
    """One shard as its transport reaches it. `where` says where it runs (a device, an actor on a node); `info`
    is what it said when ready (its engine's describe(), fingerprint, ...)."""

    index: int
    where: str
    info: dict

    @abstractmethod
    def submit(self, symbols: list[str], features: np.ndarray):
        """Send one step's part; return a handle for result(). Raises ShardLost if the shard is gone."""

    @abstractmethod
    def result(self, handle) -> np.ndarray:
        """The part's predictions, waited for. Called once per handle, in submission order. Raises ShardError
        for a step the shard failed, ShardLost when the shard is gone."""

    @abstractmethod
    def release(self, symbols: list[str]) -> None:
        """Forget these symbols' states, after every step already submitted. Raises ShardLost if gone."""

    def export_state(self, symbol: str):
        """Send a request for one symbol's state (its engine's export_state), after every step already submitted;
        return a handle for result(), which gives the state (or None). Raises ShardLost if the shard is gone."""
        raise NotImplementedError(f"shards of {type(self).__name__} cannot export a symbol's state")

    def import_state(self, symbol: str, data: np.ndarray):
        """Send one symbol's state to set (its engine's import_state, import_answer), after every step already
        submitted; return a handle for result(), which gives import_answer's answer. Raises ShardLost if gone."""
        raise NotImplementedError(f"shards of {type(self).__name__} cannot import a symbol's state")

    @abstractmethod
    def stop(self) -> None:
        """Stop the shard (end its process or actor); never raises."""

    def kill(self) -> None:
        """End a shard that answers nothing, without waiting for it to finish its work; never raises."""
        self.stop()


class _Part:
    """One shard's part of a step: its rows of the step, their symbols and features; its outcome goes to the
    step's arrivals. `moved` marks a part taken off a lost shard (failed or run elsewhere); `released` holds its
    symbols released after it was queued (its rows of them are of the state they left); `restarted` its symbols
    that start afresh with it (a reset's)."""

    def __init__(self, rows, symbols, features, arrivals):
        self.rows, self.symbols, self.features, self.arrivals = rows, symbols, features, arrivals
        self.moved = False
        self.released = set()
        self.restarted = frozenset()

    def finish(self, outcome, rows=None):
        """The outcome of the part's rows, or of `rows` (positions in the part) alone."""
        self.arrivals.put((self.rows if rows is None else self.rows[rows], outcome, self.restarted))


class _StateCall:
    """A shard's export or import of one symbol's state, sent and answered in order with its steps' parts: `kind`
    the shard's method, `args` for it, the answer (or the exception) in `future`. It holds no rows of a step."""

    symbols = ()

    def __init__(self, kind, *args):
        self.kind, self.args, self.future = kind, args, Future()
        self.moved = False
        self.released = set()

    def finish(self, outcome, rows=None):
        if isinstance(outcome, Exception):
            self.future.set_exception(outcome)
        else:
            self.future.set_result(outcome)


class _InFlight:
    __slots__ = ("part", "handle", "sent_at")

    def __init__(self, part):
        self.part, self.handle = part, None
        self.sent_at = time.monotonic()  # when it was taken to be sent: its answer is due within the timeout


class ShardedPendingStep(PendingStep):
    """A sharded step: result() waits for every part; parts() yields (rows, predictions or the exception) as
    each part arrives, so that a caller can answer them one by one; arrived() gives those that have arrived without
    waiting, wait(timeout) waits for the rest up to `timeout` seconds, done() says whether every part has arrived.
    restarted() names the symbols of the parts arrived so far that start afresh with this step."""

    def __init__(self, arrivals, batch):
        super().__init__(self._assemble)
        self._arrivals, self._batch = arrivals, batch
        self._arrived, self._rows_arrived = [], 0
        self._restarted = set()
        self._parts_lock = threading.Lock()

    def parts(self):
        index = 0
        while True:
            with self._parts_lock:
                if index == len(self._arrived):
                    if self._rows_arrived == self._batch:
                        return
                    self._take(self._arrivals.get())
                rows, outcome = self._arrived[index]
            index += 1
            yield rows, outcome

    def arrived(self) -> list:
        """[(rows, predictions or the exception)] of the parts arrived so far, in arrival order; never waits."""
        with self._parts_lock:
            while self._rows_arrived < self._batch:
                try:
                    self._take(self._arrivals.get_nowait())
                except queue.Empty:
                    break
            return list(self._arrived)

    def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for every part; whether they have all arrived."""
        deadline = time.monotonic() + timeout
        with self._parts_lock:
            while self._rows_arrived < self._batch:
                try:
                    self._take(self._arrivals.get(timeout=max(0.0, deadline - time.monotonic())))
                except queue.Empty:
                    return False
            return True

    def done(self) -> bool:
        return self.wait(0.0)

    def restarted(self) -> set[str]:
        """The symbols whose states were lost with their shard (--on-shard-loss reset) and whose first rows since
        are in the parts of this step arrived so far: their states start afresh with this step."""
        with self._parts_lock:
            return set(self._restarted)

    def _take(self, arrival):
        """Note one part's arrival (called holding the parts' lock)."""
        rows, outcome, restarted = arrival
        self._arrived.append((rows, outcome))
        self._rows_arrived += len(rows)
        self._restarted.update(restarted)

    def _assemble(self):
        out = np.empty((self._batch, NUM_TOWERS), dtype=np.float32)
        for rows, outcome in self.parts():
            if isinstance(outcome, Exception):
                raise outcome
            out[rows] = outcome
        return out


class _Runner:
    """The engine's side of one shard: its queue of work, the one thread that submits it in order and the one
    that collects the answers in order. Its deques are guarded by the engine's lock. It holds its engine weakly,
    so that an engine dropped without close() is collected, and its finalizer stops the shards."""

    def __init__(self, engine, shard: Shard):
        self.engine, self.shard, self.index = weakref.ref(engine), shard, shard.index
        self.work = deque()       # ("step", part) or ("release", symbols), in submission order
        self.in_flight = deque()  # _InFlight, submitted and not yet collected, oldest first
        self.lost = None          # the loss (ShardLost), once the shard is gone
        self.stopping = self.submitter_done = False
        self.answered_at = 0.0    # when its last answer came (time.monotonic())
        self.sending_since = None  # when the message being sent was taken, until its send returns
        self.work_ready = threading.Condition(engine._lock)
        self.answer_due = threading.Condition(engine._lock)
        self.threads = [threading.Thread(target=self._submit_loop, name=f"shard-{self.index}-submit", daemon=True),
                        threading.Thread(target=self._collect_loop, name=f"shard-{self.index}-collect",
                                         daemon=True)]
        for thread in self.threads:
            thread.start()

    def _submit_loop(self):
        try:
            while True:
                with self.work_ready:
                    self.work_ready.wait_for(lambda: self.work or self.stopping or self.lost)
                    if self.lost or not self.work:
                        return
                    kind, item = self.work.popleft()
                    self.sending_since = time.monotonic()
                    if kind != "release":
                        entry = _InFlight(item)
                        self.in_flight.append(entry)
                failure = None
                try:
                    if kind == "release":
                        self.shard.release(item)
                    elif kind == "step":
                        handle = self.shard.submit(item.symbols, item.features)
                    else:  # "export_state" or "import_state"
                        handle = getattr(self.shard, kind)(*item.args)
                except ShardLost as exc:
                    self._lose(exc)
                    return
                except Exception as exc:  # not sent (e.g. not serializable): a step's part fails alone
                    failure = ShardError(f"shard {self.index}: {type(exc).__name__}: {exc}")
                with self.answer_due:
                    self.sending_since = None
                    if kind == "release" or entry.part.moved:
                        continue
                    if failure is None:
                        entry.handle = handle
                        self.answer_due.notify()
                        continue
                    self.in_flight.remove(entry)
                entry.part.finish(failure)
        finally:
            with self.answer_due:
                self.submitter_done = True
                self.answer_due.notify()

    def _collect_loop(self):
        while True:
            with self.answer_due:
                self.answer_due.wait_for(lambda: self.lost or (self.in_flight and self.in_flight[0].handle is not None)
                                         or (self.submitter_done and not self.in_flight))
                if self.lost or not self.in_flight:
                    return
                entry = self.in_flight[0]
            try:
                outcome = self.shard.result(entry.handle)
            except ShardLost as exc:
                self._lose(exc)
                return
            except ShardError as exc:
                outcome = exc
            except Exception as exc:
                outcome = ShardError(f"shard {self.index}: {type(exc).__name__}: {exc}")
            with self.answer_due:
                if entry.part.moved:  # the shard was lost meanwhile, and the part went with the others
                    return
                self.in_flight.popleft()
                self.answered_at = time.monotonic()
            if not isinstance(outcome, tuple):
                entry.part.finish(outcome)
                continue
            predictions, refused, expired = outcome
            gone = {entry.part.symbols[row] for row in refused}.union(expired)
            if gone and (engine := self.engine()) is not None:  # they hold no state there: forgotten here first
                engine._unplace(self, gone)
                del engine
            if isinstance(predictions, ShardError):  # the step failed after it was sent: the whole part with it
                entry.part.finish(ShardError(f"shard {self.index}: {predictions}"))
                continue
            if not refused:
                entry.part.finish(predictions)
                continue
            # rows of symbols the shard had no room for fail alone (submit_placeable): a part's other rows were
            # stepped, and are answered
            kept = np.setdiff1d(np.arange(len(predictions)), list(refused))
            if len(kept):
                entry.part.finish(predictions[kept], kept)
            by_why = {}
            for row, why in refused.items():
                by_why.setdefault(why, []).append(row)
            for why, rows in by_why.items():
                entry.part.finish(ShardError(f"shard {self.index}: CapacityError: {why}"), np.asarray(rows))

    def _lose(self, cause: ShardLost):
        if (engine := self.engine()) is not None:
            engine._lose(self, cause)
            return
        # the engine was collected and its finalizer stops the shard: its unanswered parts fail as close()'s do,
        # else a step still held waits for them for ever
        with self.work_ready:
            if self.lost is not None:
                return
            pending = self.take_unanswered(cause)
            self.work_ready.notify_all()
            self.answer_due.notify_all()
        for part in pending:
            part.finish(ShardError("the sharded engine was closed"))

    def take_unanswered(self, cause) -> list[_Part]:
        """Mark the shard lost and take its parts not yet answered (sent or queued), in order, each marked moved so
        that no thread of this runner finishes it. Called holding the engine's lock."""
        self.lost = ShardLost(f"shard {self.index} ({self.shard.where}) lost: {cause}")
        pending = [entry.part for entry in self.in_flight] + [item for kind, item in self.work if kind != "release"]
        self.in_flight.clear()
        self.work.clear()
        for part in pending:
            part.moved = True
        return pending

    def loss(self) -> ShardLost:
        """The loss, as one failed part's own exception: one shared by every part would gather, at each raise
        (ShardedPendingStep.result()), that step's frames in its traceback, and keep every failed step (its features,
        the other parts' predictions, the caller's frames) for the engine's life."""
        return ShardLost(str(self.lost))

    def answer_late(self, now) -> bool:
        """Whether its oldest part has waited LATE_ANSWER_S for its answer (exact holding the engine's lock)."""
        try:
            return now - self.in_flight[0].sent_at > LATE_ANSWER_S
        except IndexError:  # nothing in flight
            return False

    def ask_stop(self):
        """Let its threads end once the parts queued are answered."""
        with self.work_ready:
            self.stopping = True
            self.work_ready.notify_all()
            self.answer_due.notify_all()

    def stop(self, deadline, caller):
        """Wait for its threads until `deadline` (time.monotonic()), then stop the shard: killed where they still
        wait on it, as its stop would wait as long again for a shard that answers nothing to end. caller: the thread
        that closes the engine (the engine's collection may come in one of these), never waited for."""
        self.ask_stop()
        others = [thread for thread in self.threads if thread is not caller]
        for thread in others:
            thread.join(max(0.0, deadline - time.monotonic()))
        if any(thread.is_alive() for thread in others):
            self.shard.kill()
        self.shard.stop()


class ShardedEngine(Engine):
    name = "sharded"
    holds_back = True  # ready() is False for the symbols of a shard late to answer

    def __init__(self, shards: list[Shard], *, on_shard_loss="error", progress=True, transport=None,
                 answer_timeout_s=ANSWER_TIMEOUT_S):
        """shards: started shards of one transport (client.engine.shard_process.process_shards,
        client.engine.shard_ray.ray_shards), which this engine now owns (close() stops them, as does the engine's
        collection if it is dropped unclosed). A shard that answers no step for answer_timeout_s seconds is stopped
        and lost."""
        if not shards:
            raise ValueError("a sharded engine needs at least one shard")
        try:
            check_loss_options(on_shard_loss, answer_timeout_s)
        except ValueError:
            for shard in shards:  # this engine owns them: a refusal stops them
                shard.stop()
            raise
        fingerprints = {shard.info.get("fingerprint") for shard in shards}
        if len(fingerprints) > 1:
            for shard in shards:
                shard.stop()
            raise ShardStartError("the shards loaded different weights: " + ", ".join(
                f"shard {s.index} ({s.where}) {s.info.get('fingerprint')}" for s in shards))
        self.fingerprint = fingerprints.pop()
        # each shard's engine has the same options: one layout (None where they differ, or a shard cannot say)
        layouts = [shard.info.get("state_layout") for shard in shards]
        self._state_layout = layouts[0] if all(layout == layouts[0] for layout in layouts) else None
        self.on_shard_loss, self.progress, self.transport = on_shard_loss, progress, transport
        self._lock = threading.Lock()
        self.shard_of: dict[str, int] = {}
        self._load = [0] * len(shards)
        self._room = [_room(shard.info) for shard in shards]  # the symbols each holds at most (its tiers)
        self._losses: list[dict] = []
        # symbols whose states went with a lost shard (reset): their next rows routed start afresh
        self._restarting: set[str] = set()
        self._loss_listeners: list = []  # called with each loss's record, outside the engine's lock
        self._closing = False
        self.answer_timeout_s = float(answer_timeout_s)
        self._runners = [_Runner(self, shard) for shard in shards]
        self._closed = threading.Event()
        # close(), or the engine's collection when dropped unclosed (its threads hold it weakly): once
        self._stop_runners = weakref.finalize(self, _stop_runners, self._runners, self._closed)
        self._stop_runners.atexit = False  # at exit the shards go with the process (as its daemon threads do)
        threading.Thread(target=_watch_answers, args=(weakref.ref(self), self._closed, self.answer_timeout_s),
                         name="shard-answers-due", daemon=True).start()

    @property
    def shards(self) -> list[Shard]:
        return [runner.shard for runner in self._runners]

    @property
    def symbols(self):
        with self._lock:
            return list(self.shard_of)

    def describe(self):
        return {"engine": self.name, "transport": self.transport, "on_shard_loss": self.on_shard_loss,
                "shards": [{"where": s.where, **{k: v for k, v in s.info.items() if k != "state_layout"}}
                           for s in self.shards], "losses": self.losses}

    def state_layout(self) -> dict | None:
        """The shards' engines' layout, as they said it when they started."""
        return self._state_layout

    def export_state(self, symbol) -> PendingStep:
        """Asked of the symbol's shard after the steps submitted to it so far; None for a symbol on no shard, or on
        a lost one (its state went with the shard: raised, the loss stopped the journal's checkpoints of every
        symbol for the session)."""
        symbol = state_symbol(symbol)
        if self._state_layout is None:
            raise NotImplementedError("this sharded engine's shards cannot export a symbol's state")
        with self._lock:
            index = self.shard_of.get(symbol)
            if index is None or self._runners[index].lost is not None:
                return PendingStep.completed(None)
            call = self._send(index, "export_state", symbol)
        return PendingStep(call.future.result, poll=call.future.done)

    def import_state(self, symbol, data) -> None:
        """Placed as a step places the symbol, then set on its shard before the steps submitted after it: waits for
        the shard's answer (a refusal there, e.g. CapacityError, leaves the symbol as it was here)."""
        symbol = state_symbol(symbol)
        if self._state_layout is None:
            raise NotImplementedError("this sharded engine's shards cannot import a symbol's state")
        data = np.array(state_data(data, self._state_layout["bytes"]))  # its own: sent from another thread
        with self._lock:
            new = symbol not in self.shard_of
            index = self._place(symbol)
            if index is None:
                raise ShardLost("every shard of the sharded engine is lost")
            try:
                call = self._send(index, "import_state", symbol, data)
            except ShardError:
                self._unplace_new(symbol, index, new)
                raise
        failure = call.future.exception() or call.future.result()  # not sent, the shard lost, or its refusal
        with self._lock:
            if failure is not None:
                self._unplace_new(symbol, index, new)
                raise failure
            if self.shard_of.get(symbol) == index:  # (not lost meanwhile) its next rows go on from the state set
                self._restarting.discard(symbol)

    def _send(self, index, kind, *args) -> _StateCall:
        """Queue a state call to shard `index` behind its steps. Called holding the lock."""
        runner = self._runners[index]
        if self._closing:
            raise ShardError("the sharded engine is closed")
        if runner.lost is not None:
            raise runner.loss()
        call = _StateCall(kind, *args)
        runner.work.append((kind, call))
        runner.work_ready.notify()
        return call

    def _unplace_new(self, symbol, index, new):
        """Forget a symbol placed for an import that failed (called holding the lock)."""
        if new and self.shard_of.get(symbol) == index:
            del self.shard_of[symbol]
            self._load[index] -= 1

    @property
    def losses(self) -> list[dict]:
        with self._lock:
            return list(self._losses)

    def on_loss(self, listener) -> None:
        self._loss_listeners.append(listener)

    def _place(self, symbol):
        """The symbol's shard (placing it on the least-loaded live shard at first sight); None when no shard is
        live. Called holding the lock."""
        index = self.shard_of.get(symbol)
        if index is None:
            live = [r.index for r in self._runners if r.lost is None]
            if not live:
                return None
            now = time.monotonic()
            on_time = [i for i in live if not self._runners[i].answer_late(now)]
            live = on_time or live
            # not one holding all it has room for while another has room: it would refuse the symbol (and, placed
            # afresh, refuse it again for as long as it held the fewest)
            with_room = [i for i in live if self._load[i] < self._room[i]]
            index = min(with_room or live, key=self._load.__getitem__)
            self.shard_of[symbol] = index
            self._load[index] += 1
        return index

    def ready(self, symbol) -> bool:
        """False while the symbol's shard has an answer overdue by LATE_ANSWER_S (hung, or far behind): the runtime
        then holds its requests back, so that its symbols wait alone and every other symbol's steps go on without a
        part on that shard. Asked for each waiting symbol as a step forms while one has late parts: no lock (a stale
        read is as good)."""
        index = self.shard_of.get(symbol)
        return index is None or not self._runners[index].answer_late(time.monotonic())

    def unplaceable(self, symbols) -> dict[str, str]:
        # in the words a caller gives a failed part (its exception's type, then its message), so that a loss
        # answered both ways reads as one reason
        symbols = symbol_list(symbols)  # a lone string refused, as every engine's unplaceable refuses it
        with self._lock:
            out = {}
            live = any(r.lost is None for r in self._runners)
            for symbol in symbols:
                index = self.shard_of.get(symbol)
                if index is not None and self._runners[index].lost is not None:
                    out[symbol] = f"ShardLost: {self._runners[index].lost}"
                elif index is None and not live:
                    out[symbol] = "ShardLost: every shard of the sharded engine is lost"
            return out

    def _unplace(self, runner: _Runner, gone):
        """Symbols that hold no state on runner's shard as of the part just answered (refused for want of room, or
        forgotten as idle) are placed afresh at their next request (another shard may have room; bound to this
        one, a refused symbol was refused for as long as it was full, and a forgotten one counted on it for ever),
        unless a later part of theirs is on its way to this shard already: it starts their fresh state there."""
        with self._lock:
            queued = {s for kind, item in runner.work if kind == "step" for s in item.symbols}
            queued.update(s for entry in runner.in_flight for s in entry.part.symbols)
            for symbol in gone - queued:
                if self.shard_of.get(symbol) == runner.index:
                    del self.shard_of[symbol]
                    self._load[runner.index] -= 1

    def release(self, symbols):
        with self._lock:
            by_shard = {}
            for symbol in symbol_list(symbols):
                self._restarting.discard(symbol)  # afresh at its next request anyway
                if symbol in self.shard_of:
                    index = self.shard_of.pop(symbol)
                    self._load[index] -= 1
                    by_shard.setdefault(index, []).append(symbol)
            for index, names in by_shard.items():
                runner = self._runners[index]
                if runner.lost is None:
                    runner.work.append(("release", names))
                    runner.work_ready.notify()
                    left = set(names)
                    for part in [entry.part for entry in runner.in_flight] + [i for k, i in runner.work if k == "step"]:
                        part.released.update(left.intersection(part.symbols))

    def step(self, symbols, features):
        return self.submit(symbols, features).result()

    def submit(self, symbols, features) -> ShardedPendingStep:
        symbols = symbol_list(symbols)
        features = check_step_inputs(symbols, features)
        arrivals = queue.SimpleQueue()
        with self._lock:
            failed = self._route(np.arange(len(symbols)), symbols, features, arrivals)
        for part, error in failed:
            part.finish(error)
        return ShardedPendingStep(arrivals, len(symbols))

    def _route(self, rows, symbols, features, arrivals):
        """Queue each shard's part of these rows (each symbol's rows in order); return [(part, error)] for the
        parts that no live shard takes, to be finished outside the lock. Called holding the lock."""
        rows_of = {}
        for position, symbol in enumerate(symbols):
            rows_of.setdefault(self._place(symbol), []).append(position)
        failed = []
        for index, positions in rows_of.items():
            part = _Part(rows[positions], [symbols[p] for p in positions], features[positions], arrivals)
            if self._closing:
                failed.append((part, ShardError("the sharded engine is closed")))
            elif index is None:
                failed.append((part, ShardLost("every shard of the sharded engine is lost")))
            elif self._runners[index].lost is not None:
                failed.append((part, self._runners[index].loss()))
            else:
                part.restarted = self._restarting.intersection(part.symbols)
                self._restarting -= part.restarted
                runner = self._runners[index]
                runner.work.append(("step", part))
                runner.work_ready.notify()
        return failed

    def _lose(self, runner: _Runner, cause: ShardLost):
        """The shard behind runner is gone: say so once, then fail or move its unanswered parts and symbols."""
        with self._lock:
            if runner.lost is not None:
                return
            where = runner.shard.where
            pending = runner.take_unanswered(cause)
            # its states went too: an export gives None (as export_state after the loss), an import fails
            calls = [(call, None if call.kind == "export_state" else runner.loss()) for call in pending
                     if isinstance(call, _StateCall)]
            pending = [part for part in pending if not isinstance(part, _StateCall)]
            symbols = [s for s, index in self.shard_of.items() if index == runner.index]
            closing = self._closing
            record = None
            if closing:
                failed = [(part, ShardError("the sharded engine was closed")) for part in pending]
            elif self.on_shard_loss == "error":
                failed = [(part, runner.loss()) for part in pending]
            else:  # reset: place its symbols again (fresh state) and run their unanswered requests there, in order
                for symbol in symbols:
                    del self.shard_of[symbol]
                self._restarting.update(symbols)
                self._load[runner.index] = 0
                failed = []
                for part in pending:
                    # rows of a symbol released since fail: run again, they would make it held anew (its release
                    # went with the shard) and its next request would go on from the state it left
                    kept = np.array([symbol not in part.released for symbol in part.symbols], dtype=bool)
                    if not kept.all():
                        failed.append((_Part(part.rows[~kept], [s for s, k in zip(part.symbols, kept) if not k],
                                             part.features[~kept], part.arrivals), runner.loss()))
                    failed += self._route(part.rows[kept], [s for s, k in zip(part.symbols, kept) if k],
                                          part.features[kept], part.arrivals)
                for symbol in symbols:  # those with no request pending too, so that the line says where they went
                    self._place(symbol)
            runner.work_ready.notify_all()
            runner.answer_due.notify_all()
            if not closing:
                record = {"shard": runner.index, "where": where, "reason": str(cause), "symbols": symbols,
                          "policy": self.on_shard_loss, "unanswered_parts": len(pending)}
                if self.on_shard_loss == "reset":
                    record["moved_to"] = {symbol: self.shard_of.get(symbol) for symbol in symbols}
                record["line"] = _loss_line(record)
                self._losses.append(record)
        for part, error in calls + failed:
            part.finish(error)
        # ended, not left as it is: a shard lost for being unreachable, hung, or out of order may live on, holding
        # its GPU (and Ray's resources) until the client exits, for symbols it will never be sent again
        runner.shard.kill()
        if closing:
            return
        if self.progress:
            sys.stderr.write(f"[sharded engine] {record['line']}\n")
            sys.stderr.flush()
        for listener in list(self._loss_listeners):
            listener(record)

    def _late(self, now, timeout) -> list[_Runner]:
        """The live runners that have answered no step for `timeout` seconds while one waits: their oldest step in
        flight was sent, and their last answer came, that long ago (not the oldest step's wait alone: a slow shard
        working through a queue of steps answers all the same, and is not hung). With none in flight, a send under
        way that long counts as one: a release has no answer, but a shard that reads nothing blocks its send once
        the transport holds no more (a process shard's pipe: ~64 KB), and every request queued behind it."""
        with self._lock:
            if self._closing:
                return []
            late = []
            for runner in self._runners:
                waiting = runner.in_flight[0].sent_at if runner.in_flight else runner.sending_since
                if runner.lost is None and waiting is not None and now - max(waiting, runner.answered_at) > timeout:
                    late.append(runner)
            return late

    def close(self):
        with self._lock:
            self._closing = True
        self._stop_runners()


def _room(info) -> float:
    """The symbols a shard's engine holds at most, as its ready info says them (its GPU and host tiers); unbounded
    where it does not say."""
    if info.get("capacity") is None:
        return float("inf")
    return info["capacity"] + (info.get("host_symbols") or 0)


def _stop_runners(runners, closed):
    closed.set()
    # every shard stopped at once, in a thread of its own, against one deadline: shards that answer nothing (and the
    # wait for a frozen process owing nothing to end, shard_process.STOP_TIMEOUT_S) hold close() that long in all,
    # not each in turn
    deadline = time.monotonic() + CLOSE_TIMEOUT_S
    caller = threading.current_thread()
    stoppers = [threading.Thread(target=runner.stop, args=(deadline, caller), name="shard-stop", daemon=True)
                for runner in runners]
    for stopper in stoppers:
        stopper.start()
    for stopper in stoppers:
        stopper.join()


def _watch_answers(engine_ref, closed, timeout):
    """Stop and lose each shard that has answered no step for `timeout` seconds while one waits (_late); holding
    the engine only while it looks."""
    while not closed.wait(min(1.0, timeout / 4)):
        if (engine := engine_ref()) is None:
            return
        for runner in engine._late(time.monotonic(), timeout):
            engine._lose(runner, ShardLost(f"it answered no step for {timeout:g} s (--shard-timeout-s); stopped"))
        del engine


def _loss_line(record) -> str:
    """One line: which shard, where, why, its symbols, and what happens to them."""
    symbols = record["symbols"]
    shown = ", ".join(symbols[:SHOWN_SYMBOLS]) + (f", ... ({len(symbols)} in all)" if len(symbols) > SHOWN_SYMBOLS
                                                  else "")
    named = f"its {len(symbols)} symbol(s) {shown}" if symbols else "it held no symbol"
    if record["policy"] == "error":
        then = "get errors from now on (--on-shard-loss error)"
    else:
        targets = sorted({index for index in record["moved_to"].values() if index is not None})
        then = (f"start again from a fresh state on shard(s) {', '.join(map(str, targets))} (--on-shard-loss reset)"
                if targets else "get errors: no shard is left (--on-shard-loss reset)")
    return f"shard {record['shard']} ({record['where']}) lost: {record['reason']}; {named} {then}"
