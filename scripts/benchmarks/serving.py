"""End-to-end serving for the benchmark and scripts/e2e_timeline.py: the project's scoring server in a process of
its own playing a stream to the team client, with targets from the fp32 reference stepped through the same
requests; the e2e and max-rate measurements built on it."""
import asyncio
import contextlib
import math
import multiprocessing
import os
import queue
import tempfile
import time

import numpy as np
import torch

from client import event_loop
from client.engine.precision import fp32_products
from client.model.config import TOWER_NAMES
from client.streams import Stream, generate_stream, symbol_names
from scripts.benchmarks.harness import E2E_RATE, E2E_SYMBOLS, MAXRATE_SYMBOLS, P99_LIMIT_MS
from scripts.benchmarks.report import fmt

REFERENCE_CHUNK = 64  # rows per reference forward when tracking many symbols (~30 GB of states beside)


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


def prefixed_names(prefix, count) -> list[str]:
    """The names of a generated stream's `count` symbols, each carrying `prefix`."""
    return [prefix + name for name in symbol_names(count)]


def prefixed_stream(prefix, num_symbols, num_requests, seed, rate):
    """A generated stream whose symbols carry `prefix`, so that each section has symbols of its own."""
    stream = generate_stream(num_symbols, num_requests, seed, rate=rate)
    return Stream(np.char.add(prefix, stream.symbols), stream.features, stream.delay_ms, meta=stream.meta)


def _serve_in_child(config, stream, targets, to_parent, from_parent, timeline=False, stacks_path=None):
    """Child process: run the scoring server, report its port, then the first team's summary, with its
    per-request send times and latencies under "request_times" (with timeline: those and what stalled the
    process, under "timeline"; with stacks_path, the stacks of its event loop's long stalls there)."""
    from client.stalls import StallProbe
    from server.app import ScoringServer

    async def main():
        probe = StallProbe(stacks_path=stacks_path).start() if timeline or stacks_path else None
        watch = asyncio.create_task(probe.watch_loop()) if probe else None
        server = ScoringServer(config, stream=stream, targets=targets)
        to_parent.put(await server.start())
        await server.wait_done()
        summary = server.summaries()[0]
        summary["request_times"] = server.first_session.request_times()
        if probe:
            watch.cancel()
            probe.stop()
        if timeline:
            summary["timeline"] = {**server.first_session.request_times(), "stalls": probe.events()}
        to_parent.put(summary)
        await asyncio.to_thread(from_parent.get)  # stay up until the client has finished
        await server.stop()

    event_loop.run(main())


