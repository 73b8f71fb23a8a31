"""Symbols sharded over engine processes (CPU processes here; one per GPU in use): the same predictions as one
engine, symbols placed by load and kept (until their shard forgets them as idle), parts answered as they complete,
a failing shard's part alone fails, a lost shard's symbols alone get errors. (Starting them again from a fresh
state, --on-shard-loss reset, is the transport-agnostic engine's: tests/test_sharded_ray.py.)"""
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from client.engine.base import PendingStep
from client.engine.fast import FastEngine
from client.engine.shard_process import process_shards
from client.engine.sharded import ModelSpec, Shard, ShardedEngine, ShardError, ShardLost, ShardStartError
from client.model import load_model
from conftest import checkout_env
from shard_checks import ShardHere, one_thread_shards

SPEC = ModelSpec("tiny", seed=3)
CAPACITY = 8  # symbols per shard, no host tier


def start(devices, **options):
    on_shard_loss = options.pop("on_shard_loss", "error")
    return ShardedEngine(process_shards(SPEC, devices, options=options, progress=False), progress=False,
                         on_shard_loss=on_shard_loss)


@pytest.fixture(scope="module")
def sharded():
    engine = start(["cpu", "cpu"], capacity=CAPACITY, host_symbols=0)
    yield engine
    engine.close()


def test_two_shards_equal_one_engine(sharded):
    model, _ = load_model("tiny", seed=3)
    single = FastEngine(model, "cpu", capacity=8, progress=False)
    rng = np.random.default_rng(0)
    symbols = [f"S{i}" for i in range(6)]
    for _ in range(5):
        chosen = [str(s) for s in rng.choice(symbols, 4, replace=False)]
        features = rng.standard_normal((4, 79)).astype(np.float32)
        # a shard steps its part of the batch alone, and a product of fewer rows may round differently
        np.testing.assert_allclose(sharded.step(chosen, features), single.step(chosen, features), rtol=0, atol=1e-4)
    counts = np.bincount(list(sharded.shard_of.values()), minlength=2)
    assert counts.sum() == 6 and abs(counts[0] - counts[1]) <= 1  # placed by load, each on one shard


def test_parts_arrive_with_their_rows(sharded):
    features = np.random.default_rng(1).standard_normal((3, 79)).astype(np.float32)
    pending = sharded.submit(["P0", "P1", "P2"], features)
    rows = sorted(int(r) for part_rows, outcome in pending.parts() for r in part_rows)
    assert rows == [0, 1, 2]
    assert pending.result().shape == (3, 4)


def test_steps_in_flight_keep_each_symbols_order(sharded):
    model, _ = load_model("tiny", seed=3)
    single = FastEngine(model, "cpu", capacity=8, progress=False)
    rng = np.random.default_rng(4)
    symbols = ["O0", "O1", "O2"]
    steps = [rng.standard_normal((3, 79)).astype(np.float32) for _ in range(8)]
    pending = [sharded.submit(symbols, features) for features in steps]  # all submitted before any is collected
    for step, features in zip(pending, steps):
        np.testing.assert_allclose(step.result(), single.step(symbols, features), rtol=0, atol=1e-4)


def test_a_symbols_several_requests_in_one_step_go_to_its_shard_in_order(sharded):
    """Rows of one symbol, interleaved with others' (several of them on each shard), advance it in order; each
    answer comes back in the caller's row."""
    model, _ = load_model("tiny", seed=3)
    one_at_a_time = FastEngine(model, "cpu", capacity=8, progress=False)
    symbols = ["M0", "M1", "M0", "M2", "M1", "M0", "M3", "M3"]
    features = np.random.default_rng(9).standard_normal((len(symbols), 79)).astype(np.float32)
    predictions = sharded.step(symbols, features)
    assert len({sharded.shard_of[s] for s in symbols}) == 2  # the step was split over both shards
    for row, symbol in enumerate(symbols):
        expected = one_at_a_time.step([symbol], features[row:row + 1])[0]
        np.testing.assert_allclose(predictions[row], expected, rtol=0, atol=1e-4)
    sharded.release(["M0", "M1", "M2", "M3"])


def _put(engine, symbol, shard):
    """Place a symbol on the given shard, as placement would have."""
    engine.shard_of[symbol] = shard
    engine._load[shard] += 1


