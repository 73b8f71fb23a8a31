"""The runtime against a real in-test websocket server playing scripted request streams."""
import asyncio
import gc
import logging
import math
import socket
import threading
import time
import warnings

import numpy as np
import pytest
from websockets.asyncio.server import serve
from websockets.exceptions import ConnectionClosed

from client import cli, protocol
from client.engine.reference import ReferenceEngine
from client.model import load_model
from client import runtime
from client.runtime import ClientStats, StreamingClient
from team.example_model import ExampleModel

SYMBOLS = ["SYM_000", "SYM_001", "SYM_002"]


@pytest.fixture(scope="module")
def model():
    return load_model("tiny", seed=1)[0]


class CountingClient(ExampleModel):
    """The example client, counting the rows it steps per symbol."""

    def __init__(self, engine, fail_on_id=None):
        super().__init__(engine)
        self.stepped = {}
        self.fail_on_id = fail_on_id

    def process_batch(self, requests_by_symbol):
        if any(uid == self.fail_on_id for queued in requests_by_symbol.values() for uid, _ in queued):
            raise RuntimeError("team client bug")
        for symbol, queued in requests_by_symbol.items():
            self.stepped[symbol] = self.stepped.get(symbol, 0) + len(queued)
        return super().process_batch(requests_by_symbol)


def _stream(n, seed=0):
    rng = np.random.default_rng(seed)
    return [SYMBOLS[i % len(SYMBOLS)] for i in range(n)], rng.standard_normal((n, 79)).astype(np.float32)


def _expected(model, symbols, features, ids):
    """Each symbol alone, straight through, over the requests `ids` in order."""
    engines = {s: ReferenceEngine(model) for s in SYMBOLS}
    return {i: engines[symbols[i]].step([symbols[i]], features[i:i + 1])[0] for i in ids}


def _request(ids, symbols, features):
    return protocol.encode(protocol.inference_request(ids, [symbols[i] for i in ids], features[ids], 0.0))


class Recorder:
    """What the client sent to the in-test server, across connections."""

    def __init__(self):
        self.responses = []  # (unique_id, prediction [4]) in arrival order
        self.errors = []     # details strings
        self.types = []

    def answered(self):
        return {uid for uid, _ in self.responses}

    async def pump(self, ws, done, timeout_s=60):
        async def loop():
            while not done():
                msg = protocol.decode(await ws.recv())
                self.types.append(msg["type"])
                if msg["type"] == "inference_response":
                    ids, predictions = protocol.parse_inference_response(msg)
                    self.responses.extend(zip(ids, predictions))
                elif msg["type"] == "error":
                    self.errors.append(msg["details"])
        await asyncio.wait_for(loop(), timeout_s)


async def _play(handler, team_client, **client_options):
    async with serve(handler, "127.0.0.1", 0) as server:
        port = server.sockets[0].getsockname()[1]
        client = StreamingClient(team_client, f"ws://127.0.0.1:{port}", "testers", backoff_s=0.02,
                                 **client_options)
        return client, await asyncio.wait_for(client.run(), 120)


def _assert_in_order_per_symbol(responses, symbols):
    for symbol in SYMBOLS:
        ids = [uid for uid, _ in responses if symbols[uid] == symbol]
        assert ids == sorted(ids)


def test_bad_messages_and_rows_are_answered_with_errors_and_the_rest_goes_on(model):
    symbols, features = _stream(15)
    nan_id, inf_id, bad_length_ids = 6, 10, [11, 12]
    valid = [i for i in range(15) if i not in (nan_id, inf_id, *bad_length_ids)]
    features[nan_id, 3] = np.nan
    features[inf_id, 0] = -np.inf
    recorder = Recorder()

    async def handler(ws):
        assert protocol.decode(await ws.recv()) == protocol.register("testers")
        await ws.send(_request([0, 1, 2, 3, 4, 5], symbols, features))
        await ws.send(b"\xc1 not msgpack")
        await ws.send("a text frame")
        await ws.send(protocol.encode({"type": "bogus", "x": 1}))
        await ws.send(protocol.encode(protocol.heartbeat(1.0)))
        await ws.send(_request([6, 7, 8], symbols, features))
        await ws.send(_request([9, 10], symbols, features))
        short = protocol.inference_request(bad_length_ids, [symbols[i] for i in bad_length_ids],
                                           features[bad_length_ids], 0.0)
        short["features"] = short["features"][:-4]
        await ws.send(protocol.encode(short))
        await ws.send(_request([13, 14], symbols, features))
        await recorder.pump(ws, lambda: recorder.answered() >= set(valid) and len(recorder.errors) >= 6
                            and "heartbeat" in recorder.types)
        await ws.close(1000)

    team_client = CountingClient(ReferenceEngine(model))
    client, summary = asyncio.run(_play(handler, team_client, heartbeat_s=0.05))

    assert sorted(uid for uid, _ in recorder.responses) == valid  # each valid id once, the bad ones never
    expected = _expected(model, symbols, features, valid)
    for uid, prediction in recorder.responses:
        np.testing.assert_allclose(prediction, expected[uid], rtol=1e-5, atol=1e-6)
    _assert_in_order_per_symbol(recorder.responses, symbols)
    errors = "\n".join(recorder.errors)
    assert "malformed msgpack" in errors and "text frame" in errors and "unknown message type 'bogus'" in errors
    assert f"unique_id {nan_id} " in errors and f"unique_id {inf_id} " in errors and "NaN or inf" in errors
    assert "[11, 12]" in errors and "bytes" in errors
    assert sum(team_client.stepped.values()) == len(valid)
    assert summary["requests"] == 15 and summary["errors"] == 4 and summary["connections"] == 1


class NonFiniteAt(ExampleModel):
    """The example client, its predictions for some ids made NaN or inf (a team's bug, or a state gone non-finite)."""

    def __init__(self, engine, bad):
        super().__init__(engine)
        self.bad = bad

    def process_batch(self, requests_by_symbol):
        answer = super().process_batch(requests_by_symbol)
        for row, uid in enumerate(answer["unique_ids"]):
            if uid in self.bad:
                answer["predictions"][row, row % 4] = self.bad[uid]
        return answer


@pytest.mark.parametrize("url_scheme", ["ws", "tcp"])
def test_a_non_finite_prediction_is_never_sent_its_request_fails_and_the_rest_are_answered(model, url_scheme,
                                                                                            tmp_path):
    """NaN never passes: a request whose prediction is NaN or inf is answered with an error (it went out as a
    response: NaN in the original protocol's JSON, which is no JSON), its batch's others as usual."""
    from server import ScoringServer, ServerConfig

    async def main():
        server = ScoringServer(ServerConfig(preset="tiny", seed=1, symbols=2, requests=8, rate=300.0, timeout_s=1.0,
                                            cache_dir=str(tmp_path)))
        port = await server.start()
        client = StreamingClient(NonFiniteAt(ReferenceEngine(model), {2: np.nan, 5: np.inf}),
                                 f"{url_scheme}://127.0.0.1:{port}", "testers", leave_at_end=True)
        summary = await asyncio.wait_for(client.run(), 60)
        await server.stop()
        return summary, server.summaries()

    summary, [team] = asyncio.run(main())
    assert summary["requests"] == 8 and summary["errors"] == 2 and summary["responses_sent"] == 6
    assert summary["responses"] == 6 and summary["accuracy"] == 1.0
    assert team["responses"] == 6 and team["client_errors"] == 2 and team["errors"] == 0  # none refused as NaN


def test_a_malformed_frames_new_rows_count_as_requests_received_and_answered_with_errors(model):
    """A request frame whose rows do not agree (3 ids, 2 symbols): its ids new to the client are requests received
    and refused, once each, so that errors never outnumber requests; an id of it answered before is neither. Ids
    that are no list of integers: the integers among them count so."""
    symbols, features = _stream(5)
    recorder = Recorder()

    async def handler(ws):
        assert protocol.decode(await ws.recv())["type"] == "register"
        await ws.send(_request([0, 1], symbols, features))
        await recorder.pump(ws, lambda: recorder.answered() == {0, 1})
        bad = protocol.inference_request([1, 2, 3], [symbols[i] for i in (1, 2, 3)], features[[1, 2, 3]], 0.0)
        bad["symbols"] = bad["symbols"][:2]
        await ws.send(protocol.encode(bad))
        await ws.send(_request([2], symbols, features))  # a resend of a refused row: refused, not counted again
        odd_ids = protocol.inference_request([5, 6], symbols[:2], features[:2], 0.0)
        odd_ids["unique_ids"][1] = "6"
        await ws.send(protocol.encode(odd_ids))
        await ws.send(_request([4], symbols, features))
        await recorder.pump(ws, lambda: 4 in recorder.answered() and len(recorder.errors) >= 3)
        await ws.close(1000)

    client, summary = asyncio.run(_play(handler, ExampleModel(ReferenceEngine(model))))
    assert "3 unique_ids but 2 symbols; unique_ids [2, 3] not answered" in recorder.errors[0]
    assert "unique_id 2 " in recorder.errors[1] and "rejected earlier" in recorder.errors[1]
    assert ("field 'unique_ids' must be a list of integers, got list (1 of its 2 unique_ids are no integers: only the "
            "integers count as requests); unique_ids [5] not answered") in recorder.errors[2]
    assert sorted(recorder.answered()) == [0, 1, 4]
    assert (summary["requests"], summary["errors"], summary["responses_sent"]) == (6, 3, 3)


class RecordingBatches(ExampleModel):
    """The example client, keeping every batch it was given."""

    def __init__(self, engine):
        super().__init__(engine)
        self.batches = []

    def process_batch(self, requests_by_symbol):
        self.batches.append({s: [uid for uid, _ in queued] for s, queued in requests_by_symbol.items()})
        return super().process_batch(requests_by_symbol)


class OnePerSymbol:
    """A team client written before batches carried lists: {symbol: (unique_id, features)}."""

    def __init__(self, engine):
        self.engine, self.batches = engine, []

    def process_batch(self, requests_by_symbol):
        self.batches.append(dict(requests_by_symbol))
        symbols = list(requests_by_symbol)
        ids = [requests_by_symbol[s][0] for s in symbols]
        features = np.stack([requests_by_symbol[s][1] for s in symbols])
        return {"unique_ids": ids, "predictions": self.engine.step(symbols, features)}


