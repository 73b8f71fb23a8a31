"""One-command benchmark of the fast engine: step latency against its memory floor, the original
one-request-at-a-time baseline, accuracy against the fp32 reference, and end-to-end serving through the
project's scoring server on loopback.

    python scripts/bench.py --json bench.json                                  # GPU, full preset
    python scripts/bench.py --preset tiny --device cpu --quick --json out.json  # CPU smoke run

Progress goes to stderr (timestamped), a summary table to stdout, and the JSON is rewritten after every
section, so that a run cut off by a time limit still leaves the numbers it had.
"""
import os
import sys


import argparse
import asyncio
import json
import logging
import math
import multiprocessing
import platform
import queue
import time
import traceback
from dataclasses import dataclass

import numpy as np
import torch

from client import cli, event_loop
from client.accuracy import Suite, format_table as accuracy_table
from client.engine.precision import (add_precision_argument, describe_precision, fp32_products, parse_precision,
                                     parse_state_dtype)
from client.families import FAMILIES
from client.model.config import NUM_FEATURES, PRESETS, TOWER_NAMES
from client.runtime import PIPELINE_MIN_BATCH


SECTIONS = ("copy", "step", "baseline", "accuracy", "precisions", "state_dtypes", "compile", "e2e", "maxrate",
            "state_rates", "churn", "capacity", "gpus", "shards")
BATCH_SIZES = (1, 2, 4, 8, 16, 20, 32, 40, 64)
MAX_BATCH = max(BATCH_SIZES)
E2E_RATE, E2E_SYMBOLS = 400.0, 20
MAXRATE_SYMBOLS = 64
SHARD_SYMBOLS = 128
SHARD_START_RATE = 2000  # req/s per GPU where the shards section's search starts (bench.counts.rates at or above)
P99_LIMIT_MS = 50.0
SHORT_BATCHES = (1, 20, 64)
REFERENCE_CHUNK = 64  # rows per reference forward when tracking many symbols (~30 GB of states beside)  # step times of the engine variants (precisions, state dtypes, GPU counts)
STEP_LIMIT_MS = 5.0  # capacity section: no step of B <= 20 over this while new symbols arrive


@dataclass
class Counts:
    """How much each section measures; --quick shrinks everything for a smoke run."""
    copy_bytes: int
    copy_repeats: int
    step_warmup: int
    step_iters: int
    baseline_warmup: int
    baseline_iters: int
    family_symbols: int  # accuracy suite: symbols per input family
    family_steps: int
    long_symbols: int
    long_steps: int
    e2e_requests: int
    rates: list
    rate_seconds: float
    new_symbols: int  # capacity section: symbols arriving mid-stream
    arrival_seconds: float
    churn_symbols: int
    churn_capacity: int
    churn_steps: int


FULL = Counts(copy_bytes=1 << 30, copy_repeats=20, step_warmup=20, step_iters=200, baseline_warmup=5,
              baseline_iters=20, family_symbols=4, family_steps=1000, long_symbols=4, long_steps=10_000,
              e2e_requests=4000, rates=[1000, 2000, 3000, 4000, 5000, 6000, 7000, 8000, 10000, 12000, 14000, 20000],
              rate_seconds=2.0, new_symbols=200, arrival_seconds=10.0, churn_symbols=24, churn_capacity=8,
              churn_steps=200)
QUICK = Counts(copy_bytes=64 << 20, copy_repeats=5, step_warmup=2, step_iters=10, baseline_warmup=2,
               baseline_iters=5, family_symbols=2, family_steps=40, long_symbols=2, long_steps=300,
               e2e_requests=200, rates=[50, 100], rate_seconds=1.0, new_symbols=12, arrival_seconds=2.0,
               churn_symbols=6, churn_capacity=3, churn_steps=30)


# ---- command line --------------------------------------------------------------------------------
def _sections(text):
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in SECTIONS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown sections {unknown}; choose from {','.join(SECTIONS)}")
    return [name for name in SECTIONS if name in names]  # always in the order that shares work sensibly


def _state_dtype(text):
    """A state dtype spec (client/engine/precision.py, parse_state_dtype), optionally ending in ':nearest' or
    ':stochastic' (the rounding of 16-bit state; stochastic by default)."""
    spec, _, rounding = text.partition(":")
    try:
        parse_state_dtype(spec)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if rounding not in ("", "nearest", "stochastic"):
        raise argparse.ArgumentTypeError(f"state rounding must be nearest or stochastic, got {rounding!r}")
    return text


def _state_options(text):
    spec, _, rounding = text.partition(":")
    return {"state_dtype": spec, "state_rounding": rounding or "stochastic"}


def _precision_spec(text):
    parse_precision(text)  # a bad spec is refused here, in one line
    return text


