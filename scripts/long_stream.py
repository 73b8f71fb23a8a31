"""Run one symbol through the fp32 reference for many steps and report whether every tower stays finite and
bounded, and the spread of its predictions (the weights' scale check).

    python scripts/long_stream.py --preset full --steps 10000          # on a GPU: replayed as a CUDA graph
"""
import argparse
import json
import sys
import time
from pathlib import Path


import torch

from client.model import PRESETS, TOWER_NAMES, load_model


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--seed", type=int, default=0, help="weights seed")
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    model, fp = load_model(args.preset, seed=args.seed, device=args.device)
    gen = torch.Generator(device="cpu").manual_seed(1)
    features = torch.randn(args.steps, 1, model.cfg.features, generator=gen).to(args.device)
    preds = torch.empty(args.steps, len(TOWER_NAMES), device=args.device)
    state = model.init_state(1)
    step_in = features[0].clone()
    start = time.perf_counter()
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
        else:
            for t in range(args.steps):
                preds[t], state = model(features[t], state)
        preds = preds.cpu()
    elapsed = time.perf_counter() - start
    finite = bool(torch.isfinite(preds).all())
    report = {"preset": args.preset, "weights_fingerprint": fp, "steps": args.steps, "finite": finite,
              "seconds": round(elapsed, 1),
              "towers": {name: {"max_abs": float(preds[:, i].abs().max()), "std": float(preds[:, i].std()),
                                "std_last_1000": float(preds[-1000:, i].std())}
                         for i, name in enumerate(TOWER_NAMES)}}
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0 if finite else 1


if __name__ == "__main__":
    sys.exit(main())
