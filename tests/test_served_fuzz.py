"""A seeded random-sequence driver of the served path: the project's scoring server and the team client's runtime
(team/example_model.py on the tiny preset, on the CPU) playing random streams, in either protocol, through a relay
that corrupts requests, injects frames and cuts connections.

Each stream mixes bursts of one symbol's requests due at once (more than the client's --max-requests-per-symbol),
bursts of several symbols, single requests and pauses, over symbols of which some are first seen mid-stream. The
relay (a websocket or TCP proxy that decodes what crosses it) turns a few requests in the middle of a symbol's run
into NaN, inf or rows of the wrong length, every time the server sends them; between requests it injects garbage
(malformed frames or lines, unknown and unexpected message types, malformed requests of ids the server never sent,
resends of ids already answered, and resends of such ids holding another request); and it cuts the first
connections: at once, or once the client has answered what it received (then dropped, or closed as a server
going away), the answers meanwhile lost so that the server resends their requests.

Every answer is checked against each symbol's accepted requests stepped one at a time in arrival order through the
fp32 reference (tests/test_engine_fuzz.py's contract, one level up): no request is answered twice with other values,
none is lost, none is stepped twice, each bad request gets an error naming it and the reason, every injected frame an
error of its own, and none of them changes another request's answer."""
import asyncio
import collections
import itertools
import json
import re
import threading
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
from websockets.asyncio.client import connect
from websockets.asyncio.server import serve

from client import original, protocol
from client.constants import NUM_FEATURES
from client.engine.fast import FastEngine
from client.engine.precision import FP32_PRECISION
from client.engine.reference import ReferenceEngine
from client.engine.shard_process import process_shards
from client.engine.sharded import ModelSpec, ShardedEngine
from client.model import load_model
from client.original_team import as_runtime_client
from client.runtime import COMPLETE, StreamingClient
from client.streams import Stream
from local_evaluator import load_team_class
from server import ScoringServer, ServerConfig
from shard_checks import one_thread_shards
from server.limits import Limits
from team.example_model import ExampleModel

SEED = 4  # the weights'
CAP = 3  # the client's --max-requests-per-symbol
POOL = [f"SYM_{i:02d}" for i in range(12)]
LATE = POOL[8:]  # first seen in the stream's second half
REQUESTS = 140
BAD = 6  # requests of the stream the relay corrupts
FRESH = 1_000_000  # ids of the relay's own requests, never the server's
FP32_TOLERANCE = dict(rtol=1e-4, atol=2e-5)  # as tests/test_engine_fuzz.py
# RetNet's per-head RMSNorm of (q.k)v is ill-conditioned (README, "The fast engine"): a request's prediction moves with
# what else its step holds, which the arrivals' timing decides (seed 104's request 1, a symbol's first: 0.204915 alone
# through the reference, 0.204803 beside another symbol's first request, 0.205082 in the fast engine's step of two)
RETNET, RETNET_ATOL = 2, 1e-3  # the server's atol
TIMEOUT_S = 1.0  # the server's answer timeout: its end comes this long after the last request left unanswered
CUTS = ("hard", "drop", "close")
DRAIN_S = 5.0  # a cut waits at most this long for the client to answer what it received


@pytest.fixture(scope="module")
def weights():
    return load_model("tiny", seed=SEED)


def make_stream(seed):
    """A random stream, and the ids of it the relay corrupts: {unique_id: how}, each in the middle of its symbol's
    requests."""
    rng = np.random.default_rng(seed)
    symbols, delays = [], []
    while len(symbols) < REQUESTS:
        pool = POOL if len(symbols) >= REQUESTS // 2 else POOL[:len(POOL) - len(LATE)]
        kind = rng.choice(["burst", "mix", "single", "pause"], p=[0.25, 0.2, 0.45, 0.1])
        if len(symbols) >= REQUESTS // 2 and not set(LATE) & set(symbols):
            kind, pool = "burst", LATE
        if kind == "burst":  # one symbol's requests due at once, more than a step carries
            chosen = [str(rng.choice(pool))] * int(rng.integers(CAP + 1, CAP + 5))
        elif kind == "mix":  # several symbols' at once, some of them twice or more
            chosen = [str(s) for s in rng.choice(pool, int(rng.integers(3, 9)))]
        else:
            chosen = [str(rng.choice(pool))]
        gap = rng.uniform(80, 200) if kind == "pause" else rng.uniform(0, 8)
        symbols += chosen
        delays += [gap] + [0.0] * (len(chosen) - 1)
    features = rng.standard_normal((len(symbols), NUM_FEATURES)).astype(np.float32)
    runs = collections.defaultdict(list)
    for uid, symbol in enumerate(symbols):
        runs[symbol].append(uid)
    middles = sorted(uid for ids in runs.values() for uid in ids[1:-1])
    hows = ["nan", "inf", "-inf", "short", "short", "nan"]
    bad = {int(uid): how for uid, how in zip(rng.choice(middles, BAD, replace=False), hows)}
    return Stream(np.array(symbols), features, np.array(delays)), bad


