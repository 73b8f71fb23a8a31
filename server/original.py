"""The original event's protocol on the scoring server's port, beside the websocket protocol and the leaderboard.

Every connection starts with a ProtocolSniffer: its first bytes choose. A JSON object (``{``) is the original
protocol (client/original.py); anything else is HTTP, handed to websockets as if it had been its own from the
start (a websocket upgrade, the leaderboard page, or a bad request websockets answers). The sniffer is what
``create_connection`` of websockets' serve() makes, so websockets keeps its listening socket and its handshake.
Over TLS the sniffer counts the socket at accept as without, and hands its first bytes to a TLS layer (the event
loop's own, the one its TLS servers use) whose decrypted bytes go through a sniffer of their own.

An OriginalConnection presents a JSON-lines connection to the server's logic as the websocket connection it
expects, so that registering, scoring, limits and faults are the same code for both protocols: send() takes the
project's frames (msgpack) and writes their original lines; the frames it yields are the client's lines, which
decode() turns into the project's messages (a register names the team by the client's address).
"""
import asyncio
import logging
import ssl
import time

from asyncio.sslproto import SSLProtocol

import msgpack
from websockets.asyncio.server import ServerConnection
from websockets.frames import Opcode
from websockets.exceptions import ConnectionClosedError, ConnectionClosedOK

from client import original
from client.constants import NUM_FEATURES
from client.protocol import ProtocolError

log = logging.getLogger("server")
TEAM_PREFIX = "tcp-json:"  # of an original client's team, which only that client's host may register
# Whitespace a client may send before its first byte that tells the protocol (then it is handed to websockets,
# which answers a bad request).
_MAX_LEADING_WHITESPACE = 1024
# A UTF-8 byte order mark, which some writers put at the start of a stream (.NET's UTF8 StreamWriter): the JSON decoder
# skips it, so it does not make the first line HTTP either.
_BOM = b"\xef\xbb\xbf"
SLICE_BYTES = 1024  # of a websocket connection's bytes handed to websockets at a time (SlicedReading)
# Of an HTTP request's line and headers, read before it is parsed (PingLimitedConnection): a browser's with its
# cookies fits; websockets reads up to 128 header lines of 8 kB, ~1 MB held a socket for the handshake's 10 s
MAX_REQUEST_BYTES = 32 * 1024
REQUESTS_PER_LINE = 64  # of an original-protocol client's request lines (OriginalConnection.send)
PING_BURST, PINGS_PER_S = 10, 1.0  # a websocket connection's pings (websockets' keepalive sends one every 20 s)
# An original-protocol connection's close: its closing line written, and its last bytes sent, within this or it is
# aborted (a client that reads nothing)
CLOSE_TIMEOUT_S = 1.0


def team_name(address) -> str:
    """The team of an original client, which registers with no name: its host, so that a client of that host that
    connects again resumes its session (the runtime relies on it; the original client never reconnects)."""
    host = address[0] if isinstance(address, (tuple, list)) and address else "unknown"
    return f"{TEAM_PREFIX}{host}"


def sniffing_connections(on_original, first_bytes_timeout_s: float, sockets, tls: ssl.SSLContext | None = None):
    """websockets' create_connection: each connection first goes through a ProtocolSniffer. on_original(transport,
    socket_transport) -> the asyncio protocol that takes an original-protocol connection over; sockets
    (limits.OpenSockets) counts each connection from accept to close, unregistered until the server says otherwise,
    and refuses those past its address's rate of new sockets; tls: the server's TLS (its handshake timed out at
    first_bytes_timeout_s)."""

    def create_connection(*args, **kwargs):
        return ProtocolSniffer(lambda: PingLimitedConnection(*args, **kwargs), on_original, first_bytes_timeout_s,
                               sockets, tls)

    return create_connection


