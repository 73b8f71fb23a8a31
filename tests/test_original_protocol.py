"""The original event's protocol (newline-delimited JSON over TCP) on the project's server and in its runtime."""
import asyncio
import http.server
import json
import re
import socket
import struct
import sys
import threading
import time

import numpy as np
import pytest
from websockets.asyncio.server import serve

from client import original, protocol, runtime, transport
from client.protocol import ProtocolError
from client.runtime import StreamingClient
from client.streams import generate_stream
from server import ScoringServer, ServerConfig

REQUESTS = 48
# The fields of each kind as the event had them (docs/facts.md, "The original protocol").
ORIGINAL_FIELDS = {"inference_request": {"unique_ids", "symbols", "features", "timestamp"},
                   "score_update": {"unique_ids", "trade_pnls", "accuracies", "latencies_ms"},
                   "heartbeat": {"timestamp"}, "error": {"error", "details"}}


def stand_in(requests=REQUESTS):
    return generate_stream(4, requests, seed=3), np.random.default_rng(0).normal(0, 0.05, (requests, 4)).astype(
        np.float32)


def run(coro, timeout=60):
    return asyncio.run(asyncio.wait_for(coro, timeout))


class OriginalClient:
    """A client written from the original protocol's facts: it registers with no field, sends a heartbeat every
    heartbeat_s, answers the requests it has gathered in one response per batch (covering several request
    messages, last first), prints errors and goes on, never exits by itself and does not notice a closed
    connection (it keeps polling)."""

    def __init__(self, port, targets, heartbeat_s=0.05, batch_s=0.01):
        self.port, self.targets = port, targets
        self.heartbeat_s, self.batch_s = heartbeat_s, batch_s
        self.received = []  # every object the server sent
        self.queued = []

    async def run(self):
        reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        self.send({"message_type": "register"})
        await asyncio.gather(self._receive(reader), self._heartbeats(), self._answer())

    def send(self, obj):
        self.writer.write(json.dumps(obj).encode() + b"\n")

    async def _receive(self, reader):
        while True:
            try:
                line = await reader.readline()
            except OSError:
                line = b""
            if not line:  # closed: it does not notice, and polls on
                await asyncio.sleep(0.01)
                continue
            msg = json.loads(line)
            self.received.append(msg)
            if msg["message_type"] == "inference_request":
                self.queued += msg["unique_ids"]
            elif msg["message_type"] == "error":
                print("server error:", msg["error"], msg["details"])

    async def _heartbeats(self):
        while True:
            self.send({"message_type": "heartbeat", "timestamp": time.time()})
            await asyncio.sleep(self.heartbeat_s)

    async def _answer(self):
        while True:
            await asyncio.sleep(self.batch_s)
            if self.queued:
                ids, self.queued = self.queued[::-1], []
                self.send({"message_type": "inference_response", "unique_ids": ids,
                           "predictions": self.targets[ids].tolist(), "client_timestamp": time.time()})

    def kinds(self, kind):
        return [msg for msg in self.received if msg["message_type"] == kind]


async def garbage_connection(port, lines):
    """A second original-protocol connection that never registers: the server's reply to each line."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    replies = []
    for line in lines:
        writer.write(line)
        replies.append(json.loads(await asyncio.wait_for(reader.readline(), 10)))
    writer.close()
    return replies


@pytest.fixture
def default_recursion_limit():
    """The interpreter's default recursion limit, as `python -m server` runs with: torch.compile raises it for the
    rest of a test process, and with it the nesting that Python's JSON decoder takes."""
    before = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)
    yield
    sys.setrecursionlimit(before)


def test_an_original_client_plays_the_server_to_the_end(default_recursion_limit):
    stream, targets = stand_in()
    garbage = [b'{"message_type": "heartbeat", "timestamp": 1.0}\n', b"{not json\n",
               b'{"message_type": "launch"}\n', b'{"message_type": "stats_update", "complete": true, "requests": 1}\n',
               b'{"x": ' + b"[" * 1500 + b"]" * 1500 + b"}\n",
               b'{"message_type": "heartbeat", "timestamp": 1' + b"0" * 400 + b"}\n",
               b'{"message_type": "register", "x": "' + b"y" * 5000 + b'"}\n',
               b'{"message_type": "register", "x": "' + b"y" * 9000 + b'"}\n']

    async def main():
        server = ScoringServer(ServerConfig(rate=400.0, heartbeat_s=0.1, max_frame_bytes=4096), stream=stream,
                               targets=targets)
        port = await server.start()
        client = OriginalClient(port, targets)
        playing = asyncio.create_task(client.run())
        replies = await garbage_connection(port, garbage)
        await server.wait_done()
        await asyncio.sleep(0.3)  # a heartbeat or two more
        scores = server.scores()
        await server.stop()
        await asyncio.sleep(0.1)
        assert not playing.done()  # the original client never exits by itself
        playing.cancel()
        return client, replies, server.summaries(), scores

    client, replies, summaries, scores = run(main())
    assert [s["team"] for s in summaries] == ["tcp-json:127.0.0.1"]
    summary = summaries[0]
    assert summary["responses"] == REQUESTS and summary["missed"] == summary["errors"] == 0
    assert summary["accuracy"] == 1.0 and summary["weights_match"] is None and summary["complete"]
    assert scores["teams"][0]["team"] == "tcp-json:127.0.0.1" and scores["unregistered_errors"] == 8
    expected = [("not_registered", "send register first, not heartbeat"),
                ("protocol_error", "line is not JSON: Expecting property name"),
                ("protocol_error", "unknown message_type 'launch'; expected one of register, "),
                ("protocol_error", "a client does not send stats_update messages"),  # not "end", the project's
                ("protocol_error", "line nests values deeper than Python's JSON decoder goes"),  # (or, below)
                ("protocol_error", "heartbeat: field 'timestamp' must be a finite number, got int"),  # 401 digits
                ("protocol_error", "line of 5038 bytes exceeds the limit of 4096 bytes"),  # as a websocket frame's
                ("protocol_error", "line exceeds twice the limit of 4096 bytes; closing the connection")]
    assert [r["error"] for r in replies] == [code for code, _ in expected]
    # Python 3.12's JSON decoder takes 1,500 levels (3.11's stops short): the line is then an object of no kind
    nested = ("line nests values deeper than Python's JSON decoder goes", "unknown message_type None; expected one of ")
    assert replies[4]["details"].startswith(nested), replies[4]
    del replies[4], expected[4]
    assert all(r["details"].startswith(details) for r, (_, details) in zip(replies, expected)), replies
    # every message as the event had it, and nothing the original client does not know
    for kind, fields in ORIGINAL_FIELDS.items():
        assert client.kinds(kind), kind
        assert all(set(msg) == {"message_type", *fields} for msg in client.kinds(kind)), kind
    requests = client.kinds("inference_request")
    assert [i for msg in requests for i in msg["unique_ids"]] == list(range(REQUESTS))
    assert all(len(row) == 79 for msg in requests for row in msg["features"])
    assert np.array([row for msg in requests for row in msg["features"]], np.float32).tobytes() == \
        stream.features.tobytes()
    updates = client.kinds("score_update")
    assert sorted(i for u in updates for i in u["unique_ids"]) == list(range(REQUESTS))
    assert {a for u in updates for a in u["accuracies"]} == {1.0}
    assert client.kinds("stats_update") == [{"message_type": "stats_update", "complete": True, "requests": REQUESTS}]
    assert client.received[-1] == {"message_type": "error", "error": "closing", "details": "1000 server stopped"}


