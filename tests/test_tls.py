"""The scoring server and the team client over TLS (--tls-cert, --tls, --tls-ca): both protocols played end to end,
a certificate the client does not trust, a client without TLS at a server with it and the other way round, and
files that cannot serve. tests/data/tls holds a self-signed certificate for localhost and 127.0.0.1 (valid to 2126)
and its key, made for these tests alone."""
import asyncio
import contextlib
import ssl
import urllib.request
from pathlib import Path

import pytest

from client import runtime
from client.runtime import StreamingClient
from server import ScoringServer, ServerConfig
from server.limits import Limits
from test_original_protocol import Oracle, run, stand_in

TLS = Path(__file__).parent / "data" / "tls"
CERT, KEY = str(TLS / "cert.pem"), str(TLS / "key.pem")


@contextlib.asynccontextmanager
async def _serving(stream, targets, **config):
    """(server, port): a ScoringServer of `config` (over TLS unless it says tls_cert=None) playing stream, started,
    stopped at the end."""
    server = ScoringServer(ServerConfig(**{"tls_cert": CERT, "tls_key": KEY, **config}), stream=stream,
                           targets=targets)
    port = await server.start()
    try:
        yield server, port
    finally:
        await server.stop()


def _play(url, server_config=None, **client_options):
    """The client's summary and the server's summaries, a stand-in stream played at url's scheme on a fresh server
    (TLS unless `server_config` says otherwise)."""
    stream, targets = stand_in(30)

    async def main():
        async with _serving(stream, targets, **(server_config or {})) as (server, port):
            client = StreamingClient(Oracle(targets), url.format(port=port), "secure", leave_at_end=True,
                                     connect_timeout_s=1.0, **client_options)
            return await client.run(), server.summaries()

    return run(main(), timeout=60)


@pytest.mark.parametrize("scheme", ["wss", "tcp+tls"])
def test_a_team_plays_a_server_over_tls_in_both_protocols(scheme):
    summary, server_summaries = _play(f"{scheme}://127.0.0.1:{{port}}", tls_ca=CERT)
    assert summary["outcome"] == runtime.COMPLETE and summary["responses"] == 30 and summary["accuracy"] == 1.0
    assert [s["responses"] for s in server_summaries] == [30]


@pytest.mark.parametrize("scheme", ["wss", "tcp+tls"])
def test_a_certificate_the_client_does_not_trust_is_said_in_one_line_naming_tls_ca(scheme):
    summary, server_summaries = _play(f"{scheme}://127.0.0.1:{{port}}")  # the system's authorities: not signed
    assert summary["outcome"] == runtime.UNREACHABLE and server_summaries == []
    assert "the server's certificate is not trusted" in summary["detail"] and "--tls-ca" in summary["detail"]


@pytest.mark.parametrize("scheme, secure", [("ws", "wss"), ("tcp", "tcp+tls")])
def test_a_client_without_tls_at_a_server_with_it_is_told_to_use_tls(scheme, secure):
    summary, _ = _play(f"{scheme}://127.0.0.1:{{port}}")
    assert summary["outcome"] == runtime.WRONG_PROTOCOL
    assert "speaks TLS" in summary["detail"] and f"{secure}://127.0.0.1:" in summary["detail"], summary["detail"]


@pytest.mark.parametrize("scheme", ["wss", "tcp+tls"])
def test_a_client_with_tls_at_a_server_without_it_is_told_to_drop_tls(scheme):
    summary, _ = _play(f"{scheme}://127.0.0.1:{{port}}", dict(tls_cert=None, tls_key=None), tls_ca=CERT)
    plain = {"wss": "ws", "tcp+tls": "tcp"}[scheme]
    assert summary["outcome"] == runtime.WRONG_PROTOCOL
    assert "speaks without TLS" in summary["detail"] and f"{plain}://127.0.0.1:" in summary["detail"], \
        summary["detail"]


def test_the_leaderboard_is_served_over_https():
    stream, targets = stand_in(30)
    context = ssl.create_default_context(cafile=CERT)

    async def main():
        async with _serving(stream, targets) as (_, port):
            return await asyncio.to_thread(lambda: urllib.request.urlopen(f"https://127.0.0.1:{port}/scores.json",
                                                                          context=context, timeout=10).read())

    assert b'"teams"' in run(main())


def test_files_that_cannot_serve_tls_are_said_in_one_line(tmp_path):
    not_pem = tmp_path / "cert.pem"
    not_pem.write_text("no certificate here\n")
    for config, said in [(dict(tls_cert=str(not_pem)), "no PEM certificate chain with its private key there"),
                         (dict(tls_cert=CERT), "no PEM certificate chain with its private key there"),  # no key
                         (dict(tls_cert=str(tmp_path / "missing.pem")), "No such file"),
                         (dict(tls_key=KEY), "--tls-key needs --tls-cert")]:
        with pytest.raises(ValueError, match=said):
            ScoringServer(ServerConfig(**config))
    with pytest.raises(ValueError, match="--tls-ca .*no PEM certificate there"):
        StreamingClient(None, "wss://127.0.0.1:1", "x", tls_ca=str(not_pem))
    with pytest.raises(ValueError, match="--tls-ca applies to a server over TLS"):
        StreamingClient(None, "ws://127.0.0.1:1", "x", tls_ca=CERT)


