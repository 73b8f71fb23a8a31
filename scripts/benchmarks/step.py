"""Section step: the engine's step time at each batch size against its memory floor."""
from scripts.benchmarks.harness import measure_step_room, measure_step_rows, measure_steps


def run(bench):
    bandwidth = bench.copy_bandwidth()  # before the engine: the floors need it even where the engine fails
    bench.report.update(step_ms=measure_steps(bench.engine, bench, bandwidth))
    bench.report.update(step_room_ms=measure_step_room(bench.engine, bench))
    bench.report.update(step_rows_ms=measure_step_rows(bench.engine, bench, bandwidth))


def summary(data) -> list[str]:
    if "step_ms" not in data:
        return []
    lines = [f"{'B':>4} {'median ms':>10} {'p99 ms':>10} {'floor ms':>10} {'x floor':>8}"]
    for batch, row in data["step_ms"].items():
        lines.append(f"{batch:>4} {row['median']:>10.3f} {row['p99']:>10.3f} {row['floor']:>10.3f} "
                     f"{row['median'] / row['floor']:>8.2f}")
    for key, row in (data.get("step_room_ms") or {}).items():
        what = f"{key} copies in and out included" if "staged" in key else f"{key} (room for joins)"
        lines.append(f"step {what}, {row['rows']} rows: median {row['median']:.3f} ms, p99 {row['p99']:.3f} ms")
    if "step_rows_ms" in data:
        lines.append(f"{'symbols':>8} {'rows':>6} {'median ms':>10} {'p99 ms':>10} {'floor ms':>10} {'x floor':>8} "
                     f"{'requests/s':>11}")
        for row in data["step_rows_ms"].values():
            lines.append(f"{row['symbols']:>8} {row['rows']:>6} {row['median']:>10.3f} {row['p99']:>10.3f} "
                         f"{row['floor']:>10.3f} {row['median'] / row['floor']:>8.2f} "
                         f"{1000 * row['rows'] / row['median']:>11.0f}")
    return lines
