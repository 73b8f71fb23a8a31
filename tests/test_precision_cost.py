"""scripts/precision_cost.py: engines of several precisions timed in turn (a CPU smoke run on the tiny preset)."""
import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "precision_cost.py"


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600)


def test_times_each_spec_in_turn(tmp_path):
    out = tmp_path / "cost.json"
    result = run("auto;fp32", "--preset", "tiny", "--device", "cpu", "--rounds", "2", "--iters", "2",
                 "--batches", "1,3", "--json", str(out))
    assert result.returncode == 0, result.stderr
    data = json.loads(out.read_text())
    assert set(data["median_ms"]) == {"auto", "fp32"} and data["rounds"] == 2
    assert all(len(rounds) == 2 and min(rounds) > 0 for row in data["round_ms"].values() for rounds in row.values())
    assert data["weight_bytes"]["fp32"] > data["weight_bytes"]["auto"]  # 4 bytes a weight against mostly 2
    lines = result.stdout.splitlines()
    assert lines[0].startswith("auto") and "(+0.0%)" in lines[0] and lines[1].startswith("fp32")


def test_bad_spec_is_one_line():
    result = run("auto;bf17", "--preset", "tiny", "--device", "cpu")
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "unknown precision 'bf17'" in result.stderr
