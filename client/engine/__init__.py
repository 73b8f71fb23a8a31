"""Engines chosen by --engine: `reference` (fp32, one batched step per micro-batch) and `fast`."""
from client.engine.base import Engine, check_step_inputs

ENGINES = ("reference", "fast")

__all__ = ["ENGINES", "Engine", "check_step_inputs", "make_engine"]


def make_engine(name: str, model, device=None, *, precision=None, compile=False) -> Engine:
    """precision (a spec or {tower: dtype}: client/engine/precision.py) and compile are the fast engine's; the
    reference engine is the fp32 model run eagerly, and refuses any other precision or compile."""
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
        return FastEngine(model, device=device, precision=precision, compile=compile)
    raise ValueError(f"unknown engine {name!r}; choose one of {', '.join(ENGINES)}")
