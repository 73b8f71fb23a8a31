"""Where end-to-end latency goes, and what makes its tail: serves streams to the team client over loopback (as
bench.py's e2e section does) and joins, per request, the server's send and receive times with the client's
stages, with what stalled either process (collector runs, sleeping threads woken late, event-loop lag).

    python scripts/e2e_timeline.py --preset full --sessions 2 --json timeline.json
    python scripts/e2e_timeline.py --journal-segment-mb 0.5     # what the journal's state checkpoints cost

For each session it prints each segment's p50 / p90 / max over all answers and over the slowest 1%, the stalls
of both processes, and the slowest answers with the stalls around them. bench/LOG.md sections 22 and 25 read it.
"""
import argparse
import contextlib
import json
import math
import sys
import time
from pathlib import Path


import numpy as np
import torch

from client import cli, event_loop
from client.model.config import PRESETS
from scripts.benchmarks.harness import E2E_RATE, E2E_SYMBOLS, device_name
from scripts.benchmarks.serving import ReferenceTracker, journaled, prefixed_names, prefixed_stream, serve_stream

# (name, from, to): the stages of an answer, in order; "sent" and "end" are the server's send and receive
SEGMENTS = (("server send -> client receive", "sent", "received"),
            ("receive -> batch formed", "received", "batched"),
            ("batch formed -> submitted", "batched", "submitted"),
            ("submitted -> step done", "submitted", "done"),
            ("step done -> answer queued", "done", "answered"),
            ("answer queued -> server receive", "answered", "end"))
STALL_KINDS = ("collections", "late_wakeups", "loop_lags")
PROG = "e2e_timeline.py"


def analyze(timeline: dict, slowest: int = 12, near_s: float = 0.02) -> dict:
    """Join the server's per-request times with the client's stages; summarise segments and stalls."""
    sent, latency = np.asarray(timeline["sent"]), np.asarray(timeline["latency_ms"])
    rows = []
    for uid, stages in timeline["client"].items():
        uid = int(uid)
        if 0 <= uid < len(sent) and np.isfinite(latency[uid]):
            row = {"unique_id": uid, "latency_ms": float(latency[uid]), "sent": float(sent[uid]),
                   "end": float(sent[uid] + latency[uid] / 1e3), **stages}
            row.setdefault("submitted", row.get("batched"))  # process_batch clients have no separate submit
            if all(row.get(stage) is not None for _, a, b in SEGMENTS for stage in (a, b)):
                rows.append(row)
    if not rows:
        raise ValueError("no answered request has every stage on the timeline")
    latencies = np.array([r["latency_ms"] for r in rows])
    p99 = float(np.percentile(latencies, 99))
    tail = [r for r in rows if r["latency_ms"] >= p99]

    def stats(selected):
        out = {}
        for name, a, b in SEGMENTS:
            ms = 1e3 * np.array([r[b] - r[a] for r in selected])
            out[name] = {"p50": float(np.median(ms)), "p90": float(np.percentile(ms, 90)), "max": float(ms.max())}
        return out

    start, end = min(r["sent"] for r in rows), max(r["end"] for r in rows)
    processes = {"server": timeline["stalls"], "client": timeline["client_stalls"]}
    stalls = {}
    for process, events in processes.items():
        stalls[process] = {}
        for kind in STALL_KINDS:
            inside = [e for e in events[kind] if start <= e[0] <= end]
            stalls[process][kind] = {"count": len(inside), "max_ms": 1e3 * max((e[1] for e in inside), default=0.0),
                                     "total_ms": 1e3 * sum(e[1] for e in inside)}
            spent = [e[2] for e in inside if kind != "collections" and len(e) > 2]
            if spent:  # how the late thread spent those intervals (client/stalls.py, Linux only)
                stalls[process][kind]["spent_ms"] = {how: sum(s[how] for s in spent) for how in spent[0]}
        full = [e for e in events["collections"] if start <= e[0] <= end and e[2] == 2]
        stalls[process]["full_collections"] = {"count": len(full), "max_ms": 1e3 * max((e[1] for e in full),
                                                                                        default=0.0)}
    worst = []
    for r in sorted(rows, key=lambda r: -r["latency_ms"])[:slowest]:
        near = [f"{process} {kind} {1e3 * e[1]:.1f} ms at {1e3 * (e[0] - r['sent']):+.1f}{_spent(kind, e)}"
                for process, events in processes.items() for kind in STALL_KINDS
                for e in events[kind] if r["sent"] - near_s <= e[0] <= r["end"]]
        worst.append({"unique_id": r["unique_id"], "latency_ms": r["latency_ms"],
                      "segments_ms": [1e3 * (r[b] - r[a]) for _, a, b in SEGMENTS], "stalls_near": near})
    result = {"answers": len(rows), "p50_ms": float(np.median(latencies)), "p99_ms": p99,
              "segments_all": stats(rows), "segments_slowest_1pct": stats(tail), "stalls": stalls, "slowest": worst,
              "episodes": episodes(rows, start, max(2 * float(np.median(latencies)), 5.0))}
    if timeline.get("steps"):
        steps = timeline["steps"]
        result["arrivals"] = {"all": arrivals(rows, steps), "slowest_1pct": arrivals(tail, steps)}
    if timeline.get("exports") is not None:
        result["checkpoints"] = checkpoints(rows, tail, timeline["exports"])
    return result


