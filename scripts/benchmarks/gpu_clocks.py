"""The GPU's clocks, power, temperature and clock-event (throttle) reasons sampled by nvidia-smi every 100 ms while
a bench section runs (`bench.py --gpu-clocks`): on a host whose steps have a long p99, this says whether the GPU
itself slowed (a power cap, a thermal or hardware slowdown) or ran at full clock while the host was late
(bench/LOG.md section 52)."""
import shutil
import subprocess
import threading

import numpy as np

# NVML's clock-event reasons (nvmlClocksEventReasons*), the bits of nvidia-smi's *_reasons.active field
REASONS = {0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
           0x10: "sync_boost", 0x20: "sw_thermal_slowdown", 0x40: "hw_thermal_slowdown",
           0x80: "hw_power_brake_slowdown", 0x100: "display_clock_setting"}
# The reasons' field was clocks_throttle_reasons.active before drivers renamed it; whichever this one knows.
REASON_FIELDS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")
FIELDS = ("clocks.sm", "clocks.mem", "power.draw", "temperature.gpu")


def reasons(mask: int) -> list[str]:
    """The names of the reasons set in `mask` (unknown bits as hex)."""
    named = [name for bit, name in REASONS.items() if mask & bit]
    unknown = mask & ~sum(REASONS)
    return named + ([hex(unknown)] if unknown else [])


def _number(text):
    try:
        return float(text)
    except ValueError:  # "[N/A]", "[Not Supported]"
        return float("nan")


class GpuClocks:
    """Samples GPU `index` in a background nvidia-smi process from __enter__ to __exit__; summary() after."""

    def __init__(self, index: int = 0, period_ms: int = 100, command: str = "nvidia-smi"):
        path = shutil.which(command)
        if path is None:
            raise RuntimeError(f"--gpu-clocks needs {command} on PATH (it samples the GPU's clocks)")
        self.index, self.period_ms, self.command = index, period_ms, path
        self.rows: list[tuple[float, ...]] = []
        self._process = self._reader = None
        self.reason_field = next((field for field in REASON_FIELDS if self._query_once(field)), None)
        if self.reason_field is None:
            raise RuntimeError(f"{command} answered no query of GPU {index}'s clocks ({', '.join(REASON_FIELDS)})")

    def _query(self, reason_field, *loop):
        return [self.command, f"--id={self.index}", "--query-gpu=" + ",".join((*FIELDS, reason_field)),
                "--format=csv,noheader,nounits", *loop]

    def _query_once(self, reason_field) -> bool:
        try:
            done = subprocess.run(self._query(reason_field), capture_output=True, text=True, timeout=30)
        except subprocess.TimeoutExpired:
            return False
        lines = done.stdout.strip().splitlines()
        return done.returncode == 0 and bool(lines) and self._parse(lines[0]) is not None

    def _parse(self, line):
        parts = [part.strip() for part in line.split(",")]
        if len(parts) != len(FIELDS) + 1:
            return None
        try:
            mask = int(parts[-1], 16)
        except ValueError:
            return None
        return (*(_number(part) for part in parts[:-1]), mask)

    def __enter__(self):
        self._process = subprocess.Popen(self._query(self.reason_field, f"-lms={self.period_ms}"),
                                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self._reader = threading.Thread(target=self._read, name="gpu-clocks", daemon=True)
        self._reader.start()
        return self

    def _read(self):
        for line in self._process.stdout:
            row = self._parse(line)
            if row is not None:
                self.rows.append(row)

    def __exit__(self, *exc):
        self._process.terminate()
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._reader.join(timeout=10)
        return False

    def summary(self) -> dict:
        """{samples, sm_mhz and mem_mhz {min, p50, max}, power_w_max, temperature_c_max, reasons: {name: share of
        the samples with it set}}; gpu_idle is left out of reasons (between steps the GPU is idle by design)."""
        if not self.rows:
            return {"samples": 0}
        table = np.array([row[:-1] for row in self.rows])
        masks = [row[-1] for row in self.rows]

        def spread(column):
            values = table[:, column]
            return {"min": float(np.nanmin(values)), "p50": float(np.nanmedian(values)),
                    "max": float(np.nanmax(values))}

        counts: dict[str, int] = {}
        for mask in masks:
            for name in reasons(mask & ~0x1):
                counts[name] = counts.get(name, 0) + 1
        return {"samples": len(self.rows), "sm_mhz": spread(0), "mem_mhz": spread(1),
                "power_w_max": float(np.nanmax(table[:, 2])), "temperature_c_max": float(np.nanmax(table[:, 3])),
                "reasons": {name: count / len(masks) for name, count in sorted(counts.items())}}


def describe(summary: dict) -> str:
    """One line of a section's summary()."""
    if not summary.get("samples"):
        return "no samples"
    sm = summary["sm_mhz"]
    said = ", ".join(f"{name} {share:.0%}" for name, share in summary["reasons"].items()) or "none"
    return (f"SM {sm['p50']:.0f} MHz p50 ({sm['min']:.0f}-{sm['max']:.0f}), power max {summary['power_w_max']:.0f} W, "
            f"{summary['temperature_c_max']:.0f} C max; clock-event reasons (share of {summary['samples']} samples): "
            f"{said}")