def test_a_shard_without_room_fails_its_part_alone(sharded):
    features = np.zeros((1, 79), np.float32)
    held = sum(shard == 0 for shard in sharded.shard_of.values())
    filled = [f"F{i}" for i in range(CAPACITY - held)]
    for symbol in filled:  # fill shard 0
        _put(sharded, symbol, 0)
        sharded.step([symbol], features)
    _put(sharded, "NEW", 0)
    _put(sharded, "OTHER", 1)
    pending = sharded.submit(["NEW", "OTHER"], np.zeros((2, 79), np.float32))
    outcomes = {int(rows[0]): outcome for rows, outcome in pending.parts()}
    assert isinstance(outcomes[0], ShardError) and "no room for the state" in str(outcomes[0])
    assert outcomes[1].shape == (1, 4)  # the other shard's part is answered
    with pytest.raises(ShardError, match="no room"):
        pending.result()
    assert sharded.step(["F0"], features).shape == (1, 4)  # the full shard still serves its symbols
    sharded.release(filled + ["NEW", "OTHER"])


def test_a_symbol_without_room_fails_alone_on_its_shard(sharded):
    """A full shard refuses only the new symbol's rows: its known symbols' rows in the same part are answered, as a
    single engine's are (a refused request is lost to its symbol's state, so none may be refused for another's)."""
    model, _ = load_model("tiny", seed=3)
    single = FastEngine(model, "cpu", capacity=8, progress=False)
    features = np.random.default_rng(2).standard_normal((4, 79)).astype(np.float32)
    held = sum(shard == 0 for shard in sharded.shard_of.values())
    filled = [f"K{i}" for i in range(CAPACITY - held)]
    for symbol in filled:  # fill shard 0
        _put(sharded, symbol, 0)
    sharded.step(filled, np.zeros((len(filled), 79), np.float32))
    single.step(filled[:1], np.zeros((1, 79), np.float32))
    _put(sharded, "LATE", 0)
    _put(sharded, "ELSEWHERE", 1)
    pending = sharded.submit([filled[0], "LATE", filled[0], "ELSEWHERE"], features)
    outcomes = {int(row): (outcome if isinstance(outcome, Exception) else outcome[i])
                for rows, outcome in pending.parts() for i, row in enumerate(rows)}
    assert isinstance(outcomes[1], ShardError) and "no room for the state of 1 symbol(s) (LATE)" in str(outcomes[1])
    assert not isinstance(outcomes[0], Exception) and not isinstance(outcomes[2], Exception), outcomes[0]
    expected = single.step([filled[0], filled[0]], features[[0, 2]])
    np.testing.assert_allclose(np.stack([outcomes[0], outcomes[2]]), expected, rtol=0, atol=1e-4)
    assert outcomes[3].shape == (4,)
    with pytest.raises(ShardError, match="no room"):
        pending.result()
    sharded.release(filled + ["LATE", "ELSEWHERE"])


def test_a_symbol_refused_for_want_of_room_is_placed_afresh_at_its_next_request(sharded):
    """A new symbol that a full shard refused stayed bound to that shard (and among the engine's symbols, holding
    no state): refused for as long as that shard was full, however much room another had. Now its next request
    is placed as a new symbol's."""
    filled = []
    for shard in (0, 1):
        held = sum(index == shard for index in sharded.shard_of.values())
        filled += [f"W{shard}_{i}" for i in range(CAPACITY - held)]
        for symbol in filled[-(CAPACITY - held):]:
            _put(sharded, symbol, shard)
    sharded.step(filled, np.zeros((len(filled), 79), np.float32))
    full = min((0, 1), key=sharded._load.__getitem__)  # where a new symbol goes while both are full
    zeros = np.zeros((1, 79), np.float32)
    with pytest.raises(ShardError, match=rf"shard {full}: CapacityError: no room for the state of 1 symbol\(s\) "
                                         r"\(LONE\)"):
        sharded.step(["LONE"], zeros)
    assert "LONE" not in sharded.symbols
    sharded.release([next(s for s, index in sharded.shard_of.items() if index != full)])  # room on the other
    assert sharded.step(["LONE"], zeros).shape == (1, 4)
    assert sharded.shard_of["LONE"] != full
    sharded.release(filled + ["LONE"])


