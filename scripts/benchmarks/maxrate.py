"""Section maxrate: the highest offered rate over 64 symbols served with p99 under 50 ms, none unanswered."""
from scripts.benchmarks.harness import MAXRATE_SYMBOLS, P99_LIMIT_MS
from scripts.benchmarks.report import fmt
from scripts.benchmarks.serving import search_max_rate


def run(bench):
    best, _ = search_max_rate(bench.engine, bench)
    bench.progress(f"maxrate: {best} req/s with p99 < {P99_LIMIT_MS:g} ms")


def summary(data) -> list[str]:
    if "max_rate_runs" not in data:
        return []
    lines = [f"rate {run['rate']:>8g} req/s: p50 {fmt(run['p50_ms']):>7} ms, p99 {fmt(run['p99_ms']):>7} ms, "
             f"accuracy {fmt(run['accuracy'], 4)}, missed {run['missed']}  {'pass' if run['passed'] else 'FAIL'}"
             for run in data["max_rate_runs"]]
    lines.append(f"max rate with p99 < {P99_LIMIT_MS:g} ms over {MAXRATE_SYMBOLS} symbols: "
                 f"{data['max_rate_p99_50ms']} req/s")
    return lines
