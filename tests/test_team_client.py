import json
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from client.engine.reference import ReferenceEngine
from client.model import load_model
from team.example_model import ExampleModel, parse_args
from test_server_cli import ONE_THREAD, start_server

REPO = Path(__file__).resolve().parent.parent
CLIENT = [sys.executable, str(REPO / "team" / "example_model.py")]
SERVER_WEIGHTS_SEED = "5"
# Status lines the client may print on stderr before it says how the session ended.
STATUS_LINES = ("--preset not given", "loading preset", "[reference engine] ", "[fast engine] ", "playing ws://",
                "requests ")


def test_process_batch_maps_ids_to_predictions_in_symbol_order():
    model = load_model("tiny", seed=2)[0]
    rng = np.random.default_rng(0)
    features = rng.standard_normal((2, 79)).astype(np.float32)
    out = ExampleModel(ReferenceEngine(model)).process_batch({"B": (7, features[0]), "A": (3, features[1])})
    assert out["unique_ids"] == [7, 3]
    np.testing.assert_array_equal(out["predictions"], ReferenceEngine(model).step(["B", "A"], features))
    empty = ExampleModel(ReferenceEngine(model)).process_batch({})
    assert empty["unique_ids"] == [] and empty["predictions"].shape == (0, 4)


def test_a_request_whose_features_are_not_finite_is_refused_alone_its_symbol_stepping_on_from_before_it():
    model = load_model("tiny", seed=2)[0]
    f = np.random.default_rng(1).standard_normal((3, 79)).astype(np.float32)
    bad = f[1].copy()
    bad[5] = np.nan
    out = ExampleModel(ReferenceEngine(model)).process_batch({"A": [(0, f[0]), (1, bad), (2, f[2])], "B": [(3, f[1])],
                                                              "C": [(4, np.full(79, np.inf, np.float32))]})
    assert out["unique_ids"] == [0, 2, 3] and set(out["errors"]) == {1, 4}
    assert "NaN or inf" in out["errors"][1]
    straight = ReferenceEngine(model)
    want = [straight.step(["A"], f[:1])[0], straight.step(["A"], f[2:])[0], straight.step(["B"], f[1:2])[0]]
    np.testing.assert_allclose(out["predictions"], np.stack(want), rtol=0, atol=1e-6)


def test_the_example_says_how_many_symbols_its_engines_step_holds():
    """The runtime forms a step at once when that many symbols wait with K requests each (team_api.step_symbols)."""
    from client import team_api
    from client.engine.fast import FastEngine

    model = load_model("tiny", seed=2)[0]
    fast = FastEngine(model, device="cpu", max_batch=6, capacity=8, progress=False)
    assert team_api.step_symbols(ExampleModel(fast)) == 6
    assert team_api.step_symbols(ExampleModel(ReferenceEngine(model))) is None  # no bound: never "full"
    assert team_api.step_symbols(object()) is None


def test_the_example_runs_its_steps_inline_only_where_the_engine_steps_in_the_background():
    """The runtime's default mode follows the engine: on the CPU the fast engine's submit computes the step, so the
    runtime keeps its threads; the reference engine, an object or a client without submit_batch never say
    otherwise (a GPU test checks the fast engine on CUDA)."""
    from client import team_api
    from client.engine.fast import FastEngine
    from client.runtime import StreamingClient

    model = load_model("tiny", seed=2)[0]
    on_cpu = ExampleModel(FastEngine(model, device="cpu", capacity=4, progress=False))
    assert on_cpu.engine.steps_in_background is False and not team_api.steps_in_background(on_cpu)
    assert not StreamingClient(on_cpu, "ws://x", "team").inline_steps
    assert not team_api.steps_in_background(ExampleModel(ReferenceEngine(model)))
    assert not team_api.steps_in_background(SimpleNamespace(steps_in_background=True))  # no submit_batch
    assert not team_api.steps_in_background(SimpleNamespace(submit_batch=print, steps_in_background="yes"))
    assert team_api.steps_in_background(SimpleNamespace(submit_batch=print, steps_in_background=True))


def test_a_team_that_changed_process_batch_is_not_stepped_inline_on_the_event_loop():
    """A subclass that changes process_batch (the one place a team changes) answers in submit_batch, its step
    computed there: run inline where the engine steps in the background (the fast engine on a GPU), each step held
    the event loop that receives and sends for its whole length."""
    from client import team_api
    from client.runtime import StreamingClient

    class Changed(ExampleModel):
        def process_batch(self, requests_by_symbol):
            return super().process_batch(requests_by_symbol)

    in_background = SimpleNamespace(steps_in_background=True)  # as the fast engine on a GPU says
    assert team_api.steps_in_background(ExampleModel(in_background))
    assert not team_api.steps_in_background(Changed(in_background))
    assert not StreamingClient(Changed(in_background), "ws://x", "team").inline_steps


def test_the_example_offers_prefetch_and_ready_only_where_states_move():
    """An engine that keeps every state on the GPU needs no prefetch (a thread woken per request) and no readiness
    asked while a step forms: the runtime then runs neither; with a host tier both are the engine's."""
    from client.engine.fast import FastEngine
    from client.runtime import StreamingClient

    model = load_model("tiny", seed=2)[0]
    fixed = ExampleModel(FastEngine(model, device="cpu", capacity=4, host_symbols=0, progress=False))
    runtime = StreamingClient(fixed, "ws://x", "team")
    assert not fixed.moves_states and runtime._prefetch is None and runtime._ready is None
    tiered = ExampleModel(engine := FastEngine(model, device="cpu", capacity=4, host_symbols=2, progress=False))
    runtime = StreamingClient(tiered, "ws://x", "team")
    runtime._prefetch(["A"])
    assert engine.table.symbols() == ["A"] and runtime._ready("A")
    assert not ExampleModel(ReferenceEngine(model)).moves_states  # its states never move
    # a team client that does not say keeps both
    team = type("Team", (), {"prefetch": lambda self, s: None, "ready": lambda self, s: True})()
    assert StreamingClient(team, "ws://x", "team")._prefetch is not None


