"""Section swap: hot symbols served at 400 req/s while cold symbols cycle through the host tier at 50 symbols/s,
each cold request bringing its symbol's state back from host memory and sending another one out.

The cold symbols outnumber the GPU's slots and come in turn, so each one's state has left the GPU by the time its
next request arrives. Measured on the engine with the default options (bench.tiered_engine): the hot and cold
requests' latencies (the server's clock) and where their time went, the longest step of at most hot-symbols symbols
(from the runtime's step log: a step never waits for a copy of a symbol outside it), the hot answers whose step ran
while a state moved against the others (a state's copy beside a step may hold its answer back: bench/LOG.md section
83), the swaps per second sustained, and each transfer's bandwidth against the pinned host<->device bandwidth
measured in the same run. The targets are the issue's, on an H100 with the full preset.
"""
import math
import time

import numpy as np
import torch

from client import event_loop
from client.model.config import NUM_FEATURES, TOWER_NAMES
from client.streams import Stream
from scripts.benchmarks.harness import median_p99, runs_in_turn
from scripts.benchmarks.report import fmt
from scripts.benchmarks.serving import prefixed_names, serve_stream, served_step_ms, served_step_spans
from scripts.e2e_timeline import analyze, format_report

STEP_LIMIT_MS = 5.0  # targets: no step of at most 20 symbols over 5 ms,
HOT_P99_LIMIT_MS = 6.0  # hot p99 <= 6 ms,
COLD_LIMIT_MS = 15.0  # every cold answer within 15 ms of its request,
BANDWIDTH_SHARE = 0.7  # and transfers at >= 70% of the pinned copy bandwidth
COLD_BEYOND_GPU = 8  # cold symbols beyond the GPU's slots: each is out of the GPU when its turn comes again


def swap_stream(hot, cold, seconds, hot_rate, cold_rate, seed):
    """(stream, is_cold): requests at hot_rate going round the hot symbols, and at cold_rate to the cold symbols
    in turn, merged in time order (the stream's gaps are the send times' differences)."""
    rng = np.random.default_rng(seed)
    hot_times = np.arange(int(hot_rate * seconds)) / hot_rate
    cold_times = (np.arange(int(cold_rate * seconds)) + 0.5) / cold_rate
    names = np.concatenate([np.asarray(hot)[np.arange(len(hot_times)) % len(hot)],
                            np.asarray(cold)[np.arange(len(cold_times)) % len(cold)]])
    is_cold = np.concatenate([np.zeros(len(hot_times), bool), np.ones(len(cold_times), bool)])
    order = np.argsort(np.concatenate([hot_times, cold_times]), kind="stable")
    times = np.concatenate([hot_times, cold_times])[order]
    features = rng.standard_normal((len(times), NUM_FEATURES)).astype(np.float32)
    return Stream(names[order], features, np.diff(times, prepend=0.0) * 1000.0), is_cold[order]


def pinned_bandwidth(device, nbytes, timer, repeats=10) -> dict:
    """Bytes/s of one copy of `nbytes` between pinned host memory and the device, each way (on the CPU, between
    two host buffers)."""
    cuda = device.type == "cuda"
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    device_buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
    rates = {}
    for direction, (dst, src) in {"to_gpu": (device_buffer, host), "to_host": (host, device_buffer)}.items():
        dst.copy_(src, non_blocking=True)  # warm-up
        median_ms, _ = median_p99([timer.time_ms(lambda: dst.copy_(src, non_blocking=True))
                                   for _ in range(repeats)])
        rates[direction] = nbytes / (median_ms / 1000.0)
    return rates


class TimedSubmits:
    """The engine behind the team client, with each submit's rows and wall-clock milliseconds noted (on the CPU a
    submit runs the step; on a GPU it is the submitting thread's own work, placement included)."""

    def __init__(self, engine):
        self.engine, self.submits = engine, []

    def submit(self, symbols, features, **options):
        begin = time.perf_counter()
        pending = self.engine.submit(symbols, features, **options)
        self.submits.append((len(symbols), (time.perf_counter() - begin) * 1000.0))
        return pending

    def __getattr__(self, name):
        return getattr(self.engine, name)


