"""Where the fast engine's step time goes, on a GPU: startup, step time per batch size, the eager step's top
kernels, and a short accuracy check against the fp32 reference.

    python scripts/profile_step.py --preset full --batches 1,20,64 --out-dir prof/
"""
import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from client.engine.fast import FastEngine  # noqa: E402
from client.model import TOWER_NAMES, load_model  # noqa: E402


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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="full")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batches", default="1,20,64")
    ap.add_argument("--accuracy-symbols", type=int, default=20)
    ap.add_argument("--accuracy-steps", type=int, default=100)
    ap.add_argument("--out-dir", type=Path, default=Path("prof"))
    args = ap.parse_args(argv)
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
            del state
    log(f"reference step {result['reference_step_ms_B1']:.1f} ms (B=1), {result['reference_step_ms_B20']:.1f} ms (B=20)")

    t = time.perf_counter()
    engine = FastEngine(model, device="cuda", max_batch=64)
    result["fast_startup_s"] = time.perf_counter() - t
    result["describe"] = engine.describe()
    batches = [int(b) for b in args.batches.split(",")]
    slots = engine.slots_for([f"P{i}" for i in range(max(batches))])
    result["step_ms"] = {}
    for B in batches:
        feats = torch.randn(B, 79, device="cuda")
        med, p99 = time_cuda(lambda: engine.step_slots(slots[:B], feats), iters=100)
        floor = (engine.weight_bytes + 2 * B * engine.state_bytes) / bw * 1e3
        result["step_ms"][B] = {"median": med, "p99": p99, "floor": floor}
        log(f"B={B}: {med:.3f} ms (p99 {p99:.3f}), floor {floor:.3f} ms")
    # eager per-tower times and top kernels of one eager step
    runner = engine.runner
    for B in (1, batches[-1]):
        feats = torch.randn(B, 79, device="cuda")
        up = torch.relu(runner.input_up(feats)).split(runner.proj, dim=1)
        for tower, chunk in zip(runner.towers, up):
            result[f"eager_tower_ms_B{B}_{tower.name}"] = time_cuda(
                lambda: tower(chunk, runner.table.tensors, slots[:B]), iters=10)[0]
        result[f"eager_step_ms_B{B}"] = time_cuda(lambda: runner(slots[:B], feats), iters=10)[0]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        feats = torch.randn(20, 79, device="cuda")
        runner(slots[:20], feats)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
    (args.out_dir / "top_kernels_B20.txt").write_text(table)
    # accuracy
    from client.engine.reference import ReferenceEngine
    ref = ReferenceEngine(model, device="cuda")
    syms = [f"A{i}" for i in range(args.accuracy_symbols)]
    errs, rng = [], np.random.default_rng(0)
    for _ in range(args.accuracy_steps):
        f = rng.standard_normal((len(syms), 79)).astype(np.float32)
        errs.append(np.abs(engine.step(syms, f) - ref.step(syms, f)))
    e = np.concatenate(errs)
    result["accuracy"] = {n: {"max_abs_err": float(e[:, i].max()), "within_1e-3": float((e[:, i] <= 1e-3).mean())}
                          for i, n in enumerate(TOWER_NAMES)}
    (args.out_dir / "profile.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    print(table[:6000])


if __name__ == "__main__":
    main()