class Oracle:
    """A team client that answers every request with its target."""

    def __init__(self, targets):
        self.targets = targets

    def process_batch(self, requests_by_symbol):
        ids = [uid for uid, _ in requests_by_symbol.values()]
        return {"unique_ids": ids, "predictions": self.targets[ids]}


def test_the_project_client_plays_the_server_in_the_original_protocol(tmp_path):
    from client.engine.reference import ReferenceEngine
    from client.model import load_model
    from team.example_model import ExampleModel

    async def main():
        server = ScoringServer(ServerConfig(preset="tiny", seed=2, symbols=3, requests=30, rate=300.0,
                                            timeout_s=30.0, cache_dir=str(tmp_path)))
        port = await server.start()
        welcomes = []
        client = StreamingClient(ExampleModel(ReferenceEngine(load_model("tiny", seed=2)[0])),
                                 f"tcp://127.0.0.1:{port}", "ignored", leave_at_end=True, on_welcome=welcomes.append)
        summary = await client.run()
        await server.stop()
        return summary, welcomes, server.summaries()

    summary, welcomes, server_summaries = run(main(), timeout=120)
    assert summary["outcome"] == runtime.COMPLETE and summary["detail"].endswith("30 requests answered in time")
    assert summary["responses"] == 30 and summary["accuracy"] == 1.0 and summary["connections"] == 1
    assert len(welcomes) == 1 and welcomes[0]["requests"] is None  # the original protocol has no welcome
    assert [(s["team"], s["responses"], s["accuracy"]) for s in server_summaries] == [("tcp-json:127.0.0.1", 30, 1.0)]


def test_a_server_that_wants_a_token_refuses_an_original_client():
    stream, targets = stand_in()

    async def main():
        server = ScoringServer(ServerConfig(token="sesame"), stream=stream, targets=targets)
        port = await server.start()
        summary = await StreamingClient(Oracle(targets), f"tcp://127.0.0.1:{port}", "x").run()
        await server.stop()
        return summary

    summary = run(main())
    assert summary["outcome"] == runtime.REFUSED and summary["connections"] == 1
    assert summary["detail"] == "the server refused this client (bad_token: register token missing or wrong)"


def test_the_server_stopping_mid_stream_cuts_an_original_session_short():
    stream, targets = stand_in(400)

    async def main():
        server = ScoringServer(ServerConfig(rate=100.0), stream=stream, targets=targets)
        port = await server.start()
        client = StreamingClient(Oracle(targets), f"tcp://127.0.0.1:{port}", "x",
                                 on_welcome=lambda _: asyncio.get_running_loop().call_later(0.3, stopping.set))
        stopping = asyncio.Event()
        playing = asyncio.create_task(client.run())
        await stopping.wait()
        await server.stop()
        return await playing

    summary = run(main())
    assert summary["outcome"] == runtime.CUT_SHORT
    assert summary["detail"].startswith("the server closed the session (1000 server stopped) before the end")


def test_a_server_that_closes_without_a_word_is_said_so_and_given_up():
    """As the event's server may: the connection closed with no closing error, so no close code to name."""
    async def handler(reader, writer):
        await reader.readline()  # register
        writer.close()

    async def main():
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        url = f"tcp://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        summary = await StreamingClient(None, url, "x", backoff_s=0.01, give_up_repeats=2).run()
        server.close()
        return summary

    summary = run(main())
    assert summary["outcome"] == runtime.GAVE_UP
    assert "between them: the connection ended without a close code; giving up" in summary["detail"]


def test_a_server_of_both_protocols_that_drops_a_connection_before_its_first_line_is_played_on():
    """A server that speaks both protocols on one port (as this project's does) answers the websocket handshake the
    client asks to tell why a tcp-json connection ended before its first line. After lines on an earlier connection
    that is a dropped connection, not the wrong protocol: the session goes on (it ended as wrong_protocol)."""
    rounds = [requests((0, "SYM_000"), (1, "SYM_001"), seed=0), [],
              requests((0, "SYM_000"), (1, "SYM_001"), (2, "SYM_000"), seed=0)]
    sent_back = []

    async def handler(reader, writer):
        first = await reader.readline()
        if first.startswith(b"GET "):  # the client's handshake probe: accepted, as a websocket server does
            writer.write(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n")
            await writer.drain()
            writer.close()
            return
        answers = []
        sent_back.append(answers)
        n = len(sent_back) - 1
        for uid, symbol, row in rounds[n] if n < len(rounds) else []:  # round 1: closed before a line
            writer.write(json.dumps({"message_type": "inference_request", "unique_ids": [uid], "symbols": [symbol],
                                     "features": [row.tolist()], "timestamp": time.time()}).encode() + b"\n")
            line = await reader.readline()
            if not line:
                return
            answers.append(json.loads(line))
        writer.close()

    async def main():
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        url = f"tcp://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        summary = await StreamingClient(Echo(), url, "x", backoff_s=0.01, give_up_repeats=3).run()
        server.close()
        return summary

    summary = run(main())
    assert summary["outcome"] == runtime.GAVE_UP, summary["detail"]  # the end: three closes with nothing new
    assert [answered(sent) for sent in sent_back[:3]] == [[0, 1], [], [0, 1, 2]]



@pytest.mark.parametrize("cut_at", [0, 30])
def test_a_server_of_both_protocols_that_drops_the_first_connection_before_its_first_line_is_played_on(cut_at):
    """The first connection dropped before its first line was whole (a reset, a line cut short: a network's doing):
    the handshake the client asks of a server of both protocols is accepted, and a session that had not yet received a
    line ended as wrong_protocol, exit 2, "pass --protocol websocket". Said once give_up_repeats connections end so."""
    first = requests((0, "SYM_000"), (1, "SYM_001"), seed=0)
    connections = []

    async def handler(reader, writer):
        if (await reader.readline()).startswith(b"GET "):  # the client's handshake probe: accepted
            writer.write(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n")
            await writer.drain()
            writer.close()
            return
        connections.append(writer)
        answers = []
        for n, (uid, symbol, row) in enumerate(first):
            line = json.dumps({"message_type": "inference_request", "unique_ids": [uid], "symbols": [symbol],
                               "features": [row.tolist()], "timestamp": time.time()}).encode() + b"\n"
            if len(connections) == 1:  # the first connection: cut_at bytes of its first line, then a reset
                writer.write(line[:cut_at])
                await writer.drain()
                writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                                           struct.pack("ii", 1, 0))
                writer.transport.abort()
                return
            writer.write(line)
            answers.append(json.loads(await reader.readline()))
        writer.write(b'{"message_type": "stats_update", "complete": true, "requests": 2}\n')
        await reader.read()

    async def main():
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        url = f"tcp://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        summary = await StreamingClient(Echo(), url, "x", backoff_s=0.01, leave_at_end=True).run()
        server.close()
        return summary

    summary = run(main())
    assert summary["outcome"] == runtime.COMPLETE, summary["detail"]
    assert summary["connections"] == len(connections) == 2

def test_a_server_error_without_details_is_said_without_an_empty_colon(caplog):
    """The original protocol's error has details null where there is nothing to add ("server error x: " before)."""
    async def handler(reader, writer):
        await reader.readline()  # register
        writer.write(b'{"message_type": "heartbeat", "timestamp": 1}\n'
                     b'{"message_type": "error", "error": "round two starts soon", "details": null}\n'
                     b'{"message_type": "error", "error": "noted", "details": "twice"}\n'
                     b'{"message_type": "stats_update", "complete": true, "requests": 0}\n')
        await reader.read()  # until the client leaves

    async def main():
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        url = f"tcp://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        summary = await StreamingClient(None, url, "x", leave_at_end=True).run()
        server.close()
        return summary

    with caplog.at_level("WARNING", logger="client.runtime"):
        assert run(main())["outcome"] == runtime.COMPLETE
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("server error")]
    assert said == ["server error round two starts soon", "server error noted: twice"]


