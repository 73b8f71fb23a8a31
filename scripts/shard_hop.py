"""What a shard's hop costs a step: the same engine in this process, behind a process pipe (client/engine/
shard_process.py) and behind a Ray actor on a local Ray instance (client/engine/shard_ray.py), one shard each,
timed step by step in turn, so that the machine's drift falls on each alike. A step is
submit -> predictions back here, one at a time (no step in flight behind it): the per-step overhead of a
transport is its step time minus the in-process engine's.

    python scripts/shard_hop.py --presets tiny,small --json bench/shard_hop_cpu.json    # CPU
    python scripts/shard_hop.py --presets tiny --rounds 1 --steps 5                      # smoke run

Every engine runs with one torch thread (OMP_NUM_THREADS=1, set here for the shards too), so that the shards
and this process do not fight over the cores.
"""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: this process, the shard processes and Ray's workers

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from client import cli  # noqa: E402
from client.engine import ENGINES, make_engine  # noqa: E402
from client.engine.sharded import ModelSpec, ShardedEngine  # noqa: E402
from client.model import PRESETS, load_model  # noqa: E402

PROG = "scripts/shard_hop.py"
TRANSPORTS = ("in_process", "process", "ray")


def presets_argument(text):
    presets = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in presets if p not in PRESETS]
    if unknown or not presets:
        raise argparse.ArgumentTypeError(f"unknown preset(s) {unknown or text!r}; choose from {', '.join(PRESETS)}")
    return presets


def timed_step_ms(engine, symbols, features):
    """Milliseconds of one step, submit to predictions back here."""
    begin = time.perf_counter()
    engine.step(symbols, features)
    return (time.perf_counter() - begin) * 1e3


def build(transport, preset, engine_name, seed):
    spec = ModelSpec(preset, seed=seed)
    if transport == "in_process":
        model, _ = load_model(preset, seed=seed)
        return make_engine(engine_name, model, "cpu", progress=False)
    if transport == "process":
        from client.engine.shard_process import process_shards

        shards = process_shards(spec, ["cpu"], engine=engine_name, progress=False)
    else:
        from client.engine.shard_ray import LOCAL, ray_shards

        shards = ray_shards(spec, LOCAL, 1, device="cpu", engine=engine_name, progress=False)
    return ShardedEngine(shards, progress=False, transport=transport)


def measure(preset, engine_name, batches, rounds, steps, warmup, seed, progress):
    """{transport: {batch: median over rounds of each round's median step ms}}, the rounds, and the overheads."""
    engines = {transport: build(transport, preset, engine_name, seed) for transport in TRANSPORTS}
    try:
        rng = np.random.default_rng(seed)
        inputs = {batch: ([f"H{i}" for i in range(batch)], rng.standard_normal((batch, 79)).astype(np.float32))
                  for batch in batches}
        for engine in engines.values():
            for symbols, features in inputs.values():
                for _ in range(warmup):
                    engine.step(symbols, features)
        per_round = {t: {b: [] for b in batches} for t in TRANSPORTS}
        for round_index in range(rounds):
            for batch, (symbols, features) in inputs.items():
                # step by step in turn, so that the machine's drift falls on each transport alike
                times = {t: [] for t in TRANSPORTS}
                for _ in range(steps):
                    for transport, engine in engines.items():
                        times[transport].append(timed_step_ms(engine, symbols, features))
                for transport in TRANSPORTS:
                    per_round[transport][batch].append(float(np.median(times[transport])))
            progress(f"{preset}: round {round_index + 1}/{rounds}: " + ", ".join(
                f"{t} B={b} {per_round[t][b][-1]:.3f} ms" for b in batches for t in TRANSPORTS))
        where = {t: (e.describe()["shards"][0]["where"] if t != "in_process" else "this process")
                 for t, e in engines.items()}
    finally:
        for engine in engines.values():
            engine.close()
    median = {t: {b: float(np.median(per_round[t][b])) for b in batches} for t in TRANSPORTS}
    overhead = {t: {b: median[t][b] - median["in_process"][b] for b in batches} for t in ("process", "ray")}
    return {"step_ms": median, "overhead_ms": overhead, "rounds_ms": per_round, "where": where}


def format_table(results) -> str:
    """The medians, each transport's overhead over the in-process step, and its range over the rounds (each
    round's overhead taken against the in-process step of the same round)."""
    lines = ["| preset | B | in process ms | process pipe ms | overhead (rounds) | Ray actor ms | overhead (rounds) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for preset, result in results.items():
        for batch, base in result["step_ms"]["in_process"].items():
            cells = []
            for transport in ("process", "ray"):
                paired = np.subtract(result["rounds_ms"][transport][batch], result["rounds_ms"]["in_process"][batch])
                cells.append(f"{result['step_ms'][transport][batch]:.2f} | "
                             f"{result['overhead_ms'][transport][batch]:+.2f} "
                             f"({paired.min():+.2f} to {paired.max():+.2f})")
            lines.append(f"| {preset} | {batch} | {base:.2f} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = cli.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default="tiny,small", type=presets_argument,
                        help="presets measured in turn (default tiny,small)")
    parser.add_argument("--engine", choices=ENGINES, default="reference",
                        help="the engine each transport runs (default reference, the CPU shards' default)")
    parser.add_argument("--batches", default="1,16", type=cli.positive_ints, help="step sizes (default 1,16)")
    parser.add_argument("--rounds", type=cli.positive_int, default=5)
    parser.add_argument("--steps", type=cli.positive_int, default=100,
                        help="steps timed per round, batch and transport (default 100)")
    parser.add_argument("--warmup", type=cli.positive_int, default=10)
    parser.add_argument("--seed", type=cli.seed, default=0)
    parser.add_argument("--json", metavar="PATH", type=cli.output_file, help="write the results here")
    args = parser.parse_args(argv)
    def progress(message):
        print(message, file=sys.stderr, flush=True)

    from client.engine.shard_ray import import_ray

    ray = import_ray()
    results = {preset: measure(preset, args.engine, args.batches, args.rounds, args.steps, args.warmup, args.seed,
                               progress) for preset in args.presets}
    report = {"device": f"cpu ({platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch thread)",
              "torch": torch.__version__, "ray": ray.__version__, "engine": args.engine, "rounds": args.rounds,
              "steps": args.steps, "presets": results}
    print(format_table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return cli.EXIT_OK


if __name__ == "__main__":
    sys.exit(cli.run_cli(main, PROG))