def reference_targets(model, stream, bad):
    """Each symbol's requests but the bad ones stepped one at a time, in order, through the fp32 reference (the bad
    ones' zeros: never answered)."""
    oracle = ReferenceEngine(model, device="cpu", capacity=len(POOL))
    targets = np.zeros((len(stream), 4), np.float32)
    for uid, symbol in enumerate(stream.symbols):
        if uid not in bad:
            targets[uid] = oracle.step([str(symbol)], stream.features[uid:uid + 1])[0]
    return targets


class Recording:
    """A team client as the runtime sees it, recording the requests of each step: {symbol: [unique_id, ...]}, and
    when it was submitted (time.monotonic())."""

    def __init__(self, team_client):
        self._team_client, self.steps, self.submitted = team_client, [], []
        for name in ("process_batch", "submit_batch"):  # only those it has: the runtime pipelines submit_batch's
            if callable(getattr(team_client, name, None)):
                setattr(self, name, self._recorded(getattr(team_client, name)))

    def __getattr__(self, name):
        return getattr(self._team_client, name)

    def _recorded(self, method):
        def step(requests_by_symbol):
            self.steps.append({symbol: [uid for uid, _ in queued] for symbol, queued in requests_by_symbol.items()})
            self.submitted.append(time.monotonic())
            return method(requests_by_symbol)
        return step


# The wire formats: what the relay reads, and what it writes in place of or between the server's messages.

class WsWire:
    scheme = "ws"

    @staticmethod
    def decode(frame):
        try:
            return protocol.decode(frame)
        except protocol.ProtocolError:
            return None

    @staticmethod
    def request(ids, symbols, features):
        return protocol.encode(protocol.inference_request(ids, symbols, features, 0.0))

    @staticmethod
    def corrupt(frame, msg, bad):
        """The server's request frame as the client gets it: each bad row's NaN or inf written in, and each short
        one alone in a frame of its own whose features miss a byte (a frame holds one features buffer), in order."""
        ids, symbols, features = protocol.parse_inference_request(msg)
        hit = [row for row, uid in enumerate(ids) if uid in bad]
        if not hit:
            return [frame]
        features = features.copy()
        frames, start = [], 0
        for row in hit:
            how = bad[ids[row]]
            if how != "short":
                features[row, row % NUM_FEATURES] = float(how)
                continue
            if row > start:
                frames.append(WsWire.request(ids[start:row], symbols[start:row], features[start:row]))
            short = protocol.inference_request(ids[row:row + 1], symbols[row:row + 1], features[row:row + 1], 0.0)
            short["features"] = short["features"][:-1]
            frames.append(protocol.encode(short))
            start = row + 1
        if start < len(ids):
            frames.append(WsWire.request(ids[start:], symbols[start:], features[start:]))
        return frames

    @staticmethod
    def garbage(tag, fresh, symbol, row):
        """(frame, the error code the client answers it with or None, ids the error names, text it holds)."""
        short = protocol.inference_request([fresh], [symbol], row[None], 0.0)
        short["features"] = short["features"][:-4]
        two = protocol.inference_request([fresh, fresh + 1], [symbol, symbol], np.stack([row, row]), 0.0)
        two["symbols"] = two["symbols"][:1]
        odd = protocol.inference_request([fresh, fresh + 1], [symbol, symbol], np.stack([row, row]), 0.0)
        odd["unique_ids"][1] = str(fresh + 1)
        return [
            (b"\xc1 no msgpack", "bad_message", [], "malformed msgpack"),
            ("a text frame", "bad_message", [], "text frame"),
            (protocol.encode({"type": f"bogus_{tag}"}), "bad_message", [], f"'bogus_{tag}'"),
            (msgpack.packb([tag, tag]), "bad_message", [], "must be a msgpack map"),
            (protocol.encode(protocol.register(f"t{tag}")), "bad_message", [], "unexpected register"),
            (protocol.encode({"type": "score_update", "unique_ids": [tag], "pnls": [], "correct": [],
                              "latencies_ms": []}), "bad_message", [], "lengths differ"),
            (protocol.encode(protocol.heartbeat(float(tag))), None, [], None),
            (protocol.encode(short), "bad_message", [fresh], "features hold"),
            (protocol.encode(two), "bad_message", [fresh, fresh + 1], "2 unique_ids but 1 symbols"),
            (protocol.encode(odd), "bad_message", [fresh], "are no integers"),
        ]