class ServerProcess:
    """The project's scoring server in a process of its own, as a real scoring server would be: its pacing,
    its latency clock and its event loop never wait for the client's interpreter (GIL) or event loop."""

    def __init__(self, config, stream, targets, timeline=False, stacks_path=None):
        ctx = multiprocessing.get_context("spawn")
        self._to_parent, self._from_parent = ctx.Queue(), ctx.Queue()
        self._process = ctx.Process(target=_serve_in_child, name="scoring-server", daemon=True,
                                    args=(config, stream, targets, self._to_parent, self._from_parent, timeline,
                                          stacks_path))
        self._process.start()
        self.port = self._get(timeout=120)

    def _get(self, timeout):
        """The child's next message; a child that ended without one is said at once, not after `timeout` (a server
        that cannot start: its traceback is on stderr already)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self._to_parent.get(timeout=0.1)
            except queue.Empty:
                if not self._process.is_alive():
                    raise RuntimeError(f"the scoring server process ended (exit code {self._process.exitcode})") \
                        from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the scoring server process gave no answer in {timeout} s") from None

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


# A self-signed certificate for 127.0.0.1 and its key, the TLS tests' (on loopback, what it costs is the same)
TLS_CERT, TLS_KEY = (os.path.join(os.path.dirname(__file__), "..", "..", "tests", "data", "tls", name)
                     for name in ("cert.pem", "key.pem"))


def server_config(stream, rate, preset, seed, ws_compression=False, tls=False):
    """The scoring server's settings for playing `stream` once at `rate` on loopback, on a free port (tls: over TLS,
    with TLS_CERT)."""
    from server.app import ServerConfig

    return ServerConfig(host="127.0.0.1", port=0, preset=preset, seed=seed, symbols=len(np.unique(stream.symbols)),
                        requests=len(stream), rate=rate, once=True, ws_compression=ws_compression,
                        tls_cert=TLS_CERT if tls else None, tls_key=TLS_KEY if tls else None)


async def serve_stream(engine, stream, targets, rate, preset, seed, pipeline_min_batch=None, timeline=False,
                       max_requests_per_symbol=None, team_client=None, during=None, form_late=True,
                       stacks_dir=None, ws_compression=False, step_log=False, late_after_s=None,
                       form_margin_s=None, punctual_late_after_s=None, join_queued=None, inline_steps=None,
                       late_parts_s=None, stalls=False, tls=False, journal=None) -> dict:
    """Serve `stream` at `rate` to the team client running `engine` (or `team_client`); the server's summary of
    the session. With timeline, the summary's "timeline" also has the client's per-request stages and both
    processes' stalls (scripts/e2e_timeline.py reads them), and with stacks_dir the event loop's stack in each of its
    long stalls (server_stacks.txt, client_stacks.txt there; client/stalls.py). ws_compression: both ends
    take permessage-deflate, as before bench/LOG.md section 50 (to measure against); tls: over TLS (wss://);
    journal: the client's (client/journal.py).
    `during(client)`, a coroutine function, runs beside the session (the backlog section pauses the client with
    it). step_log: the summary's "steps" is the runtime's step log (StreamingClient.steps). stalls: the summary's
    "client_stalls" are a StallProbe's events in the client's process, "started" the session's start
    (time.monotonic()); a session that does not ask runs no probe (the floor section's engine rung, with its step
    log, as its other rungs do).
    late_after_s: the runtime's step clock forms the next step late behind steps this long (punctual_late_after_s:
    while the host wakes its submitter on time), form_margin_s before its learned times say (None: its defaults);
    join_queued, inline_steps, late_parts_s: the runtime's (None: its defaults). The summary's "late_wakes" and
    "latest_wake_ms": how many of the runtime's waits to form a step late ended late (client/step_clock.py
    LATE_WAKE_S), and the latest any ended; "joins": the runtime's joins taken and missed; "inline_steps": whether the
    runtime ran its steps from its event loop; "host_steal_ms_per_s": the CPU time the hypervisor took from the
    host's CPUs during the session, all CPUs together, per second (None where the host does not say)."""
    from client.runtime import StreamingClient
    from client.stalls import StallProbe, host_steal_s
    from team.example_model import ExampleModel

    config = server_config(stream, rate, preset, seed, ws_compression, tls)
    stacks = {side: None if stacks_dir is None else os.path.join(stacks_dir, f"{side}_stacks.txt")
              for side in ("server", "client")}
    if stacks_dir is not None:
        os.makedirs(stacks_dir, exist_ok=True)
        header = (f"== {time.strftime('%H:%M:%S')}: a session of {len(stream)} requests over "
                  f"{len(np.unique(stream.symbols))} symbols at {rate} req/s\n")
        for path in stacks.values():
            with open(path, "a") as f:
                f.write(header)
    server = await asyncio.to_thread(ServerProcess, config, stream, targets, timeline, stacks["server"])
    steal_before, started = host_steal_s(), time.monotonic()
    probe = StallProbe(stacks_path=stacks["client"]).start() if timeline or stacks_dir or stalls else None
    watch = asyncio.create_task(probe.watch_loop()) if probe else None
    try:
        options = {"pipeline_min_batch": pipeline_min_batch, "max_requests_per_symbol": max_requests_per_symbol,
                   "late_after_s": late_after_s, "form_margin_s": form_margin_s,
                   "punctual_late_after_s": punctual_late_after_s, "join_queued": join_queued,
                   "inline_steps": inline_steps, "late_parts_s": late_parts_s}
        if tls:
            options["tls_ca"] = TLS_CERT
        client = StreamingClient(team_client or ExampleModel(engine), f"{'wss' if tls else 'ws'}://127.0.0.1:"
                                 f"{server.port}", "bench", timeline=timeline, form_late=form_late,
                                 ws_compression=ws_compression, step_log=step_log, journal=journal,
                                 **{k: v for k, v in options.items() if v is not None})
        playing = asyncio.create_task(client.run())
        beside = asyncio.create_task(during(client)) if during is not None else None
        done = asyncio.create_task(server.wait_done())
        await asyncio.wait({done, playing}, return_when=asyncio.FIRST_COMPLETED)
        done.cancel()
        client.stop()
        await playing
        if beside is not None:
            await beside
        summary = await asyncio.to_thread(server.summary)
        steal_after = host_steal_s()
        summary.update(late_wakes=client.late_wakes, latest_wake_ms=client.latest_wake_s * 1000.0,
                       joins=dict(client.joins), inline_steps=client.inline_steps,
                       host_steal_ms_per_s=None if steal_before is None or steal_after is None else
                       1e3 * (steal_after - steal_before) / (time.monotonic() - started))
        if timeline:
            summary["timeline"].update(client=client.timeline, client_stalls=probe.events(), steps=client.steps,
                                       exports=client.exports)
        if step_log:
            summary.update(steps=client.steps, frames=client.frames)
        if stalls:
            summary.update(client_stalls=probe.events(), started=started)
        return summary
    finally:
        if probe:
            watch.cancel()
            probe.stop()
        await asyncio.to_thread(server.close)