class RoundServer:
    """An event-style server over the original protocol (no welcome, no session): on connection n, after the
    register, the requests rounds[n] ([(unique_id, symbol, features)]) one at a time, each answer awaited, then a
    plain close (at once past the last round); what the client sent on each connection is kept."""

    def __init__(self, rounds):
        self.rounds, self.sent_back = rounds, []

    async def handler(self, reader, writer):
        answers = []
        self.sent_back.append(answers)
        await reader.readline()  # register
        n = len(self.sent_back) - 1
        for uid, symbol, row in self.rounds[n] if n < len(self.rounds) else []:
            writer.write(json.dumps({"message_type": "inference_request", "unique_ids": [uid], "symbols": [symbol],
                                     "features": [row.tolist()], "timestamp": time.time()}).encode() + b"\n")
            while True:  # until this request's answer or the client's error about it
                line = await reader.readline()
                if not line:
                    return
                answers.append(json.loads(line))
                if answers[-1]["message_type"] in ("inference_response", "error"):
                    break
        writer.close()

    async def play(self, **client_options):
        server = await asyncio.start_server(self.handler, "127.0.0.1", 0)
        url = f"tcp://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        summary = await StreamingClient(Echo(), url, "x", backoff_s=0.01, give_up_repeats=2, **client_options).run()
        server.close()
        return summary


class Echo:
    """A team client that answers each request with its first four features (states are not the point here)."""

    def process_batch(self, requests_by_symbol):
        return {"unique_ids": [uid for uid, _ in requests_by_symbol.values()],
                "predictions": np.stack([features[:4] for _, features in requests_by_symbol.values()])}


def requests(*pairs, seed):
    rows = np.random.default_rng(seed).standard_normal((len(pairs), 79))
    return [(uid, symbol, row) for (uid, symbol), row in zip(pairs, rows)]


async def _echo_against(handler) -> dict:
    """The summary of an echoing team client's session with a JSON-lines server whose connections `handler` serves."""
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    url = f"tcp://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    summary = await StreamingClient(Echo(), url, "x", leave_at_end=True).run()
    server.close()
    return summary


def answered(messages):
    return [uid for m in messages if m["message_type"] == "inference_response" for uid in m["unique_ids"]]


async def send_requests_reading_nothing(reader, writer, pause_s):
    """An original-protocol server's requests, one a line, until the client leaves; it never reads an answer."""
    uid, row = 0, [0.5] * 79
    while not reader.at_eof():
        writer.write(original.encode_line({"message_type": "inference_request", "unique_ids": [uid],
                                           "symbols": [f"S{uid % 20}"], "features": [row], "timestamp": 0.0}))
        uid += 1
        try:
            await writer.drain()
        except OSError:
            return
        await asyncio.sleep(pause_s)


def small_send_buffers(monkeypatch):
    """The client's connections with 4 KiB send buffers: the kernel's buffers fill after a few answers."""
    open_connection = asyncio.open_connection

    async def small_send_buffer(host, port, **options):
        sock = socket.create_connection((host, port))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        sock.setblocking(False)
        return await open_connection(sock=sock, **options)

    monkeypatch.setattr(asyncio, "open_connection", small_send_buffer)


def test_a_server_that_reads_nothing_while_it_sends_on_is_left_and_played_again(monkeypatch, caplog):
    """A server that sends requests and reads nothing (no keepalive over tcp-json notices): each answer waited for a
    send that never ended, its frame buffered and a task waiting, for good (67,000 requests: 5,256 tasks and 0.9 MB
    buffered, growing). A send stuck server_idle_s ends the connection, and the client connects again."""
    connections = []

    async def handler(reader, writer):
        connections.append(writer)
        await reader.readline()  # register
        if len(connections) > 1:  # the client came back: the stream is over
            writer.write(original.encode_line({"message_type": "stats_update", "complete": True, "requests": 0}))
            await reader.read()
            return
        await send_requests_reading_nothing(reader, writer, pause_s=0)

    small_send_buffers(monkeypatch)  # the kernel's buffers fill after a few answers, not 50,000

    async def main():
        listening = socket.create_server(("127.0.0.1", 0))
        listening.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the accepted sockets' too
        server = await asyncio.start_server(handler, sock=listening)
        url = f"tcp://127.0.0.1:{listening.getsockname()[1]}"
        client = StreamingClient(Echo(), url, "x", backoff_s=0.01, server_idle_s=1.0, leave_at_end=True)
        playing = asyncio.ensure_future(client.run())
        if not (await asyncio.wait({playing}, timeout=30))[0]:  # still on the first connection: end it from here
            connections[0].transport.abort()
        summary = await playing
        server.close()
        return client, summary

    with caplog.at_level("WARNING", logger="client.runtime"):
        client, summary = run(main())
    assert summary["outcome"] == runtime.COMPLETE and summary["connections"] == len(connections) == 2
    said = [r.getMessage() for r in caplog.records if "read nothing" in r.getMessage()]
    assert said == ["connection lost (the server read nothing for 1 s: an answer waited that long to be sent); "
                    "reconnecting, states kept"]
    assert not client._send_tasks


