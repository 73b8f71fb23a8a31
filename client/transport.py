"""How the runtime reaches a server: a transport connects and carries the project's messages over one wire format.

Two protocols, chosen by the server url's scheme:

- ``ws://host:port`` (``--protocol websocket``): the project's own, msgpack maps in binary websocket frames
  (client/protocol.py; client/websocket_transport.py, which alone imports websockets);
- ``tcp://host:port`` (``--protocol tcp-json``): the original event's, newline-delimited JSON over TCP
  (client/original.py), translated to and from the project's messages, so that the runtime's session logic is one.

Either over TLS: ``wss://`` and ``tcp+tls://`` (``--tls``), the server's certificate checked against the system's
authorities or a file of them (``--tls-ca``).

A Connection's frames go through ``decode(frame) -> message`` (a ProtocolError says what is wrong) and
``encode(message) -> frame`` (None: the protocol has no such message, nothing to send). Iterating a connection gives
the server's frames until it closes; ``close_code`` and ``close_reason`` then say why, as a websocket close frame
does. A server that speaks the other protocol raises ProtocolMismatch, whose message names the flag to pass; so
does one that speaks neither (a web server), whose message says so.
"""
import asyncio
import json
import ssl
from abc import ABC, abstractmethod
from urllib.parse import urlsplit

from client import original
from client.protocol import ProtocolError

PROTOCOLS = ("websocket", "tcp-json")
_SCHEME_OF = {("websocket", False): "ws", ("tcp-json", False): "tcp", ("websocket", True): "wss",
              ("tcp-json", True): "tcp+tls"}
_PROTOCOL_OF = {"ws": "websocket", "wss": "websocket", "tcp": "tcp-json", "tcp+tls": "tcp-json"}
_TLS_SCHEMES = ("wss", "tcp+tls")
PROBE_TIMEOUT_S = 1.0
# How long this client's close of a connection may take (a websocket's closing handshake, a tcp-json connection's
# buffered lines going out) before the connection is dropped: a server that read nothing held a close, and the
# client's stop, until a send had been stuck for the runtime's server_idle_s (15 s), or for good where nothing sent.
CLOSE_TIMEOUT_S = 1.0
# Lines an original-protocol connection hands the runtime before the event loop gets a turn: readline() returns a
# buffered line without one, and the runtime's step pump waits for the loop's next turn while a step is in flight
LINES_A_TURN = 64
# A websocket handshake, as a probe: a websocket server accepts it (101), another HTTP server answers it otherwise, and
# an original-protocol server answers its lines with error lines.
_HANDSHAKE_PROBE = (b"GET / HTTP/1.1\r\nHost: probe\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                    b"Sec-WebSocket-Key: cHJvYmVwcm9iZXByb2JlIQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")
# HTTP statuses that a websocket server may answer a handshake with for a while (busy, shutting down): no verdict
_PASSING_STATUSES = {408, 429, 500, 502, 503, 504}


class ConnectError(Exception):
    """The connection could not be made (refused, timed out, no valid answer); the message says why."""


class ConnectionClosed(Exception):
    """A send on a connection that is closed."""


class ProtocolMismatch(Exception):
    """The server speaks the other protocol, or neither (a web server); the message says which and what to do. Not
    `certain` where a server of both protocols whose connection dropped would be taken for it too."""

    certain = True


def server_url(protocol_name: str, host: str, port: int, tls: bool = False) -> str:
    if protocol_name not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol_name!r}; choose one of {', '.join(PROTOCOLS)}")
    host = f"[{host}]" if ":" in host else host
    return f"{_SCHEME_OF[protocol_name, tls]}://{host}:{port}"


def uses_tls(url: str) -> bool:
    return urlsplit(url).scheme in _TLS_SCHEMES


def client_tls(url: str, ca_file: str | None = None) -> ssl.SSLContext | None:
    """The TLS context of a connection to url (None for a url without TLS): the server's certificate checked against
    ca_file's authorities (PEM), or the system's; a file that holds none is a ValueError in one line."""
    if not uses_tls(url):
        if ca_file is not None:
            raise ValueError(f"--tls-ca applies to a server over TLS (wss://, tcp+tls://), not {url}")
        return None
    try:
        return ssl.create_default_context(cafile=ca_file)
    except ssl.SSLError as exc:  # (before OSError, which it is)
        raise ValueError(f"--tls-ca {ca_file}: no PEM certificate there ({exc.reason or exc})") from None
    except OSError as exc:
        raise ValueError(f"--tls-ca {ca_file}: {exc.strerror or exc}") from None