def test_a_new_symbol_goes_to_a_shard_with_room_where_the_one_holding_fewest_is_full():
    """Shards of unequal room (GPUs of unequal memory): a new symbol went to the shard holding the fewest symbols
    though it held all it had room for, and was refused there; placed afresh at its next request, it went back to
    that shard, refused for as long as it was full, however much room the other had."""
    from client.engine.reference import ReferenceEngine

    model, _ = load_model("tiny", seed=3)
    engine = ShardedEngine([ShardHere(ReferenceEngine(model, "cpu", capacity=1), 0),
                            ShardHere(ReferenceEngine(model, "cpu", capacity=4), 1)], progress=False)
    try:
        for symbol in ("A", "B", "C", "D", "C"):
            assert engine.step([symbol], np.zeros((1, 79), np.float32)).shape == (1, 4)
        assert engine.shard_of == {"A": 0, "B": 1, "C": 1, "D": 1}
    finally:
        engine.close()


def test_release_frees_a_symbol_everywhere(sharded):
    sharded.step(["R0"], np.zeros((1, 79), np.float32))
    sharded.release(["R0", "never-seen"])
    assert "R0" not in sharded.symbols


def test_a_lone_string_of_symbols_is_refused(sharded):
    sharded.step(["S", "T", "ST"], np.zeros((3, 79), np.float32))
    for call in (lambda: sharded.release("ST"), lambda: sharded.step("ST", np.zeros((2, 79), np.float32))):
        with pytest.raises(ValueError, match="symbols must be a list of strings, got the string"):
            call()
    assert {"S", "T", "ST"} <= set(sharded.symbols)
    sharded.release(["S", "T", "ST"])


IDLE_S = 1.0  # the idle timeout of the expiry tests: a symbol stepped again within it on a busy CPU is not idle


def _idle_engines():
    """Two shards forgetting symbols idle IDLE_S, and a single engine per shard, alike, to step the same parts. Both
    sides step on one thread (this process: conftest's): a CPU product split over threads may round otherwise, 2.7e-7
    apart with 16 threads in the shards and one here, and still 3e-8 with 15 on both sides (a 16-core host)."""
    assert torch.get_num_threads() == 1
    with one_thread_shards():
        engine = start(["cpu", "cpu"], capacity=CAPACITY, host_symbols=0, idle_timeout_s=IDLE_S)
    model, _ = load_model("tiny", seed=3)
    singles = [FastEngine(model, "cpu", capacity=CAPACITY, host_symbols=0, idle_timeout_s=IDLE_S, progress=False)
               for _ in range(2)]
    return engine, singles


def _assert_parts_equal(engine, singles, symbols, features, predictions):
    """Each shard's rows equal, bit for bit, its single engine's step of the same part."""
    for shard, single in enumerate(singles):
        rows = [row for row, symbol in enumerate(symbols) if engine.shard_of[symbol] == shard]
        if rows:
            np.testing.assert_array_equal(predictions[rows], single.step([symbols[r] for r in rows], features[rows]))


def test_symbols_a_shard_forgets_as_idle_leave_the_engine_and_its_placement():
    """A shard forgot its symbols idle past the timeout, but the engine kept listing them, counting them on their
    shard (a shard whose symbols had all gone looked full to the placement) and holding them for ever. Now each
    answer says what its shard forgot: as on a single engine, they are no longer listed, their next request starts a
    fresh state, and new symbols are placed by what each shard holds."""
    engine, singles = _idle_engines()
    try:
        rng = np.random.default_rng(11)
        symbols = ["A0", "A1", "A2", "A3"]  # placed alternately on the two shards
        features = rng.standard_normal((4, 79)).astype(np.float32)
        _assert_parts_equal(engine, singles, symbols, features, engine.step(symbols, features))
        assert engine._load == [2, 2]
        time.sleep(1.5 * IDLE_S)
        features = rng.standard_normal((1, 79)).astype(np.float32)
        _assert_parts_equal(engine, singles, ["B0"], features, engine.step(["B0"], features))  # shard 0 forgets 2
        assert engine.shard_of == {"A1": 1, "A3": 1, "B0": 0} and engine._load == [1, 2]
        assert sorted(engine.symbols) == sorted(singles[0].symbols + singles[1].symbols)  # shard 1 has not stepped
        engine.step(["C0"], features)
        assert engine.shard_of["C0"] == 0  # where fewer symbols are held
        singles[0].step(["C0"], features)
        again = rng.standard_normal((1, 79)).astype(np.float32)
        predictions = engine.step(["A0"], again)
        assert engine.shard_of["A0"] == 0
        _assert_parts_equal(engine, singles, ["A0"], again, predictions)  # from a fresh state, as the single's
    finally:
        engine.close()


