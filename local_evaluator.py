#!/usr/bin/env python
"""Offline evaluator: replay a request stream through the team client's process_batch, no sockets.

Measures per-request latency and each tower's error against the fp32 reference, optionally under
torch.profiler, and can plot both. The scheduling mirrors the live runtime: a FIFO queue per symbol,
micro-batches of each symbol's oldest requests among those that have arrived, up to max_requests_per_symbol of a
symbol (one for a team client that takes one request a symbol), so every symbol's requests reach the model strictly
in stream order.

Importable: `evaluate(client, stream, targets, ...) -> dict` is the core; `load_or_generate_stream(...)`
and `setup(stream, preset, ...)` build its inputs; `main(argv)` is the command line.
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from client import cli
from client.accuracy import percent_down, tower_errors
from client.answers import check_answer
from client.constants import ATOL, DEFAULT_REQUESTS_PER_SYMBOL, TARGET_SOURCES
from client.engine.base import Engine
from client.engine.options import add_engine_arguments, engine_options
from client.model.config import PRESETS, TOWER_NAMES
from client import team_api
from client.scheduler import Request, Scheduler

REPO_ROOT = Path(__file__).resolve().parent

PROG = cli.prog_name("local_evaluator.py")
DEFAULT_TEAM_DIR = REPO_ROOT / "team"
ERROR_FLOOR = 1e-12
# Steps the profiler records: a bounded window after the first (cold) step, so that the trace stays small
# (the whole replay of 2,000 requests made 757 MB in 180 s).
DEFAULT_PROFILE_STEPS = 5
GENERATION = ("symbols", "requests", "stream_seed", "rate")  # load_or_generate_stream's options of a generated stream


class EvaluationError(cli.CliError):
    """Bad input or a client that breaks the process_batch contract; the message says which."""


# ----------------------------------------------------------------------------------------- inputs

def load_team_class(team_dir: str | Path = DEFAULT_TEAM_DIR):
    """ExampleModel from `<team_dir>/example_model.py`, imported by path so a candidate folder can be
    checked without replacing team/."""
    path = Path(team_dir) / "example_model.py"
    if not path.is_file():
        raise EvaluationError(f"no team client at {path}")
    # Its folder on the import path, as running the file would put it: a team file that imports a module of its
    # own beside it (from helpers import ...) failed with ModuleNotFoundError. Last, so that a folder holding the
    # event's own server.py or client.py does not shadow the project's; kept, for imports made later.
    folder = str(path.parent.resolve())
    if folder not in sys.path:
        sys.path.append(folder)
    spec = importlib.util.spec_from_file_location(f"_evaluated_team_{abs(hash(str(path)))}", path)
    module = importlib.util.module_from_spec(spec)
    # in sys.modules, as an import puts it: dataclasses (string annotations) and pickle look its module up there
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[spec.name]
        raise EvaluationError(f"importing {path} failed: {type(exc).__name__}: {exc}") from exc
    cls = getattr(module, "ExampleModel", None)
    if cls is None or not callable(getattr(cls, "process_batch", None)):
        raise EvaluationError(f"{path} has no class ExampleModel with a process_batch method")
    return cls


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def setup(stream, preset: str, engine: str = "reference", weights: str | None = None, seed: int = 0,
          device: str | None = None, team_dir: str | Path = DEFAULT_TEAM_DIR, cache_dir=None, progress=False,
          engine_options=None, asked_per_symbol: int | None = None):
    """(team client, reference targets [M, 4], weights fingerprint) for `stream`; progress: say on stderr what is
    prepared, with a bar while the targets are computed on a terminal (none when they are cached). asked_per_symbol:
    the --max-requests-per-symbol given, refused above 1 for a team class that takes one request of a symbol a step
    (its steps would carry one, unsaid).

    The team module is imported first, so a broken candidate fails before any model is built, and
    the targets are computed before the engine exists, since an engine may convert the model.
    """
    team_class = load_team_class(team_dir)
    from client.original_team import takes_several_requests

    if (asked_per_symbol or 1) > 1 and not takes_several_requests(team_class):
        raise EvaluationError(f"--max-requests-per-symbol {asked_per_symbol}: {Path(team_dir) / 'example_model.py'}'s "
                              f"ExampleModel takes one request of a symbol a step (its requests_per_symbol, "
                              f"client/team_api.py); leave the option out")
    from client.engine import make_engine
    from client.model import load_model
    from client.targets import compute_targets

    # With --cluster ray, `device` is the shards' (on the cluster); the targets are computed on this machine.
    on_cluster = (engine_options or {}).get("cluster") is not None
    local_device = default_device() if on_cluster else (device or default_device())
    if progress:
        print(f"{PROG}: {len(stream):,} requests; preset {preset}, engine {engine}; the reference targets come "
              f"from the cache or are computed first", file=sys.stderr, flush=True)
    model, weights_fingerprint = load_model(preset, weights=weights, seed=seed, device=local_device)
    # the targets' own bar rewrites one line: on a terminal only
    targets = compute_targets(model, stream, weights_fingerprint, device=local_device, cache_dir=cache_dir,
                              progress=progress and sys.stderr.isatty())
    from client.engine.sharded import ModelSpec

    # handed over (the engine's loader returns it, and nothing here keeps it): the fast engine drops it once its
    # weights are converted, so that its state table is sized without the fp32 model in memory
    handed = [model]
    del model
    built = make_engine(engine, handed.pop, device=device if on_cluster else local_device,
                        spec=ModelSpec(preset, weights, seed), **(engine_options or {}))
    shards_fingerprint = getattr(built, "fingerprint", weights_fingerprint)
    if shards_fingerprint != weights_fingerprint:  # e.g. another checkpoint at the same path on a worker host
        built.close()
        raise EvaluationError(f"the shards loaded weights {shards_fingerprint}, this machine {weights_fingerprint}: "
                              f"the targets would not be theirs")
    from client.original_team import as_runtime_client

    try:
        team = team_class(built)
    except Exception as exc:  # the candidate's code, like its import (load_team_class): not this program's bug
        built.close()
        raise EvaluationError(f"{Path(team_dir) / 'example_model.py'}: ExampleModel(engine) failed: "
                              f"{type(exc).__name__}: {exc}") from exc
    return as_runtime_client(team), targets, weights_fingerprint


def load_or_generate_stream(path: str | None = None, symbols: int = 6, requests: int = 300,
                            stream_seed: int = 0, rate: float | None = None):
    """A stream from `path` (.npz or the original parquet) or generated from the options.
    Streams validate themselves (shapes, finite features and delays) when built."""
    from client import streams

    try:
        if path is None:
            return streams.generate_stream(symbols, requests, stream_seed, rate=rate)
        return streams.load_stream(path)
    except (OSError, ValueError, ImportError) as exc:  # ImportError: parquet without pyarrow
        raise EvaluationError(str(exc)) from exc


# ------------------------------------------------------------------------------------ scheduling

def replay(client, symbols, features, delay_ms, batch_size: int | None = None, after_step=None,
           max_requests_per_symbol: int = DEFAULT_REQUESTS_PER_SYMBOL):
    """Feed the stream to `client.process_batch` and return (predictions [M,4], arrival_s [M],
    answer_s [M], batch sizes) on a simulated clock; after_step(requests answered so far), if given,
    is called after each step (progress, the profiler's window).

    The clock never sleeps: it advances by the measured wall time of each process_batch call and
    jumps to the next arrival when nothing is pending. Without batch_size, request i arrives at
    sum(delay_ms[:i+1]). With batch_size N, the stream is cut into groups of N consecutive requests,
    as the original evaluator did; a group arrives all at once when the previous group is answered,
    and delay_ms is ignored. A step carries up to max_requests_per_symbol queued requests of a symbol when the
    team client takes lists (client/team_api.py), else one. Which requests share a step can depend on measured
    times (only in the delay mode); what each symbol sees, and in which order, never does.
    """
    m = len(symbols)
    if batch_size is not None and batch_size < 1:
        raise EvaluationError(f"--batch-size must be at least 1, got {batch_size}")
    arrival = np.full(m, np.nan)
    if batch_size is None:
        arrival[:] = np.cumsum(np.asarray(delay_ms, dtype=np.float64)) / 1000.0
    answer = np.full(m, np.nan)
    predictions = np.full((m, len(TOWER_NAMES)), np.nan, dtype=np.float32)
    queues = Scheduler()
    per_symbol = team_api.max_per_symbol(client, max_requests_per_symbol)
    batch_sizes = []
    clock = 0.0 if batch_size is not None else float(arrival[0])
    admitted = 0
    while admitted < m or len(queues):
        if batch_size is None:
            while admitted < m and arrival[admitted] <= clock:
                queues.push(Request(admitted, symbols[admitted], features[admitted]))
                admitted += 1
            if not len(queues):
                clock = float(arrival[admitted])
                continue
        elif not len(queues):
            group_end = min(admitted + batch_size, m)
            arrival[admitted:group_end] = clock
            for index in range(admitted, group_end):
                queues.push(Request(index, symbols[index], features[index]))
            admitted = group_end
        requests = queues.next_batch(max_per_symbol=per_symbol)
        batch = [request.unique_id for request in requests]
        started = time.perf_counter()
        response = client.process_batch(team_api.batch_for(client, requests))
        clock += time.perf_counter() - started
        predictions[batch] = _answered(response, batch)
        answer[batch] = clock
        batch_sizes.append(len(batch))
        if after_step is not None:
            after_step(admitted - len(queues))
    return predictions, arrival, answer, batch_sizes


def _answered(response, batch: list[int]) -> np.ndarray:
    """The response's predictions in the order of `batch`: a replay scores every request, so none may be left
    unanswered."""
    try:
        answer = check_answer(response, batch)
    except ValueError as exc:
        raise EvaluationError(str(exc)) from None
    if answer.errors:
        uid, why = next(iter(answer.errors.items()))
        raise EvaluationError(f"the team client left {len(answer.errors)} request(s) unanswered; request {uid}: "
                              f"{why}")
    return answer.in_order(batch)


# ----------------------------------------------------------------------------------------- metrics

def latency_summary(latency_ms: np.ndarray) -> dict:
    return {
        "p50": float(np.percentile(latency_ms, 50)),
        "p90": float(np.percentile(latency_ms, 90)),
        "p99": float(np.percentile(latency_ms, 99)),
        "mean": float(np.mean(latency_ms)),
    }


# -------------------------------------------------------------------------------------- evaluation

def check_room(stream, engine) -> None:
    """EvaluationError when `engine`, which forgets no symbol, has no room for every symbol of the stream: else the
    replay failed only where the first symbol past its room came, minutes into a long stream."""
    if not isinstance(engine, Engine):
        return
    symbols = np.unique(stream.symbols).tolist()
    rejected = engine.unplaceable(symbols)
    if rejected:
        raise EvaluationError(f"the stream has {len(symbols):,} symbols and the engine forgets none (no "
                              f"--idle-timeout): {next(iter(rejected.values()))}")


def evaluate(client, stream, targets, *, batch_size: int | None = None, atol: float = ATOL,
             max_requests_per_symbol: int = DEFAULT_REQUESTS_PER_SYMBOL,
             profile_dir: str | Path | None = None, profile_steps: int = DEFAULT_PROFILE_STEPS,
             top_kernels: int = 15, progress: bool = False) -> dict:
    """Replay `stream` through `client.process_batch` and score it against `targets` [M, 4].

    Returns requests, responses, steps, mean_batch, latency_ms {p50, p90, p99, mean},
    throughput_rps (responses over the simulated time from first arrival to last answer) and
    towers {name: tower_errors}. The arrays behind them are under the private key "_series".
    With profile_dir, torch.profiler records profile_steps steps after the first; with progress, the
    replay's progress goes to stderr (client/cli.py's Progress).
    """
    targets = np.asarray(targets, dtype=np.float32)
    m = len(stream.symbols)
    if targets.shape != (m, len(TOWER_NAMES)):
        raise EvaluationError(f"targets have shape {targets.shape}, expected ({m}, {len(TOWER_NAMES)})")
    symbols = [str(s) for s in stream.symbols]
    features = np.ascontiguousarray(stream.features, dtype=np.float32)

    bar = cli.Progress(m, "replay", unit=" requests") if progress else None
    with _profiling(profile_dir, profile_steps, top_kernels) as profiler_step:
        def after_step(answered):
            if profiler_step is not None:
                profiler_step()
            if bar is not None:
                bar.update(answered)
        predictions, arrival, answer, batch_sizes = replay(client, symbols, features, stream.delay_ms, batch_size,
                                                           after_step, max_requests_per_symbol)
    if bar is not None:
        bar.close()
    latency_ms = (answer - arrival) * 1000.0
    span = float(answer.max() - arrival.min())
    return {
        "requests": m,
        "responses": int(np.isfinite(answer).sum()),
        "steps": len(batch_sizes),
        "mean_batch": float(np.mean(batch_sizes)),
        "batch_size": batch_size,
        "atol": atol,
        "latency_ms": latency_summary(latency_ms),
        "throughput_rps": m / span if span > 0 else None,
        "towers": tower_errors(predictions, targets, atol),
        "_series": {"latency_ms": latency_ms, "predictions": predictions, "targets": targets},
    }


@contextlib.contextmanager
def _profiling(profile_dir, steps: int, top_kernels: int):
    """torch.profiler over `steps` steps of the replay after the first (cold) one: yields the function to
    call after each step (None without profile_dir), then writes a Chrome trace into profile_dir and
    prints its size and the top kernels, by device time when the GPU was used, else by CPU time."""
    if profile_dir is None:
        yield None
        return
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    on_cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    out = Path(profile_dir)
    out.mkdir(parents=True, exist_ok=True)
    print(f"profile: recording steps 2 to {steps + 1} of the replay (--profile-steps {steps})", file=sys.stderr)
    taken = 0

    def step_done():
        nonlocal taken
        taken += 1
        prof.step()
    with profile(activities=activities, schedule=schedule(wait=0, warmup=1, active=steps, repeat=1)) as prof:
        yield step_done
        if on_cuda:
            torch.cuda.synchronize()
    if taken <= steps:  # the replay ended inside the window: say so, or a short replay's trace looks like a fault
        held = f"only steps 2 to {taken}" if taken > 1 else "none of its steps (the first, cold one is left out)"
        print(f"profile: the replay took {taken} step(s), so the trace holds {held}", file=sys.stderr)
    trace = out / "trace.json"
    print(f"profile: writing {trace} ...", file=sys.stderr, flush=True)
    prof.export_chrome_trace(str(trace))
    averages = prof.key_averages()
    # by device time when the run put work on the GPU (CUDA may be present but unused)
    used_gpu = on_cuda and sum(getattr(e, "self_device_time_total", 0) for e in averages) > 0
    sort_by = "self_device_time_total" if used_gpu else "self_cpu_time_total"
    print(f"profile: trace written to {trace} ({cli.format_bytes(trace.stat().st_size)}); "
          f"top {top_kernels} by {sort_by}:")
    print(averages.table(sort_by=sort_by, row_limit=top_kernels))


# ------------------------------------------------------------------------------------------ output

def format_report(result: dict) -> str:
    lat = result["latency_ms"]
    rps = result["throughput_rps"]
    lines = [
        f"requests {result['requests']}  responses {result['responses']}  steps {result['steps']}  "
        f"mean batch {result['mean_batch']:.2f}",
        f"latency ms  p50 {lat['p50']:.3f}  p90 {lat['p90']:.3f}  p99 {lat['p99']:.3f}  "
        f"mean {lat['mean']:.3f}   throughput {'n/a' if rps is None else f'{rps:.1f}'} req/s",
        f"{'tower':<8}{'max_abs_err':>13}{'mean_abs_err':>14}{'rmse':>12}{'rel_rmse':>10}"
        f"{'within ' + format(result['atol'], 'g'):>14}{'nan/inf':>9}",
    ]
    for name, t in result["towers"].items():
        rel = "n/a" if t["rel_rmse"] is None else f"{t['rel_rmse']:.2e}"
        # the share rounded down, as the accuracy suite's table: rounded to nearest, 2 misses in 100,000 read 1.0000
        lines.append(f"{name:<8}{t['max_abs_err']:>13.3e}{t['mean_abs_err']:>14.3e}{t['rmse']:>12.3e}"
                     f"{rel:>10}{percent_down(t['within_atol']) / 100:>14.4f}{t['nan_or_inf']:>9}")
    return "\n".join(lines)


def require_matplotlib():
    try:
        import matplotlib
    except ImportError:
        raise EvaluationError("--plot needs matplotlib, which is not installed: "
                              "pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def check_plot_path(path) -> None:
    """EvaluationError unless matplotlib writes the format `path` names by its extension: an unknown one failed only
    after the run, and with none the plot went to path.png while the report named path."""
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    if Path(path).suffix.lower()[1:] not in formats:
        raise EvaluationError(f"--plot {path}: name the file .png (or {', '.join(f'.{f}' for f in sorted(formats))})")


def figure(result: dict, title: str):
    """Latency histogram with its p50 and p99, and each tower's absolute error along the stream."""
    plt = require_matplotlib()
    series = result["_series"]
    # exact zeros are floored so that they stay on the log axis
    errors = np.maximum(np.abs(series["predictions"].astype(np.float64) - series["targets"]), ERROR_FLOOR)
    fig, (ax_lat, ax_err) = plt.subplots(2, 1, figsize=(10, 8))
    fig.suptitle(title)
    ax_lat.hist(series["latency_ms"], bins=50)
    for name, style in (("p50", "--"), ("p99", ":")):
        value = result["latency_ms"][name]
        ax_lat.axvline(value, color="k", linestyle=style, linewidth=1.0, label=f"{name} {value:.2f} ms")
    ax_lat.set(xlabel="latency (ms)", ylabel="requests", title="latency distribution")
    ax_lat.legend()
    for column, name in enumerate(TOWER_NAMES):
        ax_err.plot(errors[:, column], label=name, linewidth=0.8)
    ax_err.axhline(result["atol"], color="k", linestyle="--", linewidth=0.8, label="atol")
    ax_err.set(xlabel="request (stream order)", ylabel=f"|prediction - reference| (floor {ERROR_FLOOR:g})",
               yscale="log", title="error along the stream")
    ax_err.legend()
    fig.tight_layout()
    return fig