def _latencies(latency_ms) -> dict:
    answered = latency_ms[np.isfinite(latency_ms)]
    if not answered.size:
        return {"p50_ms": None, "p99_ms": None, "max_ms": None, "missed": int(latency_ms.size)}
    return {"p50_ms": float(np.median(answered)), "p99_ms": float(np.percentile(answered, 99)),
            "max_ms": float(answered.max()), "missed": int(latency_ms.size - answered.size)}


def _stages(timeline, requests) -> dict:
    """scripts/e2e_timeline.py's analysis of the timeline, over `requests` (stream indices) alone."""
    chosen = set(requests.tolist())
    return analyze({**timeline, "client": {uid: stages for uid, stages in timeline["client"].items()
                                           if int(uid) in chosen}}, slowest=6)


def answers_beside_moves(client_stages, latency_ms, requests, spans) -> tuple[list, list]:
    """The answered `requests` (stream indices, their unique ids) whose step ran while a state moved (its submit to
    its end overlapping a transfer of `spans`, (began, ended) on the timeline's clock, sorted by began), and the
    others."""
    overlaps, beside, others = _overlap_test(spans), [], []
    for uid in requests.tolist():
        stages = client_stages.get(uid) or {}
        if not np.isfinite(latency_ms[uid]) or stages.get("submitted") is None or stages.get("done") is None:
            continue
        (beside if overlaps(stages["submitted"], stages["done"]) else others).append(uid)
    return beside, others


def _overlap_test(spans):
    """overlaps(start, end): whether [start, end] overlaps one of `spans` ((began, ended), sorted by began)."""
    began = np.array([b for b, _ in spans])
    ended_by = np.maximum.accumulate([e for _, e in spans]) if spans else np.zeros(0)  # latest end of the first k

    def overlaps(start, end):
        k = int(np.searchsorted(began, end))  # the spans that began before `end`
        return k > 0 and ended_by[k - 1] > start
    return overlaps


def beside_moves(client_stages, latency_ms, requests, spans) -> dict:
    """The answers beside a move and the others (answers_beside_moves): how many, their latency's p50 and p99 and
    their step's p50 (submitted -> done): whether a state's copy beside a step holds that step's answer back
    (bench/LOG.md section 83: an export's copy to host memory did), and whether in the step (the GPU's work, its
    copies) or around it (the host's)."""
    def tail(uids):
        values = [latency_ms[uid] for uid in uids]
        steps = [1e3 * (client_stages[uid]["done"] - client_stages[uid]["submitted"]) for uid in uids]
        return {"answers": len(values), "p50_ms": float(np.median(values)) if values else None,
                "p99_ms": float(np.percentile(values, 99)) if values else None,
                "step_p50_ms": float(np.median(steps)) if steps else None}
    return dict(zip(("beside", "others"), map(tail, answers_beside_moves(client_stages, latency_ms, requests, spans))))


def steps_beside_moves(step_spans, spans) -> dict:
    """The steps of `step_spans` ((start, end): serving.served_step_spans) that ran while a state moved (a span of
    `spans`, sorted by began) against the others: how many, their time's p50 and p99 (ms). Whether a move slows the
    step itself (its copies, its kernels) rather than what the host does around it."""
    overlaps, beside, others = _overlap_test(spans), [], []
    for start, end in step_spans:
        (beside if overlaps(start, end) else others).append(1e3 * (end - start))

    def tail(values):
        return {"steps": len(values), "p50_ms": float(np.median(values)) if values else None,
                "p99_ms": float(np.percentile(values, 99)) if values else None}
    return {"beside": tail(beside), "others": tail(others)}


