"""The scoring server: sessions per team, in the websocket protocol or the original event's (newline-delimited JSON
over TCP, server/original.py), plus a leaderboard over plain HTTP, one port."""
import asyncio
import errno
import json
import logging
import ssl
import sys
import time
from dataclasses import dataclass, field

import numpy as np
from websockets.asyncio.server import serve
from websockets.exceptions import ConnectionClosed, ConnectionClosedError

from client import protocol
from server.identity import Identity, looks, name_problem
from server.original import TEAM_PREFIX, OriginalConnection, sniffing_connections
from server.leaderboard import leaderboard_row, mark_far_below, render_page
from client.constants import ATOL, TARGET_SOURCES
from server.limits import (AddressLimits, Limits, OpenSockets, field_problem, longest_register,
                           register_frame_problem)
from server.scoring import DEFAULT_HALF_LIFE_MS, DEFAULT_TIMEOUT_S
from server.session import TeamSession, fate_of_refused_rows, send_offsets, summarize
from server.snapshot import LeaderboardSnapshot

log = logging.getLogger("server")
MAX_ERROR_DETAILS = 500
REFUSAL_PAUSE_S = 1.0  # a team's connection is read again this long after a frame past its budget
SOCKETS_PER_CONNECTION = 4  # open sockets an address may hold, per websocket connection it may register
# The leaderboard's responses: a page that runs no script, loads nothing and cannot be framed.
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; base-uri 'none'; "
                                           "form-action 'none'; frame-ancestors 'none'",
                "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer", "Cache-Control": "no-store"}