def test_stop_against_a_server_that_reads_nothing_ends_within_seconds(monkeypatch):
    """stop() closes the connection, whose close waits for its buffered answers to go out: against a server that
    read nothing, the client stopped only once a send had been stuck server_idle_s (15 s). Now the steps in flight
    have STOP_DRAIN_S, and the close CLOSE_TIMEOUT_S, before the connection is dropped."""
    async def handler(reader, writer):
        await reader.readline()  # register
        await send_requests_reading_nothing(reader, writer, pause_s=0.001)

    small_send_buffers(monkeypatch)

    async def main():
        listening = socket.create_server(("127.0.0.1", 0))
        listening.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the accepted sockets' too
        server = await asyncio.start_server(handler, sock=listening)
        client = StreamingClient(Echo(), f"tcp://127.0.0.1:{listening.getsockname()[1]}", "x")
        playing = asyncio.ensure_future(client.run())
        while len(client._send_tasks) < 5:  # answers wait to be sent
            await asyncio.sleep(0.01)
        stopped_at = time.monotonic()
        client.stop()
        summary = await playing
        server.close()
        return summary, time.monotonic() - stopped_at

    summary, took = run(main())
    assert summary["outcome"] == runtime.INTERRUPTED and summary["connections"] == 1
    assert took < runtime.STOP_DRAIN_S + transport.CLOSE_TIMEOUT_S + 1


def test_a_server_that_begins_another_stream_after_a_reconnect_ends_the_session():
    """An event server restarted (or a new round): after the reconnect its ids start over, holding other requests.
    The client's states are the old stream's: it says so and ends, answering none of the new stream from them
    (where it refused every reused id and stayed)."""
    server = RoundServer([requests((0, "SYM_000"), (1, "SYM_001"), (2, "SYM_000"), seed=0),
                          requests((0, "SYM_001"), (1, "SYM_000"), seed=1)])
    summary = run(server.play())
    assert summary["outcome"] == runtime.NEW_STREAM
    assert "unique_id 0 (SYM_001), which held another request before or was answered long ago" in summary["detail"]
    assert [answered(sent) for sent in server.sent_back] == [[0, 1, 2], []]


def test_a_stream_resumed_after_a_reconnect_goes_on():
    """The same stream after the reconnect: its requests resent as they were (answered from the cache), then new
    ones; an id that holds another request once new ones came is refused alone, as in any stream."""
    first = requests((0, "SYM_000"), (1, "SYM_001"), seed=0)
    server = RoundServer([first, first + requests((2, "SYM_000"), (0, "SYM_002"), (3, "SYM_001"), seed=1)])
    summary = run(server.play())
    assert summary["outcome"] == runtime.GAVE_UP  # closed with nothing new, twice in a row: not a new stream
    # the third connection closed before a line: a websocket handshake, then a TLS one, asked what the server speaks
    # (a connection each, answered by nothing)
    assert [answered(sent) for sent in server.sent_back] == [[0, 1], [0, 1, 2, 3], [], [], []]
    assert any(m["message_type"] == "error" and "unique_id 0 (symbol SYM_002): received before" in m["details"]
               for m in server.sent_back[1])


def test_an_id_answered_long_ago_first_after_a_reconnect_is_another_stream():
    """An id whose answer left the cache (older than a resume would resend), first after a reconnect: the server's
    ids started over, even where the request is alike."""
    first = requests(*((i, "SYM_000") for i in range(4)), seed=0)
    server = RoundServer([first, first[:1]])
    summary = run(server.play(cache_size=2))
    assert summary["outcome"] == runtime.NEW_STREAM
    assert [answered(sent) for sent in server.sent_back] == [[0, 1, 2, 3], []]


def test_a_client_of_either_protocol_says_which_flag_a_server_of_the_other_wants():
    async def websocket_server():
        async def handler(ws):
            await ws.wait_closed()
        return await serve(handler, "127.0.0.1", 0)

    async def original_server():
        # as the original server did: a line that does not decode is answered with an error line
        async def handler(reader, writer):
            while line := await reader.readline():
                try:
                    json.loads(line)
                except ValueError as exc:
                    writer.write(original.encode_line({"message_type": "error", "error": "bad json",
                                                       "details": str(exc)}))
        return await asyncio.start_server(handler, "127.0.0.1", 0)

    async def play(make_server, scheme):
        server = await make_server()
        port = server.sockets[0].getsockname()[1]
        url = f"{scheme}://127.0.0.1:{port}"
        summary = await StreamingClient(None, url, "x", connect_timeout_s=0.5).run()
        server.close()
        return url, summary

    for make_server, scheme, flag, speaks in ((websocket_server, "tcp", "websocket", "HTTP (the websocket protocol)"),
                                              (original_server, "ws", "tcp-json", "the original protocol")):
        url, summary = run(play(make_server, scheme))
        assert summary["outcome"] == runtime.WRONG_PROTOCOL
        assert summary["detail"].startswith(f"the server at {url} answers in {speaks}")
        assert summary["detail"].endswith(f"; pass --protocol {flag}")


class QuietPages(http.server.SimpleHTTPRequestHandler):
    """`python -m http.server`'s handler, without its log lines: a bad request line is answered with a page alone
    (HTTP/0.9, no status line)."""

    def log_message(self, *args):
        pass


class StatusLinePages(QuietPages):
    default_request_version = "HTTP/1.0"  # a bad request line answered with a status line first, as nginx does


@pytest.mark.parametrize("handler", [QuietPages, StatusLinePages])
@pytest.mark.parametrize("scheme", ["tcp", "ws"])
def test_a_web_server_is_said_to_be_no_scoring_server_at_once(handler, scheme):
    """A plain HTTP server at the address: over tcp-json its page (or status line) was a bad line, answered and
    skipped, and the client reconnected until it gave up; over the websocket protocol it was unreachable for 3 s.
    Now one line at the first answer, exit 2, naming what it answered."""
    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    url = f"{scheme}://127.0.0.1:{web.server_address[1]}"
    try:
        summary = run(StreamingClient(None, url, "x", connect_timeout_s=5.0).run())
    finally:
        web.shutdown()
        web.server_close()
    assert summary["outcome"] == runtime.WRONG_PROTOCOL and summary["connections"] <= 1
    assert summary["detail"].startswith(f"the server at {url} is no scoring server: it answered ")
    assert "a websocket handshake with 'HTTP/1.0 200 OK' (a web server?); check --host and --port" in summary["detail"]
    if scheme == "tcp":
        first = "'<!DOCTYPE HTML>'" if handler is QuietPages else "'HTTP/1.0 400 Bad request syntax"
        assert f"it answered the register with {first}" in summary["detail"]


def test_a_first_line_of_no_json_from_a_server_of_no_http_is_said_at_once():
    async def handler(reader, writer):
        await reader.readline()
        writer.write(b"SSH-2.0-OpenSSH_9.6\r\n")
        await reader.read()

    async def main():
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        url = f"tcp://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        summary = await StreamingClient(None, url, "x").run()
        server.close()
        return url, summary

    url, summary = run(main())
    assert summary["outcome"] == runtime.WRONG_PROTOCOL
    assert summary["detail"] == (f"the server at {url} does not speak the original protocol: it answered the register "
                                 f"with 'SSH-2.0-OpenSSH_9.6', which is no JSON; check --host and --port")


