"""Issue 21, as strangers would try it: hostile clients against a real `python -m server` while the real team client
plays alongside (its exit code, accuracy and missed count must not move), and hostile servers against the real team
client. Each hostile client speaks from an address of its own (127.0.0.x), as a stranger on another machine would,
so that the limits it runs into are its own; the team clients play from 127.0.0.1."""
import asyncio
import collections
import concurrent.futures
import json
import socket
import subprocess
import threading
import time
import urllib.request

import pytest
from websockets.asyncio.client import connect
from websockets.asyncio.server import serve
from websockets.exceptions import ConnectionClosed, InvalidHandshake

from client import protocol
from test_team_client import CLIENT, REPO, SERVER_WEIGHTS_SEED, last_line
from test_server_cli import ONE_THREAD, start_server

TOKEN = "shared-by-every-team"  # the case: one token that every team (and so every stranger) knows
REQUESTS = 600                  # 3 s at 200 requests/s: the hostile clients act while the team plays
TIMEOUT_S = 10                  # the server's: wide, so that only an attack (not a busy CI machine) makes a miss


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One server for the module's hostile clients (each from its own address), every team client its own team."""
    folder = tmp_path_factory.mktemp("hostile")
    proc, port = start_server(["--preset", "tiny", "--seed", SERVER_WEIGHTS_SEED, "--symbols", "4", "--requests",
                               str(REQUESTS), "--rate", "200", "--timeout-s", str(TIMEOUT_S), "--token", TOKEN,
                               "--cache-dir", str(folder / "cache")], folder / "server.log")
    yield port
    proc.terminate()
    proc.wait(timeout=60)


class TeamClient:
    """The real team client (team/example_model.py) playing `team` on the module's server, started in the
    background; finish() waits for it and checks that it played the whole stream, every answer right and in time
    (the server's count of missed requests: the client counts with the default 2 s, not the server's TIMEOUT_S)."""

    def __init__(self, port, team, tmp_path, *args):
        self.port, self.team = port, team
        self.out = tmp_path / f"{team}.json"
        self.proc = subprocess.Popen([*CLIENT, "--host", "127.0.0.1", "--port", str(port), "--preset", "tiny",
                                      "--seed", SERVER_WEIGHTS_SEED, "--engine", "reference", "--device", "cpu",
                                      "--token", TOKEN, "--team", team, "--json", str(self.out), *args],
                                     cwd=REPO, env=ONE_THREAD, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True)
        self.before = []
        while not self.before or not self.before[-1].startswith("playing"):
            line = self.proc.stderr.readline()
            assert line, f"the team client ended before playing: {''.join(self.before)}"
            self.before.append(line)

    def finish(self) -> dict:
        _, err = self.proc.communicate(timeout=180)
        assert self.proc.returncode == 0, "".join(self.before) + err[-3000:]
        summary = json.loads(self.out.read_text())
        assert summary["outcome"] == "complete" and summary["requests"] == REQUESTS and summary["accuracy"] == 1.0
        row = team_row(self.port, self.team)
        assert row["responses"] == REQUESTS and row["missed"] == 0 and row["accuracy"] == 1.0, row
        return row


def scores(port) -> tuple[dict, float]:
    started = time.monotonic()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/scores.json", timeout=30) as response:
        data = json.loads(response.read())
    return data, time.monotonic() - started


def team_row(port, team) -> dict:
    return next(row for row in scores(port)[0]["teams"] if row["team"] == team)


async def attempt(port, register, source, answers):
    """One stranger's connection from `source`: register (if given), note the server's answer in `answers`."""
    opened = False
    try:
        async with connect(f"ws://127.0.0.1:{port}", local_addr=(source, 0), open_timeout=30,
                           max_size=None) as ws:
            opened = True
            if register is not None:
                try:
                    await ws.send(protocol.encode(register))
                except ConnectionClosed:
                    pass  # refused before it could say anything: the refusal still waits to be read
            try:
                msg = protocol.decode(await asyncio.wait_for(ws.recv(), 30))
            except ConnectionClosed as exc:  # 1009: a frame over the server's limit, closed at its header
                answers["message_too_big" if exc.rcvd is not None and exc.rcvd.code == 1009 else "closed"] += 1
                return
            answers[msg["type"] if msg["type"] == "welcome" else msg["error"]] += 1
    except AttributeError:
        # Python 3.11's socket transport, closed once a long write drained, leaves its loop unset without counting
        # itself lost, and websockets' abort on leaving then fails; the server's answer is already counted
        pass
    except InvalidHandshake:  # closed unread: the address holds its limit of open sockets
        answers["cut"] += 1
    except ConnectionClosed as exc:  # (uvloop's client says a socket closed unread so, where asyncio's says the above)
        answers["cut" if not opened else type(exc).__name__] += 1
    except (OSError, TimeoutError) as exc:
        answers[type(exc).__name__] += 1


