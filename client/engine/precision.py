"""The fast engine's precision, chosen by a spec such as `auto`, `bf16`, or `auto,hawk=bf16,xlstm.mlp=fp32`.

Grammar: an optional base (auto, fp16, bf16, fp32; also float16, bfloat16, float32), then comma-separated
overrides `<tower>=<dtype>` or `<tower>.<part>=<dtype>` applied in order (a part is one weight group of a tower,
TOWER_PARTS; an override may also be `auto`, the measured default of that key). A base or a tower override sets
every part of the tower(s) it names. `auto` is DEFAULT_PRECISION, the measured default. Weights take the dtype;
products accumulate in fp32 and the activation feeding a product is rounded to its weight's dtype.

For the CLIs: add_precision_argument(parser) adds --precision, whose value is the parsed {key: dtype};
describe_precision(precision) is the one line to print.
"""
import argparse
import contextlib

import torch

from client.model.config import TOWER_NAMES

# The weight groups a precision override may name ("<tower>.<part>"); the fast engine's blocks (layers.py) take
# their dtypes by these names.
TOWER_PARTS = {
    "xlstm": ("input_down", "mlp", "slstm", "mlstm_x", "mlstm_gate", "mlstm_qkv", "mlstm_down"),
    "mamba2": ("input_down", "mlp", "in_proj", "out_proj"),
    "retnet": ("input_down", "mlp", "qkvg", "out_proj"),
    "hawk": ("input_down", "mlp", "gate_rec", "rglru_gates", "out_proj"),
}
# fp16 keeps three more mantissa bits than bf16 at the same bandwidth. RetNet's per-head RMSNorm of (q.k)v is
# ill-conditioned when q.k is near zero, so its tower stays in fp32 (FACTS.md, "Precision"). input_down carries
# the features' scale straight to the prediction (the residual stream has no norm before output_proj): with
# features 100x unit scale, fp16 weights there put Mamba2 and Hawk outside 1e-3 (bench/LOG.md section 29), so it
# stays fp32, for 1.5% of the step. Some mLSTM heads settle near zero on small or stuck features, and their
# GroupNorm scales them back up, with any error upstream: their q, k, v (x_proj and the tiny q/k/v blocks) stay
# fp32, for ~3% of the step (bench/LOG.md section 34).
DEFAULT_PRECISION = {"xlstm": torch.float16, "mamba2": torch.float16, "retnet": torch.float32,
                     "hawk": torch.float16, "xlstm.input_down": torch.float32, "xlstm.mlstm_x": torch.float32,
                     "xlstm.mlstm_qkv": torch.float32, "mamba2.input_down": torch.float32,
                     "hawk.input_down": torch.float32}

# Parts stacked in one product (layers.Linear): one dtype, or the first fp32 and the second fp16.
STACKED_PARTS = (("xlstm.mlstm_x", "xlstm.mlstm_gate"),)

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
ALIASES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}
BASES = ("auto", *DTYPES)
SHORT_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def _known_keys():
    return ", ".join(f"{tower} (parts {', '.join(parts)})" for tower, parts in TOWER_PARTS.items())


def _dtype_or_auto(text, what):
    name = ALIASES.get(text, text)
    if name == "auto" or name in DTYPES:
        return name
    raise ValueError(f"unknown precision {text!r} {what}; choose one of {', '.join(BASES)} "
                     f"(or float16, bfloat16, float32)")


def check_key(key):
    tower, _, part = key.partition(".")
    if tower not in TOWER_PARTS or (part and part not in TOWER_PARTS[tower]):
        raise ValueError(f"precision override {key!r} names no tower or part; towers: {_known_keys()}")


def _set(precision, key, dtype):
    """precision[key] = dtype; a tower's own dtype replaces its parts' (unless they are set after)."""
    if "." not in key:
        for part in [k for k in precision if k.startswith(key + ".")]:
            del precision[part]
    precision[key] = dtype


def _dtype_of(precision, key):
    return precision.get(key, precision[key.split(".")[0]])


def check_stacked(precision):
    for first, second in STACKED_PARTS:
        pair = (_dtype_of(precision, first), _dtype_of(precision, second))
        if pair[0] != pair[1] and pair != (torch.float32, torch.float16):
            raise ValueError(f"{first} and {second} share one product: give them one dtype, or fp32 then fp16 "
                             f"(got {SHORT_NAMES[pair[0]]} and {SHORT_NAMES[pair[1]]})")
    return precision