def _list_of(item, separator=","):
    def parse(text):
        try:
            values = [item(part.strip()) for part in text.split(";" if item in (_precision_spec, _state_dtype)
                                                                 else separator) if part.strip()]
        except (ValueError, argparse.ArgumentTypeError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        if not values:
            raise argparse.ArgumentTypeError("expected at least one value")
        return values
    return parse


def _rates(text):
    try:
        rates = [cli.positive_float(part) for part in text.split(",") if part.strip()]
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(f"rates must be positive numbers separated by commas, got {text!r}")
    if not rates:
        raise argparse.ArgumentTypeError("--rates needs at least one rate")
    return sorted(set(rates))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Benchmark the fast engine (see the module docstring).")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="full")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic weights, features and streams")
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu for a smoke run")
    parser.add_argument("--json", metavar="PATH", help="write the results here (rewritten after each section)")
    parser.add_argument("--sections", type=_sections, default=list(SECTIONS),
                        help=f"comma list of {','.join(SECTIONS)} (default: all)")
    parser.add_argument("--family-symbols", type=cli.positive_int, help="accuracy suite: symbols per input family "
                                                                     "(default 4)")
    parser.add_argument("--family-steps", type=cli.positive_int, help="accuracy suite: steps per family (default 1000)")
    parser.add_argument("--long-steps", type=cli.positive_int, help="accuracy suite: steps of the long streams "
                                                                 "(default 10000)")
    add_precision_argument(parser)
    parser.add_argument("--precisions", type=_list_of(_precision_spec), default=["auto", "fp16", "bf16", "fp32"],
                        help="precisions section: precision specs separated by ';' (default: auto;fp16;bf16;fp32)")
    parser.add_argument("--state-dtype", type=_state_dtype, default="fp32",
                        help="state storage of the other sections' engine, e.g. fp16 or fp16:nearest (default fp32)")
    parser.add_argument("--state-dtypes", type=_list_of(_state_dtype),
                        default=["fp32", "fp16", "fp16:nearest", "bf16", "fp16,retnet=fp16"],
                        help="state_dtypes section: specs separated by ';' (default "
                             "fp32;fp16;fp16:nearest;bf16;fp16,retnet=fp16)")
    parser.add_argument("--gpus", type=_list_of(cli.positive_int), default=None,
                        help="gpus and shards sections: GPU counts to run, comma list (default: 1 and every GPU)")
    parser.add_argument("--merge", action="store_true", help="keep what --json already holds; rewrite only the "
                                                               "sections of this run")
    parser.add_argument("--e2e-requests", type=cli.positive_int, help="requests of the 400 req/s run (default 4000)")
    parser.add_argument("--rates", type=_rates, help="offered rates (req/s) tried in ascending order by the "
                                                     "max-rate search (default 1000,2000,...,20000)")
    parser.add_argument("--rate-seconds", type=cli.positive_float, help="length of each max-rate run (default 2)")
    parser.add_argument("--pipeline-min-batch", type=cli.positive_int,
                        help="the client runtime's pipeline_min_batch (default: client.runtime.PIPELINE_MIN_BATCH)")
    parser.add_argument("--quick", action="store_true", help="small counts for a smoke run")
    parser.add_argument("--log-dir", help="also write the progress log and client/server warnings here")
    args = parser.parse_args(argv)
    counts = QUICK if args.quick else FULL
    overrides = {"family_symbols": args.family_symbols, "family_steps": args.family_steps,
                 "long_steps": args.long_steps, "e2e_requests": args.e2e_requests, "rates": args.rates,
                 "rate_seconds": args.rate_seconds}
    args.counts = Counts(**{**counts.__dict__, **{k: v for k, v in overrides.items() if v is not None}})
    if args.counts.family_symbols * len(FAMILIES) > MAX_BATCH:
        parser.error(f"--family-symbols must be at most {MAX_BATCH // len(FAMILIES)}: all families step together "
                     f"in batches of at most {MAX_BATCH}")
    try:
        args.device = torch.device(args.device)
    except RuntimeError as exc:
        parser.error(f"bad --device {args.device!r}: {exc}")
    if args.device.type not in ("cuda", "cpu"):
        parser.error(f"--device must be cuda or cpu, got {args.device}")
    if args.device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but CUDA is not available; use --device cpu (with --quick) for a smoke run")
    return args


# ---- reporting -----------------------------------------------------------------------------------
class Progress:
    """Timestamped progress lines on stderr, also appended to a log file when --log-dir is given."""

    def __init__(self, log_path=None):
        self.start = time.monotonic()
        self.log_path = log_path

    def __call__(self, message):
        line = f"[{time.strftime('%H:%M:%S')} +{time.monotonic() - self.start:7.1f}s] {message}"
        print(line, file=sys.stderr, flush=True)
        if self.log_path is not None:
            with open(self.log_path, "a") as log_file:
                log_file.write(line + "\n")


def _finite_or_none(value):
    """JSON-safe: non-finite floats become null (plain JSON has no NaN)."""
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_none(v) for v in value]
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, np.integer):
        return int(value)
    return value


class Report:
    """The results so far; written atomically after every update."""

    def __init__(self, path):
        self.path = path
        self.data = {}

    def update(self, **fields):
        self.data.update(_finite_or_none(fields))
        if self.path is None:
            return
        tmp_path = f"{self.path}.tmp"
        with open(tmp_path, "w") as out:
            json.dump(self.data, out, indent=2, allow_nan=False)
        os.replace(tmp_path, self.path)


# ---- timing --------------------------------------------------------------------------------------
class Timer:
    """Milliseconds of one call: CUDA events on a GPU (the queue drained first, so a call is timed alone,
    launch included), perf_counter on the CPU where ops run synchronously."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)

    def time_ms(self, fn) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            self._start.record()
            fn()
            self._end.record()
            self._end.synchronize()
            return self._start.elapsed_time(self._end)
        begin = time.perf_counter()
        fn()
        return (time.perf_counter() - begin) * 1000.0


def _median_p99(times_ms):
    times = np.asarray(times_ms, dtype=np.float64)
    return float(np.median(times)), float(np.percentile(times, 99))


# ---- sections ------------------------------------------------------------------------------------
def measure_copy(device, counts, timer):
    """Device-to-device copy bandwidth in bytes/s (bytes read plus bytes written)."""
    src = torch.ones(counts.copy_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    median_ms, _ = _median_p99([timer.time_ms(lambda: dst.copy_(src)) for _ in range(counts.copy_repeats)])
    return 2 * src.numel() * src.element_size() / (median_ms / 1000.0), median_ms


# Each section steps symbols of its own: the engine keeps every state it holds, and the served sections
# need states that match the reference's.
def step_symbols():
    return [f"STEP_{i:03d}" for i in range(MAX_BATCH)]


def measure_steps(engine, device, counts, timer, bandwidth, seed, progress, batches=BATCH_SIZES):
    """{B: {median, p99, floor}} in ms; the floor moves the weights once and each row's state in and out (on
    several GPUs, the slowest GPU's: its towers' weights and state)."""
    symbols = step_symbols()
    generator = torch.Generator(device=device).manual_seed(seed)
    shards = getattr(engine, "shards", None) or []
    results = {}
    for batch in batches:
        slots = engine.slots_for(symbols[:batch])
        features = torch.randn(batch, NUM_FEATURES, generator=generator, device=device)
        for _ in range(counts.step_warmup):
            engine.step_slots(slots, features)
        median, p99 = _median_p99([timer.time_ms(lambda: engine.step_slots(slots, features))
                                   for _ in range(counts.step_iters)])
        if len(shards) > 1:
            floor = max(shard.runner.weight_bytes + 2 * batch * part.slot_bytes
                        for shard, part in zip(shards, engine.table.parts)) / bandwidth * 1000.0
        else:
            floor = (engine.weight_bytes + 2 * batch * engine.state_bytes) / bandwidth * 1000.0
        results[str(batch)] = {"median": median, "p99": p99, "floor": floor}
        progress(f"step B={batch}: median {median:.3f} ms, p99 {p99:.3f} ms, floor {floor:.3f} ms "
                 f"({median / floor:.2f}x)")
    engine.release(symbols)
    return results


@torch.no_grad()
def measure_baseline(model, device, counts, seed):
    """The original client's path: batch 1, one request at a time, each answer copied back to the host."""
    rng = np.random.default_rng(seed)
    requests = rng.standard_normal((counts.baseline_warmup + counts.baseline_iters, 1, NUM_FEATURES),
                                   dtype=np.float32)
    state = model.init_state(1, device=device)
    times_ms = []
    with fp32_products():
        for features in requests:
            begin = time.perf_counter()
            prediction, state = model(torch.from_numpy(features).to(device), state)
            prediction.cpu()
            times_ms.append((time.perf_counter() - begin) * 1000.0)
    return float(np.median(times_ms[counts.baseline_warmup:]))