class ProtocolSniffer(asyncio.Protocol):
    """Holds a new connection's first bytes until they tell its protocol, then hands the connection over. A
    connection from an address that holds its limit of open sockets, or that opened its burst of new sockets and its
    rate since, is aborted at once, before a byte of it is read; one past the limit of unregistered sockets aborts
    the oldest (limits.OpenSockets).

    With `tls`, the socket's bytes are TLS's: counted so at accept, the connection is handed at its first bytes to a
    TLS layer whose decrypted bytes, once its handshake is done, go to a sniffer of their own (`socket_transport`:
    the accepted socket's transport, counted by this one), which chooses the protocol as above. asyncio's TLS server
    shows no connection before its handshake is done, so that a socket met the limits only then: one address could
    hold sockets in their handshakes by the thousand. (loop.start_tls at accept is no way round it: uvloop hands
    the protocol the ClientHello it then lacks, even with reading paused.)"""

    def __init__(self, make_websocket_connection, on_original, timeout_s, sockets, tls=None, socket_transport=None):
        self._make_websocket_connection = make_websocket_connection
        self._on_original = on_original
        self._timeout_s = timeout_s
        self._sockets = sockets  # None behind TLS: the socket is counted by the sniffer in front
        self._tls = tls
        self._socket_transport = socket_transport
        self._address = None  # counted in sockets until the connection closes
        self._buffer = bytearray()
        self._transport = None
        self._timer = None

    def connection_made(self, transport):
        self._transport = transport
        if self._sockets is not None:  # (behind TLS the socket is counted in front)
            self._socket_transport = transport
            peer = transport.get_extra_info("peername")
            address = peer[0] if isinstance(peer, (tuple, list)) and peer else "unknown"
            if not self._sockets.open(address, transport):
                transport.abort()
                return
            self._address = address
        # a connection that says nothing is closed, as websockets' open_timeout would
        self._timer = asyncio.get_running_loop().call_later(self._timeout_s, transport.abort)

    def data_received(self, data):
        if self._timer is None:  # aborted in connection_made
            return
        self._buffer += data
        if self._tls is not None:
            self._hand_to_tls()
            return
        head = self._buffer.lstrip()
        if _BOM.startswith(head) and len(self._buffer) <= _MAX_LEADING_WHITESPACE:
            return  # only whitespace so far, or part of a byte order mark
        head = head.removeprefix(_BOM)
        protocol = (self._on_original(self._transport, self._socket_transport) if head[:1] == b"{" else
                    SlicedReading(self._make_websocket_connection(), self._socket_transport))
        self._hand_over(protocol)
        protocol.data_received(bytes(self._buffer))

    def _hand_to_tls(self):
        """The connection to a TLS layer from its first bytes on (a client without TLS fails its handshake there),
        its handshake closed at the register timeout from accept."""
        loop = asyncio.get_running_loop()
        # what is left of the first bytes' timeout, not a timeout afresh: a byte sent just before it held the socket
        # mid-handshake twice as long as asyncio's TLS server did (its handshake timed from accept)
        handshake_timeout_s = max(self._timer.when() - loop.time(), 1e-3)
        behind = ProtocolSniffer(self._make_websocket_connection, self._on_original, self._timeout_s, None,
                                 socket_transport=self._transport)
        handshake = loop.create_future()
        # retrieved: a handshake that failed (a stranger's, a client without TLS) is closed already
        handshake.add_done_callback(lambda done: done.cancelled() or done.exception())
        protocol = _tls_layer(loop)(loop, behind, self._tls, handshake, server_side=True,
                                    ssl_handshake_timeout=handshake_timeout_s)
        self._hand_over(protocol)
        data = memoryview(self._buffer)
        while data:
            buffer = protocol.get_buffer(len(data))
            size = min(len(buffer), len(data))
            buffer[:size] = data[:size]
            protocol.buffer_updated(size)
            data = data[size:]

    def _hand_over(self, protocol):
        self._timer.cancel()
        self._count_until_lost(protocol)
        self._transport.set_protocol(protocol)
        protocol.connection_made(self._transport)

    def _count_until_lost(self, protocol):
        """The socket stays counted until the protocol it is handed to loses it."""
        address, transport, sockets, lost = self._address, self._transport, self._sockets, protocol.connection_lost
        if address is None:  # behind TLS: counted in front
            return
        self._address = None

        def connection_lost(exc):
            sockets.close(address, transport)
            lost(exc)

        protocol.connection_lost = connection_lost

    def eof_received(self):
        return False  # closed before it said anything: nothing to hand over

    def connection_lost(self, exc):
        if self._timer is not None:
            self._timer.cancel()
        if self._address is not None:
            self._sockets.close(self._address, self._transport)
            self._address = None


