"""Write the deterministic synthetic weights of a preset as a torch state dict.

    python scripts/make_weights.py --preset full --seed 0 --out weights/full-0.pt
"""
import argparse
import os
import sys
import time
from pathlib import Path


import torch

from client import cli
from client.model import PRESETS, get_preset
from client.weights import fingerprint, make_weights

PROG = cli.prog_name("scripts/make_weights.py")


class CountingWriter:
    """A file that reports the bytes written through it: torch.save writes a state dict through write()."""

    def __init__(self, file, progress: cli.Progress):
        self.file, self.progress, self.written = file, progress, 0

    def write(self, data) -> int:
        written = self.file.write(data)
        self.written += written
        self.progress.update(self.written)
        return written

    def flush(self):
        self.file.flush()


def save(state: dict, out: Path) -> None:
    """torch.save into out (through a temporary file, so that out is whole or absent), with progress."""
    total = sum(t.numel() * t.element_size() for t in state.values())
    progress = cli.Progress(total, f"saving {out}", formatter=cli.format_bytes)
    tmp = out.with_suffix(out.suffix + ".tmp")
    try:
        with open(tmp, "wb") as file:
            torch.save(state, CountingWriter(file, progress))
    except BaseException:  # a full disk, Ctrl-C: no partial file left behind (the full preset's is 7.9 GB)
        tmp.unlink(missing_ok=True)
        raise
    progress.update(total)  # the archive's own records make the file a little larger than the tensors
    progress.close()
    tmp.replace(out)


def main(argv=None) -> int:
    parser = cli.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", required=True, choices=sorted(PRESETS))
    parser.add_argument("--seed", type=cli.seed, default=0)
    parser.add_argument("--out", required=True, help="output .pt file")
    args = parser.parse_args(argv)
    if args.out.endswith(os.sep):  # Path() drops the "/": the weights went into a file named after the folder
        parser.error(f"--out {args.out} names a folder; give a file path")
    args.out = Path(args.out)
    # checked before the generation (minutes for the full preset), not when saving at its end
    if args.out.is_dir():
        parser.error(f"--out {args.out} is a folder; give a file path")
    if args.out.parent.exists() and not args.out.parent.is_dir():
        parser.error(f"--out {args.out}: {args.out.parent} is a file, not a folder")
    if args.out.suffix == ".safetensors":  # the loaders read a .safetensors file as safetensors, not torch's format
        parser.error(f"--out {args.out}: this writes torch's format; name the file .pt")
    try:  # told now, not when saving after the generation
        cli.writable_folder(args.out.parent)
    except OSError as exc:
        parser.error(f"--out {args.out}: cannot write in {args.out.parent}: {exc.strerror}")
    start = time.perf_counter()
    generating = None

    def generated(done, total):
        nonlocal generating
        generating = generating or cli.Progress(total, "generating tensors")
        generating.update(done)
    state = make_weights(get_preset(args.preset), args.seed, progress=generated)
    generating.close()
    save(state, args.out)
    print("fingerprinting ...", file=sys.stderr, flush=True)
    count = sum(t.numel() for t in state.values())
    print(f"{args.out}: {len(state)} tensors, {count:,} values, fingerprint {fingerprint(state)}, "
          f"{time.perf_counter() - start:.1f} s")
    return cli.EXIT_OK


def run() -> int:
    """The console script's entry point (pyproject.toml): main with one-line errors and exit codes."""
    return cli.run_cli(main, PROG)


if __name__ == "__main__":
    sys.exit(run())