async def tls_failure(url: str, host: str, port: int, exc: OSError) -> Exception | None:
    """The error of a connection over TLS that failed (`exc`), in one line with what to do, where it says more than
    `exc`: a certificate not trusted, or a server that speaks without TLS (it answers a handshake without it)."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return ConnectError(f"the server's certificate is not trusted ({exc.verify_message}): give --tls-ca with the "
                            f"certificate, or the authority's, that signed it")
    speaks, _ = await speaks_what(host, port)
    if speaks in ("websocket", "tcp-json"):
        plain = url.replace("wss://", "ws://", 1).replace("tcp+tls://", "tcp://", 1)
        return ProtocolMismatch(f"the server at {url} speaks without TLS: play it as {plain} (no --tls)")
    return None


def protocol_of(url: str) -> str:
    """The protocol a server url names by its scheme; ValueError for any other url."""
    scheme = urlsplit(url).scheme
    if scheme not in _PROTOCOL_OF:
        raise ValueError(f"bad server url {url!r}: its scheme must be one of ws, wss (websocket) or tcp, tcp+tls "
                         f"(tcp-json)")
    return _PROTOCOL_OF[scheme]


def mismatch(url: str, speaks: str, answered: str = "") -> ProtocolMismatch:
    """The error for a server at url that speaks `speaks` (as speaks_what says); for "http", `answered` says what it
    answered to what."""
    if speaks == "http":
        return ProtocolMismatch(f"the server at {url} is no scoring server: it answered {answered} (a web server?); "
                                f"check --host and --port")
    if speaks == "tls":
        secure = url.replace("ws://", "wss://", 1).replace("tcp://", "tcp+tls://", 1)
        return ProtocolMismatch(f"the server at {url} speaks TLS: play it as {secure} (--tls)")
    described = {"tcp-json": "the original protocol (newline-delimited JSON over TCP)",
                 "websocket": "HTTP (the websocket protocol)"}[speaks]
    return ProtocolMismatch(f"the server at {url} answers in {described}; pass --protocol {speaks}")


class Connection(ABC):
    """One connection to a server, in one protocol (see the module)."""

    close_code: int | None = None
    close_reason: str = ""
    # (code, reason) of a close this client made itself because the server broke a rule or a limit (None: not so),
    # and the size limit in words, for the close code 1009 (message too big)
    client_close: tuple[int, str] | None = None
    too_big: str = "a message over this client's size limit"

    @abstractmethod
    def encode(self, msg: dict):
        """The frame of a project message, or None when this protocol has no such message."""

    @abstractmethod
    def decode(self, frame) -> dict:
        """The project message of a frame the server sent; ProtocolError when it is not one."""

    @abstractmethod
    async def send(self, frame) -> None:
        """Send one frame; ConnectionClosed when the connection is closed."""

    @abstractmethod
    def __aiter__(self):
        """The server's frames until the connection closes (ProtocolMismatch: the server speaks the other one)."""

    @abstractmethod
    async def close(self) -> None:
        """Close the connection (nothing when it is closed already)."""

    @abstractmethod
    def abort(self) -> None:
        """Drop the connection at once, without a closing handshake (a server that stopped answering)."""

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc_info):
        await close_within(self)


