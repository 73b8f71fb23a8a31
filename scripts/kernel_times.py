"""GPU time per kernel of one eager step of the fast engine, summed by kernel name: where two versions of the
engine differ (run it in each checkout, then compare the JSONs with --compare), or where the time of a step's
extra requests goes (compare shapes: --batches 64x1,64x4 --top 25).

    python -m scripts.kernel_times --json new.json                   # full preset, B = 1 and 64
    python -m scripts.kernel_times --batches 64x1,64x4 --top 25      # 64 symbols, 1 and 4 requests each
    python -m scripts.kernel_times --compare old.json new.json       # the kernels whose time moved most
"""
import argparse
import json
import sys
from collections import defaultdict

from client import cli


def shapes(text):
    """"B" (B symbols, one request each) or "GxK" (G symbols, K requests each), comma-separated -> [(G, K)]."""
    result = []
    for part in text.split(","):
        symbols, _, rows = part.strip().partition("x")
        try:
            g, k = int(symbols), int(rows or 1)
        except ValueError:
            g = k = 0
        if g < 1 or k < 1:
            raise ValueError(f"a step shape is B or GxK with positive integers, got {part.strip()!r}")
        result.append((g, k))
    return result


def measure(preset, shapes, steps, seed=0):
    import numpy as np
    import torch
    from torch.profiler import ProfilerActivity, profile

    from client.engine.fast import FastEngine
    from client.engine.fast.layers import StepPlan
    from client.model import load_model

    model, _ = load_model(preset, seed=seed, device="cuda")
    engine = FastEngine(model, device="cuda", graphs=False, capacity=max(g for g, _ in shapes), host_symbols=0,
                        max_rows_per_symbol=max(k for _, k in shapes), progress=False)
    symbols = [f"K{i}" for i in range(max(g for g, _ in shapes))]
    result = {}
    for g, k in shapes:
        slots = engine.slots_for(symbols[:g])
        plan = StepPlan(slots, torch.arange(0, g * k + 1, k, dtype=torch.int32, device="cuda"), k)
        rng = np.random.default_rng(seed)
        features = torch.from_numpy(rng.standard_normal((g * k, 79)).astype(np.float32)).cuda()
        for _ in range(3):
            engine.step_plan(plan, features)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                engine.step_plan(plan, features)
            torch.cuda.synchronize()
        times = defaultdict(float)
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                times[event.name[:90]] += event.device_time / steps  # us per step
        result[str(g) if k == 1 else f"{g}x{k}"] = dict(sorted(times.items(), key=lambda kv: -kv[1]))
    return result


def compare(old, new, top=25):
    for batch in new:
        a, b = old.get(batch, {}), new[batch]
        print(f"B={batch}: old {sum(a.values()):.0f} us, new {sum(b.values()):.0f} us of kernel time per step")
        names = sorted(set(a) | set(b), key=lambda n: -abs(b.get(n, 0) - a.get(n, 0)))
        for name in names[:top]:
            print(f"  {a.get(name, 0):9.1f} {b.get(name, 0):9.1f} {b.get(name, 0) - a.get(name, 0):+9.1f}  {name}")


PROG = "scripts/kernel_times.py"


def main(argv=None) -> int:
    parser = cli.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="full")
    parser.add_argument("--batches", default="1,64", type=cli.argument_type(shapes),
                        help="step shapes: B (one request per symbol) or GxK (G symbols, K requests each), comma list")
    parser.add_argument("--steps", type=cli.positive_int, default=10)
    parser.add_argument("--json")
    parser.add_argument("--top", type=int, default=0, help="also print each shape's slowest kernels")
    parser.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"))
    args = parser.parse_args(argv)
    if args.compare:
        old, new = (json.load(open(path)) for path in args.compare)
        compare(old, new)
        return cli.EXIT_OK
    import torch

    if not torch.cuda.is_available():
        raise cli.CliError(f"needs a CUDA GPU (it profiles the fast engine's CUDA kernels), and this torch "
                           f"({torch.__version__}) sees none")
    result = measure(args.preset, args.batches, args.steps)
    if args.top:
        for name, times in result.items():
            print(f"{name}: {sum(times.values()):.0f} us of kernel time per step")
            for kernel, us in list(times.items())[:args.top]:
                print(f"  {us:9.1f}  {kernel}")
    text = json.dumps(result, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    elif not args.top:
        print(text)
    return cli.EXIT_OK


if __name__ == "__main__":
    sys.exit(cli.run_cli(main, PROG))
