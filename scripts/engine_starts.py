"""Start the fast engine again and again, each time in a fresh process: the first start may compile every kernel
(a cold Triton cache), the others load them from the cache. Reports each start's seconds, whether it succeeded,
and the engine's own warnings. Precompile (client/engine/fast/runner.py) compiles the step shapes side by side
(launching nothing), then runs every shape's step once more, one shape at a time, which makes the kernels' first
launches; a start counts as recovered where it succeeded only by one of its fallbacks, which say so on stderr: shapes
that failed to compile side by side, compiled by those one-at-a-time runs instead, or a shape whose run failed, run
again after Triton's compiled kernels were dropped (forget_compiled). The exit code is 1 if any start failed or
recovered.
Graphs are not captured: a start here is the imports, the model's weights made on the device, the state table and
the kernels. `--host-symbols` sizes the host tier, which pins in the background while the kernels compile (the
engine's default tier where not given; 0: none); `--parallel` runs that many starts at once, each in its own
process, for more starts a minute.

    python -m scripts.engine_starts --starts 8 --json starts.json
"""
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from client import cli

PROG = "scripts/engine_starts.py"
# precompile's notes of its fallbacks: shapes that failed to compile side by side (their one-at-a-time launches
# compiled them), a shape whose launch failed and was run again after forget_compiled
RECOVERED = ("failed to compile side by side", "first launches of step shape")
START = """
import sys, time
began = time.perf_counter()
from client.engine.fast import FastEngine
from client.model import load_model
model, _ = load_model({preset!r}, seed=0, device={device!r})
FastEngine(model, device={device!r}, graphs=False, capacity=64, host_symbols={host_symbols!r}, progress=False)
print(f"started in {{time.perf_counter() - began:.1f}} s")
"""


def start_once(preset, device, host_symbols, timeout_s):
    """(seconds, exit code, the engine's warnings and the last error line) of one start in a fresh process."""
    began = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-c", START.format(preset=preset, device=device,
                                                                  host_symbols=host_symbols)],
                              capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return time.perf_counter() - began, None, [f"no start within {timeout_s} s"]
    lines = done.stderr.splitlines()
    notes = [line for line in lines if line.startswith("[fast engine]")]
    if done.returncode != 0 and lines:
        notes.append(lines[-1])
    return time.perf_counter() - began, done.returncode, notes


def main(argv=None):
    parser = cli.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--starts", type=int, default=8)
    parser.add_argument("--preset", default="full")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--host-symbols", type=int, default=None,
                        help="the host tier's symbols (default: the engine's default; 0: no host tier)")
    parser.add_argument("--parallel", type=int, default=1, help="starts at once, each its own process (default 1)")
    parser.add_argument("--timeout", type=cli.positive_float, default=300.0,
                        help="seconds a start may take (default 300)")
    parser.add_argument("--json", type=cli.output_file, help="write every start here")
    args = parser.parse_args(argv)
    if args.starts < 1 or args.parallel < 1:
        parser.error("--starts and --parallel must be at least 1")
    if args.host_symbols is not None and args.host_symbols < 0:
        parser.error(f"--host-symbols must be >= 0, got {args.host_symbols}")
    cli.check_device(args.device)  # not a start that fails alike again and again
    starts = []
    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        runs = pool.map(lambda _: start_once(args.preset, args.device, args.host_symbols, args.timeout),
                        range(args.starts))
        for index, (seconds, code, notes) in enumerate(runs):
            starts.append({"seconds": seconds, "exit_code": code, "notes": notes})
            print(f"start {index + 1}: {'ok' if code == 0 else 'FAILED'} in {seconds:.1f} s"
                  + "".join(f"\n  {note}" for note in notes), flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(starts, f, indent=1)
    failed = sum(start["exit_code"] != 0 for start in starts)
    recovered = sum(start["exit_code"] == 0 and any(mark in note for note in start["notes"] for mark in RECOVERED)
                    for start in starts)
    print(f"{len(starts)} starts, {failed} failed, {recovered} recovered (shapes compiled one at a time, or run "
          f"again from fresh kernel caches)")
    return 1 if failed or recovered else 0


if __name__ == "__main__":
    sys.exit(cli.run_cli(main, PROG))
