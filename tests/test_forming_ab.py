"""scripts/forming_ab.py: the runtime's two step-forming rules served in turn by one engine (a CPU smoke run)."""
import json
import subprocess
import sys
from pathlib import Path

from conftest import checkout_env

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "forming_ab.py"


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600,
                          env=checkout_env(REPO))


def test_each_pair_serves_both_rules_on_the_same_stream(tmp_path):
    out = tmp_path / "ab.json"
    result = run("--preset", "tiny", "--device", "cpu", "--pairs", "2", "--e2e-requests", "20", "--rates", "",
                 "--json", str(out))  # the rate pairs are the same sessions over 64 symbols
    assert result.returncode == 0, result.stderr[-3000:]
    sessions = json.loads(out.read_text())["sessions"]
    assert [(s["kind"], s["pair"], s["rule"]) for s in sessions] == [
        ("e2e", 0, "late"), ("e2e", 0, "early"), ("e2e", 1, "early"), ("e2e", 1, "late")]  # alternating
    for s in sessions:  # every request answered, and right: both rules continue the reference's states
        assert s["missed"] == 0 and s["responses"] == s["requests"] and s["accuracy"] == 1.0
        assert 0 < s["p50_ms"] <= s["p99_ms"]
    assert all(s["requests"] == 20 for s in sessions)
    assert result.stdout.count("late p50") == 2


def test_bad_rate_is_one_line():
    result = run("--preset", "tiny", "--device", "cpu", "--rates", "100,-5")
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0 and "-5" in result.stderr