class ReferenceTracker:
    """The fp32 reference stepped through every request served to the engine, one state per symbol.

    The engine keeps its symbols' states from one served stream to the next, so each stream's targets
    must continue from the reference states where the previous stream left them.
    """

    def __init__(self, model, symbols, device):
        self.model, self.device = model, device
        self._row_of = {symbol: row for row, symbol in enumerate(symbols)}
        self._state = model.init_state(len(symbols), device=device)

    @torch.no_grad()
    def targets(self, stream) -> np.ndarray:
        rows = np.array([self._row_of[symbol] for symbol in stream.symbols.tolist()], dtype=np.int64)
        # step of a request = how many requests of its symbol came before it in this stream
        by_row = np.argsort(rows, kind="stable")
        sorted_rows = rows[by_row]
        step_of_request = np.empty(len(rows), dtype=np.int64)
        step_of_request[by_row] = np.arange(len(rows)) - np.searchsorted(sorted_rows, sorted_rows)
        execution_order = np.lexsort((rows, step_of_request))  # by step, then row: rows ascend in a step
        features = torch.from_numpy(stream.features[execution_order]).to(self.device)
        predictions = torch.empty(len(rows), len(TOWER_NAMES), dtype=torch.float32, device=self.device)
        start = 0
        with fp32_products():
            for active in np.bincount(step_of_request).tolist():
                if active == len(self._row_of) <= REFERENCE_CHUNK:  # every symbol in row order: no gather
                    predictions[start:start + active], self._state = self.model(
                        features[start:start + active], self._state)
                    start += active
                    continue
                # a few rows at a time: a step's new state is allocated beside the old one (153.5 MB a symbol)
                for chunk in range(start, start + active, REFERENCE_CHUNK):
                    end = min(chunk + REFERENCE_CHUNK, start + active)
                    index = torch.from_numpy(rows[execution_order[chunk:end]]).to(self.device)
                    step_state = {name: tensor[index] for name, tensor in self._state.items()}
                    predictions[chunk:end], new_state = self.model(features[chunk:end], step_state)
                    for name, tensor in new_state.items():
                        self._state[name][index] = tensor
                start += active
        targets = np.empty((len(rows), len(TOWER_NAMES)), dtype=np.float32)
        targets[execution_order] = predictions.cpu().numpy()
        if not np.isfinite(targets).all():
            raise ValueError("the reference model gave NaN or inf targets")
        return targets


def prefixed_stream(prefix, num_symbols, num_requests, seed, rate):
    """A generated stream whose symbols carry `prefix`, so that each section has symbols of its own."""
    from client.streams import Stream, generate_stream

    stream = generate_stream(num_symbols, num_requests, seed, rate=rate)
    return Stream(np.char.add(prefix, stream.symbols), stream.features, stream.delay_ms, meta=stream.meta)


def _serve_in_child(config, stream, targets, to_parent, from_parent, timeline=False):
    """Child process: run the scoring server, report its port, then the first team's summary (with timeline:
    also its per-request send times and latencies and what stalled the process, under "timeline")."""
    from client.stalls import StallProbe
    from server.app import ScoringServer

    async def main():
        probe = StallProbe().start() if timeline else None
        watch = asyncio.create_task(probe.watch_loop()) if probe else None
        server = ScoringServer(config, stream=stream, targets=targets)
        to_parent.put(await server.start())
        await server.wait_done()
        summary = server.summaries()[0]
        if probe:
            watch.cancel()
            probe.stop()
            summary["timeline"] = {**server.first_session.request_times(), "stalls": probe.events()}
        to_parent.put(summary)
        await asyncio.to_thread(from_parent.get)  # stay up until the client has finished
        await server.stop()

    event_loop.run(main())


class ServerProcess:
    """The project's scoring server in a process of its own, as a real scoring server would be: its pacing,
    its latency clock and its event loop never wait for the client's interpreter (GIL) or event loop."""

    def __init__(self, config, stream, targets, timeline=False):
        ctx = multiprocessing.get_context("spawn")
        self._to_parent, self._from_parent = ctx.Queue(), ctx.Queue()
        self._process = ctx.Process(target=_serve_in_child, name="scoring-server", daemon=True,
                                    args=(config, stream, targets, self._to_parent, self._from_parent, timeline))
        self._process.start()
        self.port = self._get(timeout=120)

    def _get(self, timeout):
        try:
            return self._to_parent.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"the scoring server process gave no answer in {timeout} s "
                               f"(exit code {self._process.exitcode})") from None

    async def wait_done(self):
        while True:  # short waits, so that a cancelled wait leaves no thread blocked behind it
            try:
                self._summary = self._to_parent.get_nowait()
                return
            except queue.Empty:
                if not self._process.is_alive():
                    raise RuntimeError(f"the scoring server process ended (exit code {self._process.exitcode})")
                await asyncio.sleep(0.05)

    def summary(self) -> dict:
        return self._summary

    def close(self):
        self._from_parent.put("stop")
        self._process.join(timeout=30)
        if self._process.is_alive():
            self._process.kill()


