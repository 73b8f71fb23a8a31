"""Section maxrate: the highest offered rate over 64 symbols served with p99 under 50 ms, none unanswered, with
several requests of a symbol per step (the run's --max-requests-per-symbol) and with one (K = 1) in the same run."""
from scripts.benchmarks.harness import MAXRATE_SYMBOLS, P99_LIMIT_MS
from scripts.benchmarks.report import fmt, rate_text
from scripts.benchmarks.serving import arrival_line, search_max_rate, stall_line


def run(bench):
    k = bench.args.max_requests_per_symbol
    bench.report.update(max_rate_requests_per_symbol=k)
    best, _ = search_max_rate(bench.engine, bench)
    bench.progress(f"maxrate: {rate_text(best)} with p99 < {P99_LIMIT_MS:g} ms, up to {k} requests of a symbol a step")
    best_k1, _ = search_max_rate(bench.engine, bench, prefix="RATE1_", key="max_rate_k1", rates=bench.counts.k1_rates,
                                 per_symbol=1)
    bench.progress(f"maxrate: {rate_text(best_k1)} with p99 < {P99_LIMIT_MS:g} ms, one request of a symbol a step")


def _lines(runs):
    return [f"rate {run['rate']:>8g} req/s: p50 {fmt(run['p50_ms']):>7} ms, p99 {fmt(run['p99_ms']):>7} ms, "
            f"accuracy {fmt(run['accuracy'], 4)}, missed {run['missed']}  {'pass' if run['passed'] else 'FAIL'}"
            + (" (inline steps)" if run.get("inline_steps") else "")
            + (f"; {arrival_line(run['arrival'])}" if "arrival" in run else "")
            + (f"; {stall_line(run['client_stalls'])}" if "client_stalls" in run else "")
            for run in runs]


def summary(data) -> list[str]:
    lines = []
    if "max_rate_runs" in data:
        k = data.get("max_rate_requests_per_symbol", 1)
        lines += _lines(data["max_rate_runs"])
        lines.append(f"max rate with p99 < {P99_LIMIT_MS:g} ms over {MAXRATE_SYMBOLS} symbols, up to {k} requests "
                     f"of a symbol a step: {rate_text(data['max_rate_p99_50ms'])}")
    if "max_rate_k1_runs" in data:
        lines += _lines(data["max_rate_k1_runs"])
        lines.append(f"max rate with p99 < {P99_LIMIT_MS:g} ms over {MAXRATE_SYMBOLS} symbols, one request of a "
                     f"symbol a step: {rate_text(data['max_rate_k1_p99_50ms'])}")
    return lines
