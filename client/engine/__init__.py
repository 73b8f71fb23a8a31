"""Engines chosen by --engine: `reference` (fp32, one batched step per micro-batch) and `fast`."""
from client.engine.base import Engine, check_step_inputs, is_count

ENGINES = ("reference", "fast")

__all__ = ["ENGINES", "Engine", "check_options", "check_step_inputs", "make_engine"]

# State table options both engines honour (client/engine/symbol_states.py, client/engine/fast/state_table.py).
TABLE_OPTIONS = ("capacity", "state_memory", "host_symbols", "idle_timeout_s")


def make_engine(name: str | None, model, device=None, *, precision=None, compile=False, gpus=1, split=None,
                spec=None, cluster=None, ray_address=None, shards=None, on_shard_loss=None, shard_timeout_s=None,
                max_rows_per_symbol=None, progress=True, **table_options) -> Engine:
    """table_options: the state table's capacity or state_memory, host_symbols and idle_timeout_s (both engines),
    and the fast engine's state_storage (a StateStorage: client/engine/precision.py); None means the engine's
    default. precision (a Precision, None for the default) and compile are the fast engine's; the reference engine
    is the fp32 model run eagerly, and refuses any other precision, compile or 16-bit state. gpus > 1 spreads the
    fast engine over that many GPUs: split "towers" (the default) in this process, "symbols" in a process per GPU
    that loads the model from `spec` (client.engine.sharded.ModelSpec). max_rows_per_symbol: requests of one symbol
    the fast engine's captured steps carry (more run as several steps); the reference engine steps any number. cluster
    "ray" shards the symbols over Ray actors instead (client/engine/shard_ray.py: ray_address, shards, device
    cuda/cpu or None for the cluster's choice, name None for fast on GPUs and reference on CPUs); on_shard_loss
    ("error" or "reset") is what a sharded engine does when a shard is lost, and shard_timeout_s how long a shard may
    answer no step before it is taken as hung (stopped and lost). `model` is not used by sharded
    engines (each shard loads its own); it may be a callable without arguments that loads it, called only by an engine
    that needs it (the fast engine holds the model only while it converts its weights, so that its state table is
    sized without it). No option is ignored: one that does not apply is refused in one line."""
    check_options(name, device, precision=precision, compile=compile, gpus=gpus, split=split, spec=spec,
                  cluster=cluster, ray_address=ray_address, shards=shards, on_shard_loss=on_shard_loss,
                  shard_timeout_s=shard_timeout_s, **table_options)
    options = {k: v for k, v in table_options.items() if v is not None}
    sharded = cluster == "ray" or (gpus > 1 and split == "symbols")
    losses = {"on_shard_loss": on_shard_loss or "error",
              **({} if shard_timeout_s is None else {"answer_timeout_s": shard_timeout_s})}
    if cluster == "ray":
        from client.engine.shard_ray import LOCAL, ray_shards
        from client.engine.sharded import ShardedEngine

        shard_options = _shard_options(name, precision, compile, {**options,
                                                                  "max_rows_per_symbol": max_rows_per_symbol})
        started = ray_shards(spec, ray_address or LOCAL, shards, device=device, engine=name, options=shard_options,
                             progress=progress)
        return ShardedEngine(started, progress=progress, transport="ray", **losses)
    if name == "reference":
        import torch

        from client.engine.reference import ReferenceEngine

        model = model if isinstance(model, torch.nn.Module) else model()  # the reference engine steps the model
        return ReferenceEngine(model, device=device, progress=progress,
                               **{k: v for k, v in options.items() if k in TABLE_OPTIONS})
    if name == "fast":
        try:
            from client.engine.fast import FastEngine
        except ImportError as exc:
            if exc.name is None or not exc.name.startswith("client.engine.fast"):
                raise
            raise ValueError("engine 'fast' is not available in this checkout (client/engine/fast is missing); "
                             "use --engine reference") from exc
        if max_rows_per_symbol is not None:
            options["max_rows_per_symbol"] = max_rows_per_symbol
        if sharded:
            from client.engine.shard_process import process_shards
            from client.engine.sharded import ShardedEngine

            started = process_shards(spec, [f"cuda:{i}" for i in range(gpus)], engine="fast", progress=progress,
                                     options=_shard_options(name, precision, compile, options))
            return ShardedEngine(started, progress=progress, transport="process", **losses)
        from client.engine.precision import DEFAULT_PRECISION

        devices = [f"cuda:{i}" for i in range(gpus)] if gpus > 1 else None
        return FastEngine(model, device=device, devices=devices, compile=compile, progress=progress,
                          precision=DEFAULT_PRECISION if precision is None else precision, **options)
    raise ValueError(f"unknown engine {name!r}; choose one of {', '.join(ENGINES)}")


