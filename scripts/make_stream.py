#!/usr/bin/env python
"""Write a synthetic request stream, optionally with the reference model's targets.

    python scripts/make_stream.py --symbols 20 --requests 1000 --seed 1 --out stream.npz
    python scripts/make_stream.py --preset tiny --weights-seed 0 --symbols 20 --requests 1000 --seed 1 \\
        --targets --out stream.npz

--seed seeds the stream; the weights come from --weights PATH or the generator's --weights-seed.
"""
import argparse
import importlib
import os
import sys
from pathlib import Path


from client import cli
from client.model.config import PRESETS
from client.streams import Stream, generate_stream, save_stream, stream_fingerprint

PROG = cli.prog_name("make_stream")


def parse_args(argv):
    parser = cli.ArgumentParser(prog=PROG, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--symbols", type=cli.positive_int, required=True, help="number of symbols (SYM_000, ...)")
    parser.add_argument("--requests", type=cli.positive_int, required=True, help="number of requests")
    parser.add_argument("--seed", type=cli.seed, required=True, help="seed of the stream")
    parser.add_argument("--rate", type=cli.request_rate, help="requests per second (default: 12 ms mean gap)")
    parser.add_argument("--targets", action="store_true", help="store the reference model's predictions")
    parser.add_argument("--preset", choices=sorted(PRESETS), help="model preset (needed with --targets)")
    weights = parser.add_mutually_exclusive_group()
    weights.add_argument("--weights", help="checkpoint (.pt state dict or safetensors) for --targets")
    weights.add_argument("--weights-seed", type=cli.seed,
                         help="seed of the synthetic weights for --targets (default 0)")
    parser.add_argument("--device", help="device for --targets (default: cuda when available)")
    parser.add_argument("--cache-dir", help="targets cache (default: $FASTENS_CACHE/targets or "
                                            "~/.cache/fastens/targets)")
    parser.add_argument("--out", help="output .npz or .parquet (default: stream_<symbols>x<requests>_<seed>.npz)")
    args = parser.parse_args(argv)
    if args.targets and args.preset is None:
        parser.error("--targets needs --preset")
    if not args.targets and (args.preset or args.weights or args.weights_seed is not None or args.device
                             or args.cache_dir):
        parser.error("--preset, --weights, --weights-seed, --device and --cache-dir only apply with --targets")
    if args.out is None:
        args.out = f"stream_{args.symbols}x{args.requests}_{args.seed}.npz"
    if args.out.endswith(os.sep):  # Path() drops the "/": the stream went into a file named after the folder
        parser.error(f"--out {args.out} names a folder; give a file path")
    if Path(args.out).suffix.lower() not in (".npz", ".parquet"):
        parser.error(f"--out must end in .npz or .parquet, got {args.out}")
    if Path(args.out).suffix.lower() == ".parquet":  # told now, not after the targets are computed
        try:
            importlib.import_module("pyarrow")
        except ImportError:
            parser.error(f"--out {args.out}: parquet needs the optional package pyarrow: pip install pyarrow "
                         f"(or write .npz)")
    folder = Path(args.out).parent
    if Path(args.out).is_dir():  # as make_weights: else found when saving, after the targets
        parser.error(f"--out {args.out} is a folder; give a file path")
    if folder.exists() and not folder.is_dir():  # makedirs would say "File exists"
        parser.error(f"--out {args.out}: {folder} is a file, not a folder")
    try:  # told now, not after the targets are computed
        cli.writable_folder(folder)
    except OSError as exc:
        parser.error(f"--out {args.out}: cannot write in {folder}: {exc.strerror}")
    return args


def make_stream(args) -> Stream:
    stream = generate_stream(args.symbols, args.requests, args.seed, rate=args.rate)
    if not args.targets:
        return stream
    import torch
    from client.model import load_model
    from client.targets import compute_targets, model_code_version, targets_fingerprint

    weights_seed = 0 if args.weights_seed is None else args.weights_seed
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cli.check_device(device)
    model, weights_fingerprint = load_model(args.preset, weights=args.weights, seed=weights_seed, device=device)
    targets = compute_targets(model, stream, weights_fingerprint, device=device, cache_dir=args.cache_dir)
    meta = dict(stream.meta, preset=args.preset, weights_fingerprint=weights_fingerprint,
                model_code_version=model_code_version(), targets_fingerprint=targets_fingerprint(targets),
                **({"weights": args.weights} if args.weights else {"weights_seed": weights_seed}))
    return Stream(stream.symbols, stream.features, stream.delay_ms, targets, meta)


def main(argv=None):
    args = parse_args(argv)
    try:
        stream = make_stream(args)
        save_stream(stream, args.out)
    except cli.ORDINARY_ERRORS as error:
        if args.debug:
            raise  # run_cli prints the traceback
        sys.exit(f"{PROG}: {cli.one_line(error)}")
    print(f"wrote {args.out}: {len(stream)} requests over {len(set(stream.symbols.tolist()))} symbols"
          f"{', with targets' if args.targets else ''}; stream fingerprint {stream_fingerprint(stream)[:16]}")


def run() -> int:
    """The console script's entry point (pyproject.toml): main with one-line errors and exit codes."""
    return cli.run_cli(main, PROG)


if __name__ == "__main__":
    sys.exit(run())
