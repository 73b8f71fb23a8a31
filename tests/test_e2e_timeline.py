"""scripts/e2e_timeline.py: the join of server and client times, and a CPU run end to end."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "e2e_timeline.py"


def _load():
    spec = importlib.util.spec_from_file_location("e2e_timeline_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _timeline(n=200, slow_id=17):
    """Requests sent 2.5 ms apart; each answer's stages 0.2 / 0.1 / 0.3 / 2.0 / 0.1 / 0.3 ms apart, except
    slow_id, whose step takes 20 ms with a 15 ms server-side stall noted during it."""
    sent = 100.0 + 0.0025 * np.arange(n)
    client, latency = {}, np.full(n, np.nan)
    for uid in range(n):
        step = 0.020 if uid == slow_id else 0.002
        t = sent[uid] + 0.0002
        stages = {"received": t, "batched": t + 0.0001, "submitted": t + 0.0004}
        stages["done"] = stages["submitted"] + step
        stages["answered"] = stages["done"] + 0.0001
        client[uid] = stages
        latency[uid] = 1e3 * (stages["answered"] + 0.0003 - sent[uid])
    latency[5] = np.nan  # never answered in time: left out
    stalls = {"collections": [(sent[slow_id] + 0.001, 0.015, 2), (50.0, 0.5, 2)],  # the second before the window
              "late_wakeups": [], "loop_lags": []}
    quiet = {"collections": [], "late_wakeups": [(sent[3], 0.004)], "loop_lags": []}
    return {"sent": sent, "latency_ms": latency, "client": client, "stalls": stalls, "client_stalls": quiet}


def test_analyze_joins_the_stages_and_finds_the_stall_behind_the_slowest_answer():
    result = _load().analyze(_timeline(), slowest=3)
    assert result["answers"] == 199
    segments = result["segments_all"]
    assert segments["server send -> client receive"]["p50"] == pytest.approx(0.2)
    assert segments["receive -> batch formed"]["p50"] == pytest.approx(0.1)
    assert segments["batch formed -> submitted"]["p50"] == pytest.approx(0.3)
    assert segments["submitted -> step done"]["p50"] == pytest.approx(2.0)
    assert segments["submitted -> step done"]["max"] == pytest.approx(20.0)
    assert segments["answer queued -> server receive"]["p50"] == pytest.approx(0.3)
    slowest = result["slowest"][0]
    assert slowest["unique_id"] == 17 and slowest["latency_ms"] == pytest.approx(21.0)
    assert slowest["segments_ms"][3] == pytest.approx(20.0)
    assert slowest["stalls_near"] == ["server collections 15.0 ms at +1.0"]
    assert result["segments_slowest_1pct"]["submitted -> step done"]["max"] == pytest.approx(20.0)
    server = result["stalls"]["server"]
    assert server["collections"]["count"] == 1 and server["full_collections"]["max_ms"] == pytest.approx(15.0)
    assert result["stalls"]["client"]["late_wakeups"] == {"count": 1, "max_ms": pytest.approx(4.0),
                                                          "total_ms": pytest.approx(4.0)}
    assert "21.00" in _load().format_report(result)
    episode, = result["episodes"]  # p50 2.9 ms: answers over 5.8 ms are slow, only uid 17
    assert episode["answers"] == 1 and episode["max_latency_ms"] == pytest.approx(21.0)
    assert episode["at_s"] == pytest.approx(0.0025 * 17) and episode["segment"] == "submitted -> step done"


def test_arrivals_say_which_requests_came_during_a_submit_or_to_a_full_pipeline():
    """Steps formed at 0, 10 and 20 ms, each submitted 1 ms after forming and ending 15 ms after it: a request
    received at 0.5 ms came during the first submit, at 12 ms to two steps in flight, at 18 ms to one (the first
    ended at 15), at 40 ms to none."""
    timeline = _timeline(n=6, slow_id=4)
    del timeline["client"][4], timeline["client"][5]
    t0 = 200.0
    for uid, at in enumerate((0.0005, 0.012, 0.018, 0.040)):
        timeline["client"][uid] = {stage: t0 + at + k * 1e-4 for k, stage in
                                   enumerate(("received", "batched", "submitted", "done", "answered"))}
        timeline["sent"][uid], timeline["latency_ms"][uid] = t0 + at - 1e-4, 1.0 + uid
    timeline["steps"] = [{"formed": t0 + f, "submitted": t0 + f + 0.001, "ended": t0 + f + 0.015}
                         for f in (0.0, 0.010, 0.020)]
    result = _load().analyze(timeline, slowest=1)
    assert result["arrivals"]["all"] == {"answers": 4, "during_a_submit": 1, "pipeline_full": 1}
    assert result["arrivals"]["slowest_1pct"] == {"answers": 1, "during_a_submit": 0, "pipeline_full": 0}
    assert "during a submit 1 / 0, pipeline full 1 / 0" in _load().format_report(result)
    assert "arrivals" not in _load().analyze(_timeline(), slowest=1)  # no step log: not asked


def test_a_loop_lag_near_a_slow_answer_says_how_the_loop_spent_it():
    timeline = _timeline()
    spent = {"on_cpu_ms": 1.5, "runnable_ms": 12.0, "blocked_ms": 1.5}
    timeline["client_stalls"]["loop_lags"] = [(timeline["sent"][17] + 0.002, 0.010, spent),
                                              (timeline["sent"][90], 0.004, spent)]
    result = _load().analyze(timeline, slowest=1)
    assert result["slowest"][0]["stalls_near"] == [
        "server collections 15.0 ms at +1.0",
        "client loop_lags 10.0 ms at +2.0 (on cpu 1.5, runnable 12.0, blocked 1.5)"]
    lags = result["stalls"]["client"]["loop_lags"]
    assert lags["spent_ms"] == {"on_cpu_ms": 3.0, "runnable_ms": 24.0, "blocked_ms": 3.0}
    report = _load().format_report(result)
    assert "loop lags 2 (max 10.0 ms, on cpu 3.0, runnable 24.0, blocked 3.0 ms in all)" in report


def test_slow_answers_close_in_time_are_one_episode():
    rows = [{"unique_id": i, "sent": sent, "end": sent + latency / 1e3, "latency_ms": latency,
             "received": sent, "batched": sent, "submitted": sent, "done": sent + latency / 1e3,
             "answered": sent + latency / 1e3}
            for i, (sent, latency) in enumerate([(1.0, 20.0), (1.01, 15.0), (1.2, 3.0), (2.0, 9.0), (2.5, 30.0)])]
    found = _load().episodes(rows, start=1.0, slow_ms=5.0)
    assert [(e["answers"], round(e["at_s"], 3)) for e in found] == [(2, 0.0), (1, 1.0), (1, 1.5)]
    assert found[0]["span_ms"] == pytest.approx(25.0) and found[0]["max_latency_ms"] == 20.0
    assert found[0]["segment"] == "submitted -> step done"


def test_analyze_refuses_a_timeline_without_answers():
    timeline = _timeline()
    timeline["latency_ms"][:] = np.nan
    with pytest.raises(ValueError, match="no answered request"):
        _load().analyze(timeline)


def test_checkpoints_say_which_answers_had_a_state_export_before_their_step():
    """Exports beginning at 10 ms (answer 4's receipt at 10.2 ms is after it), at 15.4 ms (between answer 6's
    receipt and its submit, 15.2 and 15.6 ms: its step came right after) and at 1 s (after every answer)."""
    timeline = _timeline(n=8, slow_id=6)
    t0 = timeline["sent"][0]
    timeline["exports"] = [(t0 + 0.010, t0 + 0.0103), (t0 + 0.0154, t0 + 0.0156), (t0 + 1.0, t0 + 1.0005)]
    result = _load().analyze(timeline, slowest=1)
    checkpoints = result["checkpoints"]
    assert checkpoints["exports"] == 3 and checkpoints["export_max_ms"] == pytest.approx(0.5)
    assert checkpoints["export_p50_ms"] == pytest.approx(0.3)
    assert checkpoints["after_one"] == 1 and checkpoints["after_one_slowest_1pct"] == 1  # answer 6, the slowest
    assert checkpoints["p50_ms_after_one"] == pytest.approx(21.0) and checkpoints["p50_ms_others"] == pytest.approx(3.0)
    assert "journal: 3 state checkpoints, each 0.30 ms (max 0.50)" in _load().format_report(result)
    assert "checkpoints" not in _load().analyze(_timeline(), slowest=1)  # not journaled: not asked


@pytest.mark.parametrize("journaled", [False, True], ids=["plain", "journaled"])
def test_cpu_run_reports_every_answer_of_every_session(tmp_path, journaled):
    out = tmp_path / "timeline.json"
    # 50 requests/s, which a 2-core CPU keeps up with: at 200 its steps (15-45 ms) took every symbol, few steps a
    # session, so no symbol was ever out of a step for its checkpoint (0 exports in most runs)
    done = subprocess.run([sys.executable, str(SCRIPT), "--preset", "tiny", "--device", "cpu", "--rate", "50",
                           "--symbols", "4", "--requests", "60", "--sessions", "2", "--slowest", "2",
                           "--json", str(out)] + (["--journal-segment-mb", "0.005"] if journaled else []),
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    data = json.loads(out.read_text())
    assert data["device"].startswith("cpu") and len(data["sessions"]) == 2
    for session in data["sessions"]:
        assert ("checkpoints" in session) == journaled
        if journaled:  # segments of ~15 requests: states checkpointed in each session
            assert session["checkpoints"]["exports"] > 0 and session["checkpoints"]["export_max_ms"] > 0
        assert session["answers"] == 60
        assert session["p99_ms"] >= session["p50_ms"] > 0
        for stats in session["segments_all"].values():
            assert stats["max"] >= stats["p90"] >= stats["p50"] >= -0.01  # one clock for both processes
        assert set(session["stalls"]) == {"server", "client"} and len(session["slowest"]) == 2
    assert "== session 1:" in done.stdout and "slowest answers" in done.stdout


def test_bad_options_are_refused(capsys):
    with pytest.raises(SystemExit):
        _load().main(["--requests", "3", "--symbols", "4"])
    assert "--requests >= --symbols" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--preset", "huge"], "argument --preset: invalid choice: 'huge'"),
    (["--seed", "-1"], "argument --seed: must be a non-negative integer, got '-1'"),
    # refused before the sessions, not after them
    (["--json", "/nonexistent-folder/t.json"], "argument --json: no such folder: /nonexistent-folder"),
    (["--journal-segment-mb", "0"], "argument --journal-segment-mb: must be a positive number, got '0'"),
])
def test_ordinary_mistakes_are_one_line_before_the_run(args, message):
    done = subprocess.run([sys.executable, str(SCRIPT), "--preset", "tiny", "--device", "cpu", "--symbols", "2",
                           "--requests", "4", "--sessions", "1", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [done.stderr.strip()]
    assert done.stderr.startswith(f"e2e_timeline.py: error: {message}")


@pytest.mark.parametrize("args, message", [
    (["--rate", "nan"], "argument --rate: must be a positive number, got 'nan'"),  # failed once the engine was up
    (["--rate", "1e-9"], "argument --rate: must be at least 0.001 requests/s (a stream's gaps are at most a day), "
                         "got '1e-9'"),
    (["--slowest", "-1"], "argument --slowest: must be a positive integer, got '-1'"),  # listed all answers but one
])
def test_numbers_out_of_range_are_refused_at_parse(args, message, usage_error):
    assert message in usage_error(_load().main, ["--preset", "tiny", "--device", "cpu", *args])


def test_a_stacks_folder_that_cannot_be_made_or_written_is_refused_before_the_model_loads(tmp_path, monkeypatch,
                                                                                         usage_error):
    (tmp_path / "taken").write_text("")
    monkeypatch.setattr("client.model.load_model", lambda *args, **kwargs: pytest.fail("the model was loaded"))
    for folder, why in ((tmp_path / "taken", "File exists"), ("/proc", "")):  # /proc takes no file, even for root
        error = usage_error(_load().main, ["--preset", "tiny", "--device", "cpu", "--stacks", str(folder)])
        assert f"--stacks {folder}: cannot write in it: {why}" in error


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_without_cuda_is_one_line():
    done = subprocess.run([sys.executable, str(SCRIPT), "--preset", "tiny", "--device", "cuda"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stderr.startswith("e2e_timeline.py: error: --device cuda, but ")
    assert done.stderr.strip().splitlines() == [done.stderr.strip()]


def test_a_cpu_run_that_cannot_fit_in_host_memory_says_what_it_needs():
    module = _load()
    assert module.host_memory_problem("tiny", 20, available=2**30 + 10**8) is None
    problem = module.host_memory_problem("full", 20, available=24 * 10**9)
    assert "needs about 26.2 GB of host memory" in problem and "24.0 GB is available" in problem
    out = subprocess.run([sys.executable, str(SCRIPT), "--preset", "full", "--device", "cpu", "--symbols", "100000",
                          "--requests", "100000"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.strip().startswith("e2e_timeline.py: error: the full preset with "
                                                                 "100000 symbols needs about")
    assert "Traceback" not in out.stderr