def checkpoints(rows, tail, exports) -> dict:
    """What the journal's state checkpoints cost (exports: each one's (began, returned) on the thread that submits,
    just before a submit): that thread's time per export, and the answers whose step came right after one (an
    export began between their receipt and their submit), among all answers and the slowest 1%, with the latency
    of those and of the others."""
    began = np.sort([b for b, _ in exports])

    def after_export(r):
        k = np.searchsorted(began, r["received"])
        return k < len(began) and began[k] <= r["submitted"]
    hit = {r["unique_id"] for r in rows if after_export(r)}
    rest = [r for r in rows if r["unique_id"] not in hit]
    took = 1e3 * np.array([e - b for b, e in exports]) if exports else np.zeros(1)
    return {"exports": len(exports), "export_p50_ms": float(np.median(took)), "export_max_ms": float(took.max()),
            "after_one": len(hit), "after_one_slowest_1pct": sum(r["unique_id"] in hit for r in tail),
            "slowest_1pct": len(tail),
            "p50_ms_after_one": float(np.median([r["latency_ms"] for r in rows if r["unique_id"] in hit]))
            if hit else None,
            "p50_ms_others": float(np.median([r["latency_ms"] for r in rest])) if rest else None}


def arrivals(rows, steps) -> dict:
    """What each answer's request found on arrival (its "received"), from the runtime's step log: a step being
    submitted (formed, not yet submitted: nothing to join yet, bench/LOG.md section 59), or two steps in flight
    (submitted, not yet ended: the pipeline full). Counts of `rows`."""
    formed = np.array([step["formed"] for step in steps])
    submitted = np.array([step["submitted"] for step in steps])
    ended = np.sort([step["ended"] for step in steps if step["ended"] is not None])
    received = np.array([r["received"] for r in rows])
    last = np.searchsorted(formed, received, side="right") - 1
    during_submit = (last >= 0) & (received < submitted[np.maximum(last, 0)])
    in_flight = (np.searchsorted(np.sort(submitted), received, side="right")
                 - np.searchsorted(ended, received, side="right"))
    return {"answers": len(rows), "during_a_submit": int(during_submit.sum()),
            "pipeline_full": int((in_flight >= 2).sum())}


def episodes(rows, start, slow_ms, join_s=0.03) -> list[dict]:
    """The slow answers (over slow_ms) grouped in time: answers sent within join_s of the previous slow one's end
    join its episode. Whether the tail is a few stalls of many answers or many single ones, when each began (s
    after the first send), and the segment that took the most of its answers' time."""
    slow = sorted((r for r in rows if r["latency_ms"] > slow_ms), key=lambda r: r["sent"])
    groups = []
    for r in slow:
        if groups and r["sent"] <= max(g["end"] for g in groups[-1]) + join_s:
            groups[-1].append(r)
        else:
            groups.append([r])
    out = []
    for group in groups:
        segment_ms = {name: float(np.median([1e3 * (r[b] - r[a]) for r in group])) for name, a, b in SEGMENTS}
        out.append({"at_s": group[0]["sent"] - start, "answers": len(group),
                    "span_ms": 1e3 * (max(r["end"] for r in group) - group[0]["sent"]),
                    "max_latency_ms": max(r["latency_ms"] for r in group),
                    "segment": max(segment_ms, key=segment_ms.get), "segment_median_ms": segment_ms})
    return out