@pytest.mark.parametrize("per_symbol", [1, 3])
def test_a_backlog_drains_several_requests_of_a_symbol_per_step_in_order(model, per_symbol):
    """A burst of requests of a few symbols: each step takes up to max_requests_per_symbol of a symbol's queued
    requests in arrival order; every answer equals stepping the requests one at a time. A team client that takes
    one request per symbol gets one, whatever the cap."""
    n = 24
    symbols, features = _stream(n, seed=7)
    nan_id = 9
    features[nan_id, 2] = np.nan  # rejected alone: its symbol's later requests go on from the state before it
    valid = [i for i in range(n) if i != nan_id]
    recorder = Recorder()

    async def handler(ws):
        await ws.recv()
        await ws.send(_request(list(range(n)), symbols, features))
        await recorder.pump(ws, lambda: recorder.answered() >= set(valid))
        await ws.close(1000)

    lists, legacy = RecordingBatches(ReferenceEngine(model)), OnePerSymbol(ReferenceEngine(model))
    for team_client in (lists, legacy):
        recorder.responses.clear()
        asyncio.run(_play(handler, team_client, max_requests_per_symbol=per_symbol))
        assert sorted(uid for uid, _ in recorder.responses) == valid
        expected = _expected(model, symbols, features, valid)
        for uid, prediction in recorder.responses:
            np.testing.assert_allclose(prediction, expected[uid], rtol=1e-5, atol=1e-6)
        _assert_in_order_per_symbol(recorder.responses, symbols)
    assert all(isinstance(v, tuple) for batch in legacy.batches for v in batch.values())
    longest = max(len(ids) for batch in lists.batches for ids in batch.values())
    assert longest == per_symbol  # the burst arrived at once: the first step takes a full run of each symbol
    served = [uid for batch in lists.batches for ids in batch.values() for uid in ids]
    assert sorted(served) == valid


def test_a_prefetch_that_blocks_or_fails_holds_up_no_request(model):
    """The team client's prefetch runs off the event loop: while one call blocks (a state table's lock held long),
    requests keep being received and answered, in order and as stepping them one at a time; a prefetch that raises
    is logged and changes nothing. The calls see every arrived symbol once each, in arrival order."""
    symbols, features = _stream(12)
    expected = _expected(model, symbols, features, range(12))
    release = threading.Event()

    class SlowPrefetch(ExampleModel):
        calls = []
        moves_states = True  # its prefetch has work to do, whatever the engine's states do

        def prefetch(self, symbols):
            self.calls.append(list(symbols))
            if len(self.calls) == 1:
                release.wait(60)
            elif len(self.calls) == 2:
                raise RuntimeError("team client bug")

    recorder = Recorder()

    async def handler(ws):
        await ws.recv()
        await ws.send(_request([0, 1, 2], symbols, features))  # the first prefetch call blocks
        await recorder.pump(ws, lambda: len(recorder.answered()) == 3, timeout_s=20)
        await ws.send(_request([3, 4, 5, 6, 7, 8], symbols, features))
        await ws.send(_request([9, 10, 11], symbols, features))
        await recorder.pump(ws, lambda: len(recorder.answered()) == 12, timeout_s=20)
        release.set()
        await ws.close(1000)

    team_client = SlowPrefetch(ReferenceEngine(model))
    started = time.monotonic()
    asyncio.run(_play(handler, team_client))
    assert time.monotonic() - started < 30  # on the event loop, the blocked call would have held it 60 s
    _assert_in_order_per_symbol(recorder.responses, symbols)
    for uid, prediction in recorder.responses:
        np.testing.assert_allclose(prediction, expected[uid], rtol=1e-5, atol=1e-6)
    assert team_client.calls[0] == SYMBOLS and all(call == SYMBOLS for call in team_client.calls[1:])
    assert 2 <= len(team_client.calls) <= 3  # the later arrivals, coalesced while the first call blocked


def test_a_symbol_whose_state_is_on_its_way_waits_alone_and_in_order(model):
    """The fast engine's host tier holds COLD's state, and its way back to the GPU is held up on the copy queue:
    the runtime starts the return when COLD's requests arrive (prefetch), the scheduler holds COLD back (ready)
    while the other symbols are answered, and COLD's requests are answered in order once its state is back; every
    answer is the one of stepping each symbol's requests one at a time."""
    from client.engine.fast import FastEngine
    from client.engine.precision import FP32_PRECISION

    names = ["COLD", "SYM_000", "SYM_001"]
    symbols = [names[i % 3] for i in range(12)]
    features = np.random.default_rng(3).standard_normal((12, 79)).astype(np.float32)
    warm = np.random.default_rng(4).standard_normal((3, 79)).astype(np.float32)
    engine = FastEngine(model, device="cpu", precision=FP32_PRECISION, capacity=3, host_symbols=3, reserve=1,
                        progress=False)
    engine.step(["COLD"], warm[:1])
    engine.step(["SYM_000", "SYM_001"], warm[1:])  # COLD, least recently used, moves out to keep a slot free
    assert list(engine.table.offloaded) == ["COLD"]
    release = threading.Event()
    engine.table.before_copy = lambda symbol, direction: (
        release.wait(30) if (symbol, direction) == ("COLD", "to_gpu") else None)

    class Prefetching(ExampleModel):
        prefetched = []

        def prefetch(self, symbols):
            self.prefetched.append(list(symbols))
            super().prefetch(symbols)

    recorder, others = Recorder(), {i for i in range(12) if symbols[i] != "COLD"}

    async def handler(ws):
        await ws.recv()
        await ws.send(_request(list(range(12)), symbols, features))
        await recorder.pump(ws, lambda: recorder.answered() >= others, timeout_s=20)
        assert not recorder.answered() - others  # COLD still on its way
        release.set()
        await recorder.pump(ws, lambda: len(recorder.answered()) == 12)
        await ws.close(1000)

    waits = engine.table.stats["step_waits"]
    team_client = Prefetching(engine)
    asyncio.run(_play(handler, team_client))
    assert team_client.prefetched[0] == names and engine.table.stats["restored_ahead"] == 1
    assert engine.table.stats["step_waits"] == waits  # COLD stepped once its state was back
    cold = [uid for uid, _ in recorder.responses if symbols[uid] == "COLD"]
    assert cold == [0, 3, 6, 9] and [uid for uid, _ in recorder.responses][-4:] == cold
    references = {name: ReferenceEngine(model) for name in names}
    references["COLD"].step(["COLD"], warm[:1])
    for name, row in zip(names[1:], warm[1:]):
        references[name].step([name], row[None])
    expected = {uid: references[symbols[uid]].step([symbols[uid]], features[uid:uid + 1])[0] for uid in range(12)}
    for uid, prediction in recorder.responses:
        np.testing.assert_allclose(prediction, expected[uid], rtol=1e-4, atol=2e-5)


def test_reconnect_keeps_state_and_answers_resent_ids_from_cache(model):
    symbols, features = _stream(24, seed=5)
    recorder = Recorder()
    connections = []

    async def handler(ws):
        connections.append(ws)
        assert protocol.decode(await ws.recv())["type"] == "register"
        if len(connections) == 1:
            await ws.send(_request(list(range(0, 6)), symbols, features))
            await ws.send(_request(list(range(6, 12)), symbols, features))
            await recorder.pump(ws, lambda: recorder.answered() >= set(range(6)))
            ws.transport.abort()  # a dropped connection, no close frame
            return
        # The server resends what it considers unanswered: 3..11, pretending 3..5's answers were lost.
        await ws.send(_request(list(range(3, 12)), symbols, features))
        await ws.send(_request(list(range(12, 24)), symbols, features))
        await recorder.pump(ws, lambda: recorder.answered() >= set(range(24)) and
                            sum(1 for uid, _ in recorder.responses if uid in (3, 4, 5)) >= 6)
        await ws.close(1000)

    team_client = CountingClient(ReferenceEngine(model))
    client, summary = asyncio.run(_play(handler, team_client))

    assert len(connections) == 2 and summary["connections"] == 2
    assert sum(team_client.stepped.values()) == 24  # resent ids never stepped twice
    expected = _expected(model, symbols, features, range(24))
    for uid, prediction in recorder.responses:
        np.testing.assert_allclose(prediction, expected[uid], rtol=1e-5, atol=1e-6)
    assert summary["resent_from_cache"] >= 3
    _assert_in_order_per_symbol([r for r in recorder.responses if r[0] >= 12], symbols)


class SlowOnRequestZero(CountingClient):
    def process_batch(self, requests_by_symbol):
        if any(uid == 0 for queued in requests_by_symbol.values() for uid, _ in queued):
            time.sleep(0.5)  # still stepping when the connection drops and the client reconnects
        return super().process_batch(requests_by_symbol)


async def _drop_after_sending(ws, ids, symbols, features):
    """The first connection: requests `ids`, then dropped while their step runs."""
    await ws.send(_request(ids, symbols, features))
    await asyncio.sleep(0.1)
    ws.transport.abort()


def test_a_resend_that_crosses_its_answer_on_the_new_connection_is_not_answered_twice(model):
    """A step in flight across a reconnect answers on the new connection; the server's resend of that request,
    formed before the answer reached it, crosses the answer on the wire: it is not answered again from the cache
    (the server counted the second answer a duplicate). A later resend on that connection still is."""
    symbols, features = _stream(2, seed=6)
    recorder = Recorder()
    connections = []

    async def handler(ws):
        connections.append(ws)
        assert protocol.decode(await ws.recv())["type"] == "register"
        if len(connections) == 1:
            return await _drop_after_sending(ws, [0], symbols, features)
        await recorder.pump(ws, lambda: 0 in recorder.answered())  # the step ended: answered here
        await ws.send(_request([0, 1], symbols, features))  # the backlog, formed before that answer came
        await recorder.pump(ws, lambda: 1 in recorder.answered())
        await ws.send(_request([1], symbols, features))  # a resend after its answer came: answered
        await recorder.pump(ws, lambda: len(recorder.responses) >= 3)
        await ws.close(1000)

    team_client = SlowOnRequestZero(ReferenceEngine(model))
    _, summary = asyncio.run(_play(handler, team_client))
    assert [uid for uid, _ in recorder.responses] == [0, 1, 1]
    assert sum(team_client.stepped.values()) == 2 and summary["resent_from_cache"] == 1