def plot(result: dict, path: str | Path, title: str) -> None:
    """figure() in one PNG."""
    fig = figure(result, title)
    fig.savefig(path)
    require_matplotlib().close(fig)


def plot_title(result: dict, preset: str, engine: str, device: str) -> str:
    return (f"preset {preset}, engine {engine} on {device}: {result['requests']:,} requests, "
            f"p50 {result['latency_ms']['p50']:.2f} ms, p99 {result['latency_ms']['p99']:.2f} ms")


def public_result(result: dict, **meta) -> dict:
    """The JSON-ready summary: `result` without its series, plus `meta` (preset, engine, ...)."""
    return {**meta, **{k: v for k, v in result.items() if not k.startswith("_")}}


# -------------------------------------------------------------------------------------------- main

def parse_args(argv=None):
    from client.engine import ENGINES

    p = cli.ArgumentParser(
        prog=PROG,
        description=__doc__.split("\n\n")[0],
        epilog="Clock: simulated and deterministic in what each symbol sees. Nothing sleeps; the "
               "clock advances by the measured time of each process_batch call and jumps to the next "
               "arrival when idle. Without --batch-size, request i arrives at the sum of delay_ms up "
               "to i; with --batch-size N, groups of N consecutive requests arrive together once the "
               "previous group is answered (delay_ms ignored). Latency = answer - arrival on this "
               "clock; throughput = responses / (last answer - first arrival).")
    src = p.add_argument_group("stream (generated unless --stream)")
    src.add_argument("--stream", type=cli.existing_file, help="replay this .npz or original .parquet stream")
    src.add_argument("--symbols", type=cli.positive_int, help="default 6")
    src.add_argument("--requests", type=cli.positive_int, help="default 300")
    src.add_argument("--stream-seed", type=cli.seed, help="default 0")
    src.add_argument("--rate", type=cli.request_rate, help="mean arrival rate, requests/s (default: the generator's)")
    mdl = p.add_argument_group("model and client")
    mdl.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="model preset (default tiny)")
    weights = mdl.add_mutually_exclusive_group()
    weights.add_argument("--weights", type=cli.existing_file, help="checkpoint to load instead of seeded weights")
    weights.add_argument("--seed", type=cli.seed, default=0, help="weights seed")
    mdl.add_argument("--device", default=None, help="torch device (default cuda when present, else cpu)")
    mdl.add_argument("--engine", default="reference", choices=ENGINES, help="engine (default reference)")
    mdl.add_argument("--team-dir", default=str(DEFAULT_TEAM_DIR),
                     help="folder holding the example_model.py to evaluate (default team/)")
    add_engine_arguments(p)
    ev = p.add_argument_group("evaluation")
    ev.add_argument("--batch-size", type=cli.positive_int, default=None,
                    help="arrival groups of N requests, as the original evaluator")
    ev.add_argument("--atol", type=float, default=ATOL,
                    help="tolerance for within_atol (default 1e-3)")
    ev.add_argument("--cache-dir", default=None, help="reference target cache (default: $FASTENS_CACHE/targets or "
                                                      "~/.cache/fastens/targets)")
    ev.add_argument("--targets", choices=TARGET_SOURCES, default="model",
                    help="score against the chosen weights' fp32 model (default) or the stream file's own targets; "
                         "a file with targets is compared with the model either way")
    out = p.add_argument_group("output")
    out.add_argument("--json", type=cli.output_file, help="write the summary here")
    out.add_argument("--profile", metavar="DIR", help="torch.profiler trace of a few steps into DIR; print top kernels")
    out.add_argument("--profile-steps", type=cli.positive_int,
                     help=f"steps the profile records, after the first (default {DEFAULT_PROFILE_STEPS})")
    out.add_argument("--plot", metavar="PNG", type=cli.output_file,
                     help="latency distribution and per-tower error (matplotlib)")
    args = p.parse_args(argv)
    generating = [f"--{name.replace('_', '-')}" for name in GENERATION if getattr(args, name) is not None]
    if args.stream is not None and generating:  # else silently ignored: the file's requests replayed as they are
        p.error(f"{', '.join(generating)}: for a generated stream; --stream replays the file's own requests")
    if args.rate is not None and args.batch_size is not None:  # the gaps it sets are ignored: it did nothing
        p.error("--rate: sets the gaps between requests, which --batch-size ignores (groups arrive as answered)")
    if args.stream is not None:  # the summary or the plot written over the stream it replays
        for name in ("json", "plot"):
            if getattr(args, name) and os.path.realpath(getattr(args, name)) == os.path.realpath(args.stream):
                p.error(f"--{name} {getattr(args, name)} is the --stream file itself; give another path")
    if not args.atol > 0:
        p.error(f"--atol must be positive, got {args.atol}")
    if args.profile_steps is not None and args.profile is None:  # else accepted, and nothing recorded
        p.error("--profile-steps: for --profile DIR, which records the trace")
    if args.profile_steps is None:
        args.profile_steps = DEFAULT_PROFILE_STEPS
    if args.profile is not None and Path(args.profile).exists() and not Path(args.profile).is_dir():
        p.error(f"--profile {args.profile} is a file; give a folder for the trace")  # else found after the setup
    if args.profile is not None:
        try:  # made now, not as the profile starts, once the model, the targets and the engine are up
            cli.writable_folder(args.profile)
        except OSError as exc:
            p.error(f"--profile {args.profile}: cannot write in it: {exc.strerror}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    asked_per_symbol = args.max_requests_per_symbol  # None where not given: the measured default
    args.max_requests_per_symbol = asked_per_symbol or DEFAULT_REQUESTS_PER_SYMBOL
    if args.cluster is None:  # else --device is the shards', on the cluster
        cli.check_device(args.device)
    from client.engine import check_options
    from client.engine.sharded import ModelSpec

    # an option the engine cannot honour, said before the model loads and the targets are computed, not after them
    check_options(args.engine, args.device if args.cluster else args.device or default_device(),
                  spec=ModelSpec(args.preset, args.weights, args.seed),
                  **{k: v for k, v in engine_options(args).items() if k != "max_rows_per_symbol"})
    if args.plot:  # fail before the run, not after it
        require_matplotlib()
        check_plot_path(args.plot)
    stream = load_or_generate_stream(args.stream, **{name: getattr(args, name) for name in GENERATION
                                                     if getattr(args, name) is not None})
    from client.targets import check_targets_source, choose_targets, describe_targets

    check_targets_source(stream, args.targets)
    client, targets, weights_fingerprint = setup(stream, args.preset, args.engine, args.weights, args.seed,
                                                 args.device, args.team_dir, args.cache_dir, progress=True,
                                                 engine_options=engine_options(args),
                                                 asked_per_symbol=asked_per_symbol)
    targets, comparison = choose_targets(stream, targets, args.targets, args.atol)
    if comparison is not None:
        model = f"preset {args.preset}, " + (f"weights {args.weights}" if args.weights else f"seed {args.seed}")
        print(f"{PROG}: {describe_targets(comparison, args.targets, model)}", file=sys.stderr, flush=True)
    engine = getattr(client, "engine", None)
    try:
        if args.idle_timeout is None:
            check_room(stream, engine)
        result = evaluate(client, stream, targets, batch_size=args.batch_size, atol=args.atol,
                          max_requests_per_symbol=args.max_requests_per_symbol,
                          profile_dir=args.profile, profile_steps=args.profile_steps, progress=True)
    finally:
        if engine is not None:
            engine.close()
    print(format_report(result))
    from client.streams import stream_fingerprint
    from scripts.benchmarks.report import finite_or_none

    device = args.device or default_device()
    sharded = {}
    described = engine.describe() if isinstance(engine, Engine) else {}
    if "shards" in described:  # a sharded engine: where its shards ran, and what it lost (with what it did)
        device = "; ".join(shard["where"] for shard in described["shards"])
        sharded = {"shards": len(described["shards"]), "on_shard_loss": described["on_shard_loss"],
                   "shard_losses": described["losses"]}
        for loss in described["losses"]:
            print(f"shard lost: {loss['line']}")
    summary = public_result(result, preset=args.preset, engine=args.engine, device=device,
                            weights_fingerprint=weights_fingerprint, stream=args.stream or stream.meta,
                            stream_fingerprint=stream_fingerprint(stream),
                            targets={"source": args.targets, "file_vs_model": comparison}, **sharded)
    if args.json:  # a tower with no finite prediction has NaN statistics, which plain JSON cannot hold: null
        Path(args.json).write_text(json.dumps(finite_or_none(summary), indent=2, allow_nan=False) + "\n")
    if args.plot:
        plot(result, args.plot, plot_title(result, args.preset, args.engine, device))
        print(f"plot written to {args.plot}")
    return cli.EXIT_OK


def run() -> int:
    """The console script's entry point (pyproject.toml): main with one-line errors and exit codes."""
    return cli.run_cli(main, PROG)


if __name__ == "__main__":
    sys.exit(run())
