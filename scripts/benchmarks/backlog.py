"""Section backlog: the client stalls (its steps held back) for PAUSE_S while the server streams 400 requests/s
over 20 symbols, then resumes: the time from the resume until every request that arrived before it is answered,
and the p99 of those requests' latencies, with several requests of a symbol per step (the run's
--max-requests-per-symbol) and with one."""
import asyncio
import threading
import time

import numpy as np

from client import event_loop
from scripts.benchmarks.harness import E2E_RATE, E2E_SYMBOLS
from scripts.benchmarks.report import fmt
from scripts.benchmarks.serving import ReferenceTracker, prefixed_names, prefixed_stream, serve_stream

PAUSE_S = 1.0
PAUSE_AT_S = 1.0  # into the session: the engine is warm and every symbol has a state
AFTER_S = 1.0     # served after the resume


def _pausable(engine):
    from team.example_model import ExampleModel

    class PausableClient(ExampleModel):
        """The example client whose steps wait while `running` is clear: a stalled client process."""

        def __init__(self):
            super().__init__(engine)
            self.running = threading.Event()
            self.running.set()

        def submit_batch(self, requests_by_symbol):
            self.running.wait()
            return super().submit_batch(requests_by_symbol)

    return PausableClient()


def measure_backlog(bench, per_symbol, prefix) -> dict:
    engine, args = bench.engine, bench.args
    requests = int(E2E_RATE * (PAUSE_AT_S + PAUSE_S + AFTER_S))
    tracker = ReferenceTracker(bench.model, prefixed_names(prefix, E2E_SYMBOLS), bench.device)
    stream = prefixed_stream(prefix, E2E_SYMBOLS, requests, args.seed + 7, E2E_RATE)
    targets = tracker.targets(stream)
    del tracker
    team_client = _pausable(engine)
    marks = {}

    async def pause(client):
        while client.welcome is None:
            await asyncio.sleep(0.005)
        await asyncio.sleep(PAUSE_AT_S)
        team_client.running.clear()
        marks["paused"] = time.monotonic()
        await asyncio.sleep(PAUSE_S)
        marks["resumed"] = time.monotonic()
        team_client.running.set()

    summary = event_loop.run(serve_stream(engine, stream, targets, E2E_RATE, args.preset, args.seed,
                                          args.pipeline_min_batch, timeline=True, max_requests_per_symbol=per_symbol,
                                          team_client=team_client, during=pause, stacks_dir=args.stacks,
                                          **bench.forming()))
    engine.release(np.unique(stream.symbols).tolist())
    stages = summary["timeline"]["client"]
    backlog = [s for s in stages.values()
               if s["received"] < marks["resumed"] and s.get("answered", np.inf) > marks["paused"]]
    answered = [s["answered"] for s in backlog if "answered" in s]
    latencies = [1000 * (s["answered"] - s["received"]) for s in backlog if "answered" in s]
    return {"requests_per_symbol": per_symbol, "backlog": len(backlog), "answered": len(answered),
            "drain_ms": 1000 * (max(answered) - marks["resumed"]) if answered else None,
            "backlog_p99_ms": float(np.percentile(latencies, 99)) if latencies else None,
            "session_p99_ms": summary["latency_ms"]["p99"], "accuracy": summary["accuracy"],
            "missed": summary["missed"]}


def run(bench):
    results = {}
    for per_symbol, prefix in ((bench.args.max_requests_per_symbol, "BACKLOG_"), (1, "BACKLOG1_")):
        numbers = measure_backlog(bench, per_symbol, prefix)
        results[f"k{per_symbol}"] = numbers
        bench.report.update(backlog=results)
        bench.progress(f"backlog: {line(numbers)}")


def line(numbers) -> str:
    return (f"up to {numbers['requests_per_symbol']} requests of a symbol a step: {numbers['backlog']} requests "
            f"queued during a {PAUSE_S:g} s pause drained {fmt(numbers['drain_ms'])} ms after the resume, their "
            f"p99 {fmt(numbers['backlog_p99_ms'])} ms; accuracy {fmt(numbers['accuracy'], 4)}, missed "
            f"{numbers['missed']}")


def summary(data) -> list[str]:
    return [f"backlog: {line(numbers)}" for numbers in data.get("backlog", {}).values()]
