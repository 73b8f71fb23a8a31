"""Several precision specs on some accuracy-suite families, against the fp32 reference and an fp64 one.

    python scripts/accuracy_ab.py "auto;auto,retnet.input_down=fp32" --families feed_mix,stuck --per-symbol 8
    python scripts/accuracy_ab.py "auto;fp32" --preset tiny --device cpu --steps 20 --seeds 0   # CPU smoke run
    python scripts/accuracy_ab.py auto --families scale_1e-2 --seeds 2 --symbols 32 --per-symbol 8 \
        --promote-partials both     # the skinny kernel's partial sums promoted or not (bench/LOG.md section 54)

For each spec and family (worst input seed), per tower: within 1e-3 of the fp32 reference and max/mean error,
then the same against the fp64 reference (the model in float64); and the fp32 reference's own error against the
fp64 one. An engine's error against the fp32 reference is its own rounding and the reference's together: the fp64
line tells them apart.
"""
import argparse
import json
import sys
import time

from client import cli
from client.accuracy import Suite, percent_down, tower_errors, worst_of
from client.constants import TOWER_NAMES
from client.engine.fast import FastEngine
from client.families import FAMILIES
from client.model import PRESETS, load_model
from kernels.skinny_matmul import promoted_partials
from scripts.benchmarks.report import finite_or_none
from scripts.precision_cost import specs_argument


PROMOTES = {"off": (False,), "on": (True,), "both": (False, True)}
PROG = "scripts/accuracy_ab.py"


def seeds_argument(text: str) -> list[int]:
    """argparse type: input seeds, comma-separated, at least one."""
    seeds = [cli.seed(part.strip()) for part in text.split(",") if part.strip()]
    if not seeds:
        raise argparse.ArgumentTypeError(f"needs at least one seed, got {text!r}")
    return seeds


def measure(precisions, families, preset="full", device="cuda", seeds=(0, 1, 2), symbols=4, steps=1000,
            per_symbol=1, fp64=True, progress=lambda message: None, promotes=(True,)):
    """promotes: kernels.skinny_matmul's PROMOTE_PARTIALS for each engine of a spec (an engine captures its products
    with the setting of its build); engines built with it off are named spec+unpromoted."""
    model, _ = load_model(preset, seed=0, device=device)
    suites = {"fp32": Suite(model, device, families=families, symbols_per_family=symbols, steps=steps,
                            long_symbols=0, seeds=seeds, progress=progress)}
    if fp64:  # the same model in float64 and back, in place (fp32 -> fp64 -> fp32 is exact): one copy in memory
        suites["fp64"] = Suite(model.double(), device, families=families, symbols_per_family=symbols, steps=steps,
                               long_symbols=0, seeds=seeds, progress=progress)
        model.float()
        reference = [tower_errors(suites["fp32"].targets[run].cpu().reshape(-1, len(TOWER_NAMES)),
                                  suites["fp64"].targets[run].cpu().reshape(-1, len(TOWER_NAMES)))
                     for run in suites["fp32"].runs]  # all families together: one line per tower
    result = {"families": families, "seeds": list(seeds), "per_symbol": per_symbol, "engines": {}}
    if fp64:
        result["fp32_reference_vs_fp64"] = worst_of([{"all": r} for r in reference])["all"]
    for precision in precisions:
        for promote in promotes:
            name = precision.spec + ("" if promote else "+unpromoted")
            with promoted_partials(promote):
                engine = FastEngine(model, device, precision=precision,
                                    capacity=max(s.symbols for s in suites.values()),
                                    max_rows_per_symbol=per_symbol, host_symbols=0, progress=False)
                result["engines"][name] = {
                    against: suite.measure(engine, prefix=f"{name}/{against}/", per_symbol=per_symbol)["families"]
                    for against, suite in suites.items()}
                progress(f"{name}: measured")
            del engine
    return result


def table(result) -> str:
    lines = []
    if "fp32_reference_vs_fp64" in result:
        lines.append("fp32 reference vs fp64, all families: " + "  ".join(
            f"{t} max {row['max_abs_err']:.1e} mean {row['mean_abs_err']:.1e}"
            for t, row in result["fp32_reference_vs_fp64"].items()))
    for spec, by_reference in result["engines"].items():
        for against, families in by_reference.items():
            for family, towers in families.items():
                lines.append(f"{spec:<34} vs {against} {family:<12} " + "  ".join(
                    f"{t} {percent_down(row['within_atol']):6.2f}% max {row['max_abs_err']:.1e} "
                    f"mean {row['mean_abs_err']:.1e}"  # rounded down: 99.998% is no 100.00%
                    for t, row in towers.items()))
    return "\n".join(lines)


def main(argv=None):
    parser = cli.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("precisions", type=specs_argument, help="precision specs separated by ';'")
    parser.add_argument("--families", default="feed_mix", help="families, comma-separated (default feed_mix)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="full")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--seeds", type=seeds_argument, default="0,1,2",
                        help="input seeds, comma-separated (default 0,1,2)")
    parser.add_argument("--symbols", type=cli.positive_int, default=4, help="symbols per family (default 4)")
    parser.add_argument("--steps", type=cli.positive_int, default=1000, help="requests per symbol (default 1000)")
    parser.add_argument("--per-symbol", type=cli.positive_int, default=1,
                        help="requests of every symbol in every step (a backlog; default 1)")
    parser.add_argument("--no-fp64", action="store_true", help="skip the fp64 reference")
    parser.add_argument("--promote-partials", choices=PROMOTES, default="on",
                        help="the skinny kernel's partial sums of fp32 weights promoted to fp32 adds "
                             "(kernels/skinny_matmul.py PROMOTE_PARTIALS): on, off, or both in turn for each spec "
                             "(default on)")
    parser.add_argument("--json", type=cli.output_file, help="write the result here")
    args = parser.parse_args(argv)
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = [f for f in families if f not in FAMILIES]
    if unknown or not families:
        parser.error(f"unknown families {unknown}; choose from {', '.join(FAMILIES)}")
    cli.check_device(args.device)
    begin = time.monotonic()
    result = measure(args.precisions, families, args.preset, args.device, args.seeds, args.symbols, args.steps,
                     args.per_symbol, not args.no_fp64,
                     lambda m: sys.stderr.write(f"[{time.monotonic() - begin:6.1f} s] {m}\n"),
                     PROMOTES[args.promote_partials])
    print(table(result))
    if args.json:  # a spec with no finite prediction of a tower has NaN errors, which plain JSON cannot hold: null
        with open(args.json, "w") as f:
            json.dump(finite_or_none(result), f, indent=1, allow_nan=False)


if __name__ == "__main__":
    sys.exit(cli.run_cli(main, PROG))