def test_a_first_line_of_no_json_from_a_server_of_json_lines_is_answered_and_skipped():
    """A server that answers a websocket handshake's lines in JSON lines speaks this protocol: its first line that is
    no JSON (a byte that is no UTF-8) is a bad line like any, where the session ended told to pass the --protocol
    tcp-json it played."""
    lines = []
    rows = np.random.default_rng(6).standard_normal((1, 79)).tolist()

    async def handler(reader, writer):
        if not (await reader.readline()).startswith(b"{"):  # the probe's handshake: an error a line, as the event's
            writer.write(original.encode_line({"message_type": "error", "error": "bad line", "details": None}))
            writer.close()
            return
        request = original.encode_line({"message_type": "inference_request", "unique_ids": [0], "symbols": ["A"],
                                         "features": rows, "timestamp": 1.0})
        writer.write(request.replace(b'"A"', b'"A\xff"') + request.replace(b"[0]", b"[1]"))
        while not answered(lines):
            lines.append(json.loads(await reader.readline()))
        writer.write(original.encode_line({"message_type": "stats_update", "complete": True, "requests": 2}))
        await reader.read()

    summary = run(_echo_against(handler))
    assert summary["outcome"] == runtime.COMPLETE and summary["connections"] == 1, summary["detail"]
    errors = [o["details"] for o in lines if o["message_type"] == "error"]
    assert len(errors) == 1 and errors[0].startswith("line is not JSON"), errors
    assert answered(lines) == [1]


def test_a_bad_line_later_in_a_session_is_answered_and_skipped_as_the_original_client_did():
    """Only the first line decides that a server speaks no JSON: later, an HTTP status line or a page is a bad line,
    answered with an error, and the session plays on."""
    lines = []

    async def handler(reader, writer):
        await reader.readline()  # register
        writer.write(original.encode_line({"message_type": "heartbeat", "timestamp": 1.0}))
        writer.write(b"HTTP/1.1 400 Bad Request\r\n<!DOCTYPE HTML>\n")
        rows = np.random.default_rng(6).standard_normal((1, 79)).tolist()
        writer.write(original.encode_line({"message_type": "inference_request", "unique_ids": [0],
                                           "symbols": ["A"], "features": rows, "timestamp": 1.0}))
        while not answered(lines):
            lines.append(json.loads(await reader.readline()))
        writer.write(original.encode_line({"message_type": "stats_update", "complete": True, "requests": 1}))
        await reader.read()

    summary = run(_echo_against(handler))
    assert summary["outcome"] == runtime.COMPLETE and summary["connections"] == 1
    errors = [o["details"] for o in lines if o["message_type"] == "error"]
    assert len(errors) == 2 and all(e.startswith("line is not JSON") for e in errors), errors
    assert answered(lines) == [0]


# ---------------------------------------------------------------------------------- the wire format

def line_of(msg):
    return original.encode_line(original.to_original(msg))


def test_each_project_message_crosses_the_original_wire_and_back():
    features = np.random.default_rng(1).standard_normal((2, 79)).astype(np.float32)
    predictions = np.random.default_rng(2).standard_normal((2, 4)).astype(np.float32)
    request = protocol.inference_request([7, 8], ["A", "B"], features, 12.5)
    back = original.from_original(original.decode_line(line_of(request)))
    assert back == request  # float32 features exactly, through JSON's decimal text
    response = protocol.inference_response([8, 7], predictions, 3.0)
    _, got = protocol.parse_inference_response(original.from_original(original.decode_line(line_of(response))))
    assert got.tobytes() == predictions.tobytes()
    update = protocol.score_update([1, 2], [0.5, 0.25], [4, 1], [3.0, 9.0])
    assert original.to_original(update)["accuracies"] == [1.0, 0.25]
    assert original.from_original(original.decode_line(line_of(update))) == update
    for msg in (protocol.heartbeat(4.0), protocol.error("bad", "why"), protocol.end(30)):
        assert original.from_original(original.decode_line(line_of(msg))) == msg
    assert original.to_original(protocol.register("team", "token", preset="tiny")) == {"message_type": "register"}
    assert original.from_original({"message_type": "register"}, team="tcp-json:h") == protocol.register("tcp-json:h")
    assert original.to_original(protocol.welcome("tiny", "f", 1, 1, None)) is None
    assert original.from_original({"message_type": "error", "error": "e", "details": None}) == protocol.error("e", "")
    assert original.from_original({"message_type": "stats_update", "pnl": 3.0}) is None


def test_an_original_score_update_with_a_negative_latency_is_refused_naming_its_id():
    line = original.encode_line({"message_type": "score_update", "unique_ids": [4, 5], "trade_pnls": [0.5, 0.5],
                                 "accuracies": [1.0, 1.0], "latencies_ms": [3.0, -1.0]})
    with pytest.raises(ProtocolError, match="latencies_ms negative or not finite for unique_ids 5$"):
        original.from_original(original.decode_line(line))


@pytest.mark.parametrize("line, message", [
    (b"{nope\n", "line is not JSON"),
    (b"[1, 2]\n", "line must hold a JSON object, got list"),
    (b"[" * 100_000 + b"]" * 100_000 + b"\n", "line nests values deeper than Python's JSON decoder goes"),
    (b'{"type": "heartbeat"}\n', "unknown message_type None"),
    (b'{"message_type": "inference_response", "unique_ids": [1, 2], "predictions": [[1, 2, 3, 4]]}\n',
     "2 unique_ids but 1 predictions"),
    (b'{"message_type": "inference_request", "unique_ids": [1], "symbols": ["A"], "timestamp": 1}\n',
     "inference_request: missing field 'features'"),
    (b'{"message_type": "heartbeat", "timestamp": "now"}\n', "field 'timestamp' must be a finite number, got str"),
    # a JSON integer has no bound: one past float's range is no number here (msgpack's stop at 64 bits)
    (b'{"message_type": "score_update", "unique_ids": [1], "trade_pnls": [1' + b"0" * 400 + b'], "accuracies": [1], '
     b'"latencies_ms": [1]}\n', "field 'trade_pnls' must be a list of numbers, got a list whose item 0 is int 100000"),
    # the item named, not "got list": ids that went through a float array
    (b'{"message_type": "inference_response", "unique_ids": [4, 5.0], "predictions": [[1, 2, 3, 4], [1, 2, 3, 4]], '
     b'"client_timestamp": 1}\n',
     "field 'unique_ids' must be a list of integers, got a list whose item 1 is float 5.0"),
    # JSON's \\u escapes can spell a lone surrogate, which no UTF-8 text (nor a msgpack string) holds
    (b'{"message_type": "error", "error": "state_reset", "details": "\\ud800"}\n',
     "field 'details' must be a string or null, of Unicode text (no lone surrogate), got str"),
    (b'{"message_type": "inference_request", "unique_ids": [1], "symbols": ["\\udfff"], "features": [[0]], '
     b'"timestamp": 1}\n', "field 'symbols' must be a list of strings of Unicode text (no lone surrogate), got a list "
                           "whose item 0 is str '\\udfff'"),
    (b'{"message_type": "score_update", "unique_ids": [1], "trade_pnls": [1], "accuracies": [2], '
     b'"latencies_ms": [1]}\n', "accuracies must be fractions"),
])
def test_a_bad_line_says_what_is_wrong(line, message):
    with pytest.raises(ProtocolError, match=re.escape(message)):
        original.from_original(original.decode_line(line))


