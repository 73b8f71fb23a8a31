"""Where the fast engine's step time goes, on a GPU: startup, step time per batch size, whether the four towers'
chains run side by side in the step's graph (each tower's state kernels, first and last, in profiled replays), the
eager step's top kernels, and a short accuracy check against the fp32 reference.

    python scripts/profile_step.py --preset full --batches 1,20,64 --out-dir prof/

It times CUDA graphs and kernels with CUDA events, so it needs a CUDA GPU: without one it says so in one line
(exit 2); `local_evaluator.py --profile DIR` profiles a replay on any device.
"""
import argparse
import json
import math
import sys
import time
from pathlib import Path


import numpy as np
import torch

from client import cli
from client.engine.cuda_streams import own_stream
from client.engine.fast import FastEngine
from client.engine.fast.layers import StepPlan
from client.engine.precision import Precision
from client.model import TOWER_NAMES, load_model

MAX_BATCH = 64  # the engines here are built with max_batch=64


def log(msg):
    sys.stderr.write(f"[{time.strftime('%H:%M:%S')}] {msg}\n")


def time_cuda(fn, iters=50, warmup=5):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return float(np.median(times)), float(np.percentile(times, 99))


def copy_bandwidth():
    src = torch.empty(2**28, dtype=torch.float32, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    med, _ = time_cuda(lambda: dst.copy_(src), iters=20)
    return 2 * src.numel() * 4 / (med * 1e-3)


def tower_graph_times(runner, slots):
    """Each tower alone captured as a CUDA graph: which one is the critical path."""
    out = {}
    for B in (1, 20):
        feats = torch.randn(B, 79, device="cuda")
        up = runner.tower_inputs(feats)
        for tower, chunk, states in zip(runner.towers, up, runner.tower_states):
            tower(chunk, states, StepPlan.one_row_each(slots[:B]))  # warm-up
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                tower(chunk, states, StepPlan.one_row_each(slots[:B]))
            out[f"B{B}_{tower.name}"] = round(time_cuda(graph.replay, iters=30)[0], 3)
    return out


# A kernel only one tower launches, once a block: where its first and last fall tells when the tower's chain ran
TOWER_KERNELS = {"xlstm": "_slstm_step_kernel", "mamba2": "_mamba2_state_update_kernel",
                 "retnet": "_retention_prepare_kernel", "hawk": "_rglru_step_kernel"}
# idle time that separates two profiled replays (the GPU idles REPLAY_SLEEP_S between them): under the profiler a
# replay itself has idle gaps of more than 200 us (an H200, session 19), which split replays into pieces
REPLAY_GAP_US = 10_000.0
REPLAY_SLEEP_S = 0.03


def tower_spans(kernels):
    """kernels: [(name, start_us, end_us)] of step replays profiled one after another with the GPU idle between
    them. Per replay: its span and each tower's (first start, last end) of its TOWER_KERNELS kernel, from the
    replay's first kernel (None where the tower has none); and `late`: the towers whose first such kernel started
    after another tower's last one ended, which ran behind that chain rather than beside it (bench/LOG.md
    section 60: RetNet and Hawk behind Mamba2)."""
    replays, current, end = [], [], -math.inf
    for name, start, stop in sorted(kernels, key=lambda k: k[1]):
        if current and start > end + REPLAY_GAP_US:
            replays.append(current)
            current = []
        current.append((name, start, stop))
        end = max(end, stop)
    if current:
        replays.append(current)
    out = []
    for replay in replays:
        t0 = replay[0][1]
        row = {"span_us": max(stop for _, _, stop in replay) - t0, "towers": {}}
        for tower, marker in TOWER_KERNELS.items():
            marks = [(start - t0, stop - t0) for name, start, stop in replay if marker in name]
            row["towers"][tower] = (min(m[0] for m in marks), max(m[1] for m in marks)) if marks else None
        ran = {t: span for t, span in row["towers"].items() if span is not None}
        row["late"] = sorted(t for t, (first, _) in ran.items() if any(last < first for _, last in ran.values()))
        out.append(row)
    return out


def tower_timeline(engine, slots, batches, replays=12):
    """Each step graph's towers side by side or not: tower_spans of `replays` replays of the step at each batch
    size, profiled with the GPU idle before each (the first two left out: the profiler's start)."""
    result = {}
    for B in batches:
        feats = torch.randn(B, 79, device="cuda")
        engine.step_slots(slots[:B], feats)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(replays + 2):
                torch.cuda.synchronize()
                time.sleep(REPLAY_SLEEP_S)
                engine.step_slots(slots[:B], feats)
            torch.cuda.synchronize()
        kernels = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA]
        rows = tower_spans(kernels)[2:]
        result[B] = {"span_us": float(np.median([r["span_us"] for r in rows])),
                     "towers": {t: None if rows[0]["towers"][t] is None else
                                tuple(float(np.median([r["towers"][t][i] for r in rows])) for i in (0, 1))
                                for t in TOWER_KERNELS},
                     "late": sorted({t for r in rows for t in r["late"]})}
    return result


