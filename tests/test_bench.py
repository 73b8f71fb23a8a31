"""scripts/bench.py and its sections (scripts/benchmarks/): a CPU smoke run (tiny preset, --quick) leaves a complete
JSON; bad options are refused."""
import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from client.families import FAMILIES, LONG_FAMILY
from conftest import checkout_env


REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "scripts" / "bench.py"
TOWERS = ("xlstm", "mamba2", "retnet", "hawk")
BATCHES = ("1", "2", "4", "8", "16", "20", "32", "40", "64")


def _finite(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_under_test", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CPU_SECTIONS = ["copy", "step", "baseline", "accuracy", "precisions", "state_dtypes", "e2e", "floor", "maxrate",
                "churn", "capacity", "backlog", "swap", "gpus", "shards"]  # compile: tests/test_compile.py


def test_quick_cpu_run_writes_every_key(tmp_path):
    out = tmp_path / "out.json"
    done = subprocess.run([sys.executable, str(BENCH), "--preset", "tiny", "--device", "cpu", "--quick",
                           "--sections", ",".join(CPU_SECTIONS), "--precisions", "auto;bf16",
                           "--state-dtypes", "fp32;fp16", "--json", str(out), "--log-dir", str(tmp_path / "logs"),
                           "--stacks", str(tmp_path / "stacks"), "--swap-runs", "2", "--late-after-ms", "6,0",
                           "--form-margin-ms", "0.5", "--punctual-late-after-ms", "0", "--join", "on,off",
                           "--e2e-runs", "1",  # one e2e run and floor round, however many the options take
                           # the GPU counts' and K's last only (CI's time): 2 process shards, 2 requests a symbol
                           "--gpus", "2", "--max-requests-per-symbol", "2"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=900,
                          env=checkout_env(REPO))  # this checkout's packages, not an installed one
    assert done.returncode == 0, done.stderr[-4000:]
    data = json.loads(out.read_text())
    assert "errors" not in data
    assert data["device"].startswith("cpu")
    assert _finite(data["copy_gb_per_s"]) and data["copy_gb_per_s"] > 0
    assert set(data["step_ms"]) == set(BATCHES)
    for row in data["step_ms"].values():
        assert all(_finite(row[key]) and row[key] > 0 for key in ("median", "p99", "floor"))
        assert row["p99"] >= row["median"]
    # the floor grows with the state each extra row moves
    assert data["step_ms"]["64"]["floor"] > data["step_ms"]["1"]["floor"]
    assert _finite(data["baseline_per_request_ms"]) and data["baseline_per_request_ms"] > 0
    families = data["accuracy"]["families"]
    assert set(families) == {*FAMILIES, LONG_FAMILY} and data["accuracy"]["gate"]["passed"]
    for towers in families.values():
        assert set(towers) == set(TOWERS)
        for tower in towers.values():
            assert all(_finite(tower[key]) for key in ("max_abs_err", "rmse", "within_atol"))
            assert tower["nan_or_inf"] == 0 and 0 <= tower["within_atol"] <= 1
    assert set(data["precisions"]) == {"auto", "bf16"} and "bf16" in data["precisions"]["bf16"]["precision"]
    assert set(data["state_dtypes"]) == {"fp32", "fp16"}
    assert data["state_dtypes"]["fp16"]["state_bytes_per_symbol"] < data["state_dtypes"]["fp32"]["state_bytes_per_symbol"]
    churn = data["churn"]
    assert churn["bit_equal"] and churn["offloaded"] > 0 and churn["restored"] > 0 and churn["step_ms_max"] > 0
    capacity = data["capacity"]
    assert capacity["missed"] == 0 and capacity["responses"] == capacity["requests"]
    assert capacity["symbols_held"] == capacity["symbols_at_budget"] + capacity["host_symbols"]
    assert capacity["host_symbols"] > 0 and capacity["host_bytes"] > 0 and capacity["host_available_bytes"] > 0
    swap = data["swap"]
    assert [run["join_queued"] for run in data["swap_runs"]] == [True, False]
    assert data["swap_runs"][1]["joins"] == {"taken": 0, "missed": 0}
    assert swap["cold_symbols"] > swap["gpu_slots"] and swap["hot"]["missed"] == swap["cold"]["missed"] == 0
    # every cold request brought a state back from host memory, started when the request arrived
    assert swap["restored"] >= swap["requests"] * swap["cold_rate"] / (swap["cold_rate"] + swap["hot_rate"]) - 1
    assert swap["restored_ahead"] == swap["restored"] and swap["swaps_per_s"] > 0
    assert all(swap["arrivals"][side]["all"]["answers"] > 0 for side in ("hot", "cold"))
    moves = swap["hot_beside_moves"]  # every hot answer counted once for each direction
    assert sum(group["steps"] for group in swap["steps_beside_moves_b20"].values()) > 0
    segments = swap["segments_beside_moves_ms"]  # answers beside a move of either way, and the others
    assert segments and all(_finite(p50) for group in segments.values() for p50 in group.values())
    assert all("submitted -> step done" in group for group in segments.values())
    assert len({m["beside"]["answers"] + m["others"]["answers"] for m in moves.values()}) == 1
    assert 0 < moves["to_host"]["beside"]["answers"] + moves["to_host"]["others"]["answers"] < swap["requests"]
    assert all(_finite(swap[key]) for key in ("step_ms_max_b20", "submit_ms_max"))
    assert all(_finite(swap[side][key]) for side in ("hot", "cold") for key in ("p50_ms", "p99_ms", "max_ms"))
    for direction in ("to_gpu", "to_host"):
        assert swap["pinned_gb_per_s"][direction] > 0 and swap["transfer_gb_per_s"][direction] > 0
        assert _finite(swap["bandwidth_share"][direction])
    # two swap runs, the forming rules in turn; the headline is the first rule's
    assert [(run["late_after_ms"], run["form_margin_ms"], run["punctual_late_after_ms"])
            for run in data["swap_runs"]] == [(6.0, 0.5, 0.0), (0.0, 0.5, 0.0)]
    assert all(isinstance(run["late_wakes"], int) and run["late_wakes"] >= 0 and run["latest_wake_ms"] >= 0
               for run in data["swap_runs"])
    assert swap == data["swap_runs"][0]
    assert set(data["gpus"]) == set(data["shards"]) == {"2"} and set(data["backlog"]) == {"k2", "k1"}
    assert {row["symbols"] for row in data["step_rows_ms"].values()} == {1, 20, 64}
    assert {row["rows"] // row["symbols"] for row in data["step_rows_ms"].values()} == {1, 2}
    e2e = data["e2e_400rps_20sym"]
    assert all(_finite(e2e[key]) for key in ("p50_ms", "p99_ms", "accuracy", "responses_per_s"))
    # the served states continue from the reference's: every answered request is judged correct
    assert e2e["responses"] == e2e["requests"] and e2e["accuracy"] >= 0.9
    assert e2e["late_after_ms"] == 6.0 and e2e["form_margin_ms"] == 0.5 and e2e["punctual_late_after_ms"] == 0.0
    assert isinstance(e2e["late_wakes"], int) and e2e["late_wakes"] >= 0 and e2e["latest_wake_ms"] >= 0
    # the hypervisor's share of the host's CPUs during each session, where the host says (Linux: /proc/stat)
    for record in (e2e, swap):
        assert (record["host_steal_ms_per_s"] >= 0) if os.path.exists("/proc/stat") else \
            record["host_steal_ms_per_s"] is None
    # the CPU engine computes its step in submit: the runtime keeps its threads (inline steps only where steps run
    # in the background), and every served record says so
    assert e2e["inline_steps"] is False and all(run["inline_steps"] is False for run in data["swap_runs"])
    assert all(run["inline_steps"] is False for run in data["max_rate_runs"])
    for run in data["max_rate_runs"]:  # where the rows waited before the runtime, from both processes' clocks
        arrival = run["arrival"]
        assert arrival["server_lag_ms"]["p50"] >= 0 and arrival["receipt_lag_ms"]["p50"] > 0
        assert 1 <= arrival["turn_requests_max"] and 1 <= arrival["frame_requests_max"] <= run["requests"]
        stalls = run["client_stalls"]  # what held the client's loop up, and the collector's runs
        assert stalls["loop_lags"] == 0 or stalls["loop_lag_ms_max"] > 3.0
        assert len(stalls["longest"]) == min(stalls["loop_lags"], 3) and set(stalls["collections"]) <= {"0", "1", "2"}
    # the requests the server sent before the resume, every one answered after it, in order
    # (--quick streams 100 requests/s, not the event's 400: a 2-core CPU drains that backlog in ~0.5-1 s, more under
    # load; what it misses says the machine's speed, not a loss; the drain within 100 ms is a GPU's, bench/h100.json)
    for k, numbers in data["backlog"].items():
        assert 0 < numbers["answered"] <= numbers["backlog"] and numbers["accuracy"] == 1.0, (k, numbers)
        assert numbers["drain_ms"] >= 0 and numbers["backlog_p99_ms"] > 0
    # the floor's four clients served the same stream in turn, each answering every request
    (floor_round,) = data["floor"]["rounds"]
    assert list(floor_round) == ["echo", "runtime", "engine", "stand-in", "options"]
    options = floor_round["options"]  # the run's runtime options, as given (and as the e2e section's run took them)
    assert options["late_after_ms"] == 6.0 and options == {key: e2e[key] for key in options}
    assert all(floor_round[name]["inline_steps"] is False for name in ("runtime", "engine", "stand-in"))
    for rung in (floor_round[name] for name in ("echo", "runtime", "engine", "stand-in")):
        assert rung["missed"] == 0 and rung["responses"] == rung["requests"]
        assert 0 < rung["p50_ms"] <= rung["p99_ms"] <= rung["max_ms"]
    # the stand-in took the engine's served times: its answers come no sooner than its submit and shortest step
    engine = floor_round["engine"]
    assert engine["submit_ms"] > 0 and all(ms > 0 for ms in engine["step_ms"].values())
    assert floor_round["stand-in"]["p50_ms"] >= engine["submit_ms"] + min(engine["step_ms"].values())
    runs = data["max_rate_runs"]
    assert runs and [run["rate"] for run in runs] == sorted(run["rate"] for run in runs)
    for run in runs:
        assert all(_finite(run[key]) for key in ("rate", "p50_ms", "p99_ms", "accuracy", "responses_per_s"))
        assert run["accuracy"] >= 0.9 or run["missed"] > 0
    passed = [run["rate"] for run in runs if run["passed"]]
    assert data["max_rate_p99_50ms"] == (max(passed) if passed else None)
    assert set(data["section_s"]) == set(CPU_SECTIONS)
    assert "max rate with p99" in done.stdout  # the summary table
    assert any((tmp_path / "logs").glob("bench-*.log"))
    # a line per served session in each process's stacks file (e2e, every max rate tried, capacity, swap, ...)
    sessions = {side: [line for line in (tmp_path / "stacks" / f"{side}_stacks.txt").read_text().splitlines()
                       if line.startswith("== ")] for side in ("client", "server")}
    assert sessions["client"] == sessions["server"] and len(sessions["client"]) >= 2 + len(runs)


def test_reference_tracker_continues_states_across_streams():
    from client.model import load_model
    from scripts.benchmarks.serving import ReferenceTracker, prefixed_stream

    model, _ = load_model("tiny")
    symbols = ["A_SYM_000", "A_SYM_001", "A_SYM_002"]
    tracker = ReferenceTracker(model, symbols, torch.device("cpu"))
    first = prefixed_stream("A_", 3, 7, seed=5, rate=100.0)
    second = prefixed_stream("A_", 3, 5, seed=6, rate=100.0)
    targets = np.concatenate([tracker.targets(first), tracker.targets(second)])
    # the same requests one at a time through each symbol's own state
    states, expected = {}, []
    with torch.no_grad():
        for symbol, features in zip([*first.symbols, *second.symbols], [*first.features, *second.features]):
            prediction, states[symbol] = model(torch.from_numpy(features[None]),
                                               states.get(symbol) or model.init_state(1))
            expected.append(prediction[0].numpy())
    np.testing.assert_allclose(targets, np.stack(expected), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("argv, message", [
    (["--sections", "copy,warp"], "unknown sections"),
    (["--family-symbols", "0"], "positive integer"),
    (["--family-symbols", "5"], "at most 4"),
    (["--family-steps", "-3"], "positive integer"),
    (["--family-seeds", "0"], "positive integer"),
    (["--precisions", "auto;fp8"], "unknown precision 'fp8'"),
    (["--state-dtypes", "fp16;fp9"], "unknown state dtype 'fp9'"),
    (["--state-dtype", "fp16:up"], "state rounding must be nearest or stochastic"),
    (["--gpus", "0"], "positive integer"),
    (["--e2e-requests", "0"], "positive integer"),
    (["--rates", "1000,-5"], "positive numbers"),
    (["--rates", ","], "at least one rate"),
    (["--k1-rates", "0"], "positive numbers"),
    (["--rate-seconds", "nan"], "positive number"),
    (["--late-after-ms", "6,-1"], "must be a number of at least 0"),
    (["--swap-runs", "0"], "positive integer"),
    (["--form-margin-ms", "x"], "must be a number of at least 0"),
    (["--punctual-late-after-ms", "7"], "must not exceed --late-after-ms (6)"),
    (["--late-after-ms", "6,3", "--punctual-late-after-ms", "0,4"], "must not exceed --late-after-ms (3)"),
    (["--device", "meta"], "--device must be cuda or cpu"),
    (["--device", "nonsense"], "--device nonsense: not a torch device; use cuda, cuda:N or cpu (see --help)"),
    (["--preset", "huge"], "invalid choice"),
    (["--json", "/no/such/folder/bench.json"], "argument --json: no such folder: /no/such/folder"),  # before the run
    (["--seed", "-1"], "argument --seed: must be a non-negative integer"),  # not every section's traceback
    # the accuracy section ran nothing and said nothing: the backlog run is for K above 1
    (["--accuracy-backlog-only", "--max-requests-per-symbol", "1"], "--accuracy-backlog-only: the suite's run with a "
                                                                    "backlog of K = --max-requests-per-symbol"),
    # only the shards section shards: accepted, and no section of the run used them
    (["--sections", "step,e2e", "--on-shard-loss", "reset", "--shard-timeout-s", "5"],
     "--on-shard-loss, --shard-timeout-s: for the shards section, which --sections leaves out"),
    (["--sections", "maxrate", "--cluster", "ray"], "--cluster: for the shards section, which --sections leaves out"),
    (["--shards", "2"], "--ray-address and --shards apply with --cluster ray"),
])
def test_bad_options_are_refused(argv, message, usage_error):
    assert message in usage_error(_load_bench().parse_args, ["--device", "cpu", *argv])


def test_the_cluster_without_ray_is_refused_before_the_run(usage_error, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    message = usage_error(_load_bench().parse_args, ["--device", "cpu", "--cluster", "ray", "--sections", "shards"])
    assert '--cluster ray needs Ray: pip install "ray>=2.9"' in message


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_device_without_cuda_is_refused(usage_error):
    assert "CUDA is not available" in usage_error(_load_bench().parse_args, ["--device", "cuda"])


def test_sections_run_in_a_fixed_order():
    args = _load_bench().parse_args(["--device", "cpu", "--sections", "maxrate,copy", "--quick",
                                     "--rates", "300,100,100", "--k1-rates", "60,40"])
    assert args.sections == ["copy", "maxrate"]
    assert args.counts.rates == [100.0, 300.0] and args.counts.k1_rates == [40.0, 60.0]
    assert args.counts.family_steps == 20  # --quick counts, where not overridden


def test_failing_section_is_recorded_and_others_still_run(tmp_path, monkeypatch, capsys):
    bench = _load_bench()
    monkeypatch.setitem(sys.modules, "client.engine.fast", None)  # as if client/engine/fast were absent
    out = tmp_path / "out.json"
    code = bench.main(["--preset", "tiny", "--device", "cpu", "--quick", "--sections", "step,baseline",
                       "--json", str(out)])
    assert code == 1
    data = json.loads(out.read_text())
    assert set(data["errors"]) == {"step"} and "client.engine.fast" in data["errors"]["step"]
    assert _finite(data["copy_gb_per_s"])  # measured for the step floor before the engine was needed
    assert _finite(data["baseline_per_request_ms"])
    assert "FAILED sections: step" in capsys.readouterr().out


def test_a_section_that_fails_then_passes_under_merge_is_no_longer_reported_failed(tmp_path, monkeypatch, capsys):
    bench = _load_bench()
    copy = bench.SECTIONS["copy"]
    out = tmp_path / "out.json"
    argv = ["--device", "cpu", "--quick", "--sections", "copy", "--json", str(out)]
    with monkeypatch.context() as patched:
        patched.setattr(copy, "run", lambda b: 1 / 0)
        assert bench.main(argv) == 1
    assert set(json.loads(out.read_text())["errors"]) == {"copy"}
    capsys.readouterr()
    assert bench.main([*argv, "--merge"]) == 0
    assert "FAILED" not in capsys.readouterr().out  # it read "FAILED sections: copy", the run exiting 0
    data = json.loads(out.read_text())
    assert not data.get("errors") and _finite(data["copy_gb_per_s"])


def test_stacks_reach_the_floor_and_hung_sections_served_sessions(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from client.streams import generate_stream
    from scripts.benchmarks import floor, hung

    given = []

    class Served(Exception):
        pass

    async def serve_stream(*args, **options):
        given.append(options.get("stacks_dir"))
        raise Served

    args = SimpleNamespace(preset="tiny", seed=0, pipeline_min_batch=None, max_requests_per_symbol=8,
                           stacks=str(tmp_path), late_after_ms=None, form_margin_ms=None,
                           punctual_late_after_ms=None, join=None, inline_steps=None)
    fake = SimpleNamespace(args=args, forming=lambda run=0: {}, model=None, device="cpu")
    stream = generate_stream(2, 4, 0)
    for module in (floor, hung):
        monkeypatch.setattr(module, "serve_stream", serve_stream)
    monkeypatch.setattr(hung, "ReferenceTracker", lambda *a: SimpleNamespace(targets=lambda s: None))
    with pytest.raises(Served):
        floor.serve_runtime(fake, stream, None, 0)

    def server_process(*args, stacks_path=None):
        given.append(os.path.dirname(stacks_path))
        raise Served
    monkeypatch.setattr(floor, "ServerProcess", server_process)
    with pytest.raises(Served):
        floor.serve_echo(fake, stream)
    with pytest.raises(Served):
        hung.measure(fake, SimpleNamespace(shards=[None, SimpleNamespace(process=None)]), None, "HUP_")
    assert given == [str(tmp_path)] * 3  # --stacks was not handed on: no stack written for these sessions


def test_a_max_rate_search_that_no_rate_passed_reads_so_not_none_req_s():
    from scripts.benchmarks import maxrate, shards, state_rates

    run = {"rate": 100, "p50_ms": 60.0, "p99_ms": 90.0, "accuracy": 1.0, "missed": 0, "passed": False}
    lines = maxrate.summary({"max_rate_runs": [run], "max_rate_p99_50ms": None, "max_rate_k1_runs": [run],
                             "max_rate_k1_p99_50ms": 3000})
    lines += shards.summary({"shards": {"2": {"max_rate_p99_50ms": None}}})
    lines += state_rates.summary({"state_rates": {"fp16": {"state_bytes_per_symbol": 2**20, "max_rate_p99_50ms": None}}})
    assert not any("None" in line for line in lines), lines
    assert [line for line in lines if line.startswith("max rate")][0].endswith("a step: no rate tried passed")
    assert [line for line in lines if line.startswith("max rate")][1].endswith("a step: 3000 req/s")
    assert lines[-2].endswith("symbols no rate tried passed") and lines[-1].endswith("symbols no rate tried passed")


def test_promote_partials_holds_for_the_run_and_is_restored(tmp_path, monkeypatch):
    import importlib

    bench = _load_bench()
    skinny = importlib.import_module("kernels.skinny_matmul")
    during = []
    monkeypatch.setattr(bench, "run_sections", lambda b: during.append(skinny.PROMOTE_PARTIALS) or [])
    out = tmp_path / "out.json"
    argv = ["--device", "cpu", "--quick", "--sections", "copy", "--promote-partials", "off", "--json", str(out)]
    assert bench.main(argv) == 0
    assert during == [False] and skinny.PROMOTE_PARTIALS is True
    assert json.loads(out.read_text())["promote_partials"] is False


def test_accuracy_backlog_only_runs_the_suite_once_with_a_backlog_of_k(monkeypatch):
    """--accuracy-backlog-only: the suite's run with K requests of every symbol a step, not the one-request run."""
    from types import SimpleNamespace

    from scripts.benchmarks import accuracy

    monkeypatch.setattr(accuracy, "format_table", str)

    runs, report = [], {}
    suite = SimpleNamespace(measure=lambda engine, prefix, per_symbol=1: runs.append((prefix, per_symbol)) or {})
    for only, expected in ((True, [("ACC8/", 8)]), (False, [("ACC/", 1), ("ACC8/", 8)])):
        runs.clear(), report.clear()
        bench = SimpleNamespace(args=SimpleNamespace(accuracy_backlog_only=only, max_requests_per_symbol=8),
                                suite=suite, engine=None, report=report, progress=lambda text: None)
        accuracy.run(bench)
        assert runs == expected and ("accuracy" in report) is not only and report["accuracy_backlog"] == {
            "requests_per_symbol": 8}


def test_steps_by_rows_groups_the_step_log_by_the_engines_row_sizes():
    from scripts.benchmarks.serving import steps_by_rows

    def step(submitted, ended, rows, symbols=64):
        return {"formed": submitted - 0.001, "submitted": submitted, "ended": ended, "rows": rows, "symbols": symbols}

    log = [step(0.000, 0.015, 240), step(0.001, 0.034, 340),  # queued behind the first: counted from its end
           step(0.034, None, 300),                            # failed: no time
           step(0.040, 0.059, 300), step(0.060, 0.084, 400)]
    out = steps_by_rows(log, (128, 256, 384, 512))
    assert list(out) == ["256", "384", "512"]
    assert out["384"]["steps"] == 2 and out["384"]["rows_p50"] == 320
    assert out["384"]["ms_p50"] == pytest.approx(19.0)  # 19 ms (15 -> 34) and 19 ms (40 -> 59)
    assert out["256"]["ms_p50"] == pytest.approx(15.0) and out["512"]["ms_p50"] == pytest.approx(24.0)
    assert out["384"]["forming_ms_p50"] == pytest.approx(1.0) and out["384"]["forming_ms_max"] == pytest.approx(1.0)
    assert list(steps_by_rows(log, ())) == ["256", "512"]  # without the engine's sizes: powers of two


def test_beside_moves_splits_the_answers_whose_step_ran_while_a_state_moved():
    """Steps of answers 0-3 at [0, 2], [3, 6], [6, 8] and [9, 11] ms; moves over [1, 4] ms (beside answers 0 and 1)
    and [4.5, 5.5] (answer 1 again): answers 0 and 1 beside a move, 2 and 3 not; answer 4 never answered."""
    from scripts.benchmarks.swap import beside_moves

    stages = {uid: {"submitted": 0.003 * uid, "done": 0.003 * uid + 0.002 + 0.001 * (uid == 1)} for uid in range(5)}
    latency = np.array([9.0, 7.0, 3.0, 2.0, np.nan])
    out = beside_moves(stages, latency, np.arange(5), [(0.001, 0.004), (0.0045, 0.0055)])
    assert out["beside"] == {"answers": 2, "p50_ms": 8.0, "p99_ms": pytest.approx(8.98),
                             "step_p50_ms": pytest.approx(2.5)}
    assert out["others"] == {"answers": 2, "p50_ms": 2.5, "p99_ms": pytest.approx(2.99),
                             "step_p50_ms": pytest.approx(2.0)}
    nothing = beside_moves(stages, latency, np.arange(5), [])
    assert nothing["beside"] == {"answers": 0, "p50_ms": None, "p99_ms": None, "step_p50_ms": None}
    assert nothing["others"]["answers"] == 4


def test_steps_beside_moves_splits_the_steps_that_ran_while_a_state_moved():
    """Steps from when each could start (serving.served_step_spans): [0, 2], [2, 5] (queued behind the first),
    [6, 7] ms and one of 30 symbols, left out; a move over [4, 5.5] ms overlaps the second step alone."""
    from scripts.benchmarks.serving import served_step_spans
    from scripts.benchmarks.swap import steps_beside_moves

    log = [{"submitted": 0.0, "ended": 0.002, "symbols": 20}, {"submitted": 0.001, "ended": 0.005, "symbols": 3},
           {"submitted": 0.006, "ended": 0.007, "symbols": 1}, {"submitted": 0.0071, "ended": 0.009, "symbols": 30},
           {"submitted": 0.0095, "ended": None, "symbols": 1}]
    spans = served_step_spans(log, 20)
    assert spans == [(0.0, 0.002), (0.002, 0.005), (0.006, 0.007)]
    out = steps_beside_moves(spans, [(0.004, 0.0055)])
    assert out["beside"] == {"steps": 1, "p50_ms": pytest.approx(3.0), "p99_ms": pytest.approx(3.0)}
    assert out["others"]["steps"] == 2 and out["others"]["p50_ms"] == pytest.approx(1.5)
    assert steps_beside_moves(spans, [])["beside"] == {"steps": 0, "p50_ms": None, "p99_ms": None}


def test_arrival_numbers_split_the_wait_before_the_runtime_into_the_servers_pacing_and_the_receipt():
    from scripts.benchmarks.serving import arrival_line, arrival_numbers

    # five requests due 1 ms apart; the server fell 3 ms behind and sent the last three in one turn at 0.007 s
    due = np.array([0.001, 0.002, 0.003, 0.004, 0.005])
    sent = np.array([0.001, 0.002, 0.007, 0.007, 0.007])
    latency_ms = np.array([1.0, 1.0, 2.0, 9.0, np.nan])  # the last never answered
    frames = [(0.0015, [0]), (0.0025, [1]), (0.009, [2, 3]), (0.010, [4]),
              (0.050, [3, 99])]                          # a resend of 3 (its first receipt counts), an id not sent
    out = arrival_numbers({"due": due, "sent": sent, "latency_ms": latency_ms}, frames)
    assert out["server_lag_ms"]["max"] == pytest.approx(4.0) and out["server_lag_ms"]["p50"] == pytest.approx(2.0)
    assert out["receipt_lag_ms"]["max"] == pytest.approx(3.0) and out["receipt_lag_ms"]["p50"] == pytest.approx(2.0)
    assert out["turn_requests_max"] == 3 and out["frame_requests_max"] == 2
    assert out["frames"] == 5 and out["frame_requests_mean"] == pytest.approx(7 / 5)
    assert "5 frames of 1.4 requests on average, slowest 1%" in arrival_line(out)
    older = {k: v for k, v in out.items() if k not in ("frames", "frame_requests_mean")}  # a run before section 79
    assert "frame 2 requests, slowest 1% latency 9.00 ms" in arrival_line(older)
    assert out["slowest_1pct"] == {"latency_ms": 9.0, "receipt_lag_ms": pytest.approx(2.0)}


def test_stall_numbers_say_how_long_the_loop_was_held_up_how_it_spent_that_and_the_collectors_runs():
    from scripts.benchmarks.serving import stall_line, stall_numbers

    spent = {"on_cpu_ms": 1.0, "runnable_ms": 0.5, "blocked_ms": 60.0}
    events = {"loop_lags": [(10.5, 0.004), (11.0, 0.0615, spent), (12.0, 0.010, dict(spent, blocked_ms=8.0)),
                            (13.0, 0.005, dict(spent, on_cpu_ms=4.0, blocked_ms=0.0))],
              "collections": [(10.0, 0.001, 0), (10.2, 0.002, 0), (11.0, 0.060, 2)], "late_wakeups": []}
    out = stall_numbers(events, started=10.0)
    assert out["loop_lags"] == 4 and out["loop_lag_ms_max"] == pytest.approx(61.5)
    assert out["loop_lag_ms_sum"] == pytest.approx(80.5)
    assert out["spent_ms"] == pytest.approx({"on_cpu_ms": 6.0, "runnable_ms": 1.5, "blocked_ms": 68.0})
    assert [lag["at_s"] for lag in out["longest"]] == pytest.approx([1.0, 2.0, 3.0])
    assert out["longest"][0]["blocked_ms"] == 60.0
    assert out["collections"] == {"0": {"count": 2, "max_ms": pytest.approx(2.0)},
                                  "2": {"count": 1, "max_ms": pytest.approx(60.0)}}
    assert out["full_collections"] == [{"at_s": pytest.approx(1.0), "ms": pytest.approx(60.0)}]
    assert "loop lags over 3 ms in play: 4 (max 61.5" in stall_line(out) and "gen 2: 1 max 60.0 ms" in stall_line(out)
    quiet = stall_numbers({"loop_lags": [], "collections": [], "late_wakeups": []}, started=0.0)
    assert quiet["loop_lags"] == 0 and quiet["longest"] == [] and "collections none" in stall_line(quiet)
    # the runtime's collection before it connects is no lag of play (play: from the first request frame's receipt)
    events["loop_lags"].insert(0, (9.9, 0.095, dict(spent, on_cpu_ms=95.0, blocked_ms=0.0)))
    played = stall_numbers(events, started=9.9, play_from=10.2)
    assert played["loop_lags"] == 4 and played["loop_lag_ms_sum"] == pytest.approx(80.5)
    assert played["before_play_ms_max"] == pytest.approx(95.0) and "before play max 95.0" in stall_line(played)
    assert stall_numbers(events, started=9.9)["loop_lags"] == 5  # no first frame: every lag counts


def test_a_served_session_runs_a_stall_probe_only_where_asked_not_for_its_step_log_alone(monkeypatch):
    """The floor section's engine rung logs its steps (step_log) as before, with no stall probe beside it, as its
    other rungs: the probe's ticks on the client's loop would be in one rung alone. The maxrate runs ask (stalls), and
    their probe is stopped, also where the session fails."""
    import asyncio

    import client.stalls
    from scripts.benchmarks import serving

    probes = []

    class Probe(client.stalls.StallProbe):
        def start(self):
            probes.append(self)
            self.stopped = False
            return super().start()

        def stop(self):
            self.stopped = True
            super().stop()

    class Server:  # the session ends at once: the client is stopped before it reaches the (absent) server
        port, fail = 1, False

        def __init__(self, *args):
            pass

        async def wait_done(self):
            return

        def summary(self):
            if Server.fail:
                raise RuntimeError("the server's summary failed")
            return {}

        def close(self):
            pass

    class Team:
        def process_batch(self, batch):
            raise AssertionError("nothing steps")

    monkeypatch.setattr(client.stalls, "StallProbe", Probe)
    monkeypatch.setattr(serving, "ServerProcess", Server)
    monkeypatch.setattr(serving, "server_config", lambda *args: None)

    def session(**options):
        return asyncio.run(serving.serve_stream(None, None, None, 100.0, "tiny", 0, team_client=Team(), **options))

    summary = session(step_log=True)  # the floor's engine rung
    assert probes == [] and summary["steps"] == [] and "client_stalls" not in summary
    summary = session(step_log=True, stalls=True)  # a maxrate run
    assert len(probes) == 1 and probes[0].stopped and set(summary["client_stalls"]) >= {"loop_lags", "collections"}
    Server.fail = True
    with pytest.raises(RuntimeError, match="summary failed"):
        session(step_log=True, stalls=True)
    assert len(probes) == 2 and probes[1].stopped


def test_floor_stand_in_steps_queue_one_at_a_time_at_the_step_tables_pace():
    from scripts.benchmarks.floor import StandInTeam, step_ms_of

    step_ms = step_ms_of({"1": 2.0, "20": 5.8})
    assert step_ms(1) == 2.0 and step_ms(20) == 5.8 and step_ms(10) == pytest.approx(3.8) and step_ms(64) == 5.8
    team = StandInTeam(lambda symbols: 20.0 * symbols)
    begin = time.perf_counter()
    first = team.submit_batch({"A": [(1, None), (2, None)], "B": [(3, None)]})
    second = team.submit_batch({"A": [(4, None)]})  # queued behind the first, as on a device
    answer = second.result()
    assert time.perf_counter() - begin >= 0.060
    assert answer["unique_ids"] == [4] and answer["predictions"].shape == (1, 4)
    assert first.result()["unique_ids"] == [1, 2, 3]
    third = team.submit_batch({"B": [(5, None)]})
    assert not third.done()  # polled by the runtime's inline steps: ends at its time, not before
    third.result()
    assert third.done()


def test_inline_steps_are_given_to_the_served_runs_in_turn():
    bench = _load_bench()
    args = bench.parse_args(["--preset", "tiny", "--device", "cpu", "--inline-steps", "on,off"])
    from scripts.benchmarks.harness import Bench
    harness = Bench(args, None, print)
    assert harness.forming(0) == {"inline_steps": True} and harness.forming(1) == {"inline_steps": False}
    assert "inline_steps" not in Bench(bench.parse_args(["--preset", "tiny", "--device", "cpu"]), None,
                                       print).forming(0)


def test_the_committed_results_read_back_in_the_summary_table():
    """bench.py --merge keeps what bench/h100.json holds and prints every section's summary of it: a record kept
    from a probe (the swap's of session 14 lacks step_waits) must not end the run in a traceback."""
    data = json.loads((REPO / "bench" / "h100.json").read_text())
    table = _load_bench().summary_table(data)
    assert "swap: 20 hot symbols" in table and "steps that waited for a copy not recorded" in table


def test_a_failure_is_one_line_with_the_tools_name(tmp_path):
    """As the other tools: what main raises is one line and an exit code, the traceback behind --debug."""
    (tmp_path / "old.json").write_text("{not json")
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "bench.py"), "--device", "cpu", "--preset", "tiny",
                           "--quick", "--sections", "step", "--merge", "--json", "old.json"],
                          cwd=tmp_path, env=checkout_env(REPO), capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1].startswith("scripts/bench.py: error: --merge: old.json holds no JSON "
                                                           "report (Expecting property name")
    assert (tmp_path / "old.json").read_text() == "{not json"


@pytest.mark.parametrize("option", ["--stacks", "--log-dir"])
def test_a_folder_that_cannot_be_made_or_written_is_one_line_before_any_section(tmp_path, cli_here, option):
    """--stacks was made by each served section as it started: each failed with a traceback, the run going on; a
    folder that takes no file (/proc, even for root) failed only when the first file went there."""
    (tmp_path / "taken").write_text("")
    for folder, why in ((tmp_path / "taken", "File exists"), (Path("/proc"), "")):
        code, stderr = cli_here(_load_bench().main, "scripts/bench.py",
                                ["--device", "cpu", "--preset", "tiny", "--quick", "--sections", "copy",
                                 option, str(folder)])
        assert code == 2 and stderr.startswith(f"scripts/bench.py: error: {option} {folder}: cannot write in it: "
                                               f"{why}"), stderr
        assert len(stderr.strip().splitlines()) == 1


def test_a_hung_shard_section_says_how_long_the_live_shards_symbols_waited_beside_the_hung_ones(tmp_path):
    """Section hung on the CPU: one of two process shards stopped for 2 s mid-session, with the runtime's default
    (steps whose parts are late go on without them) and with every step answered whole. The live shard's symbols
    waited for the hung one only with whole steps; on a 2-core CPU the steps themselves take ~0.1 s."""
    out = tmp_path / "out.json"
    done = subprocess.run([sys.executable, str(BENCH), "--preset", "tiny", "--device", "cpu", "--quick",
                           "--sections", "hung", "--json", str(out), "--log-dir", str(tmp_path / "logs")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300, env=checkout_env(REPO))
    assert done.returncode == 0, done.stderr[-4000:]
    hung = json.loads(out.read_text())["hung_shard"]
    assert hung["hung_s"] == 2.0 and len(hung["devices"]) == 2
    parts, whole = hung["in_parts"], hung["whole"]
    assert parts["late_parts_s"] is None and whole["late_parts_s"] >= 1e9
    for run in (parts, whole):
        assert run["live_requests"] > 0 and run["hung_requests"] > 0 and run["accuracy"] == 1.0
    assert parts["live_missed"] <= whole["live_missed"] and parts["live_p50_ms"] < 0.5 * whole["live_p50_ms"]



def test_e2e_runs_over_tls_in_turn_with_tls_alternate(tmp_path, capsys):
    """--tls alternate: every second e2e run plays the server over TLS (wss://), both fully answered; --quick's one
    run had none over TLS, unsaid: it takes the two the alternation needs, and says so."""
    bench = _load_bench()
    out = tmp_path / "out.json"
    assert bench.main(["--preset", "tiny", "--device", "cpu", "--quick", "--sections", "e2e",
                       "--tls", "alternate", "--json", str(out)]) == 0
    runs = json.loads(out.read_text())["e2e_runs"]
    assert [run["tls"] for run in runs] == [False, True]
    assert all(run["missed"] == 0 and run["accuracy"] == 1.0 for run in runs)
    assert ("scripts/bench.py: 2 e2e and floor runs, not the --quick default 1, so that --tls alternate take every "
            "turn (--e2e-runs N to choose)") in capsys.readouterr().err.splitlines()


@pytest.mark.parametrize("argv, runs, said", [
    (["--quick", "--sections", "e2e,floor", "--late-after-ms", "6,0,3", "--join", "on,off", "--tls", "alternate"], 6,
     "6 e2e and floor runs, not the --quick default 1, so that --late-after-ms, --join, --tls alternate take every "
     "turn"),
    (["--quick", "--sections", "floor", "--tls", "alternate", "--inline-steps", "off,on"], 2,
     "2 e2e and floor runs, not the --quick default 1, so that --inline-steps take every turn"),  # floor: no TLS
    (["--sections", "e2e", "--form-margin-ms", "1,2,3,4"], 4,
     "4 e2e and floor runs, not the default 3, so that --form-margin-ms take every turn"),
    (["--sections", "e2e", "--form-margin-ms", "1,2", "--awake-cpus", "alternate"], 3, None),  # 3 runs take both
    (["--quick", "--sections", "e2e", "--tls", "alternate", "--e2e-runs", "1"], 1, None),  # as asked
    (["--quick", "--sections", "floor", "--tls", "alternate"], 1, None),
    (["--quick", "--sections", "step,swap", "--late-after-ms", "6,0"], 1, None),
])
def test_the_default_e2e_runs_grow_to_give_every_option_in_turn_its_run(argv, runs, said, capsys):
    args = _load_bench().parse_args(["--preset", "tiny", "--device", "cpu", *argv])
    assert args.counts.e2e_runs == runs
    err = capsys.readouterr().err
    assert err == (f"scripts/bench.py: {said} (--e2e-runs N to choose)\n" if said else "")


def test_tls_without_the_tls_tests_certificate_is_refused_before_the_run(usage_error, monkeypatch, tmp_path):
    """An installed package holds no tests/: --tls failed after the e2e targets were made, its server process gone
    at start and waited for 120 s. It is refused as the options are read."""
    bench = _load_bench()
    monkeypatch.setattr(bench, "TLS_CERT", str(tmp_path / "tests" / "data" / "tls" / "cert.pem"), raising=False)
    message = usage_error(bench.parse_args, ["--device", "cpu", "--sections", "e2e", "--tls", "alternate"])
    assert "--tls alternate serves with the TLS tests' certificate, not here" in message
    bench.parse_args(["--device", "cpu", "--sections", "e2e", "--tls", "off"])


def test_a_scoring_server_process_that_cannot_start_is_said_at_once(tmp_path):
    """The bench's server process ended at its start (a certificate it cannot serve with, here): the bench waited
    120 s for its port before saying so."""
    from client.streams import generate_stream
    from scripts.benchmarks.serving import ServerProcess, server_config

    not_pem = tmp_path / "cert.pem"
    not_pem.write_text("no certificate here\n")
    stream = generate_stream(2, 10, 0)
    config = server_config(stream, 100.0, "tiny", 0)
    config.tls_cert = str(not_pem)
    began = time.monotonic()
    with pytest.raises(RuntimeError, match=r"the scoring server process ended \(exit code 1\)"):
        ServerProcess(config, stream, np.zeros((len(stream), 4), np.float32))
    assert time.monotonic() - began < 60