def test_a_request_queued_while_its_shard_forgets_the_symbol_starts_it_afresh_there_in_order():
    """A symbol's next request already on its way to its shard when that shard forgets it (the answer saying so
    comes after): it stays placed there and counted, and its requests start a fresh state there, in order, as on a
    single engine; a symbol forgotten with no request on its way leaves the engine."""
    engine, singles = _idle_engines()
    try:
        rng = np.random.default_rng(12)
        first = ["Q0", "Q1"]  # Q0 on shard 0, Q1 on shard 1
        features = rng.standard_normal((2, 79)).astype(np.float32)
        _assert_parts_equal(engine, singles, first, features, engine.step(first, features))
        time.sleep(1.5 * IDLE_S)
        process = engine.shards[0].process
        os.kill(process.pid, signal.SIGSTOP)  # shard 0 answers nothing until both steps are on their way
        try:
            steps = [(["Q2", "Q3"], rng.standard_normal((2, 79)).astype(np.float32)),  # forget Q0 and Q1
                     (["Q0", "Q2", "Q0", "Q3"], rng.standard_normal((4, 79)).astype(np.float32))]
            pending = [engine.submit(symbols, step_features) for symbols, step_features in steps]
        finally:
            os.kill(process.pid, signal.SIGCONT)
        for (symbols, step_features), step in zip(steps, pending):
            _assert_parts_equal(engine, singles, symbols, step_features, step.result())
        assert engine.shard_of == {"Q0": 0, "Q2": 0, "Q3": 1} and engine._load == [2, 1]
        assert sorted(engine.symbols) == sorted(singles[0].symbols + singles[1].symbols)
    finally:
        engine.close()


def test_symbols_forgotten_by_a_step_that_fails_after_it_was_sent_leave_the_engine(monkeypatch):
    """A step whose placement forgot idle symbols, then failed after it was sent (a GPU's read-back raising): the
    list of those symbols was lost with its answer, and the engine listed them, and counted them on their shard,
    until they were released. The failed part's answer still carries them."""
    model, _ = load_model("tiny", seed=3)
    now = [0.0]
    single = FastEngine(model, "cpu", capacity=CAPACITY, host_symbols=0, idle_timeout_s=IDLE_S, progress=False)
    single.table.clock = lambda: now[0]
    engine = ShardedEngine([ShardHere(single)], progress=False)
    try:
        features = np.random.default_rng(13).standard_normal((2, 79)).astype(np.float32)
        engine.step(["F0", "F1"], features)
        now[0] = 2 * IDLE_S  # F0 and F1 idle: the next step's placement forgets them
        submit = single.submit

        def submit_then_fail(symbols, step_features):
            submit(symbols, step_features)  # sent: the step ran, its placement forgot F0 and F1

            def read_back():
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            return PendingStep(read_back)
        monkeypatch.setattr(single, "submit", submit_then_fail)
        with pytest.raises(ShardError, match="shard 0: RuntimeError: CUDA error: an illegal memory access"):
            engine.step(["F2"], features[:1])
        assert engine.symbols == single.symbols == ["F2"] and engine._load == [1]
    finally:
        engine.close()


class _UnreachableShard(Shard):
    """A shard whose calls all fail as unreachable, while its process or actor may live on."""
    index, where, info = 1, "elsewhere", {}

    def __init__(self):
        self.killed = 0

    def submit(self, symbols, features):
        return symbols

    def result(self, handle):
        raise ShardLost("unreachable")

    def release(self, symbols):
        pass

    def kill(self):
        self.killed += 1

    def stop(self):
        pass


def test_a_lost_shard_is_ended_at_its_loss():
    """A shard lost while its process or actor lives on (a Ray actor unreachable for a moment, a process that
    answered out of order) was left running until the client closed, holding its GPU for symbols it would never
    be sent again."""
    model, _ = load_model("tiny", seed=3)
    unreachable = _UnreachableShard()
    engine = ShardedEngine([ShardHere(FastEngine(model, "cpu", capacity=CAPACITY, progress=False)), unreachable],
                           progress=False)
    try:
        features = np.zeros((2, 79), np.float32)
        outcomes = [outcome for _, outcome in engine.submit(["A", "B"], features).parts()]
        assert sum(isinstance(outcome, ShardLost) for outcome in outcomes) == 1
        assert unreachable.killed == 1
    finally:
        engine.close()


