"""The fast engine's weight products, cuBLAS against kernels/skinny_matmul.py, on a GPU, from a step's single row
to steps of many requests (512 rows).

    python scripts/bench_matmul.py --json bench/matmul_h100.json
    python scripts/bench_matmul.py --batches 256,512 --search float32,fp32+fp16   # tile search (long)

The products are grouped by (kind, N, K) with the engine's own weights (full preset; kinds as layers.Linear.kind
names them: fp32 weights as the split fp16 pairs the kernel takes, "fp32+fp16" the mixed product whose first rows
are split), and each group is timed as one CUDA graph that runs the product once per weight of the group in turn,
so W comes from HBM, not from L2, and launches cost what they cost inside the step's graphs. The table at the end
gives, per group and number of rows M, cuBLAS's time (the engine's path without the kernel: true fp32 for fp32
weights), the kernel's with default_config, and their ratio: layers.SKINNY_MAX_ROWS is set from it. For the
--search kinds a coordinate search over the kernel's (BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps, SPLIT_K)
shows what it would change against default_config.
"""
import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path


import numpy as np
import torch

from client import cli
from client.engine.fast.layers import SKINNY_MAX_ROWS, skinny_pays
from client.engine.fast.runner import StepRunner
from client.model import load_model
from kernels.skinny_matmul import default_config, skinny_matmul, split_fp16, supports

# values tried per axis of the config (BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps, SPLIT_K)
SEARCH = {0: (16, 32, 64, 128), 1: (16, 32, 64, 128), 2: (32, 64, 128, 256), 3: (2, 3, 4, 5, 6), 4: (2, 4, 8),
          5: (1, 2, 4, 8)}
SEARCH_PASSES = 2  # a second pass over the axes from the first one's best (tile sizes and split K interact)
SMEM_PER_SM = 227 * 1024  # an H100's or H200's shared memory per block
PROG = "scripts/bench_matmul.py"


def log(msg):
    sys.stderr.write(f"[{time.strftime('%H:%M:%S')}] {msg}\n")