def test_the_example_says_the_rows_its_engines_steps_run_at():
    """The runtime's step clock learns step times at the engine's captured rows (team_api.step_rows)."""
    from client import team_api
    from client.engine.fast import FastEngine
    from client.runtime import StreamingClient

    model = load_model("tiny", seed=2)[0]
    fast = FastEngine(model, device="cpu", max_batch=4, max_rows_per_symbol=8, capacity=8, progress=False)
    assert team_api.step_rows(ExampleModel(fast)) == (8, 16, 24, 32)  # 24: the midpoint of the two largest
    assert StreamingClient(ExampleModel(fast), "ws://x", "team")._clock.size(20, 4) == (24, 4)
    assert team_api.step_rows(ExampleModel(ReferenceEngine(model))) == ()
    for says in (None, 5, [8, "16"], [0, 8], [True]):  # a team client's attribute that is no list of rows
        assert team_api.step_rows(type("Team", (), {"step_rows": says})()) == ()


@pytest.mark.parametrize("argv, match", [
    (["--host", "127.0.0.1"], "--host needs --port"),
    (["--port", "9000"], "--port without --host"),
    # said before the model loads: later they were "Invalid IPv6 URL" and "... does not appear to be an IPv4 or IPv6
    # address", naming no option
    (["--host", "ws://127.0.0.1", "--port", "8765"], "argument --host: takes a host name or address, not a url, got "
                                                     "'ws://127.0.0.1': give the url's port with --port"),
    (["--host", "127.0.0.1:8765", "--port", "8765"], "argument --host: must be a host name or address, got "
                                                     "'127.0.0.1:8765': give the port with --port"),
    (["--host", "", "--port", "8765"], "argument --host: must be a host name or address, got ''"),
    (["--symbols", "0"], "must be positive"),
    (["--rate", "-5"], "argument --rate: must be a positive number, got '-5'"),
    (["--rate", "1e-9"], "argument --rate: must be at least 0.001 requests/s (a stream's gaps are at most a day), "
                         "got '1e-9'"),
    (["--engine", "slow"], "invalid choice"),
    (["--preset", "huge"], "invalid choice"),
    (["--protocol", "udp"], "invalid choice"),
    (["--protocol", "tcp-json", "--token", "t"], "the original protocol (tcp-json) has no field to carry it"),
    # options that were ignored without a word: a server at --host plays its own stream; tcp-json registers no name
    (["--host", "h", "--port", "9", "--requests", "200"], "--requests: for the embedded server (no --host)"),
    (["--host", "h", "--port", "9", "--symbols", "4", "--rate", "50"], "--symbols, --rate: for the embedded server"),
    (["--protocol", "tcp-json", "--team", "mine"], "--team: the original protocol (tcp-json) registers no name"),
    (["--tls"], "--tls, --tls-ca: for the server at --host (the embedded server speaks without TLS)"),
    (["--host", "h", "--port", "9", "--tls-ca", __file__], "--tls-ca: with --tls"),
    (["--journal-segment-mb", "8"], "--journal-segment-mb: with --journal"),
    (["--journal-segment-mb", "0"], "argument --journal-segment-mb: must be a positive number"),
    (["--host", "h", "--port", "9", "--tls", "--tls-ca", "/no/such/ca.pem"], "argument --tls-ca"),
])
def test_bad_options_exit_with_a_message(argv, match, usage_error):
    assert match in usage_error(parse_args, argv)


def test_the_team_name_and_the_embedded_stream_have_their_defaults():
    args = parse_args(["--protocol", "tcp-json"])
    assert (args.team, args.symbols, args.requests, args.rate) == ("example", 20, 1000, None)
    assert parse_args(["--host", "h", "--port", "9", "--team", "mine"]).team == "mine"


def test_an_ipv6_host_is_taken_with_or_without_its_brackets():
    assert parse_args(["--host", "[::1]", "--port", "9"]).host == parse_args(["--host", "::1", "--port", "9"]).host
    assert parse_args(["--host", "::1", "--port", "9"]).host == "::1"


def test_preset_default_is_announced(capsys):
    args = parse_args([])
    assert args.preset in ("full", "tiny")
    assert f"--preset not given: using {args.preset}" in capsys.readouterr().err


@pytest.mark.parametrize("argv, mode", [([], None), (["--inline-steps", "auto"], None),
                                         (["--inline-steps", "off"], False), (["--inline-steps", "off", "--device",
                                                                               "cpu"], False)])
def test_inline_steps_default_to_the_engines_word_and_can_be_turned_off(argv, mode):
    """auto (the default) leaves inline steps to the runtime, which asks the engine (client/team_api.py); off keeps
    the runtime's threads anywhere; on is refused off the fast engine on a GPU (the one-line mistakes below)."""
    from team.example_model import INLINE_STEPS

    assert INLINE_STEPS[parse_args(argv).inline_steps] is mode


ONE_A_SYMBOL = ("import numpy as np\n\n\nclass ExampleModel:\n    def __init__(self, engine):\n"
                "        self.engine = engine\n\n"
                "    def process_batch(self, requests_by_symbol):  # {symbol: (unique_id, features)}\n"
                "        ids = [uid for uid, _ in requests_by_symbol.values()]\n"
                "        return {'unique_ids': ids, 'predictions': np.zeros((len(ids), 4), np.float32)}\n")
