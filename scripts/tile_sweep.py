"""GPU time of the state kernels' tilings at a step's shapes: the tiling each launcher chooses today against the
alternatives, at one and at several rows per sequence (where a tile's row loop, not its load, may set the time).

    python -m scripts.tile_sweep --json bench/tile_sweep_h100.json           # full preset sizes, G x k shapes
    python -m scripts.tile_sweep --shapes 64x1,64x4 --ops mamba2 --reps 5

Ops: mlstm_C and retnet_S (kernels/outer_product_update.py at the mLSTM's and RetNet's sizes), mamba2
(kernels/mamba2_update.py) and slstm (kernels/slstm_step.py: sequences a program, with the engine's split fp32 input
maps over fp16 state maps, one launch per row position). Each time is the median over --reps of one launch replayed
from a CUDA graph after L2 is flushed, in microseconds; the states are the shape's own G slots (fp32), the inputs
random. A shape here is G sequences exactly, where the engine's captured shapes may hold more (empty) ones, which
changes the tiling its launchers choose (kernels/outer_product_update.tiling). bench/tile_sweep_h100.json was taken
by the version before, which timed 10 back-to-back launches between two events: below ~60 us a launch, its times are
the launches' (bench/LOG.md section 44). On a CPU, with TRITON_INTERPRET=1, a smoke run (--preset tiny).
"""
import itertools
import json
import re
import statistics
import sys
import time

from client import cli
from client.model.config import get_preset
from client.model.mamba2 import HEAD_SIZE, STATE_SIZE
from kernels._common import next_pow2
from scripts.kernel_times import shapes as parse_shapes

PROG = "scripts/tile_sweep.py"
L2_FLUSH_BYTES = 256 << 20  # written before each timed launch: five times an H100's L2


def outer_product_configs(d_size):
    """(block_e, block_d, num_warps, row_stages) to try; None: the launcher's own choice. One or two warps a
    program with tiles of 2,048-4,096 values: a row's readout then sums over d within a warp (no barrier)."""
    configs = [None]
    for block_e, tile, warps, stages in [*itertools.product((16, 32, 64), (4096, 8192, 16384), (4, 8), (1, 2)),
                                         *itertools.product((8, 16, 32), (2048, 4096), (1, 2), (1,))]:
        block_d = min(next_pow2(d_size), tile // block_e)
        config = (block_e, block_d, warps, stages)
        if config not in configs:
            configs.append(config)
    return configs


def mamba2_configs():
    """(block_p, num_warps) to try; None: the launcher's own choice."""
    return [None, *itertools.product((4, 8, 16, 32, 64), (4, 8))]


SLSTM_BLOCK_M = (16, 32, 64)  # sequences a program


def time_us(fn, reps, torch, dev):
    """Median over reps of one launch, us: on a GPU the launch replayed from a CUDA graph (no Python launch
    overhead between the events) after L2 is flushed (in a step, the weights stream through L2 between two
    launches of a state kernel); on the CPU the wall clock (the Triton interpreter: a smoke run, not a
    measurement)."""
    fn()
    if dev == "cpu":
        times = []
        for _ in range(reps):
            begin = time.perf_counter()
            fn()
            times.append((time.perf_counter() - begin) * 1e6)
        return statistics.median(times)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=dev)
    times = []
    for _ in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    return statistics.median(times)


def check(result, name, outputs):
    """Every tiling computes the default's outputs and states (up to fp32 reassociation): a tiling that does not
    is a bug, not a result."""
    outputs = [t.clone() for t in outputs]
    if name == "default":
        result["_reference"] = outputs
        return
    for got, want in zip(outputs, result["_reference"]):
        if not (got.isfinite().all() and (got - want).abs().max() <= 1e-4 * (want.abs().max() + 1e-6)):
            raise AssertionError(f"tiling {name} differs from the default: max |diff| "
                                 f"{(got - want).abs().max().item():.3g} of max |value| {want.abs().max().item():.3g}")


def sweep_outer_product(heads, d_size, g, k, reps, torch, dev, wanted):
    from kernels.outer_product_update import _check, launch
    from kernels._common import plan

    rows = g * k
    M = torch.randn(g + 1, heads, d_size, d_size, device=dev) * 0.01
    q, key = (torch.randn(rows, heads, d_size, device=dev) for _ in range(2))
    v = torch.randn(rows, heads, d_size, device=dev)
    a = torch.rand(rows, heads, device=dev) * 0.1 + 0.9
    den = torch.rand(rows, heads, device=dev) + 1.0
    seq_slots, seq_starts = plan(list(range(1, g + 1)), [k] * g, device=dev)
    q, key, v, a, den, rounding = _check(M, q, key, v, a, den, seq_slots, seq_starts, None)
    out = torch.empty(rows, heads, d_size, device=dev)
    result, start = {}, M.clone()
    for config in outer_product_configs(d_size):
        tiling = {} if config is None else dict(zip(("block_e", "block_d", "num_warps", "row_stages"), config))
        name = "default" if config is None else "e{}_d{}_w{}_s{}".format(*config)
        if not wanted(name):
            continue
        M.copy_(start)  # one launch from the same state, against the default tiling's output and state
        out.fill_(float("nan"))  # a row the tiling leaves unwritten fails the check
        launch(M, q, key, v, a, den, seq_slots, seq_starts, rounding, out, **tiling)
        check(result, name, (out, M[1:]))
        result[name] = time_us(lambda: launch(M, q, key, v, a, den, seq_slots, seq_starts, rounding, out, **tiling),
                               reps, torch, dev)
    return result


