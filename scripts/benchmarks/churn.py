"""Section churn: symbols leaving and returning through a GPU tier smaller than them."""
import time

import numpy as np

from client.model.config import NUM_FEATURES

SUMMARY = ("churn: {symbols} symbols through {gpu_slots} GPU slots, {offloaded} offloads, {restored} returns, "
           "bit-equal to never offloaded: {bit_equal}; step ms p50 {step_ms_p50:.2f} p99 {step_ms_p99:.2f} "
           "max {step_ms_max:.2f}")


def measure_churn(bench):
    """States offloaded to host memory and brought back give the same predictions, bit for bit, as an engine that
    never offloads; a symbol that left (released) and comes back starts afresh, as in both engines."""
    counts = bench.counts
    symbols = [f"CHURN_{i:03d}" for i in range(counts.churn_symbols)]
    tight = bench.build_engine(capacity=counts.churn_capacity, host_symbols=counts.churn_symbols, reserve=1,
                               max_batch=counts.churn_capacity)
    roomy = bench.build_engine(capacity=counts.churn_symbols, host_symbols=0, max_batch=counts.churn_capacity)
    rng = np.random.default_rng(bench.args.seed + 6)
    equal, worst, step_ms = True, 0.0, []
    for step in range(counts.churn_steps):
        batch = [str(s) for s in rng.choice(symbols, int(rng.integers(1, counts.churn_capacity + 1)), replace=False)]
        features = rng.standard_normal((len(batch), NUM_FEATURES)).astype(np.float32)
        begin = time.perf_counter()
        got = tight.step(batch, features)
        step_ms.append((time.perf_counter() - begin) * 1000.0)
        want = roomy.step(batch, features)
        equal &= bool(np.array_equal(got, want))
        worst = max(worst, float(np.abs(got - want).max()))
        if step % 25 == 24:  # a symbol leaves; it may come back later as a new one
            gone = [str(rng.choice(symbols))]
            tight.release(gone)
            roomy.release(gone)
    result = {"symbols": counts.churn_symbols, "gpu_slots": counts.churn_capacity, "steps": counts.churn_steps,
              "bit_equal": equal, "max_abs_diff": worst, **tight.table.stats,
              "step_ms_p50": float(np.median(step_ms)), "step_ms_p99": float(np.percentile(step_ms, 99)),
              "step_ms_max": float(np.max(step_ms))}
    del tight, roomy
    bench.free_gpu()
    return result


def run(bench):
    bench.record("churn", measure_churn(bench))


def summary(data) -> list[str]:
    return [SUMMARY.format(**data["churn"])] if "churn" in data else []
