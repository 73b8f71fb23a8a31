"""The torch.compile'd step against the hand-fused one, both inside the engine's CUDA graphs: step median and p99
at each batch size, their predictions' largest difference, and each engine's startup (the compiled one's
compilation included) with a cold and a warm compile cache.

    python scripts/compile_bench.py --preset full --json bench/compile_h100.json
    python scripts/compile_bench.py --preset tiny --device cpu --batches 1,4 --iters 5   # CPU smoke run

From Python (e.g. scripts/bench.py's compile section):

    from scripts.compile_bench import measure_compile
    result = measure_compile("full", seed=0, device="cuda", batches=(1, 20, 64))

Each measurement runs in a child process, so that "cold" is what a fresh machine sees: new, empty
TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR, where everything compiles (Inductor's glue, and the Triton kernels
that both engines use). The "cold" child builds the compiled engine first, then the hand-fused one (whose shared
kernels are then warm), and times both; the "warm" child does the same again with those directories (Inductor's
FX graph cache and Triton's cache hit); the "hand_fused_cold" child builds only the hand-fused engine with
directories of its own, for the startup a fresh machine sees without compile. Weights are generated from the seed
in each child, outside the startup times.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from client import cli
from client.engine.precision import Precision, precision_argument
from client.model import PRESETS
from scripts.benchmarks.harness import Timer

BATCHES = (1, 20, 64)
PROG = "scripts/compile_bench.py"


def log(msg):
    sys.stderr.write(f"[{time.strftime('%H:%M:%S')}] {msg}\n")


def measure_compile(preset="full", seed=0, device="cuda", batches=BATCHES, iters=200, warmup=20,
                    precision="auto") -> dict:
    """The settings, and the results of the children "cold", "warm" and "hand_fused_cold" (measure_in_child), their
    fresh cache directories in a temporary directory, removed afterwards. precision: a spec
    (client/engine/precision.py), which each child parses."""
    settings = dict(preset=preset, seed=seed, device=str(device), batches=list(batches), iters=iters, warmup=warmup,
                    precision=precision)
    both = dict(engines=["compiled", "hand_fused"], time_steps=True)
    with tempfile.TemporaryDirectory(prefix="compile-cache-") as root:
        result = {**settings, "cold": _child({**settings, **both}, os.path.join(root, "shared")),
                  "warm": _child({**settings, **both}, os.path.join(root, "shared")),
                  "hand_fused_cold": _child({**settings, "engines": ["hand_fused"], "time_steps": False},
                                            os.path.join(root, "hand_fused"))}
    return result


def _child(settings, cache):
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "inductor"),
           "TRITON_CACHE_DIR": os.path.join(cache, "triton")}
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        command = [sys.executable, str(Path(__file__).resolve()), "--child", out.name, "--settings",
                   json.dumps(settings)]
        subprocess.run(command, env=env, check=True)  # its progress goes to our stderr
        return json.loads(Path(out.name).read_text())


def measure_in_child(settings) -> dict:
    """In this process: build settings["engines"] in that order ("compiled", "hand_fused"), and with
    settings["time_steps"] time their steps per batch size on the same inputs, alternating, and compare their
    predictions."""
    from torch._dynamo.utils import counters

    from client.engine.fast import FastEngine
    from client.model import load_model

    device = torch.device(settings["device"])
    batches, iters, warmup = settings["batches"], settings["iters"], settings["warmup"]
    model, _ = load_model(settings["preset"], seed=settings["seed"], device=device)
    options = dict(precision=Precision.parse(settings["precision"]), max_batch=max(64, *batches),
                   capacity=sum(batches), host_symbols=0)  # the symbols fit on the GPU: no host tier to pin
    engines = {name: FastEngine(model, device, compile=name == "compiled", **options) for name in settings["engines"]}
    result = {"torch": torch.__version__,
              "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              **{f"{name}_startup_s": engine.startup_s for name, engine in engines.items()}}
    if "compiled" in engines:
        result.update(compile_s=engines["compiled"].compile_s, compiled_graphs=counters["stats"]["unique_graphs"])
    if settings["time_steps"]:
        result["steps"] = time_steps(engines, device, batches, iters, warmup, settings["seed"])
        result["graphs_after_steps"] = counters["stats"]["unique_graphs"]  # equal: nothing compiled after startup
    return result


def time_steps(engines, device, batches, iters, warmup, seed) -> dict:
    """{B: {engine: {median_ms, p99_ms}, max_abs_diff, compiled_over_hand_fused}}: each engine's step inside its
    graphs (step_slots), the engines alternating call by call so that both see the same drift of the machine."""
    timer = Timer(device)
    generator = torch.Generator(device=device).manual_seed(seed)
    steps = {}
    for batch in batches:
        symbols = [f"B{batch}_{i}" for i in range(batch)]
        slots = {name: engine.slots_for(symbols) for name, engine in engines.items()}
        features = torch.randn(batch, 79, generator=generator, device=device)
        times = {name: [] for name in engines}
        for i in range(warmup + iters):
            for name, engine in engines.items():
                ms = timer.time_ms(lambda: engine.step_slots(slots[name], features))
                if i >= warmup:
                    times[name].append(ms)
        row = {name: {"median_ms": float(np.median(t)), "p99_ms": float(np.percentile(t, 99))}
               for name, t in times.items()}
        # both engines stepped the same symbols through the same inputs
        outputs = [engine.step_slots(slots[name], features).cpu() for name, engine in engines.items()]
        row["max_abs_diff"] = float((outputs[0] - outputs[1]).abs().max())
        row["compiled_over_hand_fused"] = row["compiled"]["median_ms"] / row["hand_fused"]["median_ms"]
        steps[str(batch)] = row
        log(f"B={batch}: " + ", ".join(f"{name} {r['median_ms']:.3f} ms (p99 {r['p99_ms']:.3f})"
                                       for name, r in row.items() if isinstance(r, dict)))
    return steps


def summary(result) -> str:
    cold, warm = result["cold"], result["warm"]
    lines = [f"{result['preset']} on {cold['device_name']} (torch {cold['torch']}), precision {result['precision']}",
             f"startup, cold cache: compiled {cold['compiled_startup_s']:.1f} s (compiling {cold['compile_s']:.1f} s), "
             f"hand-fused alone {result['hand_fused_cold']['hand_fused_startup_s']:.1f} s",
             f"startup, warm cache: compiled {warm['compiled_startup_s']:.1f} s (compiling {warm['compile_s']:.1f} s), "
             f"hand-fused {warm['hand_fused_startup_s']:.1f} s",
             "| B | hand-fused median / p99 ms | compiled median / p99 ms | compiled / hand-fused | max abs diff |",
             "| --- | --- | --- | --- | --- |"]
    for label, child in (("cold", cold), ("warm", warm)):
        for batch, row in child["steps"].items():
            hand, comp = row["hand_fused"], row["compiled"]
            lines.append(f"| {batch} ({label}) | {hand['median_ms']:.3f} / {hand['p99_ms']:.3f} | "
                         f"{comp['median_ms']:.3f} / {comp['p99_ms']:.3f} | {row['compiled_over_hand_fused']:.2f} | "
                         f"{row['max_abs_diff']:.1e} |")
    return "\n".join(lines)


def parse_args(argv=None):
    parser = cli.ArgumentParser(prog=PROG, description="torch.compile against the hand-fused step (module docstring).")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="full")
    parser.add_argument("--seed", type=cli.seed, default=0)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)), help="comma-separated batch sizes")
    parser.add_argument("--iters", type=cli.positive_int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--precision", type=precision_argument, default="auto",
                        help="a precision spec (client/engine/precision.py)")
    parser.add_argument("--json", metavar="PATH", type=cli.output_file, help="write the result here")
    parser.add_argument("--child", metavar="OUT", help=argparse.SUPPRESS)
    parser.add_argument("--settings", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        result = measure_in_child(json.loads(args.settings))
        Path(args.child).write_text(json.dumps(result))
        return 0
    cli.check_device(args.device)  # here, not as each child's traceback
    batches = tuple(int(b) for b in args.batches.split(","))
    result = measure_compile(args.preset, args.seed, args.device, batches, args.iters, args.warmup,
                             args.precision.spec)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print(summary(result))
    return 0


if __name__ == "__main__":
    sys.exit(cli.run_cli(main, PROG))