def test_a_resend_that_crosses_an_answer_gone_from_the_cache_does_not_end_the_session(model):
    """The answers a reconnect's first steps send can push one that crossed its resend out of the cache before
    that resend arrives: it was taken for an id answered long ago, the mark of a new stream, and the session
    ended (new_stream) though the server had its answer."""
    symbols, features = _stream(3, seed=7)
    recorder = Recorder()
    connections = []

    async def handler(ws):
        connections.append(ws)
        assert protocol.decode(await ws.recv())["type"] == "register"
        if len(connections) == 1:
            return await _drop_after_sending(ws, [0, 1], symbols, features)
        await recorder.pump(ws, lambda: {0, 1} <= set(recorder.answered()))  # answered here; 0 left the cache
        await ws.send(_request([0, 1], symbols, features))  # the backlog, formed before those answers came
        await ws.send(_request([2], symbols, features))
        await recorder.pump(ws, lambda: 2 in recorder.answered())
        await ws.close(1000)

    team_client = SlowOnRequestZero(ReferenceEngine(model))
    client, summary = asyncio.run(_play(handler, team_client, cache_size=1))
    assert client.outcome != "new_stream"
    assert sorted(uid for uid, _ in recorder.responses) == [0, 1, 2]


def test_failing_process_batch_sends_an_error_and_keeps_going(model):
    symbols, features = _stream(6)
    recorder = Recorder()

    async def handler(ws):
        await ws.recv()
        await ws.send(_request([0, 1, 2], symbols, features))
        await recorder.pump(ws, lambda: recorder.answered() >= {0, 2} and recorder.errors)
        await ws.send(_request([3, 4, 5], symbols, features))
        await recorder.pump(ws, lambda: recorder.answered() >= {0, 2, 3, 4, 5})
        await ws.close(1000)

    asyncio.run(_play(handler, CountingClient(ReferenceEngine(model), fail_on_id=1), max_batch=1))
    assert 1 not in recorder.answered()
    assert "unique_ids [1] not answered" in recorder.errors[0] and "team client bug" in recorder.errors[0]


def test_requests_answered_with_an_error_are_not_kept_waiting_for_a_score(model):
    """Every request received waits in the stats for its score, which a server gives only to an answer: each one the
    client refused (NaN features, a malformed frame) or whose step failed (a lost shard's, for the rest of the
    stream) waited for good, one entry a request for the session. Those go once they are answered with an error; a
    server's score for one is not counted."""
    symbols, features = _stream(9)
    features[2, 0] = np.nan
    recorder = Recorder()

    async def handler(ws):
        await ws.recv()
        await ws.send(_request([0, 1, 2, 3, 4], symbols, features))
        malformed = protocol.inference_request([5, 6], [symbols[5], symbols[6]], features[[5, 6]], 0.0)
        malformed["symbols"] = malformed["symbols"][:1]
        await ws.send(protocol.encode(malformed))
        await ws.send(_request([7, 8], symbols, features))
        await recorder.pump(ws, lambda: len(recorder.answered()) == 5 and len(recorder.errors) >= 3)
        everything = list(range(9))
        await ws.send(protocol.encode(protocol.score_update(everything, [0.0] * 9, [4] * 9, [1.0] * 9)))
        await ws.close(1000)

    client, summary = asyncio.run(_play(handler, CountingClient(ReferenceEngine(model), fail_on_id=4), max_batch=1,
                                           max_requests_per_symbol=1))
    assert recorder.answered() == {0, 1, 3, 7, 8}
    assert summary["requests"] == 9 and summary["errors"] == 4 and summary["responses"] == 5
    assert not client.stats._unscored


def test_a_step_that_fails_the_same_way_again_logs_its_traceback_once(model, caplog):
    """A team's code that raised at every step printed its traceback at every step: the first time in full, then
    one line naming the failure; each request is answered with its error all the same."""
    symbols, features = _stream(6)
    recorder = Recorder()

    class AlwaysFailing(ExampleModel):
        def process_batch(self, requests_by_symbol):
            raise RuntimeError("team client bug")

    handler = _each_after_the_last_error(recorder, symbols, features, 6)

    with caplog.at_level(logging.ERROR, logger="client.runtime"):
        asyncio.run(_play(handler, AlwaysFailing(ReferenceEngine(model)), max_batch=1))
    failures = [r for r in caplog.records if "failed for unique_ids" in r.getMessage()]
    assert len(recorder.errors) == 6 and all("team client bug" in error for error in recorder.errors)
    assert len(failures) == 6 and [r.exc_info is not None for r in failures] == [True] + [False] * 5
    assert all("RuntimeError: team client bug (its traceback logged before)" in r.getMessage() for r in failures[1:])


def _each_after_the_last_error(recorder, symbols, features, n):
    """A server that sends n requests one at a time, each once the one before was answered with an error."""
    async def handler(ws):
        await ws.recv()
        for uid in range(n):
            await ws.send(_request([uid], symbols, features))
            await recorder.pump(ws, lambda: len(recorder.errors) > uid)
        await ws.close(1000)
    return handler


def test_requests_not_answered_for_one_reason_log_it_once(model, caplog):
    """Every request of a lost shard's symbols fails for one reason to the end of the stream: that reason is
    logged once, where it was a line a request; each request is still answered with its error, and counted."""
    symbols, features = _stream(6)
    recorder = Recorder()

    class Lost(ExampleModel):
        def process_batch(self, requests_by_symbol):
            return {"unique_ids": [], "predictions": np.zeros((0, 4), np.float32),
                    "errors": {uid: "ShardLost: shard 0 lost" if symbol != "SYM_000" else "no room"
                               for symbol, queued in requests_by_symbol.items() for uid, _ in queued}}

    handler = _each_after_the_last_error(recorder, symbols, features, 6)

    with caplog.at_level(logging.WARNING, logger="client.runtime"):
        _, summary = asyncio.run(_play(handler, Lost(ReferenceEngine(model)), max_batch=1))
    logged = [r.getMessage() for r in caplog.records if "not answered" in r.getMessage()]
    assert len(recorder.errors) == 6 and summary["errors"] == 6
    assert [line.split(" (later")[0] for line in logged] == ["unique_id 0 not answered: no room",
                                                             "unique_id 1 not answered: ShardLost: shard 0 lost"]


def test_requests_refused_on_arrival_for_one_reason_log_it_once(model, caplog):
    """A feed's NaN rows, and a reconnect's resend of every request refused before (the server resends what it
    missed), were a warning a request: each reason is logged once, every request still answered with its error."""
    symbols, features = _stream(8)
    features[:6, 0] = np.nan
    recorder = Recorder()

    async def handler(ws):
        await ws.recv()
        await ws.send(_request(list(range(8)), symbols, features))
        await ws.send(_request(list(range(6)), symbols, features))  # resent: refused earlier
        await recorder.pump(ws, lambda: recorder.answered() == {6, 7} and len(recorder.errors) >= 12)
        await ws.close(1000)

    with caplog.at_level(logging.WARNING, logger="client.runtime"):
        _, summary = asyncio.run(_play(handler, CountingClient(ReferenceEngine(model))))
    logged = [r.getMessage() for r in caplog.records if "not fed to the model" in r.getMessage()]
    assert len(recorder.errors) == 12 and summary["errors"] == 6 and summary["requests"] == 8
    assert [line.split(";")[0] for line in logged] == ["request 0 (SYM_000): features contain NaN or inf",
                                                       "request 0 (SYM_000): rejected earlier"]


def test_objects_alive_at_start_are_frozen_out_of_the_collector_during_play(model):
    symbols, features = _stream(3)
    recorder = Recorder()
    frozen_during_steps = []

    class Observing(CountingClient):
        def process_batch(self, requests_by_symbol):
            frozen_during_steps.append(gc.get_freeze_count())
            return super().process_batch(requests_by_symbol)

    async def handler(ws):
        await ws.recv()
        await ws.send(_request([0, 1, 2], symbols, features))
        await recorder.pump(ws, lambda: len(recorder.answered()) == 3)
        await ws.close(1000)

    team_client = Observing(ReferenceEngine(model))
    assert gc.get_freeze_count() == 0
    client, _ = asyncio.run(_play(handler, team_client))
    assert client.timeline is None  # recorded only when asked for
    assert frozen_during_steps and min(frozen_during_steps) > 0  # the model's tensors among them
    assert gc.get_freeze_count() == 0  # and given back to the collector when play ends


def test_timeline_of_a_process_batch_client_has_its_stages_in_order(model):
    symbols, features = _stream(6)
    recorder = Recorder()

    async def handler(ws):
        await ws.recv()
        await ws.send(_request([0, 1, 2, 3, 4, 5], symbols, features))
        await recorder.pump(ws, lambda: len(recorder.answered()) == 6)
        await ws.close(1000)

    class OnlyProcessBatch:  # no submit_batch: the runtime's single worker steps it
        def __init__(self):
            self.example = ExampleModel(ReferenceEngine(model))

        def process_batch(self, requests_by_symbol):
            return self.example.process_batch(requests_by_symbol)

    client, _ = asyncio.run(_play(handler, OnlyProcessBatch(), timeline=True))
    assert set(client.timeline) == set(range(6))
    for stages in client.timeline.values():
        assert set(stages) == {"received", "batched", "done", "answered"}  # no separate submit
        assert stages["received"] <= stages["batched"] <= stages["done"] <= stages["answered"]


def _welcome(requests, fingerprint="f00d", weights_match=True):
    return protocol.encode(protocol.welcome("tiny", fingerprint, requests, len(SYMBOLS), weights_match))