def fp32_gemm_times():
    """[B, 2048] x [2048, 8192] in fp32 (RetNet's q/k/v/g), as F.linear on W [out, in] and as x @ W^T stored
    [in, out]."""
    out = {}
    w = torch.randn(8192, 2048, device="cuda")
    wt = w.t().contiguous()
    for B in (1, 20, 64):
        x = torch.randn(B, 2048, device="cuda")
        out[f"B{B}_linear"] = round(1e3 * time_cuda(lambda: torch.nn.functional.linear(x, w), iters=50)[0], 1)
        out[f"B{B}_mm_in_out"] = round(1e3 * time_cuda(lambda: x @ wt, iters=50)[0], 1)
        out[f"B{B}_fp16"] = round(1e3 * time_cuda(lambda: torch.nn.functional.linear(x.half(), w.half()),
                                                  iters=50)[0], 1)
    return out


def priority_times(engine, slots, batches, assignments, rounds=3):
    """Step medians (ms) per CUDA stream priority assignment {spec: {tower: priority}} (priorities_argument's): each
    assignment's graphs captured and timed in turn, `rounds` times; the engine's own streams restored after."""
    names = [tower.name for tower in engine.runner.towers]
    own = engine.runner.streams
    times = {spec: {B: [] for B in batches} for spec in assignments}
    for _ in range(rounds):
        for spec, priorities in assignments.items():
            engine.runner.streams = [own_stream(engine.device, priority=priorities.get(name, 0)) for name in names]
            engine.graphed.capture()
            for B in batches:
                feats = torch.randn(B, 79, device="cuda")
                times[spec][B].append(time_cuda(lambda: engine.step_slots(slots[:B], feats), iters=100)[0])
    engine.runner.streams = own
    engine.graphed.capture()
    return {spec: {B: float(np.median(v)) for B, v in by_batch.items()} for spec, by_batch in times.items()}


# name -> (a step's one row through kernels/gemv.py, launched with PDL, gemv's TILE_BYTES). Every other step kernel
# launched with PDL too was tried and left (bench/LOG.md section 66: commit d00c813)
LAUNCHES = {"cublas": (False, False, None), "gemv": (True, False, None), "gemv+pdl": (True, True, None),
            "gemv 32k": (True, False, 32 * 1024)}


