"""GPU time per kernel of one eager step of the fast engine, summed by kernel name: where two versions of the
engine differ (run it in each checkout, then compare the JSONs with --compare).

    python -m scripts.kernel_times --json new.json                   # full preset, B = 1 and 64
    python -m scripts.kernel_times --compare old.json new.json       # the kernels whose time moved most
"""
import argparse
import json
import sys
from collections import defaultdict


def measure(preset, batches, steps, seed=0):
    import numpy as np
    import torch
    from torch.profiler import ProfilerActivity, profile

    from client.engine.fast import FastEngine
    from client.model import load_model

    model, _ = load_model(preset, seed=seed, device="cuda")
    engine = FastEngine(model, device="cuda", graphs=False, capacity=max(batches), host_symbols=0, progress=False)
    symbols = [f"K{i}" for i in range(max(batches))]
    result = {}
    for batch in batches:
        slots = engine.slots_for(symbols[:batch])
        features = torch.from_numpy(np.random.default_rng(seed).standard_normal((batch, 79)).astype(np.float32)).cuda()
        for _ in range(3):
            engine.step_slots(slots, features)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                engine.step_slots(slots, features)
            torch.cuda.synchronize()
        times = defaultdict(float)
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                times[event.name[:90]] += event.device_time / steps  # us per step
        result[str(batch)] = dict(sorted(times.items(), key=lambda kv: -kv[1]))
    return result


def compare(old, new, top=25):
    for batch in new:
        a, b = old.get(batch, {}), new[batch]
        print(f"B={batch}: old {sum(a.values()):.0f} us, new {sum(b.values()):.0f} us of kernel time per step")
        names = sorted(set(a) | set(b), key=lambda n: -abs(b.get(n, 0) - a.get(n, 0)))
        for name in names[:top]:
            print(f"  {a.get(name, 0):9.1f} {b.get(name, 0):9.1f} {b.get(name, 0) - a.get(name, 0):+9.1f}  {name}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="full")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--json")
    parser.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"))
    args = parser.parse_args(argv)
    if args.compare:
        old, new = (json.load(open(path)) for path in args.compare)
        compare(old, new)
        return 0
    result = measure(args.preset, [int(b) for b in args.batches.split(",")], args.steps)
    text = json.dumps(result, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