def test_a_response_row_that_is_not_4_numbers_leaves_the_message_its_id_named():
    # a JSON integer has no bound: one past float's range is no number here (msgpack's stop at 64 bits)
    line = (b'{"message_type": "inference_response", "unique_ids": [1, 2, 3, 4], "predictions": [[1, 2, 3], '
            b'[1' + b"0" * 400 + b', 0, 0, 0], [null, 0, 0, 0], [5, 6, 7, 8]], "client_timestamp": 1}\n')
    msg = original.from_original(original.decode_line(line))
    assert msg["unique_ids"] == [4] and msg["predictions"] == [[5, 6, 7, 8]] and msg["unreadable_ids"] == [1, 2, 3]


def test_a_row_that_is_not_79_numbers_is_refused_alone_and_the_rest_of_its_line_played():
    from client.engine.reference import ReferenceEngine
    from client.model import load_model
    from team.example_model import ExampleModel

    features = np.random.default_rng(4).standard_normal((6, 79)).astype(np.float32)
    rows = features.tolist()
    rows[1][5] = "x"            # a string
    rows[2] = rows[2][:50]      # too short
    rows[4][0] = 10 ** 400      # an integer past float's range
    ids, symbols = [10, 11, 12, 13, 14, 15], ["A", "B", "C", "A", "D", "C"]
    lines = []

    async def handler(reader, writer):
        await reader.readline()  # register
        writer.write(original.encode_line({"message_type": "inference_request", "unique_ids": ids,
                                           "symbols": symbols, "features": rows, "timestamp": 1.0}))
        while not (sum(1 for o in lines if o["message_type"] == "error") >= 3
                   and sum(len(o["unique_ids"]) for o in lines if o["message_type"] == "inference_response") >= 3):
            lines.append(json.loads(await reader.readline()))
        writer.write(original.encode_line({"message_type": "stats_update", "complete": True, "requests": 6}))
        await reader.read()

    class Counting(ExampleModel):
        stepped = []

        def process_batch(self, requests_by_symbol):
            self.stepped += [uid for queued in requests_by_symbol.values() for uid, _ in queued]
            return super().process_batch(requests_by_symbol)

    async def main():
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        team_client = Counting(ReferenceEngine(load_model("tiny", seed=2)[0]))
        summary = await StreamingClient(team_client, f"tcp://127.0.0.1:{port}", "t", leave_at_end=True).run()
        server.close()
        return summary, team_client.stepped

    summary, stepped = run(main())
    assert summary["outcome"] == runtime.COMPLETE
    assert sorted(stepped) == [10, 13, 15]  # A's two in order, C's one: the bad rows never reach the model
    answered = [uid for o in lines if o["message_type"] == "inference_response" for uid in o["unique_ids"]]
    assert sorted(answered) == [10, 13, 15]
    errors = [o["details"] for o in lines if o["message_type"] == "error"]
    for uid in (11, 12, 14):
        assert any(f"unique_id {uid} " in e and "79 numbers" in e for e in errors), errors
    assert summary["requests"] == 6 and summary["errors"] == 3