def served_step_ms(steps, max_symbols) -> np.ndarray:
    """Milliseconds of each step of at most max_symbols symbols in the runtime's step log (a timeline's "steps"),
    from when it could start (its submission, or the end of the step before it) to its answer: the device's time
    as the host sees it, read-back included, with no timing event on the step's stream (an event recorded there
    held launches back while states moved: bench/LOG.md section 48)."""
    return np.array([(end - start) * 1000.0 for start, end in served_step_spans(steps, max_symbols)])


def served_step_spans(steps, max_symbols) -> list:
    """(start, end) on the timeline's clock of each step of at most max_symbols symbols that ended: from when it
    could start (its submission, or the end of the step before it) to its answer (served_step_ms)."""
    spans, last_end = [], -math.inf
    for step in steps:
        if step["ended"] is None:  # failed
            continue
        if step["symbols"] <= max_symbols:
            spans.append((max(step["submitted"], last_end), step["ended"]))
        last_end = step["ended"]
    return spans


def steps_by_rows(steps, row_sizes) -> dict:
    """{rows class: {steps, rows_p50, ms_p50, ms_p90, forming_ms_p50, forming_ms_max}} of the runtime's step log,
    each step under its rows' size class as the runtime's step clock has it (step_size with the engine's captured
    rows), its time as served_step_ms counts it; forming: from the start of its forming to its submit's return,
    the event loop's time on it with inline steps."""
    from client.step_clock import step_size

    ended = [step for step in steps if step["ended"] is not None]
    ms = served_step_ms(ended, math.inf)
    rows = np.array([step["rows"] for step in ended])
    classes = np.array([step_size(step["rows"], step["symbols"], row_sizes)[0] for step in ended])
    forming = np.array([(step["submitted"] - step["formed"]) * 1e3 for step in ended])
    return {str(size): {"steps": int((chosen := classes == size).sum()), "rows_p50": float(np.median(rows[chosen])),
                        "ms_p50": float(np.median(ms[chosen])), "ms_p90": float(np.percentile(ms[chosen], 90)),
                        "forming_ms_p50": float(np.median(forming[chosen])),
                        "forming_ms_max": float(forming[chosen].max())}
            for size in sorted(set(classes.tolist()))}


def _percentiles(values) -> dict:
    values = values[~np.isnan(values)]
    if not len(values):
        return {"p50": None, "p99": None, "max": None}
    return {"p50": float(np.median(values)), "p99": float(np.percentile(values, 99)), "max": float(values.max())}