def _spent(kind, event) -> str:
    """How the late thread spent a late wake-up's or a loop lag's interval, where the probe could tell."""
    if kind == "collections" or len(event) < 3:
        return ""
    return " (" + ", ".join(f"{how[:-3].replace('_', ' ')} {ms:.1f}" for how, ms in event[2].items()) + ")"


def _ms(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def format_report(result: dict) -> str:
    lines = [f"{result['answers']} answers: p50 {result['p50_ms']:.2f} ms, p99 {result['p99_ms']:.2f} ms",
             f"{'segment (ms)':34} {'all: p50 / p90 / max':>26} {'slowest 1%: p50 / p90 / max':>32}"]
    for name, _, _ in SEGMENTS:
        a, t = result["segments_all"][name], result["segments_slowest_1pct"][name]
        lines.append(f"{name:34} {a['p50']:8.2f} {a['p90']:8.2f} {a['max']:8.2f} "
                     f"{t['p50']:10.2f} {t['p90']:10.2f} {t['max']:10.2f}")
    for process, kinds in result["stalls"].items():
        parts = [f"{kind.replace('_', ' ')} {v['count']} (max {v['max_ms']:.1f} ms"
                 + ("".join(f", {how[:-3].replace('_', ' ')} {ms:.1f}" for how, ms in v["spent_ms"].items())
                    + " ms in all" if "spent_ms" in v else "") + ")" for kind, v in kinds.items()]
        lines.append(f"{process} stalls: " + ", ".join(parts))
    if "arrivals" in result:
        lines.append("on arrival (all / slowest 1%): " + ", ".join(
            f"{what.replace('_', ' ')} {result['arrivals']['all'][what]} / {result['arrivals']['slowest_1pct'][what]}"
            for what in ("during_a_submit", "pipeline_full")))
    if "checkpoints" in result:
        c = result["checkpoints"]
        lines.append(f"journal: {c['exports']} state checkpoints, each {c['export_p50_ms']:.2f} ms (max "
                     f"{c['export_max_ms']:.2f}) of the thread that submits; answers whose step came right after one: "
                     f"{c['after_one']} (p50 {_ms(c['p50_ms_after_one'])} against {_ms(c['p50_ms_others'])} ms), "
                     f"{c['after_one_slowest_1pct']} of the slowest {c['slowest_1pct']}")
    slow = result["episodes"]
    lines.append(f"slow answers in {len(slow)} episodes (at s: answers, span ms, max ms, the longest segment):")
    lines.extend(f"  {e['at_s']:7.3f}: {e['answers']:3d}, {e['span_ms']:6.1f}, {e['max_latency_ms']:6.1f}, "
                 f"{e['segment']} ({e['segment_median_ms'][e['segment']]:.1f})" for e in slow[:40])
    lines.append("slowest answers (ms, the segments in order) and the stalls around them:")
    for w in result["slowest"]:
        segments = " ".join(f"{v:6.2f}" for v in w["segments_ms"])
        lines.append(f"  {w['latency_ms']:7.2f} | {segments} | {'; '.join(w['stalls_near'][:4])}")
    return "\n".join(lines)


def host_memory_problem(preset, symbols, available=None) -> str | None:
    """Why a run on the CPU would not fit in host memory (None if it fits): the fp32 reference model, the engine's
    copy of its weights (fp32 at most), and three states per symbol (the engine's, and the reference's before and
    after a step), 1 GiB beside."""
    from client.engine.fast.state_table import host_memory
    from client.model import get_preset, manifest
    from client.model.ensemble import Ensemble

    weights = sum(4 * math.prod(entry["shape"]) for entry in manifest(preset))
    with torch.device("meta"):
        state = sum(t.numel() * t.element_size()
                    for t in Ensemble(get_preset(preset)).init_state(1, device="meta").values())
    need = 2 * weights + 3 * symbols * state + 2**30
    available = host_memory()[1] if available is None else available
    if need <= available:
        return None
    return (f"the {preset} preset with {symbols} symbols needs about {need / 1e9:.1f} GB of host memory on the CPU "
            f"(the reference model, the engine's weights, three states per symbol), and {available / 1e9:.1f} GB is "
            f"available: run it on a GPU, or with a smaller --preset or fewer --symbols")


def main(argv=None) -> list[dict]:
    ap = cli.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="full", choices=sorted(PRESETS))
    ap.add_argument("--device", default=None, help="cuda (default where available) or cpu")
    ap.add_argument("--seed", type=cli.seed, default=0)
    # typed: a rate of nan passed a check of `rate <= 0`, and failed only once the model and the engine were up
    ap.add_argument("--rate", type=cli.request_rate, default=E2E_RATE, help="requests per second")
    ap.add_argument("--symbols", type=cli.positive_int, default=E2E_SYMBOLS)
    ap.add_argument("--requests", type=cli.positive_int, default=4000, help="requests per session")
    ap.add_argument("--sessions", type=cli.positive_int, default=2, help="sessions in a row on one engine")
    ap.add_argument("--slowest", type=cli.positive_int, default=12, help="slowest answers to list")
    ap.add_argument("--json", type=cli.output_file, help="write the results here")
    ap.add_argument("--journal-segment-mb", type=cli.positive_float, metavar="MB",
                    help="journal every session with state checkpoints (to a temporary folder) in segments of MB "
                         "MiB, and say what the checkpoints cost (0.5: every symbol's state every few seconds at "
                         "400 req/s)")
    ap.add_argument("--stacks", type=Path, help="a folder: the event loop's stack, in both processes, whenever an "
                                                "event loop is held up over 12 ms (server_stacks.txt, "
                                                "client_stacks.txt, appended session after session)")
    args = ap.parse_args(argv)
    if args.requests < args.symbols:
        ap.error("need --requests >= --symbols")
    cli.check_device(args.device)
    try:  # made and tried now, not by the first session once the model and the engine are up
        if args.stacks is not None:
            cli.writable_folder(args.stacks)
    except OSError as exc:
        ap.error(f"--stacks {args.stacks}: cannot write in it: {exc.strerror or exc}")

    from client.engine.fast import FastEngine
    from client.model import load_model

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu":
        problem = host_memory_problem(args.preset, args.symbols)
        if problem:
            raise cli.CliError(problem)
    model, _ = load_model(args.preset, seed=args.seed, device=device)
    # The state table holds the timeline's symbols and no more: the reference targets need the memory beside it.
    engine = FastEngine(model, device=device, max_batch=64, capacity=args.symbols, host_symbols=0,
                        progress=sys.stderr.isatty())
    tracker = ReferenceTracker(model, prefixed_names("TL_", args.symbols), device)
    results = []
    for session in range(args.sessions):
        stream = prefixed_stream("TL_", args.symbols, args.requests, args.seed + 100 + session, args.rate)
        targets = tracker.targets(stream)
        started = time.perf_counter()
        with contextlib.ExitStack() as stack:
            journal = None if args.journal_segment_mb is None else \
                stack.enter_context(journaled(engine, args.journal_segment_mb))[0]
            summary = event_loop.run(serve_stream(engine, stream, targets, args.rate, args.preset, args.seed,
                                                  timeline=True, stacks_dir=args.stacks, journal=journal))
        result = {"session": session, "rate": args.rate, "symbols": args.symbols, "seconds":
                  time.perf_counter() - started, **analyze(summary["timeline"], args.slowest)}
        print(f"== session {session}: " + format_report(result), flush=True)
        results.append(result)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": device_name(device), "preset": args.preset,
                                         "sessions": results}, indent=1))
    return results


def run() -> int:
    """main with one-line errors and exit codes."""
    def played(argv) -> int:
        main(argv)  # its sessions' results, for a caller in Python
        return cli.EXIT_OK
    return cli.run_cli(played, PROG)


if __name__ == "__main__":
    sys.exit(run())