OWN_PROCESS_BATCH = ("from team.example_model import ExampleModel as Example\n\n\nclass ExampleModel(Example):\n"
                     "    def process_batch(self, requests_by_symbol):\n"
                     "        return super().process_batch(requests_by_symbol)\n")
ON_A_GPU = ["--engine", "fast", "--device", "cuda"]  # what --inline-steps on needs of the engine (checked at start)


@pytest.mark.parametrize("team_file, argv, message", [
    (ONE_A_SYMBOL, ["--max-requests-per-symbol", "4"], "--max-requests-per-symbol 4: {file}'s ExampleModel takes one "
                                                       "request of a symbol a step (its requests_per_symbol, "
                                                       "client/team_api.py); leave the option out"),
    (ONE_A_SYMBOL, ["--inline-steps", "on", *ON_A_GPU], "--inline-steps on: {file}'s ExampleModel has no "
                                                        "submit_batch, so its steps cannot run in the background"),
    (OWN_PROCESS_BATCH, ["--inline-steps", *ON_A_GPU], "--inline-steps on: {file}'s ExampleModel has a process_batch "
                                                       "of its own, which the submit_batch it inherits computes on "
                                                       "the event loop that receives"),
], ids=["one-a-symbol-k", "one-a-symbol-inline", "own-process-batch-inline"])
def test_an_option_the_team_class_cannot_use_is_refused_not_ignored(team_file, argv, message, tmp_path,
                                                                     usage_error):
    """A --team-dir class taking one request of a symbol a step was given K above 1, or one whose steps cannot run
    in the background inline steps: accepted, and ignored (or held the event loop) without a word."""
    (tmp_path / "example_model.py").write_text(team_file)
    said = usage_error(parse_args, ["--preset", "tiny", "--team-dir", str(tmp_path), *argv])
    assert message.format(file=tmp_path / "example_model.py") in said and len(said.strip().splitlines()) == 1