def arrival_numbers(request_times, frames) -> dict:
    """Where a session's requests waited before the runtime had them, ms p50 / p99 / max over the requests: the
    server's pacing ("server_lag_ms": sent - due, how far its sends fell behind the stream; what fell due meanwhile
    went in one turn) and the link with the client's loop ("receipt_lag_ms": from the send to the request frame's
    parse, a resend's first receipt); the most requests one server turn sent ("turn_requests_max") and one frame
    carried ("frame_requests_max"); the request frames the client read ("frames") and their mean requests (each frame
    costs the client's loop its fixed part, bench/LOG.md section 79); and, over the slowest 1% of answers, the mean
    latency and receipt lag. Both processes' clocks are CLOCK_MONOTONIC (time.monotonic, time.perf_counter on
    Linux)."""
    due, sent = np.asarray(request_times["due"]), np.asarray(request_times["sent"])
    latency = np.asarray(request_times["latency_ms"], dtype=np.float64)
    received = np.full(len(sent), np.nan)
    for at, ids in frames:
        ids = np.asarray(ids, dtype=np.int64)
        ids = ids[(ids >= 0) & (ids < len(sent))]
        received[ids] = np.fmin(received[ids], at)
    receipt_lag_ms = (received - sent) * 1e3
    _, turns = np.unique(sent[~np.isnan(sent)], return_counts=True)
    answered = np.flatnonzero(~np.isnan(latency))
    slowest = answered[np.argsort(latency[answered])[-max(len(answered) // 100, 1):]] if len(answered) else answered
    return {"server_lag_ms": _percentiles((sent - due) * 1e3), "receipt_lag_ms": _percentiles(receipt_lag_ms),
            "turn_requests_max": int(turns.max()) if len(turns) else 0,
            "frame_requests_max": max((len(ids) for _, ids in frames), default=0),
            "frames": len(frames), "frame_requests_mean": float(np.mean([len(ids) for _, ids in frames])) if frames
            else 0.0,
            "slowest_1pct": {"latency_ms": float(latency[slowest].mean()) if len(slowest) else None,
                             "receipt_lag_ms": float(np.nanmean(receipt_lag_ms[slowest]))
                             if len(slowest) and not np.isnan(receipt_lag_ms[slowest]).all() else None}}


def arrival_line(arrival) -> str:
    server, receipt = arrival["server_lag_ms"], arrival["receipt_lag_ms"]
    return (f"server lag p99 {fmt(server['p99'])} max {fmt(server['max'])} ms, receipt lag p99 {fmt(receipt['p99'])} "
            f"max {fmt(receipt['max'])} ms, largest turn {arrival['turn_requests_max']} / frame "
            f"{arrival['frame_requests_max']} requests, "
            + (f"{arrival['frames']} frames of {arrival['frame_requests_mean']:.1f} requests on average, "
               if "frames" in arrival else "")  # (not in runs before bench/LOG.md section 79)
            + f"slowest 1% latency {fmt(arrival['slowest_1pct']['latency_ms'])}"
            f" ms of which receipt lag {fmt(arrival['slowest_1pct']['receipt_lag_ms'])}")


def stall_numbers(stalls, started, play_from=None) -> dict:
    """What held the client's event loop up in a session (a StallProbe's events): its lags over 3 ms once play began
    at `play_from` (the first request frame's receipt; None: all), how many, the longest, their sum, and how the loop
    thread spent them (on a CPU, waiting for one, or blocked: the GIL, a lock, a page fault); the longest three (when
    each began, s after the session's start); the longest lag before play ("before_play_ms_max": the runtime's
    collection before it connects); the collector's runs by generation (how many, the longest) and each full one
    (when, how long)."""
    before, lags = [], []
    for lag in stalls["loop_lags"]:
        (before if play_from is not None and lag[0] + lag[1] <= play_from else lags).append(lag)
    spent = {how: sum(lag[2][how] for lag in lags if len(lag) > 2)
             for how in ("on_cpu_ms", "runnable_ms", "blocked_ms")}
    longest = sorted(lags, key=lambda lag: -lag[1])[:3]
    collections = {}
    for _, seconds, generation in stalls["collections"]:
        count, longest_ms = collections.get(generation, (0, 0.0))
        collections[generation] = (count + 1, max(longest_ms, 1e3 * seconds))
    return {"loop_lags": len(lags), "loop_lag_ms_max": 1e3 * max((lag[1] for lag in lags), default=0.0),
            "before_play_ms_max": 1e3 * max((lag[1] for lag in before), default=0.0),
            "loop_lag_ms_sum": 1e3 * sum(lag[1] for lag in lags), "spent_ms": spent,
            "longest": [{"at_s": lag[0] - started, "ms": 1e3 * lag[1], **(lag[2] if len(lag) > 2 else {})}
                        for lag in longest],
            "collections": {str(generation): {"count": count, "max_ms": longest_ms}
                            for generation, (count, longest_ms) in sorted(collections.items())},
            "full_collections": [{"at_s": start - started, "ms": 1e3 * seconds}
                                 for start, seconds, generation in stalls["collections"] if generation == 2]}


def stall_line(stalls) -> str:
    spent = ", ".join(f"{how[:-3].replace('_', ' ')} {ms:.0f}" for how, ms in stalls["spent_ms"].items())
    return (f"loop lags over 3 ms in play: {stalls['loop_lags']} (max {stalls['loop_lag_ms_max']:.1f}, sum "
            f"{stalls['loop_lag_ms_sum']:.0f} ms: {spent}; before play max "
            f"{stalls.get('before_play_ms_max', 0.0):.1f}), collections "
            + (", ".join(f"gen {g}: {c['count']} max {c['max_ms']:.1f} ms" for g, c in stalls["collections"].items())
               or "none"))


def session_numbers(summary) -> dict:
    latency = summary["latency_ms"]
    return {"p50_ms": latency["p50"], "p99_ms": latency["p99"], "max_ms": latency["max"],
            "accuracy": summary["accuracy"],
            "responses_per_s": summary["responses_per_s"], "requests": summary["total_requests"],
            "responses": summary["responses"], "missed": summary["missed"], "joins": summary.get("joins"),
            "late_wakes": summary["late_wakes"],
            "latest_wake_ms": summary["latest_wake_ms"], "inline_steps": summary["inline_steps"],
            "host_steal_ms_per_s": summary["host_steal_ms_per_s"]}


def serve(bench, engine, stream, targets, rate, per_symbol=None, ws_compression=False, step_log=False,
          run=0, tls=False, journal=None) -> dict:
    """session_numbers of `stream` served at `rate` to `engine` with the run's settings (per_symbol: requests of
    a symbol a step may carry, the run's --max-requests-per-symbol by default; run: the section's run, for
    Bench.forming, whose options given are recorded beside the numbers); with step_log, also its steps by rows
    (steps_by_rows)."""
    args = bench.args
    summary = event_loop.run(serve_stream(
        engine, stream, targets, rate, args.preset, args.seed, args.pipeline_min_batch,
        max_requests_per_symbol=per_symbol or args.max_requests_per_symbol, ws_compression=ws_compression,
        stacks_dir=args.stacks, step_log=step_log, stalls=step_log, tls=tls, journal=journal, **bench.forming(run)))
    numbers = session_numbers(summary)
    if step_log:
        numbers["steps_by_rows"] = steps_by_rows(summary["steps"], getattr(engine, "step_rows", ()))
        numbers["arrival"] = arrival_numbers(summary["request_times"], summary["frames"])
        numbers["client_stalls"] = stall_numbers(summary["client_stalls"], summary["started"],
                                                 summary["frames"][0][0] if summary["frames"] else None)
    return {**numbers, **bench.forming_ms(run)}


def measure_e2e(engine, bench, prefix="E2E_", run=0, ws_compression=False, tls=False, journal_mb=None):
    """The session's numbers of E2E_SYMBOLS symbols served at E2E_RATE (run: the stream's index, for its seed;
    tls: over TLS; journal_mb: journaled in segments of that many MiB, as `journaled` says)."""
    tracker = ReferenceTracker(bench.model, prefixed_names(prefix, E2E_SYMBOLS), bench.device)
    stream = prefixed_stream(prefix, E2E_SYMBOLS, bench.counts.e2e_requests, bench.args.seed + 1 + 100 * run,
                             E2E_RATE)
    targets = tracker.targets(stream)
    del tracker
    bench.progress(f"e2e: targets ready; serving {len(stream)} requests at {E2E_RATE:.0f} req/s")
    if journal_mb is None:
        numbers = serve(bench, engine, stream, targets, E2E_RATE, ws_compression=ws_compression, run=run, tls=tls)
    else:
        with journaled(engine, journal_mb) as (journal, restart):
            numbers = serve(bench, engine, stream, targets, E2E_RATE, ws_compression=ws_compression, run=run,
                            tls=tls, journal=journal)
            numbers["journal"] = restart(np.unique(stream.symbols).tolist())
    engine.release(np.unique(stream.symbols).tolist())
    return numbers


@contextlib.contextmanager
def journaled(engine, segment_mb):
    """(a Journal in a temporary directory, restart): the journal with state checkpoints and segments of
    `segment_mb` MiB for a session of the engine's team client; restart(symbols), once the session ends, releases
    their states and times what a restarted client does (load the checkpointed states, replay the journal's tail),
    and says how many checkpoints the session wrote and segments it dropped."""
    from client import team_api
    from client.journal import Journal, replay
    from client.runtime import CACHE_SIZE
    from team.example_model import ExampleModel

    with tempfile.TemporaryDirectory(prefix="bench-journal-") as directory:
        layout = team_api.state_layout(ExampleModel(engine))
        journal = Journal(os.path.join(directory, "journal"), {"team": "bench"}, layout=layout,
                          segment_bytes=int(segment_mb * 2**20), keep=CACHE_SIZE)

        def restart(symbols):
            journal.close()
            before = {symbol: engine.export_state(symbol).result() for symbol in symbols}
            engine.release(symbols)
            began = time.perf_counter()
            again = Journal(journal.path, {"team": "bench"}, layout=layout, keep=CACHE_SIZE)
            replayed = replay(ExampleModel(engine), again, CACHE_SIZE, progress=None)
            restart_s = time.perf_counter() - began
            after = {symbol: engine.export_state(symbol).result() for symbol in symbols}
            # replayed in other steps than played (several requests of a symbol a step): bit for bit where the
            # kernels' sums do not depend on a step's rows; the largest difference of their float32 words else
            differences = [np.abs(before[s].view(np.float32) - after[s].view(np.float32)).max(initial=0.0)
                           for s in symbols if not np.array_equal(before[s], after[s])]
            return {"checkpoints": journal.checkpointed, "segments_dropped": journal.dropped,
                    "states_equal": len(symbols) - len(differences), "states": len(symbols),
                    "largest_state_difference": float(max(differences, default=0.0)),
                    "states_loaded": len(again.checkpoints.covers) if again.checkpoints else 0,
                    "replayed": len(replayed), "replayed_steps": replayed.stepped,
                    "restart_s": restart_s, "segment_mb": segment_mb}

        yield journal, restart


def search_max_rate(engine, bench, num_symbols=MAXRATE_SYMBOLS, prefix="RATE_", key="max_rate", rates=None,
                    per_symbol=None):
    """Ascending rates over `num_symbols` symbols until the first whose p99 reaches the limit or that leaves a
    request unanswered (it may never have been stepped, so later runs could not continue its symbol's state).
    Records report[key + "_p99_50ms"] and report[key + "_runs"] as it goes. per_symbol: requests of a symbol a
    step may carry (default: the run's --max-requests-per-symbol)."""
    counts = bench.counts
    tracker = ReferenceTracker(bench.model, prefixed_names(prefix, num_symbols), bench.device)
    runs, best = [], None
    for attempt, rate in enumerate(rates or counts.rates):
        num_requests = max(int(rate * counts.rate_seconds), num_symbols)
        stream = prefixed_stream(prefix, num_symbols, num_requests, bench.args.seed + 2 + attempt, rate)
        bench.progress(f"maxrate {rate:g} req/s: reference targets of {num_requests} requests")
        targets = tracker.targets(stream)
        numbers = serve(bench, engine, stream, targets, rate, per_symbol, step_log=True)
        passed = (numbers["responses"] == numbers["requests"] and numbers["p99_ms"] is not None
                  and numbers["p99_ms"] < P99_LIMIT_MS)
        runs.append({"rate": rate, **numbers, "passed": passed})
        best = rate if passed else best
        bench.report.update(**{f"{key}_p99_50ms": best, f"{key}_runs": runs})
        bench.progress(f"maxrate {rate:g} req/s: p50 {fmt(numbers['p50_ms'])} ms, p99 {fmt(numbers['p99_ms'])} ms, "
                       f"accuracy {fmt(numbers['accuracy'], 4)}, missed {numbers['missed']} -> "
                       f"{'pass' if passed else 'FAIL'}; {arrival_line(numbers['arrival'])}; "
                       f"{stall_line(numbers['client_stalls'])}; steps by rows: "
                       + ", ".join(
                           f"{size}: {c['steps']} x {c['ms_p50']:.1f} ms (rows p50 {c['rows_p50']:g}, formed in "
                           f"{c['forming_ms_p50']:.2f}, max {c['forming_ms_max']:.2f})"
                           for size, c in numbers["steps_by_rows"].items()))
        if not passed:
            break
    engine.release(prefixed_names(prefix, num_symbols))
    return best, runs
