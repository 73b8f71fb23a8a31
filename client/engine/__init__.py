"""Engines chosen by --engine: `reference` (fp32, one batched step per micro-batch) and `fast`."""
from client.engine.base import Engine, check_step_inputs

ENGINES = ("reference", "fast")

__all__ = ["ENGINES", "Engine", "check_step_inputs", "make_engine"]


def make_engine(name: str | None, model, device=None, *, precision=None, compile=False, gpus=1, split="towers",
                spec=None, cluster=None, ray_address=None, shards=None, on_shard_loss=None,
                max_rows_per_symbol=None, progress=True, **fast_options) -> Engine:
    """precision (a spec or {tower: dtype}: client/engine/precision.py), compile and fast_options (FastEngine's:
    capacity, state_memory, host_symbols, idle_timeout_s, state_dtype, state_rounding) are the fast engine's; the
    reference engine is the fp32 model run eagerly, and refuses any other precision or compile. gpus > 1 spreads
    the fast engine over that many GPUs: split "towers" in this process, "symbols" in a process per GPU that loads
    the model from `spec` (client.engine.sharded.ModelSpec). max_rows_per_symbol: requests of one symbol the fast
    engine's captured steps carry (more run as several steps); the reference engine steps any number. cluster
    "ray" shards the symbols over Ray actors instead (client/engine/shard_ray.py: ray_address, shards, device
    cuda/cpu or None for the cluster's choice, name None for fast on GPUs and reference on CPUs); on_shard_loss
    ("error" or "reset") is what a sharded engine does when a shard is lost. `model` is not used by sharded
    engines (each shard loads its own)."""
    fast_options = {**fast_options, "max_rows_per_symbol": max_rows_per_symbol}
    sharded = cluster == "ray" or (gpus > 1 and split == "symbols")
    if cluster not in (None, "ray"):
        raise ValueError(f"--cluster {cluster!r}: the one cluster supported is ray")
    if cluster is None and (ray_address is not None or shards is not None):
        raise ValueError("--ray-address and --shards apply with --cluster ray")
    if on_shard_loss is not None and not sharded:
        raise ValueError("--on-shard-loss applies to sharded engines: --cluster ray, or --gpus N --split symbols")
    if sharded and spec is None:
        raise ValueError("a sharded engine needs the model's spec (preset and weights) for its shards")
    if cluster == "ray":
        if gpus > 1:
            raise ValueError("--gpus is for one machine; with --cluster ray, --shards N shards the symbols over N "
                             "GPUs of the cluster")
        from client.engine.shard_ray import LOCAL, ray_shards
        from client.engine.sharded import ShardedEngine

        options = _shard_options(name, precision, compile, fast_options)
        started = ray_shards(spec, ray_address or LOCAL, shards, device=device, engine=name, options=options,
                             progress=progress)
        return ShardedEngine(started, on_shard_loss=on_shard_loss or "error", progress=progress, transport="ray")
    if gpus > 1 and (name != "fast" or str(device or "cuda").startswith("cpu")):
        raise ValueError("--gpus applies to the fast engine on CUDA GPUs")
    if name == "reference":
        from client.engine.precision import DEFAULT_PRECISION, describe_precision, parse_precision, resolve_precision
        from client.engine.reference import ReferenceEngine
        if compile:
            raise ValueError("--compile applies to the fast engine; the reference engine runs the fp32 model eagerly")
        if precision is not None and resolve_precision(precision) not in (DEFAULT_PRECISION, parse_precision("fp32")):
            raise ValueError(f"--precision {describe_precision(precision)} applies to the fast engine; the reference "
                             f"engine is the fp32 model")
        return ReferenceEngine(model, device=device)
    if name == "fast":
        try:
            from client.engine.fast import FastEngine
        except ImportError as exc:
            if exc.name is None or not exc.name.startswith("client.engine.fast"):
                raise
            raise ValueError("engine 'fast' is not available in this checkout (client/engine/fast is missing); "
                             "use --engine reference") from exc
        options = {k: v for k, v in fast_options.items() if v is not None}
        if sharded:
            from client.engine.shard_process import process_shards
            from client.engine.sharded import ShardedEngine

            started = process_shards(spec, [f"cuda:{i}" for i in range(gpus)], engine="fast", progress=progress,
                                     options=_shard_options(name, precision, compile, fast_options))
            return ShardedEngine(started, on_shard_loss=on_shard_loss or "error", progress=progress,
                                 transport="process")
        devices = [f"cuda:{i}" for i in range(gpus)] if gpus > 1 else None
        return FastEngine(model, device=device, devices=devices, precision=precision, compile=compile,
                          progress=progress, **options)
    raise ValueError(f"unknown engine {name!r}; choose one of {', '.join(ENGINES)}")


def _shard_options(name, precision, compile, fast_options) -> dict:
    """make_engine's options for each shard's own engine: the fast engine's when it is fast (or not yet chosen)."""
    if name == "reference":
        return {"precision": precision, "compile": compile}
    return {"precision": precision, "compile": compile, **{k: v for k, v in fast_options.items() if v is not None}}