def launch_times(engine, slots, batches, rounds=3, names=tuple(LAUNCHES)):
    """Step medians (ms) per LAUNCHES entry named: a step's one row through cuBLAS / skinny_matmul as before
    kernels/gemv.py ("cublas"), through gemv launched plainly, with programmatic dependent launch, with larger
    slices of W a program; each captured and timed in turn, `rounds` times, and each tower alone at B = 1. The
    engine's own setting restored after."""
    import importlib

    import kernels._pdl as pdl
    gemv_kernel = importlib.import_module("kernels.gemv")  # the module (the package's `gemv` is its function)
    times = {name: {B: [] for B in batches} for name in names}
    towers = {name: {} for name in names}
    before = pdl.PDL, gemv_kernel.TILE_BYTES
    try:
        for round_ in range(rounds):
            for name in names:
                gemv, on, tile_bytes = LAUNCHES[name]
                pdl.PDL, gemv_kernel.TILE_BYTES = on, tile_bytes or before[-1]
                engine.runner.set_gemv(gemv)
                engine.graphed.capture()
                for B in batches:
                    feats = torch.randn(B, 79, device="cuda")
                    times[name][B].append(time_cuda(lambda: engine.step_slots(slots[:B], feats), iters=100)[0])
                if round_ == 0:
                    towers[name] = {k: v for k, v in tower_graph_times(engine.runner, slots).items()
                                    if k.startswith("B1_")}
    finally:
        pdl.PDL, gemv_kernel.TILE_BYTES = before
        engine.runner.set_gemv(True)
        engine.graphed.capture()
    return ({name: {B: {"median": float(np.median(v)), "rounds": v} for B, v in by_batch.items()}
             for name, by_batch in times.items()}, towers)


def accuracy(model, engines, n_symbols, steps):
    from client.accuracy import tower_errors
    from client.engine.reference import ReferenceEngine
    ref = ReferenceEngine(model, device="cuda")
    syms = [f"A{i}" for i in range(n_symbols)]
    predictions, targets = {name: [] for name in engines}, []
    rng = np.random.default_rng(0)
    for _ in range(steps):
        f = rng.standard_normal((len(syms), 79)).astype(np.float32)
        targets.append(ref.step(syms, f))
        for name, engine in engines.items():
            predictions[name].append(engine.step(syms, f))
    result = {name: tower_errors(np.concatenate(parts), np.concatenate(targets)) for name, parts in predictions.items()}
    for name, towers in result.items():
        log(f"accuracy {name}: " + ", ".join(f"{n} {v['within_atol']:.4f} ({v['max_abs_err']:.1e})"
                                             for n, v in towers.items()))
    return result


PROG = "scripts/profile_step.py"


# The options' types: a mistake in one is told before the minutes of timing, not when it is reached.
def batches_argument(text: str) -> list[int]:
    """Batch sizes, comma-separated, 1 to MAX_BATCH."""
    batches = [cli.positive_int(part.strip()) for part in text.split(",")]
    if max(batches) > MAX_BATCH:
        raise argparse.ArgumentTypeError(f"batch sizes go up to {MAX_BATCH}, got {text!r}")
    return batches


def variant_argument(spec: str) -> tuple[str, Precision, list[torch.dtype] | None]:
    """(spec, its precision over auto, the skinny kernel's weight dtypes or None) from e.g.
    "retnet.mlp=float16,skinny=float32+float16" (skinny=none: cuBLAS throughout)."""
    overrides = [kv for kv in spec.split(",") if not kv.startswith("skinny=")]
    skinny = next((kv.partition("=")[2] for kv in spec.split(",") if kv.startswith("skinny=")), None)
    try:
        precision = Precision.parse(",".join(["auto", *overrides]))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{spec!r}: {exc}") from None
    if skinny is None:
        return spec, precision, None
    dtypes = [getattr(torch, name, None) for name in skinny.split("+") if name != "none"]
    if not all(isinstance(dtype, torch.dtype) for dtype in dtypes):
        raise argparse.ArgumentTypeError(f"{spec!r}: skinny= takes torch dtypes joined by + (float32+float16) "
                                         f"or none")
    return spec, precision, dtypes