@pytest.mark.parametrize("leave_at_end", [True, False])
def test_end_of_the_stream_completes_the_session(model, leave_at_end):
    symbols, features = _stream(6)
    recorder = Recorder()
    registers, welcomes = [], []

    async def handler(ws):
        registers.append(protocol.decode(await ws.recv()))
        await ws.send(_welcome(6))
        await ws.send(_request(list(range(6)), symbols, features))
        await recorder.pump(ws, lambda: len(recorder.answered()) == 6)
        await ws.send(protocol.encode(protocol.score_update(range(6), [1.0] * 6, [4] * 6, [5.0] * 6)))
        await ws.send(protocol.encode(protocol.end(6)))
        if leave_at_end:
            await ws.wait_closed()  # the client leaves by itself
        else:
            await ws.close(1000)

    client, summary = asyncio.run(_play(handler, CountingClient(ReferenceEngine(model)), preset="tiny",
                                        weights_fingerprint="f00d", leave_at_end=leave_at_end,
                                        on_welcome=welcomes.append))
    assert registers[0]["preset"] == "tiny" and registers[0]["weights_fingerprint"] == "f00d"
    assert "allow_weights_mismatch" not in registers[0]
    assert [w["requests"] for w in welcomes] == [6]
    assert summary["outcome"] == runtime.COMPLETE and "6 of 6 requests" in summary["detail"]
    assert summary["total_requests"] == 6 and summary["weights_match"] is True
    assert client.progress_line().startswith("requests 6/6  responses 6  accuracy 1.000")
    assert summary["server_weights_fingerprint"] == "f00d" and summary["accuracy"] == 1.0


def test_answers_are_in_time_by_the_timeout_the_servers_welcome_says(model):
    """A server with another timeout than the client's 2 s (python -m server --timeout-s 5): the client judged its
    answers in time by its own, so that one the server scored in time after 3 s was missed in the client's summary."""
    symbols, features = _stream(3)
    recorder = Recorder()

    async def handler(ws):
        await ws.recv()
        await ws.send(protocol.encode(protocol.welcome("tiny", None, 3, len(SYMBOLS), None, timeout_s=5.0)))
        await ws.send(_request([0, 1, 2], symbols, features))
        await recorder.pump(ws, lambda: len(recorder.answered()) == 3)
        await ws.send(protocol.encode(protocol.score_update([0, 1, 2], [0.1, 0.1, 0.0], [4, 4, 4],
                                                            [3000.0, 4000.0, 6000.0])))
        await ws.send(protocol.encode(protocol.end(3)))
        await ws.wait_closed()

    _, summary = asyncio.run(_play(handler, CountingClient(ReferenceEngine(model)), leave_at_end=True))
    assert summary["responses"] == 2 and summary["missed"] == 1  # 6 s is past the server's 5
    assert summary["latency_ms"]["max"] == 4000.0 and summary["accuracy"] == 1.0


@pytest.mark.parametrize("error, outcome, detail", [
    (protocol.error("bad_token", "register token missing or wrong"), runtime.REFUSED,
     "the server refused this client (bad_token: register token missing or wrong)"),
    (protocol.error("weights_mismatch", "the server plays preset tiny with weights aaaa, the client has preset "
                                        "tiny with weights bbbb"), runtime.WEIGHTS_MISMATCH,
     "the server plays preset tiny with weights aaaa, the client has preset tiny with weights bbbb"),
    (None, runtime.REFUSED, "the server refused this client (bad protocol version)"),
])
def test_a_refusal_ends_the_session_with_what_the_server_said(model, error, outcome, detail):
    async def handler(ws):
        await ws.recv()
        if error is not None:
            await ws.send(protocol.encode(error))
        await ws.close(1008, error["error"] if error else "bad protocol version")

    client, summary = asyncio.run(_play(handler, CountingClient(ReferenceEngine(model))))
    assert summary["outcome"] == outcome and summary["detail"] == detail
    assert summary["connections"] == 1  # not retried


def test_a_reconnect_refused_after_an_earlier_welcome_is_a_refusal(model):
    connections = []

    async def handler(ws):
        connections.append(ws)
        await ws.recv()
        if len(connections) == 1:
            await ws.send(_welcome(10))
            ws.transport.abort()  # dropped: the client reconnects
            return
        await ws.send(protocol.encode(protocol.error("bad_token", "register token missing or wrong")))
        await ws.close(1008, "bad_token")

    _, summary = asyncio.run(_play(handler, CountingClient(ReferenceEngine(model))))
    assert summary["outcome"] == runtime.REFUSED and "bad_token: register token missing" in summary["detail"]
    assert summary["connections"] == 2


def test_server_stopping_before_the_end_cuts_the_session_short(model):
    symbols, features = _stream(3)
    recorder = Recorder()

    async def handler(ws):
        await ws.recv()
        await ws.send(_welcome(10))
        await ws.send(_request([0, 1, 2], symbols, features))
        await recorder.pump(ws, lambda: len(recorder.answered()) == 3)
        await ws.send(protocol.encode(protocol.score_update([0, 1, 2], [1.0] * 3, [4] * 3, [5.0] * 3)))
        await ws.close(1000, "server stopped")

    _, summary = asyncio.run(_play(handler, CountingClient(ReferenceEngine(model))))
    assert summary["outcome"] == runtime.CUT_SHORT
    assert "(1000 server stopped)" in summary["detail"] and "after 3 of 10 requests" in summary["detail"]