class TcpWire:
    scheme = "tcp"

    @staticmethod
    def decode(line):
        try:
            msg = original.from_original(original.decode_line(line))
        except protocol.ProtocolError:
            return None
        return msg

    @staticmethod
    def request(ids, symbols, features):
        return original.encode_line({"message_type": "inference_request", "unique_ids": list(ids),
                                     "symbols": list(symbols), "features": features.tolist(), "timestamp": 0.0})

    @staticmethod
    def corrupt(line, msg, bad):
        """The server's request line as the client gets it: each bad row's NaN or inf written in (as Python's json
        writes them), each short row 78 numbers."""
        if not bad.keys() & set(msg["unique_ids"]):
            return [line]
        obj = json.loads(line)
        for row, uid in enumerate(obj["unique_ids"]):
            how = bad.get(uid)
            if how == "short":
                obj["features"][row] = obj["features"][row][:-1]
            elif how is not None:
                obj["features"][row][row % NUM_FEATURES] = float(how)
        return [json.dumps(obj).encode() + b"\n"]

    @staticmethod
    def garbage(tag, fresh, symbol, row):
        line = original.encode_line
        request = {"message_type": "inference_request", "unique_ids": [fresh], "symbols": [symbol],
                   "features": [row.tolist()[:-2]], "timestamp": 0.0}
        two = {**request, "unique_ids": [fresh, fresh + 1], "features": [row.tolist()] * 2}
        return [
            (b"no JSON at all\n", "bad_message", [], "line is not JSON"),
            (b"[1, 2]\n", "bad_message", [], "must hold a JSON object"),
            (b"\n", None, [], None),
            (line({"message_type": f"bogus_{tag}"}), "bad_message", [], f"'bogus_{tag}'"),
            (line({"message_type": "register"}), "bad_message", [], "unexpected register"),
            (line({"message_type": "stats_update", "complete": False}), None, [], None),
            (line({"message_type": "heartbeat", "timestamp": "now"}), "bad_message", [], "'timestamp'"),
            (line(request), "bad_request", [fresh], f"not {NUM_FEATURES} numbers"),
            (line(two), "bad_message", [fresh, fresh + 1], "2 unique_ids, 1 symbols and 2 feature rows"),
        ]


class Link:
    """One connection through the relay."""

    def __init__(self, index, cut):
        self.index, self.cut = index, cut  # cut: (once the server has sent this many requests, how) or None
        self.ids = set()           # ids of the server's forwarded
        self.first_here = set()    # ... forwarded here first
        self.answered_here = set()
        self.expected = []         # (code, ids, text) of the errors the injected frames earn
        self.errors = []           # (code, details) the client sent on it
        self.how = None            # how it was cut, once it was
        self.holding = False       # cut, waiting for the client's answers: nothing more forwarded either way
        self.ended = False         # the stream's end forwarded: nothing injected after it

    @property
    def hard(self) -> bool:
        """Cut at once: what the client sent last may be lost with it."""
        return self.how == "hard"

    @property
    def fed(self) -> bool:
        """Whether the client answered here a request it received first here (a resend that holds another request
        is then a bad request, and not a sign that the server began another stream)."""
        return bool(self.first_here & self.answered_here)