def priorities_argument(spec: str) -> tuple[str, dict[str, int]]:
    """(spec, {tower: CUDA stream priority}) from "none" (all 0) or e.g. "xlstm=-1,mamba2=-1"."""
    pairs = [] if spec == "none" else [kv.split("=") for kv in spec.split(",")]
    try:
        if any(len(kv) != 2 or kv[0] not in TOWER_NAMES for kv in pairs):
            raise ValueError
        return spec, {name: int(value) for name, value in pairs}
    except ValueError:
        raise argparse.ArgumentTypeError(f"{spec!r}: expected none or tower=priority[,...] (an integer) with "
                                         f"towers {', '.join(TOWER_NAMES)}") from None


def main(argv=None) -> int:
    ap = cli.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="full")
    ap.add_argument("--seed", type=cli.seed, default=0)
    ap.add_argument("--batches", type=batches_argument, default="1,20,64")
    ap.add_argument("--accuracy-symbols", type=int, default=20)
    ap.add_argument("--accuracy-steps", type=int, default=100)
    ap.add_argument("--out-dir", type=Path, default=Path("prof"))
    ap.add_argument("--variant", action="append", type=variant_argument, default=[],
                    help="also time and check an engine with precision overrides, e.g. "
                         "retnet.mlp=float16,hawk=bfloat16, or with other weight dtypes on the skinny kernel, e.g. "
                         "skinny=none or skinny=float32+float16")
    ap.add_argument("--priorities", action="append", type=priorities_argument, default=[],
                    help="also time the step under these CUDA stream priorities per tower, e.g. xlstm=-1 or "
                         "xlstm=-1,mamba2=-1 or none (all 0); repeat to compare (bench/LOG.md section 23)")
    ap.add_argument("--launch-ab", type=int, default=0, metavar="ROUNDS",
                    help="also time the step with a step's one row through cuBLAS and through kernels/gemv.py "
                         "(plain, with programmatic dependent launch, with larger slices of W), in turn, ROUNDS "
                         "times (bench/LOG.md section 57)")
    ap.add_argument("--launches", default=",".join(LAUNCHES),
                    help=f"the --launch-ab variants to time, comma-separated (default all: {', '.join(LAUNCHES)})")
    args = ap.parse_args(argv)
    launches = [name.strip() for name in args.launches.split(",") if name.strip()]
    unknown = [name for name in launches if name not in LAUNCHES]
    if unknown or not launches:
        ap.error(f"--launches {args.launches!r}: choose from {', '.join(LAUNCHES)}")
    if not torch.cuda.is_available():
        raise cli.CliError(f"needs a CUDA GPU (it times the fast engine's CUDA graphs and kernels), and this torch "
                           f"({torch.__version__}) sees none; on a CPU, local_evaluator.py --profile DIR profiles a "
                           f"replay")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    result = {"device": torch.cuda.get_device_name()}
    bw = copy_bandwidth()
    result["copy_GBps"] = bw / 1e9
    t = time.perf_counter()
    model, fp = load_model(args.preset, seed=args.seed, device="cuda")
    torch.cuda.synchronize()
    result["weights_s"] = time.perf_counter() - t
    log(f"weights {fp} in {result['weights_s']:.1f} s; copy {bw / 1e9:.0f} GB/s")
    with torch.no_grad():
        for B in (1, 20):
            state = model.init_state(B)
            feats = torch.randn(B, 79, device="cuda")
            result[f"reference_step_ms_B{B}"] = time_cuda(lambda: model(feats, state), iters=5, warmup=1)[0]
    log(f"reference step {result['reference_step_ms_B1']:.1f} ms (B=1), "
        f"{result['reference_step_ms_B20']:.1f} ms (B=20)")

    t = time.perf_counter()
    batches = args.batches
    capacity = max(batches) + args.accuracy_symbols  # the timed steps' symbols, then the accuracy check's
    engine = FastEngine(model, device="cuda", max_batch=MAX_BATCH, capacity=capacity, host_symbols=0)
    result["fast_startup_s"] = time.perf_counter() - t
    result["describe"] = engine.describe()
    slots = engine.slots_for([f"P{i}" for i in range(max(batches))])
    result["step_ms"] = {}
    for B in batches:
        feats = torch.randn(B, 79, device="cuda")
        med, p99 = time_cuda(lambda: engine.step_slots(slots[:B], feats), iters=100)
        floor = (engine.weight_bytes + 2 * B * engine.state_bytes) / bw * 1e3
        result["step_ms"][B] = {"median": med, "p99": p99, "floor": floor}
        log(f"B={B}: {med:.3f} ms (p99 {p99:.3f}), floor {floor:.3f} ms")
    if args.priorities:
        result["priority_step_ms"] = priority_times(engine, slots, batches, dict(args.priorities))
        for spec, times in result["priority_step_ms"].items():
            log(f"priorities {spec}: " + ", ".join(f"B={B} {t:.3f} ms" for B, t in times.items()))
    if args.launch_ab:
        result["launch_step_ms"], result["launch_tower_ms"] = launch_times(engine, slots, batches, args.launch_ab,
                                                                           launches)
        for name, times in result["launch_step_ms"].items():
            log(f"launch {name}: " + ", ".join(f"B={B} {t['median']:.3f} ms" for B, t in times.items())
                + f"; towers alone {result['launch_tower_ms'][name]}")
    # eager per-tower times and top kernels of one eager step
    runner = engine.runner
    for B in (1, batches[-1]):
        feats = torch.randn(B, 79, device="cuda")
        up = runner.tower_inputs(feats)
        for tower, chunk, states in zip(runner.towers, up, runner.tower_states):
            result[f"eager_tower_ms_B{B}_{tower.name}"] = time_cuda(
                lambda: tower(chunk, states, StepPlan.one_row_each(slots[:B])), iters=10)[0]
        result[f"eager_step_ms_B{B}"] = time_cuda(lambda: runner(StepPlan.one_row_each(slots[:B]), feats), iters=10)[0]
    result["tower_timeline"] = tower_timeline(engine, slots, batches)
    for B, row in result["tower_timeline"].items():
        spans = ", ".join(f"{t} {a:.0f}-{b:.0f}" for t, (a, b) in ((t, v) for t, v in row["towers"].items() if v))
        log(f"B={B}: towers' state kernels from the step's first kernel (us): {spans}; span {row['span_us']:.0f}"
            + (f"; BEHIND ANOTHER TOWER'S CHAIN: {', '.join(row['late'])}" if row["late"] else ""))
    result["tower_graph_ms"] = tower_graph_times(runner, slots)
    log(f"towers alone as graphs: {result['tower_graph_ms']}")
    result["fp32_gemm_us"] = fp32_gemm_times()
    log(f"fp32 GEMM variants: {result['fp32_gemm_us']}")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        feats = torch.randn(20, 79, device="cuda")
        runner(StepPlan.one_row_each(slots[:20]), feats)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
    (args.out_dir / "top_kernels_B20.txt").write_text(table)
    engines = {"default": engine}
    for spec, precision, skinny in args.variant:
        variant = FastEngine(model, device="cuda", max_batch=MAX_BATCH, capacity=capacity, host_symbols=0,
                             progress=False, precision=precision)
        if skinny is not None:
            variant.runner.set_skinny(skinny)
            variant.graphed.capture()
        vslots = variant.slots_for([f"P{i}" for i in range(max(batches))])
        times = {}
        for B in batches:
            feats = torch.randn(B, 79, device="cuda")
            times[B] = time_cuda(lambda: variant.step_slots(vslots[:B], feats), iters=50)[0]
        result[f"variant {spec} step_ms"] = times
        log(f"variant {spec}: {times}, weights {variant.weight_bytes / 1e9:.2f} GB")
        engines[spec] = variant
    result["accuracy"] = accuracy(model, engines, args.accuracy_symbols, args.accuracy_steps)
    (args.out_dir / "profile.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    print(table[:6000])
    return cli.EXIT_OK


if __name__ == "__main__":
    sys.exit(cli.run_cli(main, PROG))
