"""local_evaluator: scheduling order, batching, metrics, the CLI end to end, and bad input."""
import json
import sys

import numpy as np
import pytest

import local_evaluator as le
from client import cli
from client.streams import Stream, generate_stream, save_stream

TOWERS = ("xlstm", "mamba2", "retnet", "hawk")


class RecordingClient:
    """A stateful stand-in whose predictions depend on every earlier request of the symbol, so a
    reordered or skipped request shows up as an error; it also records each micro-batch."""

    def __init__(self):
        self.state = {}
        self.batches = []

    def process_batch(self, requests_by_symbol):
        ids, predictions = [], []
        for symbol, (uid, features) in requests_by_symbol.items():
            state = 0.5 * self.state.get(symbol, np.zeros(4)) + features[:4]
            self.state[symbol] = state
            ids.append(uid)
            predictions.append(state)
        self.batches.append(list(requests_by_symbol.items()))
        return {"unique_ids": ids, "predictions": np.array(predictions, dtype=np.float32)}


def sequential_targets(stream):
    """What RecordingClient must answer when each symbol's requests come in stream order."""
    state, targets = {}, []
    for symbol, features in zip(stream.symbols, stream.features):
        state[symbol] = 0.5 * state.get(symbol, np.zeros(4)) + features[:4]
        targets.append(state[symbol])
    return np.array(targets, dtype=np.float32)


def assert_order(client, stream):
    seen = {}
    for batch in client.batches:
        symbols = [symbol for symbol, _ in batch]
        assert len(set(symbols)) == len(symbols), "two requests of one symbol in a step"
        ids = [uid for _, (uid, _) in batch]
        assert ids == sorted(ids), "a batch is not oldest first"
        for symbol, (uid, features) in batch:
            assert stream.symbols[uid] == symbol
            np.testing.assert_array_equal(features, stream.features[uid])
            seen.setdefault(symbol, []).append(uid)
    for symbol, ids in seen.items():
        assert ids == sorted(ids), f"{symbol} saw its requests out of order"
    assert sorted(i for ids in seen.values() for i in ids) == list(range(len(stream)))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("batch_size", [None, 1, 7, 1000])
def test_random_interleavings_keep_each_symbols_order(seed, batch_size):
    rng = np.random.default_rng(seed)
    stream = generate_stream(int(rng.integers(1, 9)), int(rng.integers(1, 120)), seed,
                             rate=float(rng.choice([1e2, 1e5, 1e8])))
    client = RecordingClient()
    result = le.evaluate(client, stream, sequential_targets(stream), batch_size=batch_size)
    assert_order(client, stream)
    assert result["responses"] == result["requests"] == len(stream)
    assert (result["_series"]["latency_ms"] >= 0).all(), "a request was answered before it arrived"
    assert all(result["towers"][t]["within_atol"] == 1.0 for t in TOWERS)