def _play_until_the_server_dies(handler, team_client, dies, give_up_after_s=0.5):
    """The client's summary of a session with `handler`'s server, whose process dies once the asyncio.Event `dies`
    is set: the connection drops and nobody listens any more."""
    async def main():
        server = await serve(handler, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = StreamingClient(team_client, f"ws://127.0.0.1:{port}", "testers", backoff_s=0.02,
                                 give_up_after_s=give_up_after_s)
        playing = asyncio.create_task(client.run())
        await dies.wait()
        server.close()
        return await asyncio.wait_for(playing, 30)

    return asyncio.run(main())


def test_server_gone_mid_stream_cuts_the_session_short_after_the_backoff(model):
    registered = asyncio.Event()

    async def handler(ws):
        await ws.recv()
        await ws.send(_welcome(10))
        registered.set()
        await asyncio.sleep(30)

    summary = _play_until_the_server_dies(handler, CountingClient(ReferenceEngine(model)), registered)
    assert summary["outcome"] == runtime.CUT_SHORT and "stayed unreachable" in summary["detail"]
    assert summary["connections"] == 1


def test_server_gone_as_its_end_was_due_after_every_request_answered_completes_the_stream(model):
    """A server of one stream (`--once`) that went away just as it would send its end, the last answers sent: every
    request the welcome counted was received and answered, so the stream was played to its end (it had said cut
    short, exit 6)."""
    symbols, features = _stream(3)
    recorder = Recorder()
    answered = asyncio.Event()

    async def handler(ws):
        await ws.recv()
        await ws.send(_welcome(3))
        await ws.send(_request([0, 1, 2], symbols, features))
        await recorder.pump(ws, lambda: len(recorder.answered()) == 3)
        answered.set()  # no end
        await asyncio.sleep(30)

    summary = _play_until_the_server_dies(handler, CountingClient(ReferenceEngine(model)), answered)
    assert summary["outcome"] == runtime.COMPLETE and "every one of the stream's 3 requests" in summary["detail"]
    assert cli.EXIT_BY_OUTCOME[summary["outcome"]] == cli.EXIT_OK


def test_server_gone_before_the_last_answers_went_out_cuts_the_session_short(model):
    """Every request the welcome counted received and stepped, but the server went away while their step ran: the
    answers went out on no connection (they wait in the cache for a resend that never comes), so the stream was not
    played to its end (it said complete, exit 0)."""
    symbols, features = _stream(3)
    sent = asyncio.Event()

    async def handler(ws):
        await ws.recv()
        await ws.send(_welcome(3))
        await ws.send(_request([0, 1, 2], symbols, features))
        await asyncio.sleep(0.1)
        sent.set()  # mid-step
        await asyncio.sleep(30)

    summary = _play_until_the_server_dies(handler, SlowOnRequestZero(ReferenceEngine(model)), sent,
                                          give_up_after_s=0.8)
    assert summary["outcome"] == runtime.CUT_SHORT and "stayed unreachable" in summary["detail"], summary["detail"]


def test_unreachable_server_fails_fast():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nobody listens there
    client = StreamingClient(None, f"ws://127.0.0.1:{port}", "testers", connect_timeout_s=0.5)
    started = time.monotonic()
    summary = asyncio.run(asyncio.wait_for(client.run(), 30))
    assert time.monotonic() - started < 5
    assert summary["outcome"] == runtime.UNREACHABLE and summary["connections"] == 0
    assert summary["detail"].startswith(f"cannot reach ws://127.0.0.1:{port} within 0.")


def test_stop_before_the_end_is_an_interruption(model):
    async def handler(ws):
        await ws.recv()
        await ws.send(_welcome(10))
        await ws.wait_closed()

    async def main():
        async with serve(handler, "127.0.0.1", 0) as server:
            port = server.sockets[0].getsockname()[1]
            client = StreamingClient(CountingClient(ReferenceEngine(model)), f"ws://127.0.0.1:{port}", "testers",
                                     on_welcome=lambda welcome: client.stop())
            return await asyncio.wait_for(client.run(), 30)

    summary = asyncio.run(main())
    assert summary["outcome"] == runtime.INTERRUPTED and "0 of 10 requests" in summary["detail"]


@pytest.mark.parametrize("options, match", [
    ({"max_batch": 0}, "max_batch"),
    ({"cache_size": 0}, "cache_size"),
    ({"heartbeat_s": 0}, "heartbeat_s"),
    ({"backoff_s": 1.0, "backoff_max_s": 0.5}, "backoff_s"),
    ({"late_after_s": -0.001}, "late_after_s"),
    ({"form_margin_s": float("nan")}, "form_margin_s"),
    ({"punctual_late_after_s": -1.0}, "punctual_late_after_s"),
    ({"late_after_s": 0.002, "punctual_late_after_s": 0.004}, "punctual_late_after_s <= late_after_s"),
])
def test_bad_client_options(options, match):
    with pytest.raises(ValueError, match=match):
        StreamingClient(None, "ws://127.0.0.1:1", "testers", **options)


def test_bad_url():
    with pytest.raises(ValueError, match="bad server url"):
        asyncio.run(StreamingClient(None, "http://nowhere", "testers").run())


def test_stats_from_score_updates():
    stats = ClientStats(timeout_s=1.0)
    for uid in range(1, 6):
        stats.note_request(uid)
    stats.add_scores(protocol.score_update([1, 2, 3], [0.5, 1.0, 0.0], [2, 4, 0], [10.0, 30.0, 20.0]))
    stats.add_scores(protocol.score_update([3], [0.0], [0], [20.0]))  # a repeat is counted once
    stats.add_scores(protocol.score_update([4], [0.0], [4], [1500.0]))  # late: scored, but missed
    summary = stats.summary()
    assert summary["requests"] == 5 and summary["responses"] == 3 and summary["missed"] == 2
    assert summary["accuracy"] == pytest.approx(6 / 12)
    assert summary["pnl"] == pytest.approx(1.5)
    assert summary["latency_ms"]["p50"] == pytest.approx(20.0, rel=5e-4) and summary["latency_ms"]["max"] == 30.0
    assert "requests 5  responses 3" in stats.progress_line() and "requests 5/9  " in stats.progress_line(9)
    with pytest.raises(protocol.ProtocolError, match="lengths differ"):
        stats.add_scores({"type": "score_update", "unique_ids": [1], "pnls": [], "correct": [1],
                          "latencies_ms": [1.0]})
    assert math.isfinite(summary["latency_ms"]["mean"])


def test_stats_percentiles_over_every_latency_in_time_within_0_05_percent_in_constant_memory():
    """The latencies are counted in a histogram (a buffer of each grew 8 B a request and its percentiles took 0.3 s
    at 14M): every one in time is counted, the late ones are not, the percentiles are numpy's within 0.05% however
    many, the mean and the max exact, and its memory does not grow."""
    stats = ClientStats(timeout_s=1.0)
    latencies = np.random.default_rng(3).uniform(1.0, 1200.0, 5000)
    for uid in range(len(latencies)):
        stats.note_request(uid)
    size = stats._latencies._counts.nbytes
    for begin in range(0, len(latencies), 700):
        ids = range(begin, min(begin + 700, len(latencies)))
        stats.add_scores(protocol.score_update(ids, [0.0] * len(ids), [4] * len(ids), latencies[ids.start:ids.stop]))
    in_time = latencies[latencies <= 1000.0]
    summary = stats.summary()
    assert summary["responses"] == len(in_time) and summary["missed"] == len(latencies) - len(in_time)
    assert [summary["latency_ms"][f"p{q}"] for q in (50, 90, 99)] == pytest.approx(
        np.percentile(in_time, [50, 90, 99]), rel=5e-4)
    assert summary["latency_ms"]["max"] == in_time.max()
    assert summary["latency_ms"]["mean"] == pytest.approx(in_time.mean(), rel=1e-12)
    assert stats._latencies._counts.nbytes == size


@pytest.mark.parametrize("latencies", [[7.0], [1.0, 100.0], [0.0, 0.0004, 3.0], [2.0] * 9 + [900.0], [5e7]])
def test_latency_percentiles_of_a_few_interpolate_between_ranks_as_numpy(latencies):
    """With a few latencies the percentiles fall between far ranks (0 and 1 us, a latency past the bins' range
    included): each rank's value within 0.05%, interpolated as numpy's; the smallest and the largest exact."""
    from client.runtime import LatencyHistogram

    histogram = LatencyHistogram()
    histogram.add(latencies)
    qs = [0, 1, 50, 90, 99, 100]
    got, expected = histogram.percentiles(qs), np.percentile(latencies, qs)
    assert got == pytest.approx(expected, rel=5e-4, abs=1e-3)
    assert got[0] == min(latencies) and got[-1] == max(latencies)
    assert LatencyHistogram().percentiles(qs) is None


def test_latency_percentiles_read_while_latencies_are_added_are_never_outside_those_seen(monkeypatch):
    """The progress thread reads the percentiles while the event loop adds: a read between the counts and the
    extremes (the first add's: min inf, max -inf) said -inf or nan; it may miss the latest, never make one up."""
    from types import SimpleNamespace

    from client.runtime import LatencyHistogram

    histogram, read = LatencyHistogram(), []

    def add_at(counts, bins, one):  # the reader's thread runs just after the counts grew
        np.add.at(counts, bins, one)
        read.append(histogram.percentiles([0, 50, 100]))

    monkeypatch.setattr(runtime, "np", SimpleNamespace(**{name: getattr(np, name) for name in dir(np)
                                                          if not name.startswith("__")}))
    monkeypatch.setattr(runtime.np, "add", SimpleNamespace(at=add_at))
    histogram.add([3.0, 5.0])
    histogram.add([1.0, 9.0])
    assert all(1.0 <= value <= 9.0 for values in read for value in values), read


def test_requests_a_client_cannot_place_get_an_error_and_the_rest_are_answered():
    """A symbol the engine has no room for: its request alone gets an error, the batch's others are answered."""
    from client.answers import check_answer

    ids, predictions, errors, restarted = check_answer(
        {"unique_ids": [1], "predictions": np.zeros((1, 4)), "errors": {2: "no room for the state of 1 symbol(s) (B)"}},
        [1, 2])
    assert ids == [1] and predictions.shape == (1, 4) and errors == {2: "no room for the state of 1 symbol(s) (B)"}
    assert restarted == []
    with pytest.raises(ValueError, match=r"missing ids \[2\]"):
        check_answer({"unique_ids": [1], "predictions": np.zeros((1, 4))}, [1, 2])


def test_a_finite_prediction_past_float32s_range_is_held_at_its_largest_not_refused_as_not_finite():
    """A team client's float64 prediction past float32's range, cast, became inf (with numpy's overflow warning), and
    the runtime refused its request as not finite, the request's right towers with it; held at float32's largest, it
    is a wrong tower alone (as the protocol holds such a value for the server). NaN and inf stay as they are."""
    from client.answers import check_answer

    big = np.finfo(np.float32).max
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow warning either
        answer = check_answer({"unique_ids": [1, 2], "predictions": np.array([[1e39, 0.5, -1e300, 0.25],
                                                                              [np.nan, np.inf, -np.inf, 1.0]])},
                              [1, 2])
    assert answer.predictions.dtype == np.float32
    np.testing.assert_array_equal(answer.predictions, np.array([[big, 0.5, -big, 0.25],
                                                                [np.nan, np.inf, -np.inf, 1.0]], np.float32))
    assert check_answer({"unique_ids": [1], "predictions": [[1, 2, 3, 4]]}, [1]).predictions.dtype == np.float32
    with pytest.raises(ValueError, match="process_batch must return"):
        check_answer({"unique_ids": [1], "predictions": [[10**400, 0, 0, 0]]}, [1])


@pytest.mark.parametrize("answer, match", [
    ({"unique_ids": [1, 3], "predictions": np.zeros((2, 4))}, r"unexpected ids \[3\]"),
    ({"unique_ids": [1], "predictions": np.zeros((1, 4)), "errors": {1: "lost"}}, r"repeated ids \[1\]"),
    ({"unique_ids": [1], "predictions": np.zeros((2, 4))}, r"shape \(2, 4\) for 1 ids"),
    ({"unique_ids": [1], "predictions": np.zeros((1, 4)), "restarted": [2]}, r"'restarted' must name .*\[2\]")])
def test_a_partial_answer_may_leave_requests_out_but_names_none_outside_its_batch_or_twice(answer, match):
    """A step answered in parts, some late (a hung shard), is answered for the parts that came: its answer may leave
    the batch's other requests out, and is checked for everything else as a whole answer is."""
    from client.answers import check_answer

    assert check_answer({"unique_ids": [2], "predictions": np.ones((1, 4))}, [1, 2], partial=True).unique_ids == [2]
    assert check_answer({"unique_ids": [], "predictions": np.zeros((0, 4))}, [1, 2], partial=True).unique_ids == []
    with pytest.raises(ValueError, match=match):
        check_answer(answer, [1, 2], partial=True)


def test_a_notice_is_in_the_summary_and_on_the_servers_leaderboard(model):
    from client.streams import generate_stream
    from server import ScoringServer, ServerConfig
    from server.leaderboard import format_table, render_page

    line = "shard 1 (process on cpu) lost: its process exited (exit code -9); its 1 symbol(s) SYM_001 start again"

    class Noticing(ExampleModel):  # says what a sharded engine's loss listener says, on its first batch
        client = None

        def process_batch(self, requests_by_symbol):
            if not self.client.notices:
                self.client.notice("state_reset", line)
            return super().process_batch(requests_by_symbol)

    async def main():
        stream = generate_stream(3, 30, seed=3)
        server = ScoringServer(ServerConfig(rate=1000.0), stream=stream,
                               targets=np.zeros((30, 4), np.float32))
        port = await server.start()
        try:
            team_client = Noticing(ReferenceEngine(model))
            team_client.client = StreamingClient(team_client, f"ws://127.0.0.1:{port}", "testers", leave_at_end=True)
            summary = await asyncio.wait_for(team_client.client.run(), 60)
            return summary, server.summaries(), server.scores()
        finally:
            await server.stop()

    summary, (server_summary,), scores = asyncio.run(main())
    assert summary["notices"] == [{"code": "state_reset", "text": line}]
    assert server_summary["notices"] == [{"code": "state_reset", "text": line}] and server_summary["notices_total"] == 1
    assert f"states reset: {line}" in render_page(scores)
    assert format_table([server_summary]).splitlines()[-1] == f"testers: states reset: {line}"


# ------------------------------------------------------------------ hostile servers (issue 21)

def test_a_refusal_is_said_at_once_even_when_the_server_keeps_the_connection_open(model):
    async def handler(ws):
        await ws.recv()
        await ws.send(protocol.encode(protocol.error("bad_team", "a team name is 1..64 printable characters")))
        await ws.wait_closed()  # an older server: it waits for another register (then times out)

    started = time.monotonic()
    _, summary = asyncio.run(_play(handler, CountingClient(ReferenceEngine(model))))
    assert time.monotonic() - started < 5
    assert summary["outcome"] == runtime.REFUSED and summary["connections"] == 1
    assert summary["detail"] == "the server refused this client (bad_team: a team name is 1..64 printable characters)"


def test_a_reconnect_presents_the_session_key_of_the_welcome(model):
    registers = []

    async def handler(ws):
        registers.append(protocol.decode(await ws.recv()))
        await ws.send(protocol.encode(protocol.welcome("tiny", "f00d", 10, 3, True, session_key="k3y")))
        if len(registers) == 1:
            ws.transport.abort()  # dropped: the client reconnects
            return
        await ws.send(protocol.encode(protocol.end(10)))
        await ws.wait_closed()

    _, summary = asyncio.run(_play(handler, CountingClient(ReferenceEngine(model)), leave_at_end=True))
    assert "session_key" not in registers[0] and registers[1]["session_key"] == "k3y"
    assert summary["outcome"] == runtime.COMPLETE


@pytest.mark.parametrize("server_key", ["k3y", "another"])
def test_a_replayed_journal_answers_its_resends_in_its_session_and_ends_in_another(model, tmp_path, server_key):
    """A client restarted with a journal (client/journal.py): it registers with the journal's session key; in that
    session the server's resend of an id it replayed is answered with the replay's prediction (not stepped twice),
    and a new id is stepped from the replayed states and journaled after them; in another session (the welcome's key
    not the journal's) the replayed states are that session's no more: it ends as a new stream, answering nothing."""
    from client.journal import Journal, Replayed

    symbols, features = _stream(3)
    journal = Journal(tmp_path / "j", {})
    journal.begin("k3y")
    journal.append([(0, symbols[0], features[0]), (1, symbols[1], features[1])])
    journal.close()
    journal = Journal(tmp_path / "j", {})
    predictions = {0: np.full(4, 7.0, np.float32), 1: np.full(4, 8.0, np.float32)}
    replayed = Replayed(count=2)
    for uid in (0, 1):
        replayed.recent[uid] = predictions[uid], symbols[uid], features[uid]
    recorder, registers = Recorder(), []

    async def handler(ws):
        registers.append(protocol.decode(await ws.recv()))
        await ws.send(protocol.encode(protocol.welcome("tiny", None, 3, 3, None, session_key=server_key)))
        try:
            await ws.send(_request([1, 2], symbols, features))
            await recorder.pump(ws, lambda: len(recorder.answered()) == 2)
            await ws.send(protocol.encode(protocol.end(3)))
        except Exception:  # the client left
            pass
        await ws.wait_closed()

    team = CountingClient(ReferenceEngine(model))
    _, summary = asyncio.run(_play(handler, team, leave_at_end=True, session_key=journal.session_key,
                                   journal=journal, replayed=replayed))
    assert registers[0]["session_key"] == "k3y"
    if server_key != "k3y":
        assert summary["outcome"] == runtime.NEW_STREAM and "is not the journal's" in summary["detail"]
        assert recorder.answered() == set() and team.stepped == {}
        return
    assert summary["outcome"] == runtime.COMPLETE and recorder.answered() == {1, 2}
    answers = dict(recorder.responses)
    assert np.array_equal(answers[1], predictions[1]) and team.stepped == {symbols[2]: 1}  # 1 from the replay
    assert [uid for chunk in Journal(tmp_path / "j", {}).records() for uid, *_ in chunk] == [0, 1, 2]


def test_a_replayed_journals_refusals_are_refused_again_never_stepped(model):
    """The requests a restarted client's journal holds as refused (client/journal.py), those it tells apart by id
    and those refused long before them alike: their resends are refused again ('rejected earlier'), never stepped,
    and a new request of their symbols steps."""
    from client.journal import Replayed

    symbols, features = _stream(4)
    replayed = Replayed(count=2)
    replayed.refused[1] = None
    replayed.refused_long_ago.add(0)
    replayed.older.add(0)
    recorder = Recorder()

    async def handler(ws):
        await ws.recv()
        await ws.send(protocol.encode(protocol.welcome("tiny", None, 4, 3, None, session_key="k3y")))
        await ws.send(_request([0, 1, 3], symbols, features))
        await recorder.pump(ws, lambda: recorder.answered() == {3} and len(recorder.errors) == 2)
        await ws.send(protocol.encode(protocol.end(4)))
        await ws.wait_closed()

    team = CountingClient(ReferenceEngine(model))
    _, summary = asyncio.run(_play(handler, team, leave_at_end=True, session_key="k3y", replayed=replayed))
    assert summary["outcome"] == runtime.COMPLETE and team.stepped == {symbols[3]: 1}
    assert all("rejected earlier" in error for error in recorder.errors)


@pytest.mark.parametrize("kind", ["malformed", "non-finite", "answered"])
def test_a_unique_id_beyond_int64_stops_journaling_and_the_session_plays_on(model, tmp_path, kind):
    """A request whose unique_id no journal record holds (2**64 - 1): its refusal's journaling raised struct.error
    out of the client's run() (malformed, non-finite), its answer's out of the step (answered: the session gave up).
    Journaling stops (client/journal.py) and every request is answered or refused."""
    from client.journal import Journal

    symbols, features = _stream(2)
    big, row = 2**64 - 1, features[:1].copy()
    row[0, 0] = np.nan if kind == "non-finite" else row[0, 0]
    journal, recorder = Journal(tmp_path / "j", {}), Recorder()

    async def handler(ws):
        await ws.recv()
        await ws.send(protocol.encode(protocol.welcome("tiny", None, 3, len(SYMBOLS), None, session_key="k")))
        request = protocol.inference_request([big], symbols[:1], row, 0.0)
        await ws.send(protocol.encode({**request, "features": "none"} if kind == "malformed" else request))
        await ws.send(_request([0, 1], symbols, features))
        await recorder.pump(ws, lambda: recorder.answered() == ({0, 1, big} if kind == "answered" else {0, 1})
                            and len(recorder.errors) == (kind != "answered"))
        await ws.send(protocol.encode(protocol.end(3)))
        await ws.wait_closed()

    _, summary = asyncio.run(_play(handler, CountingClient(ReferenceEngine(model)), leave_at_end=True,
                                   journal=journal))
    assert summary["outcome"] == runtime.COMPLETE and journal.failed


@pytest.mark.parametrize("inline_steps", [False, True])
def test_a_journal_write_that_fails_mid_session_stops_journaling_and_every_request_is_answered(model, tmp_path,
                                                                                               inline_steps):
    """A full disk under the journal: the step whose write failed and every later one are answered (before, the
    error escaped the step's answer: those answers never went out, and the session hung), and the journal is set
    aside as PATH.incomplete (client/journal.py)."""
    from client.journal import Journal

    n = 12
    symbols, features = _stream(n)
    journal = Journal(tmp_path / "j", {})
    writes = []

    def failing_after_one(data):
        writes.append(len(data))
        if len(writes) > 1:
            raise OSError(28, "No space left on device")
        return len(data)

    recorder = Recorder()

    async def handler(ws):
        await ws.recv()
        await ws.send(protocol.encode(protocol.welcome("tiny", None, n, len(SYMBOLS), None, session_key="k")))
        journal._file.write = failing_after_one  # once the welcome has opened it
        for start in range(0, n, 3):
            await ws.send(_request(list(range(start, start + 3)), symbols, features))
            await recorder.pump(ws, lambda: len(recorder.answered()) >= start + 3)
        await ws.send(protocol.encode(protocol.end(n)))
        await ws.wait_closed()

    class Pipelined(ExampleModel):
        steps_in_background = inline_steps

    _, summary = asyncio.run(_play(handler, Pipelined(ReferenceEngine(model)), leave_at_end=True, journal=journal,
                                   inline_steps=inline_steps))
    assert summary["outcome"] == runtime.COMPLETE and recorder.answered() == set(range(n))
    assert len(writes) == 2 and journal.failed and (tmp_path / "j.incomplete").exists()


def test_a_limit_that_passes_is_tried_again_and_the_session_plays_on(model):
    symbols, features = _stream(3)
    recorder, connections = Recorder(), []

    async def handler(ws):
        connections.append(protocol.decode(await ws.recv()))
        if len(connections) <= 2:
            await ws.send(protocol.encode(protocol.error("rate_limited", "too many registrations; try again")))
            await ws.close(protocol.CLOSE_TRY_AGAIN_LATER, "rate_limited")
            return
        await ws.send(_welcome(3))
        await ws.send(_request([0, 1, 2], symbols, features))
        await recorder.pump(ws, lambda: len(recorder.answered()) == 3)
        await ws.send(protocol.encode(protocol.end(3)))
        await ws.wait_closed()

    _, summary = asyncio.run(_play(handler, CountingClient(ReferenceEngine(model)), leave_at_end=True))
    assert summary["outcome"] == runtime.COMPLETE and len(connections) == 3 and recorder.answered() == {0, 1, 2}


@pytest.mark.parametrize("break_it, said", [
    ("huge_frame", "it sent a frame over this client's limit of 4 MiB (1009: frame with 524288000 bytes exceeds "
                   "limit of 4194304 bytes)"),
    ("close_1011", "the connection ended (1011 internal error)"),
    ("rate_limited", "it refused the register (rate_limited: try again later)"),
])
def test_a_server_that_fails_the_same_way_on_every_connection_is_given_up(model, break_it, said):
    symbols, features = _stream(3)
    connections = []

    async def handler(ws):
        connections.append(protocol.decode(await ws.recv()))
        if break_it == "rate_limited":
            await ws.send(protocol.encode(protocol.error("rate_limited", "try again later")))
            await ws.close(protocol.CLOSE_TRY_AGAIN_LATER, "rate_limited")
            return
        await ws.send(_welcome(10))
        await ws.send(_request([0, 1, 2], symbols, features))  # the same requests on every connection
        await asyncio.sleep(0.05)
        if break_it == "huge_frame":  # a frame header announcing 500 MB
            ws.transport.write(bytes([0x82, 127]) + (500 * 2**20).to_bytes(8, "big"))
            await ws.wait_closed()
        else:
            await ws.close(1011, "internal error")

    started = time.monotonic()
    _, summary = asyncio.run(_play(handler, CountingClient(ReferenceEngine(model)), give_up_repeats=3))
    assert time.monotonic() - started < 20
    assert summary["outcome"] == runtime.GAVE_UP and len(connections) == 3 == summary["connections"]
    played = "0" if break_it == "rate_limited" else "0 of 10"  # (never welcomed: the stream's length unknown)
    assert summary["detail"] == (f"the server failed the same way on 3 connections in a row, with no new request "
                                 f"between them: {said}; giving up after {played} requests answered")


def test_a_server_that_fails_in_turns_two_ways_is_retried_keeping_only_the_last_ways_it_failed():
    """Connections that end in turns two ways (with no request between them) never give up: only the last
    give_up_repeats ways are kept to compare, where each reconnect kept one for the session."""
    client = StreamingClient(None, "ws://127.0.0.1:1", "testers", give_up_repeats=3)
    for attempt in range(100):
        assert not client._gave_up(("server", 1011 + attempt % 2, ""), "it broke")
    assert len(client._failures) == 3
    assert not client._gave_up(("server", 1012, ""), "it broke") and client._gave_up(("server", 1012, ""), "it broke")
    assert client.outcome == runtime.GAVE_UP


def test_a_server_that_falls_silent_without_end_cuts_the_session_short(model):
    async def handler(ws):
        await ws.recv()
        await ws.send(_welcome(10))
        await ws.wait_closed()  # no heartbeat, no request, no end

    started = time.monotonic()
    _, summary = asyncio.run(_play(handler, CountingClient(ReferenceEngine(model)), server_idle_s=0.5))
    assert time.monotonic() - started < 10
    assert summary["outcome"] == runtime.CUT_SHORT and summary["connections"] == 1
    assert summary["detail"].startswith("the server sent nothing for 0.5 s (not even a heartbeat) and never said "
                                        "the stream was over, after 0 of 10 requests answered (the limit: "
                                        "--server-idle-s 0.5)")


def test_a_resent_id_whose_answer_left_the_cache_is_refused_never_stepped_twice(model):
    symbols, features = _stream(7)
    recorder = Recorder()

    async def handler(ws):
        await ws.recv()
        await ws.send(_request(list(range(6)), symbols, features))
        await recorder.pump(ws, lambda: recorder.answered() >= set(range(6)))
        await ws.send(_request([0, 1, 6], symbols, features))  # 0 and 1 answered long ago (left the cache of 2)
        await recorder.pump(ws, lambda: 6 in recorder.answered() and len(recorder.errors) >= 2)
        await ws.close(1000)

    team_client = CountingClient(ReferenceEngine(model))
    _, summary = asyncio.run(_play(handler, team_client, cache_size=2))
    assert sum(team_client.stepped.values()) == 7  # 0 and 1 never advanced their symbols' states again
    assert sorted(uid for uid, _ in recorder.responses) == list(range(7))
    for uid in (0, 1):
        assert any(f"unique_id {uid} " in e and "answered earlier" in e for e in recorder.errors), recorder.errors
    expected = _expected(model, symbols, features, range(7))
    np.testing.assert_allclose(dict(recorder.responses)[6], expected[6], rtol=1e-5, atol=1e-6)
    assert summary["requests"] == 7


class LostSymbol(CountingClient):
    """Answers SYM_001's requests with an error, as a lost shard's symbols' for the rest of the stream."""

    def process_batch(self, requests_by_symbol):
        lost = requests_by_symbol.pop("SYM_001", [])
        answer = super().process_batch(requests_by_symbol)
        return {**answer, "errors": {uid: "shard lost" for uid, _ in lost}}


def test_refused_ids_leave_no_holes_in_the_ranges_of_answers_gone_and_are_refused_again(model):
    """Each request answered with an error (a lost shard's symbol's) left a hole in the ranges of the ids whose
    answers left the cache, a range each for the session (~80 B a request refused); its resend, after a reconnect
    too, is still refused as such, not taken for an id answered long ago (a new stream's)."""
    symbols, features = _stream(31)
    recorder = Recorder()
    connections = []

    async def handler(ws):
        connections.append(ws)
        assert protocol.decode(await ws.recv())["type"] == "register"
        if len(connections) == 1:
            await ws.send(_request(list(range(30)), symbols, features))
            await recorder.pump(ws, lambda: len(recorder.answered()) == 20 and len(recorder.errors) >= 10)
            ws.transport.abort()
            return
        await ws.send(_request([1, 30, 0], symbols, features))  # the backlog first (1 was refused), then 30 new
        await recorder.pump(ws, lambda: 30 in recorder.answered() and len(recorder.errors) >= 12)
        await ws.close(1000)

    client, summary = asyncio.run(_play(handler, LostSymbol(ReferenceEngine(model)), cache_size=2))
    assert client.outcome != "new_stream" and len(connections) == 2
    assert client._evicted.ranges() == 1 and len(client._evicted) == 29  # 0..28: 19 answers gone, 10 refused
    assert any("unique_id 1 " in e and "rejected earlier" in e for e in recorder.errors), recorder.errors
    assert any("unique_id 0 " in e and "answered earlier" in e for e in recorder.errors), recorder.errors
    assert summary["requests"] == 31 and summary["errors"] == 10


def test_refused_ids_are_kept_apart_a_bounded_number_then_join_the_ranges_still_refused(model, monkeypatch):
    """A lost shard's symbols are refused for the rest of a stream: the set telling refused ids apart grew ~60 B a
    request for the session. The last REFUSALS_KEPT are kept (a resend 'rejected earlier'); older ones join the
    ranges of ids gone from the cache, still refused and never stepped."""
    monkeypatch.setattr(runtime, "REFUSALS_KEPT", 3)
    symbols, features = _stream(31)
    lost = [uid for uid in range(30) if symbols[uid] == "SYM_001"]
    recorder = Recorder()

    async def handler(ws):
        assert protocol.decode(await ws.recv())["type"] == "register"
        await ws.send(_request(list(range(30)), symbols, features))
        await recorder.pump(ws, lambda: len(recorder.answered()) + len(recorder.errors) == 30)
        await ws.send(_request([lost[0], lost[-1], 30], symbols, features))  # the oldest refused, the last, new
        await recorder.pump(ws, lambda: 30 in recorder.answered() and len(recorder.errors) == len(lost) + 2)
        await ws.close(1000)

    team_client = LostSymbol(ReferenceEngine(model))
    client, summary = asyncio.run(_play(handler, team_client, cache_size=2))
    assert len(lost) > 3 and list(client._rejected_ids) == lost[-3:]
    assert lost[0] in client._evicted and client._evicted.ranges() == 1
    assert sum(team_client.stepped.values()) == 31 - len(lost)  # the resends stepped nothing
    assert any(f"unique_id {lost[0]} " in e and "rejected earlier" in e for e in recorder.errors), recorder.errors
    assert any(f"unique_id {lost[-1]} " in e and "rejected earlier" in e for e in recorder.errors), recorder.errors
    assert summary["requests"] == 31 and summary["errors"] == len(lost)


def test_a_resent_id_that_holds_another_request_is_refused_and_its_answer_stands(model):
    symbols, features = _stream(4)
    other_symbol = next(s for s in SYMBOLS if s != symbols[2])
    recorder = Recorder()

    async def handler(ws):
        await ws.recv()
        await ws.send(_request([0, 1, 2], symbols, features))
        await recorder.pump(ws, lambda: recorder.answered() >= {0, 1, 2})
        await ws.send(protocol.encode(protocol.inference_request([1], [symbols[1]], features[1:2] + 1.0, 0.0)))
        await ws.send(protocol.encode(protocol.inference_request([2], [other_symbol], features[2:3], 0.0)))
        await ws.send(_request([0, 3], symbols, features))  # a true resend, and a new request
        await recorder.pump(ws, lambda: 3 in recorder.answered() and len(recorder.errors) >= 2)
        await ws.close(1000)

    team_client = CountingClient(ReferenceEngine(model))
    asyncio.run(_play(handler, team_client))
    assert sum(team_client.stepped.values()) == 4  # the other requests were fed to no model
    assert sorted(uid for uid, _ in recorder.responses) == [0, 0, 1, 2, 3]
    for uid in (1, 2):
        assert any(f"unique_id {uid} " in e and "received before for another symbol or other features" in e
                   for e in recorder.errors), recorder.errors
    expected = _expected(model, symbols, features, range(4))
    for uid, prediction in recorder.responses:
        np.testing.assert_allclose(prediction, expected[uid], rtol=1e-5, atol=1e-6)


def test_ids_wait_for_a_score_only_among_the_latest_received(monkeypatch):
    """A server that scores nothing (or only some ids) kept every id received waiting for its score, ~70 B a request
    for the session: only the last MAX_UNSCORED received wait, and a score for an older one is not counted."""
    monkeypatch.setattr(runtime, "MAX_UNSCORED", 100)
    stats = ClientStats(timeout_s=1.0)
    for uid in range(1000):
        stats.note_request(uid)
    assert len(stats._unscored) == 100 and len(stats._received) == 100
    stats.add_scores(protocol.score_update([5, 950, 999], [1.0] * 3, [4] * 3, [10.0] * 3))
    summary = stats.summary()
    assert summary["requests"] == 1000 and summary["responses"] == 2 and summary["missed"] == 998
    assert summary["pnl"] == pytest.approx(2.0)


def test_scores_of_ids_never_received_or_beyond_the_towers_are_not_counted():
    stats = ClientStats(timeout_s=1.0)
    for uid in range(3):
        stats.note_request(uid)
    stats.add_scores(protocol.score_update([0, 1, 7, 8], [1.0, 1.0, 5.0, 5.0], [4, 2, 4, 4], [10.0] * 4))
    summary = stats.summary()
    assert summary["responses"] == 2 and summary["missed"] == 1  # 7 and 8 were never this client's requests
    assert summary["accuracy"] == pytest.approx(6 / 8) and summary["pnl"] == pytest.approx(2.0)
    for correct, pnl in ((5, 0.0), (-1, 0.0), (4, math.nan)):
        with pytest.raises(protocol.ProtocolError):
            stats.add_scores(protocol.score_update([2], [pnl], [correct], [10.0]))
    assert stats.summary()["responses"] == 2


def test_a_score_update_with_a_negative_or_non_finite_latency_is_refused_whole_naming_its_ids():
    """The server's frame decoded, not built here: the count checks it as the builder does (a negative latency was
    counted in time however late the answer came)."""
    stats = ClientStats(timeout_s=1.0)
    for uid in range(3):
        stats.note_request(uid)
    for latencies, pnls, named in (([10.0, -5.0, 10.0], [1.0] * 3, "latencies_ms negative or not finite for "
                                                                   "unique_ids 1$"),
                                   ([10.0, 10.0, math.nan], [1.0, math.inf, 1.0], "pnls not finite for unique_ids 1; "
                                    "latencies_ms negative or not finite for unique_ids 2$")):
        update = {"type": "score_update", "unique_ids": [0, 1, 2], "pnls": pnls, "correct": [4] * 3,
                  "latencies_ms": latencies}
        with pytest.raises(protocol.ProtocolError, match=named):
            stats.add_scores(update)
    summary = stats.summary()
    assert summary["responses"] == 0 and summary["pnl"] == 0.0  # nothing of a refused update counted


def test_a_server_that_heartbeats_but_never_answers_the_register_is_left_after_the_idle_limit(model):
    async def handler(ws):
        await ws.recv()
        while True:  # no welcome, no refusal: heartbeats only
            await ws.send(protocol.encode(protocol.heartbeat(time.time())))
            await asyncio.sleep(0.05)

    started = time.monotonic()
    _, summary = asyncio.run(_play(handler, CountingClient(ReferenceEngine(model)), server_idle_s=0.5))
    assert time.monotonic() - started < 10
    assert summary["outcome"] == runtime.CUT_SHORT and summary["connections"] == 1
    assert "never answered the register" in summary["detail"], summary["detail"]



def test_a_limit_that_passes_refused_on_a_connection_left_open_is_tried_again_then_given_up():
    """A refusal for a limit that passes (server_full) is followed by the server's close (1013), and the client tries
    again. A server that heartbeat on instead held the client for good, neither welcomed nor refused: the connection
    is dropped server_idle_s after it began, and the connect loop tries again, and gives up as for any such refusal."""
    connections = []

    async def handler(ws):
        connections.append(protocol.decode(await ws.recv()))
        await ws.send(protocol.encode(protocol.error("server_full", "64 teams play already")))
        while True:  # no close: heartbeats
            await ws.send(protocol.encode(protocol.heartbeat(time.time())))
            await asyncio.sleep(0.05)

    started = time.monotonic()
    _, summary = asyncio.run(_play(handler, None, server_idle_s=0.3, give_up_repeats=3))
    assert time.monotonic() - started < 10
    assert summary["outcome"] == runtime.GAVE_UP and len(connections) == 3 == summary["connections"]
    assert "it refused the register (server_full: 64 teams play already)" in summary["detail"]


class SlowSteps:
    """A team client whose steps take `step_s` (no model): process_batch alone, submit_batch (pipelined on threads),
    or submit_batch whose steps run in the background (inline steps)."""

    requests_per_symbol = "many"

    def __init__(self, kind, step_s=0.3):
        self.step_s, self.steps_in_background = step_s, kind == "inline"
        if kind != "process_batch":
            self.submit_batch = self._submit

    def _answer(self, requests_by_symbol):
        ids = [uid for queued in requests_by_symbol.values() for uid, _ in queued]
        return {"unique_ids": ids, "predictions": np.full((len(ids), 4), 0.5, np.float32)}

    def process_batch(self, requests_by_symbol):
        time.sleep(self.step_s)
        return self._answer(requests_by_symbol)

    def _submit(self, requests_by_symbol):
        ends, answer = time.monotonic() + self.step_s, self._answer(requests_by_symbol)

        class Pending:
            def done(self):
                return time.monotonic() >= ends

            def result(self):
                time.sleep(max(0.0, ends - time.monotonic()))
                return answer

        return Pending()


@pytest.mark.parametrize("kind", ["process_batch", "threads", "inline"])
def test_stop_answers_the_steps_in_flight_before_the_connection_closes(kind):
    """stop() closed the connection at once: the answers of the steps already running were computed and never sent
    (the server counted them missed). Now no step is formed after it, and those in flight are answered first."""
    symbols, features = _stream(3)
    recorder, stepping = Recorder(), asyncio.Event()

    async def handler(ws):
        await ws.recv()
        await ws.send(_welcome(10))
        await ws.send(_request([0, 1, 2], symbols, features))
        stepping.set()
        try:
            await recorder.pump(ws, lambda: False)
        except ConnectionClosed:  # the client closed it
            pass

    async def main():
        async with serve(handler, "127.0.0.1", 0) as server:
            port = server.sockets[0].getsockname()[1]
            client = StreamingClient(SlowSteps(kind), f"ws://127.0.0.1:{port}", "testers")
            playing = asyncio.ensure_future(client.run())
            await stepping.wait()
            await asyncio.sleep(0.1)  # its step runs
            stopped_at = time.monotonic()
            client.stop()
            return await asyncio.wait_for(playing, 30), time.monotonic() - stopped_at

    summary, took = asyncio.run(main())
    assert summary["outcome"] == runtime.INTERRUPTED and took < runtime.STOP_DRAIN_S
    assert recorder.answered() == {0, 1, 2} and summary["responses_sent"] == 3


def test_stop_while_a_connection_is_being_made_gives_it_up():
    """Stopped while it reconnected to a server slow to accept, the client connected once the server did and played
    on, the stop unseen, until the server ended the session: now the attempt is given up at once."""
    connections = []

    async def slow_reconnect(connection, request):
        if connections:
            await asyncio.sleep(3)

    async def handler(ws):
        connections.append(protocol.decode(await ws.recv()))
        await ws.send(_welcome(10))
        if len(connections) == 1:
            await ws.close(1011, "internal error")  # lost: the client reconnects
            return
        while True:
            await ws.send(protocol.encode(protocol.heartbeat(time.time())))
            await asyncio.sleep(0.05)

    async def main():
        async with serve(handler, "127.0.0.1", 0, process_request=slow_reconnect) as server:
            port = server.sockets[0].getsockname()[1]
            client = StreamingClient(None, f"ws://127.0.0.1:{port}", "testers", backoff_s=0.01)
            playing = asyncio.ensure_future(client.run())
            while not connections:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.3)  # reconnecting, in the slow handshake
            stopped_at = time.monotonic()
            client.stop()
            return await asyncio.wait_for(playing, 30), time.monotonic() - stopped_at

    summary, took = asyncio.run(main())
    assert took < 1 and summary["outcome"] == runtime.INTERRUPTED
    assert len(connections) == 1 and summary["connections"] == 1