# ------------------------------------------------------------------ hostile clients, the team client playing

def test_nobody_else_can_take_over_a_team_that_plays(server, tmp_path):
    good = TeamClient(server, "victim", tmp_path)

    async def impostor():  # the issue's: registers the team's name and answers every request with zeros
        async with connect(f"ws://127.0.0.1:{server}", local_addr=("127.0.0.2", 0)) as ws:
            await ws.send(protocol.encode(protocol.register("victim", token=TOKEN)))
            reply = protocol.decode(await asyncio.wait_for(ws.recv(), 30))
            with pytest.raises(ConnectionClosed):
                await asyncio.wait_for(ws.recv(), 30)
            return reply, ws.close_code
    reply, close_code = asyncio.run(impostor())
    # the real team client under the same name: refused at once, saying why, exit 4
    rival = subprocess.run([*CLIENT, "--host", "127.0.0.1", "--port", str(server), "--preset", "tiny", "--seed",
                            SERVER_WEIGHTS_SEED, "--engine", "reference", "--token", TOKEN, "--team", "victim"],
                           cwd=REPO, env=ONE_THREAD, capture_output=True, text=True, timeout=120)
    row = good.finish()
    assert reply["error"] == "team_taken" and close_code == 1008
    assert rival.returncode == 4 and json.loads(rival.stdout)["connections"] == 1
    assert last_line(rival.stderr) == (
        "team/example_model.py: refused: the server refused this client (team_taken: team 'victim' is registered "
        "by another client; only that client's reconnects (with the session key of its welcome) may play it: "
        "choose another --team); check --token and --team")
    assert row["errors"] == row["duplicates"] == 0  # nobody else answered in its name


def test_a_flood_of_registrations_is_refused_and_the_team_plays_on(server, tmp_path):
    good = TeamClient(server, "flooded", tmp_path)
    answers = collections.Counter()

    async def flood():  # the 500 registrations at once, new team names, the shared token
        page = asyncio.create_task(asyncio.to_thread(scores, server))
        await asyncio.gather(*(attempt(server, protocol.register(f"flood-{i}", token=TOKEN), "127.0.0.3", answers)
                               for i in range(500)))
        return await page
    started = time.monotonic()
    (data, page_s) = asyncio.run(flood())
    flood_s = time.monotonic() - started
    good.finish()
    flood_teams = [row["team"] for row in scores(server)[0]["teams"] if row["team"].startswith("flood-")]
    assert answers["welcome"] == len(flood_teams) <= 10 + 2 * flood_s + 1  # a burst of 10, then 2 a second
    # 16 connections open at once from one address, and 64 sockets: those beyond are closed unread
    assert answers["too_many_connections"] + answers["rate_limited"] + answers["cut"] == 500 - answers["welcome"]
    assert answers["cut"] <= 500 - 64, answers
    assert page_s < 2.5, f"/scores.json took {page_s:.1f} s during the flood"


def test_oversized_register_fields_are_refused_and_the_page_stays_small(server, tmp_path):
    good = TeamClient(server, "beside-big-fields", tmp_path)
    answers = collections.Counter()
    fingerprint = "f" * 3_900_000  # the 3.9 MB weights_fingerprint, 20 times

    async def big_fields():
        await asyncio.gather(*(attempt(server, protocol.register(f"big-{i}", token=TOKEN,
                                                                  weights_fingerprint=fingerprint),
                                       "127.0.0.4", answers) for i in range(20)))
    asyncio.run(big_fields())
    started = time.monotonic()
    with urllib.request.urlopen(f"http://127.0.0.1:{server}/", timeout=30) as response:
        page = response.read()
    page_s = time.monotonic() - started
    good.finish()
    # a frame before register over twice the longest register is not read: closed at its header (1009)
    refusals = answers["message_too_big"] + answers["rate_limited"] + answers["too_many_connections"]
    assert answers["message_too_big"] >= 1 and refusals == 20, answers
    assert len(page) < 100_000 and page_s < 2.5 and b"f" * 1000 not in page


def test_guessing_the_token_is_slow(server, tmp_path):
    good = TeamClient(server, "beside-guessers", tmp_path)
    answers = collections.Counter()

    async def guess():  # the 200 guesses, as fast as they go
        await asyncio.gather(*(attempt(server, protocol.register(f"guess-{i}", token=f"guess-{i}"), "127.0.0.5",
                                       answers) for i in range(200)))
    started = time.monotonic()
    asyncio.run(guess())
    took = time.monotonic() - started
    good.finish()
    # each guess checked is answered a second later, and one address gets 10 checks, then 2 a second
    assert 1 <= answers["bad_token"] <= 10 + 2 * took + 1 and took >= 1.0, answers
    assert answers["bad_token"] + answers["rate_limited"] + answers["too_many_connections"] + answers["cut"] == 200, \
        answers


