"""A sharded engine's faults beside the contract of one engine: a shard lost with requests of released symbols on
its way (--on-shard-loss reset), a shard slow to answer but answering, close() of shards that answer nothing, and
what make_engine refuses before any shard starts."""
import os
import signal
import threading
import time

import numpy as np
import pytest

import client.engine.sharded as sharded
from client.engine.reference import ReferenceEngine
from client.engine.shard_process import process_shards
from client.engine.sharded import ModelSpec, Shard, ShardedEngine, ShardError, ShardLost
from client.model import load_model
from shard_checks import LosableHere

TOLERANCE = dict(rtol=1e-4, atol=2e-5)


@pytest.fixture(scope="module")
def model():
    return load_model("tiny", seed=3)[0]


def _outcomes(step):
    """{row: prediction or exception} of a sharded step."""
    return {int(row): outcome if isinstance(outcome, Exception) else outcome[i]
            for rows, outcome in step.parts() for i, row in enumerate(rows)}


def test_reset_does_not_bring_back_the_state_of_a_symbol_released_after_its_unanswered_requests(model):
    """A lost shard's unanswered requests ran again on a live shard, those of symbols released after them too: the
    release went with the shard, so such a symbol was held again, its next request going on from the released
    state (and a request of its new life, queued behind, from the old one's) instead of a fresh one."""
    lossy = LosableHere(ReferenceEngine(model, device="cpu"), 0)
    engine = ShardedEngine([lossy, LosableHere(ReferenceEngine(model, device="cpu"), 1)], progress=False,
                           on_shard_loss="reset")
    fresh = ReferenceEngine(model, device="cpu")  # what a fresh state predicts, then goes on from
    try:
        x = np.random.default_rng(3).standard_normal((6, 79)).astype(np.float32)
        for symbol in ("A", "C", "B"):  # A and B on shard 0, C on shard 1
            engine.step([symbol], x[:1])
        assert engine.shard_of == {"A": 0, "B": 0, "C": 1}
        lossy.gate.clear()
        old = engine.submit(["A", "B"], x[1:3])  # unanswered when shard 0 is lost
        engine.release(["A", "B"])
        new = engine.submit(["A"], x[3:4])  # A again, from a fresh state: on shard 0 too (the fewest symbols)
        assert engine.shard_of["A"] == 0
        lossy.lose()
        assert all(isinstance(outcome, ShardLost) for outcome in _outcomes(old).values())
        np.testing.assert_allclose(new.result(), fresh.step(["A"], x[3:4]), **TOLERANCE)
        assert sorted(engine.symbols) == ["A", "C"]  # B left, and was not brought back
        np.testing.assert_allclose(engine.step(["A", "B"], x[4:6]), fresh.step(["A", "B"], x[4:6]), **TOLERANCE)
        assert engine.losses[0]["symbols"] == ["A"] and engine.losses[0]["moved_to"] == {"A": 1}
    finally:
        engine.close()


def test_a_reset_step_names_the_symbols_that_start_afresh_with_it_once_their_parts_arrive(model):
    """--on-shard-loss reset: a lost shard's symbol starts afresh with its first rows routed after the loss, its
    unanswered ones moved to a live shard (A, in the step in flight) or its next request (B): that step, and no
    other, names it restarted, once its part has arrived. A symbol whose state is imported (C), or which is released
    (F), before its next request does not start afresh with it by the loss, and no step names it."""
    lossy = LosableHere(ReferenceEngine(model, device="cpu"), 0)
    engine = ShardedEngine([lossy, LosableHere(ReferenceEngine(model, device="cpu"), 1)], progress=False,
                           on_shard_loss="reset")
    fresh = ReferenceEngine(model, device="cpu")
    try:
        x = np.random.default_rng(4).standard_normal((8, 79)).astype(np.float32)
        for symbol in ("A", "D", "B", "E", "C", "G", "F"):  # A, B, C and F on shard 0
            engine.step([symbol], x[:1])
        assert [engine.shard_of[s] for s in "ABCF"] == [0, 0, 0, 0]
        state_of_c = engine.export_state("C").result()
        before = engine.submit(["D", "E"], x[1:3])
        lossy.gate.clear()
        moved = engine.submit(["A", "D", "A"], x[1:4])  # A's rows unanswered when shard 0 is lost
        assert moved.restarted() == set()
        lossy.lose()
        np.testing.assert_allclose(moved.result()[[0, 2]], fresh.step(["A", "A"], x[[1, 3]]), **TOLERANCE)
        assert moved.restarted() == {"A"} and before.restarted() == set()
        engine.release(["F"])
        engine.import_state("C", state_of_c)
        after = engine.submit(["B", "A", "B", "C", "F"], x[3:8])
        np.testing.assert_allclose(after.result()[[0, 2]], fresh.step(["B", "B"], x[[3, 5]]), **TOLERANCE)
        assert after.restarted() == {"B"}
        again = engine.submit(["A", "B", "C", "F"], x[4:8])
        again.result()
        assert again.restarted() == set()
    finally:
        engine.close()

class _Slow(Shard):
    """A shard that answers each step `delay` seconds after the last (a step takes that long), until hung."""
    index, where, info = 0, "slow", {}

    def __init__(self, delay):
        self.delay, self.hung, self.ended = delay, threading.Event(), threading.Event()

    def submit(self, symbols, features):
        return len(symbols)

    def result(self, handle):
        if self.ended.wait(None if self.hung.is_set() else self.delay):
            raise ShardLost("stopped")
        return np.zeros((handle, 4), np.float32), {}, []

    def release(self, symbols):
        pass

    def stop(self):
        self.ended.set()


