"""Section backlog: the client stalls (its steps held back) for PAUSE_S while the server streams the event's load
(400 requests/s; a --quick run 100, which a CPU serves) over 20 symbols, then resumes: the time from the resume
until the server has the answer to every request it sent before it, and the p99 of those requests' latencies, with
several requests of a symbol per step (the run's --max-requests-per-symbol) and with one."""
import asyncio
import threading
import time

import numpy as np

from client import event_loop
from scripts.benchmarks.harness import E2E_SYMBOLS
from scripts.benchmarks.report import fmt
from scripts.benchmarks.serving import ReferenceTracker, prefixed_names, prefixed_stream, serve_stream

PAUSE_S = 1.0
PAUSE_AT_S = 1.0  # into the session: the engine is warm and every symbol has a state
AFTER_S = 1.0     # served after the resume


def _pausable(engine):
    from team.example_model import ExampleModel

    class PausableClient(ExampleModel):
        """The example client whose steps wait while `running` is clear: a stalled client process (with inline
        steps its event loop waits too, receiving nothing meanwhile, as a stalled process would)."""

        def __init__(self):
            super().__init__(engine)
            self.running = threading.Event()
            self.running.set()

        def submit_batch(self, requests_by_symbol):
            self.running.wait()
            return super().submit_batch(requests_by_symbol)

    return PausableClient()


def measure_backlog(bench, per_symbol, prefix) -> dict:
    engine, args, rate = bench.engine, bench.args, bench.counts.arrival_rate
    requests = int(rate * (PAUSE_AT_S + PAUSE_S + AFTER_S))
    tracker = ReferenceTracker(bench.model, prefixed_names(prefix, E2E_SYMBOLS), bench.device)
    stream = prefixed_stream(prefix, E2E_SYMBOLS, requests, args.seed + 7, rate)
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

        def resume():
            marks["resumed"] = time.monotonic()
            team_client.running.set()
        # resumed from a thread: with inline steps the held submit holds this event loop itself
        resumer = threading.Timer(PAUSE_S, resume)
        resumer.start()
        await asyncio.to_thread(resumer.join)

    summary = event_loop.run(serve_stream(engine, stream, targets, rate, args.preset, args.seed,
                                          args.pipeline_min_batch, timeline=True, max_requests_per_symbol=per_symbol,
                                          team_client=team_client, during=pause, stacks_dir=args.stacks,
                                          **bench.forming()))
    engine.release(np.unique(stream.symbols).tolist())
    # The server's times (the same monotonic clock): a client whose event loop was held during the pause read the
    # requests sent meanwhile only after the resume, so its own receive times would leave them out.
    sent, latency_ms = (np.asarray(summary["timeline"][key], dtype=np.float64) for key in ("sent", "latency_ms"))
    ends = sent + latency_ms / 1000.0  # NaN: not answered in time
    backlog = (sent < marks["resumed"]) & ~(ends <= marks["paused"])
    answered = backlog & np.isfinite(ends)
    return {"requests_per_symbol": per_symbol, "rate": rate, "backlog": int(backlog.sum()),
            "answered": int(answered.sum()),
            "drain_ms": 1000 * (ends[answered].max() - marks["resumed"]) if answered.any() else None,
            "backlog_p99_ms": float(np.percentile(latency_ms[answered], 99)) if answered.any() else None,
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
