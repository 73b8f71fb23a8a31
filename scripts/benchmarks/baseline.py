"""Section baseline: the original client's path, fp32 at batch 1, one request at a time."""
import time

import numpy as np
import torch

from client.engine.precision import fp32_products
from client.model.config import NUM_FEATURES


@torch.no_grad()
def measure_baseline(model, device, counts, seed):
    """Median ms per request: each request stepped alone, its answer copied back to the host."""
    rng = np.random.default_rng(seed)
    requests = rng.standard_normal((counts.baseline_warmup + counts.baseline_iters, 1, NUM_FEATURES),
                                   dtype=np.float32)
    state = model.init_state(1, device=device)
    times_ms = []
    with fp32_products():
        for features in requests:
            begin = time.perf_counter()
            prediction, state = model(torch.from_numpy(features).to(device), state)
            prediction.cpu()
            times_ms.append((time.perf_counter() - begin) * 1000.0)
    return float(np.median(times_ms[counts.baseline_warmup:]))


def run(bench):
    per_request = measure_baseline(bench.model, bench.device, bench.counts, bench.args.seed)
    bench.report.update(baseline_per_request_ms=per_request)
    bench.progress(f"baseline: {per_request:.3f} ms per request")


def summary(data) -> list[str]:
    if "baseline_per_request_ms" not in data:
        return []
    return [f"baseline (fp32, one request at a time): {data['baseline_per_request_ms']:.3f} ms/request"]