def check_options(name: str | None, device=None, *, precision=None, compile=False, gpus=1, split=None, spec=None,
                  cluster=None, ray_address=None, shards=None, on_shard_loss=None, shard_timeout_s=None,
                  **table_options) -> None:
    """make_engine's refusals of options that do not apply, which need no model: a command that loads the model
    (minutes for the full preset) and computes targets before it makes the engine says them first."""
    options = {k: v for k, v in table_options.items() if v is not None}
    sharded = cluster == "ray" or (gpus > 1 and split == "symbols")
    if cluster not in (None, "ray"):
        raise ValueError(f"--cluster {cluster!r}: the one cluster supported is ray")
    if cluster is None and (ray_address is not None or shards is not None):
        raise ValueError("--ray-address and --shards apply with --cluster ray")
    if on_shard_loss is not None and not sharded:
        raise ValueError("--on-shard-loss applies to sharded engines: --cluster ray, or --gpus N --split symbols")
    if shard_timeout_s is not None and not sharded:
        raise ValueError("--shard-timeout-s applies to sharded engines: --cluster ray, or --gpus N --split symbols")
    if sharded:
        from client.engine.sharded import ANSWER_TIMEOUT_S, check_loss_options

        check_loss_options(on_shard_loss or "error", ANSWER_TIMEOUT_S if shard_timeout_s is None else shard_timeout_s)
    if sharded and spec is None:
        raise ValueError("a sharded engine needs the model's spec (preset and weights) for its shards")
    if not is_count(gpus, 1):
        raise ValueError(f"--gpus must be a whole number of at least 1, got {gpus!r}")
    if shards is not None and not is_count(shards, 1):  # 0 read as "every GPU"; < 0 started Ray, then no shard
        raise ValueError(f"--shards must be a whole number of at least 1, got {shards!r}")
    if split is not None and gpus == 1:
        raise ValueError(f"--split {split} applies with --gpus 2 or more")
    if name == "reference":
        _check_reference_options(precision, compile, options)
    if cluster == "ray" and gpus > 1:
        raise ValueError("--gpus is for one machine; with --cluster ray, --shards N shards the symbols over N "
                         "GPUs of the cluster")
    if cluster is None and gpus > 1 and (name != "fast" or str(device or "cuda").startswith("cpu")):
        raise ValueError("--gpus applies to the fast engine on CUDA GPUs")


def _check_reference_options(precision, compile, options) -> None:
    """Refuse, in one line, what the reference engine (the fp32 model run eagerly) cannot honour."""
    from client.engine.precision import DEFAULT_PRECISION, FP32_PRECISION, FP32_STATE

    if compile:
        raise ValueError("--compile applies to the fast engine; the reference engine runs the fp32 model eagerly")
    if precision is not None and precision not in (DEFAULT_PRECISION, FP32_PRECISION):
        raise ValueError(f"--precision {precision.describe()} applies to the fast engine; the reference engine is "
                         f"the fp32 model")
    storage = options.get("state_storage", FP32_STATE)
    if storage.sixteen_bit:
        raise ValueError(f"--state-dtype {storage.spec} applies to the fast engine; the reference engine keeps fp32 "
                         f"state")
    unknown = sorted(set(options) - set(TABLE_OPTIONS) - {"state_storage"})
    if unknown:
        raise TypeError(f"make_engine got options no engine takes: {', '.join(unknown)}")


def _shard_options(name, precision, compile, options) -> dict:
    """make_engine's options for each shard's own engine: the fast engine's when it is fast (or not yet chosen), the
    state table's for the reference engine."""
    if name == "reference":
        return {"precision": precision, "compile": compile,
                **{k: v for k, v in options.items() if k in TABLE_OPTIONS and v is not None}}
    return {"precision": precision, "compile": compile, **{k: v for k, v in options.items() if v is not None}}
