"""Section e2e: the engine behind the team client, served 400 req/s over 20 symbols by the scoring server."""
from scripts.benchmarks.report import fmt
from scripts.benchmarks.serving import measure_e2e


def line(numbers) -> str:
    """A served session's numbers in one line (the progress log, the summary, the gpus section)."""
    return (f"p50 {fmt(numbers['p50_ms'])} ms, p99 {fmt(numbers['p99_ms'])} ms, "
            f"accuracy {fmt(numbers['accuracy'], 4)}, {fmt(numbers['responses_per_s'], 1)} responses/s")


def run(bench):
    numbers = measure_e2e(bench.engine, bench)
    bench.report.update(e2e_400rps_20sym=numbers)
    bench.progress(f"e2e: {line(numbers)}")


def summary(data) -> list[str]:
    return [f"e2e 400 req/s, 20 symbols: {line(data['e2e_400rps_20sym'])}"] if "e2e_400rps_20sym" in data else []
