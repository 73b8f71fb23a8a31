"""scripts/engine_starts.py: the engine started in fresh processes, each start timed and a failed one reported with
its last error line (a CPU smoke run: tiny preset, no kernels to compile)."""
import json
import subprocess
import sys
from pathlib import Path

from conftest import checkout_env

REPO = Path(__file__).resolve().parents[1]


def run(*args):
    return subprocess.run([sys.executable, "-m", "scripts.engine_starts", *args], capture_output=True, text=True,
                          timeout=300, cwd=REPO, env=checkout_env(REPO))


def test_each_start_is_timed(tmp_path):
    out = tmp_path / "starts.json"
    result = run("--starts", "2", "--preset", "tiny", "--device", "cpu", "--json", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    starts = json.loads(out.read_text())
    assert [s["exit_code"] for s in starts] == [0, 0] and all(s["seconds"] > 0 for s in starts)
    assert "2 starts, 0 failed, 0 recovered" in result.stdout


def test_a_failed_start_is_reported_with_its_error():
    result = run("--starts", "1", "--preset", "no_such_preset", "--device", "cpu")
    assert result.returncode == 1
    assert "start 1: FAILED" in result.stdout and "unknown preset 'no_such_preset'" in result.stdout
    assert "1 starts, 1 failed, 0 recovered" in result.stdout


def test_starts_run_side_by_side_with_a_host_tier():
    result = run("--starts", "2", "--parallel", "2", "--host-symbols", "2", "--preset", "tiny", "--device", "cpu")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "start 1: ok" in result.stdout and "start 2: ok" in result.stdout
    assert "2 starts, 0 failed, 0 recovered" in result.stdout


def test_bad_counts_are_one_line_errors():
    for args in (("--starts", "0"), ("--parallel", "0"), ("--host-symbols", "-1")):
        result = run(*args)
        assert result.returncode == 2 and "error: --" in result.stderr.splitlines()[-1], args


def test_what_counts_as_recovered_is_what_precompile_says_of_its_fallbacks():
    """Each mark is in one of precompile's notes on stderr: a note reworded there would count no start as recovered."""
    import inspect

    from client.engine.fast import runner
    from scripts.engine_starts import RECOVERED

    source = inspect.getsource(runner.precompile)
    assert all(mark in source for mark in RECOVERED)
