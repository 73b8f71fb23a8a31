"""scripts/benchmarks/gpu_clocks.py: nvidia-smi's samples read back and summed up, against a stand-in nvidia-smi
(a script printing what the real one prints), so that the parsing runs without a GPU."""
import sys
import time

import pytest

from scripts.benchmarks.gpu_clocks import GpuClocks, describe, reasons

FAKE = '''#!{python}
import sys, time
query = next(a for a in sys.argv if a.startswith("--query-gpu="))
if "clocks_event_reasons" in query and {old_driver}:
    print('Field "clocks_event_reasons.active" is not a valid field to query.', file=sys.stderr)
    sys.exit(2)
rows = ["1980, 2619, 350.5, 45, 0x0000000000000000", "1755, 2619, 699.0, 61, 0x0000000000000004",
        "1980, 2619, [N/A], 47, 0x0000000000000001", "1410, 2619, 700.2, 62, 0x000000000000000C"]
if not any(a.startswith("-lms=") for a in sys.argv):
    print(rows[0])
    sys.exit(0)
for i in range(100000):
    print(rows[i % len(rows)], flush=True)
    time.sleep(0.01)
'''


def fake_smi(tmp_path, old_driver=False):
    path = tmp_path / "nvidia-smi"
    path.write_text(FAKE.format(python=sys.executable, old_driver=old_driver))
    path.chmod(0o755)
    return str(path)


def test_reasons_name_the_bits():
    assert reasons(0) == []
    assert reasons(0x4 | 0x8) == ["sw_power_cap", "hw_slowdown"]
    assert reasons(0x1 | 0x4000) == ["gpu_idle", "0x4000"]


@pytest.mark.parametrize("old_driver", [False, True])
def test_samples_summed_up_per_section(tmp_path, old_driver):
    clocks = GpuClocks(0, period_ms=10, command=fake_smi(tmp_path, old_driver))
    assert clocks.reason_field == ("clocks_throttle_reasons.active" if old_driver else "clocks_event_reasons.active")
    with clocks:
        deadline = time.monotonic() + 20
        while len(clocks.rows) < 8 and time.monotonic() < deadline:
            time.sleep(0.01)
    out = clocks.summary()
    assert out["samples"] >= 8
    assert out["sm_mhz"]["min"] == 1410 and out["sm_mhz"]["max"] == 1980 and out["mem_mhz"]["p50"] == 2619
    assert out["power_w_max"] == 700.2 and out["temperature_c_max"] == 62  # [N/A] read as no number
    assert set(out["reasons"]) == {"sw_power_cap", "hw_slowdown"}  # gpu_idle is no slowdown
    assert 0.4 < out["reasons"]["sw_power_cap"] < 0.6 and 0.2 < out["reasons"]["hw_slowdown"] < 0.3
    assert "sw_power_cap" in describe(out) and "SM" in describe(out)
    assert describe({"samples": 0}) == "no samples"


def test_without_nvidia_smi_a_clear_error(tmp_path):
    with pytest.raises(RuntimeError, match="needs no-such-smi on PATH"):
        GpuClocks(0, command="no-such-smi")
    silent = tmp_path / "nvidia-smi"
    silent.write_text(f"#!{sys.executable}\nimport sys; sys.exit(9)\n")
    silent.chmod(0o755)
    with pytest.raises(RuntimeError, match="answered no query"):
        GpuClocks(0, command=str(silent))


def test_bench_refuses_gpu_clocks_without_a_gpu_or_nvidia_smi(usage_error):
    from test_bench import _load_bench
    assert "--gpu-clocks samples a CUDA GPU" in usage_error(_load_bench().parse_args,
                                                            ["--device", "cpu", "--gpu-clocks"])


def test_bench_records_each_sections_clocks(tmp_path, monkeypatch):
    """run_sections samples through each section and records its summary under gpu_clocks[section]."""
    import torch
    from test_bench import _load_bench

    from scripts.benchmarks.report import Report
    bench_module = _load_bench()
    smi = fake_smi(tmp_path)
    made = []
    monkeypatch.setattr(bench_module, "GpuClocks",
                        lambda index: made.append(GpuClocks(index, period_ms=10, command=smi)) or made[-1])

    def run(bench):  # a section that lasts until three samples came
        deadline = time.monotonic() + 20
        while len(made[-1].rows) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)

    monkeypatch.setitem(bench_module.SECTIONS, "copy", type("Section", (), {"run": run}))
    lines = []
    bench = type("Bench", (), {"args": type("Args", (), {"sections": ["copy"], "gpu_clocks": True})(),
                               "device": torch.device("cpu"), "report": Report(None), "progress": lines.append})()
    assert bench_module.run_sections(bench) == []
    sampled = bench.report.data["gpu_clocks"]["copy"]
    assert sampled["samples"] >= 3 and sampled["sm_mhz"]["max"] == 1980
    assert any(line.startswith("gpu clocks during copy: SM") for line in lines)
