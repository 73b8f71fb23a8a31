"""A shard in this process, and shard processes of one thread, for tests of the sharded engine
(client/engine/sharded.py)."""
import contextlib
import os
import threading

from client.engine.base import PendingStep
from client.engine.sharded import Shard, ShardLost, import_answer, submit_placeable


@contextlib.contextmanager
def one_thread_shards():
    """Shard processes started within step on one thread, as this process does (conftest's): on a 2-core CPU two
    shards of torch's default threads each, beside this process, took 0.3-1.7 s a step for their first steps; and a
    CPU product split over threads may round otherwise than here."""
    threads = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # read by each spawned shard's torch at start
    try:
        yield
    finally:
        if threads is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = threads


class ShardHere(Shard):
    """A shard in this process, run as the transports run theirs (submit_placeable on its engine), so that a test
    can reach its engine (make its step fail, look at its table)."""
    info = {}

    def __init__(self, engine, index=0):
        self.index, self.where, self.engine = index, f"this process ({index})", engine
        self.info = {**engine.describe(), "state_layout": engine.state_layout()}  # as build_shard_engine's
        engine.expired()  # as build_shard_engine: from now on it keeps the symbols it forgets as idle

    def submit(self, symbols, features):
        return submit_placeable(self.engine, symbols, features)

    def result(self, handle):
        return handle.result()

    def release(self, symbols):
        self.engine.release(symbols)

    def export_state(self, symbol):
        return self.engine.export_state(symbol)

    def import_state(self, symbol, data):
        return PendingStep.completed(import_answer(self.engine, symbol, data))

    def stop(self):
        pass


class LosableHere(ShardHere):
    """ShardHere whose answers wait while `gate` is clear, and which lose() makes lost (its process gone)."""

    def __init__(self, engine, index=0):
        super().__init__(engine, index)
        self.gate, self.lost = threading.Event(), False
        self.gate.set()

    def result(self, handle):
        self.gate.wait()
        if self.lost:
            raise ShardLost("gone")
        return handle.result()

    def lose(self):
        self.lost = True
        self.gate.set()

    def stop(self):
        self.lose()