class Relay:
    def __init__(self, wire, port, bad, rng):
        self.wire, self.port, self.bad, self.rng = wire, port, bad, rng
        # the first connections' cuts: once the server has sent that many requests in all, and the next one came
        self.cuts = [(int(sent), str(rng.choice(CUTS))) for sent in np.sort(rng.uniform(0.05, 0.7, 3) * REQUESTS)]
        self.links = []
        self.sent = {}          # id -> (symbol, features) as the server first sent it
        self.answers = []       # (id, prediction) in the order the client sent them
        self.first = {}         # id -> the first prediction the client sent
        self.first_at = {}      # id -> when it reached the relay (time.monotonic())
        self.named = {}         # id -> [(code, details)] of the client's errors naming it
        self.crowded = 0        # request messages holding more than CAP requests of a symbol
        self.injected = collections.Counter()
        self.fresh = {}         # id -> (symbol, features) of the relay's own requests (malformed) it sent
        self.drain_timeouts = 0
        self._fresh = itertools.count(FRESH, 2)
        self._tags = itertools.count()

    async def start(self):
        if self.wire is WsWire:
            self.server = await serve(self._ws_link, "127.0.0.1", 0, compression=None, max_size=None)
        else:
            self.server = await asyncio.start_server(self._tcp_link, "127.0.0.1", 0, limit=original.MAX_LINE_BYTES)
        return self.server.sockets[0].getsockname()[1]

    def close(self):
        self.server.close()

    def _link(self):
        link = Link(len(self.links), self.cuts[len(self.links)] if len(self.links) < len(self.cuts) else None)
        self.links.append(link)
        return link

    # the two protocols' connections ---------------------------------------------------------------
    async def _ws_link(self, client):
        link = self._link()
        async with connect(f"ws://127.0.0.1:{self.port}", compression=None, max_size=None) as server:
            def abort():
                client.transport.abort()
                server.transport.abort()

            async def close():
                await asyncio.gather(client.close(1001, "going away"), server.close(), return_exceptions=True)

            async def up():
                try:
                    async for frame in client:
                        if self._up(link, frame):
                            await server.send(frame)
                finally:
                    await server.close()

            async def down():
                try:
                    async for frame in server:
                        for out in self._down(link, frame):
                            await client.send(out)
                finally:
                    await client.close()

            link.abort, link.close = abort, close
            await asyncio.gather(up(), down(), return_exceptions=True)

    async def _tcp_link(self, client_reader, client_writer):
        server_reader, server_writer = await asyncio.open_connection("127.0.0.1", self.port,
                                                                     limit=original.MAX_LINE_BYTES)

        def abort():
            client_writer.transport.abort()
            server_writer.transport.abort()

        first = await client_reader.readline()
        if not first.startswith(b"{"):  # the client's probe of what the server speaks: relayed as it is
            server_writer.write(first)
            await asyncio.gather(_pipe(client_reader, server_writer), _pipe(server_reader, client_writer),
                                 return_exceptions=True)
            abort()
            return
        link = self._link()

        async def close():
            client_writer.write(original.encode_line(original.closing(1001, "going away")))
            client_writer.close()
            server_writer.close()

        async def up():
            line = first
            try:
                while line:
                    if self._up(link, line):
                        server_writer.write(line)
                    line = await client_reader.readline()
            finally:
                server_writer.close()

        async def down():
            try:
                while line := await server_reader.readline():
                    for out in self._down(link, line):
                        client_writer.write(out)
                        await client_writer.drain()
            finally:
                client_writer.close()

        link.abort, link.close = abort, close
        await asyncio.gather(up(), down(), return_exceptions=True)
        abort()

    # what crosses ---------------------------------------------------------------------------------
    def _up(self, link, frame) -> bool:
        """Note what the client sent; whether to forward it to the server."""
        msg = self.wire.decode(frame)
        if msg is not None and msg["type"] == "inference_response":
            ids, predictions = protocol.parse_inference_response(msg)
            for uid, prediction in zip(ids, predictions):
                self.answers.append((uid, prediction))
                self.first.setdefault(uid, prediction)
                self.first_at.setdefault(uid, time.monotonic())
                link.answered_here.add(uid)
        elif msg is not None and msg["type"] == "error":
            link.errors.append((msg["error"], msg["details"]))
            for uid in _named_ids(msg["details"]):
                self.named.setdefault(uid, []).append((msg["error"], msg["details"]))
        return not link.holding

    def _down(self, link, frame) -> list:
        """What reaches the client for the server's frame: it, corrupted, or nothing (the link is cut); then
        perhaps an injected frame."""
        if link.holding:
            return []
        msg = self.wire.decode(frame)
        if msg is None or msg["type"] != "inference_request":
            link.ended |= msg is not None and msg["type"] == "end"
            return [frame]
        ids, symbols, features = protocol.parse_inference_request(msg)
        for uid, symbol, row in zip(ids, symbols, features):
            if not any(uid in other.ids for other in self.links):
                link.first_here.add(uid)
                self.sent[uid] = (symbol, row)
            link.ids.add(uid)
            if uid in self.bad:  # refused each time it comes: a malformed frame of its own, or that request alone
                link.expected.append(("bad_message", [], "features hold") if self.wire is WsWire
                                     and self.bad[uid] == "short" else ("bad_request", [uid], ""))
        self.crowded += max(collections.Counter(symbols).values()) > CAP
        out = self.wire.corrupt(frame, msg, self.bad)
        if link.cut is not None and link.how is None and len(self.sent) >= link.cut[0]:
            link.how = link.cut[1]
            link.holding = link.how != "hard"
            asyncio.get_running_loop().create_task(self._cut(link))
        elif not link.ended and self.rng.random() < 0.4:
            out += self._inject(link, symbols[-1])
        return out

    def _inject(self, link, symbol) -> list:
        kind = str(self.rng.choice(["garbage", "garbage", "resend", "other"]))
        if kind == "garbage":
            row = self.rng.standard_normal(NUM_FEATURES).astype(np.float32)
            options = self.wire.garbage(next(self._tags), next(self._fresh), symbol, row)
            frame, code, ids, text = options[self.rng.integers(len(options))]
            if code is not None:
                link.expected.append((code, ids, text))
                self.fresh.update(dict.fromkeys(ids, (symbol, row)))
            self.injected[text or "ignored"] += 1
            return [frame]
        # the ids the client holds: answered, sent on this connection before (it reads them first), or refused
        requests = {**{uid: self.sent[uid] for uid in link.ids.union(self.first)},
                    **{uid: self.fresh[uid] for uid in self.fresh.keys() & self.named.keys()}}
        refused = self.bad.keys() | self.fresh.keys()
        chosen = [int(uid) for uid in self.rng.choice(sorted(requests), min(len(requests), 3), replace=False)]
        symbols, features = [requests[uid][0] for uid in chosen], np.stack([requests[uid][1] for uid in chosen])
        if kind == "resend":  # answered again from the cache with the same values, or once its step is done, or refused
            link.expected += [("bad_request", [uid], "rejected earlier") for uid in chosen if uid in refused]
            self.injected["resend"] += len(chosen)
            # (one answered on this connection may be one whose resend crosses its answer: not answered again)
            self.injected["resend of an earlier answer"] += sum(uid in self.first.keys() - link.answered_here
                                                               for uid in chosen)
            return [self.wire.request(chosen, symbols, features)]
        if not link.fed:  # no new request yet on this connection: a changed resend would say another stream began
            return []
        uid = chosen[0]
        link.expected.append(("bad_request", [uid], "rejected earlier" if uid in refused else
                              "received before for another symbol or other features"))
        self.injected["other request"] += 1
        return [self.wire.request([uid], symbols[:1], features[:1] + np.float32(0.5))]

    async def _cut(self, link):
        if link.how == "hard":  # with steps in flight: their answers cross the server's resends on the next one
            link.abort()
            return
        # once the client has answered or refused what it received: its answers meanwhile are lost to the server,
        # which resends their requests on the next connection
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DRAIN_S
        while not self._drained(link) and loop.time() < deadline:
            await asyncio.sleep(0.01)
        self.drain_timeouts += not self._drained(link)
        if link.how == "drop":
            link.abort()
        else:
            await link.close()

    def _drained(self, link) -> bool:
        answered = {uid for uid in link.ids if uid not in self.bad} <= self.first.keys()
        return answered and not _unmet(link)