def test_a_lost_shards_requests_fail_in_the_same_words_before_and_after_its_loss_is_known():
    """The team client answers a lost shard's requests with its failed part's error, and once the loss is known
    with unplaceable's reason: they said it in other words ("ShardLost: " or not), which the runtime logged as two
    reasons."""
    from team.example_model import ExampleModel

    model, _ = load_model("tiny", seed=3)
    engine = ShardedEngine([ShardHere(FastEngine(model, "cpu", capacity=CAPACITY, progress=False)),
                            _UnreachableShard()], progress=False)
    try:
        team, features = ExampleModel(engine), np.zeros(79, np.float32)
        first = team.process_batch({"A": (1, features), "B": (2, features)})
        again = team.process_batch({"A": (3, features), "B": (4, features)})
        assert first["errors"] == {2: "ShardLost: shard 1 (elsewhere) lost: unreachable"}
        assert again["errors"] == {4: first["errors"][2]}
    finally:
        engine.close()



def test_a_shard_lost_before_the_stream_plays_is_in_the_clients_summary(monkeypatch):
    """A shard lost while the team client's journal was replayed (no stream's client yet) was said on stderr alone:
    the listener that tells the client was set only after the replay, so the summary's notices and the server's
    leaderboard never said why that shard's symbols failed (or started again) for the whole session."""
    from client import event_loop
    from client.engine.reference import ReferenceEngine
    from team import example_model

    model, fingerprint = load_model("tiny", seed=0)  # the embedded server's weights
    engine = ShardedEngine([ShardHere(ReferenceEngine(model, "cpu")), _UnreachableShard()], progress=False)
    monkeypatch.setattr(example_model, "build_engine", lambda args, **kwargs: (engine, fingerprint, "shards here"))

    def replay_losing_a_shard(args, url, fingerprint, team_client):
        list(engine.submit(["A", "B"], np.zeros((2, 79), np.float32)).parts())  # B's shard is lost
        return None, None
    monkeypatch.setattr(example_model, "_replay_journal", replay_losing_a_shard)
    args = example_model.parse_args(["--preset", "tiny", "--engine", "reference", "--device", "cpu", "--symbols",
                                     "2", "--requests", "20", "--rate", "200"])
    summary, (server,) = event_loop.run(example_model.play(args))
    assert summary["outcome"] == "complete"
    (notice,) = summary["notices"]
    assert notice == {"code": "shard_lost", "text": engine.losses[0]["line"]}
    assert server["notices"] == [notice]

def test_a_lost_shards_failed_steps_are_not_kept_by_its_loss():
    """Every part sent to a lost shard failed with one exception, the shard's loss: each step's result() raised it
    again, adding that step's frames to its traceback, so that the loss kept every failed step (its features, the
    other parts' predictions, and the caller's frames up to where it was caught) for the engine's life."""
    import gc
    import weakref

    model, _ = load_model("tiny", seed=3)
    engine = ShardedEngine([ShardHere(FastEngine(model, "cpu", capacity=CAPACITY, progress=False)),
                            _UnreachableShard()], progress=False)
    try:
        list(engine.submit(["A", "B"], np.zeros((2, 79), np.float32)).parts())  # B's shard is lost
        failed = []
        for _ in range(3):
            step = engine.submit(["A", "B"], np.ones((2, 79), np.float32))
            failed.append(weakref.ref(step))
            with pytest.raises(ShardLost, match="shard 1 .* lost"):
                step.result()
            del step
        gc.collect()
        assert [ref() for ref in failed] == [None] * 3
    finally:
        engine.close()


def test_an_engine_dropped_unclosed_is_collected_and_stops_its_shards_and_a_with_block_closes_one():
    """Its threads held the engine (bound methods): dropped without close(), it kept its threads, its shard
    processes and their memory (a GPU each) for the process's life."""
    import gc
    import weakref

    before = set(threading.enumerate())
    engine = start(["cpu"], capacity=CAPACITY, host_symbols=0)
    features = np.random.default_rng(5).standard_normal((3, 79)).astype(np.float32)
    step = engine.submit(["A", "B", "A"], features)  # in flight as the engine goes: still answered
    process, threads = engine.shards[0].process, set(threading.enumerate()) - before
    assert len(threads) == 3  # its shard's submitter and collector, and the watch on late answers
    dropped = weakref.ref(engine)
    del engine
    gc.collect()
    assert dropped() is None
    assert step.result().shape == (3, 4)
    process.join(30)
    assert process.exitcode == 0  # stopped (not killed)
    for thread in threads:
        thread.join(10)
        assert not thread.is_alive()

    model, _ = load_model("tiny", seed=3)
    stopped = []
    with ShardedEngine([ShardHere(FastEngine(model, "cpu", capacity=CAPACITY, progress=False))],
                       progress=False) as engine:
        engine.shards[0].stop = lambda: stopped.append(True)
        assert engine.step(["A"], features[:1]).shape == (1, 4)
    assert stopped == [True]
    engine.close()  # a second close does nothing more
    assert stopped == [True]


