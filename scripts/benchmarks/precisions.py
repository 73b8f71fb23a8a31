"""Section precisions: per weight precision of --precisions, what it chose, its step time and its accuracy."""
from client.accuracy import format_table
from scripts.benchmarks.harness import MAX_BATCH, SHORT_BATCHES, measure_steps
from scripts.benchmarks.report import gate_line, step_cells


def run(bench):
    """Per weight precision: what it chose, its step time at B = 1, 20, 64 and its accuracy on every family."""
    bandwidth, suite = bench.copy_bandwidth(), bench.suite
    results = {}
    for precision in bench.args.precisions:
        name = precision.spec
        engine = bench.build_engine(precision=precision, capacity=max(suite.symbols, MAX_BATCH))
        row = {"precision": precision.describe(),
               "step_ms": measure_steps(engine, bench, bandwidth, SHORT_BATCHES),
               "accuracy": suite.measure(engine, prefix=f"{name}/")}
        results[name] = row
        bench.report.update(precisions=results)
        bench.progress(f"precision {name}:\n" + format_table(row["accuracy"]))
        del engine
        bench.free_gpu()
    return results


def summary(data) -> list[str]:
    return [f"precision {name}: step ms {step_cells(row['step_ms'])}; {gate_line(row['accuracy'])}"
            for name, row in data.get("precisions", {}).items()]
