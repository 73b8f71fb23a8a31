"""scripts/benchmarks/gpu_sharing.py: whether a bench run's GPU is its own, from the memory held before the run and a
stand-in nvidia-smi (a script printing what the real one prints), so that the parsing runs without a GPU."""
import os
import sys

import pytest

from scripts import bench as bench_module
from scripts.benchmarks import gpu_sharing

FAKE = '''#!{python}
import sys
query = next(a for a in sys.argv if a.startswith("--query-"))
if {fail}:
    sys.exit(6)
if query.startswith("--query-compute-apps"):
    print("{own}, 612")
    print("4242, 12800")
    print("4343, [N/A]")
else:
    print("{util}")
'''


def fake_smi(tmp_path, util="0", fail=False):
    path = tmp_path / "nvidia-smi"
    path.write_text(FAKE.format(python=sys.executable, own=os.getpid(), util=util, fail=fail))
    path.chmod(0o755)
    return str(path)


def test_other_processes_listed_without_this_one(tmp_path):
    others = gpu_sharing.processes(0, fake_smi(tmp_path))
    assert others == [{"pid": 4242, "used_bytes": 12800 * 2**20}, {"pid": 4343, "used_bytes": None}]


def test_utilization_sampled(tmp_path):
    assert gpu_sharing.utilization(0, fake_smi(tmp_path, util="37"), samples=3, period_s=0) == [37.0, 37.0, 37.0]


@pytest.mark.parametrize("command", ["no-such-smi", "failing"])
def test_without_an_answer_from_nvidia_smi_none(tmp_path, command):
    if command == "failing":
        command = fake_smi(tmp_path, fail=True)
    assert gpu_sharing.processes(0, command) is None
    assert gpu_sharing.utilization(0, command, samples=2, period_s=0) is None


def test_verdict_names_each_sign_of_another_process():
    gib = 2**30
    alone = gpu_sharing.verdict(80 * gib, 79.4 * gib, [], [])
    assert alone == {"shared": False, "why": ""}
    held = gpu_sharing.verdict(80 * gib, 66 * gib, None, [])
    assert held["shared"] and "14.0 GiB of 80.0 GiB held before the run" in held["why"]
    both = gpu_sharing.verdict(80 * gib, 79.4 * gib, [{"pid": 7, "used_bytes": 2 * gib}], [12.0, 0.0, 40.0])
    assert both["shared"] and "pid 7 2.0 GiB" in both["why"]
    assert "utilisation up to 40% in 2 of 3 samples while this run was idle" in both["why"]
    assert gpu_sharing.verdict(80 * gib, 79.4 * gib, None, [3.0, 0.0, 0.0, 0.0, 0.0])["shared"] is False  # one blip
    assert gpu_sharing.verdict(80 * gib, 79.4 * gib, None, None)["shared"] is False  # nvidia-smi said nothing


def test_bench_warns_and_records_a_shared_gpu(monkeypatch, tmp_path):
    """bench.main on a GPU records gpu_at_start and warns in its progress log when the GPU is shared (the snapshot
    stood in for: no GPU here)."""
    shared = {"total_bytes": 1, "free_bytes": 0, "held_bytes": 1, "other_processes": [], "utilization_pct": [50.0],
              "shared": True, "why": "utilisation 50% while this run was idle"}
    seen = {}

    class Args:
        device = type("Device", (), {"type": "cuda", "index": 0})()

    monkeypatch.setattr(gpu_sharing, "snapshot", lambda index: shared)
    monkeypatch.setattr(bench_module, "run_sections", lambda bench: seen.update(report=bench.report.data) or [])
    monkeypatch.setattr(bench_module.torch.cuda, "set_device", lambda index: None)
    monkeypatch.setattr(bench_module, "device_name", lambda device: "stand-in GPU")
    monkeypatch.setattr(bench_module, "summary_table", lambda data: "")
    monkeypatch.setattr(bench_module, "Bench", lambda args, report, progress: type("B", (), {"report": report})())
    parsed = bench_module.parse_args(["--quick", "--device", "cpu", "--sections", "copy", "--log-dir", str(tmp_path)])
    parsed.device = Args.device
    monkeypatch.setattr(bench_module, "parse_args", lambda argv: parsed)
    assert bench_module.main([]) == 0
    assert seen["report"]["gpu_at_start"] == shared
    log = next(tmp_path.glob("bench-*.log")).read_text()
    assert "WARNING: this GPU is not the run's alone (utilisation 50% while this run was idle)" in log


def test_summary_table_says_when_the_gpu_was_shared():
    data = {"device": "H100", "preset": "full", "gpu_at_start": {"shared": True, "why": "2 GiB held"}}
    assert "GPU NOT THE RUN'S ALONE: 2 GiB held" in bench_module.summary_table(data)
    assert "NOT THE RUN'S ALONE" not in bench_module.summary_table({**data, "gpu_at_start": {"shared": False}})