def _tls_layer(loop):
    """The TLS protocol of the loop's own TLS servers (uvloop's is written in C: -0.05 ms p50 at the event's load on
    an H200 against asyncio's, bench/LOG.md section 81), as a subclass: _count_until_lost sets connection_lost on an
    instance, which uvloop's C type does not allow."""
    base = SSLProtocol
    if type(loop).__module__.startswith("uvloop"):
        try:
            from uvloop.loop import SSLProtocol as base
        except ImportError:  # (not public in uvloop: asyncio's works on its loop too)
            pass
    return _TLS_LAYERS.setdefault(base, type("TLSLayer", (base,), {}))


_TLS_LAYERS = {}


class PingLimitedConnection(ServerConnection):
    """websockets answers each ping with a pong written at once, before the server's own code sees a frame, so no
    budget of the server's counted them: a stranger's pings from every socket it may open kept the event loop busy
    answering them. PING_BURST pings at once, then PINGS_PER_S; the connection that pings beyond is cut off. Its
    request's line and headers likewise: past MAX_REQUEST_BYTES before the request is parsed, it is aborted unread."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._pings, self._pings_counted_at = float(PING_BURST), time.monotonic()
        self._request_bytes = 0

    def data_received(self, data):
        if self.request is None:  # (SlicedReading hands a kilobyte at a time: the count is that close)
            self._request_bytes += len(data)
            if self._request_bytes > MAX_REQUEST_BYTES:
                self.transport.abort()
                return
        super().data_received(data)

    def limit_messages(self, max_bytes: int) -> None:
        """From now on read messages up to twice max_bytes, to be answered with an error over max_bytes, and close
        the connection (1009) at the header of a longer one, as serve()'s max_size does: a message is read whole
        before the server sees it, so before register a stranger's sockets each held up to 8 MB."""
        # websockets keeps the limit on its protocol object: max_message_size since 16, max_size before
        name = "max_message_size" if hasattr(self.protocol, "max_message_size") else "max_size"
        setattr(self.protocol, name, 2 * max_bytes)

    def hold_reading(self, seconds: float) -> None:
        """Read nothing more for `seconds` (SlicedReading.hold)."""
        self.transport.hold(seconds)

    @property
    def socket_transport(self):
        """The transport of the accepted socket, as limits.OpenSockets counts it."""
        return self.transport.socket_transport

    def process_event(self, event):
        if getattr(event, "opcode", None) is Opcode.PING:  # (the handshake's request is an event too)
            now = time.monotonic()
            self._pings = min(PING_BURST, self._pings + (now - self._pings_counted_at) * PINGS_PER_S) - 1
            self._pings_counted_at = now
            if self._pings < 0:
                self.transport.abort()
                return
        super().process_event(event)


