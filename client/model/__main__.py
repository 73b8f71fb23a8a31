"""python -m client.model --preset NAME --manifest: print the preset's state-dict manifest as JSON."""
import json
import sys

from client import cli

from . import PRESETS, manifest

PROG = "python -m client.model"


def main(argv=None):
    parser = cli.ArgumentParser(prog=PROG, description=__doc__)
    parser.add_argument("--preset", default="full", choices=sorted(PRESETS))
    parser.add_argument("--manifest", action="store_true", help="print the state-dict manifest (no weights allocated)")
    args = parser.parse_args(argv)
    if not args.manifest:
        parser.error("nothing to do: pass --manifest")
    json.dump({"tensors": manifest(args.preset)}, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return cli.EXIT_OK


if __name__ == "__main__":
    sys.exit(cli.run_cli(main, PROG))