async def registered_with_requests(port, count):
    """A JSON-lines team registered at the server on port, and the unique_ids of its first count requests."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b'{"message_type": "register"}\n')
    ids = []
    while len(ids) < count:
        msg = json.loads(await reader.readline())
        ids += msg["unique_ids"] if msg["message_type"] == "inference_request" else []
    return reader, writer, ids[:count]


def test_a_prediction_that_is_not_4_numbers_is_refused_alone_and_the_rest_of_its_line_scored():
    """A response row of null (NaN as most languages' JSON writes it), or not 4 numbers: that request is left
    unanswered, as a NaN row is; refusing the line lost the batch's other answers with it."""
    stream, targets = stand_in()

    async def main():
        server = ScoringServer(ServerConfig(rate=400.0), stream=stream, targets=targets)
        port = await server.start()
        reader, writer, ids = await registered_with_requests(port, 4)
        replies = []
        rows = targets[ids].tolist()
        rows[1][2], rows[3] = None, rows[3][:3]
        writer.write(original.encode_line({"message_type": "inference_response", "unique_ids": ids,
                                           "predictions": rows, "client_timestamp": 1.0}))
        while not replies or replies[-1]["message_type"] != "error":  # (the score_update comes first)
            msg = json.loads(await reader.readline())
            if msg["message_type"] in ("score_update", "error"):
                replies.append(msg)
        # left unanswered: answered again, they are scored
        writer.write(original.encode_line({"message_type": "inference_response", "unique_ids": [ids[1], ids[3]],
                                           "predictions": targets[[ids[1], ids[3]]].tolist(),
                                           "client_timestamp": 1.0}))
        while replies[-1]["message_type"] != "score_update":
            msg = json.loads(await reader.readline())
            if msg["message_type"] in ("score_update", "error"):
                replies.append(msg)
        writer.close()
        await server.stop()
        return ids, replies

    ids, replies = run(main())
    assert len(replies) == 3, replies
    scored, error, rescored = replies
    assert scored["message_type"] == "score_update" and scored["unique_ids"] == [ids[0], ids[2]], scored
    assert error["error"] == "protocol_error", error
    assert error["details"] == (f"inference_response: each prediction must be a list of 4 numbers; unique_ids "
                                f"{ids[1]}, {ids[3]} left unanswered")
    assert rescored["message_type"] == "score_update" and rescored["unique_ids"] == [ids[1], ids[3]], rescored


def test_a_row_that_is_not_4_numbers_of_an_id_another_row_answers_is_said_answered_not_left_unanswered():
    stream, targets = stand_in()

    async def main():
        server = ScoringServer(ServerConfig(rate=400.0), stream=stream, targets=targets)
        port = await server.start()
        reader, writer, (first, second) = await registered_with_requests(port, 2)
        replies = []
        rows = [targets[first].tolist(), None, targets[second].tolist()[:3]]
        writer.write(original.encode_line({"message_type": "inference_response", "unique_ids": [first, first, second],
                                           "predictions": rows, "client_timestamp": 1.0}))
        while not replies or replies[-1]["message_type"] != "error":
            msg = json.loads(await reader.readline())
            if msg["message_type"] in ("score_update", "error"):
                replies.append(msg)
        writer.close()
        await server.stop()
        return first, second, replies, server.summaries()

    first, second, replies, (summary,) = run(main())
    scored, error = replies
    assert scored["unique_ids"] == [first]
    assert error["details"] == (f"inference_response: each prediction must be a list of 4 numbers; unique_ids "
                                f"{second} left unanswered; unique_ids {first} answered by another row")
    assert summary["errors"] == 1 and summary["duplicates"] == 0


def test_a_burst_of_requests_reaches_an_original_client_in_short_lines_the_event_loop_free_between_them():
    """JSON's decimal floats take ~90 us a request to write: 4,096 requests due at once (what a reconnect's backlog
    resends in a message) made one 6 MB line that held the server's event loop, every team's, about 0.4 s."""
    requests = 4096

    def original_client(port, lines):
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(b'{"message_type": "register"}\n')
            received = b""
            while received.count(b'"SYM_') < requests or not received.endswith(b"\n"):  # a symbol a request
                received += sock.recv(1 << 20)
            lines.extend(line for line in received.split(b"\n") if b'"inference_request"' in line)

    async def main():
        stream, targets = stand_in(requests)
        server = ScoringServer(ServerConfig(rate=None, speed=1e6), stream=stream, targets=targets)
        port = await server.start()
        loop, lines = asyncio.get_running_loop(), []
        client = loop.run_in_executor(None, original_client, port, lines)
        lags = []
        while not client.done() and len(lags) < 2000:
            started = loop.time()
            await asyncio.sleep(0.005)
            lags.append(loop.time() - started - 0.005)
        await client
        await server.stop()
        return max(lags), [json.loads(line) for line in lines]
    most, lines = run(main())
    assert [i for line in lines for i in line["unique_ids"]] == list(range(requests))
    assert most < 0.1 and max(len(line["unique_ids"]) for line in lines) <= 64


def test_a_backlog_of_lines_at_an_original_client_leaves_its_event_loop_a_turn_every_few_lines():
    """readline() returns a buffered line without a turn of the event loop: a backlog of lines (a client that fell
    behind; its reader holds up to 2 x 128 MiB) ran the runtime's frame handler for every one of them before its step
    pump, due on the loop's next turn while a step is in flight, could form a step."""
    from client.transport import LINES_A_TURN, TcpJsonConnection

    requests = 1000
    features = np.zeros((1, protocol.NUM_FEATURES), np.float32)
    lines = b"".join(original.encode_line(original.to_original(protocol.inference_request([uid], ["SYM_000"],
                                                                                         features, 0.0)))
                     for uid in range(requests))

    async def main():
        async def send_all(reader, writer):
            writer.write(lines)
            await writer.drain()
            await reader.read()  # until the client closes

        listener = await asyncio.start_server(send_all, "127.0.0.1", 0)
        port = listener.sockets[0].getsockname()[1]
        connection = await TcpJsonConnection.open(f"tcp://127.0.0.1:{port}", 5.0)
        await asyncio.sleep(0.3)  # every line in the reader's buffer
        loop, read, seen_at_turns = asyncio.get_running_loop(), [0], []

        def turn():
            seen_at_turns.append(read[0])
            if read[0] < requests:
                loop.call_soon(turn)

        loop.call_soon(turn)
        async for msg in connection:
            read[0] += msg["type"] == "inference_request"
            if read[0] == requests:
                break
        await connection.close()
        listener.close()
        return seen_at_turns

    seen_at_turns = run(main())
    gaps = np.diff(seen_at_turns)
    assert len(seen_at_turns) > requests // LINES_A_TURN and gaps.max() <= LINES_A_TURN  # before: all 1,000 at once


def test_an_original_line_before_register_is_read_up_to_twice_the_longest_register():
    """A stranger's line is read whole before the server sees it: before register, up to twice the longest
    register (the connection closed past that), not twice the line limit of a team (8 MB a socket)."""
    garbage = [b'{"message_type": "register", "x": "' + b"y" * 20_000]  # no newline yet: the server must not wait

    async def main():
        stream, targets = stand_in()
        server = ScoringServer(ServerConfig(rate=400.0), stream=stream, targets=targets)
        port = await server.start()
        replies = await garbage_connection(port, garbage)
        await server.stop()
        return replies

    replies = run(main())
    assert [(r["error"], r["details"]) for r in replies] == [
        ("protocol_error", "line exceeds twice the limit of 5376 bytes; closing the connection")]


def test_a_line_whose_lists_disagree_counts_its_new_ids_as_requests_refused_as_a_frame_does():
    """An inference_request line of 3 unique_ids and 2 symbols: its ids new to the client are requests received and
    refused, once each, as over the websocket protocol (it counted as neither); a resend of one is refused as
    rejected earlier. Ids that are no list of integers: the integers among them count, the error says the rest."""
    rows = np.random.default_rng(5).standard_normal((4, 79)).tolist()
    lines = []

    def request(ids, symbols, features):
        return original.encode_line({"message_type": "inference_request", "unique_ids": ids, "symbols": symbols,
                                     "features": features, "timestamp": 1.0})

    async def handler(reader, writer):
        await reader.readline()  # register
        writer.write(request([0], ["A"], rows[:1]))
        writer.write(request([0, 1, 2], ["A", "B"], rows[:3]))       # 0 answered already: 1 and 2 refused
        writer.write(request([2], ["C"], rows[2:3]))                 # a resend of a refused id
        writer.write(request([5, "x", 6.0], ["A", "B", "C"], rows[:3]))  # ids that are not all integers: 5 refused
        writer.write(request([3], ["A"], rows[3:4]))
        while not (sum(1 for o in lines if o["message_type"] == "error") >= 3
                   and sum(len(o["unique_ids"]) for o in lines if o["message_type"] == "inference_response") >= 2):
            if not (line := await reader.readline()):
                return
            lines.append(json.loads(line))
        writer.write(original.encode_line({"message_type": "stats_update", "complete": True, "requests": 5}))
        await reader.read()

    async def main():
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        summary = await StreamingClient(Echo(), f"tcp://127.0.0.1:{port}", "t", leave_at_end=True).run()
        server.close()
        return summary

    summary = run(main())
    assert summary["outcome"] == runtime.COMPLETE
    assert answered(lines) == [0, 3]
    errors = [o["details"] for o in lines if o["message_type"] == "error"]
    assert "3 unique_ids, 2 symbols and 3 feature rows; unique_ids [1, 2] not answered" in errors[0]
    assert "unique_id 2 " in errors[1] and "rejected earlier" in errors[1]
    assert ("field 'unique_ids' must be a list of integers, got a list whose item 1 is str 'x' (2 of its 3 "
            "unique_ids are no integers: only the integers count as requests); unique_ids [5] not answered"
            ) in errors[2]
    assert (summary["requests"], summary["errors"], summary["responses_sent"]) == (5, 3, 2)


def test_an_original_client_whose_stream_begins_with_a_byte_order_mark_plays():
    """Some writers begin a UTF-8 stream with a BOM (.NET's UTF8 StreamWriter), on the first line alone: the server took
    that register for HTTP and handed it to websockets, which answered 400; the client never played."""
    stream, targets = stand_in(8)

    async def main():
        server = ScoringServer(ServerConfig(rate=400.0), stream=stream, targets=targets)
        port = await server.start()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"\xef\xbb\xbf" + b'{"message_type": "register"}\r\n')
        first = await asyncio.wait_for(reader.readline(), 10)
        writer.close()
        await server.stop()
        return first

    assert json.loads(run(main()))["message_type"] == "inference_request"


