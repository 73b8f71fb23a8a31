"""Which of the engine's CUDA streams share a hardware queue with the stream its steps run on (issue 20; bench/LOG.md
section 48).

A GPU feeds streams through a few hardware queues (CUDA_DEVICE_MAX_CONNECTIONS, 8 by default). Within a queue the
work runs in order: a stream held up (a copy waiting for the one before it, a wait for an event) holds up every
stream sharing its queue. The state table's copy streams hold a whole state's copies (~3 ms): a step whose stream
shares their queue waits for them before it launches, as the swap section's long steps did.

For each pair (a stream held up, another stream) the probe holds the first up for --hold-ms (a sleep kernel, then
a kernel behind it on the same stream) and times an event recorded on the second: ~0 ms apart, --hold-ms together.
The streams: the default stream (where the submitting thread steps), a new stream of torch's pool, the towers'
streams, the table's copy streams, and a whole step's graph replayed on the step stream beside a held copy stream.

    python -m scripts.queue_probe --json queue_probe.json
"""
import json
import os
import sys
import time

import numpy as np
import torch

from client import cli

PROG = "scripts/queue_probe.py"


def sleep_cycles(ms) -> int:
    """Cycles of torch.cuda._sleep that last about `ms` on this GPU."""
    probe = 1_000_000
    torch.cuda._sleep(probe)  # warm-up
    torch.cuda.synchronize()
    begin = time.perf_counter()
    torch.cuda._sleep(probe)
    torch.cuda.synchronize()
    return int(probe * ms / ((time.perf_counter() - begin) * 1000.0))


def held_delay_ms(held, other, cycles, work=None, repeats=3) -> float:
    """Milliseconds until `other`'s work (an event, or work()) completes while `held` sleeps (median of repeats)."""
    delays = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        with torch.cuda.stream(held):
            torch.cuda._sleep(cycles)
            torch.cuda._sleep(1)  # behind the sleep on the same stream: the queue waits here
        begin = time.perf_counter()
        with torch.cuda.stream(other):
            if work is not None:
                work()
            done = torch.cuda.Event()
            done.record(other)
        done.synchronize()
        delays.append((time.perf_counter() - begin) * 1000.0)
    torch.cuda.synchronize()
    return float(np.median(delays))


def main(argv=None):
    import argparse

    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny", help="the engine's model (its streams do not depend on it)")
    parser.add_argument("--hold-ms", type=cli.positive_float, default=5.0)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit(f"{PROG}: needs a CUDA GPU (it probes the GPU's hardware queues)")
    from client.engine.fast import FastEngine
    from client.model import load_model

    engine = FastEngine(load_model(args.preset, seed=0)[0], "cuda", capacity=8, host_symbols=4, progress=False)
    engine.step(["A"], np.zeros((1, 79), np.float32))
    shard, part = engine.shards[0], engine.table.parts[0]
    streams = {"default": torch.cuda.default_stream(), "pool_new": torch.cuda.Stream()}
    streams.update({f"tower_{i}": s for i, s in enumerate(shard.runner.streams or [])})
    copies = {"to_host": part.to_host.stream, "to_gpu": part.to_gpu.stream}
    streams.update(copies)
    cycles = sleep_cycles(args.hold_ms)
    names = list(streams)
    pairs = {held: {other: round(held_delay_ms(streams[held], streams[other], cycles), 3)
                    for other in names if other != held} for held in names}
    graph = shard.graphed.graphs[min(shard.graphed.graphs, key=lambda s: s.rows)]
    replay = {}
    for step_name in ("default", "pool_new"):
        alone = held_delay_ms(torch.cuda.Stream(), streams[step_name], 1, work=graph.replay)
        replay[step_name] = {"alone": round(alone, 3),
                             **{f"{c}_held": round(held_delay_ms(copies[c], streams[step_name], cycles,
                                                                 work=graph.replay), 3) for c in copies}}
    result = {"device": torch.cuda.get_device_name(), "connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS",
                                                                                    "default (8)"),
              "hold_ms": args.hold_ms, "delay_ms": pairs, "graph_replay_ms": replay}
    shared = sorted({tuple(sorted((a, b))) for a, row in pairs.items() for b, ms in row.items()
                     if ms > args.hold_ms / 2})
    print(f"{result['device']}, connections {result['connections']}: streams sharing a queue: "
          + (", ".join(f"{a}+{b}" for a, b in shared) or "none"))
    print("a step's graph replayed on the default / a pool stream, ms (alone, with each copy stream held): "
          + "; ".join(f"{k}: {v}" for k, v in replay.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
