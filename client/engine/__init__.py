"""Engines chosen by --engine: `reference` (fp32, one batched step per micro-batch) and `fast`."""
from client.engine.base import Engine, check_step_inputs

ENGINES = ("reference", "fast")

__all__ = ["ENGINES", "Engine", "check_step_inputs", "make_engine"]


def make_engine(name: str, model, device=None) -> Engine:
    if name == "reference":
        from client.engine.reference import ReferenceEngine
        return ReferenceEngine(model, device=device)
    if name == "fast":
        try:
            from client.engine.fast import FastEngine
        except ImportError as exc:
            if exc.name is None or not exc.name.startswith("client.engine.fast"):
                raise
            raise ValueError("engine 'fast' is not available in this checkout (client/engine/fast is missing); "
                             "use --engine reference") from exc
        return FastEngine(model, device=device)
    raise ValueError(f"unknown engine {name!r}; choose one of {', '.join(ENGINES)}")
