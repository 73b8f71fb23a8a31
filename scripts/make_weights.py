"""Write the deterministic synthetic weights of a preset as a torch state dict.

    python scripts/make_weights.py --preset full --seed 0 --out weights/full-0.pt
"""
import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from client.model import PRESETS, get_preset  # noqa: E402
from client.weights import fingerprint, make_weights  # noqa: E402


def progress_bar(done, total):
    if done == total or done % max(1, total // 50) == 0:
        sys.stderr.write(f"\rgenerating tensors {done}/{total}")
        if done == total:
            sys.stderr.write("\n")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", required=True, choices=sorted(PRESETS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, type=Path, help="output .pt file")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    state = make_weights(get_preset(args.preset), args.seed, progress=progress_bar)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(args.out.suffix + ".tmp")
    torch.save(state, tmp)
    tmp.replace(args.out)
    count = sum(t.numel() for t in state.values())
    print(f"{args.out}: {len(state)} tensors, {count:,} values, fingerprint {fingerprint(state)}, "
          f"{time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