def test_a_team_file_subclassing_the_example_is_refused_inline_steps_from_a_real_process(tmp_path):
    """Run as a script, this file is __main__ and the team file's base another copy of it (team.example_model)."""
    (tmp_path / "example_model.py").write_text(OWN_PROCESS_BATCH)
    result = subprocess.run([*CLIENT, "--preset", "tiny", "--team-dir", str(tmp_path), "--inline-steps", *ON_A_GPU],
                            cwd=REPO, env=ONE_THREAD, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "ExampleModel has a process_batch of its own" in result.stderr


def test_the_options_a_team_class_can_use_are_taken_and_the_default_k_is_the_measured_one(tmp_path):
    from client.constants import DEFAULT_REQUESTS_PER_SYMBOL

    (tmp_path / "example_model.py").write_text(ONE_A_SYMBOL)
    one = parse_args(["--preset", "tiny", "--team-dir", str(tmp_path)])
    assert one.team_class.__name__ == "ExampleModel" and one.team_class is not ExampleModel
    assert one.max_requests_per_symbol == DEFAULT_REQUESTS_PER_SYMBOL  # the runtime takes 1 for it, unsaid
    assert parse_args(["--preset", "tiny", "--team-dir", str(tmp_path), "--max-requests-per-symbol", "1",
                       "--inline-steps", "off"]).max_requests_per_symbol == 1
    original = str(REPO / "tests" / "original_team")  # the event's style: lists of requests a symbol
    assert parse_args(["--preset", "tiny", "--team-dir", original, "--max-requests-per-symbol", "4"]
                      ).max_requests_per_symbol == 4
    mine = parse_args(["--preset", "tiny", "--max-requests-per-symbol", "2", "--inline-steps", "on", *ON_A_GPU])
    assert mine.team_class is ExampleModel and mine.max_requests_per_symbol == 2 and mine.inline_steps == "on"


def last_line(stderr) -> str:
    """The line that says how the run ended: the last, after status lines only, and no traceback."""
    lines = stderr.strip().splitlines()
    assert "Traceback" not in stderr, stderr
    assert all(line.startswith(STATUS_LINES) or not line.strip() for line in lines[:-1]), stderr
    return lines[-1]


def test_embedded_server_plays_to_the_end(tmp_path):
    out = tmp_path / "e.json"
    result = subprocess.run([*CLIENT, "--preset", "tiny", "--symbols", "6", "--requests", "300", "--json", str(out)],
                            cwd=tmp_path, env=ONE_THREAD, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["requests"] == 300 and summary["responses"] == 300 and summary["missed"] == 0
    assert summary["accuracy"] == 1.0 and summary["outcome"] == "complete" and summary["weights_match"] is True
    assert set(summary["latency_ms"]) >= {"p50", "p90", "p99", "mean", "max"}
    assert summary["responses_per_s"] > 0 and summary["pnl"] > 0
    assert last_line(result.stderr) == ("team/example_model.py: complete: the stream was played to the end: "
                                        "300 of 300 requests answered in time")


# ------------------------------------------------------------------ a real server, in a process of its own

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`python -m server` without --once, with a token: every test plays it under a team of its own."""
    folder = tmp_path_factory.mktemp("server")
    proc, port = start_server(["--preset", "tiny", "--seed", SERVER_WEIGHTS_SEED, "--symbols", "4",
                               "--requests", "40", "--rate", "200", "--timeout-s", "60", "--token", "sesame",
                               "--cache-dir", str(folder / "cache")], folder / "server.log")
    yield port
    proc.terminate()
    proc.wait(timeout=60)


def play_client(port, *args, timeout=120):
    return subprocess.run([*CLIENT, "--host", "127.0.0.1", "--port", str(port), "--preset", "tiny",
                           "--engine", "reference", "--device", "cpu", *args],
                          cwd=REPO, env=ONE_THREAD, capture_output=True, text=True, timeout=timeout)


def test_client_leaves_when_the_server_says_the_stream_is_over(server):
    # the server runs on (no --once): the client must leave by itself, and say so with exit code 0
    result = play_client(server, "--seed", SERVER_WEIGHTS_SEED, "--token", "sesame", "--team", "finisher")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout)
    assert summary["outcome"] == "complete" and summary["responses"] == 40 and summary["accuracy"] == 1.0
    assert "playing ws://127.0.0.1:" in result.stderr and "(the same as this client's)" in result.stderr
    assert last_line(result.stderr).endswith("40 of 40 requests answered in time")


def test_wrong_token_is_refused_in_one_line(server):
    result = play_client(server, "--seed", SERVER_WEIGHTS_SEED, "--token", "nope", "--team", "intruder")
    assert result.returncode == 4
    assert json.loads(result.stdout)["outcome"] == "refused"
    assert last_line(result.stderr) == ("team/example_model.py: refused: the server refused this client "
                                        "(bad_token: register token missing or wrong); check --token and --team")
    assert "playing" not in result.stderr


def test_other_weights_are_refused_naming_both_fingerprints_unless_allowed(server):
    from client.model import load_model
    client_weights, server_weights = load_model("tiny", seed=0)[1], load_model("tiny", seed=5)[1]
    refused = play_client(server, "--token", "sesame", "--team", "seed-zero")  # the default seed, 0
    assert refused.returncode == 5
    line = last_line(refused.stderr)
    assert line.startswith("team/example_model.py: weights mismatch: the server plays preset tiny with weights "
                           f"{server_weights}, the client has preset tiny with weights {client_weights}; ")
    assert line.endswith("or pass --allow-weights-mismatch to play anyway")
    allowed = play_client(server, "--token", "sesame", "--team", "seed-zero-anyway", "--allow-weights-mismatch")
    assert allowed.returncode == 0, allowed.stderr[-3000:]
    summary = json.loads(allowed.stdout)
    assert summary["weights_match"] is False and summary["accuracy"] < 0.5
    assert "OTHER than this client's (played anyway: --allow-weights-mismatch)" in allowed.stderr


def test_a_client_started_before_its_server_waits_for_it_with_connect_timeout(cli_here):
    """--connect-timeout-s: the first connection retried until an event-style server (the original protocol)
    comes up 2 s later, which plays one request to the end."""
    import socketserver
    import threading

    from team.example_model import main

    class Handler(socketserver.StreamRequestHandler):
        def handle(self):
            self.rfile.readline()  # register
            self.wfile.write(json.dumps({"message_type": "inference_request", "unique_ids": [7],
                                         "symbols": ["SYM_000"], "features": [[0.5] * 79],
                                         "timestamp": time.time()}).encode() + b"\n")
            while (line := self.rfile.readline()) and json.loads(line)["message_type"] != "inference_response":
                pass
            self.wfile.write(b'{"message_type": "stats_update", "complete": true, "requests": 1}\n')
            self.rfile.read()

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nobody listens there yet
    servers = []

    def start_later():
        time.sleep(2.0)
        servers.append(socketserver.ThreadingTCPServer(("127.0.0.1", port), Handler))
        servers[0].serve_forever()

    threading.Thread(target=start_later, daemon=True).start()
    code, err = cli_here(main, "team/example_model.py",
                         ["--host", "127.0.0.1", "--port", str(port), "--protocol", "tcp-json", "--preset", "tiny",
                          "--engine", "reference", "--device", "cpu", "--connect-timeout-s", "30"])
    servers[0].shutdown()
    servers[0].server_close()
    assert code == 0, err[-2000:]
    assert err.strip().splitlines()[-1].startswith("team/example_model.py: complete: the stream was played")


def test_unreachable_server_fails_fast_in_one_line():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nobody listens there
    started = time.monotonic()
    result = play_client(port)
    assert result.returncode == 3
    assert time.monotonic() - started < 30  # the first connection gives up after 3 s (plus the start)
    assert json.loads(result.stdout)["outcome"] == "unreachable"
    line = last_line(result.stderr)
    assert line.startswith(f"team/example_model.py: unreachable: cannot reach ws://127.0.0.1:{port} within 3.")
    assert line.endswith("is the server running there? check --host and --port")


@pytest.mark.parametrize("protocol, scheme", [("tcp-json", "tcp"), ("websocket", "ws")])
def test_a_web_server_is_said_to_be_no_scoring_server_in_one_line(protocol, scheme, cli_here):
    """`python -m http.server` at --host/--port: over tcp-json the client gave up after 5 connections of bad lines,
    over the websocket protocol it said the server was unreachable; both after seconds and a wrong hint."""
    import http.server
    import threading

    from team.example_model import main

    class Pages(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Pages)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    port = web.server_address[1]
    try:
        code, err = cli_here(main, "team/example_model.py", ["--host", "127.0.0.1", "--port", str(port), "--protocol",
                                                             protocol, "--preset", "tiny", "--engine", "reference"])
    finally:
        web.shutdown()
        web.server_close()
    assert code == 2, err[-2000:]
    assert "bad message" not in err and "connection lost" not in err, err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"team/example_model.py: wrong protocol: the server at {scheme}://127.0.0.1:{port} is no "
                           f"scoring server: it answered ")
    assert line.endswith("'HTTP/1.0 200 OK' (a web server?); check --host and --port")


@pytest.fixture(scope="module")
def targets_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("targets")


def start_slow_server(tmp_path, targets_cache):
    """A stream long enough (30 s) to be interrupted or cut short."""
    return start_server(["--preset", "tiny", "--seed", SERVER_WEIGHTS_SEED, "--symbols", "2", "--requests", "600",
                         "--rate", "20", "--timeout-s", "60", "--cache-dir", str(targets_cache)],
                        tmp_path / "server.log")


def start_client_until_playing(port, *args):
    client = subprocess.Popen([*CLIENT, "--host", "127.0.0.1", "--port", str(port), "--preset", "tiny",
                               "--seed", SERVER_WEIGHTS_SEED, "--engine", "reference", "--device", "cpu", *args],
                              cwd=REPO, env=ONE_THREAD, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = []
    while not seen or not seen[-1].startswith("playing"):
        line = client.stderr.readline()
        assert line, f"client ended before playing: {''.join(seen)}"
        seen.append(line)
    time.sleep(1.0)  # some requests played
    return client, "".join(seen)


@pytest.mark.parametrize("signum, code, why", [(signal.SIGINT, 130, ""), (signal.SIGTERM, 143, "SIGTERM: ")],
                         ids=["ctrl_c", "sigterm"])
def test_a_signal_stops_cleanly_with_the_summary_so_far(tmp_path, targets_cache, signum, code, why):
    """Ctrl-C, and SIGTERM (a service manager's stop, `docker stop`: it killed the client at once, no summary, no
    --json), stop the client cleanly with the summary so far, saying which."""
    server_proc, port = start_slow_server(tmp_path, targets_cache)
    summary_file = tmp_path / "summary.json"
    try:
        client, before = start_client_until_playing(port, "--json", str(summary_file))
        client.send_signal(signum)
        out, err = client.communicate(timeout=60)
    finally:
        server_proc.kill()
    assert client.returncode == code, err
    summary = json.loads(out)
    assert summary["outcome"] == "interrupted" and 0 < summary["requests"] < 600
    assert json.loads(summary_file.read_text()) == summary
    assert last_line(before + err).startswith(f"team/example_model.py: interrupted: {why}stopped before the end of "
                                              "the stream: ")


def test_server_stopping_mid_stream_cuts_the_client_short(tmp_path, targets_cache):
    server_proc, port = start_slow_server(tmp_path, targets_cache)
    try:
        client, before = start_client_until_playing(port)
        server_proc.terminate()  # the server stops: it closes every connection, 1000 "server stopped"
        out, err = client.communicate(timeout=60)
    finally:
        server_proc.kill()
    assert client.returncode == 6, err
    assert json.loads(out)["outcome"] == "cut_short"
    line = last_line(before + err)
    assert line.startswith("team/example_model.py: cut short: the server closed the session (1000 server stopped) "
                           "before the end of the stream, after ")
    assert line.endswith(" of 600 requests answered; the summary above covers what was played")


@pytest.mark.parametrize("args, message", [
    (["--weights", "missing.pt"], "argument --weights: no such file: missing.pt"),
    (["--preset", "huge"], "argument --preset: invalid choice: 'huge'"),
    (["--host", "127.0.0.1"], "--host needs --port"),
    # checked before the model loads (issue 21): not after the stream, not after a register timeout
    (["--team", ""], "argument --team: a team name is 1..64 printable characters, got '' (0 characters)"),
    (["--team", "a\nb"], "argument --team: a team name is 1..64 printable characters, got 'a\\nb' (3 characters)"),
    (["--team", "x" * 65], "argument --team: a team name is 1..64 printable characters, got "),
    (["--host", "127.0.0.1", "--port", "-1"], "argument --port: must be a port number in 1..65535, got '-1'"),
    (["--json", "/no/such/folder/summary.json"], "argument --json: no such folder: /no/such/folder"),
    (["--seed", "-1"], "argument --seed: must be a non-negative integer, got '-1'"),
    (["--rate", "nan"], "argument --rate: must be a positive number, got 'nan'"),
    (["--preset", "tiny", "--device", "bogus"], "--device bogus: not a torch device; use cpu, cuda or cuda:N"),
    (["--preset", "tiny", "--team-dir", "/no/such/team"], "no team client at /no/such/team/example_model.py"),
    (["--preset", "tiny", "--host", "127.0.0.1", "--port", "1", "--tls", "--tls-ca", __file__],
     f"--tls-ca {__file__}: no PEM certificate there"),
    *[(argv, "--inline-steps needs --engine fast on one CUDA device: other engines compute a step in submit or "
             "wait for it, which would hold the event loop that receives")
      for argv in (["--inline-steps", "on", "--device", "cpu"], ["--inline-steps", "--device", "cpu"])],
])
def test_ordinary_mistakes_are_one_line(args, message, cli_here):
    """In this process, as the console script runs main (a real process's stderr: the next test)."""
    from team import example_model

    code, err = cli_here(example_model.main, example_model.PROG, args)
    assert code == 2
    assert err.strip() == f"team/example_model.py: error: {message}" + err.strip().split(message, 1)[1]
    assert len(err.strip().splitlines()) == 1


def test_a_team_dir_whose_example_model_takes_no_engine_is_one_line(tmp_path, cli_here):
    """A team file whose ExampleModel cannot be built with the engine (its __init__ takes none) is that file's
    mistake, as the evaluator says it: one line naming it, exit 2 (was an 'unexpected error', exit 1)."""
    from team import example_model

    (tmp_path / "example_model.py").write_text(
        "from client import BaseInferenceClient\n\n\nclass ExampleModel(BaseInferenceClient):\n"
        "    def __init__(self):\n        super().__init__()\n\n"
        "    def process_batch(self, requests_by_symbol):\n        pass\n")
    code, err = cli_here(example_model.main, example_model.PROG, ["--preset", "tiny", "--team-dir", str(tmp_path)])
    assert code == 2, err
    assert err.strip().splitlines()[-1] == (
        f"team/example_model.py: error: {tmp_path / 'example_model.py'}: ExampleModel(engine) failed: TypeError: "
        f"ExampleModel.__init__() takes 1 positional argument but 2 were given")


def test_a_mistake_is_one_line_from_a_real_process():
    result = subprocess.run([*CLIENT, "--preset", "tiny", "--seed", "-1"], cwd=REPO, env=ONE_THREAD,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.splitlines() == ["team/example_model.py: error: argument --seed: must be a non-negative "
                                          "integer, got '-1' (see --help)"]


# fastens-team as pip's wrapper runs it: the module imported, then run()
CONSOLE_SCRIPT = [sys.executable, "-c", "import sys; sys.argv[0] = '/venv/bin/fastens-team'; "
                  "from team.example_model import run; sys.exit(run())"]


@pytest.mark.parametrize("command, prog", [(CLIENT, "team/example_model.py"), (CONSOLE_SCRIPT, "fastens-team")])
def test_ctrl_c_while_starting_is_one_line(command, prog):
    # in the imports (torch), then once the model loads (on a fast host the client may be connecting by then: its
    # line then says how many requests it answered). The console script's was a traceback in the imports, and
    # named team/example_model.py once they were done.
    for interrupt_after in (lambda client: time.sleep(0.3),
                            lambda client: next(line for line in client.stderr if line.startswith("loading preset"))):
        client = subprocess.Popen([*command, "--host", "127.0.0.1", "--port", "9"], cwd=REPO, env=ONE_THREAD,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        interrupt_after(client)
        client.send_signal(signal.SIGINT)
        _, err = client.communicate(timeout=60)
        assert client.returncode == 130 and "Traceback" not in err, err
        assert err.strip().splitlines()[-1] in (f"{prog}: interrupted",
                                                f"{prog}: interrupted: stopped before the end of the "
                                                "stream: 0 requests answered in time")


def test_an_engine_option_the_reference_engine_cannot_honour_is_one_line():
    result = subprocess.run([*CLIENT, "--engine", "reference", "--state-dtype", "fp16"], cwd=REPO, env=ONE_THREAD,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == ("team/example_model.py: error: --state-dtype fp16 applies to the "
                                                      "fast engine; the reference engine keeps fp32 state")


def test_a_symbol_beyond_the_state_table_is_answered_with_an_error_alone():
    from client.engine.fast import FastEngine
    from client.model import load_model
    from team.example_model import ExampleModel

    model, _ = load_model("tiny", seed=0)
    client = ExampleModel(FastEngine(model, device="cpu", capacity=2, host_symbols=0, progress=False))
    row = np.zeros(79, np.float32)
    first = client.process_batch({"A": (1, row), "B": (2, row)})
    assert first["unique_ids"] == [1, 2] and not first["errors"]
    result = client.process_batch({"A": (3, row), "C": (4, row)})
    assert result["unique_ids"] == [3] and result["predictions"].shape == (1, 4)
    assert list(result["errors"]) == [4] and "no room for the state" in result["errors"][4]


def test_a_symbol_whose_room_a_prefetch_took_meanwhile_is_answered_with_an_error_alone():
    """The runtime's prefetch thread places a new symbol's state as its request arrives: one that takes the room
    unplaceable() counted, before the step is submitted, leaves that step's new symbol without room. It alone is
    answered with the error; the others step (the whole step was refused: each symbol lost a request)."""
    from client.engine.fast import FastEngine

    model, _ = load_model("tiny", seed=0)
    engine = FastEngine(model, device="cpu", capacity=2, host_symbols=1, reserve=0, progress=False)
    client, row = ExampleModel(engine), np.zeros(79, np.float32)
    client.process_batch({"A": [(1, row)], "D": [(2, row)]})
    client.process_batch({"D": [(3, row)]})
    unplaceable = engine.unplaceable

    def then_c_arrives(symbols):  # room for one new symbol, which C's prefetch takes
        rejected = unplaceable(symbols)
        engine.prefetch(["C"])
        return rejected
    engine.unplaceable = then_c_arrives
    result = client.process_batch({"A": [(4, row), (5, row)], "B": [(6, row)]})
    del engine.unplaceable  # (a cycle through the engine otherwise: its copy threads would outlive the test)
    assert result["unique_ids"] == [4, 5] and result["predictions"].shape == (2, 4)
    assert list(result["errors"]) == [6] and "no room for the state of 1 symbol(s) (B)" in result["errors"][6]
    assert sorted(engine.symbols) == ["A", "C", "D"]
    alone = ExampleModel(ReferenceEngine(model, device="cpu"))
    for uid in (1, 4, 5):
        want = alone.process_batch({"A": [(uid, row)]})["predictions"]
    np.testing.assert_allclose(result["predictions"][1:], want, rtol=1e-4, atol=2e-5)


def test_a_new_stream_after_a_reconnect_is_played_from_fresh_states(cli_here):
    """An event-style server (the original protocol) restarted: after the reconnect its ids start over. The team
    client drops every state and plays the new stream from the start, its answers those of a fresh model."""
    import socketserver
    import threading

    from team.example_model import main

    rng = np.random.default_rng(0)
    old = [(0, "SYM_000", rng.standard_normal(79)), (1, "SYM_001", rng.standard_normal(79))]
    new = [(0, "SYM_001", rng.standard_normal(79)), (1, "SYM_000", rng.standard_normal(79))]
    rounds, sent_back = [old, new[:1], new], []

    class Handler(socketserver.StreamRequestHandler):
        def handle(self):
            answers = []
            sent_back.append(answers)
            self.rfile.readline()  # register
            for uid, symbol, row in rounds[min(len(sent_back), len(rounds)) - 1]:
                self.wfile.write(json.dumps({"message_type": "inference_request", "unique_ids": [uid],
                                             "symbols": [symbol], "features": [row.tolist()],
                                             "timestamp": time.time()}).encode() + b"\n")
                while (line := self.rfile.readline()) and json.loads(line)["message_type"] != "inference_response":
                    pass
                if not line:
                    return  # the client left
                answers.append(json.loads(line))
            if len(sent_back) == len(rounds):  # the new stream is over
                self.wfile.write(b'{"message_type": "stats_update", "complete": true, "requests": 2}\n')
                self.rfile.read()

    with socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        code, err = cli_here(main, "team/example_model.py",
                             ["--host", "127.0.0.1", "--port", str(server.server_address[1]), "--protocol",
                              "tcp-json", "--preset", "tiny", "--engine", "reference", "--device", "cpu"])
        server.shutdown()
    assert code == 0, err[-2000:]
    assert "which held another request before or was answered long ago: it began another stream" in err
    assert "states reset, playing the new stream" in err
    fresh = ReferenceEngine(load_model("tiny", seed=0)[0])
    want = {uid: fresh.step([symbol], row[None].astype(np.float32))[0] for uid, symbol, row in new}
    got = {m["unique_ids"][0]: np.array(m["predictions"][0]) for m in sent_back[2]}
    assert sorted(got) == [0, 1] and all(np.allclose(got[uid], want[uid], atol=1e-6) for uid in want)
    assert [len(answers) for answers in sent_back] == [2, 0, 2]


def test_a_new_stream_of_a_restarted_websocket_server_is_played_by_the_team_it_welcomed(cli_here):
    """A server of the project's protocol restarted with another stream: its welcome on the reconnect gave the team a
    new session key, and the fresh client that played the new stream registered without it: refused (team_taken,
    exit 4), the whole new stream missed."""
    import threading

    from websockets.exceptions import ConnectionClosed
    from websockets.sync.server import serve

    from client import protocol
    from team.example_model import main

    rng = np.random.default_rng(0)
    old = [(0, "SYM_000", rng.standard_normal(79)), (1, "SYM_001", rng.standard_normal(79))]
    new = [(0, "SYM_001", rng.standard_normal(79)), (1, "SYM_000", rng.standard_normal(79))]
    registers, sent_back = [], []

    def request(uid, symbol, row):
        return protocol.encode(protocol.inference_request([uid], [symbol], row[None], time.time()))

    def handler(ws):
        try:
            play(ws)
        except ConnectionClosed:  # the client left (the new stream's first connection)
            pass

    def play(ws):
        registers.append(protocol.decode(ws.recv()))
        restarted = len(registers) > 1
        if len(registers) == 3 and registers[-1].get("session_key") != "new":
            ws.send(protocol.encode(protocol.error("team_taken", "team 'example' is registered by another client")))
            ws.close(1008, "team_taken")
            return
        ws.send(protocol.encode(protocol.welcome(None, None, 2, 2, None, session_key="new" if restarted else "old")))
        answers = []
        sent_back.append(answers)
        for uid, symbol, row in (new[:1] if len(registers) == 2 else new) if restarted else old:
            ws.send(request(uid, symbol, row))
            while (msg := protocol.decode(ws.recv()))["type"] != "inference_response":
                pass
            answers.append(protocol.parse_inference_response(msg))
        if len(registers) == 1:
            ws.close(1011, "restarting")  # the old server goes
        else:
            ws.send(protocol.encode(protocol.end(2)))
            for _ in ws:  # until the client leaves
                pass

    with serve(handler, "127.0.0.1", 0) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        code, err = cli_here(main, "team/example_model.py",
                             ["--host", "127.0.0.1", "--port", str(server.socket.getsockname()[1]), "--preset", "tiny",
                              "--engine", "reference", "--device", "cpu"])
        server.shutdown()
    assert code == 0, err[-2000:]
    assert "states reset, playing the new stream" in err
    assert [r.get("session_key") for r in registers] == [None, "old", "new"]
    fresh = ReferenceEngine(load_model("tiny", seed=0)[0])
    want = {uid: fresh.step([symbol], row[None].astype(np.float32))[0] for uid, symbol, row in new}
    got = {ids[0]: predictions[0] for ids, predictions in sent_back[-1]}
    assert sorted(got) == [0, 1] and all(np.allclose(got[uid], want[uid], atol=1e-6) for uid in want)


@pytest.mark.parametrize("argv, timeout_s, said", [
    ([], 2.0, "answers count in time within 2 s, the project's server's timeout (the original protocol does not say "
              "the server's timeout; --timeout-s S to state it)"),
    (["--timeout-s", "5"], 5.0, "answers count in time within 5 s (--timeout-s: the original protocol does not say "
                                "the server's timeout)"),
])
def test_over_the_original_protocol_the_client_says_the_timeout_it_counts_answers_in_time_by(argv, timeout_s, said,
                                                                                              cli_here, tmp_path):
    """The original protocol has no welcome to say the server's timeout: the client counts an answer scored 3 s
    after its request in time only by a --timeout-s past it, and says which timeout it counts by."""
    import socketserver
    import threading

    from team.example_model import main

    class Handler(socketserver.StreamRequestHandler):
        def handle(self):
            self.rfile.readline()  # register
            self.wfile.write(json.dumps({"message_type": "inference_request", "unique_ids": [0], "symbols": ["SYM_000"],
                                         "features": [[0.0] * 79], "timestamp": time.time()}).encode() + b"\n")
            while (line := self.rfile.readline()) and json.loads(line)["message_type"] != "inference_response":
                pass
            self.wfile.write(b'{"message_type": "score_update", "unique_ids": [0], "trade_pnls": [0.5], '
                             b'"accuracies": [1.0], "latencies_ms": [3000.0]}\n'
                             b'{"message_type": "stats_update", "complete": true, "requests": 1}\n')
            self.rfile.read()

    out = tmp_path / "summary.json"
    with socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        code, err = cli_here(main, "team/example_model.py",
                             ["--host", "127.0.0.1", "--port", str(server.server_address[1]), "--protocol", "tcp-json",
                              "--preset", "tiny", "--engine", "reference", "--device", "cpu", "--json", str(out),
                              *argv])
        server.shutdown()
    assert code == 0, err[-2000:]
    assert said in err
    summary = json.loads(out.read_text())
    in_time = timeout_s > 3.0
    assert summary["timeout_s"] == timeout_s and summary["requests"] == 1
    assert (summary["responses"], summary["missed"]) == ((1, 0) if in_time else (0, 1))


def test_the_embedded_server_plays_with_the_timeout_the_client_counts_by(cli_here, tmp_path, monkeypatch):
    from team.example_model import main

    monkeypatch.setenv("FASTENS_CACHE", str(tmp_path))
    out = tmp_path / "summary.json"
    code, err = cli_here(main, "team/example_model.py", ["--preset", "tiny", "--engine", "reference", "--device", "cpu",
                                                         "--symbols", "2", "--requests", "4", "--timeout-s", "30",
                                                         "--json", str(out)])
    assert code == 0, err[-2000:]
    assert "answers count in time within the server's timeout, 30 s;" in err  # its welcome says the one it was given
    assert json.loads(out.read_text())["timeout_s"] == 30.0


def test_a_websocket_servers_own_timeout_wins_over_timeout_s():
    from team.example_model import _describe_timeout

    args = parse_args(["--host", "h", "--port", "9", "--timeout-s", "5"])
    assert _describe_timeout(args, {"timeout_s": 2.0}) == ("answers count in time within the server's timeout, 2 s "
                                                           "(--timeout-s 5 not used)")
    assert _describe_timeout(args, {}) == ("answers count in time within 5 s (--timeout-s: the server's welcome does "
                                           "not say its timeout)")


def test_with_a_journal_the_team_client_forgets_idle_symbols_not_its_engine(tmp_path):
    """--idle-timeout with --journal: the runtime has the team client forget idle symbols between steps, journaled
    (client/journal.py), and the engine forgets none of its own (the journal could not say where); a team class in
    the event's style through the adapter's release (its engine's), one of our style without release leaves it to
    the engine."""
    from client.original_team import BaseInferenceClient
    from team.example_model import _team_forgets_idle, build_engine

    journaled = parse_args(["--journal", str(tmp_path / "j"), "--idle-timeout", "5", "--preset", "tiny", "--engine",
                            "reference", "--device", "cpu"])
    assert _team_forgets_idle(journaled, ExampleModel)
    assert not _team_forgets_idle(parse_args(["--idle-timeout", "5"]), ExampleModel)
    assert not _team_forgets_idle(parse_args(["--journal", str(tmp_path / "j")]), ExampleModel)

    class EventStyle(BaseInferenceClient):
        def process_batch(self, requests):
            return []

    assert _team_forgets_idle(journaled, EventStyle)

    class CannotForget:
        def process_batch(self, requests):
            return {}

    assert not _team_forgets_idle(journaled, CannotForget)
    engine = build_engine(journaled, forgets_idle=False)[0]
    try:
        assert engine.describe()["idle_timeout_s"] is None
    finally:
        engine.close()


@pytest.mark.parametrize("segment", [[], ["--journal-segment-mb", "0.004"]], ids=["one-segment", "checkpointed"])
def test_a_client_killed_mid_session_replays_its_journal_and_answers_on_from_its_states(tmp_path, targets_cache,
                                                                                       segment):
    """kill -9 mid-session, then the same command again: the client replays its journal (every request it answered,
    in order) into fresh states, takes its session back with the journal's session key (no token here: a stranger
    would be refused the team) and answers the rest right, no request stepped twice. Without a journal a restarted
    client answered from fresh states (accuracy ~0.18 after, bench/LOG.md section 76). With segments of ~11
    requests, the engine's states are checkpointed as it plays, and the restart loads them and steps only what came
    after each."""
    from client.journal import Journal

    server_proc, port = start_server(["--preset", "tiny", "--seed", SERVER_WEIGHTS_SEED, "--symbols", "3",
                                      "--requests", "240", "--rate", "40", "--timeout-s", "60",
                                      "--cache-dir", str(targets_cache)], tmp_path / "server.log")
    journal = tmp_path / "journal"
    try:
        client, _ = start_client_until_playing(port, "--journal", str(journal), *segment)
        client.kill()  # SIGKILL: nothing flushed, no close
        client.communicate(timeout=30)
        journaled = [record for chunk in Journal(journal, {}).records() for record in chunk]
        assert 0 < len(journaled) < 240
        again = subprocess.run([*CLIENT, "--host", "127.0.0.1", "--port", str(port), "--preset", "tiny", "--seed",
                                SERVER_WEIGHTS_SEED, "--engine", "reference", "--device", "cpu", "--journal",
                                str(journal), *segment], cwd=REPO, env=ONE_THREAD, capture_output=True, text=True,
                               timeout=120)
    finally:
        server_proc.kill()
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"replaying the {len(journaled)} requests of 3 symbols in the journal" in again.stderr
    assert re.search(r"onto the checkpointed states of [123] symbols" if segment else "onto fresh states",
                     again.stderr)
    summary = json.loads(again.stdout)
    assert summary["outcome"] == "complete" and summary["responses"] > 0
    assert summary["accuracy"] == 1.0 and summary["errors"] == 0, summary
    # the old process's answers and the new one's: every request once, in one journal of the session
    assert sorted(uid for chunk in Journal(journal, {}).records() for uid, *_ in chunk) == list(range(240))
