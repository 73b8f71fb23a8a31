"""`python -m server` end to end: the issue's 'done when', played by the team client, plus CLI input checks."""
import asyncio
import json
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from client import protocol
from conftest import run_side_by_side
from server.__main__ import parse_args

ROOT = Path(__file__).resolve().parent.parent


# One intra-op thread, as conftest.py sets for this process: on a busy 2-core machine torch's threads only
# wait on each other over a tiny model (targets 30x slower measured).
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1"}


def start_server(args, log_path, **popen):
    """Start `python -m server` on a free port; returns (process, port) once it listens."""
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "server", "--port", "0", *args], cwd=ROOT, env=ONE_THREAD,
                            stdout=subprocess.PIPE, stderr=log, text=True, **popen)
    line = proc.stdout.readline()  # targets are computed before the server listens
    match = re.search(r"ws://127\.0\.0\.1:(\d+)", line)
    if not match:
        proc.kill()
        pytest.fail(f"server did not start: {line!r}; log: {Path(log_path).read_text()[-2000:]}")
    return proc, int(match.group(1))


async def send_garbage(port):
    """A second connection sending garbage must get `error` replies while the team plays."""
    async with connect(f"ws://127.0.0.1:{port}") as ws:
        replies = []
        for frame in (b"\x00garbage", "text", msgpack.packb({"type": "nope"})):
            await ws.send(frame)
            replies.append(protocol.decode(await asyncio.wait_for(ws.recv(), 10)))
        return replies


