"""The project's own protocol over websockets (client/protocol.py): the one module of the client that imports
websockets, so that a client playing the original protocol (tcp-json) runs without it."""
import ssl
from urllib.parse import urlsplit

from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI

from client import protocol
from client.transport import (ConnectError, Connection, ConnectionClosed as TransportClosed, first_line, mismatch,
                              speaks_what, tls_failure)


async def connect_websocket(url: str, open_timeout: float, compression: bool = False,
                            tls: ssl.SSLContext | None = None) -> "WebSocketConnection":
    try:
        # No permessage-deflate unless asked (websockets offers it by default; kept to measure against): msgpack'd
        # float32 features shrink by ~8% for ~30 us of the server's loop per one-row frame and ~0.8 ms per 64-row
        # frame (bench/LOG.md section 50).
        ws = await connect(url, max_size=protocol.MAX_FRAME_BYTES, open_timeout=open_timeout,
                           compression="deflate" if compression else None, **({"ssl": tls} if tls else {}))
    except InvalidURI as exc:
        raise ValueError(f"bad server url {url!r}: {exc}") from None
    except (InvalidHandshake, TimeoutError) as exc:
        # A server of the original protocol takes the handshake's lines for bad JSON and answers each with an
        # error line, which is no HTTP response, and a web server answers it with a page: ask it again to tell them
        # from a server that is only slow or busy. A server over TLS answers nothing without it.
        parts = urlsplit(url)
        speaks, answer = await speaks_what(parts.hostname, parts.port or (443 if tls else 80), tls)
        if speaks in ("tcp-json", "http", "tls"):
            raise mismatch(url, speaks, f"a websocket handshake with {first_line(answer)}") from None
        raise ConnectError(_reason(exc)) from None
    except OSError as exc:  # (an ssl.SSLError is one)
        parts = urlsplit(url)
        said = tls and await tls_failure(url, parts.hostname, parts.port or 443, exc)
        raise said or ConnectError(_reason(exc)) from None
    return WebSocketConnection(ws)


def _reason(exc) -> str:
    """What a failed connect says, without the noise of OSError's errno prefix."""
    if isinstance(exc, TimeoutError):
        return "timed out"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return " ".join(str(exc).split()) or type(exc).__name__


class WebSocketConnection(Connection):
    """Binary websocket frames, each one msgpack map."""

    too_big = f"a frame over this client's limit of {protocol.MAX_FRAME_BYTES / 2**20:g} MiB"

    def __init__(self, ws):
        self._ws = ws

    @property
    def client_close(self):
        sent, received = self._ws.protocol.close_sent, self._ws.protocol.close_rcvd
        return (sent.code, sent.reason) if sent is not None and received is None else None

    @property
    def close_code(self):
        return self._ws.close_code

    @property
    def close_reason(self):
        return self._ws.close_reason or ""

    def encode(self, msg: dict) -> bytes:
        return protocol.encode(msg)

    def decode(self, frame) -> dict:
        return protocol.decode(frame)

    async def send(self, frame: bytes) -> None:
        try:
            await self._ws.send(frame)
        except ConnectionClosed as exc:
            raise TransportClosed(str(exc)) from None

    async def __aiter__(self):
        try:
            async for frame in self._ws:
                yield frame
        except ConnectionClosed:
            return

    async def close(self) -> None:
        await self._ws.close()

    def abort(self) -> None:
        self._ws.transport.abort()
