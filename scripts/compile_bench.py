"""The torch.compile'd step against the hand-fused one, both inside the engine's CUDA graphs: step median and p99
at each batch size, their predictions' largest difference, and the compiled engine's startup (compilation
included) with a cold and a warm compile cache.

    python scripts/compile_bench.py --preset full --json bench/compile_h100.json
    python scripts/compile_bench.py --preset tiny --device cpu --batches 1,4 --iters 5   # CPU smoke run

From Python (e.g. scripts/bench.py, whose directory is then on sys.path):

    from compile_bench import measure_compile
    result = measure_compile("full", seed=0, device="cuda", batches=(1, 20, 64))

Each measurement runs in a child process, so that "cold" means what a fresh machine sees: the first child gets new,
empty TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR (everything compiles: Inductor's glue and the Triton kernels
that both engines use), builds the compiled engine first, then the hand-fused one, and times both; the second child
reuses those directories (warm: Inductor's FX graph cache and Triton's cache hit) and builds the compiled engine
again. Weights are generated from the seed in each child, outside the startup times.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from client.model import PRESETS  # noqa: E402

BATCHES = (1, 20, 64)


def log(msg):
    sys.stderr.write(f"[{time.strftime('%H:%M:%S')}] {msg}\n")


def measure_compile(preset="full", seed=0, device="cuda", batches=BATCHES, iters=200, warmup=20, precision="auto",
                    cache_dir=None) -> dict:
    """{"cold": child result, "warm": child result} (see measure_in_child), plus the settings. cache_dir: where the
    fresh cache directories go (default: a new temporary directory, removed afterwards)."""
    settings = dict(preset=preset, seed=seed, device=str(device), batches=list(batches), iters=iters, warmup=warmup,
                    precision=precision)
    with tempfile.TemporaryDirectory(prefix="compile-cache-", dir=cache_dir) as root:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(root, "inductor"),
               "TRITON_CACHE_DIR": os.path.join(root, "triton")}
        result = {**settings, "cold": _child(settings, env, hand_fused=True),
                  "warm": _child(settings, env, hand_fused=False)}
    return result


def _child(settings, env, hand_fused):
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        command = [sys.executable, str(Path(__file__).resolve()), "--child", out.name, "--settings",
                   json.dumps(settings)] + ([] if hand_fused else ["--no-hand-fused"])
        subprocess.run(command, env=env, check=True)  # its progress goes to our stderr
        return json.loads(Path(out.name).read_text())


class Timer:
    """Milliseconds of one call, as scripts/bench.py measures a step: CUDA events around it with the queue drained
    first (launch included); perf_counter on the CPU."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn):
        if not self.cuda:
            begin = time.perf_counter()
            fn()
            return (time.perf_counter() - begin) * 1e3
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)


def measure_in_child(settings, hand_fused=True) -> dict:
    """In this process: build the compiled engine (and then the hand-fused one), time their steps per batch size
    on the same inputs, alternating, and compare their predictions."""
    from torch._dynamo.utils import counters

    from client.engine.fast import FastEngine
    from client.model import load_model

    device = torch.device(settings["device"])
    batches, iters, warmup = settings["batches"], settings["iters"], settings["warmup"]
    model, _ = load_model(settings["preset"], seed=settings["seed"], device=device)
    options = dict(precision=settings["precision"], max_batch=max(64, *batches), capacity=sum(batches))
    compiled = FastEngine(model, device, compile=True, **options)
    result = {"torch": torch.__version__, "device_name": torch.cuda.get_device_name(device) if device.type == "cuda"
              else "cpu", "compiled_startup_s": compiled.startup_s, "compile_s": compiled.compile_s,
              "compiled_graphs": counters["stats"]["unique_graphs"], "steps": {}}
    engines = {"compiled": compiled}
    if hand_fused:
        engines["hand_fused"] = FastEngine(model, device, **options)
        result["hand_fused_startup_s"] = engines["hand_fused"].startup_s  # built second: shared kernels are warm
    timer = Timer(device)
    generator = torch.Generator(device=device).manual_seed(settings["seed"])
    for batch in batches:
        symbols = [f"B{batch}_{i}" for i in range(batch)]
        slots = {name: engine.slots_for(symbols) for name, engine in engines.items()}
        features = torch.randn(batch, 79, generator=generator, device=device)
        times = {name: [] for name in engines}
        for i in range(warmup + iters):
            for name, engine in engines.items():  # alternating: both see the same drift of the machine
                ms = timer(lambda: engine.step_slots(slots[name], features))
                if i >= warmup:
                    times[name].append(ms)
        row = {name: {"median_ms": float(np.median(t)), "p99_ms": float(np.percentile(t, 99))}
               for name, t in times.items()}
        if hand_fused:  # both stepped the same symbols through the same inputs
            outputs = [engine.step_slots(slots[name], features).cpu() for name, engine in engines.items()]
            row["max_abs_diff"] = float((outputs[0] - outputs[1]).abs().max())
            row["compiled_over_hand_fused"] = row["compiled"]["median_ms"] / row["hand_fused"]["median_ms"]
        result["steps"][str(batch)] = row
        log(f"B={batch}: " + ", ".join(f"{name} {r['median_ms']:.3f} ms (p99 {r['p99_ms']:.3f})"
                                       for name, r in row.items() if isinstance(r, dict)))
    result["graphs_after_steps"] = counters["stats"]["unique_graphs"]  # equal: nothing compiled after startup
    return result


def summary(result) -> str:
    lines = [f"{result['preset']} on {result['cold']['device_name']} (torch {result['cold']['torch']}), "
             f"precision {result['precision']}",
             f"compiled engine startup: cold {result['cold']['compiled_startup_s']:.1f} s "
             f"(compile {result['cold']['compile_s']:.1f} s), warm {result['warm']['compiled_startup_s']:.1f} s "
             f"(compile {result['warm']['compile_s']:.1f} s); hand-fused startup "
             f"{result['cold']['hand_fused_startup_s']:.1f} s (after the compiled engine)",
             "| B | hand-fused median / p99 ms | compiled median / p99 ms | compiled / hand-fused | max abs diff |",
             "| --- | --- | --- | --- | --- |"]
    for batch, row in result["cold"]["steps"].items():
        hand, comp = row["hand_fused"], row["compiled"]
        lines.append(f"| {batch} | {hand['median_ms']:.3f} / {hand['p99_ms']:.3f} | {comp['median_ms']:.3f} / "
                     f"{comp['p99_ms']:.3f} | {row['compiled_over_hand_fused']:.2f} | {row['max_abs_diff']:.1e} |")
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="torch.compile against the hand-fused step (module docstring).")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="full")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)), help="comma-separated batch sizes")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--precision", default="auto", help="a precision spec (client/engine/precision.py)")
    parser.add_argument("--json", metavar="PATH", help="write the result here")
    parser.add_argument("--child", metavar="OUT", help=argparse.SUPPRESS)
    parser.add_argument("--settings", help=argparse.SUPPRESS)
    parser.add_argument("--no-hand-fused", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        result = measure_in_child(json.loads(args.settings), hand_fused=not args.no_hand_fused)
        Path(args.child).write_text(json.dumps(result))
        return 0
    batches = tuple(int(b) for b in args.batches.split(","))
    result = measure_compile(args.preset, args.seed, args.device, batches, args.iters, args.warmup, args.precision)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print(summary(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
