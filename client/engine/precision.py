"""The fast engine's precision, chosen by a spec such as `auto`, `bf16`, or `auto,hawk=bf16,xlstm.mlp=fp32`.

Grammar: an optional base (auto, fp16, bf16, fp32; also float16, bfloat16, float32), then comma-separated
overrides `<tower>=<dtype>` or `<tower>.mlp=<dtype>` applied in order (`<tower>.mlp` sets the tower's MLP
products apart from the rest of it; an override may also be `auto`, the measured default of that key). `auto` is
DEFAULT_PRECISION, the measured default (fp16 weights for xLSTM, Mamba2 and Hawk; fp32 for RetNet, whose
per-head RMSNorm of (q.k)v does not keep 1e-3 in 16 bits: README, "Precision"). Weights take the dtype; products
accumulate in fp32 and the state stays fp32 whatever the spec.

For the CLIs: add_precision_argument(parser) adds --precision, whose value is the parsed {key: dtype};
describe_precision(precision) is the one line to print.
"""
import argparse

import torch

from client.model.config import TOWER_NAMES

# fp16 keeps three more mantissa bits than bf16 at the same bandwidth. RetNet's per-head RMSNorm of
# (q.k)v is ill-conditioned when q.k is near zero, so its tower stays in fp32 (FACTS.md, "Precision").
# "<tower>.mlp" sets a tower's MLP products apart from the rest of the tower.
DEFAULT_PRECISION = {"xlstm": torch.float16, "mamba2": torch.float16, "retnet": torch.float32,
                     "hawk": torch.float16}

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
ALIASES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}
BASES = ("auto", *DTYPES)
KEYS = (*TOWER_NAMES, *(f"{tower}.mlp" for tower in TOWER_NAMES))
SHORT_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def _dtype_or_auto(text, what):
    name = ALIASES.get(text, text)
    if name == "auto" or name in DTYPES:
        return name
    raise ValueError(f"unknown precision {text!r} {what}; choose one of {', '.join(BASES)} "
                     f"(or float16, bfloat16, float32)")


def _default(key):
    tower = key.removesuffix(".mlp")
    return DEFAULT_PRECISION[tower]


def parse_precision(spec) -> dict:
    """A spec string (or None: auto) -> {tower or "<tower>.mlp": torch.dtype}, every tower present.
    Raises ValueError with one line naming the choices for an unknown name or key."""
    if spec is None:
        spec = "auto"
    if not isinstance(spec, str):
        raise ValueError(f"a precision spec is a string such as 'auto' or 'bf16,retnet=fp32', got {spec!r}")
    items = [item.strip() for item in spec.split(",")]
    if not all(items):
        raise ValueError(f"empty item in precision spec {spec!r}; write e.g. 'bf16,retnet=fp32'")
    base = "auto" if "=" in items[0] else _dtype_or_auto(items.pop(0).lower(), "as the base")
    precision = dict(DEFAULT_PRECISION) if base == "auto" else {tower: DTYPES[base] for tower in TOWER_NAMES}
    for item in items:
        key, sep, value = (part.strip() for part in item.partition("="))
        if not sep:
            raise ValueError(f"precision override {item!r} must read <tower>=<dtype> (the base comes first only)")
        key = key.lower()
        if key not in KEYS:
            raise ValueError(f"precision override {item!r} names no tower; towers are {', '.join(TOWER_NAMES)} "
                             f"(and <tower>.mlp for a tower's MLP)")
        name = _dtype_or_auto(value.lower(), f"for {key}")
        precision[key] = _default(key) if name == "auto" else DTYPES[name]
    return precision


def resolve_precision(precision) -> dict:
    """The engine's full precision from a spec string, None (auto) or a {key: dtype} dict of overrides of the
    default (what FastEngine and StepRunner take); a dict key naming no tower is a ValueError too."""
    if precision is None or isinstance(precision, str):
        return parse_precision(precision)
    unknown = [key for key in precision if key not in KEYS]
    if unknown:
        raise ValueError(f"precision keys {unknown} name no tower; towers are {', '.join(TOWER_NAMES)} "
                         f"(and <tower>.mlp for a tower's MLP)")
    bad = {key: value for key, value in precision.items() if value not in SHORT_NAMES}
    if bad:
        raise ValueError(f"precision values must be torch.float16, torch.bfloat16 or torch.float32, got {bad}")
    return {**DEFAULT_PRECISION, **precision}


def describe_precision(precision) -> str:
    """One line: what each tower got, e.g. 'xlstm fp16 (mlp fp32), mamba2 fp16, retnet fp32, hawk bf16', and
    '(auto: the measured default)' when it is DEFAULT_PRECISION."""
    precision = resolve_precision(precision)
    parts = []
    for tower in TOWER_NAMES:
        part = f"{tower} {SHORT_NAMES[precision[tower]]}"
        mlp = precision.get(f"{tower}.mlp")
        if mlp is not None and mlp != precision[tower]:
            part += f" (mlp {SHORT_NAMES[mlp]})"
        parts.append(part)
    auto = all(precision.get(key, precision[key.removesuffix(".mlp")]) == _default(key) for key in KEYS)
    return ", ".join(parts) + (" (auto: the measured default)" if auto else "")


def precision_argument(text) -> dict:
    """argparse type of --precision: the parsed spec, or argparse's one-line error."""
    try:
        return parse_precision(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_precision_argument(parser, default="auto"):
    """Add --precision to an argparse parser; args.precision is then a {key: dtype} dict for
    FastEngine(precision=...)."""
    parser.add_argument(
        "--precision", type=precision_argument, default=parse_precision(default), metavar="SPEC",
        help="fast engine weight precision: auto (the measured default: fp16, RetNet fp32), bf16, fp16 or fp32, "
             "then per-tower overrides, e.g. 'bf16,retnet=fp32' or 'auto,hawk=bf16,xlstm.mlp=fp32' "
             f"(towers: {', '.join(TOWER_NAMES)})")
