"""A shard in this process, for tests of the sharded engine (client/engine/sharded.py)."""
from client.engine.sharded import Shard, submit_placeable


class ShardHere(Shard):
    """A shard in this process, run as the transports run theirs (submit_placeable on its engine), so that a test
    can reach its engine (make its step fail, look at its table)."""
    info = {}

    def __init__(self, engine, index=0):
        self.index, self.where, self.engine = index, f"this process ({index})", engine
        engine.expired()  # as build_shard_engine: from now on it keeps the symbols it forgets as idle

    def submit(self, symbols, features):
        return submit_placeable(self.engine, symbols, features)

    def result(self, handle):
        return handle.result()

    def release(self, symbols):
        self.engine.release(symbols)

    def stop(self):
        pass