async def serve_stream(engine, stream, targets, rate, preset, seed, pipeline_min_batch=None, timeline=False) -> dict:
    """Serve `stream` at `rate` to the team client running `engine`; the server's summary of the session.
    With timeline, the summary's "timeline" also has the client's per-request stages and both processes'
    stalls (scripts/e2e_timeline.py reads them)."""
    from client.runtime import StreamingClient
    from client.stalls import StallProbe
    from server.app import ServerConfig
    from team.example_model import ExampleModel

    config = ServerConfig(host="127.0.0.1", port=0, preset=preset, seed=seed,
                          symbols=len(np.unique(stream.symbols)), requests=len(stream), rate=rate, once=True)
    server = await asyncio.to_thread(ServerProcess, config, stream, targets, timeline)
    probe = StallProbe().start() if timeline else None
    watch = asyncio.create_task(probe.watch_loop()) if probe else None
    try:
        options = {} if pipeline_min_batch is None else {"pipeline_min_batch": pipeline_min_batch}
        client = StreamingClient(ExampleModel(engine), f"ws://127.0.0.1:{server.port}", "bench", timeline=timeline,
                                 **options)
        playing = asyncio.create_task(client.run())
        done = asyncio.create_task(server.wait_done())
        await asyncio.wait({done, playing}, return_when=asyncio.FIRST_COMPLETED)
        done.cancel()
        client.stop()
        await playing
        summary = await asyncio.to_thread(server.summary)
        if probe:
            summary["timeline"].update(client=client.timeline, client_stalls=probe.events())
        return summary
    finally:
        if probe:
            watch.cancel()
            probe.stop()
        await asyncio.to_thread(server.close)


def session_numbers(summary) -> dict:
    latency = summary["latency_ms"]
    return {"p50_ms": latency["p50"], "p99_ms": latency["p99"], "accuracy": summary["accuracy"],
            "responses_per_s": summary["responses_per_s"], "requests": summary["total_requests"],
            "responses": summary["responses"], "missed": summary["missed"]}


def measure_e2e(engine, model, device, counts, args, progress, prefix="E2E_"):
    tracker = ReferenceTracker(model, [prefix + name for name in _symbol_names(E2E_SYMBOLS)], device)
    stream = prefixed_stream(prefix, E2E_SYMBOLS, counts.e2e_requests, args.seed + 1, E2E_RATE)
    targets = tracker.targets(stream)
    del tracker
    progress(f"e2e: targets ready; serving {len(stream)} requests at {E2E_RATE:.0f} req/s")
    numbers = session_numbers(event_loop.run(serve_stream(engine, stream, targets, E2E_RATE, args.preset, args.seed,
                                                          args.pipeline_min_batch)))
    engine.release(np.unique(stream.symbols).tolist())
    return numbers


def search_max_rate(engine, model, device, counts, args, report, progress, num_symbols=MAXRATE_SYMBOLS,
                    prefix="RATE_", key="max_rate", rates=None):
    """Ascending rates over `num_symbols` symbols until the first whose p99 reaches the limit or that leaves a
    request unanswered (it may never have been stepped, so later runs could not continue its symbol's state).
    Records report[key + "_p99_50ms"] and report[key + "_runs"] as it goes."""
    tracker = ReferenceTracker(model, [prefix + name for name in _symbol_names(num_symbols)], device)
    runs, best = [], None
    for attempt, rate in enumerate(rates or counts.rates):
        num_requests = max(int(rate * counts.rate_seconds), num_symbols)
        stream = prefixed_stream(prefix, num_symbols, num_requests, args.seed + 2 + attempt, rate)
        progress(f"maxrate {rate:g} req/s: reference targets of {num_requests} requests")
        targets = tracker.targets(stream)
        numbers = session_numbers(event_loop.run(serve_stream(engine, stream, targets, rate, args.preset, args.seed,
                                                               args.pipeline_min_batch)))
        passed = (numbers["responses"] == numbers["requests"] and numbers["p99_ms"] is not None
                  and numbers["p99_ms"] < P99_LIMIT_MS)
        runs.append({"rate": rate, **numbers, "passed": passed})
        best = rate if passed else best
        report.update(**{f"{key}_p99_50ms": best, f"{key}_runs": runs})
        progress(f"maxrate {rate:g} req/s: p50 {_fmt(numbers['p50_ms'])} ms, p99 {_fmt(numbers['p99_ms'])} ms, "
                 f"accuracy {_fmt(numbers['accuracy'], 4)}, missed {numbers['missed']} -> "
                 f"{'pass' if passed else 'FAIL'}")
        if not passed:
            break
    engine.release([prefix + name for name in _symbol_names(num_symbols)])
    return best, runs


def measure_precisions(bench, suite):
    """Per weight precision: what it chose, its step time at B = 1, 20, 64 and its accuracy on every family."""
    results = {}
    for name in bench.args.precisions:
        engine = bench.build_engine(precision=name, capacity=max(suite.symbols, MAX_BATCH))
        row = {"precision": describe_precision(engine.runner.precision),
               "step_ms": measure_steps(engine, bench.device, bench.counts, bench.timer, bench.bandwidth,
                                        bench.args.seed, bench.progress, SHORT_BATCHES),
               "accuracy": suite.measure(engine, prefix=f"{name}/")}
        results[name] = row
        bench.report.update(precisions=results)
        bench.progress(f"precision {name}:\n" + accuracy_table(row["accuracy"]))
        bench.drop(engine)
    return results


