"""Run one symbol through the fp32 reference for many steps and report whether every tower stays finite and
bounded, and the spread of its predictions (the weights' scale check).

    python scripts/long_stream.py --preset full --steps 10000          # on a GPU: replayed as a CUDA graph
"""
import argparse
import json
import math
import sys
import time
from pathlib import Path


import torch

from client import cli
from client.model import PRESETS, TOWER_NAMES, load_model

PROG = "scripts/long_stream.py"


def finite_or_none(value: float) -> float | None:
    """A number for the report, None where it is NaN or inf (which JSON cannot hold)."""
    return value if math.isfinite(value) else None


def main(argv=None) -> int:
    ap = cli.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--seed", type=cli.seed, default=0, help="weights seed")
    ap.add_argument("--steps", type=cli.positive_int, default=10_000)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", type=cli.output_file, help="write the report here too")
    args = ap.parse_args(argv)
    cli.check_device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    model, fp = load_model(args.preset, seed=args.seed, device=args.device)
    gen = torch.Generator(device="cpu").manual_seed(1)
    features = torch.randn(args.steps, 1, model.cfg.features, generator=gen).to(args.device)
    preds = torch.empty(args.steps, len(TOWER_NAMES), device=args.device)
    state = model.init_state(1)
    step_in = features[0].clone()
    start = time.perf_counter()
    progress = cli.Progress(args.steps, "steps")  # on a GPU, the steps launched
    with torch.no_grad():
        if args.device.startswith("cuda"):
            # the reference is launch-bound one row at a time: replay its step as a graph, state copied back
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                model(step_in, model.init_state(1))
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out, new_state = model(step_in, state)
            for t in range(args.steps):
                step_in.copy_(features[t])
                graph.replay()
                preds[t] = out[0]
                for name, value in new_state.items():
                    state[name].copy_(value)
                progress.update(t + 1)
        else:
            for t in range(args.steps):
                preds[t], state = model(features[t], state)
                progress.update(t + 1)
        preds = preds.cpu()
    progress.close()
    elapsed = time.perf_counter() - start
    finite = bool(torch.isfinite(preds).all())
    report = {"preset": args.preset, "weights_fingerprint": fp, "steps": args.steps, "finite": finite,
              "seconds": round(elapsed, 1),
              # a spread needs two steps; a tower gone NaN or inf has its values as null
              "towers": {name: {"max_abs": finite_or_none(float(preds[:, i].abs().max())),
                                "std": finite_or_none(float(preds[:, i].std())) if args.steps > 1 else None,
                                "std_last_1000": (finite_or_none(float(preds[-1000:, i].std()))
                                                  if args.steps > 1 else None)}
                         for i, name in enumerate(TOWER_NAMES)}}
    text = json.dumps(report, indent=1, allow_nan=False)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    return 0 if finite else 1


if __name__ == "__main__":
    sys.exit(cli.run_cli(main, PROG))