def readme_server_example():
    """The two commands of the README's scoring-server section: (server args, client args), as written."""
    section = (ROOT / "README.md").read_text().split("## The scoring server", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    server_line, client_line = [line.split("#")[0].split() for line in block.strip().splitlines()]
    assert server_line[:3] == ["python", "-m", "server"] and client_line[:2] == ["python", "team/example_model.py"]
    return server_line[3:], client_line[2:]


def replace_option(args, option, value):
    return [value if i and args[i - 1] == option else arg for i, arg in enumerate(args)]


def test_done_when_the_readme_example_scores_every_request(tmp_path):
    out = tmp_path / "out.json"
    server_args, client_args = readme_server_example()
    assert "--once" in server_args
    for option in ("--preset", "--seed"):  # the client plays with the server's weights
        assert server_args[server_args.index(option) + 1] == client_args[client_args.index(option) + 1]
    # as written, on a free port, and with a long timeout so that a loaded CI machine still answers in time
    server_args = replace_option(replace_option(server_args, "--port", "0"), "--json", str(out))
    proc, port = start_server([*server_args, "--timeout-s", "60", "--cache-dir", str(tmp_path / "cache")],
                              tmp_path / "server.log")
    try:
        team = subprocess.Popen([sys.executable, "team/example_model.py",
                                 *replace_option(client_args, "--port", str(port)), "--team", "NAME"],
                                cwd=ROOT, env=ONE_THREAD, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        replies = asyncio.run(send_garbage(port))
        _, team_err = team.communicate(timeout=300)
        assert team.returncode == 0, team_err[-2000:]
        table, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0
    assert "complete: the stream was played to the end: 400 of 400 requests answered in time" in team_err
    assert [r["type"] for r in replies] == ["error"] * 3
    summaries = json.loads(out.read_text())
    assert [s["team"] for s in summaries] == ["NAME"]
    summary = summaries[0]
    assert summary["requests"] == summary["responses"] == 400
    assert summary["missed"] == summary["errors"] == summary["duplicates"] == 0
    assert summary["accuracy"] == 1.0 and summary["pnl"] > 0 and summary["weights_match"] is True
    for key in ("p50", "p90", "p99", "mean", "max"):
        assert summary["latency_ms"][key] > 0
    assert summary["responses_per_s"] > 0
    assert re.search(r"^NAME\s+400\s+400\s+0\s+0\s+0\s+1\.0000.*finished\s+match$", table, re.M), table


@pytest.mark.parametrize("argv, message", [
    (["--rate", "0"], "argument --rate: must be a positive number, got '0'"),
    (["--rate", "1e-9"], "argument --rate: must be at least 0.001 requests/s (a stream's gaps are at most a day), "
                         "got '1e-9'"),
    (["--timeout-s", "-1"], "argument --timeout-s: must be a positive number, got '-1'"),  # not as timeout_s
    (["--symbols", "-2"], "argument --symbols: must be a positive integer, got '-2'"),
    (["--bad-token-delay-s", "-1"], "argument --bad-token-delay-s: must be a number of at least 0, got '-1'"),
    (["--port", "99999"], "argument --port: must be a port number in 0..65535, got '99999'"),
    (["--port", "-1"], "argument --port: must be a port number in 0..65535, got '-1'"),
    (["--json", "/no/such/folder/out.json"], "argument --json: no such folder: /no/such/folder"),
    (["--max-teams", "0"], "argument --max-teams: must be a positive integer, got '0'"),
    (["--max-unregistered-sockets", "0"], "argument --max-unregistered-sockets: must be a positive integer, got '0'"),
    (["--max-unregistered-sockets", "lots"],
     "argument --max-unregistered-sockets: must be a positive integer, got 'lots'"),
    (["--stream-seed", "-1"], "argument --stream-seed: must be a non-negative integer, got '-1'"),
    (["--token", "a", "--tokens", "README.md"], "not allowed with argument"),
    (["--host", "ws://127.0.0.1"], "argument --host: takes an address of this machine, not a url"),  # was a lookup
    (["--host", "127.0.0.1:80"], "argument --host: must be a host name or address"),
    (["--rate", "200", "--speed", "2"], "--speed scales the stream's own gaps; --rate replaces them"),  # was ignored
    (["--token", ""], "--token must not be empty"),  # it admitted every register with an empty token, unwarned
    (["--token", "t" * 300], "--token holds 300 characters; a register takes at most 256 (--max-field-chars)"),
    (["--weights", str(ROOT / "README.md"), "--seed", "3"], "not allowed with argument"),
    (["--requests", "many"], "argument --requests: must be a positive integer, got 'many'"),
    # not ignored: the file's requests were played, all of them
    (["--stream", "README.md", "--requests", "100"],
     "--requests: for a generated stream; --stream plays the file's own requests"),
    # said before the targets are computed, not when the server starts to listen
    (["--tls-cert", "README.md"], "--tls-cert README.md: no PEM certificate chain with its private key there"),
    (["--tls-key", "README.md"], "--tls-key needs --tls-cert"),
    (["--tls-cert", "/no/such/cert.pem"], "argument --tls-cert"),
])
def test_cli_rejects_bad_options(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


def test_a_stream_whose_own_gaps_play_for_hours_is_warned():
    from client.streams import Stream
    from server.__main__ import long_play_warning

    def warning(delay_ms, *argv):
        stream = Stream(["A"] * len(delay_ms), [[0.0] * 79] * len(delay_ms), delay_ms)
        return long_play_warning(parse_args(list(argv)), stream)
    # gaps of seconds or timestamps, each under a day: the server played them for days, silently
    assert warning([8.6e7] * 12) == ("warning: a team's play of the stream lasts 286.7 h at its own gaps (delay_ms); "
                                     "--rate or --speed plays it faster")
    assert warning([8.6e7] * 12, "--speed", "1000") is None
    assert warning([12.0] * 1000) is None
    assert "lasts 1.4 h at --rate" in warning([12.0] * 5000, "--rate", "1")


def test_cli_builds_config():
    assert parse_args(["--host", "[::1]"]).host == "::1"  # was looked up as a name, after a warning that it was public
    config = parse_args(["--preset", "small", "--seed", "5", "--rate", "50", "--once", "--json", "x.json"])
    assert (config.preset, config.seed, config.rate, config.once, config.json) == ("small", 5, 50.0, True, "x.json")
    assert config.atol == 1e-3 and config.timeout_s == 2.0 and config.host == "127.0.0.1"
    assert (config.symbols, config.requests, config.stream_seed) == (20, 1000, 1)
    assert config.limits.max_unregistered_sockets == 1024
    assert parse_args(["--max-unregistered-sockets", "64"]).limits.max_unregistered_sockets == 64


def test_ordinary_mistakes_are_one_line_errors(tmp_path):
    import torch

    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint")
    partial = tmp_path / "partial.pt"
    torch.save({"output_proj.weight": torch.zeros(4, 8)}, partial)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cases = [
            (["--weights", "missing.pt"], "argument --weights: no such file: missing.pt (see --help)"),
            (["--stream", "missing.npz"], "argument --stream: no such file: missing.npz (see --help)"),
            (["--preset", "huge"], "argument --preset: invalid choice: 'huge'"),
            (["--port", str(port)], f"cannot listen on 127.0.0.1:{port}: Address already in use; is another "
                                    f"server there? stop it or choose another --port"),
            (["--weights", str(garbage), "--port", "0"], f"cannot read checkpoint {garbage}"),
            (["--weights", str(partial), "--port", "0"],
             f"checkpoint {partial} does not match the tiny preset's model: "),
        ]
        runs = run_side_by_side([[sys.executable, "-m", "server", *args] for args, _ in cases], cwd=ROOT,
                                env=ONE_THREAD, timeout=120)
        for (code, stderr), (args, message) in zip(runs, cases):
            lines = stderr.strip().splitlines()
            assert code == 2, stderr
            assert "Traceback" not in stderr
            assert lines[-1].startswith(f"python -m server: error: {message}"), stderr
            assert all(line.startswith("loading preset") for line in lines[:-1]), stderr


# ------------------------------------------------------------------ issue 21: Ctrl-C, exposure, tokens file

# fastens-server as pip's wrapper runs it: the module imported, then run()
CONSOLE_SCRIPT = [sys.executable, "-c", "import sys; sys.argv[0] = '/venv/bin/fastens-server'; "
                  "from server.__main__ import run; sys.exit(run())"]


@pytest.mark.parametrize("command, prog", [([sys.executable, "-m", "server"], "python -m server"),
                                           (CONSOLE_SCRIPT, "fastens-server")])
def test_ctrl_c_stops_the_server_while_it_computes_the_targets(tmp_path, command, prog):
    # 100,000 requests over 2 symbols: a minute of targets on a CPU, nothing cached
    proc = subprocess.Popen([*command, "--port", "0", "--symbols", "2", "--requests", "100000",
                             "--cache-dir", str(tmp_path / "cache")], cwd=ROOT, env=ONE_THREAD,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stderr.readline().startswith("loading preset tiny")
    time.sleep(2)  # computing the targets now
    proc.send_signal(signal.SIGINT)
    started = time.monotonic()
    out, err = proc.communicate(timeout=60)
    assert time.monotonic() - started < 5 and proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == f"{prog}: interrupted" and "Traceback" not in err
    assert "listening" not in out


def test_ctrl_c_in_the_console_scripts_imports_is_one_line():
    # fastens-server imports server.__main__, torch and all, before it calls run(): Ctrl-C there was a traceback
    proc = subprocess.Popen([*CONSOLE_SCRIPT, "--port", "0"], cwd=ROOT, env=ONE_THREAD,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == "fastens-server: interrupted"
    assert "listening" not in out


def test_ctrl_c_stops_a_serving_server_with_the_table_so_far(tmp_path):
    out_json = tmp_path / "out.json"
    proc, port = start_server(["--symbols", "2", "--requests", "400", "--rate", "50", "--json", str(out_json),
                               "--cache-dir", str(tmp_path / "cache")], tmp_path / "server.log")

    async def play_a_little():
        async with connect(f"ws://127.0.0.1:{port}") as ws:
            await ws.send(protocol.encode(protocol.register("partial")))
            while protocol.decode(await asyncio.wait_for(ws.recv(), 10))["type"] != "inference_request":
                pass
            proc.send_signal(signal.SIGINT)  # while the team plays
            with pytest.raises(ConnectionClosed):
                while True:
                    await asyncio.wait_for(ws.recv(), 30)
            return ws.close_code
    close_code = asyncio.run(play_a_little())
    table, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130 and close_code == 1000
    assert re.search(r"^partial\s+\d+\s+0\s+", table, re.M), table
    assert [s["team"] for s in json.loads(out_json.read_text())] == ["partial"]


def test_strangers_idle_sockets_leave_a_team_room_under_a_low_soft_limit_of_open_files(tmp_path):
    """Every socket a stranger holds (64 an address, until its timeout) is a file descriptor: under a soft limit of
    1,024, the usual one, 16 addresses took them all, the server accepted nothing more (an error a second in its
    log) and no team could connect. The server raises its soft limit to the hard one. Here: a soft limit of 160,
    192 idle sockets from three addresses, then a team."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    proc, port = start_server(["--symbols", "2", "--requests", "40", "--cache-dir", str(tmp_path / "cache")],
                              tmp_path / "server.log",
                              preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (160, hard)))
    idle = [socket.create_connection(("127.0.0.1", port), source_address=(f"127.0.0.{20 + i // 64}", 0))
            for i in range(192)]

    async def register():
        async with connect(f"ws://127.0.0.1:{port}", open_timeout=5) as ws:
            await ws.send(protocol.encode(protocol.register("beside-idle-sockets")))
            return protocol.decode(await asyncio.wait_for(ws.recv(), 5))["type"]
    try:
        assert asyncio.run(register()) == "welcome"
    finally:
        for sock in idle:
            sock.close()
        proc.terminate()
        proc.wait(timeout=60)


def test_the_listening_line_gives_urls_a_browser_takes_for_an_ipv6_host_too():
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    proc = subprocess.Popen([sys.executable, "-m", "server", "--host", "::1", "--port", "0", "--symbols", "1",
                             "--requests", "1"], cwd=ROOT, env=ONE_THREAD, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    # it said ws://::1:PORT and http://::1:PORT/, which no browser or url parser takes
    port = re.search(r"ws://\[::1\]:(\d+) ", line).group(1)
    assert f"(leaderboard http://[::1]:{port}/;" in line and line.rstrip().endswith(f"tcp://[::1]:{port})"), line


def test_the_listening_line_gives_the_tls_urls_of_a_server_over_tls():
    from server.__main__ import listening_line

    line = listening_line("127.0.0.1", 8443, tls=True)
    assert line.startswith("scoring server listening on wss://127.0.0.1:8443 (leaderboard https://127.0.0.1:8443/;")
    assert line.endswith("over TCP and TLS, on the same port: tcp+tls://127.0.0.1:8443)")


def test_a_server_other_machines_reach_without_tokens_is_warned(tmp_path):
    with socket.socket() as taken:  # a port in use: the server stops right after its checks
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "server", "--host", "0.0.0.0", "--port", str(port)], cwd=ROOT,
                                env=ONE_THREAD, capture_output=True, text=True, timeout=120)
    first, last = result.stderr.strip().splitlines()
    assert first == (f"python -m server: warning: listening on 0.0.0.0 without --token or --tokens: anyone who reaches "
                     f"port {port} may register a team; give --tokens FILE (a token per team) to a server other "
                     f"machines can reach")
    assert last.startswith(f"python -m server: error: cannot listen on 0.0.0.0:{port}") and result.returncode == 2


def test_a_host_not_of_this_machine_is_refused_before_the_targets_naming_the_host():
    # with --port 0 it was found only after the targets, and either way blamed "another server" on the port
    result = subprocess.run([sys.executable, "-m", "server", "--host", "203.0.113.7", "--port", "0"], cwd=ROOT,
                            env=ONE_THREAD, capture_output=True, text=True, timeout=120)
    warning, error = result.stderr.strip().splitlines()
    assert warning.startswith("python -m server: warning: listening on 203.0.113.7") and result.returncode == 2
    assert error == ("python -m server: error: cannot listen on 203.0.113.7:0: Cannot assign requested address; "
                     "--host must be an address of this machine (0.0.0.0: all of them)")


@pytest.mark.parametrize("content, message", [
    ("{not json", "not JSON (Expecting property name enclosed in double quotes at line 1)"),
    ("[]", 'expected one non-empty JSON object {"team": "token", ...}'),
    ('{"alpha": ""}', "the token of team 'alpha' must be a non-empty string"),
    ('{"a\\nb": "t"}', "a team name is 1..64 printable characters"),
    ('{"alpha": "t1", "beta": "t2", "alpha": "t3"}', "team 'alpha' is given more than once"),
    ('{"alpha": "t1", "beta": "t1"}', "teams 'alpha' and 'beta' have the same token"),
])
def test_a_bad_tokens_file_is_one_line(tmp_path, content, message, capsys):
    path = tmp_path / "tokens.json"
    path.write_text(content)
    with pytest.raises(SystemExit):
        parse_args(["--tokens", str(path)])
    assert f"--tokens {path}: {message}" in capsys.readouterr().err


def test_a_tokens_file_that_is_not_utf8_is_one_line_naming_it(tmp_path, capsys):
    path = tmp_path / "tokens.json"
    path.write_bytes('{"équipe": "t"}'.encode("latin-1"))
    with pytest.raises(SystemExit):
        parse_args(["--tokens", str(path)])
    assert f"--tokens {path}: 'utf-8' codec can't decode" in capsys.readouterr().err