class _AnswersUntilStopped(Shard):
    """A shard whose steps wait for an answer that never comes: its stop() ends it, and every wait is lost."""
    index, where, info = 0, "slow", {}

    def __init__(self):
        self.stopped = threading.Event()

    def submit(self, symbols, features):
        return len(symbols)

    def result(self, handle):
        self.stopped.wait()
        raise ShardLost("stopped")

    def release(self, symbols):
        pass

    def stop(self):
        self.stopped.set()


def test_the_steps_of_an_engine_dropped_unclosed_fail_when_its_collection_stops_a_slow_shard(monkeypatch):
    """The collection stops a shard that has not answered in CLOSE_TIMEOUT_S, as close() does; the shard's loss
    then found no engine to fail its steps, and their result() waited for ever (close() fails them)."""
    import gc

    import client.engine.sharded as sharded

    monkeypatch.setattr(sharded, "CLOSE_TIMEOUT_S", 0.2)
    engine = ShardedEngine([_AnswersUntilStopped()], progress=False)
    features = np.zeros((1, 79), np.float32)
    steps = [engine.submit(["A"], features) for _ in range(3)]
    del engine
    gc.collect()
    for step in steps:
        assert step.wait(5)
        with pytest.raises(ShardError, match="closed"):
            step.result()


def test_missing_gpu_is_a_clear_error():
    with pytest.raises(ValueError, match=r"asked for, but this machine has \d+ GPU"):
        process_shards(SPEC, ["cuda:7"], progress=False)


def test_shard_that_cannot_start_says_why():
    with pytest.raises(ShardStartError, match="failed to start: cpu: ValueError: unknown preset"):
        process_shards(ModelSpec("huge"), ["cpu"], progress=False)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpu_shards_serve_like_one_engine():
    model, _ = load_model("small", seed=3, device="cuda")
    single = FastEngine(model, "cuda", capacity=16, host_symbols=0, progress=False)
    engine = ShardedEngine(process_shards(ModelSpec("small", seed=3), ["cuda:0", "cuda:1"],
                                          options={"capacity": 16, "host_symbols": 0}, progress=False),
                           progress=False)
    try:
        rng = np.random.default_rng(2)
        for _ in range(10):
            chosen = [f"S{i}" for i in rng.choice(16, 12, replace=False)]
            features = rng.standard_normal((12, 79)).astype(np.float32)
            np.testing.assert_allclose(engine.step(chosen, features), single.step(chosen, features), rtol=0, atol=2e-4)
        assert sorted(set(engine.shard_of.values())) == [0, 1]
    finally:
        engine.close()


def test_a_lost_shard_fails_its_symbols_alone(capsys):
    engine = ShardedEngine(process_shards(SPEC, ["cpu", "cpu"], options={"capacity": CAPACITY}, progress=False),
                           progress=True, on_shard_loss="error")
    try:
        model, _ = load_model("tiny", seed=3)
        single = FastEngine(model, "cpu", capacity=8, progress=False)
        symbols = ["L0", "L1", "L2", "L3"]  # placed alternately on the two shards
        features = np.random.default_rng(5).standard_normal((4, 79)).astype(np.float32)
        np.testing.assert_allclose(engine.step(symbols, features), single.step(symbols, features), rtol=0, atol=1e-4)
        lost = [s for s in symbols if engine.shard_of[s] == 1]
        os.kill(engine.shards[1].process.pid, signal.SIGKILL)
        features = np.random.default_rng(6).standard_normal((4, 79)).astype(np.float32)
        expected = single.step(symbols, features)
        for rows, outcome in engine.submit(symbols, features).parts():
            if engine.shard_of[symbols[rows[0]]] == 1:
                assert isinstance(outcome, ShardLost) and "shard 1 (process on cpu) lost: its process exited" in str(outcome)
            else:
                np.testing.assert_allclose(outcome, expected[rows], rtol=0, atol=1e-4)
        line = f"shard 1 (process on cpu) lost: its process exited (exit code -9); its 2 symbol(s) {', '.join(lost)} get errors"
        assert line in capsys.readouterr().err
        assert engine.losses[0]["symbols"] == lost
        assert set(engine.unplaceable(symbols)) == set(lost)  # a caller can answer them without stepping
        kept = [s for s in symbols if s not in lost]
        again = np.random.default_rng(7).standard_normal((2, 79)).astype(np.float32)
        np.testing.assert_allclose(engine.step(kept, again), single.step(kept, again), rtol=0, atol=1e-4)
        engine.step(["NEW"], again[:1])
        assert engine.shard_of["NEW"] == 0  # new symbols go to the live shard
    finally:
        engine.close()


