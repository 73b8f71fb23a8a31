"""Section floor: where the event's load's latency comes from on this host. The e2e section's stream (E2E_RATE req/s
over E2E_SYMBOLS symbols) served by the same scoring server, in turn, to four clients:
- echo: answers each request frame in its event loop as the frame arrives, no thread and no model: what the host,
  the server and the websocket cost; no client can do better on this host;
- runtime: the team runtime (client/runtime.py) with a team client whose steps end at once: the runtime's threads
  and handoffs added;
- engine: the e2e section's client, the engine behind the team client;
- stand-in: the runtime with a team client that takes, with no device, the engine's time just served: its submit's
  median (spun) and its steps' served medians by symbols (one at a time, as steps queue on the device), the engine's
  step size and forming options. It takes no joins (the engine's joined requests wait for a step of their own here).
  What the engine adds beyond it is neither its submit nor its step.
e2e_runs rounds, each serving the four in turn, every session reported. A tail the echo already has is the host's."""
import os
import time

import numpy as np

from client import event_loop, protocol, transport
from client.model.config import TOWER_NAMES
from scripts.benchmarks.harness import E2E_RATE, E2E_SYMBOLS
from scripts.benchmarks.report import fmt
from scripts.benchmarks.serving import (ServerProcess, ReferenceTracker, prefixed_names, prefixed_stream,
                                        server_config, serve_stream, served_step_ms, session_numbers)

PREFIX = "FLOOR_"
RUNGS = ("echo", "runtime", "engine", "stand-in")
SPIN_S = 0.0003  # the last stretch of a stand-in's wait is spun, not slept: a sleep may end late


def _until(moment, hold_gil=False):
    """Return at perf_counter() `moment`: slept, then spun, the GIL held while spinning (Python work, as a submit)
    or handed on at each turn (a device wait, as the engine's synchronize, which releases it)."""
    if (wait := moment - time.perf_counter() - SPIN_S) > 0:
        time.sleep(wait)
    while time.perf_counter() < moment:
        if not hold_gil:
            time.sleep(0)


class StandInTeam:
    """A team client of the runtime's submit/result kind with no device: submit_batch takes submit_ms, each step
    step_ms(symbols) from when it is submitted or the one ahead of it ends, whichever is later (as steps queue on a
    device), and answers zeros. steps_in_background: as the engine it stands in for says (the runtime's default
    mode, client/team_api.py)."""

    requests_per_symbol = "many"

    def __init__(self, step_ms, submit_ms=0.0, max_batch=None, steps_in_background=False):
        self.step_ms, self.submit_ms, self.max_batch = step_ms, submit_ms, max_batch
        self.steps_in_background = steps_in_background
        self._free_at = 0.0  # when the stand-in device ends its last step (perf_counter)

    def submit_batch(self, batch) -> "StandInStep":
        _until(time.perf_counter() + self.submit_ms / 1000.0, hold_gil=True)
        ids = [uid for requests in batch.values() for uid, _ in requests]
        ends = max(time.perf_counter(), self._free_at) + self.step_ms(len(batch)) / 1000.0
        self._free_at = ends
        return StandInStep(ids, ends)


class StandInStep:
    def __init__(self, ids, ends):
        self.ids, self.ends = ids, ends

    def done(self) -> bool:
        return time.perf_counter() >= self.ends

    def result(self) -> dict:
        _until(self.ends)
        return {"unique_ids": self.ids, "predictions": np.zeros((len(self.ids), len(TOWER_NAMES)), np.float32)}


def served_times(steps) -> dict:
    """What a served session's steps took (the runtime's step log): {submit_ms: formed -> submitted median,
    step_ms: {symbols: served median (served_step_ms)}}."""
    ended = [step for step in steps if step["ended"] is not None]
    if not ended:
        raise RuntimeError("the engine's session ended no step: nothing for the stand-in to take")
    served = served_step_ms(ended, np.inf)
    symbols = np.array([step["symbols"] for step in ended])
    return {"submit_ms": float(np.median([(step["submitted"] - step["formed"]) * 1000.0 for step in ended])),
            "step_ms": {str(b): float(np.median(served[symbols == b])) for b in np.unique(symbols)}}


def step_ms_of(step_ms):
    """A step's ms at any count of symbols from {symbols (a str, as in JSON): ms} (interpolated, the ends held)."""
    known = sorted((int(b), ms) for b, ms in step_ms.items())
    return lambda symbols: float(np.interp(symbols, [b for b, _ in known], [ms for _, ms in known]))


async def echo_session(server: ServerProcess):
    """Play one session answering each request frame at once with zeros, in the loop that read it."""
    async with await transport.connect(f"ws://127.0.0.1:{server.port}", open_timeout=30) as ws:
        await ws.send(ws.encode(protocol.register("floor-echo")))
        async for frame in ws:
            msg = ws.decode(frame)
            if msg["type"] == "inference_request":
                ids, _, _ = protocol.parse_inference_request(msg)
                zeros = np.zeros((len(ids), len(TOWER_NAMES)), np.float32)
                await ws.send(ws.encode(protocol.inference_response(ids, zeros, time.time())))
            elif msg["type"] == "end":
                break
    await server.wait_done()


