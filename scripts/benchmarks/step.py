"""Section step: the engine's step time at each batch size against its memory floor."""
from scripts.benchmarks.harness import measure_steps


def run(bench):
    bandwidth = bench.copy_bandwidth()  # before the engine: the floors need it even where the engine fails
    bench.report.update(step_ms=measure_steps(bench.engine, bench, bandwidth))


def summary(data) -> list[str]:
    if "step_ms" not in data:
        return []
    lines = [f"{'B':>4} {'median ms':>10} {'p99 ms':>10} {'floor ms':>10} {'x floor':>8}"]
    for batch, row in data["step_ms"].items():
        lines.append(f"{batch:>4} {row['median']:>10.3f} {row['p99']:>10.3f} {row['floor']:>10.3f} "
                     f"{row['median'] / row['floor']:>8.2f}")
    return lines
