"""One-command benchmark of the fast engine: step latency against its memory floor, the original
one-request-at-a-time baseline, accuracy against the fp32 reference, and end-to-end serving through the
project's scoring server on loopback.

    python scripts/bench.py --json bench.json                                  # GPU, full preset
    python scripts/bench.py --preset tiny --device cpu --quick --json out.json  # CPU smoke run

The smoke run takes ~4 minutes on 2 CPU cores, half of it the compile section's torch.compile (leave `compile` out of
--sections for ~2 minutes).

Progress goes to stderr (timestamped), a summary table to stdout, and the JSON is rewritten after every
section, so that a run cut off by a time limit still leaves the numbers it had. Each section is a module of
scripts/benchmarks/; this file is the command line and the runner.
"""
import argparse
import contextlib
import logging
import os
import shutil
import sys
import time
import traceback

import torch

from client import cli
from scripts.benchmarks.awake_cpus import AwakeCpus
from scripts.benchmarks.gpu_clocks import GpuClocks, describe as describe_clocks
from scripts.benchmarks import gpu_sharing
from client.constants import DEFAULT_REQUESTS_PER_SYMBOL
from client.engine.options import add_cluster_arguments
from client.engine.precision import FP32_STATE, add_precision_argument, precision_argument, state_storage_argument
from client.families import FAMILIES
from client.model.config import PRESETS
from client.runtime import PIPELINE_MIN_BATCH
from client.step_clock import LATE_AFTER_S, LATE_WAKE_S, PUNCTUAL_HOLD_S
from kernels.skinny_matmul import promoted_partials
from scripts.benchmarks import SECTIONS
from scripts.benchmarks.harness import (FULL, MAX_BATCH, QUICK, Bench, Counts, device_name, runs_in_turn,
                                        taken_in_turn)
from scripts.benchmarks.report import Progress, Report
from scripts.benchmarks.serving import TLS_CERT, TLS_KEY

PROG = cli.prog_name("scripts/bench.py")


def _sections(text):
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in SECTIONS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown sections {unknown}; choose from {','.join(SECTIONS)}")
    return [name for name in SECTIONS if name in names]  # always in the order that shares work sensibly