async def _pipe(reader, writer):
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()
    writer.close()


def _named_ids(details) -> list[int]:
    """The ids a client's error names: 'unique_id N (symbol S): ...' or 'unique_ids [N, ...] not answered'."""
    ids = [int(uid) for uid in re.findall(r"unique_id (\d+) \(symbol", details)]
    for group in re.findall(r"unique_ids \[([\d, ]*)\] not answered", details):
        ids += [int(uid) for uid in group.replace(",", " ").split()]
    return ids


def _unmet(link) -> list:
    """The errors expected on the link (its injected frames') that the client has not sent, each matched once."""
    left = list(link.errors)
    unmet = []
    for code, ids, text in link.expected:
        match = next((i for i, (c, d) in enumerate(left) if c == code and text in d
                      and all(uid in _named_ids(d) for uid in ids)), None)
        if match is None:
            unmet.append((code, ids, text))
        else:
            left.pop(match)
    return unmet


def make_team_client(name, model):
    """The team client the runtime plays: the example's with the reference engine; or with the fast engine through
    its state table of 3 slots and a host tier, a step's rows in parts of 2 a symbol; or team code in the original
    event's style (process_batch alone, answers in an order of its own) through the runtime's adapter."""
    if name == "fast":
        return ExampleModel(FastEngine(model, device="cpu", precision=FP32_PRECISION, capacity=3,
                                       host_symbols=len(POOL), max_batch=3, max_rows_per_symbol=2, progress=False))
    if name == "event-style":
        team_class = load_team_class(Path(__file__).resolve().parent / "original_team")  # as --team-dir loads it
        return as_runtime_client(team_class(ReferenceEngine(model, device="cpu")))
    return ExampleModel(ReferenceEngine(model, device="cpu"))