def test_a_hung_shard_is_stopped_after_the_answer_timeout_and_fails_its_symbols_alone(capsys):
    """A shard alive but answering nothing (here: its process stopped) would hold every step that has a part on
    it, and with them every symbol: after the timeout it is killed and lost, and the others keep playing."""
    # 5 s: on a busy 2-core CPU a shard's first step took over 1 s
    engine = ShardedEngine(process_shards(SPEC, ["cpu", "cpu"], options={"capacity": CAPACITY}, progress=False),
                           progress=True, on_shard_loss="error", answer_timeout_s=5.0)
    try:
        symbols = ["H0", "H1", "H2", "H3"]  # placed alternately on the two shards
        features = np.random.default_rng(5).standard_normal((4, 79)).astype(np.float32)
        engine.step(symbols, features)
        hung = [s for s in symbols if engine.shard_of[s] == 1]
        process = engine.shards[1].process
        os.kill(process.pid, signal.SIGSTOP)
        started = time.monotonic()
        for rows, outcome in engine.submit(symbols, features).parts():
            if engine.shard_of[symbols[rows[0]]] == 1:
                assert isinstance(outcome, ShardLost), outcome
                assert str(outcome) == ("shard 1 (process on cpu) lost: it answered no step for 5 s "
                                        "(--shard-timeout-s); stopped")
            else:
                assert np.isfinite(outcome).all()
        assert 5.0 < time.monotonic() - started < 20
        deadline = time.monotonic() + 10  # the engine reaps it: poll, not join, from this thread
        while process.exitcode is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert process.exitcode == -signal.SIGKILL
        assert f"its 2 symbol(s) {', '.join(hung)} get errors" in capsys.readouterr().err
        kept = [s for s in symbols if s not in hung]
        assert np.isfinite(engine.step(kept, features[:2])).all()
    finally:
        engine.close()


class _StoppableShard:
    info = {}
    stopped = False

    def stop(self):
        self.stopped = True


@pytest.mark.parametrize("options, match", [
    ({"answer_timeout_s": 0}, "--shard-timeout-s must be a positive number of seconds, got 0"),
    ({"answer_timeout_s": "5"}, "--shard-timeout-s must be a positive number of seconds, got '5'"),
    ({"on_shard_loss": "retry"}, "--on-shard-loss 'retry': choose one of error, reset"),
])
def test_bad_loss_options_are_one_line_and_stop_the_shards_given(options, match):
    shard = _StoppableShard()  # the engine owns the shards it is given: a refusal left them running
    with pytest.raises(ValueError, match=match):
        ShardedEngine([shard], progress=False, **options)
    assert shard.stopped


@pytest.mark.parametrize("options, match", [
    ({"on_shard_loss": "retry"}, "--on-shard-loss 'retry': choose one of error, reset"),
    ({"shard_timeout_s": -1.0}, "--shard-timeout-s must be a positive number of seconds, got -1.0"),
])
def test_bad_loss_options_are_refused_before_any_shard_starts(monkeypatch, options, match):
    """They were refused once every shard had started (minutes on GPUs), and the shards (and a local Ray) were left
    running."""
    import client.engine.shard_ray
    from client.engine import make_engine

    def start_shards(*args, **kwargs):
        raise AssertionError("shards started for options that are refused")
    monkeypatch.setattr(client.engine.shard_ray, "ray_shards", start_shards)
    with pytest.raises(ValueError, match=match):
        make_engine("reference", None, "cpu", cluster="ray", spec=SPEC, **options)