def measure_state_dtypes(bench, suite):
    """Per state storage: symbols held at the default memory budget, step times and accuracy on every family (long
    streams included, where rounding in the state accumulates)."""
    from client.engine.fast import STATE_MEMORY

    results = {}
    for state_dtype in bench.args.state_dtypes:
        engine = bench.build_engine(**_state_options(state_dtype), capacity=max(suite.symbols, MAXRATE_SYMBOLS))
        row = {"state_bytes_per_symbol": engine.state_bytes,
               "symbols_at_budget": bench.symbols_at_budget(engine, STATE_MEMORY),
               "step_ms": measure_steps(engine, bench.device, bench.counts, bench.timer, bench.bandwidth,
                                        bench.args.seed, bench.progress, SHORT_BATCHES),
               "accuracy": suite.measure(engine, prefix=f"state-{state_dtype}/")}
        results[state_dtype] = row
        bench.report.update(state_dtypes=results)
        bench.progress(f"state {state_dtype}: {row['symbols_at_budget']} symbols at {STATE_MEMORY:.0%} of free "
                       f"memory\n" + accuracy_table(row["accuracy"]))
        bench.drop(engine)
    return results


def measure_state_rates(bench):
    """The highest rate over 64 symbols for each 16-bit state storage of --state-dtypes, once per size of state
    (the rate depends on the bytes moved, not on how they round; fp32's is the maxrate section's)."""
    results, rated = {}, set()
    for state_dtype in bench.args.state_dtypes:
        if parse_state_dtype(state_dtype.partition(":")[0]) == parse_state_dtype("fp32"):
            continue
        engine = bench.build_engine(**_state_options(state_dtype), capacity=MAXRATE_SYMBOLS)
        if engine.state_bytes not in rated:
            rated.add(engine.state_bytes)
            tag = "".join(c if c.isalnum() else "_" for c in state_dtype)
            # from the fp32 state's rate on: the smaller state only moves fewer bytes
            start = bench.report.data.get("max_rate_p99_50ms") or 0
            rates = [rate for rate in bench.counts.rates if rate >= start] or bench.counts.rates
            best, runs = search_max_rate(engine, bench.model, bench.device, bench.counts, bench.args, bench.report,
                                         bench.progress, prefix=f"ST{tag}_", key=f"state_{tag}_rate", rates=rates)
            results[state_dtype] = {"state_bytes_per_symbol": engine.state_bytes, "max_rate_p99_50ms": best,
                                    "runs": runs}
            bench.report.update(state_rates=results)
        bench.drop(engine)
    return results