async def play(wire, team_client, inline, seed, weights):
    """Serve seed's stream to team_client (make_team_client's) through the relay."""
    model, fingerprint = weights
    stream, bad = make_stream(seed)
    targets = reference_targets(model, stream, bad)
    server = ScoringServer(ServerConfig(preset="tiny", seed=SEED, timeout_s=TIMEOUT_S,
                                        limits=Limits(registration_burst=100)),
                           stream=stream, targets=targets, weights_fingerprint=fingerprint)
    relay = Relay(wire, await server.start(), bad, np.random.default_rng(seed))
    team = Recording(team_client)
    client = StreamingClient(team, f"{wire.scheme}://127.0.0.1:{await relay.start()}", "fuzz",
                             weights_fingerprint=fingerprint, preset="tiny", leave_at_end=True,
                             max_requests_per_symbol=CAP, backoff_s=0.01, backoff_max_s=0.05, give_up_repeats=100,
                             timeout_s=TIMEOUT_S, inline_steps=inline)
    try:
        summary = await asyncio.wait_for(client.run(), 60)
    finally:
        [team_summary] = server.summaries() or [None]
        await server.stop()
        relay.close()
    return stream, bad, targets, relay, team, summary, team_summary


CASES = [("ws", "reference", False, 1), ("tcp", "reference", False, 2), ("ws", "fast", False, 3),
         ("tcp", "fast", False, 4), ("ws", "reference", True, 5), ("tcp", "reference", True, 6),
         ("tcp", "event-style", False, 7)]


@pytest.mark.parametrize("scheme, team_client, inline, seed", CASES,
                         ids=[f"{s}-{t}{'-inline' if i else ''}-seed{n}" for s, t, i, n in CASES])
def test_random_streams_served_through_corruption_garbage_and_cuts_equal_one_request_at_a_time(
        scheme, team_client, inline, seed, weights):
    served_and_checked(scheme, make_team_client(team_client, weights[0]), inline, seed, weights)