def test_idle_sockets_from_many_addresses_close_the_oldest_and_the_team_plays_on(tmp_path):
    """Idle sockets from 16 addresses, 200 a second from before the team connects to after it finished: past
    --max-unregistered-sockets each new one closes the oldest that no team registered, never the team's."""
    cap = 64
    proc, port = start_server(["--preset", "tiny", "--seed", SERVER_WEIGHTS_SEED, "--symbols", "4", "--requests",
                               str(REQUESTS), "--rate", "200", "--timeout-s", str(TIMEOUT_S), "--token", TOKEN,
                               "--max-unregistered-sockets", str(cap), "--cache-dir", str(tmp_path / "cache")],
                              tmp_path / "server.log")
    stop, held = threading.Event(), collections.deque()

    def flood():
        opened = 0
        while not stop.is_set():
            held.append(socket.create_connection(("127.0.0.1", port), source_address=(f"127.0.0.{40 + opened % 16}",
                                                                                        0)))
            opened += 1
            if len(held) > 2 * cap:  # long closed by the server: the test's own file descriptors
                held.popleft().close()
            time.sleep(0.005)
        return opened

    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            flooding = pool.submit(flood)
            while len(held) < 2 * cap:
                time.sleep(0.05)
            good = TeamClient(port, "beside-a-botnet", tmp_path)
            good.finish()
            stop.set()
            opened = flooding.result()
        time.sleep(0.5)
        still_open = []
        for sock in held:
            sock.setblocking(False)
            try:
                still_open.append(sock.recv(1) != b"")
            except BlockingIOError:
                still_open.append(True)
            except ConnectionResetError:
                still_open.append(False)
    finally:
        stop.set()
        for sock in held:
            sock.close()
        proc.terminate()
        proc.wait(timeout=60)
    # the oldest closed, the newest open (fewer than the limit: the team's page loads counted too while open)
    assert opened > 4 * cap and still_open == sorted(still_open) and cap // 2 <= sum(still_open) <= cap, still_open
    warnings = [line for line in (tmp_path / "server.log").read_text().splitlines() if "unregistered" in line]
    assert warnings == [f"{cap} sockets open that no team registered, this server's limit "
                        f"(--max-unregistered-sockets): closing the oldest for each new one (a flood from many "
                        f"addresses?)"]


# ------------------------------------------------------------------ hostile servers, the real team client

async def play_against(handler, *args):
    """The real team client against an in-test server `handler`: (exit code, stdout, stderr)."""
    async with serve(handler, "127.0.0.1", 0) as hostile:
        port = hostile.sockets[0].getsockname()[1]
        proc = await asyncio.create_subprocess_exec(
            *CLIENT, "--host", "127.0.0.1", "--port", str(port), "--preset", "tiny", "--engine", "reference",
            *args, cwd=REPO, env=ONE_THREAD, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 120)
        return proc.returncode, out.decode(), err.decode()


def welcome():
    return protocol.encode(protocol.welcome("tiny", None, 100, 4, None, session_key="k"))


def test_a_server_that_breaks_every_connection_is_given_up_naming_the_limit():
    connections = []

    async def handler(ws):  # the issue's: a 500 MB frame on every connection
        connections.append(await ws.recv())
        await ws.send(welcome())
        ws.transport.write(bytes([0x82, 127]) + (500 * 2**20).to_bytes(8, "big"))
        await ws.wait_closed()

    code, out, err = asyncio.run(play_against(handler))
    assert code == 6 and json.loads(out)["outcome"] == "gave_up" and len(connections) == 5
    lost = [line for line in err.splitlines() if line.startswith("WARNING client.runtime: connection lost (it sent "
                                                                  "a frame over this client's limit of 4 MiB")]
    assert len(lost) == 4  # each retry said as it happens
    line = last_line("\n".join(line for line in err.splitlines() if line not in lost))
    assert line.startswith("team/example_model.py: gave up: the server failed the same way on 5 connections in a "
                           "row, with no new request between them: it sent a frame over this client's limit of 4 MiB "
                           "(1009: frame with 524288000 bytes exceeds limit of 4194304 bytes); "), line


def test_a_server_that_falls_silent_is_left_after_the_idle_limit():
    async def handler(ws):  # welcomes, then nothing: no request, no heartbeat, no end
        await ws.recv()
        await ws.send(welcome())
        await ws.wait_closed()

    started = time.monotonic()
    code, out, err = asyncio.run(play_against(handler, "--server-idle-s", "1"))
    assert code == 6 and json.loads(out)["outcome"] == "cut_short" and time.monotonic() - started < 60
    assert last_line(err).startswith("team/example_model.py: cut short: the server sent nothing for 1.0 s (not even a "
                                     "heartbeat) and never said the stream was over, after 0 of 100 requests "
                                     "answered (the limit: --server-idle-s 1)")
