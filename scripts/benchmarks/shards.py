"""Section shards: symbols sharded over N GPUs (an engine process per GPU), for each N of --gpus."""
import time

from scripts.benchmarks.harness import MAX_BATCH
from scripts.benchmarks.serving import search_max_rate

SHARD_SYMBOLS = 128
SHARD_START_RATE = 2000  # req/s per GPU where the search starts (--rates at or above it)


def run(bench):
    """The highest rate over 128 symbols with p99 < 50 ms."""
    from client.engine.shard_process import process_shards
    from client.engine.sharded import ModelSpec, ShardedEngine

    results = {}
    for gpus in bench.gpu_counts():
        bench.close_engine()
        per_shard = -(-SHARD_SYMBOLS // gpus) + MAX_BATCH
        begin = time.perf_counter()
        shards = process_shards(ModelSpec(bench.args.preset, seed=bench.args.seed), bench.devices(gpus),
                                options={"capacity": per_shard, "host_symbols": 0, "precision": bench.args.precision},
                                progress=False)
        engine = ShardedEngine(shards, progress=False, transport="process")
        startup_s = time.perf_counter() - begin
        # one GPU passes 2,000 req/s and more over 128 symbols: start the search at 2,000 per GPU
        rates = [rate for rate in bench.counts.rates if rate >= SHARD_START_RATE * gpus] or bench.counts.rates
        try:
            best, runs = search_max_rate(engine, bench, num_symbols=SHARD_SYMBOLS, prefix=f"SH{gpus}_",
                                         key=f"shards_{gpus}_rate", rates=rates)
        finally:
            engine.close()
        results[str(gpus)] = {"max_rate_p99_50ms": best, "runs": runs, "startup_s": startup_s}
        bench.report.update(shards=results)
    return results


def summary(data) -> list[str]:
    return [f"{gpus} shard(s): max rate over {SHARD_SYMBOLS} symbols {row['max_rate_p99_50ms']} req/s"
            for gpus, row in data.get("shards", {}).items()]