def restarting_targets(model, stream, bad, relay, team, idle_s):
    """reference_targets where states may be forgotten as idle: each accepted request's target is its symbol's state
    stepped on through it where the client's first answer is that, else a fresh state's (the symbol forgotten since
    its last request); and the ids of the requests that started a symbol afresh so. A restart is never a symbol's
    first request, comes only at the first of its requests in a step (a shard forgets a symbol at a step's
    placement), and only where its answer came more than idle_s after its symbol's last step was submitted (the
    shard stepped it after that, and forgot it before this step)."""
    first = relay.first
    oracle = ReferenceEngine(model, device="cpu", capacity=len(POOL))
    targets, restarts, seen = np.zeros((len(stream), 4), np.float32), [], set()
    for uid, symbol in enumerate(stream.symbols):
        if uid in bad:
            continue
        targets[uid] = oracle.step([str(symbol)], stream.features[uid:uid + 1])[0]
        if symbol in seen and uid in first and not _close(first[uid], targets[uid]):
            oracle.release([str(symbol)])
            targets[uid] = oracle.step([str(symbol)], stream.features[uid:uid + 1])[0]
            restarts.append(uid)
        seen.add(symbol)
    last_step = {}  # unique_id -> when the step before its own of its symbol was submitted
    for step, submitted in zip(team.steps, team.submitted):
        for symbol, ids in step.items():
            last_step[ids[0]] = last_step.pop(symbol, None)
            last_step[symbol] = submitted
    firsts_in_steps = {ids[0] for step in team.steps for ids in step.values()}
    assert set(restarts) <= firsts_in_steps, sorted(set(restarts) - firsts_in_steps)
    early = {uid: relay.first_at[uid] - last_step[uid] for uid in restarts if relay.first_at[uid] - last_step[uid]
             <= idle_s}
    assert not early, f"restarted by answers within {idle_s} s of their symbol's last step: {early}"
    return targets, restarts


def _close(prediction, target) -> bool:
    others = np.arange(4) != RETNET
    return (np.allclose(prediction[others], target[others], **FP32_TOLERANCE)
            and abs(prediction[RETNET] - target[RETNET]) <= RETNET_ATOL)


def served_and_checked(scheme, team_client, inline, seed, weights, idle=None) -> dict:
    """Play seed's stream to team_client through the relay and check every answer, error and count; idle: the
    client's engine forgets symbols idle past this many seconds, each then going on from a fresh state
    (restarting_targets: the server's targets, and its accuracy, are those of states never forgotten). Returns what
    was checked: the client's summary, and the ids of the requests answered from a fresh state after their symbol
    was forgotten."""
    wire = WsWire if scheme == "ws" else TcpWire
    stream, bad, targets, relay, team, summary, server_summary = asyncio.run(play(wire, team_client, inline, seed,
                                                                                  weights))
    accepted = [uid for uid in range(len(stream)) if uid not in bad]
    assert summary["outcome"] == COMPLETE, summary["detail"]
    restarts = []
    if idle is not None:
        targets, restarts = restarting_targets(weights[0], stream, bad, relay, team, idle)

    # every request of the stream but the bad ones answered, right, and each time with the same values
    assert sorted(relay.first) == accepted
    for uid, prediction in relay.answers:
        others = np.arange(4) != RETNET
        np.testing.assert_allclose(prediction[others], targets[uid, others], **FP32_TOLERANCE, err_msg=f"id {uid}")
        np.testing.assert_allclose(prediction[RETNET], targets[uid, RETNET], rtol=0, atol=RETNET_ATOL,
                                   err_msg=f"unique_id {uid}")
        assert np.array_equal(prediction, relay.first[uid]), f"unique_id {uid} answered twice, differently"
    # each stepped once, each symbol's in arrival order, at most CAP of a symbol a step
    stepped = collections.defaultdict(list)
    for step in team.steps:
        for symbol, ids in step.items():
            stepped[symbol] += ids
    for symbol in set(stream.symbols):
        assert stepped[symbol] == [uid for uid in accepted if stream.symbols[uid] == symbol], symbol
    per_step = [len(ids) for step in team.steps for ids in step.values()]
    assert max(per_step) == CAP and relay.crowded, "no step carried a backlog of a symbol beyond the cap"

    # each bad request refused, naming it and why, the first time it came (where that connection was not cut at once)
    whys = {"nan": "NaN or inf", "inf": "NaN or inf", "-inf": "NaN or inf",
            "short": "features hold" if scheme == "ws" else f"not {NUM_FEATURES} numbers"}
    for uid, how in bad.items():
        if not next(link for link in relay.links if uid in link.ids).hard:
            assert whys[how] in relay.named[uid][0][1], (uid, how, relay.named[uid])
    # a request of the stream is refused only as the resend of an answered id that holds another request
    for uid in relay.named.keys() & set(accepted):
        assert all("received before for another symbol or other features" in details
                   for _, details in relay.named[uid]), relay.named[uid]
    # on every connection not cut at once, each bad or injected frame earned its own error, and nothing else did
    for link in relay.links:
        if not link.hard:
            assert not _unmet(link), (link.index, _unmet(link), link.errors)
            assert sum(code == "bad_message" for code, _ in link.errors) == sum(
                code == "bad_message" for code, _, _ in link.expected), (link.index, link.errors)
    assert relay.drain_timeouts == 0

    # the client's counts: each request received once, each refused one an error; the server's: every answer right
    refused = summary["requests"] - len(accepted)
    assert summary["errors"] == refused
    assert len(bad) + len(relay.fresh.keys() & relay.named.keys()) <= refused <= len(bad) + len(relay.fresh)
    assert summary["responses_sent"] == len(accepted)
    assert summary["responses"] == server_summary["responses"]  # each score counted once, whatever a cut lost
    # the answers a cut lost, and the resends injected, answered from the cache
    assert summary["resent_from_cache"] >= max(relay.injected["resend of an earlier answer"], 1)
    assert summary["connections"] == len(relay.links) == 1 + sum(link.how is not None for link in relay.links) == 4
    assert server_summary["errors"] == 0 and (idle is not None or server_summary["accuracy"] == 1.0)
    assert server_summary["responses"] + server_summary["late"] == len(accepted)
    assert server_summary["missed"] - server_summary["late"] == len(bad)
    return {"summary": summary, "restarts": restarts}