def serve_echo(bench, stream) -> dict:
    config = server_config(stream, E2E_RATE, bench.args.preset, bench.args.seed)
    stacks = None if bench.args.stacks is None else os.path.join(bench.args.stacks, "server_stacks.txt")
    server = ServerProcess(config, stream, np.zeros((len(stream), len(TOWER_NAMES)), np.float32), stacks_path=stacks)
    try:
        event_loop.run(echo_session(server))
        return _numbers(server.summary())
    finally:
        server.close()


def _numbers(summary) -> dict:
    """A session's latency (its answers are zeros: no accuracy)."""
    latency = summary["latency_ms"]
    return {"p50_ms": latency["p50"], "p99_ms": latency["p99"], "max_ms": latency["max"],
            "responses": summary["responses"], "requests": summary["total_requests"], "missed": summary["missed"],
            **({"inline_steps": summary["inline_steps"]} if "inline_steps" in summary else {})}


def serve_runtime(bench, stream, team_client, run, engine=None, targets=None, step_log=False) -> dict:
    """serve_stream's summary of `stream` served to `team_client` (None: the example's on `engine`) with the run's
    forming options, as the e2e section serves it."""
    if targets is None:
        targets = np.zeros((len(stream), len(TOWER_NAMES)), np.float32)
    return event_loop.run(serve_stream(
        engine, stream, targets, E2E_RATE, bench.args.preset, bench.args.seed, bench.args.pipeline_min_batch,
        max_requests_per_symbol=bench.args.max_requests_per_symbol, team_client=team_client, step_log=step_log,
        stacks_dir=bench.args.stacks, **bench.forming(run)))


def run(bench):
    names = prefixed_names(PREFIX, E2E_SYMBOLS)
    tracker = ReferenceTracker(bench.model, names, bench.device)
    engine, rounds = bench.engine, []
    background = getattr(engine, "steps_in_background", False)
    try:
        for i in range(bench.counts.e2e_runs):
            stream = prefixed_stream(PREFIX, E2E_SYMBOLS, bench.counts.e2e_requests,
                                     bench.args.seed + 1 + 100 * i, E2E_RATE)
            targets = tracker.targets(stream)
            at_once = StandInTeam(lambda symbols: 0.0, max_batch=engine.max_batch, steps_in_background=background)
            sessions = {"echo": serve_echo(bench, stream),
                        "runtime": _numbers(serve_runtime(bench, stream, at_once, i))}
            served = serve_runtime(bench, stream, None, i, engine=engine, targets=targets, step_log=True)
            taken = served_times(served["steps"])
            sessions["engine"] = {**session_numbers(served), **taken}
            stand_in = StandInTeam(step_ms_of(taken["step_ms"]), taken["submit_ms"], max_batch=engine.max_batch,
                                   steps_in_background=background)
            sessions["stand-in"] = _numbers(serve_runtime(bench, stream, stand_in, i))
            options = bench.forming_ms(i)  # the run's runtime options, where given
            rounds.append({**sessions, "options": options} if options else sessions)
            bench.report.update(floor={"rounds": rounds})
            bench.progress(f"floor round {i + 1}/{bench.counts.e2e_runs}"
                           + (" (inline steps)" if sessions["engine"]["inline_steps"] else "") + ": " + "; ".join(
                f"{rung} p50 {fmt(s['p50_ms'])} p99 {fmt(s['p99_ms'])} ms" for rung, s in sessions.items())
                + f"; the engine's submit {fmt(taken['submit_ms'])} ms, steps by symbols (served ms) "
                + ", ".join(f"{b}: {fmt(ms)}" for b, ms in taken["step_ms"].items()))
    finally:
        engine.release(names)


def _inline(sessions) -> bool:
    """Whether a round's engine ran inline steps (a round recorded before the engine's session said: its options)."""
    return bool(sessions["engine"].get("inline_steps", sessions.get("options", {}).get("inline_steps")))


def summary(data) -> list[str]:
    floor = data.get("floor")
    if not floor:
        return []
    lines = [f"floor ({E2E_RATE:g} req/s, {E2E_SYMBOLS} symbols), p50 / p99 ms a session: " + ", ".join(RUNGS)
             + "; the engine's submit and one-symbol step (served medians, ms)"]
    for i, sessions in enumerate(floor["rounds"]):
        engine = sessions["engine"]
        lines.append(f"  round {i + 1}: " + ", ".join(
            f"{fmt(sessions[rung]['p50_ms'])} / {fmt(sessions[rung]['p99_ms'])}" for rung in RUNGS)
            + f"; {fmt(engine['submit_ms'])}, {fmt(engine['step_ms'].get('1'))}"
            + (", inline steps" if _inline(sessions) else ""))
    return lines