def test_a_shard_that_answers_slowly_but_steadily_is_not_taken_as_hung():
    """A shard answering a step every 0.3 s, several queued, was lost after answer_timeout_s (1 s) as one that
    "answered no step for 1 s": the timeout ran from the oldest unanswered step's sending, not from the shard's
    last answer. It answers them all; hung, it is still lost a timeout after its last answer."""
    slow = _Slow(0.3)
    engine = ShardedEngine([slow], progress=False, answer_timeout_s=1.0)
    try:
        steps = [engine.submit(["A"], np.zeros((1, 79), np.float32)) for _ in range(6)]  # 1.8 s of work
        for step in steps:
            assert step.result().shape == (1, 4)
        assert not engine.losses
        slow.hung.set()
        started = time.monotonic()
        with pytest.raises(ShardLost, match="answered no step for 1 s"):
            engine.step(["A"], np.zeros((1, 79), np.float32))
        assert time.monotonic() - started < 4
    finally:
        engine.close()


def test_close_ends_shards_that_answer_nothing_within_its_timeout_in_all(monkeypatch):
    """Each shard with a step unanswered (its process stopped) held close() for CLOSE_TIMEOUT_S waiting for the
    answer, then as long again waiting for the process to exit on "stop", shard after shard: two such shards, two
    minutes. Now every shard is waited for against one deadline, and those still owing answers then are killed."""
    monkeypatch.setattr(sharded, "CLOSE_TIMEOUT_S", 1.0)
    engine = ShardedEngine(process_shards(ModelSpec("tiny", seed=3), ["cpu", "cpu"], engine="reference",
                                          progress=False), progress=False)
    before = set(threading.enumerate())
    features = np.zeros((2, 79), np.float32)
    engine.step(["A", "B"], features)  # one on each shard
    processes = [shard.process for shard in engine.shards]
    for process in processes:
        os.kill(process.pid, signal.SIGSTOP)
    step = engine.submit(["A", "B"], features)
    started = time.monotonic()
    engine.close()
    assert time.monotonic() - started < 6
    assert all(isinstance(outcome, ShardError) and "closed" in str(outcome) for outcome in _outcomes(step).values())
    assert [process.exitcode for process in processes] == [-signal.SIGKILL] * 2
    for thread in set(threading.enumerate()) - before:
        thread.join(5)
        assert not thread.is_alive(), thread.name


def test_close_waits_for_shards_frozen_with_nothing_owed_at_once_not_in_turn(monkeypatch):
    """A shard process frozen with nothing in flight lets its threads end at once, then holds its stop
    STOP_TIMEOUT_S for the process to exit: three such shards held close() three times that, one after another."""
    import client.engine.shard_process as shard_process
    monkeypatch.setattr(sharded, "CLOSE_TIMEOUT_S", 1.0)
    monkeypatch.setattr(shard_process, "STOP_TIMEOUT_S", 2.0)
    engine = ShardedEngine(process_shards(ModelSpec("tiny", seed=3), ["cpu"] * 3, engine="reference",
                                          progress=False), progress=False)
    engine.step(["A", "B", "C"], np.zeros((3, 79), np.float32))
    processes = [shard.process for shard in engine.shards]
    for process in processes:
        os.kill(process.pid, signal.SIGSTOP)
    started = time.monotonic()
    engine.close()
    assert time.monotonic() - started < 4.5  # 2 s in all; in turn, 6 s
    assert [process.exitcode for process in processes] == [-signal.SIGKILL] * 3


def test_a_hung_shard_process_whose_pipe_releases_filled_is_lost_after_the_answer_timeout(monkeypatch):
    """A shard process alive but reading nothing, with no step in flight, was sent releases until its requests
    pipe was full (~64 KB): the write blocked its submitter, and every step queued behind, for good (the answer
    timeout ran only while a step was in flight)."""
    monkeypatch.setattr(sharded, "CLOSE_TIMEOUT_S", 1.0)
    engine = ShardedEngine(process_shards(ModelSpec("tiny", seed=3), ["cpu"], engine="reference", progress=False),
                           progress=False, answer_timeout_s=2.0)
    try:
        symbols = [f"{i:02d}" + "x" * 10_000 for i in range(20)]  # a release of them: 200 KB
        features = np.zeros((len(symbols), 79), np.float32)
        engine.step(symbols, features)
        os.kill(engine.shards[0].process.pid, signal.SIGSTOP)
        engine.release(symbols)
        step = engine.submit(["A"], features[:1])  # queued behind the release
        assert step.wait(10)
        with pytest.raises(ShardLost, match="answered no step for 2 s"):
            step.result()
    finally:
        engine.close()


@pytest.mark.parametrize("shards", [0, -1, 2.5, True, "2"])
def test_a_shard_count_that_is_not_a_whole_number_of_at_least_one_is_refused_before_any_shard_starts(
        monkeypatch, shards):
    """make_engine took --shards 0 as "every GPU", and a negative count started Ray and then no shard (the engine
    refused none, leaving the Ray it started running); 2.5 failed in the middle of the start."""
    import client.engine.shard_ray
    from client.engine import make_engine

    def start_shards(*args, **kwargs):
        raise AssertionError("shards started for a count that is refused")
    monkeypatch.setattr(client.engine.shard_ray, "ray_shards", start_shards)
    with pytest.raises(ValueError, match=rf"--shards must be a whole number of at least 1, got {shards!r}$"):
        make_engine("reference", None, "cpu", cluster="ray", spec=ModelSpec("tiny"), shards=shards)