# Symbols sharded over two engines, each the fast engine of the "fast" client (3 slots and a host tier: states move
# within each shard); with idle, each shard forgets symbols idle IDLE_S, so that requests land on a shard that has
# just forgotten their symbol, or that is forgetting it while they are on their way.
IDLE_S = 0.1
CLOSE_S = 10.0  # close() of a sharded engine with nothing in flight: its shards' exits, not a timeout's


def shard_options(idle: bool) -> dict:
    return dict(precision=FP32_PRECISION, capacity=3, host_symbols=len(POOL), max_batch=3, max_rows_per_symbol=2,
                idle_timeout_s=IDLE_S if idle else None)


def served_sharded(scheme, shards, seed, weights, idle) -> dict:
    """served_and_checked through a sharded engine over these started shards, which it closes: no shard lost,
    symbols on each shard, every symbol restarted only where a shard forgot it, closed promptly."""
    engine = ShardedEngine(shards, progress=False)
    try:
        checked = served_and_checked(scheme, ExampleModel(engine), False, seed, weights,
                                     idle=IDLE_S if idle else None)
        assert not engine.losses, engine.losses
        assert sorted(set(engine.shard_of.values())) == list(range(len(shards)))
        assert bool(checked["restarts"]) == idle, checked["restarts"]
    finally:
        started = time.monotonic()
        engine.close()
        closed_in = time.monotonic() - started
    assert closed_in < CLOSE_S
    return checked


SHARDED_CASES = [("ws", False, 8), ("tcp", True, 9)]


@pytest.mark.parametrize("scheme, idle, seed", SHARDED_CASES,
                         ids=[f"{s}{'-idle' if i else ''}-seed{n}" for s, i, n in SHARDED_CASES])
def test_random_streams_served_through_symbols_sharded_over_processes_equal_one_request_at_a_time(
        scheme, idle, seed, weights):
    before = set(threading.enumerate())
    with one_thread_shards():
        shards = process_shards(ModelSpec("tiny", seed=SEED), ["cpu", "cpu"], options=shard_options(idle),
                                progress=False)
    processes = [shard.process for shard in shards]
    served_sharded(scheme, shards, seed, weights, idle)
    assert [process.exitcode for process in processes] == [0, 0]  # stopped, not killed
    for thread in set(threading.enumerate()) - before:
        thread.join(5)
        assert not thread.is_alive(), thread.name