def test_a_socket_stalled_in_its_tls_handshake_is_closed_at_the_register_timeout():
    """One that never sends its ClientHello was held for asyncio's 60 s handshake timeout. It is closed at the
    register timeout; a team plays meanwhile."""
    stream, targets = stand_in(30)

    async def main():
        async with _serving(stream, targets, register_timeout_s=1.0) as (_, port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)  # no ClientHello
            began = asyncio.get_running_loop().time()
            summary = await StreamingClient(Oracle(targets), f"wss://127.0.0.1:{port}", "secure", leave_at_end=True,
                                            tls_ca=CERT).run()
            closed = await asyncio.wait_for(reader.read(), 10)
            held_s = asyncio.get_running_loop().time() - began
            writer.close()
            return summary, closed, held_s

    summary, closed, held_s = run(main())
    assert summary["outcome"] == runtime.COMPLETE and closed == b"" and held_s < 5


CLIENT_HELLO_HEAD = b"\x16\x03\x01\x02\x00"  # a TLS record's header: a ClientHello of 512 bytes, never sent


async def _held_in_handshake(port, source):
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    writer.write(CLIENT_HELLO_HEAD)
    return reader, writer


async def _closed_within(reader, seconds) -> bool:
    try:
        return await asyncio.wait_for(reader.read(), seconds) == b""
    except asyncio.TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_a_tls_handshake_begun_just_before_the_register_timeout_is_closed_at_it():
    """The handshake is timed from accept, as asyncio's TLS server timed it: a first byte sent just before the
    register timeout gave the handshake a timeout afresh, the socket held mid-handshake for nearly twice as long."""
    stream, targets = stand_in(30)

    async def main():
        async with _serving(stream, targets, register_timeout_s=2.0) as (_, port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            began = asyncio.get_running_loop().time()
            await asyncio.sleep(1.5)
            writer.write(CLIENT_HELLO_HEAD)
            closed = await _closed_within(reader, 10)
            held_s = asyncio.get_running_loop().time() - began
            writer.close()
            return closed, held_s

    closed, held_s = run(main())
    assert closed and held_s < 2.75, held_s  # (3.5 s before)


def test_sockets_held_in_their_tls_handshakes_meet_the_per_address_limit_at_accept():
    """asyncio's TLS server shows the server a connection only once its handshake is done: one address could hold
    sockets in their handshakes by the thousand, past its limit of open sockets. Each is counted at accept now: past
    4 per websocket connection the address may register, its new sockets are closed at once; a team plays."""
    stream, targets = stand_in(30)

    async def main():
        async with _serving(stream, targets, limits=Limits(max_connections_per_address=2)) as (_, port):
            held = [await _held_in_handshake(port, "127.0.0.9") for _ in range(9)]
            cut = [await _closed_within(reader, 0.5 if i < 8 else 5) for i, (reader, _) in enumerate(held)]
            summary = await StreamingClient(Oracle(targets), f"wss://127.0.0.1:{port}", "secure", leave_at_end=True,
                                            tls_ca=CERT).run()
            for _, writer in held:
                writer.close()
            return cut, summary

    cut, summary = run(main())
    assert cut == 8 * [False] + [True]
    assert summary["outcome"] == runtime.COMPLETE and summary["accuracy"] == 1.0


def test_a_flood_of_tls_handshakes_from_many_addresses_closes_the_oldest_never_a_registered_team():
    """Past --max-unregistered-sockets a new socket closes the oldest no team registered, sockets in their TLS
    handshakes included; the teams registered over TLS, in both protocols, are never closed to make room."""
    cap = 8
    stream, targets = stand_in(60)

    async def main():
        async with _serving(stream, targets, rate=40.0, limits=Limits(max_unregistered_sockets=cap)) as (server, port):
            teams = [asyncio.create_task(StreamingClient(Oracle(targets), f"{scheme}://127.0.0.1:{port}", "secure",
                                                         leave_at_end=True, tls_ca=CERT).run())
                     for scheme in ("wss", "tcp+tls")]
            while len(server.summaries()) < 2:
                await asyncio.sleep(0.01)
            flood = [await _held_in_handshake(port, f"127.0.0.{21 + i % 4}") for i in range(2 * cap)]
            oldest = await asyncio.gather(*(_closed_within(reader, 5) for reader, _ in flood[:cap]))
            unregistered = server._sockets.unregistered
            summaries = await asyncio.gather(*teams)
            for _, writer in flood:
                writer.close()
            return oldest, unregistered, summaries, server.summaries()

    oldest, unregistered, summaries, server_summaries = run(main())
    assert oldest == cap * [True] and unregistered == cap
    assert [(s["outcome"], s["accuracy"]) for s in summaries] == 2 * [(runtime.COMPLETE, 1.0)]
    assert [(s["connections"], s["responses"], s["missed"]) for s in server_summaries] == 2 * [(1, 60, 0)]
