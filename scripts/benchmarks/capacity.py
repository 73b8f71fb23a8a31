"""Section capacity: the symbols held with the default options, on the GPU and in host memory, and new symbols
arriving mid-stream."""
import numpy as np

from client import event_loop
from client.model.config import NUM_FEATURES
from client.streams import Stream
from scripts.benchmarks.harness import E2E_RATE
from scripts.benchmarks.report import fmt
from scripts.benchmarks.serving import ReferenceTracker, prefixed_names, serve_stream, served_step_ms, session_numbers

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
    """Symbols held with the default options (bench.tiered_engine: on a GPU the GPU's share of free memory and the
    host tier's rule), and the host memory they were sized from; then new symbols arriving mid-stream at 400 req/s
    into that engine (--quick: 100 req/s, which a CPU serves): the end-to-end p99, missed requests, and every
    step's time from the runtime's step log (none of at most 20 symbols over 5 ms)."""
    from client.engine.fast import STATE_MEMORY

    counts = bench.counts
    stream = arrival_stream("NEW_", counts.new_symbols, counts.arrival_seconds, counts.arrival_rate,
                            bench.args.seed + 5)
    tracker = ReferenceTracker(bench.model, np.unique(stream.symbols).tolist(), bench.device)
    targets = tracker.targets(stream)
    del tracker
    bench.free_gpu()
    engine = bench.tiered_engine()
    host_total, host_available = bench.host_memory_before_tiers
    table = engine.table
    args = bench.args
    session = event_loop.run(serve_stream(engine, stream, targets, counts.arrival_rate, args.preset, args.seed,
                                          args.pipeline_min_batch, timeline=True,
                                          max_requests_per_symbol=args.max_requests_per_symbol,
                                          stacks_dir=args.stacks, **bench.forming()))
    numbers, steps = session_numbers(session), session["timeline"]["steps"]
    small = served_step_ms(steps, 20)
    result = {"symbols_held": table.capacity + table.host_capacity, "symbols_at_budget": table.capacity,
              "host_symbols": table.host_capacity, "state_memory": STATE_MEMORY, "reserve": table.reserve,
              "state_bytes_per_symbol": engine.state_bytes, "host_bytes": table.host_bytes,
              "host_pin_s": table.pin_s, "host_total_bytes": host_total, "host_available_bytes": host_available,
              "gpu_free_bytes": bench.gpu_free_before_tiers,
              "engine_startup_s": engine.startup_s, "new_symbols": counts.new_symbols, "rate": counts.arrival_rate,
              **numbers,
              "steps": len(steps),
              "step_ms_max_b20": float(small.max()) if small.size else None,
              "step_ms_p99_b20": float(np.percentile(small, 99)) if small.size else None,
              "steps_over_limit": int((small > STEP_LIMIT_MS).sum())}
    engine.release(np.unique(stream.symbols).tolist())
    return result


def run(bench):
    bench.record("capacity", measure_capacity(bench))
    if "swap" not in bench.args.sections:
        bench.close_tiered_engine()


def summary(data) -> list[str]:
    c = data.get("capacity")
    return [] if c is None else [
        f"capacity: {c['symbols_held']} symbols held with the default options: {c['symbols_at_budget']} on the "
        f"GPU at {c['state_memory']:.0%} of free memory, {c['host_symbols']} in host memory "
        f"({c['host_bytes'] / 2**30:.1f} GiB of {c['host_available_bytes'] / 2**30:.1f} GiB available, pinned in "
        f"{fmt(c['host_pin_s'], 1)} s); {c['new_symbols']} new symbols at {c.get('rate', E2E_RATE):g} req/s: p50 "
        f"{fmt(c['p50_ms'])} ms, p99 {fmt(c['p99_ms'])} ms, missed {c['missed']}, slowest step of B <= 20 "
        f"{fmt(c['step_ms_max_b20'])} ms ({c['steps_over_limit']} over {STEP_LIMIT_MS:g} ms)"]
