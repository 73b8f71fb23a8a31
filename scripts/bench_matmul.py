"""The fast engine's weight products, cuBLAS against kernels/skinny_matmul.py, on a GPU.

    python scripts/bench_matmul.py --json bench/matmul_h100.json

The products are grouped by (weight dtype, N, K) with the engine's own weights (full preset; fp32 weights as the
split fp16 pairs the kernel takes), and each group is timed as one CUDA graph that runs the product once per
weight of the group in turn, so W comes from HBM, not from L2, and launches cost what they cost inside the
step's graphs. For each group and batch size of the --search dtypes, a coordinate search over the kernel's
(BLOCK_N, BLOCK_K, num_stages, num_warps) shows what it would change against default_config.
"""
import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path


import numpy as np
import torch

from client.engine.fast.runner import StepRunner
from client.model import load_model
from kernels.skinny_matmul import SMEM_BUDGET, default_config, skinny_matmul, split_fp16, supports

SEARCH = {0: (16, 32, 64, 128), 1: (32, 64, 128, 256), 2: (2, 3, 4, 5, 6), 3: (2, 4, 8)}


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


def fits(config, M, K, split):
    block_n, block_k, stages, _ = config
    tile_bytes = (2 * max(16, M) + (2 if split else 1) * 2 * block_n) * block_k
    return K % block_k == 0 and stages * tile_bytes <= SMEM_BUDGET * 1.25


def skinny_weights(w):
    """kwargs of skinny_matmul for an engine weight: fp32 as the split fp16 pair the engine uses."""
    if w.dtype != torch.float32:
        return {"weight": w}
    hi, lo = split_fp16(w)
    return {"weight": hi, "weight_lo": lo}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="full")
    ap.add_argument("--batches", default="1,2,4,8,20,40,64")
    ap.add_argument("--search", default="float32", help="weight dtypes whose kernel configs are searched "
                                                        "(comma list, or none)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    model, _ = load_model(args.preset, device="cuda")
    runner = StepRunner(model, "cuda", streams=False, skinny=())
    del model
    groups, split = defaultdict(list), defaultdict(list)
    for linear in runner.linears():  # skinny=() above: product() is the cuBLAS path
        N, K = linear.weight.shape
        mixed = linear.weight_lo is not None  # fp32 rows split beside fp16 rows (layers.Linear)
        key = ("fp32+fp16" if mixed else str(linear.dtype).removeprefix("torch."), N, K)
        groups[key].append(linear)
        split[key].append({"weight": linear.weight, "weight_lo": linear.weight_lo} if mixed
                          else skinny_weights(linear.weight))
    result = {"device": torch.cuda.get_device_name(), "groups": {}}
    for B in (int(b) for b in args.batches.split(",")):
        for key in sorted(groups):
            dtype, N, K = key
            if not supports(B, N, K):
                continue
            linears, x = groups[key], torch.randn(B, K, device="cuda")
            splits = dtype in ("float32", "fp32+fp16")

            def skinny_us(config=None):
                return graph_time_us([lambda w=w: skinny_matmul(x, **w, config=config) for w in split[key]])

            cublas = graph_time_us([lambda linear=linear: linear.product(x) for linear in linears])
            best = list(default_config(B, N, K, splits))
            best_us = first_us = skinny_us()
            if dtype in args.search.split(","):  # coordinate search over the launch parameters
                for axis, values in SEARCH.items():
                    for value in values:
                        config = tuple(best[:axis] + [value] + best[axis + 1:])
                        if value == best[axis] or not fits(config, B, K, splits):
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
                     "best_config": best, "cublas_TBps": nbytes / cublas / 1e6,
                     "skinny_TBps": nbytes / first_us / 1e6, "best_TBps": nbytes / best_us / 1e6}
            result["groups"][f"B{B} {dtype} {N}x{K}"] = entry
            log(f"B={B} {dtype} [{N}, {K}] x{len(linears)}: cuBLAS {cublas:.1f} us ({entry['cublas_TBps']:.2f} TB/s), "
                f"skinny {first_us:.1f} us, best {best_us:.1f} us ({entry['best_TBps']:.2f} TB/s) with {best}")
    print(f"{'group':30s} {'cuBLAS us':>9s} {'TB/s':>5s} {'skinny us':>9s} {'best us':>8s} {'TB/s':>5s}  best config")
    for name, g in result["groups"].items():
        print(f"{name:30s} {g['cublas_us']:9.1f} {g['cublas_TBps']:5.2f} {g['skinny_us']:9.1f} {g['best_us']:8.1f} "
              f"{g['best_TBps']:5.2f}  {g['best_config']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
