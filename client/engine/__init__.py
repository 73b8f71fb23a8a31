"""Engines chosen by --engine: `reference` (fp32, one batched step per micro-batch) and `fast`."""
from client.engine.base import Engine, check_step_inputs

ENGINES = ("reference", "fast")

__all__ = ["ENGINES", "Engine", "check_step_inputs", "make_engine"]


def make_engine(name: str, model, device=None, *, precision=None, compile=False, gpus=1, split="towers",
                spec=None, max_rows_per_symbol=None, **fast_options) -> Engine:
    """precision (a spec or {tower: dtype}: client/engine/precision.py), compile and fast_options (FastEngine's:
    capacity, state_memory, host_symbols, idle_timeout_s, state_dtype, state_rounding) are the fast engine's; the
    reference engine is the fp32 model run eagerly, and refuses any other precision or compile. gpus > 1 spreads
    the fast engine over that many GPUs: split "towers" in this process, "symbols" in a process per GPU that loads
    the model from `spec` (client.engine.sharded.ModelSpec). max_rows_per_symbol: requests of one symbol the fast
    engine's captured steps carry (more run as several steps); the reference engine steps any number."""
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
        options = {k: v for k, v in {**fast_options, "max_rows_per_symbol": max_rows_per_symbol}.items()
                   if v is not None}
        if gpus > 1 and split == "symbols":
            from client.engine.sharded import ShardedEngine
            if spec is None:
                raise ValueError("--split symbols needs the model's spec (preset and weights) for its processes")
            return ShardedEngine(spec, [f"cuda:{i}" for i in range(gpus)], precision=precision, compile=compile,
                                 **options)
        devices = [f"cuda:{i}" for i in range(gpus)] if gpus > 1 else None
        return FastEngine(model, device=device, devices=devices, precision=precision, compile=compile, **options)
    raise ValueError(f"unknown engine {name!r}; choose one of {', '.join(ENGINES)}")
