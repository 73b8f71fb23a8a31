"""scripts/shard_hop.py: the same engine in this process, behind a process pipe and behind a Ray actor, timed in
turn (a CPU smoke run on the tiny preset)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import checkout_env

pytest.importorskip("ray", reason="the Ray tests need the extra: pip install -e '.[test]'")

REPO = Path(__file__).resolve().parents[1]


def test_smoke_run_times_every_transport(tmp_path):
    out = tmp_path / "hop.json"
    done = subprocess.run([sys.executable, "scripts/shard_hop.py", "--presets", "tiny", "--batches", "1,2",
                           "--rounds", "2", "--steps", "3", "--warmup", "1", "--json", str(out)],
                          cwd=REPO, env=checkout_env(REPO), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())["presets"]["tiny"]
    for transport in ("in_process", "process", "ray"):
        assert set(result["step_ms"][transport]) == {"1", "2"}
        assert all(len(times) == 2 and min(times) > 0 for times in result["rounds_ms"][transport].values())
    assert result["where"]["ray"].startswith("Ray actor on node") and result["where"]["process"] == "process on cpu"
    for transport in ("process", "ray"):
        for batch, overhead in result["overhead_ms"][transport].items():
            assert overhead == pytest.approx(result["step_ms"][transport][batch] - result["step_ms"]["in_process"][batch])
    assert "| tiny | 1 |" in done.stdout and "| tiny | 2 |" in done.stdout