async def close_within(connection: Connection, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
    """Close `connection`, and drop it where the close is not done within timeout_s. The close is not cancelled (a
    tcp-json connection's close waits on its stream's one close waiter, which a cancelled wait cancels for every
    other waiter too): it ends once the connection is dropped."""
    closing = asyncio.ensure_future(connection.close())
    closing.add_done_callback(_retrieved)
    if not (await asyncio.wait({closing}, timeout=timeout_s))[0]:
        connection.abort()


def _retrieved(task: asyncio.Task) -> None:
    """A done callback that retrieves a task's exception: one never retrieved is logged as an error."""
    if not task.cancelled():
        task.exception()


async def connect(url: str, open_timeout: float, ws_compression: bool = False,
                  tls: ssl.SSLContext | None = None) -> Connection:
    """A connection to the server at url in the protocol its scheme names (ConnectError, ProtocolMismatch);
    ws_compression offers permessage-deflate on a websocket (off: client/websocket_transport.py says why); tls: the
    context of a url over TLS (client_tls(url): the system's authorities when None)."""
    if uses_tls(url) and tls is None:
        tls = client_tls(url)
    if protocol_of(url) == "websocket":
        from client.websocket_transport import connect_websocket  # websockets is imported for this protocol only

        return await connect_websocket(url, open_timeout, ws_compression, tls)
    return await TcpJsonConnection.open(url, open_timeout, tls)


async def first_bytes(host: str, port: int, send: bytes, timeout_s: float = PROBE_TIMEOUT_S,
                      tls: ssl.SSLContext | None = None) -> bytes:
    """What a server answers first to `send` on a fresh connection (b"" when it says nothing in time)."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port, ssl=tls), timeout_s)
    except (OSError, TimeoutError):  # (an ssl.SSLError is an OSError)
        return b""
    try:
        writer.write(send)
        return await asyncio.wait_for(reader.read(64), timeout_s)
    except (OSError, TimeoutError):
        return b""
    finally:
        writer.close()


def first_line(answer: bytes, limit: int = 80) -> str:
    """The first line of a server's answer, quoted, for a message (cut to about `limit` characters)."""
    text = next((line for line in answer.splitlines() if line.strip()), b"").decode("utf-8", "replace")
    return repr(text if len(text) <= limit else text[:limit] + "...")


async def speaks_what(host: str, port: int, tls: ssl.SSLContext | None = None) -> tuple[str | None, bytes]:
    """(what the server at host:port speaks, by its answer to a websocket handshake, over TLS with `tls`; that
    answer): "websocket" (it accepts one), "tcp-json" (JSON lines: it takes the handshake's lines for bad ones), "http"
    (another HTTP answer: no scoring server), "tls" (no answer without TLS, a TLS handshake: a server over TLS), or None
    (no answer in time, a busy or stopping server's, or anything else)."""
    answer = await first_bytes(host, port, _HANDSHAKE_PROBE, tls=tls)
    if not answer and tls is None and await speaks_tls(host, port):
        return "tls", answer
    if answer.lstrip().startswith(b"{"):
        return "tcp-json", answer
    status = answer.split(b" ", 2)[1:2] if answer.startswith(b"HTTP/") else []
    if not status or not status[0].isdigit():
        return None, answer
    if int(status[0]) == 101:
        return "websocket", answer
    return (None if int(status[0]) in _PASSING_STATUSES else "http"), answer


async def speaks_tls(host: str, port: int, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether the server at host:port completes a TLS handshake (a probe: its certificate is not looked at)."""
    probe = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    probe.check_hostname, probe.verify_mode = False, ssl.CERT_NONE
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port, ssl=probe), timeout_s)
    except (OSError, TimeoutError):
        return False
    writer.close()
    return True


def _is_json(line: bytes) -> bool:
    try:
        json.loads(line)
    except (ValueError, UnicodeDecodeError):
        return False
    except RecursionError:  # deep, but JSON: the decoder says what is wrong with it
        pass
    return True


class TcpJsonConnection(Connection):
    """The original protocol: JSON lines over TCP. Its frames are project messages already decoded (or the
    ProtocolError of a line that was not one), since a welcome is made up before the server's first message: the
    original protocol has none, and the runtime takes an error before it for a refusal."""

    too_big = f"a line over this client's limit of {original.MAX_LINE_BYTES / 2**20:g} MiB"

    def __init__(self, url, host, port, reader, writer, tls=None):
        self.url, self.host, self.port, self._tls = url, host, port, tls
        self._reader, self._writer = reader, writer
        self._lines_read = 0
        self._welcomed = False

    @classmethod
    async def open(cls, url: str, open_timeout: float, tls: ssl.SSLContext | None = None) -> "TcpJsonConnection":
        parts = urlsplit(url)
        if parts.hostname is None or parts.port is None:
            raise ValueError(f"bad server url {url!r}: it needs a host and a port, as tcp://host:port")
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(parts.hostname, parts.port, limit=original.MAX_LINE_BYTES, ssl=tls),
                open_timeout)
        except TimeoutError:
            raise ConnectError("timed out") from None
        except OSError as exc:  # (an ssl.SSLError is one)
            said = tls and await tls_failure(url, parts.hostname, parts.port, exc)
            raise said or ConnectError(exc.strerror or str(exc) or type(exc).__name__) from None
        return cls(url, parts.hostname, parts.port, reader, writer, tls)

    def encode(self, msg: dict):
        obj = original.to_original(msg)
        return None if obj is None else original.encode_line(obj)

    def decode(self, frame) -> dict:
        if isinstance(frame, ProtocolError):
            raise frame
        return frame

    async def send(self, frame: bytes) -> None:
        if self._writer.is_closing():
            raise ConnectionClosed("the connection is closed")
        self._writer.write(frame)
        try:
            await self._writer.drain()
        except OSError as exc:
            raise ConnectionClosed(str(exc)) from None

    async def __aiter__(self):
        unturned = 0  # lines read since the loop last had a turn here (a backlog of up to 2 x MAX_LINE_BYTES)
        while True:
            if unturned >= LINES_A_TURN:
                unturned = 0
                await asyncio.sleep(0)
            unturned += 1
            try:
                line = await self._reader.readline()
            except ValueError:  # a line over the limit: what follows cannot be trusted to start a line
                self.client_close = (1009, f"a line from the server exceeds {original.MAX_LINE_BYTES} bytes")
                yield ProtocolError(f"a line from the server exceeds {original.MAX_LINE_BYTES} bytes; "
                                    f"closing the connection")
                await self.close()
                return
            except OSError:
                line = b""
            if not line.endswith(b"\n"):  # the end of the connection (a last line cut short is lost with it)
                # A websocket server closes at once, without a word, on a line that is no HTTP request: ask it
                # one to tell it from a server that went away.
                if not self._lines_read:
                    speaks, answer = await speaks_what(self.host, self.port, self._tls)
                    if speaks in ("websocket", "http", "tls"):
                        exc = mismatch(self.url, speaks, f"the register by closing the connection, and a websocket "
                                                         f"handshake with {first_line(answer)}")
                        # a server of both protocols (this project's) accepts the handshake too: this connection may
                        # only have dropped (a reset, a first line cut short)
                        exc.certain = speaks in ("http", "tls")
                        raise exc
                return
            if not line.strip():
                continue
            # A first line that is no JSON (an HTTP status line, a page) is no server of this protocol: said at once,
            # where a later bad line is answered with an error and the session goes on, as the original client did.
            if not self._lines_read and not _is_json(line):
                exc = await self._not_original(line)
                if exc is not None:
                    raise exc
            self._lines_read += 1
            try:
                obj = original.decode_line(line)
                msg = original.from_original(obj)
            except ProtocolError as exc:
                yield exc
                continue
            if msg is None:
                continue
            if msg["type"] == "error" and msg["error"] == original.CLOSING:
                self.close_code, self.close_reason = original.parse_closing(msg["details"])
                continue
            if not self._welcomed and msg["type"] != "error":
                self._welcomed = True
                yield {"type": "welcome", "preset": None, "weights_fingerprint": None, "requests": None,
                       "symbols": None, "weights_match": None}
            yield msg

    async def _not_original(self, line: bytes) -> ProtocolMismatch | None:
        """The error for a server whose first line is no JSON: what it speaks, where a handshake tells; None where it
        speaks this protocol (it answers the handshake's lines in JSON lines), its first line a bad line like any."""
        speaks, answer = await speaks_what(self.host, self.port, self._tls)
        if speaks == "tcp-json":  # (told "pass --protocol tcp-json", the session ended at one bad line)
            return None
        if speaks is None:
            return ProtocolMismatch(f"the server at {self.url} does not speak the original protocol: it answered the "
                                    f"register with {first_line(line)}, which is no JSON; check --host and --port")
        return mismatch(self.url, speaks, f"the register with {first_line(line)}, and a websocket handshake with "
                                          f"{first_line(answer)}")

    async def close(self) -> None:
        if not self._writer.is_closing():
            self._writer.close()
        try:
            await self._writer.wait_closed()
        except OSError:
            pass

    def abort(self) -> None:
        self._writer.transport.abort()
