"""python -m client.model --preset NAME --manifest: print the preset's state-dict manifest as JSON."""
import argparse
import json
import sys

from . import PRESETS, manifest


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m client.model", description=__doc__)
    parser.add_argument("--preset", default="full", choices=sorted(PRESETS))
    parser.add_argument("--manifest", action="store_true", help="print the state-dict manifest (no weights allocated)")
    args = parser.parse_args(argv)
    if not args.manifest:
        parser.error("nothing to do: pass --manifest")
    json.dump({"tensors": manifest(args.preset)}, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