def test_a_server_error_after_its_requests_is_no_refusal_even_where_its_welcome_was_malformed(model):
    symbols, features = _stream(4)
    recorder = Recorder()

    async def handler(ws):
        await ws.recv()
        odd = protocol.welcome("tiny", None, 4, 3, None)
        odd["session_key"] = 5  # not a string: the welcome is a bad message
        await ws.send(protocol.encode(odd))
        await ws.send(_request([0, 1], symbols, features))
        await recorder.pump(ws, lambda: recorder.answered() >= {0, 1})
        await ws.send(protocol.encode(protocol.error("late_response", "unique_id 0 answered late")))
        await ws.send(_request([2, 3], symbols, features))
        await recorder.pump(ws, lambda: recorder.answered() >= {0, 1, 2, 3})
        await ws.send(protocol.encode(protocol.end(4)))
        await ws.wait_closed()

    _, summary = asyncio.run(_play(handler, CountingClient(ReferenceEngine(model)), leave_at_end=True))
    assert summary["outcome"] == runtime.COMPLETE, summary["detail"]
    assert any("session_key" in e for e in recorder.errors)


def test_a_resend_of_an_id_refused_long_ago_after_a_reconnect_is_refused_and_the_session_plays_on(model,
                                                                                                  monkeypatch):
    """A server resends on each reconnect every request it holds unanswered, the refused ones too (its backlog, the
    oldest first: server/session.py _send_backlog). An id refused before the last REFUSALS_KEPT, told apart from the
    ids answered long ago no more, was taken for the mark of a new stream: the session ended at the reconnect."""
    monkeypatch.setattr(runtime, "REFUSALS_KEPT", 3)
    symbols, features = _stream(31)
    lost = [uid for uid in range(30) if symbols[uid] == "SYM_001"]
    recorder = Recorder()
    connections = []

    async def handler(ws):
        connections.append(ws)
        assert protocol.decode(await ws.recv())["type"] == "register"
        if len(connections) == 1:
            await ws.send(_request(list(range(30)), symbols, features))
            await recorder.pump(ws, lambda: len(recorder.answered()) + len(recorder.errors) == 30)
            ws.transport.abort()
            return
        await ws.send(_request(lost + [30], symbols, features))  # the backlog (every refused id), then 30 new
        await recorder.pump(ws, lambda: 30 in recorder.answered() and len(recorder.errors) == 2 * len(lost))
        await ws.close(1000)

    team_client = LostSymbol(ReferenceEngine(model))
    client, summary = asyncio.run(_play(handler, team_client, cache_size=2))
    assert client.outcome != "new_stream" and len(connections) == 2
    assert len(lost) > 3 and lost[0] not in client._rejected_ids
    assert sum(team_client.stepped.values()) == 31 - len(lost)  # the resends stepped nothing
    assert all(any(f"unique_id {uid} " in e and "rejected earlier" in e for e in recorder.errors) for uid in lost)
    assert summary["requests"] == 31 and summary["errors"] == len(lost)