def measure_swap(bench, run=0):
    """One session of the swap stream on the tiered engine (run: the section's run, for Bench.forming)."""
    counts, engine = bench.counts, bench.tiered_engine()
    table = engine.table
    hot = prefixed_names("HOT_", counts.swap_hot_symbols)
    cold = prefixed_names("COLD_", table.capacity + COLD_BEYOND_GPU)
    if len(hot) + len(cold) > table.capacity + table.host_capacity:
        raise ValueError(f"the swap section cycles {len(cold)} cold symbols beside {len(hot)} hot ones: it needs a "
                         f"host tier of at least {len(hot) + len(cold) - table.capacity} symbols, this engine has "
                         f"{table.host_capacity}")
    rng = np.random.default_rng(bench.args.seed + 7)
    for start in range(0, len(cold), engine.max_batch):  # every cold symbol placed once: most now in host memory
        names = cold[start:start + engine.max_batch]
        engine.step(names, rng.standard_normal((len(names), NUM_FEATURES)).astype(np.float32))
    engine.step(hot, rng.standard_normal((len(hot), NUM_FEATURES)).astype(np.float32))
    stream, is_cold = swap_stream(hot, cold, counts.swap_seconds, counts.swap_hot_rate, counts.swap_cold_rate,
                                  bench.args.seed + 8)
    seconds = float(np.sum(stream.delay_ms)) / 1000.0
    bench.progress(f"swap: {len(hot)} hot symbols at {counts.swap_hot_rate:g} req/s, {len(cold)} cold ones in turn "
                   f"at {counts.swap_cold_rate:g}/s, {len(stream)} requests over {seconds:.1f} s")
    table.reset_transfer_times()
    before = dict(table.stats)
    timed = TimedSubmits(engine)
    targets = np.zeros((len(stream), len(TOWER_NAMES)), np.float32)  # latency only: churn checks the states' bits
    session = event_loop.run(serve_stream(timed, stream, targets, None, bench.args.preset, bench.args.seed,
                                          bench.args.pipeline_min_batch, timeline=True, stacks_dir=bench.args.stacks,
                                          **bench.forming(run)))
    stages = {kind: _stages(session["timeline"], np.flatnonzero(chosen))
              for kind, chosen in (("hot", ~is_cold), ("cold", is_cold)) if chosen.any()}
    for kind, result in stages.items():
        bench.progress(f"swap, where the {kind} requests' time went:\n{format_report(result)}")
    moved = {key: table.stats[key] - before[key] for key in ("restored", "offloaded", "restored_ahead", "step_waits")}
    latency = np.asarray(session["request_times"]["latency_ms"], dtype=np.float64)
    submits = np.array(timed.submits or [(0, 0.0)])
    if bench.device.type == "cuda":
        small = served_step_ms(session["timeline"]["steps"], len(hot))
    else:  # a step on the CPU runs inside submit
        small = submits[submits[:, 0] <= len(hot), 1]
    spans = table.transfer_spans()
    hot_beside = {direction: beside_moves(session["timeline"]["client"], latency, np.flatnonzero(~is_cold),
                                          [(b, e) for kind, b, e in spans if kind == direction])
                  for direction in ("to_host", "to_gpu")}
    small_beside = steps_beside_moves(served_step_spans(session["timeline"]["steps"], len(hot)),
                                      [(b, e) for _, b, e in spans])
    bench.progress(f"swap, the steps of at most {len(hot)} symbols that ran beside a state's move: "
                   f"{small_beside['beside']['steps']}, p50/p99 {fmt(small_beside['beside']['p50_ms'])}/"
                   f"{fmt(small_beside['beside']['p99_ms'])} ms against {fmt(small_beside['others']['p50_ms'])}/"
                   f"{fmt(small_beside['others']['p99_ms'])}")
    split = answers_beside_moves(session["timeline"]["client"], latency, np.flatnonzero(~is_cold),
                                 [(b, e) for _, b, e in spans])
    segments_beside = {group: {name: stats["p50"] for name, stats in _stages(session["timeline"],
                                                                              np.array(uids))["segments_all"].items()}
                       for group, uids in zip(("beside", "others"), split) if uids}
    bench.progress("swap, the hot answers beside a move of either way, their segments' p50 (ms) against the others': "
                   + "; ".join(f"{name} {fmt(p50)}/{fmt(segments_beside.get('others', {}).get(name))}"
                               for name, p50 in segments_beside.get("beside", {}).items()))
    bench.progress("swap, the hot answers whose step ran beside a state's move (p50/p99 ms, their step's p50, "
                   "against the others): "
                   + "; ".join(f"{direction} {m['beside']['answers']} ({fmt(m['beside']['p50_ms'])}/"
                               f"{fmt(m['beside']['p99_ms'])}, {fmt(m['beside']['step_p50_ms'])} against "
                               f"{fmt(m['others']['p50_ms'])}/{fmt(m['others']['p99_ms'])}, "
                               f"{fmt(m['others']['step_p50_ms'])})" for direction, m in hot_beside.items()))
    transfers = {}
    for direction in ("to_gpu", "to_host"):
        rates = [size / seconds_ for kind, size, seconds_ in table.transfer_seconds() if kind == direction]
        transfers[direction] = float(np.median(rates)) if rates else None
    pinned = pinned_bandwidth(bench.device, table.parts[0].slot_bytes, bench.timer)
    result = {"hot_symbols": len(hot), "cold_symbols": len(cold), "hot_rate": counts.swap_hot_rate,
              "cold_rate": counts.swap_cold_rate, "seconds": seconds, "requests": len(stream),
              "gpu_slots": table.capacity, "gpu_free_bytes": bench.gpu_free_before_tiers,
              "host_symbols": table.host_capacity, "reserve": table.reserve,
              "hot": _latencies(latency[~is_cold]), "cold": _latencies(latency[is_cold]),
              "step_ms_max_b20": float(small.max()) if small.size else None,
              "step_ms_p99_b20": float(np.percentile(small, 99)) if small.size else None,
              "steps_over_limit": int((small > STEP_LIMIT_MS).sum()),
              "submit_ms_max": float(submits[:, 1].max()),
              "segments_ms": {kind: {"all": r["segments_all"], "slowest_1pct": r["segments_slowest_1pct"]}
                              for kind, r in stages.items()},
              "arrivals": {kind: r.get("arrivals") for kind, r in stages.items()},
              "hot_beside_moves": hot_beside, "steps_beside_moves_b20": small_beside,
              "segments_beside_moves_ms": segments_beside,
              **moved, "swaps_per_s": moved["restored"] / seconds,
              "transfer_gb_per_s": {k: None if v is None else v / 1e9 for k, v in transfers.items()},
              "pinned_gb_per_s": {k: v / 1e9 for k, v in pinned.items()},
              "bandwidth_share": {k: None if transfers[k] is None else transfers[k] / pinned[k] for k in pinned},
              "late_wakes": session["late_wakes"], "latest_wake_ms": session["latest_wake_ms"],
              "joins": session["joins"], "inline_steps": session["inline_steps"],
              "host_steal_ms_per_s": session["host_steal_ms_per_s"]}
    result.update(bench.forming_ms(run))
    engine.release(hot + cold)
    return result