def _list_of(item, separator=","):
    def parse(text):
        try:
            values = [item(part.strip()) for part in text.split(separator) if part.strip()]
        except (ValueError, argparse.ArgumentTypeError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        if not values:
            raise argparse.ArgumentTypeError("expected at least one value")
        return values
    return parse


def _rates(text):
    try:
        rates = [cli.positive_float(part) for part in text.split(",") if part.strip()]
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(f"rates must be positive numbers separated by commas, got {text!r}")
    if not rates:
        raise argparse.ArgumentTypeError("--rates needs at least one rate")
    return sorted(set(rates))


def _on_off(text):
    if text not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")
    return text == "on"


def parse_args(argv=None):
    parser = cli.ArgumentParser(prog=PROG, description="Benchmark the fast engine (see the module docstring).")
    parser.add_argument("--preset", choices=sorted(PRESETS), help="model preset (default: full on CUDA, else tiny)")
    parser.add_argument("--seed", type=cli.seed, default=0, help="seed of the synthetic weights, features and streams")
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu for a smoke run")
    parser.add_argument("--json", metavar="PATH", type=cli.output_file,
                        help="write the results here (rewritten after each section)")
    parser.add_argument("--sections", type=_sections, default=list(SECTIONS),
                        help=f"comma list of {','.join(SECTIONS)} (default: all)")
    parser.add_argument("--family-symbols", type=cli.positive_int, help="accuracy suite: symbols per input family "
                                                                     "(default 4)")
    parser.add_argument("--family-steps", type=cli.positive_int, help="accuracy suite: steps per family (default 1000)")
    parser.add_argument("--family-seeds", type=cli.positive_int, help="accuracy suite: input seeds of the families, "
                                                                    "--seed and on (default 3; each family's worst "
                                                                    "seed is its result)")
    parser.add_argument("--long-steps", type=cli.positive_int, help="accuracy suite: steps of the long streams "
                                                                 "(default 10000)")
    add_precision_argument(parser)
    parser.add_argument("--accuracy-backlog-only", action="store_true",
                        help="accuracy suite: only its run with a backlog of K requests of every symbol a step (with "
                             "--merge, the one-request run already in --json stays)")
    parser.add_argument("--precisions", type=_list_of(precision_argument, ";"), default="auto;fp16;bf16;fp32",
                        help="precisions section: precision specs separated by ';' (default: auto;fp16;bf16;fp32)")
    parser.add_argument("--state-dtype", type=state_storage_argument, default=FP32_STATE,
                        help="state storage of the other sections' engine, e.g. fp16 or fp16:nearest (default fp32)")
    parser.add_argument("--state-dtypes", type=_list_of(state_storage_argument, ";"),
                        default="fp32;fp16;fp16:nearest;bf16;fp16,retnet=fp16",
                        help="state_dtypes section: specs separated by ';' (default "
                             "fp32;fp16;fp16:nearest;bf16;fp16,retnet=fp16)")
    parser.add_argument("--gpus", type=_list_of(cli.positive_int), default=None,
                        help="gpus and shards sections: GPU counts to run, comma list (default: 1 and every GPU)")
    parser.add_argument("--merge", action="store_true", help="keep what --json already holds; rewrite only the "
                                                               "sections of this run")
    parser.add_argument("--e2e-requests", type=cli.positive_int, help="requests of the 400 req/s run (default 4000)")
    parser.add_argument("--e2e-runs", type=cli.positive_int,
                        help="e2e sessions in a row, and floor rounds (default 3, --quick 1, or the runs the options "
                             "given in turn take if more)")
    parser.add_argument("--awake-cpus", choices=("off", "on", "alternate"), default="off",
                        help="a lowest-priority spinner on every CPU (scripts/benchmarks/awake_cpus.py): on, through "
                             "every section; alternate, in every second e2e run (default off)")
    parser.add_argument("--stacks", metavar="DIR",
                        help="served sections: whenever the client's or the server's event loop misses its ticks for "
                             "12 ms, its stack (the main thread's), appended to DIR/client_stacks.txt or "
                             "DIR/server_stacks.txt under a line per session (client/stalls.py)")
    parser.add_argument("--ws-compression", choices=("off", "alternate"), default="off",
                        help="e2e section: permessage-deflate on both ends of the websocket in every second run, as "
                             "before bench/LOG.md section 50 (default off)")
    parser.add_argument("--tls", choices=("off", "on", "alternate"), default="off",
                        help="e2e section: the server and the client over TLS (wss://, the TLS tests' self-signed "
                             "certificate) in every run, or in every second run (default off)")
    parser.add_argument("--journal", choices=("off", "on", "alternate"), default="off",
                        help="e2e section: the client journals to a temporary directory with state checkpoints "
                             "(segments of --journal-segment-mb), in every run or every second run; each such run "
                             "also times a restart from it (load the states, replay the tail) (default off)")
    parser.add_argument("--journal-segment-mb", type=cli.positive_float, default=0.5, metavar="MB",
                        help="with --journal: the journal's segments (default 0.5: ~1,400 requests, a checkpoint of "
                             "every symbol each ~3.6 s at 400 req/s, ~500 times the default's rate)")
    parser.add_argument("--rates", type=_rates, help="offered rates (req/s) tried in ascending order by the max-rate "
                                                     "search (default 2000,5000,8000,11000,14000,15000,16000,"
                                                     "17000,20000,...,30000)")
    parser.add_argument("--k1-rates", type=_rates, help="the max-rate search's rates with one request of a symbol a "
                                                        "step (default 3000,4000,...,8000)")
    parser.add_argument("--rate-seconds", type=cli.positive_float, help="length of each max-rate run (default 1.5)")
    parser.add_argument("--swap-cold-rate", type=cli.non_negative_float, metavar="PER_S",
                        help="swap section: cold symbols a second through the host tier (default 50; 0: the hot "
                             "symbols alone, the section's baseline)")
    parser.add_argument("--swap-runs", type=cli.positive_int, default=1,
                        help="swap section: sessions in a row on one engine, each recorded (default 1)")
    parser.add_argument("--late-after-ms", type=_list_of(cli.non_negative_float), metavar="MS[,MS...]",
                        help="served sections: the runtime forms its next step late (just before the one in flight "
                             "ends) behind steps of at least MS (default: client/step_clock.py's LATE_AFTER_S); "
                             "several: the e2e and swap runs take them in turn, the other sections the first")
    parser.add_argument("--form-margin-ms", type=_list_of(cli.non_negative_float), metavar="MS[,MS...]",
                        help="served sections: the next step formed late is formed MS earlier than the runtime's "
                             "learned times say (default: client/step_clock.py's MARGIN_S); several: in turn, as "
                             "--late-after-ms")
    parser.add_argument("--punctual-late-after-ms", type=_list_of(cli.non_negative_float), metavar="MS[,MS...]",
                        help="served sections: behind steps of at least MS (<= --late-after-ms) the next step is "
                             "formed late while the host wakes the runtime's submitter on time (no wait ended over "
                             f"{LATE_WAKE_S * 1000:g} ms late in the last {PUNCTUAL_HOLD_S:g} s: "
                             "client/step_clock.py; default: --late-after-ms, never); several: in turn, as "
                             "--late-after-ms")
    parser.add_argument("--join", type=_list_of(_on_off), metavar="on|off[,...]",
                        help="served sections: a request arriving while a step waits on the GPU behind another "
                             "joins that step (the runtime's join_queued; default on); several: in turn, as "
                             "--late-after-ms")
    parser.add_argument("--inline-steps", type=_list_of(_on_off), metavar="on|off[,...]",
                        help="served sections: the runtime's event loop submits the steps and polls their ends "
                             "itself, no thread handing requests and answers on (the runtime's inline_steps; "
                             "default: the runtime's, on where the engine steps in the background, the fast engine "
                             "on one GPU); several: in turn, as --late-after-ms")
    parser.add_argument("--max-requests-per-symbol", type=cli.positive_int, default=DEFAULT_REQUESTS_PER_SYMBOL,
                        metavar="K", help="requests of one symbol a step may carry (default "
                                          f"{DEFAULT_REQUESTS_PER_SYMBOL}); maxrate and backlog also run K = 1")
    parser.add_argument("--pipeline-min-batch", type=cli.positive_int,
                        help="the client runtime's pipeline_min_batch (default: client.runtime.PIPELINE_MIN_BATCH)")
    add_cluster_arguments(parser, "shards section: the shards as Ray actors on a cluster (--shards of them, default "
                                  "every GPU, or one per node without GPUs) instead of a process per GPU here")
    parser.add_argument("--promote-partials", choices=("on", "off"), default="on",
                        help="the skinny kernel's partial sums of fp32 weights promoted to fp32 adds in every engine "
                             "of the run (kernels/skinny_matmul.py PROMOTE_PARTIALS; default on; bench/LOG.md "
                             "section 54)")
    parser.add_argument("--gpu-clocks", action="store_true",
                        help="sample the GPU's clocks, power and clock-event (throttle) reasons with nvidia-smi every "
                             "100 ms through each section (scripts/benchmarks/gpu_clocks.py)")
    parser.add_argument("--quick", action="store_true", help="small counts for a smoke run")
    parser.add_argument("--log-dir", help="also write the progress log and client/server warnings here")
    args = parser.parse_args(argv)
    for option, folder in (("--stacks", args.stacks), ("--log-dir", args.log_dir)):
        try:  # made and tried now: a file there, or a folder that takes none, failed later with a traceback
            if folder is not None:
                cli.writable_folder(folder)
        except OSError as exc:
            parser.error(f"{option} {folder}: cannot write in it: {exc.strerror or exc}")
    if args.cluster is None and (args.ray_address or args.shards):
        parser.error("--ray-address and --shards apply with --cluster ray")
    sharding = [f"--{name.replace('_', '-')}" for name in ("cluster", "on_shard_loss", "shard_timeout_s")
                if getattr(args, name) is not None]
    if sharding and "shards" not in args.sections:  # else accepted, and no section of the run used them
        parser.error(f"{', '.join(sharding)}: for the shards section, which --sections leaves out")
    if args.cluster == "ray":  # said now, not as a traceback in the shards section's log, the run exiting 0
        from client.engine.shard_ray import import_ray
        try:
            import_ray()
        except ImportError as exc:
            parser.error(str(exc))
    if args.tls != "off" and not all(os.path.isfile(path) for path in (TLS_CERT, TLS_KEY)):
        # an installed package holds no tests/: said now, not after the e2e targets, by a server that never started
        parser.error(f"--tls {args.tls} serves with the TLS tests' certificate, not here "
                     f"({os.path.normpath(TLS_CERT)}): run the bench from a checkout")
    late_after_ms = args.late_after_ms or [LATE_AFTER_S * 1000.0]
    if args.punctual_late_after_ms and max(args.punctual_late_after_ms) > min(late_after_ms):
        parser.error(f"--punctual-late-after-ms must not exceed --late-after-ms ({min(late_after_ms):g})")
    if args.accuracy_backlog_only and args.max_requests_per_symbol == 1:  # else the accuracy section ran nothing
        parser.error("--accuracy-backlog-only: the suite's run with a backlog of K = --max-requests-per-symbol "
                     "requests needs K above 1")
    counts = QUICK if args.quick else FULL
    overrides = {"family_symbols": args.family_symbols, "family_steps": args.family_steps,
                 "family_seeds": args.family_seeds,
                 "long_steps": args.long_steps, "e2e_requests": args.e2e_requests, "e2e_runs": args.e2e_runs,
                 "rates": args.rates, "k1_rates": args.k1_rates,
                 "rate_seconds": args.rate_seconds, "swap_cold_rate": args.swap_cold_rate}
    args.counts = Counts(**{**counts.__dict__, **{k: v for k, v in overrides.items() if v is not None}})
    served = {"e2e", "floor"} & set(args.sections)
    turns = runs_in_turn(args, alternating="e2e" in served)
    if served and args.e2e_runs is None and turns > counts.e2e_runs:
        # fewer runs left options given in turn without a run, unsaid (--quick's one: no alternation at all)
        args.counts.e2e_runs = turns
        print(f"{PROG}: {turns} e2e and floor runs, not the {'--quick ' if args.quick else ''}default "
              f"{counts.e2e_runs}, so that {', '.join(taken_in_turn(args, 'e2e' in served))} take every turn "
              f"(--e2e-runs N to choose)", file=sys.stderr)
    if args.counts.family_symbols * len(FAMILIES) > MAX_BATCH:
        parser.error(f"--family-symbols must be at most {MAX_BATCH // len(FAMILIES)}: all families step together "
                     f"in batches of at most {MAX_BATCH}")
    try:
        args.device = torch.device(args.device)
    except RuntimeError:  # torch's message lists device types (ipu, mps, ...) that bench refuses below
        parser.error(f"--device {args.device}: not a torch device; use cuda, cuda:N or cpu")
    if args.device.type not in ("cuda", "cpu"):
        parser.error(f"--device must be cuda or cpu, got {args.device}")
    if args.gpu_clocks and (args.device.type != "cuda" or shutil.which("nvidia-smi") is None):
        parser.error("--gpu-clocks samples a CUDA GPU with nvidia-smi: it needs --device cuda and nvidia-smi on PATH")
    if args.device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but CUDA is not available; use --device cpu (with --quick) for a smoke run")
    args.preset = cli.preset_for(args.preset, args.device)
    return args


def run_sections(bench) -> list[str]:
    """Every chosen section; a failing one is logged and recorded, and the others still run."""
    failed = []
    for section in bench.args.sections:
        bench.progress(f"section {section} ...")
        begin = time.monotonic()
        clocks = GpuClocks(bench.device.index or 0) if bench.args.gpu_clocks else None
        try:
            with clocks or contextlib.nullcontext():
                SECTIONS[section].run(bench)
            if section in bench.report.data.get("errors", {}):  # an earlier run's failure, kept by --merge
                bench.report.update(errors={name: error for name, error in bench.report.data["errors"].items()
                                            if name != section})
        except Exception as exc:
            failed.append(section)
            bench.progress(f"section {section} FAILED: {exc}\n{traceback.format_exc()}")
            bench.report.update(errors={**bench.report.data.get("errors", {}), section: repr(exc)})
        elapsed = time.monotonic() - begin
        bench.report.update(section_s={**bench.report.data.get("section_s", {}), section: elapsed})
        bench.progress(f"section {section} done in {elapsed:.1f} s")
        if clocks is not None:
            sampled = clocks.summary()
            bench.report.update(gpu_clocks={**bench.report.data.get("gpu_clocks", {}), section: sampled})
            bench.progress(f"gpu clocks during {section}: {describe_clocks(sampled)}")
        if bench.device.type == "cuda":
            torch.cuda.empty_cache()
    return failed


def summary_table(data) -> str:
    lines = [f"device: {data.get('device')}   preset: {data.get('preset')}"]
    if (data.get("gpu_at_start") or {}).get("shared"):
        lines.append(f"GPU NOT THE RUN'S ALONE: {data['gpu_at_start']['why']}")
    for section in SECTIONS.values():
        lines.extend(section.summary(data))
    if "section_s" in data:
        lines.append("seconds per section: " + ", ".join(f"{name} {seconds:.1f}"
                                                         for name, seconds in data["section_s"].items()))
    if data.get("errors"):
        lines.append(f"FAILED sections: {', '.join(data['errors'])}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    log_path = None
    if args.log_dir is not None:
        os.makedirs(args.log_dir, exist_ok=True)
        log_path = os.path.join(args.log_dir, f"bench-{time.strftime('%Y%m%d-%H%M%S')}.log")
        logging.basicConfig(filename=log_path, level=logging.INFO,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    else:
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.device.type == "cuda":
        torch.cuda.set_device(args.device.index or 0)  # events and synchronize() then refer to the chosen GPU
    progress = Progress(log_path)
    report = Report(args.json)
    if args.merge:
        report.load()
    report.update(device=device_name(args.device), preset=args.preset, seed=args.seed, quick=args.quick,
                  awake_cpus=args.awake_cpus,
                  sections=args.sections, counts=args.counts.__dict__, torch=torch.__version__,
                  pipeline_min_batch=args.pipeline_min_batch or PIPELINE_MIN_BATCH,
                  max_requests_per_symbol=args.max_requests_per_symbol,
                  promote_partials=args.promote_partials == "on")
    progress(f"bench on {report.data['device']}: preset {args.preset}, sections {','.join(args.sections)}")
    if args.device.type == "cuda":
        shared = gpu_sharing.snapshot(args.device.index or 0)
        report.update(gpu_at_start=shared)
        if shared["shared"]:
            progress(f"WARNING: this GPU is not the run's alone ({shared['why']}): fewer state slots and slower "
                     f"steps than on a GPU of its own")
    with (promoted_partials(args.promote_partials == "on"),
          AwakeCpus() if args.awake_cpus == "on" else contextlib.nullcontext()):
        failed = run_sections(Bench(args, report, progress))
    report.update(total_s=time.monotonic() - progress.start)
    print(summary_table(report.data))
    return 1 if failed else 0


def run() -> int:
    """The console script's entry point (pyproject.toml): main with one-line errors and exit codes."""
    return cli.run_cli(main, PROG)


if __name__ == "__main__":
    sys.exit(run())
