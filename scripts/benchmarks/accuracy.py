"""Section accuracy: the engine against the fp32 reference on every input family (client/accuracy.py)."""
from client.accuracy import format_table


def run(bench):
    result = bench.suite.measure(bench.engine, prefix="ACC/")
    bench.report.update(accuracy=result)
    bench.progress("accuracy suite:\n" + format_table(result))


def summary(data) -> list[str]:
    if "accuracy" not in data:
        return []
    return ["accuracy suite (within 1e-3 and max error per tower, per input family):", format_table(data["accuracy"])]
