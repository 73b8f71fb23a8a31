"""The fast engine's weight products, cuBLAS against kernels/skinny_matmul.py, on a GPU.

    python scripts/bench_matmul.py --json bench/matmul_h100.json

The products are grouped by (weight dtype, N, K) with the engine's own weights (full preset), and each group is
timed as one CUDA graph that runs the product once per weight of the group in turn, so W comes from HBM, not
from L2, and launches cost what they cost inside the step's graphs. For each dtype and batch size, a coordinate
search over the kernel's (BLOCK_N, BLOCK_K, num_stages, num_warps) minimises the time of all its products in a
step; the table shows what that search would change against default_config.
"""
import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from client.engine.fast.layers import mm32  # noqa: E402
from client.engine.fast.runner import StepRunner  # noqa: E402
from client.model import load_model  # noqa: E402
from kernels.skinny_matmul import SMEM_BUDGET, default_config, skinny_matmul, supports  # noqa: E402

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


def fits(config, M, K, dtype):
    block_n, block_k, stages, _ = config
    size = torch.tensor([], dtype=dtype).element_size()
    return K % block_k == 0 and stages * (max(16, M) + block_n) * block_k * size <= SMEM_BUDGET * 1.25


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="full")
    ap.add_argument("--batches", default="1,4,20,64")
    ap.add_argument("--no-search", action="store_true", help="time cuBLAS and default_config only")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    model, _ = load_model(args.preset, device="cuda")
    runner = StepRunner(model, "cuda", capacity=1, streams=False, skinny=())
    del model
    groups = defaultdict(list)
    for linear in runner.linears():
        N, K = linear.weight.shape
        groups[(str(linear.dtype).removeprefix("torch."), N, K)].append(linear.weight)
    result = {"device": torch.cuda.get_device_name(), "groups": {}, "search": {}}
    for B in (int(b) for b in args.batches.split(",")):
        for dtype in sorted({key[0] for key in groups}):
            keys = [key for key in groups if key[0] == dtype and supports(B, key[1], key[2])]
            xs = {key: torch.randn(B, key[2], device="cuda") for key in keys}

            def total_us(config):
                """Time of all of this dtype's products in one step (each group: time per call x weights)."""
                return sum(graph_time_us([lambda w=w, x=xs[key]: skinny_matmul(x, w, config=config)
                                          for w in groups[key]]) * len(groups[key]) for key in keys)

            for key in keys:
                ws, x = groups[key], xs[key]
                cublas = graph_time_us([lambda w=w: mm32(x.to(w.dtype), w.t()) for w in ws])
                skinny = graph_time_us([lambda w=w: skinny_matmul(x, w) for w in ws])
                nbytes = ws[0].numel() * ws[0].element_size()
                entry = {"weights": len(ws), "cublas_us": cublas, "skinny_us": skinny,
                         "cublas_TBps": nbytes / cublas / 1e6, "skinny_TBps": nbytes / skinny / 1e6,
                         "default_config": default_config(B, key[1], key[2], ws[0].dtype)}
                result["groups"][f"B{B} {dtype} {key[1]}x{key[2]}"] = entry
                log(f"B={B} {dtype} [{key[1]}, {key[2]}] x{len(ws)}: cuBLAS {cublas:.1f} us "
                    f"({entry['cublas_TBps']:.2f} TB/s), skinny {skinny:.1f} us ({entry['skinny_TBps']:.2f} TB/s)")
            if args.no_search or not keys:
                continue
            torch_dtype = getattr(torch, dtype)
            best = list(default_config(B, keys[0][1], keys[0][2], torch_dtype))
            best_us = total_us(tuple(best))
            start_us, tried = best_us, 1
            for axis, values in SEARCH.items():
                for value in values:
                    config = tuple(best[:axis] + [value] + best[axis + 1:])
                    if value == best[axis] or not all(fits(config, B, key[2], torch_dtype) for key in keys):
                        continue
                    try:
                        us = total_us(config)
                    except Exception as exc:  # a config the compiler or the SM cannot take
                        log(f"  {config}: {type(exc).__name__}")
                        continue
                    tried += 1
                    if us < best_us:
                        best, best_us = list(config), us
            result["search"][f"B{B} {dtype}"] = {"default_us": start_us, "best_us": best_us, "best": best,
                                                 "tried": tried}
            log(f"B={B} {dtype}: all products {start_us:.0f} us with the first config, {best_us:.0f} us with "
                f"{tuple(best)} ({tried} configs)")
    print(f"{'group':32s} {'cuBLAS us':>10s} {'TB/s':>6s} {'skinny us':>10s} {'TB/s':>6s}")
    for name, g in result["groups"].items():
        print(f"{name:32s} {g['cublas_us']:10.1f} {g['cublas_TBps']:6.2f} {g['skinny_us']:10.1f} {g['skinny_TBps']:6.2f}")
    for name, s in result["search"].items():
        print(f"search {name}: {s['default_us']:.0f} -> {s['best_us']:.0f} us with {s['best']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