class SlicedReading(asyncio.Protocol):
    """Hands a websocket connection's bytes to websockets SLICE_BYTES at a time, each slice in a turn of the event
    loop of its own, the socket not read meanwhile. websockets parses all that one read brings (up to 256 kB) in one
    go: 256 kB of 7-byte frames held the loop, every team's, 0.3 s, and as pings (each answered with a pong written
    at once) 1.5 s. The connection sees a transport whose reading it pauses and resumes as before."""

    def __init__(self, connection, socket_transport=None):
        self.connection = connection
        self._socket_transport = socket_transport  # the accepted socket's, where TLS is between (else the transport)
        self._pending = bytearray()
        self._next_slice = None  # the turn scheduled to hand the next slice
        self._paused_by_connection = False
        self._held = None  # hold()'s timer: nothing handed meanwhile
        self._reading_paused = False

    def connection_made(self, transport):
        self._transport = transport
        self.connection.connection_made(_PacedTransport(self, transport, self._socket_transport or transport))

    @property
    def _stopped(self):
        return self._paused_by_connection or self._held is not None

    def data_received(self, data):
        self._pending += data
        if self._next_slice is None and not self._stopped:
            self._hand_slice()
        self._pause_while_pending()

    def _hand_slice(self):
        self._next_slice = None
        piece = bytes(self._pending[:SLICE_BYTES])
        del self._pending[:SLICE_BYTES]
        self.connection.data_received(piece)
        if self._pending and not self._stopped and not self._transport.is_closing():
            self._next_slice = asyncio.get_running_loop().call_soon(self._hand_slice)
        self._pause_while_pending()

    def _pause_while_pending(self):
        paused = bool(self._pending) or self._stopped
        if paused != self._reading_paused and not self._transport.is_closing():
            self._reading_paused = paused
            (self._transport.pause_reading if paused else self._transport.resume_reading)()

    def pause_reading(self):
        self._paused_by_connection = True
        self._pause_while_pending()

    def resume_reading(self):
        self._paused_by_connection = False
        self._hand_next()

    def hold(self, seconds):
        """Hand the connection nothing for `seconds`, the socket not read meanwhile. While the server waits out a
        team's frame past its budget, websockets read on, 16 frames of up to 8 MB queued: 150 MB a connection."""
        if self._next_slice is not None:
            self._next_slice.cancel()
            self._next_slice = None
        if self._held is not None:
            self._held.cancel()
        self._held = asyncio.get_running_loop().call_later(seconds, self._release)
        self._pause_while_pending()

    def _release(self):
        self._held = None
        self._hand_next()

    def _hand_next(self):
        if self._pending and self._next_slice is None and not self._stopped:
            self._next_slice = asyncio.get_running_loop().call_soon(self._hand_slice)
        self._pause_while_pending()

    def eof_received(self):  # reading is paused while bytes are pending: none are left now
        return self.connection.eof_received()

    def pause_writing(self):
        self.connection.pause_writing()

    def resume_writing(self):
        self.connection.resume_writing()

    def connection_lost(self, exc):
        for handle in (self._next_slice, self._held):
            if handle is not None:
                handle.cancel()
        self.connection.connection_lost(exc)


class _PacedTransport:
    """The transport as SlicedReading's connection sees it: its own pauses of reading go through SlicedReading."""

    def __init__(self, reading, transport, socket_transport):
        self._reading, self._transport, self.socket_transport = reading, transport, socket_transport

    def pause_reading(self):
        self._reading.pause_reading()

    def resume_reading(self):
        self._reading.resume_reading()

    def hold(self, seconds):
        self._reading.hold(seconds)

    def __getattr__(self, name):
        return getattr(self._transport, name)


class _LineProtocol(asyncio.StreamReaderProtocol):
    """asyncio's, a connection lost to an error (a reset) ending the stream as a close does, as recv() takes it anyway:
    left on the protocol, nothing took the error, and the garbage collector reported it at ERROR with a traceback."""

    def connection_lost(self, exc):
        super().connection_lost(None if isinstance(exc, OSError) else exc)


