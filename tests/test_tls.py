"""The scoring server and the team client over TLS (--tls-cert, --tls, --tls-ca): both protocols played end to end,
a certificate the client does not trust, a client without TLS at a server with it and the other way round, and
files that cannot serve. tests/data/tls holds a self-signed certificate for localhost and 127.0.0.1 (valid to 2126)
and its key, made for these tests alone."""
import asyncio
import ssl
import urllib.request
from pathlib import Path

import pytest

from client import runtime
from client.runtime import StreamingClient
from server import ScoringServer, ServerConfig
from test_original_protocol import Oracle, run, stand_in

TLS = Path(__file__).parent / "data" / "tls"
CERT, KEY = str(TLS / "cert.pem"), str(TLS / "key.pem")


def _play(url, config=None, **client_options):
    """The client's summary and the server's summaries, a stand-in stream played at url's scheme on a fresh server
    (TLS unless `config` says otherwise)."""
    stream, targets = stand_in(30)
    config = config or ServerConfig(tls_cert=CERT, tls_key=KEY)

    async def main():
        server = ScoringServer(config, stream=stream, targets=targets)
        port = await server.start()
        try:
            client = StreamingClient(Oracle(targets), url.format(port=port), "secure", leave_at_end=True,
                                     connect_timeout_s=1.0, **client_options)
            return await client.run(), server.summaries()
        finally:
            await server.stop()

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
    summary, _ = _play(f"{scheme}://127.0.0.1:{{port}}", ServerConfig(), tls_ca=CERT)
    plain = {"wss": "ws", "tcp+tls": "tcp"}[scheme]
    assert summary["outcome"] == runtime.WRONG_PROTOCOL
    assert "speaks without TLS" in summary["detail"] and f"{plain}://127.0.0.1:" in summary["detail"], \
        summary["detail"]


def test_the_leaderboard_is_served_over_https():
    stream, targets = stand_in(30)
    context = ssl.create_default_context(cafile=CERT)

    async def main():
        server = ScoringServer(ServerConfig(tls_cert=CERT, tls_key=KEY), stream=stream, targets=targets)
        port = await server.start()
        try:
            return await asyncio.to_thread(lambda: urllib.request.urlopen(f"https://127.0.0.1:{port}/scores.json",
                                                                          context=context, timeout=10).read())
        finally:
            await server.stop()

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


def test_sockets_stalled_in_their_tls_handshake_count_against_their_address_and_time_out():
    """Over asyncio's own TLS server a connection reached the server's limits only once its handshake was done: a
    stranger's sockets that never finished one were counted nowhere (its file descriptors, its new sockets' rate) and
    held until asyncio's 60 s handshake timeout, and each refused socket cost the loop a handshake. Now the socket
    is counted at accept, as without TLS: past 4 per connection it may register an address's new sockets are closed
    at once, unread; a stalled handshake is closed at the register timeout; another address plays meanwhile."""
    from server.limits import Limits

    stream, targets = stand_in(30)

    async def main():
        config = ServerConfig(tls_cert=CERT, tls_key=KEY, register_timeout_s=1.0,
                              limits=Limits(max_connections_per_address=2))
        server = ScoringServer(config, stream=stream, targets=targets)
        port = await server.start()
        try:
            stalled = [await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.9", 0))
                       for _ in range(9)]  # a TCP connection each, no ClientHello
            cut = await asyncio.wait_for(stalled[-1][0].read(), 5)  # the ninth: closed at once
            began = asyncio.get_running_loop().time()
            client = StreamingClient(Oracle(targets), f"wss://127.0.0.1:{port}", "secure", leave_at_end=True,
                                     tls_ca=CERT)
            summary = await client.run()
            timed_out = await asyncio.wait_for(stalled[0][0].read(), 5)  # held until the register timeout
            held_s = asyncio.get_running_loop().time() - began
            for _, writer in stalled:
                writer.close()
            return cut, summary, timed_out, held_s
        finally:
            await server.stop()

    cut, summary, timed_out, held_s = run(main())
    assert cut == b"" and timed_out == b"" and held_s < 5
    assert summary["outcome"] == runtime.COMPLETE and summary["responses"] == 30
