"""Section state_rates: the highest rate over 64 symbols for each 16-bit state storage of --state-dtypes."""
from scripts.benchmarks.harness import MAXRATE_SYMBOLS
from scripts.benchmarks.report import rate_text
from scripts.benchmarks.serving import search_max_rate


def run(bench):
    """Once per size of state (the rate depends on the bytes moved, not on how they round; fp32's is the maxrate
    section's)."""
    bench.close_engine()
    results, rated = {}, set()
    for storage in bench.args.state_dtypes:
        if not storage.sixteen_bit:
            continue
        name = storage.spec
        engine = bench.build_engine(state_storage=storage, capacity=MAXRATE_SYMBOLS)
        if engine.state_bytes not in rated:
            rated.add(engine.state_bytes)
            tag = "".join(c if c.isalnum() else "_" for c in name)
            # from the fp32 state's rate on: the smaller state only moves fewer bytes
            start = bench.report.data.get("max_rate_p99_50ms") or 0
            rates = [rate for rate in bench.counts.rates if rate >= start] or bench.counts.rates
            best, runs = search_max_rate(engine, bench, prefix=f"ST{tag}_", key=f"state_{tag}_rate", rates=rates)
            results[name] = {"state_bytes_per_symbol": engine.state_bytes, "max_rate_p99_50ms": best, "runs": runs}
            bench.report.update(state_rates=results)
        del engine
        bench.free_gpu()
    return results


def summary(data) -> list[str]:
    return [f"state {name} ({row['state_bytes_per_symbol'] / 2**20:.1f} MiB a symbol): max rate over "
            f"{MAXRATE_SYMBOLS} symbols {rate_text(row['max_rate_p99_50ms'])}"
            for name, row in data.get("state_rates", {}).items()]