def test_a_lost_shard_says_its_exit_code_whichever_thread_sees_the_exit():
    """The engine's submitter and collector may see a shard's exit at once (a broken pipe, the end of its
    replies): each says its exit code. (Eight threads here, so that they race to reap it.)"""
    (shard,) = process_shards(SPEC, ["cpu"], engine="reference", progress=False)
    try:
        os.kill(shard.process.pid, signal.SIGKILL)
        time.sleep(0.5)  # exited, not yet reaped
        together = threading.Barrier(8)
        said = []

        def notice():
            together.wait()
            said.append(str(shard._gone()))

        threads = [threading.Thread(target=notice) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert said == ["its process exited (exit code -9)"] * 8
    finally:
        shard.stop()


def _open_fds():
    return len(os.listdir("/proc/self/fd"))


def test_a_closed_or_lost_process_shard_gives_its_pipes_back_at_once():
    """A process shard kept its 4 pipe descriptors (its requests' and replies', and the two of its process's start)
    until it was collected: after a loss (the engine keeps its shards) and after close() alike."""
    from multiprocessing import resource_tracker
    resource_tracker.ensure_running()  # the first process started starts it, with a pipe kept for good
    before = _open_fds()
    engine = start(["cpu", "cpu"])
    try:
        features = np.zeros((2, 79), np.float32)
        engine.step(["A", "B"], features)  # one on each shard
        lost = engine.shards[engine.shard_of["B"]]
        os.kill(lost.process.pid, signal.SIGKILL)
        with pytest.raises(ShardLost):
            engine.step(["B"], features[:1])
        deadline = time.monotonic() + 5  # the engine kills the lost shard after it fails its parts
        while _open_fds() > before + 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _open_fds() == before + 4  # the live shard's alone
        assert engine.step(["A"], features[:1]).shape == (1, 4)
    finally:
        engine.close()
    assert _open_fds() == before
    assert lost.process.exitcode == -signal.SIGKILL  # its process still says how it ended


def test_ctrl_c_at_the_terminal_leaves_the_shards_serving():
    """Ctrl-C reaches the whole foreground process group, shards included: the client stops cleanly on it (the
    summary so far printed, close() ending the shards), so a shard must not die of it first (its symbols would
    be reported lost, to the server too)."""
    engine = start(["cpu"])
    try:
        features = np.zeros((1, 79), np.float32)
        engine.step(["C0"], features)
        os.kill(engine.shards[0].process.pid, signal.SIGINT)
        engine.shards[0].process.join(timeout=2)  # returns at once where the shard dies of it
        assert engine.step(["C0"], features).shape == (1, 4) and not engine.losses
    finally:
        engine.close()
    assert engine.shards[0].process.exitcode == 0  # and close() still ends it


def test_a_shard_whose_parent_is_gone_exits_quietly():
    """A client killed (or interrupted twice: it exits at once) sends no "stop": its shards see the end of their
    pipe, and end without a traceback, steps of theirs in flight too (the answer to one printed a broken pipe's)."""
    parent = ("import os, numpy as np\n"
              "from client.engine.shard_process import process_shards\n"
              "from client.engine.sharded import ModelSpec\n"
              "(shard,) = process_shards(ModelSpec('tiny', seed=3), ['cpu'], engine='reference', progress=False)\n"
              "for _ in range(20):\n"
              "    shard.submit(['A', 'B'], np.zeros((2, 79), np.float32))\n"
              "print(shard.process.pid, flush=True)\n"
              "os._exit(130)\n")
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", parent], cwd=root, env=checkout_env(root), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 130 and "Traceback" not in done.stderr, done.stderr
    pid = int(done.stdout)
    deadline = time.monotonic() + 10
    while _running(pid):
        assert time.monotonic() < deadline, f"shard process {pid} outlived its parent"
        time.sleep(0.1)


def _running(pid):
    """Whether the process runs (an exited one may stay a zombie until whoever adopted it reaps it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("options, match", [
    ({"on_shard_loss": "reset"}, "--on-shard-loss applies to sharded engines"),
    ({"shard_timeout_s": 5.0}, "--shard-timeout-s applies to sharded engines"),
    ({"shards": 2}, "--ray-address and --shards apply with --cluster ray"),
    ({"ray_address": "head:6379"}, "--ray-address and --shards apply with --cluster ray"),
    ({"cluster": "ray", "gpus": 2, "spec": SPEC}, "--gpus is for one machine"),
    ({"cluster": "ray"}, "needs the model's spec"),
    ({"cluster": "slurm", "spec": SPEC}, "the one cluster supported is ray"),
])
def test_cluster_options_that_do_not_go_together_are_one_line(options, match):
    from client.engine import make_engine

    with pytest.raises(ValueError, match=match):
        make_engine("fast", None, "cpu", **options)
