"""The runtime's two rules for forming the next pipelined step, served in turn by one engine: late (the default,
client/step_clock.py: just before the step in flight ends, behind steps of StepClock.late_after_s or more) and early
(as soon as the step in flight is submitted, the rule before). Each pair serves the same stream with the same
reference targets, on fresh symbols each, the order alternating from pair to pair, so that the host's drift and
its tail fall on both alike (bench/LOG.md section 41: two hosts' tails differed more than the rules did).

    python scripts/forming_ab.py --json bench/ab/forming_h100.json      # 3 pairs at 400 req/s, 8,000 and 11,000
    python scripts/forming_ab.py --preset tiny --device cpu --e2e-requests 40 --rates 200   # CPU smoke run
"""
import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from client import cli, event_loop
from client.constants import DEFAULT_REQUESTS_PER_SYMBOL
from client.model.config import PRESETS
from client.streams import Stream
from scripts.benchmarks.harness import E2E_RATE, E2E_SYMBOLS, MAXRATE_SYMBOLS
from scripts.benchmarks.report import fmt

RULES = {"late": True, "early": False}  # name -> StreamingClient's form_late


def _comma_list(kind):
    def parse(text):
        return [kind(item) for item in text.split(",") if item.strip()]
    return parse


def parse_args(argv=None):
    parser = cli.ArgumentParser(prog="forming_ab.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), help="model preset (default: full on CUDA, else tiny)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=cli.seed, default=0, help="seed of the weights and streams")
    parser.add_argument("--pairs", type=cli.positive_int, default=3, help="pairs at the event's load (default 3)")
    parser.add_argument("--e2e-requests", type=cli.positive_int, default=2000,
                        help=f"requests of a session at the event's load ({E2E_RATE:g} req/s over {E2E_SYMBOLS} "
                             f"symbols; default 2000)")
    parser.add_argument("--rates", type=_comma_list(cli.positive_float), default=[8000.0, 11000.0],
                        help=f"rates over {MAXRATE_SYMBOLS} symbols, one pair each (default 8000,11000)")
    parser.add_argument("--rate-seconds", type=cli.positive_float, default=1.5, help="length of those sessions")
    parser.add_argument("--max-requests-per-symbol", type=cli.positive_int, default=DEFAULT_REQUESTS_PER_SYMBOL,
                        metavar="K")
    parser.add_argument("--json", type=cli.output_file, help="write every session's numbers here")
    args = parser.parse_args(argv)
    cli.check_device(args.device)
    args.preset = cli.preset_for(args.preset, args.device)
    return args


def _on_symbols(stream, prefix):
    return Stream(np.char.add(prefix, stream.symbols), stream.features, stream.delay_ms, meta=stream.meta)


def measure(args, progress) -> list[dict]:
    """Every session's numbers, in the order served: {kind, pair, rate, rule, p50_ms, p99_ms, ...}."""
    from scripts.bench import parse_args as bench_args
    from scripts.benchmarks.harness import Bench
    from scripts.benchmarks.report import Report
    from scripts.benchmarks.serving import (ReferenceTracker, prefixed_names, prefixed_stream, serve_stream,
                                            session_numbers)

    # the e2e section's engine: no accuracy suite to size it for
    options = ["--sections", "e2e", "--preset", args.preset, "--device", args.device, "--seed", str(args.seed),
               "--max-requests-per-symbol", str(args.max_requests_per_symbol)]
    bench = Bench(bench_args(options), Report(None), progress)
    engine = bench.engine
    plan = [("e2e", pair, E2E_RATE, E2E_SYMBOLS, args.e2e_requests) for pair in range(args.pairs)]
    plan += [("rate", pair, rate, MAXRATE_SYMBOLS, max(int(rate * args.rate_seconds), MAXRATE_SYMBOLS))
             for pair, rate in enumerate(args.rates)]
    sessions = []
    for kind, pair, rate, symbols, requests in plan:
        stream = prefixed_stream("AB_", symbols, requests, args.seed + 1000 * (kind == "rate") + pair, rate)
        tracker = ReferenceTracker(bench.model, prefixed_names("AB_", symbols), bench.device)
        targets = tracker.targets(stream)  # fresh symbols start from zero states: the same targets for both rules
        del tracker
        rules = list(RULES) if pair % 2 == 0 else list(RULES)[::-1]
        for rule in rules:
            served = _on_symbols(stream, f"{kind}{pair}{rule}_")
            numbers = session_numbers(event_loop.run(serve_stream(
                engine, served, targets, rate, args.preset, args.seed,
                max_requests_per_symbol=args.max_requests_per_symbol, form_late=RULES[rule])))
            engine.release(np.unique(served.symbols).tolist())
            sessions.append({"kind": kind, "pair": pair, "rate": rate, "rule": rule, **numbers})
            progress(f"{kind} pair {pair}, {rate:g} req/s, {rule:<5}: p50 {fmt(numbers['p50_ms'])} ms, "
                     f"p99 {fmt(numbers['p99_ms'])} ms, accuracy {fmt(numbers['accuracy'], 4)}, "
                     f"missed {numbers['missed']}")  # (none of them where no answer came in time)
    return sessions


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.monotonic()

    def progress(message):
        print(f"[{time.monotonic() - start:7.1f} s] {message}", file=sys.stderr, flush=True)

    sessions = measure(args, progress)
    for kind, pair, rate in dict.fromkeys((s["kind"], s["pair"], s["rate"]) for s in sessions):
        both = {s["rule"]: s for s in sessions if (s["kind"], s["pair"], s["rate"]) == (kind, pair, rate)}
        print(f"{kind} {rate:>7g} req/s pair {pair}: " + "; ".join(
            f"{rule} p50 {s['p50_ms']:.2f} p99 {s['p99_ms']:.2f} ms" for rule, s in both.items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"preset": args.preset, "device": str(args.device),
                                               "max_requests_per_symbol": args.max_requests_per_symbol,
                                               "sessions": sessions}, indent=1))
    return 0


def run() -> int:
    return cli.run_cli(main, "forming_ab.py")


if __name__ == "__main__":
    sys.exit(run())