def run(bench):
    """--swap-runs sessions in a row on one engine, each recorded under swap_runs; the headline is the worst hot
    p99 of the runs with the first forming rule (--late-after-ms, --form-margin-ms)."""
    runs = []
    try:
        for i in range(bench.args.swap_runs):
            runs.append(measure_swap(bench, run=i))
            headline = max(runs[::runs_in_turn(bench.args)], key=_hot_tail)
            bench.report.update(swap=headline, swap_runs=runs)
            bench.progress(f"swap run {i + 1}/{bench.args.swap_runs}: {runs[-1]}")
    finally:
        bench.close_tiered_engine()


def _hot_tail(result):
    p99 = result["hot"]["p99_ms"]
    return result["hot"]["missed"], math.inf if p99 is None else p99


def summary(data) -> list[str]:
    if "swap" not in data:
        return []
    s = data["swap"]  # a record kept from a probe may lack step_waits (bench/h100.json's of session 14)
    share = s["bandwidth_share"]
    return [f"swap: {s['hot_symbols']} hot symbols at {s['hot_rate']:g} req/s, {s['cold_symbols']} cold ones through "
            f"the host tier at {s['cold_rate']:g}/s: hot p99 {fmt(s['hot']['p99_ms'])} ms (target <= "
            f"{HOT_P99_LIMIT_MS:g}), cold p50/max {fmt(s['cold']['p50_ms'])}/{fmt(s['cold']['max_ms'])} ms (<= "
            f"{COLD_LIMIT_MS:g}), missed {s['hot']['missed'] + s['cold']['missed']}; longest step of B <= "
            f"{s['hot_symbols']} {fmt(s['step_ms_max_b20'])} ms (<= {STEP_LIMIT_MS:g}), steps that waited for a copy "
            f"{s.get('step_waits', 'not recorded')}; {s['swaps_per_s']:.1f} swaps/s; transfers at "
            f"{fmt(share['to_gpu'])}/{fmt(share['to_host'])} of the pinned bandwidth to GPU/to host (>= "
            f"{BANDWIDTH_SHARE:g}); the host's CPU time taken by its hypervisor "
            f"{fmt(s.get('host_steal_ms_per_s'))} ms/s"]