def listen_error(host: str, port: int, exc: OSError) -> str:
    """Why the server cannot listen on host:port, and what to do: another port only where this one is taken."""
    if exc.errno == errno.EADDRINUSE:
        hint = "; is another server there? stop it or choose another --port"
    elif exc.errno == errno.EADDRNOTAVAIL:
        hint = "; --host must be an address of this machine (0.0.0.0: all of them)"
    else:
        hint = ""
    return f"cannot listen on {host}:{port}: {exc.strerror or exc}{hint}"


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 0
    preset: str = "tiny"
    weights: str | None = None
    seed: int = 0
    stream: str | None = None  # path of a saved stream; else one is generated
    symbols: int = 20
    requests: int = 1000
    stream_seed: int = 1
    rate: float | None = None  # requests/s; None: the stream's own gaps, scaled by speed
    speed: float = 1.0
    atol: float = ATOL
    timeout_s: float = DEFAULT_TIMEOUT_S
    half_life_ms: float = DEFAULT_HALF_LIFE_MS
    once: bool = False
    json: str | None = None
    device: str | None = None
    cache_dir: str | None = None
    targets: str = "model"  # score against the weights' model, or "file": the stream file's own targets
    token: str | None = None  # when set, register must carry it
    tokens: dict[str, str] | None = None  # {team: token}: only these teams play, each with its own token
    limits: Limits = field(default_factory=Limits)
    register_timeout_s: float = 10.0
    heartbeat_s: float = 5.0
    send_stall_s: float | None = None  # None: timeout_s
    max_frame_bytes: int = protocol.MAX_FRAME_BYTES
    max_requests_per_message: int = 4096
    progress: bool = False
    # Accept permessage-deflate when a client offers it, as websockets does by default: off, and kept only to
    # measure against (bench.py --ws-compression; bench/LOG.md section 50).
    ws_compression: bool = False
    # TLS on the port, for both protocols (wss://, tcp+tls://; the leaderboard https://): the certificate chain
    # (PEM) and its private key (default: in tls_cert). Without it tokens and session keys cross the network as text.
    tls_cert: str | None = None
    tls_key: str | None = None

    def __post_init__(self):
        positive = {"symbols": self.symbols, "requests": self.requests, "speed": self.speed,
                    "timeout_s": self.timeout_s, "half_life_ms": self.half_life_ms,
                    "register_timeout_s": self.register_timeout_s, "heartbeat_s": self.heartbeat_s,
                    "max_frame_bytes": self.max_frame_bytes,
                    "max_requests_per_message": self.max_requests_per_message}
        if self.rate is not None:
            positive["rate"] = self.rate
        if self.send_stall_s is not None:
            positive["send_stall_s"] = self.send_stall_s
        for name, value in positive.items():
            if not value > 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if not self.atol >= 0:
            raise ValueError(f"atol must be non-negative, got {self.atol}")
        if self.targets not in TARGET_SOURCES:
            raise ValueError(f"targets must be one of {', '.join(TARGET_SOURCES)}, got {self.targets!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.token is not None and self.tokens is not None:
            raise ValueError("give one token for every team (--token) or a token per team (--tokens), not both")
        if self.token == "":  # would admit every register that sends an empty token, and silence the warning
            raise ValueError("--token must not be empty")
        # a register's token is refused past the field limit: the server's own would lock every team out
        tokens = ({"--token": self.token} if self.token is not None else
                  {f"the token of team {team!r}": token for team, token in (self.tokens or {}).items()})
        for whose, token in tokens.items():
            if len(token) > self.limits.max_field_chars:
                raise ValueError(f"{whose} holds {len(token):,} characters; a register takes at most "
                                 f"{self.limits.max_field_chars} (--max-field-chars)")
        if self.tls_key is not None and self.tls_cert is None:
            raise ValueError("--tls-key needs --tls-cert, the certificate it signs for")


def server_tls(cert: str | None, key: str | None = None) -> ssl.SSLContext | None:
    """The TLS context of a server with this certificate chain and key (PEM files), None without a certificate; a
    file that cannot serve is a ValueError in one line."""
    if cert is None:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    files = f"--tls-cert {cert}{f' --tls-key {key}' if key else ''}"
    try:
        context.load_cert_chain(cert, key)
    except ssl.SSLError as exc:  # (before OSError, which it is)
        raise ValueError(f"{files}: no PEM certificate chain with its private key there ({exc.reason or exc})") \
            from None
    except OSError as exc:
        raise ValueError(f"{files}: {exc.strerror or exc}") from None
    return context


class ScoringServer:
    """Serves `config`'s stream, scored against targets of the model config.preset with config's weights.

    stream and targets may be passed in (tests, benchmarks); weights_fingerprint then names the weights behind
    the targets, and without it the server cannot tell a client with other weights (welcome says None)."""

    def __init__(self, config: ServerConfig, stream=None, targets=None, weights_fingerprint: str | None = None):
        self.config = config
        self._stream = stream
        self._targets = None if targets is None else np.asarray(targets, dtype=np.float32)
        self.weights_fingerprint = weights_fingerprint
        self.targets_comparison = None  # the stream file's own targets against the model's (client.targets)
        self._sessions: dict[str, TeamSession] = {}
        self._tasks: dict[str, asyncio.Task] = {}  # team -> its session's run()
        self._background: set[asyncio.Task] = set()
        self._first_registered = asyncio.Event()
        self._first: TeamSession | None = None
        self._original_connections: dict[OriginalConnection, asyncio.Task] = {}
        self.unregistered_errors = 0
        self._server = None
        self._send_stall_s = config.send_stall_s or config.timeout_s
        self._tls = server_tls(config.tls_cert, config.tls_key)
        self._identity = Identity(config.token, config.tokens)
        self._addresses = AddressLimits(config.limits)
        # a team's connections and page loads fit; thousands of idle sockets from one address, or from many, do not
        self._sockets = OpenSockets(SOCKETS_PER_CONNECTION * config.limits.max_connections_per_address,
                                    config.limits.max_unregistered_sockets, burst=config.limits.new_socket_burst,
                                    per_s=config.limits.new_sockets_per_s)
        self._leaderboard = LeaderboardSnapshot(self._collect_scores, _build_leaderboard)

    # lifecycle ---------------------------------------------------------------------------------
    def prepare(self):
        """Load the reference model, the stream and its targets (through the targets cache). start() does it in a
        thread when it was not done; `python -m server` does it first, in its main thread, where Ctrl-C stops it."""
        from client.model import load_model
        from client.streams import generate_stream, load_stream
        from client.targets import check_targets_source, choose_targets, compute_targets, describe_targets

        cfg = self.config
        if self._stream is None:
            self._stream = (load_stream(cfg.stream) if cfg.stream is not None else
                            generate_stream(cfg.symbols, cfg.requests, cfg.stream_seed, rate=cfg.rate))
        if self._targets is None:
            check_targets_source(self._stream, cfg.targets)
            if cfg.progress:
                weights = cfg.weights or f"seed {cfg.seed}"
                print(f"loading preset {cfg.preset} ({weights}) for the reference targets of "
                      f"{len(self._stream):,} requests", file=sys.stderr, flush=True)
            model, fingerprint = load_model(cfg.preset, weights=cfg.weights, seed=cfg.seed,
                                            device=cfg.device or "cpu")
            self.weights_fingerprint = fingerprint
            model_targets = compute_targets(model, self._stream, fingerprint, device=cfg.device,
                                            cache_dir=cfg.cache_dir, progress=cfg.progress)
            targets, self.targets_comparison = choose_targets(self._stream, model_targets, cfg.targets, cfg.atol)
            self._targets = np.asarray(targets, dtype=np.float32)
            if self.targets_comparison is not None:
                weights = f"weights {cfg.weights}" if cfg.weights else f"seed {cfg.seed}"
                line = describe_targets(self.targets_comparison, cfg.targets, f"preset {cfg.preset}, {weights}")
                log.info("%s", line)
                if cfg.progress:
                    print(line, file=sys.stderr, flush=True)

    async def start(self) -> int:
        """Prepare the stream and targets, then listen; returns the bound port."""
        if self._stream is None or self._targets is None:
            await asyncio.to_thread(self.prepare)
        stream = self._stream
        self._symbols = np.asarray(stream.symbols).astype(str)
        self._features = np.ascontiguousarray(stream.features, dtype=np.float32)
        total = len(self._symbols)
        if self._features.shape != (total, protocol.NUM_FEATURES):
            raise ValueError(f"stream features must have shape ({total}, {protocol.NUM_FEATURES}), "
                             f"got {self._features.shape}")
        if self._targets.shape != (total, protocol.NUM_TOWERS):
            raise ValueError(f"targets must have shape ({total}, {protocol.NUM_TOWERS}), got {self._targets.shape}")
        self._offsets = send_offsets(total, stream.delay_ms, self.config.rate, self.config.speed)
        self._num_symbols = len(np.unique(self._symbols))
        # websockets closes the connection above its own limit, so let frames somewhat over ours
        # through to be answered with an error. No permessage-deflate, even for a client that offers it: the
        # features hardly compress, and compressing them held this loop up to 31 ms at 15,000 req/s (LOG 50).
        try:
            self._server = await serve(self._handle, self.config.host, self.config.port,
                                       compression="deflate" if self.config.ws_compression else None,
                                       process_request=self._http, max_size=2 * self.config.max_frame_bytes,
                                       # TLS in the sniffer, which counts a socket at accept (server/original.py)
                                       create_connection=sniffing_connections(self._accept_original,
                                                                              self.config.register_timeout_s,
                                                                              self._sockets, self._tls))
        except OSError as exc:
            raise OSError(listen_error(self.config.host, self.config.port, exc)) from exc
        return self.port

    @property
    def stream(self):
        """The stream served (once prepared)."""
        return self._stream

    @property
    def port(self) -> int:
        return self._server.sockets[0].getsockname()[1]

    async def wait_done(self):
        """Return once the first registered team's stream is fully scored and the team told so."""
        await self._first_registered.wait()
        await self._first.ended.wait()

    async def stop(self):
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        if self._server is not None:
            # 1000 tells clients the session is over (websockets' own close says 1001, "going away",
            # which a client takes as a reason to reconnect)
            await asyncio.gather(*(ws.close(1000, "server stopped") for ws in list(self._server.connections)),
                                 *(conn.close(1000, "server stopped") for conn in list(self._original_connections)),
                                 return_exceptions=True)
            await asyncio.gather(*self._original_connections.values(), return_exceptions=True)
            self._server.close()
            await self._server.wait_closed()
        self._leaderboard.close()

    # reporting ---------------------------------------------------------------------------------
    @property
    def first_session(self) -> TeamSession | None:
        """The session of the first team that registered (the one wait_done() waits for)."""
        return self._first

    def summaries(self) -> list[dict]:
        return [session.summary() for session in self._sessions.values()]

    def scores(self) -> dict:
        return _scores(self._collect_scores())

    def _collect_scores(self) -> dict:
        """What the scores are made of, copied on the event loop (_scores finishes them anywhere)."""
        cfg = self.config
        return {"time": time.time(), "teams": [session.snapshot() for session in self._sessions.values()],
                "unregistered_errors": self.unregistered_errors,
                "stream": {"requests": len(self._symbols), "symbols": self._num_symbols},
                "model": {"preset": cfg.preset, "weights_fingerprint": self.weights_fingerprint},
                "targets": {"source": cfg.targets, "file_vs_model": self.targets_comparison},
                "scoring": {"atol": cfg.atol, "half_life_ms": cfg.half_life_ms, "timeout_s": cfg.timeout_s}}

    async def _http(self, connection, request):
        # get_all: get raises on a header sent twice (websockets answers such an upgrade itself)
        if any(value.lower() == "websocket" for value in request.headers.get_all("Upgrade")):
            return None
        path = request.path.split("?", 1)[0]
        if path not in ("/", "/scores.json"):
            response = connection.respond(404, f"not found: {path[:100]}; try / or /scores.json\n")
            response.headers.update(PAGE_HEADERS)  # it repeats the stranger's path: never sniffed as a page
            return response
        page, data = await self._leaderboard.get()
        response = connection.respond(200, page if path == "/" else data)
        del response.headers["Content-Type"]
        response.headers["Content-Type"] = f"{'text/html' if path == '/' else 'application/json'}; charset=utf-8"
        response.headers.update(PAGE_HEADERS)
        return response

    # connections -------------------------------------------------------------------------------
    def _accept_original(self, transport, socket_transport):
        """An original-protocol connection: the same handling as a websocket one (server/original.py)."""
        connection = OriginalConnection(transport, self.config.max_frame_bytes, socket_transport)
        self._original_connections[connection] = asyncio.create_task(self._handle_original(connection))
        return connection.protocol

    async def _handle_original(self, connection):
        try:
            await self._handle(connection)
        finally:  # as websockets closes a connection once its handler returns
            await connection.close()
            del self._original_connections[connection]

    def _decode(self, ws, frame) -> dict:
        if isinstance(ws, OriginalConnection):
            return ws.decode(frame)
        return protocol.decode(frame, self.config.max_frame_bytes)

    async def _handle(self, ws):
        address = ws.remote_address[0] if ws.remote_address else "unknown"
        # first: a connection refused here held back its side of the close and had frames of 8 MB read meanwhile (10 s,
        # 16 queued: 150 MB a socket)
        ws.limit_messages(min(longest_register(self.config.limits), self.config.max_frame_bytes))
        refusal = self._addresses.connect(address)
        if refusal is not None:
            self.unregistered_errors += 1
            await self._refuse(ws, *refusal)
            return
        try:
            await self._serve_connection(ws, address)
        finally:
            self._addresses.disconnect(address)

    async def _serve_connection(self, ws, address):
        session = None
        heartbeats = asyncio.create_task(self._heartbeats(ws))
        try:
            session = await self._register(ws, address)
            if session is None:
                return
            ws.limit_messages(self.config.max_frame_bytes)
            async for frame in ws:
                if session.connection is not ws:
                    # no longer the team's connection (a newer one registered, and wins; or this one was cut off): what
                    # it sent while its close completed (10 s for a peer that holds its close back) was scored, answers
                    # to the requests resent to the newer one, whose own answers then counted as duplicates. A turn of
                    # the event loop each all the same: the 16 MB of lines an original-protocol connection may have
                    # buffered (its reader's most), skipped without one, held the event loop, every team's, 13 s
                    await asyncio.sleep(0)
                    continue
                await self._on_message(session, ws, frame, time.monotonic())
                # neither taking a buffered message nor sending an answer waits: without this, a team sending many
                # small messages held the event loop, every team's, until it had answered them all
                await asyncio.sleep(0)
        except ConnectionClosed:
            pass
        finally:
            heartbeats.cancel()
            if session is not None:
                session.detach(ws)

    async def _heartbeats(self, ws):
        try:
            while True:
                await asyncio.sleep(self.config.heartbeat_s)
                await self._send(ws, protocol.encode(protocol.heartbeat(time.time())))
        except ConnectionClosed:
            pass

    async def _send(self, ws, frame):
        """ws.send(frame); a send stuck send_stall_s aborts the connection (as TeamSession.send): a stranger that sent
        lines or frames and never read the errors they earned held its connection for ever, registered or not (the
        register timeout waits only for its next message). A timer, not a task a send: score updates go this way."""
        aborted = []

        def cut_off():
            aborted.append(True)
            ws.transport.abort()  # the websockets docs advise closing, not cancelling, a stuck send

        stuck = asyncio.get_running_loop().call_later(self._send_stall_s, cut_off)
        try:
            await ws.send(frame)
        finally:
            stuck.cancel()
        if aborted:  # (an original connection's send returns once its connection is aborted)
            raise ConnectionClosedError(None, None)

    async def _send_error(self, ws, code, details):
        await self._send(ws, protocol.encode(protocol.error(code, details[:MAX_ERROR_DETAILS])))

    async def _refuse(self, ws, code, details):
        """Refuse a register (or a connection): the error, then a close saying whether trying again can help."""
        if code == "bad_token":  # slows down guessing: the connection stays open (and counted) meanwhile
            await asyncio.sleep(self.config.limits.bad_token_delay_s)
        try:
            await self._send_error(ws, code, details)
            await ws.close(protocol.CLOSE_TRY_AGAIN_LATER if code in protocol.REFUSALS_THAT_PASS else 1008, code)
        except ConnectionClosed:
            pass

    async def _register(self, ws, address):
        """Wait for a valid register; answer anything else with an error. None: connection closed."""
        deadline = asyncio.get_running_loop().time() + self.config.register_timeout_s
        while True:
            # one message a turn of the event loop, as _serve_connection's: from Python 3.12 wait_for takes a buffered
            # one without yielding, and a stranger's 60 kB of `{}` lines before register held every team's loop 0.5 s
            await asyncio.sleep(0)
            remaining = deadline - asyncio.get_running_loop().time()
            try:
                frame = await asyncio.wait_for(ws.recv(), timeout=max(remaining, 0))
            except TimeoutError:
                self.unregistered_errors += 1
                await self._send_error(ws, "register_timeout",
                                       f"no register within {self.config.register_timeout_s} s of connecting")
                await ws.close(1008, "register first")
                return None
            problem = register_frame_problem(len(frame), self.config.limits)
            if problem is not None:  # counted as a register, as it likely is one
                problem = self._addresses.register(address) or problem
            else:
                try:
                    msg = self._decode(ws, frame)
                except protocol.ProtocolError as exc:
                    self.unregistered_errors += 1
                    await self._send_error(ws, "protocol_error", str(exc))
                    continue
                if msg["type"] != "register":
                    self.unregistered_errors += 1
                    await self._send_error(ws, "not_registered", f"send register first, not {msg['type']}")
                    continue
                # the last check, _team_problem, and _attach's new session come with no await between them
                problem = (self._addresses.register(address) or self._register_problem(msg, ws)
                           or self._team_problem(msg, ws))
            if problem is not None:
                self.unregistered_errors += 1
                await self._refuse(ws, *problem)
                return None
            return await self._attach(msg, ws)

    def _register_problem(self, msg, ws):
        problem = field_problem(msg, self.config.limits)
        if problem is not None:
            return problem
        if msg["protocol"] != protocol.PROTOCOL_VERSION:
            return ("version_mismatch", f"server speaks protocol {protocol.PROTOCOL_VERSION}, "
                                        f"client sent {msg['protocol']}")
        team = msg["team"]
        problem = protocol.team_name_problem(team)
        if problem is not None:
            return ("bad_team", problem)
        if looks(team).startswith(TEAM_PREFIX) and not isinstance(ws, OriginalConnection):
            # its host's name (server/original.py): whoever registered it first would hold its session key; and what
            # reads as it ("TCP-JSON:..."), which would have the host refused as its lookalike
            return ("bad_team", f"a name beginning {TEAM_PREFIX!r} is the team of an original-protocol client, "
                                f"named after its host: choose another --team")
        problem = self._identity.token_problem(team, msg.get("token"))
        if problem is not None:
            return problem
        if self._weights_match(msg) is False and not msg.get("allow_weights_mismatch", False):
            # the facts only: the client says what its user can do about them
            return ("weights_mismatch", f"the server plays preset {self.config.preset} with weights "
                                        f"{self.weights_fingerprint}, the client has preset "
                                        f"{msg.get('preset', '?')} with weights {msg['weights_fingerprint']}")
        return None

    def _team_problem(self, msg, ws):
        """Whether this register may be its team: a known team only with its session key, a new one if there
        is room."""
        team = msg["team"]
        if team in self._sessions:
            if isinstance(ws, OriginalConnection) and team == ws.team:
                return None  # the original protocol names a team after its client's host, which is then its key
            return self._identity.takeover_problem(team, msg.get("session_key"))
        if self._identity.tokens is None and not isinstance(ws, OriginalConnection):  # (else not a stranger's name)
            problem = name_problem(team, self._sessions)
            if problem is not None:
                return problem
        if len(self._sessions) >= self.config.limits.max_teams:
            return ("server_full", f"this server holds its limit of {self.config.limits.max_teams} teams "
                                   f"(--max-teams); none can join now")
        return None

    def _weights_match(self, msg) -> bool | None:
        """Whether the client's weights are the server's (None: one side has no fingerprint to compare)."""
        theirs = msg.get("weights_fingerprint")
        if theirs is None or self.weights_fingerprint is None:
            return None
        return theirs == self.weights_fingerprint

    async def _attach(self, msg, ws):
        self._sockets.registered(ws.socket_transport)  # before any await: a flood's new sockets close others now
        team, weights_match = msg["team"], self._weights_match(msg)
        session = self._sessions.get(team)
        if session is None:  # before any await: a second register of the name now finds the team
            cfg = self.config
            session = TeamSession(team, self._symbols, self._features, self._targets, self._offsets,
                                  atol=cfg.atol, half_life_ms=cfg.half_life_ms, timeout_s=cfg.timeout_s,
                                  send_stall_s=self._send_stall_s,
                                  max_requests_per_message=cfg.max_requests_per_message)
            self._sessions[team] = session
            self._identity.issue(team)
            self._tasks[team] = asyncio.create_task(session.run())
            log.info("team %r registered", team)
        # first, so that the client hears which model it plays before any request
        welcome = protocol.welcome(self.config.preset, self.weights_fingerprint, len(self._symbols),
                                   self._num_symbols, weights_match, session_key=self._identity.key_of(team),
                                   timeout_s=self.config.timeout_s)
        try:
            await self._send(ws, protocol.encode(welcome))
        except ConnectionClosed:
            if session.connections == 0:  # gone before hearing its key: the name is free again
                self._drop_team(team)
            raise
        if self._first is None:  # the first team welcomed: the one wait_done() (--once) waits for
            self._first = session
            self._first_registered.set()
        # those a drop may have lost, before the connection is the team's: then nothing else (the end above all, should
        # the stream end meanwhile) is sent on it before them
        for frame in session.scores_to_resend(time.monotonic()):
            if not await session.send(ws, frame):
                break
        previous = session.attach(ws, msg.get("weights_fingerprint"), weights_match)
        if session.ended.is_set():  # a team back after its stream ended: nothing more will come
            await session.send(ws, protocol.encode(protocol.end(session.total)))
        if previous is not None:  # a reconnect that beat the old connection's close: the new one wins
            task = asyncio.create_task(self._supersede(previous))
            self._background.add(task)  # the loop holds tasks only weakly
            task.add_done_callback(self._background.discard)
        return session

    def _drop_team(self, team):
        self._sessions.pop(team)
        self._identity.forget(team)
        self._tasks.pop(team).cancel()

    async def _supersede(self, ws):
        try:
            await self._send_error(ws, "superseded", "a newer connection registered under this team")
            await ws.close(1008, "superseded")
        except ConnectionClosed:
            pass

    async def _on_message(self, session, ws, frame, received):
        over = session.inbound.take(len(frame), session.open_requests)
        if over is not None:
            session.errors += 1
            await self._send_error(ws, *over)
            # refusing costs the server what reading cost the team: read on at once, it answered a stream of small
            # frames refusal after refusal as fast as it went; and the socket is not read meanwhile either
            ws.hold_reading(REFUSAL_PAUSE_S)
            await asyncio.sleep(REFUSAL_PAUSE_S)
            return
        try:
            msg = self._decode(ws, frame)
            kind = msg["type"]
            if kind == "inference_response":
                ids, predictions = protocol.parse_inference_response(msg)
                update, problems = session.handle_response(ids, predictions, received)
                if update is not None:
                    frame = protocol.encode(update)
                    session.note_scores_sent(frame, len(update["unique_ids"]), received)
                    await self._send(ws, frame)
                unreadable = msg.get("unreadable_ids")
                if unreadable:  # (the original protocol's) rows that were not 4 numbers, left out of the message
                    session.errors += 1
                    fate = fate_of_refused_rows(unreadable, session.answered_among(unreadable))
                    problems.append(("protocol_error", f"inference_response: each prediction must be a list of "
                                                       f"{protocol.NUM_TOWERS} numbers; {fate}"))
                for code, details in problems:
                    await self._send_error(ws, code, details)
                if session.finished_at is not None:
                    await session.announce_end()  # after the last score_update
            elif kind == "error":  # the client reports a problem of its own (e.g. a NaN feature row)
                session.client_errors += 1
                if msg["error"] in protocol.CLIENT_NOTICES:
                    session.add_notice(msg["error"], msg["details"])
            elif kind == "register":
                session.errors += 1
                await self._send_error(ws, "already_registered", f"this connection is team {session.team!r}")
            elif kind != "heartbeat":
                session.errors += 1
                await self._send_error(ws, "unexpected_type", f"a client does not send {kind} messages")
        except protocol.ProtocolError as exc:
            session.errors += 1
            await self._send_error(ws, "protocol_error", str(exc))


def _scores(raw: dict) -> dict:
    """The leaderboard's data from ScoringServer._collect_scores: each team summarized, best PnL first."""
    rows = (leaderboard_row(summarize(snapshot, len(raw["teams"]))) for snapshot in raw["teams"])
    return {**raw, "teams": mark_far_below(sorted(rows, key=lambda row: -row["pnl"]))}


def _build_leaderboard(raw: dict) -> tuple[str, str]:
    scores = _scores(raw)
    return render_page(scores), json.dumps(scores)
