"""Section state_dtypes: per state storage of --state-dtypes, the symbols it holds, its step time and accuracy."""
from client.accuracy import format_table
from scripts.benchmarks.harness import MAXRATE_SYMBOLS, SHORT_BATCHES, measure_steps
from scripts.benchmarks.report import gate_line, step_cells


def run(bench):
    """Per state storage: symbols held at the default memory budget, step times and accuracy on every family (long
    streams included, where rounding in the state accumulates)."""
    from client.engine.fast import STATE_MEMORY

    bandwidth, suite = bench.copy_bandwidth(), bench.suite
    results = {}
    for storage in bench.args.state_dtypes:
        name = storage.spec
        engine = bench.build_engine(state_storage=storage, capacity=max(suite.symbols, MAXRATE_SYMBOLS))
        row = {"state_bytes_per_symbol": engine.state_bytes,
               "symbols_at_budget": bench.symbols_at_budget(engine, STATE_MEMORY),
               "step_ms": measure_steps(engine, bench, bandwidth, SHORT_BATCHES),
               "accuracy": suite.measure(engine, prefix=f"state-{name}/")}
        results[name] = row
        bench.report.update(state_dtypes=results)
        bench.progress(f"state {name}: {row['symbols_at_budget']} symbols at {STATE_MEMORY:.0%} of free "
                       f"memory\n" + format_table(row["accuracy"]))
        del engine
        bench.free_gpu()
    return results


def summary(data) -> list[str]:
    return [f"state {name}: {row['symbols_at_budget']} symbols at the budget; step ms {step_cells(row['step_ms'])}; "
            f"{gate_line(row['accuracy'])}" for name, row in data.get("state_dtypes", {}).items()]
