"""Section shards: symbols sharded over N GPUs (an engine process per GPU) for each N of --gpus, or over the Ray
actors of a cluster (--cluster ray)."""
import time

from scripts.benchmarks.harness import MAX_BATCH
from scripts.benchmarks.report import rate_text
from scripts.benchmarks.serving import search_max_rate

SHARD_SYMBOLS = 128
SHARD_START_RATE = 2000  # req/s per GPU where the search starts (--rates at or above it)


def run(bench):
    """The highest rate over 128 symbols with p99 < 50 ms: for each N of --gpus, a process per GPU here; with
    --cluster ray, the cluster's --shards Ray actors (default every GPU, or one per node without GPUs)."""
    from client.engine.sharded import ModelSpec, ShardedEngine

    args = bench.args
    results = {}
    for count in [args.shards] if args.cluster == "ray" else bench.gpu_counts():
        bench.close_engine()
        begin = time.perf_counter()
        shards = start_shards(bench, ModelSpec(args.preset, seed=args.seed), count)
        engine = ShardedEngine(shards, on_shard_loss=args.on_shard_loss or "error", progress=False,
                               transport=args.cluster or "process",
                               **({} if args.shard_timeout_s is None else {"answer_timeout_s": args.shard_timeout_s}))
        startup_s = time.perf_counter() - begin
        count = len(shards)
        # one GPU passes 2,000 req/s and more over 128 symbols: start the search at 2,000 per GPU
        rates = [rate for rate in bench.counts.rates if rate >= SHARD_START_RATE * count] or bench.counts.rates
        try:
            best, runs = search_max_rate(engine, bench, num_symbols=SHARD_SYMBOLS, prefix=f"SH{count}_",
                                         key=f"shards_{count}_rate", rates=rates)
        finally:
            engine.close()
        results[str(count)] = {"max_rate_p99_50ms": best, "runs": runs, "startup_s": startup_s,
                               "transport": engine.transport, "where": [shard.where for shard in shards],
                               "losses": [loss["line"] for loss in engine.losses]}
        bench.report.update(shards=results)
    return results


def start_shards(bench, spec, count):
    """count shards, each with room for its part of the symbols and a batch (None: the cluster's default)."""
    per_shard = -(-SHARD_SYMBOLS // (count or 1)) + MAX_BATCH
    options = {"capacity": per_shard, "host_symbols": 0, "precision": bench.args.precision}
    if bench.args.cluster == "ray":
        from client.engine.shard_ray import LOCAL, ray_shards

        return ray_shards(spec, bench.args.ray_address or LOCAL, count, device=bench.device.type, engine="fast",
                          options=options, progress=False)
    from client.engine.shard_process import process_shards

    return process_shards(spec, bench.devices(count), options=options, progress=False)


def summary(data) -> list[str]:
    return [f"{gpus} shard(s): max rate over {SHARD_SYMBOLS} symbols {rate_text(row['max_rate_p99_50ms'])}"
            for gpus, row in data.get("shards", {}).items()]