class OriginalConnection:
    """One original-protocol client, seen by the server's logic as a websocket connection (see the module)."""

    def __init__(self, transport, max_line_bytes: int, socket_transport=None):
        # As websockets does with frames: a line up to twice the limit is read and answered with an error, a longer
        # one closes the connection.
        self._reader = asyncio.StreamReader(limit=2 * max_line_bytes)
        # the asyncio protocol that takes the transport over from the sniffer
        self.protocol = _LineProtocol(self._reader)
        self.transport = transport
        self.socket_transport = socket_transport or transport  # as limits.OpenSockets counts it (TLS between)
        self._writer = asyncio.StreamWriter(transport, self.protocol, self._reader, asyncio.get_running_loop())
        self.max_line_bytes = max_line_bytes
        self.remote_address = transport.get_extra_info("peername")
        self.team = team_name(self.remote_address)
        self._overrun = False
        self._closed = False  # by the server: recv() reads no more

    def limit_messages(self, max_bytes: int) -> None:
        """From now on answer a line over max_bytes with an error, and close the connection at one over twice that
        (PingLimitedConnection.limit_messages)."""
        self.max_line_bytes = max_bytes
        self._reader._limit = 2 * max_bytes  # asyncio's StreamReader reads its limit there at each readline

    def hold_reading(self, seconds: float) -> None:
        """Nothing to hold: its StreamReader reads at most 16 MB ahead (twice its limit), then pauses the socket."""

    # receiving ---------------------------------------------------------------------------------
    async def recv(self) -> bytes:
        """The client's next line; ConnectionClosed once it has closed."""
        if self._overrun:  # the line after an over-long one cannot be told from its tail
            await self.close(1009, "line too long")
            raise ConnectionClosedError(None, None)
        if self._closed:  # (superseded, say): what the client had sent before, up to 16 MB of lines, is nobody's
            raise ConnectionClosedOK(None, None)
        try:
            line = await self._reader.readline()
        except ValueError:
            self._overrun = True
            return b""  # decode() says what was wrong
        except OSError:
            line = b""
        if not line.endswith(b"\n"):  # closed (a last line without its newline is not a message)
            raise ConnectionClosedOK(None, None)
        return line

    async def __aiter__(self):
        while True:
            try:
                yield await self.recv()
            except (ConnectionClosedOK, ConnectionClosedError):
                return

    def decode(self, line: bytes) -> dict:
        """The project's message of a client's line; ProtocolError when it is not one."""
        if self._overrun:
            raise ProtocolError(f"line exceeds twice the limit of {self.max_line_bytes} bytes; closing the connection")
        if len(line) > self.max_line_bytes:
            raise ProtocolError(f"line of {len(line)} bytes exceeds the limit of {self.max_line_bytes} bytes")
        obj = original.decode_line(line)
        # the server's own kind, refused by its own name: from_original would make a complete one the project's end
        if obj["message_type"] == "stats_update":
            raise ProtocolError("a client does not send stats_update messages")
        return original.from_original(obj, team=self.team)

    # sending -----------------------------------------------------------------------------------
    async def send(self, frame: bytes) -> None:
        """Write the original line of a project frame (nothing for a message the original protocol has no kind
        for), requests REQUESTS_PER_LINE a line; ConnectionClosed when the connection is closed."""
        msg = msgpack.unpackb(frame, raw=False)
        if msg["type"] != "inference_request":
            obj = original.to_original(msg)
            if obj is not None:
                await self._write(original.encode_line(obj))
            return
        # JSON's decimal floats take ~90 us a request to write: 4,096 requests due at once (a reconnect's backlog) in
        # one line held the event loop, every team's, 0.4 s
        row_bytes = 4 * NUM_FEATURES
        for begin in range(0, len(msg["unique_ids"]), REQUESTS_PER_LINE):
            end = begin + REQUESTS_PER_LINE
            part = {**msg, "unique_ids": msg["unique_ids"][begin:end], "symbols": msg["symbols"][begin:end],
                    "features": msg["features"][begin * row_bytes:end * row_bytes]}
            await self._write(original.encode_line(original.to_original(part)))
            await asyncio.sleep(0)  # the other teams' work between lines (a write that fits the buffer never waits)

    async def _write(self, line: bytes):
        if self._writer.is_closing():
            raise ConnectionClosedError(None, None)
        self._writer.write(line)
        try:
            await self._writer.drain()
        except OSError:
            raise ConnectionClosedError(None, None) from None

    async def close(self, code: int = 1000, reason: str = "") -> None:
        """Say why in a closing error (what a websocket close frame says), then close."""
        if self._writer.is_closing():
            self._closed = True
            return
        try:
            await asyncio.wait_for(self._write(original.encode_line(original.closing(code, reason))), CLOSE_TIMEOUT_S)
        except ConnectionClosedError:
            pass
        except TimeoutError:  # a client that stopped reading
            self.transport.abort()
        # once its reason is out: set before, the connection's own loop stopped at once and closed it first, saying
        # "normal closure" instead (a server stopping mid-stream)
        self._closed = True
        self._writer.close()
        # a close waits for the last bytes to be sent: those of a client that reads nothing (below the transport's
        # high-water mark, so the write above did not wait) held the socket for good
        asyncio.get_running_loop().call_later(CLOSE_TIMEOUT_S, self.transport.abort)
        log.debug("closed original-protocol connection of %s (%s %s)", self.team, code, reason)

