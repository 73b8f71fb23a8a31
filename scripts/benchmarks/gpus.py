"""Section gpus: the towers spread over N GPUs of this machine, for each N of --gpus."""
import time

import numpy as np

from client.model.config import NUM_FEATURES
from scripts.benchmarks.harness import E2E_SYMBOLS, MAX_BATCH, SHORT_BATCHES, measure_steps, median_p99, step_symbols
from scripts.benchmarks.report import fmt
from scripts.benchmarks.serving import measure_e2e


def measure_submits(engine, counts, seed, batches=SHORT_BATCHES) -> dict:
    """{B: median and p99 ms} of a submitted step and its predictions back on the host (wall clock): what the
    runtime waits for. With towers on several GPUs this is the step's time (each GPU's staged graph writes its
    columns to the host; step_slots instead joins them on the first GPU)."""
    symbols = step_symbols()
    rng = np.random.default_rng(seed)
    results = {}
    for batch in batches:
        features = rng.standard_normal((batch, NUM_FEATURES)).astype(np.float32)
        times = []
        for i in range(counts.step_warmup + counts.step_iters):
            begin = time.perf_counter()
            engine.submit(symbols[:batch], features).result()
            times.append((time.perf_counter() - begin) * 1000.0)
        median, p99 = median_p99(times[counts.step_warmup:])
        results[str(batch)] = {"median": median, "p99": p99}
    engine.release(symbols)
    return results


def run(bench):
    """Step times with the slowest GPU's floor, submit-to-result times, and end-to-end at 400 req/s over 20
    symbols."""
    bandwidth = bench.copy_bandwidth()
    results = {}
    for gpus in bench.gpu_counts():
        engine = bench.build_engine(devices=bench.devices(gpus), capacity=MAX_BATCH + E2E_SYMBOLS)
        row = {"towers": engine.describe()["towers"],
               "step_ms": measure_steps(engine, bench, bandwidth, SHORT_BATCHES),
               "submit_ms": measure_submits(engine, bench.counts, bench.args.seed),
               "e2e_400rps_20sym": measure_e2e(engine, bench, prefix=f"G{gpus}_")}
        results[str(gpus)] = row
        bench.report.update(gpus=results)
        del engine
        bench.free_gpu()
    return results


def summary(data) -> list[str]:
    lines = []
    for gpus, row in data.get("gpus", {}).items():
        steps = ", ".join(f"B={b} {r['median']:.3f} ({r['median'] / r['floor']:.2f}x)"
                          for b, r in row["step_ms"].items())
        e2e = row["e2e_400rps_20sym"]
        submits = ", ".join(f"B={b} {r['median']:.3f}" for b, r in row["submit_ms"].items())
        lines.append(f"{gpus} GPU(s) {row['towers']}: step ms {steps}; submit->result ms {submits}; e2e p50 "
                     f"{fmt(e2e['p50_ms'])} ms, p99 {fmt(e2e['p99_ms'])} ms")
    return lines
