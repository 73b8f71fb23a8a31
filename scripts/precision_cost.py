"""What a precision costs in step time: several engines in one process, timed in turn (rounds x engines x batch
sizes), so that the machine's drift falls on each alike. A few percent between two precisions is below the
spread of engines timed one after another (scripts/bench.py's precisions section), not below this one's.

    python scripts/precision_cost.py "auto;auto,xlstm.mlstm_x=fp16,xlstm.mlstm_qkv=fp16" --json out.json
    python scripts/precision_cost.py "auto;fp16" --preset tiny --device cpu --rounds 1 --iters 3   # CPU smoke run
"""
import argparse
import json
import sys
from pathlib import Path


import numpy as np
import torch

from client import cli
from client.engine.fast import FastEngine
from client.engine.precision import Precision
from client.model import PRESETS, load_model
from scripts.benchmarks.harness import Timer


def specs_argument(text) -> list[Precision]:
    specs = [spec.strip() for spec in text.split(";")]
    if len(set(specs)) < len(specs):
        raise argparse.ArgumentTypeError(f"a precision spec is given twice in {text!r}")
    try:
        return [Precision.parse(spec) for spec in specs]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def step_ms(engine, slots, features, iters):
    """Median milliseconds of one step (GPU time between events on CUDA, wall time on the CPU)."""
    timer = Timer(features.device)
    return float(np.median([timer.time_ms(lambda: engine.step_slots(slots, features)) for _ in range(iters)]))


def measure(precisions, preset="full", device="cuda", batches=(1, 20, 64), rounds=6, iters=100, warmup=10):
    """{spec: {batch: median over rounds of each round's median step ms}}, plus the rounds themselves."""
    model, _ = load_model(preset, seed=0, device=device)
    # each engine holds the largest batch's symbols; a smaller batch steps the first of them
    engines = {precision.spec: FastEngine(model, device, precision=precision, capacity=max(batches),
                                          max_batch=max(batches), host_symbols=0, progress=False)
               for precision in precisions}
    specs = list(engines)
    slots = {spec: engine.slots_for([f"S{i}" for i in range(max(batches))]) for spec, engine in engines.items()}
    rows = {spec: {b: [] for b in batches} for spec in specs}
    generator = torch.Generator().manual_seed(0)
    for done in range(rounds):
        for spec, engine in engines.items():
            for b in batches:
                features = torch.randn(b, model.cfg.features, generator=generator).to(device)
                step_ms(engine, slots[spec][:b], features, warmup)
                rows[spec][b].append(step_ms(engine, slots[spec][:b], features, iters))
        sys.stderr.write(f"round {done + 1}/{rounds} done\n")
    return {"preset": preset, "device": str(device), "rounds": rounds, "iters": iters,
            "weight_bytes": {spec: engine.weight_bytes for spec, engine in engines.items()},
            "median_ms": {spec: {b: float(np.median(v)) for b, v in row.items()} for spec, row in rows.items()},
            "round_ms": rows}


def main(argv=None):
    parser = cli.ArgumentParser(prog="precision_cost.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("specs", type=specs_argument, help="precision specs separated by ';' (the first is the base)")
    parser.add_argument("--preset", choices=sorted(PRESETS), help="model preset (default: full on CUDA, else tiny)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batches", type=cli.positive_ints, default=[1, 20, 64],
                        help="comma list of batch sizes (default 1,20,64)")
    parser.add_argument("--rounds", type=cli.positive_int, default=6)
    parser.add_argument("--iters", type=cli.positive_int, default=100, help="timed steps a round, engine and batch")
    parser.add_argument("--json", type=cli.output_file, help="write the result here")
    args = parser.parse_args(argv)
    cli.check_device(args.device)
    args.preset = cli.preset_for(args.preset, args.device)
    result = measure(args.specs, args.preset, args.device, args.batches, args.rounds, args.iters)
    base = result["median_ms"][args.specs[0].spec]
    for spec, row in result["median_ms"].items():
        cells = "  ".join(f"B={b} {ms:.3f} ms ({100 * (ms / base[b] - 1):+.1f}%)" for b, ms in row.items())
        print(f"{spec:<48} {cli.format_bytes(result['weight_bytes'][spec]):>9}  {cells}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


def run() -> int:
    """The console script's entry point (pyproject.toml): main with one-line errors and exit codes."""
    return cli.run_cli(main, "precision_cost.py")


if __name__ == "__main__":
    sys.exit(run())