def parse_precision(spec) -> dict:
    """A spec string (or None: auto) -> {tower or "<tower>.<part>": torch.dtype}, every tower present.
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
        check_key(key)
        name = _dtype_or_auto(value.lower(), f"for {key}")
        if name != "auto":
            _set(precision, key, DTYPES[name])
        elif "." in key:
            _set(precision, key, _dtype_of(DEFAULT_PRECISION, key))
        else:
            _set(precision, key, DEFAULT_PRECISION[key])
            precision.update({k: v for k, v in DEFAULT_PRECISION.items() if k.startswith(key + ".")})
    return check_stacked(precision)


def resolve_precision(precision=None) -> dict:
    """The engine's full precision from a spec string, None (auto) or a {key: dtype} dict of overrides of the
    default (a tower given a dtype drops the default of its parts, unless they are given too)."""
    if precision is None or isinstance(precision, str):
        return parse_precision(precision)
    for key in precision:
        check_key(key)
    bad = {key: value for key, value in precision.items() if value not in SHORT_NAMES}
    if bad:
        raise ValueError(f"precision values must be torch.float16, torch.bfloat16 or torch.float32, got {bad}")
    resolved = dict(DEFAULT_PRECISION)
    for key in sorted(precision, key=lambda k: "." in k):  # towers first, then their parts
        _set(resolved, key, precision[key])
    return check_stacked(resolved)


def describe_precision(precision) -> str:
    """One line: what each tower got, e.g. 'xlstm fp16 (input_down fp32), mamba2 fp16, retnet fp32, hawk bf16',
    and '(auto: the measured default)' when it is DEFAULT_PRECISION."""
    precision = resolve_precision(precision)
    parts = []
    for tower in TOWER_NAMES:
        part = f"{tower} {SHORT_NAMES[precision[tower]]}"
        others = [f"{key.split('.')[1]} {SHORT_NAMES[dtype]}" for key, dtype in precision.items()
                  if key.startswith(tower + ".") and dtype != precision[tower]]
        parts.append(part + (f" ({', '.join(others)})" if others else ""))
    auto = precision == resolve_precision(None)
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
        help="fast engine weight precision: auto (the measured default: fp16; RetNet, input_down and the mLSTM's "
             "q/k/v inputs fp32), bf16, "
             "fp16 or fp32, then overrides per tower or part, e.g. 'bf16,retnet=fp32' or "
             f"'auto,hawk=bf16,xlstm.mlp=fp32' (towers and parts: {_known_keys()})")


# Towers with a matrix state (mLSTM C, Mamba2 h, RetNet S) that may be stored in 16 bits. A 16-bit state spec
# applies to xLSTM and Mamba2; RetNet's S stays fp32 unless named: its per-head RMSNorm of q.S is ill-conditioned,
# and in 16 bits it fails the accuracy suite on near-stuck feeds (bench/LOG.md section 30).
STATE_TOWERS = ("xlstm", "mamba2", "retnet")
STATE16_TOWERS = ("xlstm", "mamba2")


def parse_state_dtype(spec) -> dict:
    """A state spec ("fp32", "fp16", "bf16", then overrides such as "fp16,retnet=fp16") -> {tower: dtype} for the
    towers with a matrix state. ValueError in one line for an unknown name."""
    spec = spec or "fp32"
    items = [item.strip().lower() for item in spec.split(",")]
    base = ALIASES.get(items[0], items[0])
    if base not in DTYPES or "=" in items[0]:
        raise ValueError(f"unknown state dtype {items[0]!r}; choose one of {', '.join(DTYPES)}, then overrides "
                         f"such as retnet=fp16")
    dtypes = {tower: DTYPES[base] if tower in STATE16_TOWERS else torch.float32 for tower in STATE_TOWERS}
    for item in items[1:]:
        tower, sep, value = (part.strip() for part in item.partition("="))
        value = ALIASES.get(value, value)
        if not sep or tower not in STATE_TOWERS or value not in DTYPES:
            raise ValueError(f"state dtype override {item!r} must read <tower>=<dtype> with a tower of "
                             f"{', '.join(STATE_TOWERS)} and a dtype of {', '.join(DTYPES)}")
        dtypes[tower] = DTYPES[value]
    return dtypes


def describe_state_dtype(dtypes) -> str:
    return ", ".join(f"{tower} {SHORT_NAMES[dtype]}" for tower, dtype in dtypes.items())


@contextlib.contextmanager
def fp32_products():
    """fp32 products stay fp32 while this is open: no TF32, no reduced-precision fp16 reductions in cuBLAS. The
    engine's fp32 parts (RetNet, input_down, the mLSTM's q/k/v inputs) and the reference need it; CUDA graphs keep
    the kernels chosen at capture. The process's own settings come back after, whatever they were."""
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    saved = matmul.allow_tf32, cudnn.allow_tf32, matmul.allow_fp16_reduced_precision_reduction
    matmul.allow_tf32 = cudnn.allow_tf32 = matmul.allow_fp16_reduced_precision_reduction = False
    try:
        yield
    finally:
        matmul.allow_tf32, cudnn.allow_tf32, matmul.allow_fp16_reduced_precision_reduction = saved
