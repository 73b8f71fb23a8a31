"""Section hung: of two shards (an engine process each), one stops answering for HUNG_S (its process stopped with
SIGSTOP, then continued) while the scoring server streams 400 requests/s over 20 symbols. Recorded: the latency of
the requests sent meanwhile, the live shard's symbols' (p50, p99, max, missed) and the hung shard's (the longest
answered, missed), with the runtime's default (a step whose parts are late goes on without them,
client/runtime.py LATE_PARTS_S) and with every step answered whole (the runtime before it)."""
import asyncio
import os
import signal
import time

import numpy as np

from client import event_loop
from scripts.benchmarks.harness import E2E_RATE, E2E_SYMBOLS
from scripts.benchmarks.report import fmt
from scripts.benchmarks.serving import ReferenceTracker, prefixed_names, prefixed_stream, serve_stream

HUNG_AT_S = 1.0  # into the session: both shards warm, every symbol placed
HUNG_S = 2.0
AFTER_S = 1.0    # served after the hung shard answers again
WHOLE = 1e9      # late_parts_s that never comes: every step answered whole


def run(bench):
    import torch

    from client.engine.shard_process import process_shards
    from client.engine.sharded import ModelSpec, ShardedEngine

    args = bench.args
    bench.close_engine()
    # two processes on one GPU where the machine has one: the shards' GPUs play no part in what is measured
    devices = (["cuda:0", "cuda:0"] if bench.device.type == "cuda" and torch.cuda.device_count() < 2
               else bench.devices(2))
    options = {"capacity": 2 * E2E_SYMBOLS, "host_symbols": 0, "precision": args.precision}
    engine = ShardedEngine(process_shards(ModelSpec(args.preset, seed=args.seed), devices, options=options,
                                          progress=False), progress=False, transport="process")
    runs = {}
    try:
        for name, late_parts_s, prefix in (("in_parts", None, "HUP_"), ("whole", WHOLE, "HUW_")):
            runs[name] = measure(bench, engine, late_parts_s, prefix)
            bench.report.update(hung_shard={"devices": devices, "hung_s": HUNG_S, **runs})
            bench.progress(f"hung shard, steps answered {name.replace('_', ' ')}: {line(runs[name])}")
    finally:
        engine.close()
    return runs


def measure(bench, engine, late_parts_s, prefix) -> dict:
    args = bench.args
    requests = int(E2E_RATE * (HUNG_AT_S + HUNG_S + AFTER_S))
    tracker = ReferenceTracker(bench.model, prefixed_names(prefix, E2E_SYMBOLS), bench.device)
    stream = prefixed_stream(prefix, E2E_SYMBOLS, requests, args.seed + 11, E2E_RATE)
    targets = tracker.targets(stream)
    del tracker
    process = engine.shards[1].process
    marks = {}

    async def hang(client):
        while client.welcome is None:
            await asyncio.sleep(0.005)
        await asyncio.sleep(HUNG_AT_S)
        os.kill(process.pid, signal.SIGSTOP)
        marks["stopped"] = time.monotonic()
        await asyncio.sleep(HUNG_S)
        os.kill(process.pid, signal.SIGCONT)
        marks["continued"] = time.monotonic()

    summary = event_loop.run(serve_stream(engine, stream, targets, E2E_RATE, args.preset, args.seed,
                                          args.pipeline_min_batch, timeline=True, during=hang,
                                          late_parts_s=late_parts_s, stacks_dir=args.stacks, **bench.forming()))
    on_hung = np.asarray([engine.shard_of.get(symbol) == 1 for symbol in stream.symbols])
    engine.release(np.unique(stream.symbols).tolist())
    sent, latency_ms = (np.asarray(summary["timeline"][key], dtype=np.float64) for key in ("sent", "latency_ms"))
    meanwhile = (sent >= marks["stopped"]) & (sent < marks["continued"])
    live, hung = meanwhile & ~on_hung, meanwhile & on_hung
    live_ms, hung_ms = latency_ms[live], latency_ms[hung]  # NaN: not answered in time
    answered = live_ms[np.isfinite(live_ms)]
    return {"late_parts_s": late_parts_s, "live_requests": int(live.sum()), "hung_requests": int(hung.sum()),
            "live_p50_ms": float(np.percentile(answered, 50)) if len(answered) else None,
            "live_p99_ms": float(np.percentile(answered, 99)) if len(answered) else None,
            "live_max_ms": float(answered.max()) if len(answered) else None,
            "live_missed": int((~np.isfinite(live_ms)).sum()),
            "hung_max_answered_ms": float(np.nanmax(hung_ms)) if np.isfinite(hung_ms).any() else None,
            "hung_missed": int((~np.isfinite(hung_ms)).sum()),
            "session_p99_ms": summary["latency_ms"]["p99"], "accuracy": summary["accuracy"],
            "missed": summary["missed"], "host_steal_ms_per_s": summary["host_steal_ms_per_s"]}


def line(numbers) -> str:
    return (f"live shard's {numbers['live_requests']} requests meanwhile p50 {fmt(numbers['live_p50_ms'])} ms, "
            f"p99 {fmt(numbers['live_p99_ms'])} ms, max {fmt(numbers['live_max_ms'])} ms, "
            f"{numbers['live_missed']} missed; hung shard's {numbers['hung_requests']}: longest answered "
            f"{fmt(numbers['hung_max_answered_ms'])} ms, {numbers['hung_missed']} missed; session accuracy "
            f"{fmt(numbers['accuracy'], 4)}")


def summary(data) -> list[str]:
    hung = data.get("hung_shard", {})
    return [f"hung shard {fmt(hung['hung_s'])} s, steps answered {name.replace('_', ' ')}: {line(hung[name])}"
            for name in ("in_parts", "whole") if name in hung]