def graph_time_us(calls, replays=20):
    """Median time per call of `calls` (a list of thunks) replayed as one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(calls))
    return float(np.median(times))


def fits(config, K, split):
    block_m, block_n, block_k, stages, _, split_k = config
    tile_bytes = (4 * block_m + (2 if split else 1) * 2 * block_n) * block_k  # x fp32, W fp16 (hi and lo)
    return K % (block_k * split_k) == 0 and stages * tile_bytes <= SMEM_PER_SM


def skinny_weights(w):
    """kwargs of skinny_matmul for an engine weight: fp32 as the split fp16 pair the engine uses."""
    if w.dtype != torch.float32:
        return {"weight": w}
    hi, lo = split_fp16(w)
    return {"weight": hi, "weight_lo": lo}


def table(result, batches):
    """cuBLAS, skinny (default_config) and their ratio per group (rows) and M (columns); then, per kind, the M
    where the kernel wins on every group layers.skinny_pays sends it."""
    groups = sorted({name.split(" ", 1)[1] for name in result["groups"]})
    cell = {(group, B): result["groups"].get(f"B{B} {group}") for group in groups for B in batches}
    for what, title in (("cublas_us", "cuBLAS us"), ("skinny_us", "skinny us (default_config)"),
                        ("ratio", "cuBLAS / skinny (> 1: the kernel wins)")):
        print(title)
        print(f"{'group':28s}" + "".join(f"{f'M={B}':>9s}" for B in batches))
        for group in groups:
            values = [None if g is None else g["cublas_us"] / g["skinny_us"] if what == "ratio" else g[what]
                      for g in (cell[group, B] for B in batches)]
            print(f"{group:28s}" + "".join(f"{'-':>9s}" if v is None else f"{v:9.2f}" for v in values))
        print()
    for kind in sorted({group.split(" ")[0] for group in groups}):
        routed = {B: [g for (group, b), g in cell.items() if b == B and g is not None and group.startswith(kind + " ")
                      and skinny_pays(B, int(group.split(" ")[1].split("x")[0]))] for B in batches}
        won = [B for B in batches if routed[B] and all(g["cublas_us"] > g["skinny_us"] for g in routed[B])]
        print(f"{kind:10s} the kernel wins on every group skinny_pays routes at M = {won or 'none'} "
              f"(layers.SKINNY_MAX_ROWS: {SKINNY_MAX_ROWS.get(kind)})")


def main(argv=None):
    ap = cli.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="full")
    ap.add_argument("--batches", default="1,4,16,64,128,256,512")
    ap.add_argument("--search", default="none", help="kinds whose kernel configs are searched (comma list: "
                                                     "float32, fp32+fp16, float16; or none)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise cli.CliError(f"needs a CUDA GPU (it times cuBLAS and kernels/skinny_matmul.py on it), and this torch "
                           f"({torch.__version__}) sees none")
    torch.backends.cuda.matmul.allow_tf32 = False
    model, _ = load_model(args.preset, device="cuda")
    runner = StepRunner(model, "cuda", streams=False, skinny=())
    del model
    groups, split = defaultdict(list), defaultdict(list)
    for linear in runner.linears():  # skinny=() above: product() is the cuBLAS path
        if linear.weight.dtype == torch.float64:  # RetNet's input path: cuBLAS's fp64 only, no kernel to compare
            continue
        N, K = linear.weight.shape
        key = (linear.kind, N, K)
        groups[key].append(linear)
        split[key].append({"weight": linear.weight, "weight_lo": linear.weight_lo} if linear.weight_lo is not None
                          else skinny_weights(linear.weight))
    batches = [int(b) for b in args.batches.split(",")]
    result = {"device": torch.cuda.get_device_name(), "groups": {}}
    for B in batches:
        for key in sorted(groups):
            kind, N, K = key
            if not supports(B, N, K):
                continue
            linears, x = groups[key], torch.randn(B, K, device="cuda")
            splits = kind in ("float32", "fp32+fp16")

            def skinny_us(config=None):
                return graph_time_us([lambda w=w: skinny_matmul(x, **w, config=config) for w in split[key]])

            cublas = graph_time_us([lambda linear=linear: linear.product(x) for linear in linears])
            best = list(default_config(B, N, K, splits))
            best_us = first_us = skinny_us()
            if kind in args.search.split(","):  # coordinate search over the launch parameters
                for axis, values in [*SEARCH.items()] * SEARCH_PASSES:
                    for value in values:
                        config = tuple(best[:axis] + [value] + best[axis + 1:])
                        if value == best[axis] or not fits(config, K, splits):
                            continue
                        try:
                            us = skinny_us(config)
                        except Exception as exc:  # a config the compiler or the SM cannot take
                            log(f"  {config}: {type(exc).__name__}")
                            continue
                        if us < best_us:
                            best, best_us = list(config), us
            nbytes = linears[0].nbytes
            entry = {"weights": len(linears), "cublas_us": cublas, "skinny_us": first_us, "best_us": best_us,
                     "default_config": list(default_config(B, N, K, splits)), "best_config": best,
                     "cublas_TBps": nbytes / cublas / 1e6, "skinny_TBps": nbytes / first_us / 1e6,
                     "best_TBps": nbytes / best_us / 1e6}
            result["groups"][f"B{B} {kind} {N}x{K}"] = entry
            log(f"B={B} {kind} [{N}, {K}] x{len(linears)}: cuBLAS {cublas:.1f} us ({entry['cublas_TBps']:.2f} TB/s), "
                f"skinny {first_us:.1f} us, best {best_us:.1f} us ({entry['best_TBps']:.2f} TB/s) with {best}")
    print(f"{'group':30s} {'cuBLAS us':>9s} {'TB/s':>5s} {'skinny us':>9s} {'best us':>8s} {'TB/s':>5s}  best config")
    for name, g in result["groups"].items():
        print(f"{name:30s} {g['cublas_us']:9.1f} {g['cublas_TBps']:5.2f} {g['skinny_us']:9.1f} {g['best_us']:8.1f} "
              f"{g['best_TBps']:5.2f}  {g['best_config']}")
    print()
    table(result, batches)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    sys.exit(cli.run_cli(main, PROG))