def test_batch_size_groups_arrive_together_and_in_turn():
    stream = generate_stream(5, 40, seed=3)
    client = RecordingClient()
    result = le.evaluate(client, stream, sequential_targets(stream), batch_size=10)
    groups = [{uid // 10 for _, (uid, _) in batch} for batch in client.batches]
    assert all(len(group) == 1 for group in groups), "a step mixed two arrival groups"
    order = [min(group) for group in groups]
    assert order == sorted(order) and set(order) == {0, 1, 2, 3}
    # the first step of each group takes the oldest request of every symbol present in it
    first = client.batches[0]
    assert len(first) == len(set(stream.symbols[:10]))
    assert result["steps"] == len(client.batches)


def test_requests_far_apart_are_served_one_by_one():
    # gaps of 1000 s: each request arrives long after the previous one is answered
    stream = Stream(np.array(["A", "B", "A", "C"]), np.ones((4, 79), np.float32),
                    np.full(4, 1e6, np.float32))
    client = RecordingClient()
    result = le.evaluate(client, stream, sequential_targets(stream))
    assert [len(b) for b in client.batches] == [1, 1, 1, 1]
    assert result["latency_ms"]["p99"] < 1e6


def test_simultaneous_arrivals_fill_one_step_per_symbol():
    stream = Stream(np.array(["A", "A", "B", "A", "B"]), np.ones((5, 79), np.float32),
                    np.zeros(5, np.float32))
    client = RecordingClient()
    le.evaluate(client, stream, sequential_targets(stream))
    assert [[uid for _, (uid, _) in b] for b in client.batches] == [[0, 2], [1, 4], [3]]


def test_order_of_symbols_inside_a_step_does_not_matter():
    class ReversingClient(RecordingClient):
        def process_batch(self, requests_by_symbol):
            return super().process_batch(dict(reversed(list(requests_by_symbol.items()))))

    stream = Stream(np.array(["A", "B"] * 5), np.arange(790, dtype=np.float32).reshape(10, 79),
                    np.zeros(10, np.float32))
    result = le.evaluate(ReversingClient(), stream, sequential_targets(stream))
    assert all(result["towers"][t]["within_atol"] == 1.0 for t in TOWERS)


@pytest.mark.parametrize("response, message", [
    ({"unique_ids": [0], "predictions": np.zeros((1, 3))}, "shape"),
    ({"unique_ids": [], "predictions": np.zeros((0, 4))}, "missing ids [0]"),
    ({"unique_ids": [0, 0], "predictions": np.zeros((2, 4))}, "repeated ids [0]"),
    ({"unique_ids": [7], "predictions": np.zeros((1, 4))}, "missing ids [0], unexpected ids [7]"),
    ({"predictions": np.zeros((1, 4))}, "must return"),
    (None, "must return"),
    ({"unique_ids": [0], "predictions": np.zeros((1, 4)), "errors": {0: "why"}}, "repeated ids [0]"),
    ({"unique_ids": [], "predictions": np.zeros((0, 4)), "errors": {0: "no room"}},
     "unanswered; request 0: no room"),
])
def test_a_client_breaking_the_contract_gets_a_clear_error(response, message):
    class BadClient:
        def process_batch(self, requests_by_symbol):
            return response

    stream = Stream(np.array(["A"]), np.zeros((1, 79), np.float32), np.zeros(1, np.float32))
    with pytest.raises(le.EvaluationError, match=message.replace("[", r"\[").replace("]", r"\]")):
        le.evaluate(BadClient(), stream, np.zeros((1, 4), np.float32))


def test_targets_of_the_wrong_shape_are_refused():
    stream = Stream(np.array(["A"]), np.zeros((1, 79), np.float32), np.zeros(1, np.float32))
    with pytest.raises(le.EvaluationError, match="targets have shape"):
        le.evaluate(RecordingClient(), stream, np.zeros((2, 4), np.float32))


def test_tower_errors_values():
    from client.accuracy import tower_errors

    targets = np.zeros((4, 4), np.float32)
    targets[:, 1] = [1, -1, 1, -1]  # std 1
    predictions = targets.copy()
    predictions[0, 0] = 2e-3
    predictions[:, 1] += 0.5
    predictions[3, 3] = np.nan
    errors = tower_errors(predictions, targets, atol=1e-3)
    assert errors["xlstm"]["within_atol"] == 0.75
    assert errors["xlstm"]["max_abs_err"] == pytest.approx(2e-3)
    assert errors["xlstm"]["rel_rmse"] is None  # constant target
    assert errors["mamba2"]["rmse"] == pytest.approx(0.5)
    assert errors["mamba2"]["rel_rmse"] == pytest.approx(0.5)
    assert errors["mamba2"]["within_atol"] == 0.0
    assert errors["retnet"] == {"max_abs_err": 0.0, "mean_abs_err": 0.0, "rmse": 0.0,
                                "rel_rmse": None, "within_atol": 1.0, "nan_or_inf": 0}
    # a NaN prediction is wrong and counted; the error statistics are of the finite ones
    assert errors["hawk"]["within_atol"] == 0.75 and errors["hawk"]["nan_or_inf"] == 1
    assert errors["hawk"]["max_abs_err"] == 0.0



def test_the_report_never_shows_a_share_with_misses_as_all_within():
    """2 predictions of 100,000 off: rounded to nearest, the report read 1.0000 within atol."""
    targets = np.zeros((100_000, 4), np.float32)
    predictions = targets.copy()
    predictions[:2, 0] = 1.0
    result = {"requests": 100_000, "responses": 100_000, "steps": 1, "mean_batch": 1.0, "atol": 1e-3,
              "latency_ms": {"p50": 1.0, "p90": 1.0, "p99": 1.0, "mean": 1.0}, "throughput_rps": None,
              "towers": le.tower_errors(predictions, targets)}
    rows = le.format_report(result).splitlines()[3:]
    assert rows[0].split()[-2] == "0.9999" and rows[1].split()[-2] == "1.0000"


def test_rel_rmse_of_a_constant_or_nearly_constant_target_is_undefined():
    from client.accuracy import tower_errors

    targets = np.zeros((3, 4))
    targets[:, 0] = 0.1  # constant: its float64 std is 1.4e-17, not 0
    targets[:, 1] = 0.035 + np.array([0, 4e-8, -4e-8])  # an output settled to a few ulps (RetNet on zeros input)
    targets[:, 2] = [0.0, 2e-3, 4e-3]  # std 1.6e-3: past atol, a scale
    targets[:, 3] = [0.0, 1e-3, 2e-3]  # std 8.2e-4: within atol
    errors = tower_errors(targets + 5e-4, targets, atol=1e-3)
    assert errors["xlstm"]["rel_rmse"] is None and errors["mamba2"]["rel_rmse"] is None
    assert errors["hawk"]["rel_rmse"] is None
    assert errors["retnet"]["rel_rmse"] == pytest.approx(5e-4 / np.std([0.0, 2e-3, 4e-3]))  # errors within atol: < 1
    assert all(row["within_atol"] == 1.0 for row in errors.values())

# ----------------------------------------------------------------------------- CLI, real model

@pytest.fixture
def team_dir():
    """The real team client, as the evaluator finds it by default."""
    return le.DEFAULT_TEAM_DIR


def run_main(capsys, *argv):
    """The command line as `python local_evaluator.py ARGV` runs it, in this process."""
    rc = cli.run_cli(le.main, le.PROG, list(map(str, argv)))
    out, err = capsys.readouterr()
    return rc, out, err


def test_tiny_reference_run_writes_every_field(tmp_path, team_dir, capsys):
    out_json = tmp_path / "l.json"
    rc, out, err = run_main(capsys, "--preset", "tiny", "--engine", "reference", "--symbols", 3,
                            "--requests", 24, "--team-dir", team_dir, "--cache-dir", tmp_path / "cache",
                            "--json", out_json, "--device", "cpu")
    assert rc == 0, err
    summary = json.loads(out_json.read_text())
    assert summary["requests"] == summary["responses"] == 24
    assert set(summary["latency_ms"]) == {"p50", "p90", "p99", "mean"}
    assert summary["throughput_rps"] > 0
    assert summary["stream"]["num_symbols"] == 3 and len(summary["stream_fingerprint"]) == 64
    for tower in TOWERS:
        assert set(summary["towers"][tower]) == {"max_abs_err", "mean_abs_err", "rmse", "rel_rmse",
                                                 "within_atol", "nan_or_inf"}
        assert summary["towers"][tower]["within_atol"] == 1.0
    assert "within 0.001" in out and "hawk" in out
    assert err.splitlines()[-1].startswith("replay: 24/24 requests (100%), ")  # the replay's progress


def test_a_tower_with_no_finite_prediction_is_null_in_the_json(tmp_path, capsys):
    """Its statistics are NaN, which went into --json as NaN: no JSON (a strict reader, jq, refused the file)."""
    folder = tmp_path / "candidate"
    folder.mkdir()
    (folder / "example_model.py").write_text(
        "from team.example_model import ExampleModel as Base\n\n\n"
        "class ExampleModel(Base):\n"
        "    def process_batch(self, batch):\n"
        "        answer = Base.process_batch(self, batch)\n"
        "        answer['predictions'][:, 3] = float('nan')\n"
        "        return answer\n")
    out_json = tmp_path / "l.json"
    rc, _, err = run_main(capsys, "--symbols", 2, "--requests", 6, "--team-dir", folder, "--device", "cpu",
                          "--cache-dir", tmp_path / "cache", "--json", out_json)
    assert rc == 0, err
    summary = json.loads(out_json.read_text(), parse_constant=lambda name: pytest.fail(f"{name} in the JSON"))
    assert summary["towers"]["hawk"]["nan_or_inf"] == 6 and summary["towers"]["hawk"]["max_abs_err"] is None
    assert summary["towers"]["xlstm"]["within_atol"] == 1.0


ONE_A_SYMBOL = ("import numpy as np\n\n\nclass ExampleModel:\n    def __init__(self, engine):\n"
                "        self.engine = engine\n\n"
                "    def process_batch(self, requests_by_symbol):  # {symbol: (unique_id, features)}\n"
                "        ids = [uid for uid, _ in requests_by_symbol.values()]\n"
                "        return {'unique_ids': ids, 'predictions': np.zeros((len(ids), 4), np.float32)}\n")


def test_k_above_one_for_a_class_taking_one_request_a_symbol_is_refused_before_the_model_loads(tmp_path, capsys):
    """The replay gave such a class one request of a symbol a step whatever --max-requests-per-symbol said, unsaid
    (the team client refuses the option at parse)."""
    (tmp_path / "example_model.py").write_text(ONE_A_SYMBOL)
    rc, _, err = run_main(capsys, "--symbols", 2, "--requests", 6, "--team-dir", tmp_path, "--device", "cpu",
                          "--cache-dir", tmp_path / "cache", "--max-requests-per-symbol", 4)
    assert rc == cli.EXIT_USAGE
    assert err.strip().splitlines()[-1] == (
        f"{le.PROG}: error: --max-requests-per-symbol 4: {tmp_path / 'example_model.py'}'s ExampleModel takes one "
        f"request of a symbol a step (its requests_per_symbol, client/team_api.py); leave the option out")
    assert "reference targets" not in err  # said before the model and the targets
    # K 1, or none given, runs it: one request of a symbol a step
    rc, _, err = run_main(capsys, "--symbols", 2, "--requests", 6, "--team-dir", tmp_path, "--device", "cpu",
                          "--cache-dir", tmp_path / "cache", "--max-requests-per-symbol", 1)
    assert rc == 0, err


def test_replay_tells_after_each_step_how_many_requests_are_answered():
    answered = []
    stream = generate_stream(3, 30, seed=2)
    _, _, _, batch_sizes = le.replay(RecordingClient(), list(stream.symbols), stream.features, stream.delay_ms,
                                     after_step=answered.append)
    assert answered == np.cumsum(batch_sizes).tolist() and answered[-1] == 30


def test_profile_records_a_bounded_window_and_says_its_size(tmp_path, team_dir, capsys):
    def profile(steps):
        rc, out, err = run_main(capsys, "--symbols", 2, "--requests", 40, "--batch-size", 2,
                                "--team-dir", team_dir, "--cache-dir", tmp_path / "cache",
                                "--profile", tmp_path / f"prof{steps}", "--profile-steps", steps, "--device", "cpu")
        assert rc == 0, err
        assert f"profile: recording steps 2 to {steps + 1} of the replay (--profile-steps {steps})" in err
        size = (tmp_path / f"prof{steps}" / "trace.json").stat().st_size
        assert f"trace written to {tmp_path / f'prof{steps}' / 'trace.json'} ({cli.format_bytes(size)})" in out
        assert "top 15 by self_cpu_time_total" in out
        return size
    # 20 steps in the replay: the trace grows with the window, not with the replay
    assert 0 < profile(2) < 0.6 * profile(8)


@pytest.mark.parametrize("requests, held", [(1, "none of its steps"), (3, "only steps 2 to 3")])
def test_a_replay_shorter_than_the_profile_window_says_what_the_trace_holds(tmp_path, team_dir, capsys, requests,
                                                                              held):
    # groups of one request: one step each
    rc, _, err = run_main(capsys, "--symbols", 1, "--requests", requests, "--batch-size", 1, "--team-dir", team_dir,
                          "--cache-dir", tmp_path / "cache", "--profile", tmp_path / "prof", "--device", "cpu")
    assert rc == 0, err
    assert f"profile: the replay took {requests} step(s), so the trace holds {held}" in err


# ------------------------------------------------------------------------------------ bad input

def test_missing_stream_file(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        le.main(["--stream", str(tmp_path / "nope.npz")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == f"local_evaluator.py: error: argument --stream: no such file: " \
                                      f"{tmp_path / 'nope.npz'} (see --help)\n"


def test_parquet_without_pyarrow(tmp_path, team_dir, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # makes `import pyarrow` fail
    path = tmp_path / "s.parquet"
    path.write_bytes(b"PAR1")
    rc, _, err = run_main(capsys, "--stream", path, "--team-dir", team_dir)
    assert rc == 2 and "pip install pyarrow" in err


def test_nan_in_stream(tmp_path, team_dir, capsys):
    features = np.zeros((3, 79), np.float32)
    features[1, 5] = np.nan
    path = tmp_path / "nan.npz"
    np.savez(path, symbols=np.array(["A", "B", "A"]), features=features,
             delay_ms=np.zeros(3, np.float32))
    rc, _, err = run_main(capsys, "--stream", path, "--team-dir", team_dir)
    assert rc == 2 and "NaN" in err and "row 1" in err


def test_stream_without_requests(tmp_path, team_dir, capsys):
    path = tmp_path / "empty.npz"
    np.savez(path, symbols=np.array([], dtype=str), features=np.zeros((0, 79), np.float32),
             delay_ms=np.zeros(0, np.float32))
    rc, _, err = run_main(capsys, "--stream", path, "--team-dir", team_dir, "--cache-dir", tmp_path / "cache")
    assert rc == 2 and err.endswith(f"error: stream {path}: the stream has no requests\n"), err


def test_a_stream_of_more_symbols_than_the_engine_holds_is_refused_before_the_replay(tmp_path, team_dir, capsys):
    # the third symbol first comes last: the replay failed there, after the rest of a long stream was played
    path = tmp_path / "s.npz"
    save_stream(Stream(["A", "B"] * 20 + ["C"], np.zeros((41, 79), np.float32), np.ones(41, np.float32)), path)
    rc, _, err = run_main(capsys, "--stream", path, "--team-dir", team_dir, "--cache-dir", tmp_path / "cache",
                          "--device", "cpu", "--state-slots", 2)
    assert rc == 2 and "the stream has 3 symbols and the engine forgets none (no --idle-timeout): no room for the " \
                       "state of 1 symbol(s) (C): 2 on cpu and 0 in host memory" in err.splitlines()[-1], err


def test_stream_file_replays(tmp_path, team_dir, capsys):
    path = tmp_path / "s.npz"
    save_stream(generate_stream(2, 6, seed=1), path)
    rc, out, err = run_main(capsys, "--stream", path, "--team-dir", team_dir,
                            "--cache-dir", tmp_path / "cache", "--device", "cpu")
    assert rc == 0, err
    assert "requests 6  responses 6" in out


def test_an_original_parquet_stream_replays_and_a_bad_one_is_one_line(tmp_path, team_dir, capsys):
    # as pandas writes the original's files: an index column, a categorical symbol, int64 gaps, float64 features
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    from client.streams import FEATURE_COLUMNS
    stream = generate_stream(3, 8, seed=2)
    columns = {"__index_level_0__": np.arange(8) + 100}
    columns.update({name: stream.features[:, i].astype(np.float64) for i, name in enumerate(FEATURE_COLUMNS)})
    columns.update(symbol=pa.array(stream.symbols.tolist()).dictionary_encode(), delay_ms=np.full(8, 3))
    path = tmp_path / "original.parquet"
    pq.write_table(pa.table(columns), path)
    rc, out, err = run_main(capsys, "--stream", path, "--team-dir", team_dir,
                            "--cache-dir", tmp_path / "cache", "--device", "cpu")
    assert rc == 0, err
    assert "requests 8  responses 8" in out
    pq.write_table(pa.Table.from_arrays([*pa.table(columns).columns, pa.array(["x"] * 8)],
                                        names=[*columns, "symbol"]), path)
    rc, _, err = run_main(capsys, "--stream", path, "--team-dir", team_dir, "--device", "cpu")
    assert rc == 2 and err == f"local_evaluator.py: error: stream {path} has 2 columns named symbol\n", err


def test_plot_without_matplotlib(tmp_path, team_dir, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    rc, _, err = run_main(capsys, "--plot", tmp_path / "p.png", "--team-dir", team_dir)
    assert rc == 2 and "pip install matplotlib" in err


@pytest.mark.parametrize("option, message", [
    (["--compile"], "--compile applies to the fast engine"),
    (["--precision", "bf16"], "--precision xlstm bf16, mamba2 bf16, retnet bf16, hawk bf16 applies to the fast engine"),
    (["--gpus", "2"], "--gpus applies to the fast engine on CUDA GPUs"),
    (["--shards", "2"], "--ray-address and --shards apply with --cluster ray"),
])
def test_an_engine_option_that_does_not_apply_is_refused_before_the_model_loads(team_dir, capsys, option, message):
    """It was refused by make_engine, after the model had loaded and the targets were computed (minutes for full)."""
    rc, _, err = run_main(capsys, *option, "--team-dir", team_dir, "--symbols", 1, "--requests", 1, "--device", "cpu")
    assert rc == 2 and err.startswith(f"local_evaluator.py: error: {message}"), err
    assert len(err.splitlines()) == 1, err


@pytest.mark.parametrize("name", ["p.xyz", "p"])
def test_a_plot_path_matplotlib_does_not_write_is_refused_before_the_run(tmp_path, team_dir, capsys, name):
    """p.xyz failed after the whole run; p was written as p.png while the report said "plot written to p"."""
    pytest.importorskip("matplotlib")
    rc, _, err = run_main(capsys, "--plot", tmp_path / name, "--team-dir", team_dir, "--symbols", 1, "--requests", 2)
    assert rc == 2 and f"--plot {tmp_path / name}: name the file .png (or " in err and "replay:" not in err, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("source, message", [
    ("", "no team client at"),
    ("raise RuntimeError('boom')", "importing .* failed: RuntimeError: boom"),
    ("class ExampleModel:\n    pass\n", "no class ExampleModel with a process_batch"),
    ("class ExampleModel:\n    def __init__(self, engine):\n        raise RuntimeError('boom')\n"
     "    def process_batch(self, batch):\n        return {}\n",
     r"example_model.py: ExampleModel\(engine\) failed: RuntimeError: boom"),
])
def test_broken_team_client(tmp_path, capsys, source, message):
    folder = tmp_path / "candidate"
    folder.mkdir()
    if source:
        (folder / "example_model.py").write_text(source)
    rc, _, err = run_main(capsys, "--team-dir", folder, "--symbols", 1, "--requests", 1)
    assert rc == 2
    assert __import__("re").search(message, err), err


def test_a_team_file_with_a_dataclass_under_postponed_annotations_imports(tmp_path):
    # dataclasses look the module of a string annotation up in sys.modules: one imported without being put there
    # failed with AttributeError: 'NoneType' object has no attribute '__dict__'
    (tmp_path / "example_model.py").write_text(
        "from __future__ import annotations\nfrom dataclasses import dataclass\n\n\n@dataclass\nclass Stats:\n"
        "    calls: int = 0\n\n\nclass ExampleModel:\n    def process_batch(self, batch):\n"
        "        return Stats()\n")
    assert le.load_team_class(tmp_path)().process_batch({}).calls == 0


@pytest.mark.parametrize("argv, message", [
    (["--batch-size", "0"], "--batch-size: must be a positive integer"),
    (["--symbols", "-1"], "--symbols: must be a positive integer"),
    (["--atol", "0"], "--atol must be positive"),
    (["--preset", "huge"], "argument --preset: invalid choice: 'huge'"),
    (["--engine", "warp"], "argument --engine: invalid choice: 'warp'"),
    (["--profile-steps", "0"], "--profile-steps: must be a positive integer"),
    (["--profile-steps", "3"], "--profile-steps: for --profile DIR"),  # accepted, and nothing was recorded
    (["--rate", "50", "--batch-size", "4"], "--rate: sets the gaps between requests, which --batch-size ignores"),
    (["--seed", "-1"], "argument --seed: must be a non-negative integer, got '-1'"),
    # checked before the run, not when writing its results
    (["--json", "/no/such/folder/summary.json"], "argument --json: no such folder: /no/such/folder"),
    (["--rate", "-5"], "argument --rate: must be a positive number, got '-5'"),
    (["--rate", "1e-9"], "argument --rate: must be at least 0.001 requests/s (a stream's gaps are at most a day), "
                         "got '1e-9'"),
    # the engine's options: not "invalid <lambda> value: 'abc'"
    (["--state-slots", "abc"], "argument --state-slots: --state-slots must be a whole number of at least 1, got abc"),
    (["--max-requests-per-symbol", "2.5"], "--max-requests-per-symbol must be a whole number of at least 1, got 2.5"),
    (["--state-memory", "half"], "argument --state-memory: --state-memory is a share of free memory"),
    (["--idle-timeout", "soon"], "argument --idle-timeout: --idle-timeout must be a positive number of seconds"),
    # not ignored: the file's requests were replayed, all of them
    (["--stream", __file__, "--requests", "100", "--rate", "50"],
     "--requests, --rate: for a generated stream; --stream replays the file's own requests"),
])
def test_bad_options_exit_with_usage(usage_error, argv, message):
    assert message in usage_error(le.main, argv)


@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_an_output_over_the_stream_it_replays_is_refused(tmp_path, usage_error, option):
    """--json (or --plot) naming the --stream file wrote the summary over the stream, which was then gone."""
    path = tmp_path / "s.npz"
    save_stream(generate_stream(2, 5, seed=1), path)
    before = path.read_bytes()
    assert f"{option} {path} is the --stream file itself" in usage_error(le.main, ["--stream", str(path), option,
                                                                                   str(path)])
    assert path.read_bytes() == before


def test_a_profile_folder_that_is_a_file_is_refused_before_the_run(tmp_path, usage_error):
    (tmp_path / "trace").write_text("")
    assert f"--profile {tmp_path / 'trace'} is a file" in usage_error(le.main, ["--profile", str(tmp_path / "trace")])


def test_a_profile_folder_that_takes_no_file_is_refused_before_the_run(usage_error):
    # /proc takes no new folder, for root too
    assert "--profile /proc/prof: cannot write in it: " in usage_error(le.main, ["--profile", "/proc/prof"])


def test_plot_has_a_title_and_marks_p50_and_p99(tmp_path):
    pytest.importorskip("matplotlib")
    stream = generate_stream(3, 20, seed=2)
    result = le.evaluate(RecordingClient(), stream, sequential_targets(stream))
    title = le.plot_title(result, "tiny", "reference", "cpu")
    assert title.startswith("preset tiny, engine reference on cpu: 20 requests, p50 ")
    fig = le.figure(result, title)
    assert fig._suptitle.get_text() == title
    marks = {line.get_label(): line.get_xdata()[0] for line in fig.axes[0].lines}
    assert marks == {f"p50 {result['latency_ms']['p50']:.2f} ms": result["latency_ms"]["p50"],
                     f"p99 {result['latency_ms']['p99']:.2f} ms": result["latency_ms"]["p99"]}
    le.plot(result, tmp_path / "p.png", title)
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_profile_on_cuda_ranks_by_device_time(tmp_path, team_dir, capsys):
    rc, out, err = run_main(capsys, "--symbols", 2, "--requests", 4, "--team-dir", team_dir,
                            "--cache-dir", tmp_path / "cache", "--profile", tmp_path / "prof",
                            "--device", "cuda")
    assert rc == 0, err
    assert "top 15 by self_device_time_total" in out


@pytest.mark.parametrize("argv, message", [
    (["--preset", "huge"], "argument --preset: invalid choice: 'huge'"),
    (["--team-dir", "nowhere"], "no team client at nowhere/example_model.py"),
    (["--device", "bogus"], "--device bogus: not a torch device"),
])
def test_ordinary_mistakes_are_one_line(argv, message, cli_here):
    """In this process, as the console script runs main (a real process's stderr: the next test)."""
    code, err = cli_here(le.main, le.PROG, argv)
    lines = err.strip().splitlines()
    assert code == 2
    assert lines[-1].startswith(f"local_evaluator.py: error: {message}"), lines
    assert all(line.startswith("local_evaluator.py: ") for line in lines[:-1])


def test_a_mistake_is_one_line_from_a_real_process():
    import subprocess
    result = subprocess.run([sys.executable, str(le.REPO_ROOT / "local_evaluator.py"), "--stream", "missing.npz"],
                            cwd=le.REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.splitlines() == ["local_evaluator.py: error: argument --stream: no such file: missing.npz "
                                          "(see --help)"]