def arrival_stream(prefix, num_symbols, seconds, rate, seed):
    """A stream at `rate` in which `num_symbols` symbols appear one after another over its first half, each
    request going to a symbol already seen (so new symbols keep arriving mid-stream)."""
    from client.streams import Stream

    rng = np.random.default_rng(seed)
    total = max(int(rate * seconds), 2 * num_symbols)
    names = np.array([prefix + name for name in _symbol_names(num_symbols)])
    seen = np.minimum(np.arange(total) * 2 * num_symbols // total + 1, num_symbols)  # symbols seen so far
    choice = (rng.random(total) * seen).astype(np.int64)
    choice[np.arange(num_symbols) * total // (2 * num_symbols)] = np.arange(num_symbols)  # each one's arrival
    features = rng.standard_normal((total, NUM_FEATURES)).astype(np.float32)
    return Stream(names[choice], features, np.full(total, 1000.0 / rate))


def measure_capacity(bench):
    """Symbols held at the default memory budget; then new symbols arriving mid-stream at 400 req/s into that
    engine: the end-to-end p99, missed requests, and every step's GPU time (none of B <= 20 over 5 ms)."""
    from client.engine.fast import STATE_MEMORY

    counts = bench.counts
    stream = arrival_stream("NEW_", counts.new_symbols, counts.arrival_seconds, E2E_RATE, bench.args.seed + 5)
    tracker = ReferenceTracker(bench.model, np.unique(stream.symbols).tolist(), bench.device)
    targets = tracker.targets(stream)
    del tracker
    bench.close_engine()  # the budget is a share of the memory free now
    bench.drop(None)
    engine = bench.build_engine(state_memory=STATE_MEMORY if bench.device.type == "cuda" else None,
                                capacity=None if bench.device.type == "cuda" else counts.new_symbols,
                                time_steps=bench.device.type == "cuda")
    numbers = session_numbers(event_loop.run(serve_stream(engine, stream, targets, E2E_RATE, bench.args.preset,
                                                          bench.args.seed, bench.args.pipeline_min_batch)))
    steps = np.array(engine.step_times or [(0, 0.0)])
    small = steps[steps[:, 0] <= 20, 1]
    result = {"symbols_at_budget": engine.table.capacity, "state_memory": STATE_MEMORY,
              "state_bytes_per_symbol": engine.state_bytes, "new_symbols": counts.new_symbols, **numbers,
              "steps": len(engine.step_times or []),
              "step_ms_max_b20": float(small.max()) if small.size else None,
              "step_ms_p99_b20": float(np.percentile(small, 99)) if small.size else None,
              "steps_over_limit": int((small > STEP_LIMIT_MS).sum())}
    bench.drop(engine)
    return result


def measure_churn(bench):
    """Symbols leaving and returning through a GPU tier smaller than them: states offloaded to host memory and
    brought back give the same predictions, bit for bit, as an engine that never offloads; a symbol that left
    (released) and comes back starts afresh, as in both engines."""
    counts = bench.counts
    symbols = [f"CHURN_{i:03d}" for i in range(counts.churn_symbols)]
    tight = bench.build_engine(capacity=counts.churn_capacity, host_symbols=counts.churn_symbols, reserve=1,
                               max_batch=counts.churn_capacity)
    roomy = bench.build_engine(capacity=counts.churn_symbols, host_symbols=0, max_batch=counts.churn_capacity)
    rng = np.random.default_rng(bench.args.seed + 6)
    equal, worst, step_ms = True, 0.0, []
    for step in range(counts.churn_steps):
        batch = [str(s) for s in rng.choice(symbols, int(rng.integers(1, counts.churn_capacity + 1)), replace=False)]
        features = rng.standard_normal((len(batch), NUM_FEATURES)).astype(np.float32)
        begin = time.perf_counter()
        got = tight.step(batch, features)
        step_ms.append((time.perf_counter() - begin) * 1000.0)
        want = roomy.step(batch, features)
        equal &= bool(np.array_equal(got, want))
        worst = max(worst, float(np.abs(got - want).max()))
        if step % 25 == 24:  # a symbol leaves; it may come back later as a new one
            gone = [str(rng.choice(symbols))]
            tight.release(gone)
            roomy.release(gone)
    result = {"symbols": counts.churn_symbols, "gpu_slots": counts.churn_capacity, "steps": counts.churn_steps,
              "bit_equal": equal, "max_abs_diff": worst, **tight.table.stats,
              "step_ms_p50": float(np.median(step_ms)), "step_ms_p99": float(np.percentile(step_ms, 99)),
              "step_ms_max": float(np.max(step_ms))}
    bench.drop(tight)
    bench.drop(roomy)
    return result


def measure_submits(engine, counts, seed, batches=SHORT_BATCHES) -> dict:
    """{B: median and p99 ms} of a submitted step and its predictions back on the host (wall clock): what the
    runtime waits for. With towers on several GPUs this is the step's time (each GPU's staged graph writes its
    columns to the host; step_slots instead joins them on the first GPU)."""
    symbols = step_symbols()
    rng = np.random.default_rng(seed)
    results = {}
    for batch in batches:
        features = rng.standard_normal((batch, NUM_FEATURES)).astype(np.float32)
        times = []
        for i in range(counts.step_warmup + counts.step_iters):
            begin = time.perf_counter()
            engine.submit(symbols[:batch], features).result()
            times.append((time.perf_counter() - begin) * 1000.0)
        median, p99 = _median_p99(times[counts.step_warmup:])
        results[str(batch)] = {"median": median, "p99": p99}
    engine.release(symbols)
    return results


def measure_gpus(bench):
    """The towers spread over N GPUs of this machine, for each N asked: step times with the slowest GPU's floor,
    and end-to-end at 400 req/s over 20 symbols."""
    results = {}
    for gpus in bench.gpu_counts():
        devices = [f"cuda:{i}" for i in range(gpus)] if bench.device.type == "cuda" else ["cpu"] * gpus
        engine = bench.build_engine(devices=devices, capacity=MAX_BATCH + E2E_SYMBOLS)
        row = {"towers": engine.describe()["towers"],
               "step_ms": measure_steps(engine, bench.device, bench.counts, bench.timer, bench.bandwidth,
                                        bench.args.seed, bench.progress, SHORT_BATCHES),
               "submit_ms": measure_submits(engine, bench.counts, bench.args.seed),
               "e2e_400rps_20sym": measure_e2e(engine, bench.model, bench.device, bench.counts, bench.args,
                                               bench.progress, prefix=f"G{gpus}_")}
        results[str(gpus)] = row
        bench.report.update(gpus=results)
        bench.drop(engine)
    return results


def measure_shards(bench):
    """Symbols sharded over N GPUs (an engine process per GPU), for each N asked: the highest rate over 128
    symbols with p99 < 50 ms."""
    from client.engine.sharded import ModelSpec, ShardedEngine

    results = {}
    for gpus in bench.gpu_counts():
        bench.close_engine()
        devices = [f"cuda:{i}" for i in range(gpus)] if bench.device.type == "cuda" else ["cpu"] * gpus
        per_shard = -(-SHARD_SYMBOLS // gpus) + MAX_BATCH
        engine = ShardedEngine(ModelSpec(bench.args.preset, seed=bench.args.seed), devices, progress=False,
                               capacity=per_shard, host_symbols=0, precision=bench.args.precision)
        # one GPU passes 2,000 req/s and more over 128 symbols: start the search at 2,000 per GPU
        rates = [rate for rate in bench.counts.rates if rate >= SHARD_START_RATE * gpus] or bench.counts.rates
        try:
            best, runs = search_max_rate(engine, bench.model, bench.device, bench.counts, bench.args, bench.report,
                                         bench.progress, num_symbols=SHARD_SYMBOLS, prefix=f"SH{gpus}_",
                                         key=f"shards_{gpus}_rate", rates=rates)
        finally:
            engine.close()
        results[str(gpus)] = {"max_rate_p99_50ms": best, "runs": runs, "startup_s": engine.startup_s}
        bench.report.update(shards=results)
    return results


def _symbol_names(count):
    from client.streams import symbol_names

    return symbol_names(count)


def _fmt(value, digits=2):
    return "-" if value is None else f"{value:.{digits}f}"


def _device_name(device):
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)"


# ---- the run -------------------------------------------------------------------------------------
class Bench:
    """Runs the chosen sections, building the reference model, the accuracy suite and the engine once, when
    first needed; sections that need other engines build and drop their own."""

    def __init__(self, args, report, progress):
        self.args, self.counts, self.device = args, args.counts, args.device
        self.report, self.progress = report, progress
        self.timer = Timer(self.device)
        self._model = self._engine = self._suite = None
        self.bandwidth = None

    @property
    def model(self):
        if self._model is None:
            from client.model import load_model

            begin = time.monotonic()
            self._model, fingerprint = load_model(self.args.preset, seed=self.args.seed, device=self.device)
            self.report.update(weights_fingerprint=fingerprint)
            self.progress(f"reference model {self.args.preset} loaded in {time.monotonic() - begin:.1f} s")
        return self._model

    @property
    def suite(self) -> Suite:
        """The accuracy suite's inputs and reference predictions, shared by every engine measured."""
        if self._suite is None:
            counts = self.counts
            self._suite = Suite(self.model, self.device, symbols_per_family=counts.family_symbols,
                                steps=counts.family_steps, long_symbols=counts.long_symbols,
                                long_steps=counts.long_steps, seed=self.args.seed, progress=self.progress)
        return self._suite

    def build_engine(self, **options):
        """A fast engine of the run's settings, `options` on top (capacity: symbols it holds on the GPU)."""
        from client.engine.fast import FastEngine

        settings = {"max_batch": MAX_BATCH, "precision": self.args.precision, **_state_options(self.args.state_dtype),
                    "capacity": MAX_BATCH, "progress": False, **options}
        begin = time.monotonic()
        engine = FastEngine(self.model, self.device, **settings)
        self.progress(f"engine built in {time.monotonic() - begin:.1f} s: {engine.describe()}")
        return engine

    def drop(self, engine):
        del engine
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    @property
    def engine(self):
        """The engine of the step, accuracy, e2e and maxrate sections; each releases its symbols when done."""
        if self._engine is None:
            capacity = max(MAX_BATCH, MAXRATE_SYMBOLS, E2E_SYMBOLS,
                           self.suite.symbols if "accuracy" in self.args.sections else 0)
            self._engine = self.build_engine(capacity=capacity)
            self.report.update(engine=self._engine.describe(), weight_bytes=self._engine.weight_bytes,
                               state_bytes=self._engine.state_bytes)
        return self._engine

    def close_engine(self):
        if self._engine is not None:
            engine, self._engine = self._engine, None
            self.drop(engine)

    def symbols_at_budget(self, engine, share) -> int:
        """Symbols the engine's state table would hold at `share` of the memory free without it."""
        from client.engine.fast.state_table import slot_layout

        if self.device.type != "cuda":
            return engine.table.capacity
        slot_bytes = sum(slot_layout(part.layout)[1] for part in engine.table.parts)
        free, _ = torch.cuda.mem_get_info(self.device)
        return int(share * (free + (engine.table.capacity + 1) * slot_bytes)) // slot_bytes - 1

    def gpu_counts(self):
        present = torch.cuda.device_count() if self.device.type == "cuda" else 2
        counts = self.args.gpus or sorted({1, present})
        if max(counts) > present:
            raise ValueError(f"--gpus {max(counts)} asked for, but this machine has {present} GPU(s)")
        return counts

    def _copy_first(self):
        if self.bandwidth is None:  # step floors need this run's bandwidth
            self.run_copy()

    def run_copy(self):
        self.bandwidth, median_ms = measure_copy(self.device, self.counts, self.timer)
        self.report.update(copy_gb_per_s=self.bandwidth / 1e9)
        self.progress(f"copy: {self.counts.copy_bytes / 2**20:.0f} MiB in {median_ms:.3f} ms, "
                      f"{self.bandwidth / 1e9:.1f} GB/s")

    def run_step(self):
        self._copy_first()
        self.report.update(step_ms=measure_steps(self.engine, self.device, self.counts, self.timer,
                                                 self.bandwidth, self.args.seed, self.progress))

    def run_baseline(self):
        per_request = measure_baseline(self.model, self.device, self.counts, self.args.seed)
        self.report.update(baseline_per_request_ms=per_request)
        self.progress(f"baseline: {per_request:.3f} ms per request")

    def run_accuracy(self):
        result = self.suite.measure(self.engine, prefix="ACC/")
        self.report.update(accuracy=result)
        self.progress("accuracy suite:\n" + accuracy_table(result))

    def run_precisions(self):
        self._copy_first()
        measure_precisions(self, self.suite)

    def run_state_dtypes(self):
        self._copy_first()
        measure_state_dtypes(self, self.suite)

    def run_compile(self):
        from scripts.compile_bench import measure_compile

        self.close_engine()  # its children build their own engines on this GPU
        self.report.update(compile=measure_compile(self.args.preset, self.args.seed, self.device,
                                                   batches=SHORT_BATCHES))

    def run_e2e(self):
        numbers = measure_e2e(self.engine, self.model, self.device, self.counts, self.args, self.progress)
        self.report.update(e2e_400rps_20sym=numbers)
        self.progress(f"e2e: p50 {_fmt(numbers['p50_ms'])} ms, p99 {_fmt(numbers['p99_ms'])} ms, "
                      f"accuracy {_fmt(numbers['accuracy'], 4)}, {_fmt(numbers['responses_per_s'], 1)} responses/s")

    def run_maxrate(self):
        best, _ = search_max_rate(self.engine, self.model, self.device, self.counts, self.args, self.report,
                                  self.progress)
        self.progress(f"maxrate: {best} req/s with p99 < {P99_LIMIT_MS:g} ms")

    def run_state_rates(self):
        self.close_engine()
        measure_state_rates(self)

    def run_churn(self):
        result = measure_churn(self)
        self.report.update(churn=result)
        self.progress(f"churn: {result}")

    def run_capacity(self):
        result = measure_capacity(self)
        self.report.update(capacity=result)
        self.progress(f"capacity: {result}")

    def run_gpus(self):
        self._copy_first()
        measure_gpus(self)

    def run_shards(self):
        measure_shards(self)

    def run(self) -> list[str]:
        """Every chosen section; a failing one is logged and recorded, and the others still run."""
        failed = []
        for section in self.args.sections:
            self.progress(f"section {section} ...")
            begin = time.monotonic()
            try:
                getattr(self, f"run_{section}")()
            except Exception as exc:
                failed.append(section)
                self.progress(f"section {section} FAILED: {exc}\n{traceback.format_exc()}")
                self.report.update(errors={**self.report.data.get("errors", {}), section: repr(exc)})
            elapsed = time.monotonic() - begin
            self.report.update(section_s={**self.report.data.get("section_s", {}), section: elapsed})
            self.progress(f"section {section} done in {elapsed:.1f} s")
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        return failed


def summary_table(data) -> str:
    lines = [f"device: {data.get('device')}   preset: {data.get('preset')}"]
    if "copy_gb_per_s" in data:
        lines.append(f"copy bandwidth: {data['copy_gb_per_s']:.1f} GB/s")
    if "step_ms" in data:
        lines.append(f"{'B':>4} {'median ms':>10} {'p99 ms':>10} {'floor ms':>10} {'x floor':>8}")
        for batch, row in data["step_ms"].items():
            lines.append(f"{batch:>4} {row['median']:>10.3f} {row['p99']:>10.3f} {row['floor']:>10.3f} "
                         f"{row['median'] / row['floor']:>8.2f}")
    if "baseline_per_request_ms" in data:
        lines.append(f"baseline (fp32, one request at a time): {data['baseline_per_request_ms']:.3f} ms/request")
    if "accuracy" in data:
        lines.append("accuracy suite (within 1e-3 and max error per tower, per input family):")
        lines.append(accuracy_table(data["accuracy"]))
    for name, row in data.get("precisions", {}).items():
        steps = ", ".join(f"B={b} {r['median']:.3f}" for b, r in row["step_ms"].items())
        gate = row["accuracy"]["gate"]
        lines.append(f"precision {name}: step ms {steps}; gate {'passed' if gate['passed'] else 'FAILED'} "
                     f"(worst {gate['worst'][0]} {gate['worst'][1]} {100 * gate['worst'][2]:.2f}%)")
    for name, row in data.get("state_dtypes", {}).items():
        steps = ", ".join(f"B={b} {r['median']:.3f}" for b, r in row["step_ms"].items())
        gate = row["accuracy"]["gate"]
        lines.append(f"state {name}: {row['symbols_at_budget']} symbols at the budget; step ms {steps}; gate "
                     f"{'passed' if gate['passed'] else 'FAILED'} (worst {gate['worst'][0]} {gate['worst'][1]} "
                     f"{100 * gate['worst'][2]:.2f}%)")
    if "compile" in data:
        lines.append(f"compile: {json.dumps(data['compile'])[:600]}")
    if "e2e_400rps_20sym" in data:
        e2e = data["e2e_400rps_20sym"]
        lines.append(f"e2e 400 req/s, 20 symbols: p50 {_fmt(e2e['p50_ms'])} ms, p99 {_fmt(e2e['p99_ms'])} ms, "
                     f"accuracy {_fmt(e2e['accuracy'], 4)}, {_fmt(e2e['responses_per_s'], 1)} responses/s")
    if "max_rate_runs" in data:
        for run in data["max_rate_runs"]:
            lines.append(f"rate {run['rate']:>8g} req/s: p50 {_fmt(run['p50_ms']):>7} ms, "
                         f"p99 {_fmt(run['p99_ms']):>7} ms, accuracy {_fmt(run['accuracy'], 4)}, "
                         f"missed {run['missed']}  {'pass' if run['passed'] else 'FAIL'}")
        lines.append(f"max rate with p99 < {P99_LIMIT_MS:g} ms over {MAXRATE_SYMBOLS} symbols: "
                     f"{data['max_rate_p99_50ms']} req/s")
    for name, row in data.get("state_rates", {}).items():
        lines.append(f"state {name} ({row['state_bytes_per_symbol'] / 2**20:.1f} MiB a symbol): max rate over "
                     f"{MAXRATE_SYMBOLS} symbols {row['max_rate_p99_50ms']} req/s")
    if "churn" in data:
        c = data["churn"]
        lines.append(f"churn: {c['symbols']} symbols through {c['gpu_slots']} GPU slots, {c['offloaded']} offloads, "
                     f"{c['restored']} returns, bit-equal to never offloaded: {c['bit_equal']}; step ms p50 "
                     f"{c['step_ms_p50']:.2f} p99 {c['step_ms_p99']:.2f} max {c['step_ms_max']:.2f}")
    if "capacity" in data:
        c = data["capacity"]
        lines.append(f"capacity: {c['symbols_at_budget']} symbols at {c['state_memory']:.0%} of free memory; "
                     f"{c['new_symbols']} new symbols at {E2E_RATE:g} req/s: p50 {_fmt(c['p50_ms'])} ms, p99 "
                     f"{_fmt(c['p99_ms'])} ms, missed {c['missed']}, slowest step of B <= 20 "
                     f"{_fmt(c['step_ms_max_b20'])} ms ({c['steps_over_limit']} over {STEP_LIMIT_MS:g} ms)")
    for gpus, row in data.get("gpus", {}).items():
        steps = ", ".join(f"B={b} {r['median']:.3f} ({r['median'] / r['floor']:.2f}x)" for b, r in row["step_ms"].items())
        e2e = row["e2e_400rps_20sym"]
        submits = ", ".join(f"B={b} {r['median']:.3f}" for b, r in row["submit_ms"].items())
        lines.append(f"{gpus} GPU(s) {row['towers']}: step ms {steps}; submit->result ms {submits}; e2e p50 "
                     f"{_fmt(e2e['p50_ms'])} ms, p99 {_fmt(e2e['p99_ms'])} ms")
    for gpus, row in data.get("shards", {}).items():
        lines.append(f"{gpus} shard(s): max rate over {SHARD_SYMBOLS} symbols {row['max_rate_p99_50ms']} req/s")
    if "section_s" in data:
        lines.append("seconds per section: " + ", ".join(f"{name} {seconds:.1f}"
                                                         for name, seconds in data["section_s"].items()))
    if data.get("errors"):
        lines.append(f"FAILED sections: {', '.join(data['errors'])}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    log_path = None
    if args.log_dir is not None:
        os.makedirs(args.log_dir, exist_ok=True)
        log_path = os.path.join(args.log_dir, f"bench-{time.strftime('%Y%m%d-%H%M%S')}.log")
        logging.basicConfig(filename=log_path, level=logging.INFO,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    else:
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.device.type == "cuda":
        torch.cuda.set_device(torch.device(args.device).index or 0)  # events and synchronize() then refer to the chosen GPU
    progress = Progress(log_path)
    report = Report(args.json)
    if args.merge and args.json and os.path.exists(args.json):
        with open(args.json) as existing:
            report.data = json.load(existing)
    report.update(device=_device_name(args.device), preset=args.preset, seed=args.seed, quick=args.quick,
                  sections=args.sections, counts=args.counts.__dict__, torch=torch.__version__,
                  pipeline_min_batch=args.pipeline_min_batch or PIPELINE_MIN_BATCH)
    progress(f"bench on {report.data['device']}: preset {args.preset}, sections {','.join(args.sections)}")
    failed = Bench(args, report, progress).run()
    report.update(total_s=time.monotonic() - progress.start)
    print(summary_table(report.data))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