def sweep_mamba2(cfg, g, k, reps, torch, dev, wanted):
    from kernels._common import plan
    from kernels.mamba2_update import mamba2_state_update

    rows, inner = g * k, 2 * cfg.hidden
    heads = inner // HEAD_SIZE
    h = torch.randn(g + 1, heads, HEAD_SIZE, STATE_SIZE, device=dev) * 0.01
    x = torch.randn(rows, heads, HEAD_SIZE, device=dev)
    t = torch.randn(rows, cfg.hidden, device=dev)
    dt_weight = torch.randn(heads, cfg.hidden, device=dev) * 0.02
    dt_bias, d = torch.randn(heads, device=dev), torch.randn(heads, device=dev)
    a = -torch.rand(heads, device=dev)
    b, c = torch.randn(rows, STATE_SIZE, device=dev), torch.randn(rows, STATE_SIZE, device=dev)
    seq_slots, seq_starts = plan(list(range(1, g + 1)), [k] * g, device=dev)
    result, start = {}, h.clone()
    for config in mamba2_configs():
        tiling = {} if config is None else {"block_p": config[0], "num_warps": config[1]}
        name = "default" if config is None else "p{}_w{}".format(*config)
        if not wanted(name):
            continue
        h.copy_(start)
        y = mamba2_state_update(h, x, t, dt_weight, dt_bias, a, b, c, d, seq_slots, seq_starts, **tiling)
        check(result, name, (y, h[1:]))
        result[name] = time_us(
            lambda: mamba2_state_update(h, x, t, dt_weight, dt_bias, a, b, c, d, seq_slots, seq_starts, **tiling),
            reps, torch, dev)
    return result


def sweep_slstm(cfg, g, k, reps, torch, dev, wanted):
    from kernels._common import plan
    from kernels.slstm_step import pack_weights, slstm_step

    rows, width, blocks = g * k, cfg.hidden, 4
    size = width // blocks
    maps = torch.randn(2, 4, blocks, size, size, device=dev) / (2 * size) ** 0.5
    weight, weight_lo = pack_weights(maps[0], maps[1], torch.float32, torch.float16)
    xc, xn = torch.randn(rows, width, device=dev), torch.randn(rows, width, device=dev)
    bias = torch.randn(4, width, device=dev) * 0.5
    c, n, m, y = (torch.randn(g + 1, width, device=dev) for _ in range(4))
    n.abs_().add_(0.5)
    seq_slots, seq_starts = plan(list(range(1, g + 1)), [k] * g, device=dev)
    start = [t.clone() for t in (c, n, m)]
    result = {}
    # the default (input maps hoisted out of the row positions' launches at k > 1), then the one-launch path
    for block_m, hoist in ((None, None), (None, False), *((b, None) for b in SLSTM_BLOCK_M)):
        tiling = {"hoist_inputs": hoist} if block_m is None else {"block_m": block_m}
        name = "default" if (block_m, hoist) == (None, None) else "fused" if block_m is None else f"m{block_m}"
        if not wanted(name):
            continue

        def step():
            return slstm_step(xc, xn, weight, bias, c, n, m, y, seq_slots, seq_starts, k, weight_lo, **tiling)
        for state, first in zip((c, n, m), start):
            state.copy_(first)
        out = step()
        check(result, name, (out, c[1:], n[1:], m[1:]))
        result[name] = time_us(step, reps, torch, dev)
    return result


def main(argv=None):
    parser = cli.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="full")
    parser.add_argument("--shapes", default="1x1,1x4,20x1,20x4,64x1,64x4,64x8",
                        help="step shapes GxK: G sequences of K rows (default %(default)s)")
    parser.add_argument("--ops", default="mlstm_C,retnet_S,mamba2,slstm", help="comma list (default %(default)s)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--match", default="", help="time only the tilings whose names this regex finds "
                        "(e.g. '_w1_'); the default's always")
    parser.add_argument("--json", type=cli.output_file, help="write every time here")  # checked before any timing
    args = parser.parse_args(argv)
    import torch

    from kernels._common import INTERPRET
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu" and not INTERPRET:
        raise cli.CliError(f"needs a CUDA GPU (it times Triton kernels), and this torch ({torch.__version__}) sees "
                           f"none; on a CPU only as a smoke run, with TRITON_INTERPRET=1")
    cfg = get_preset(args.preset)
    pattern = re.compile(args.match)

    def wanted(name):
        return name == "default" or bool(pattern.search(name))
    ops = [op.strip() for op in args.ops.split(",") if op.strip()]
    unknown = set(ops) - {"mlstm_C", "retnet_S", "mamba2", "slstm"}
    if unknown:
        parser.error(f"unknown ops {sorted(unknown)}; choose from mlstm_C, retnet_S, mamba2, slstm")
    results = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu (interpreter)", "preset": args.preset}
    print(f"{'op':9} {'shape':6} {'default us':>10} {'best us':>9}  best tiling")
    for op in ops:
        results[op] = {}
        for g, k in parse_shapes(args.shapes):
            if op == "mlstm_C":
                times = sweep_outer_product(cfg.heads, 2 * cfg.hidden // cfg.heads, g, k, args.reps, torch, dev,
                                            wanted)
            elif op == "retnet_S":
                times = sweep_outer_product(cfg.heads, cfg.hidden // cfg.heads, g, k, args.reps, torch, dev, wanted)
            elif op == "mamba2":
                times = sweep_mamba2(cfg, g, k, args.reps, torch, dev, wanted)
            else:
                times = sweep_slstm(cfg, g, k, args.reps, torch, dev, wanted)
            times.pop("_reference")
            results[op][f"{g}x{k}"] = times
            best = min(times, key=times.get)
            print(f"{op:9} {g}x{k:<4} {times['default']:10.1f} {times[best]:9.1f}  {best}", flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(cli.run_cli(main, PROG))