def test_a_response_whose_client_timestamp_is_no_number_is_scored():
    """The server never reads client_timestamp, and a line without one is scored: one that sent it as text (an ISO
    time) had every response refused, the whole stream missed."""
    for value in ("2025-09-20T10:00:00Z", None, [1.0]):
        line = original.encode_line({"message_type": "inference_response", "unique_ids": [3],
                                     "predictions": [[1, 2.5, 3, 4]], "client_timestamp": value})
        msg = original.from_original(original.decode_line(line))
        ids, predictions = protocol.parse_inference_response(msg)
        assert ids == [3] and predictions.tolist() == [[1, 2.5, 3, 4]]


def _scored(ids) -> bytes:
    """An event-style server's score_update line for the answers of `ids`."""
    n = len(ids)
    return original.encode_line({"message_type": "score_update", "unique_ids": ids, "trade_pnls": [1.0] * n,
                                 "accuracies": [1.0] * n, "latencies_ms": [1.0] * n})


def _played_on_event_style_server(handler) -> dict:
    """The summary of our client (leaving at the stream's end, server_idle_s 0.5) played on `handler`'s server."""
    async def main():
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        url = f"tcp://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        summary = await StreamingClient(Echo(), url, "x", leave_at_end=True, server_idle_s=0.5).run()
        server.close()
        return summary

    return run(main(), timeout=20)


def test_a_stream_that_simply_stops_on_an_event_style_server_ends_the_session():
    """The event's server has no end message: its stream stops, the connection stays open and its heartbeats go on.
    The client played on for ever; once no request came for server_idle_s, every one answered, the stream is over."""
    rows = np.random.default_rng(6).standard_normal((6, 79))
    received = []

    async def handler(reader, writer):
        await reader.readline()  # register
        for begin in (0, 3):  # several requests a line
            ids = list(range(begin, begin + 3))
            writer.write(original.encode_line({"message_type": "inference_request", "unique_ids": ids,
                                               "symbols": ["A", "B", "C"], "features": rows[ids].tolist(),
                                               "timestamp": time.time()}))
        while True:
            try:
                line = await asyncio.wait_for(reader.readline(), 0.05)
            except TimeoutError:
                line = None
            if line == b"":
                break
            if line:
                received.append(msg := json.loads(line))
                if msg["message_type"] == "inference_response":
                    writer.write(_scored(msg["unique_ids"]))
            writer.write(original.encode_line({"message_type": "heartbeat", "timestamp": time.time()}))

    summary = _played_on_event_style_server(handler)
    assert summary["outcome"] == runtime.COMPLETE, summary["detail"]
    assert summary["detail"].startswith("the server sent no request for ")
    assert sorted(answered(received)) == list(range(6)) and summary["responses"] == 6


def test_a_stream_that_stops_on_an_event_style_server_that_sends_no_heartbeat_ends_the_session():
    """The facts say only the original client sends heartbeats: a server of the event's may fall silent once its
    stream stops. With every request answered that is the stream's end too (exit 0), not a server cut short."""
    rows = np.random.default_rng(6).standard_normal((3, 79))
    received = []

    async def handler(reader, writer):
        await reader.readline()  # register
        writer.write(original.encode_line({"message_type": "inference_request", "unique_ids": [0, 1, 2],
                                           "symbols": ["A", "B", "C"], "features": rows.tolist(),
                                           "timestamp": time.time()}))
        while line := await reader.readline():
            received.append(msg := json.loads(line))
            if msg["message_type"] == "inference_response":  # scored, and nothing else: no heartbeat
                writer.write(_scored(msg["unique_ids"]))

    summary = _played_on_event_style_server(handler)
    assert summary["outcome"] == runtime.COMPLETE, summary["detail"]
    assert summary["detail"].startswith("the server sent no request for ")
    assert sorted(answered(received)) == [0, 1, 2] and summary["responses"] == 3


def test_closing_a_connection_whose_client_reads_nothing_frees_its_socket():
    """The server's close of an original-protocol connection (a refusal, a superseded one, a register timeout) waited
    for its last bytes to be sent: a client that read nothing held its socket, and the server's file descriptor, for
    good (websockets aborts a close that takes longer than its close timeout)."""
    from server.original import CLOSE_TIMEOUT_S, OriginalConnection

    async def main():
        with socket.create_server(("127.0.0.1", 0)) as listener, socket.socket() as peer:
            peer.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            peer.connect(listener.getsockname())
            accepted, _ = listener.accept()
            accepted.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            transport, _ = await asyncio.get_running_loop().connect_accepted_socket(asyncio.Protocol, accepted)
            connection = OriginalConnection(transport, 4096)
            transport.set_protocol(connection.protocol)
            connection.protocol.connection_made(transport)
            while True:  # until the socket's buffers are full: a little waits in the transport, and stays there
                while not transport.get_write_buffer_size():
                    transport.write(b" " * 1024)
                    await asyncio.sleep(0.001)
                await asyncio.sleep(0.1)
                if transport.get_write_buffer_size():
                    break
            await connection.close(1008, "superseded")  # its closing line fits below the high-water mark
            await asyncio.sleep(CLOSE_TIMEOUT_S + 0.5)
            held = transport.get_extra_info("socket")  # (uvloop's transport has none once closed)
            return -1 if held is None else held.fileno()

    assert run(main()) == -1


def test_an_original_client_that_resets_its_connection_leaves_no_error_for_the_collector_to_log():
    """A reset (a client killed, a link dropped) was left on the connection's stream as an error that nothing took:
    the garbage collector reported it, "Future exception was never retrieved" and a traceback at ERROR, on the
    operator's terminal (whether it did depended on the order it collected the connection's objects in)."""
    stream, targets = stand_in()

    async def main():
        server = ScoringServer(ServerConfig(rate=400.0), stream=stream, targets=targets)
        port = await server.start()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b'{"message_type": "register"}\n')
        await reader.readline()  # playing
        connection = next(iter(server._original_connections))
        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()  # a reset, not a close
        while server._original_connections:
            await asyncio.sleep(0.01)
        await server.stop()
        await connection._writer.wait_closed()  # the reset, had it been left there, raised here, or in the collector

    run(main())
