"""Section capacity: the symbols held at the default memory budget, and new symbols arriving mid-stream."""
import numpy as np

from client.model.config import NUM_FEATURES
from client.streams import Stream
from scripts.benchmarks.harness import E2E_RATE
from scripts.benchmarks.report import fmt
from scripts.benchmarks.serving import ReferenceTracker, prefixed_names, serve

STEP_LIMIT_MS = 5.0  # no step of B <= 20 over this while new symbols arrive


def arrival_stream(prefix, num_symbols, seconds, rate, seed):
    """A stream at `rate` in which `num_symbols` symbols appear one after another over its first half, each
    request going to a symbol already seen (so new symbols keep arriving mid-stream)."""
    rng = np.random.default_rng(seed)
    total = max(int(rate * seconds), 2 * num_symbols)
    names = np.array(prefixed_names(prefix, num_symbols))
    seen = np.minimum(np.arange(total) * 2 * num_symbols // total + 1, num_symbols)  # symbols seen so far
    choice = (rng.random(total) * seen).astype(np.int64)
    choice[np.arange(num_symbols) * total // (2 * num_symbols)] = np.arange(num_symbols)  # each one's arrival
    features = rng.standard_normal((total, NUM_FEATURES)).astype(np.float32)
    return Stream(names[choice], features, np.full(total, 1000.0 / rate))


def measure_capacity(bench):
    """Symbols held at the default memory budget; then new symbols arriving mid-stream at 400 req/s into that
    engine: the end-to-end p99, missed requests, and every step's GPU time (none of B <= 20 over 5 ms)."""
    from client.engine.fast import STATE_MEMORY

    counts = bench.counts
    stream = arrival_stream("NEW_", counts.new_symbols, counts.arrival_seconds, E2E_RATE, bench.args.seed + 5)
    tracker = ReferenceTracker(bench.model, np.unique(stream.symbols).tolist(), bench.device)
    targets = tracker.targets(stream)
    del tracker
    bench.close_engine()  # the budget is a share of the memory free now
    bench.drop(None)
    engine = bench.build_engine(state_memory=STATE_MEMORY if bench.device.type == "cuda" else None,
                                capacity=None if bench.device.type == "cuda" else counts.new_symbols,
                                time_steps=bench.device.type == "cuda")
    numbers = serve(bench, engine, stream, targets, E2E_RATE)
    steps = np.array(engine.step_times or [(0, 0.0)])
    small = steps[steps[:, 0] <= 20, 1]
    result = {"symbols_at_budget": engine.table.capacity, "state_memory": STATE_MEMORY,
              "state_bytes_per_symbol": engine.state_bytes, "new_symbols": counts.new_symbols, **numbers,
              "steps": len(engine.step_times or []),
              "step_ms_max_b20": float(small.max()) if small.size else None,
              "step_ms_p99_b20": float(np.percentile(small, 99)) if small.size else None,
              "steps_over_limit": int((small > STEP_LIMIT_MS).sum())}
    bench.drop(engine)
    return result


def run(bench):
    result = measure_capacity(bench)
    bench.report.update(capacity=result)
    bench.progress(f"capacity: {result}")


def summary(data) -> list[str]:
    if "capacity" not in data:
        return []
    c = data["capacity"]
    return [f"capacity: {c['symbols_at_budget']} symbols at {c['state_memory']:.0%} of free memory; "
            f"{c['new_symbols']} new symbols at {E2E_RATE:g} req/s: p50 {fmt(c['p50_ms'])} ms, p99 "
            f"{fmt(c['p99_ms'])} ms, missed {c['missed']}, slowest step of B <= 20 "
            f"{fmt(c['step_ms_max_b20'])} ms ({c['steps_over_limit']} over {STEP_LIMIT_MS:g} ms)"]
