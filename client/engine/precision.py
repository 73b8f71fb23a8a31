"""The fast engine's number formats, each parsed once where it enters (a command-line option, a script's argument)
into a value that the engine, the placement and the benchmarks take as it is:

- Precision, the weights' dtypes: a spec such as `auto`, `bf16`, or `auto,hawk=bf16,xlstm.mlp=fp32`. Grammar: an
  optional base (auto, fp16, bf16, fp32; also float16, bfloat16, float32), then comma-separated overrides
  `<tower>=<dtype>` or `<tower>.<group>=<dtype>` applied in order (a group is one weight group of a tower,
  WEIGHT_GROUPS; an override may also be `auto`, the measured default of that key). A base or a tower override
  sets every group of the tower(s) it names. `auto` is DEFAULT_PRECISION, the measured default. Weights take the
  dtype; products accumulate in fp32 and the activation feeding a product is rounded to its weight's dtype.
  A tower's input path (input_up, ReLU, input_down) may also be `fp64` (`<tower>.input_down=fp64`): computed in
  float64 from the fp32 weights and features, and rounded to fp32 once, at the residual.
- StateStorage, the matrix states' dtypes and how 16-bit ones are rounded: `fp32`, `fp16`, `bf16`, then overrides
  such as `retnet=fp16`, optionally ending in `:nearest` or `:stochastic` (the default).

For the CLIs: add_precision_argument(parser) adds --precision, state_storage_argument parses --state-dtype;
describe() of either is the one line to print.
"""
import contextlib
import threading
from dataclasses import dataclass, field, replace

import torch

from client import cli
from client.constants import TOWER_NAMES

# The weight groups of each tower, in one table: the names a precision override takes ("<tower>.<group>"), the names
# the fast engine's blocks ask their dtypes by (layers.py, through Precision.dtype_of), and where each group lies in
# a tower's state dict (what placement.py counts the bytes of), in the order they are matched (a key lies in the first
# group that names a part of it: slstm_in before slstm).
WEIGHT_GROUPS = {
    "xlstm": {"input_down": (".input_down.",), "mlp": (".mlp.",),
              "slstm_in": tuple(f".layer.slstm.{g}gate_input." for g in "ifzo"), "slstm": (".layer.slstm.",),
              "mlstm_x": (".mlstm.x_proj.",), "mlstm_gate": (".mlstm.gate_proj.",),
              "mlstm_qkv": (".mlstm.q_proj.", ".mlstm.k_proj.", ".mlstm.v_proj."),
              "mlstm_down": (".mlstm.proj_down.",)},
    "mamba2": {"input_down": (".input_down.",), "mlp": (".mlp.",),
               "in_proj": (".input_proj.", ".b_proj.", ".c_proj.", ".z_proj."), "out_proj": (".layer.out_proj.",)},
    "retnet": {"input_down": (".input_down.",), "mlp": (".mlp.",),
               "qkvg": (".q_proj.", ".k_proj.", ".v_proj.", ".g_proj."), "out_proj": (".layer.out_proj.",)},
    "hawk": {"input_down": (".input_down.",), "mlp": (".mlp.",), "gate_rec": (".gate_proj.", ".recurrent_proj."),
             "rglru_gates": (".rglru.input_gate.", ".rglru.recurrence_gate."), "out_proj": (".layer.out_proj.",)},
}

# fp16 keeps three more mantissa bits than bf16 at the same bandwidth. RetNet's per-head RMSNorm of (q.k)v is
# ill-conditioned when q.k is near zero, so its tower stays in fp32 (docs/facts.md, "Precision"). input_down carries
# the features' scale straight to the prediction (the residual stream has no norm before output_proj): with
# features 100x unit scale, fp16 weights there put Mamba2 and Hawk outside 1e-3 (bench/LOG.md section 29), so it
# stays fp32, for 1.5% of the step. Some mLSTM heads settle near zero on small or stuck features, and their
# GroupNorm scales them back up, with any error upstream: their q, k, v (x_proj and the tiny q/k/v blocks) stay
# fp32, for ~3% of the step (bench/LOG.md section 34). The sLSTM's four input maps in fp16 were the rest of xLSTM's
# error at scale 1e-2 (99.90%, on the gate), its state maps none of it: the input maps stay fp32, split into fp16
# halves inside slstm_step, for 0.1 GB more a step (bench/LOG.md sections 34, 38 and 42). RetNet's prediction
# carries the largest share of a feed's scale (its tower gain is the largest): on a feed of prices and volumes its
# residual reaches ~4e3, where the fp32 rounding of input_down's 4,096-term sums alone is ~1e-4 of the prediction, so
# its input path runs in fp64 (bench/LOG.md section 47).
_AUTO = {"xlstm": torch.float16, "mamba2": torch.float16, "retnet": torch.float32, "hawk": torch.float16,
         "retnet.input_down": torch.float64, "xlstm.input_down": torch.float32, "xlstm.slstm_in": torch.float32,
         "xlstm.mlstm_x": torch.float32, "xlstm.mlstm_qkv": torch.float32, "mamba2.input_down": torch.float32,
         "hawk.input_down": torch.float32}

# Groups stacked in one weight (layers.Linear's product, slstm_step's eight maps): one dtype, or the first fp32 and
# the second fp16.
STACKED_GROUPS = (("xlstm.slstm_in", "xlstm.slstm"), ("xlstm.mlstm_x", "xlstm.mlstm_gate"))

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
ALIASES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float64": "fp64"}
BASES = ("auto", *DTYPES)
# The input path alone may be computed in fp64 (the weights stay fp32 in the checkpoint; the runner keeps fp64 copies)
INPUT_GROUP, INPUT_DTYPES = "input_down", {**DTYPES, "fp64": torch.float64}
SHORT_NAMES = {dtype: name for name, dtype in INPUT_DTYPES.items()}


def _known_keys():
    return ", ".join(f"{tower} (parts {', '.join(groups)})" for tower, groups in WEIGHT_GROUPS.items())


def _dtype_or_auto(text, what, key=None):
    name = ALIASES.get(text, text)
    if name == "auto" or name in DTYPES or (name == "fp64" and key is not None and key.endswith("." + INPUT_GROUP)):
        return name
    if name == "fp64":
        raise ValueError(f"fp64 {what} is not offered: only a tower's input path takes it "
                         f"('<tower>.{INPUT_GROUP}=fp64')")
    raise ValueError(f"unknown precision {text!r} {what}; choose one of {', '.join(BASES)} "
                     f"(or float16, bfloat16, float32; fp64 for '<tower>.{INPUT_GROUP}')")


def _check_key(key):
    tower, dot, group = key.partition(".")
    # "hawk.=fp32" names no part: it set a key no weight reads, and the override was dropped unsaid
    if tower not in WEIGHT_GROUPS or (dot and group not in WEIGHT_GROUPS[tower]):
        raise ValueError(f"precision override {key!r} names no tower or part; towers: {_known_keys()}")


def _set(dtypes, key, dtype):
    """dtypes[key] = dtype; a tower's own dtype replaces its groups' (unless they are set after)."""
    if "." not in key:
        for group in [k for k in dtypes if k.startswith(key + ".")]:
            del dtypes[group]
    dtypes[key] = dtype


def _dtype_in(dtypes, key):
    return dtypes.get(key, dtypes[key.split(".")[0]])


@dataclass(frozen=True)
class Precision:
    """The weights' dtypes: every tower's, and each weight group's that differs from its tower's. Equal by what each
    group gets, whatever the spec that said it; `spec` is that text, for names and reports."""
    dtypes: tuple  # ((tower or "<tower>.<group>", torch.dtype), ...): the towers, then the groups set apart
    spec: str = field(default="auto", compare=False)

    @classmethod
    def parse(cls, spec="auto") -> "Precision":
        """A spec string (None: auto). ValueError with one line naming the choices for an unknown name or key."""
        if spec is None:
            spec = "auto"
        if not isinstance(spec, str):
            raise ValueError(f"a precision spec is a string such as 'auto' or 'bf16,retnet=fp32', got {spec!r}")
        items = [item.strip() for item in spec.split(",")]
        if not all(items):
            raise ValueError(f"empty item in precision spec {spec!r}; write e.g. 'bf16,retnet=fp32'")
        base = "auto" if "=" in items[0] else _dtype_or_auto(items.pop(0).lower(), "as the base")
        dtypes = dict(_AUTO) if base == "auto" else {tower: DTYPES[base] for tower in TOWER_NAMES}
        for item in items:
            key, sep, value = (part.strip() for part in item.partition("="))
            if not sep:
                raise ValueError(f"precision override {item!r} must read <tower>=<dtype> (the base comes first only)")
            key = key.lower()
            _check_key(key)
            name = _dtype_or_auto(value.lower(), f"for {key}", key)
            if name != "auto":
                _set(dtypes, key, INPUT_DTYPES[name])
            elif "." in key:
                _set(dtypes, key, _dtype_in(_AUTO, key))
            else:
                _set(dtypes, key, _AUTO[key])
                dtypes.update({k: v for k, v in _AUTO.items() if k.startswith(key + ".")})
        for first, second in STACKED_GROUPS:
            pair = (_dtype_in(dtypes, first), _dtype_in(dtypes, second))
            if pair[0] != pair[1] and pair != (torch.float32, torch.float16):
                raise ValueError(f"{first} and {second} share one product: give them one dtype, or fp32 then fp16 "
                                 f"(got {SHORT_NAMES[pair[0]]} and {SHORT_NAMES[pair[1]]})")
        towers = [(tower, dtypes[tower]) for tower in TOWER_NAMES]
        groups = [(f"{tower}.{group}", dtypes[f"{tower}.{group}"]) for tower in TOWER_NAMES
                  for group in WEIGHT_GROUPS[tower] if dtypes.get(f"{tower}.{group}", dtypes[tower]) != dtypes[tower]]
        return cls(tuple(towers + groups), spec.strip())

    def as_dict(self) -> dict:
        """{tower or "<tower>.<group>": dtype}: every tower, and the groups that differ from their tower."""
        return dict(self.dtypes)

    def dtype_of(self, tower, group=None) -> torch.dtype:
        """The dtype of a tower's weight group (of WEIGHT_GROUPS; None: the tower's own)."""
        if group is not None and group not in WEIGHT_GROUPS[tower]:
            raise KeyError(f"{tower} has no weight group {group!r} in client.engine.precision.WEIGHT_GROUPS")
        dtypes = self.as_dict()
        return dtypes.get(f"{tower}.{group}", dtypes[tower])

    def describe(self) -> str:
        """One line: what each tower got, e.g. 'xlstm fp16 (input_down fp32), mamba2 fp16, retnet fp32, hawk bf16',
        and '(auto: the measured default)' when it is DEFAULT_PRECISION."""
        dtypes, parts = self.as_dict(), []
        for tower in TOWER_NAMES:
            groups = [f"{key.split('.')[1]} {SHORT_NAMES[dtype]}" for key, dtype in dtypes.items()
                      if key.startswith(tower + ".")]
            parts.append(f"{tower} {SHORT_NAMES[dtypes[tower]]}" + (f" ({', '.join(groups)})" if groups else ""))
        return ", ".join(parts) + (" (auto: the measured default)" if self == DEFAULT_PRECISION else "")

    def __str__(self):
        return self.spec


DEFAULT_PRECISION = Precision.parse("auto")
FP32_PRECISION = Precision.parse("fp32")


precision_argument = cli.argument_type(Precision.parse)  # argparse type of a precision spec


def add_precision_argument(parser):
    """Add --precision to an argparse parser; args.precision is then a Precision for FastEngine(precision=...)."""
    parser.add_argument(
        "--precision", type=precision_argument, default=DEFAULT_PRECISION, metavar="SPEC",
        help="fast engine weight precision: auto (the measured default: fp16; RetNet, input_down, the sLSTM's "
             "input maps and the mLSTM's q/k/v inputs fp32, RetNet's input path fp64), bf16, "
             "fp16 or fp32, then overrides per tower or part, e.g. 'bf16,retnet=fp32' or "
             f"'auto,hawk=bf16,xlstm.mlp=fp32' (towers and parts: {_known_keys()})")


# Towers with a matrix state (mLSTM C, Mamba2 h, RetNet S) that may be stored in 16 bits. A 16-bit state spec
# applies to xLSTM and Mamba2; RetNet's S stays fp32 unless named: its per-head RMSNorm of q.S is ill-conditioned,
# and in 16 bits it fails the accuracy suite on near-stuck feeds (bench/LOG.md section 30).
STATE_TOWERS = ("xlstm", "mamba2", "retnet")
STATE16_TOWERS = ("xlstm", "mamba2")
ROUNDINGS = ("stochastic", "nearest")


@dataclass(frozen=True)
class StateStorage:
    """How the matrix states (mLSTM C, Mamba2 h, RetNet S) are stored: a dtype per tower with one (the others keep
    fp32), and how a 16-bit state is rounded, stochastic or to nearest. Equal by dtypes and rounding; `spec` is the
    text it was parsed from, for names and reports."""
    dtypes: tuple  # ((tower, torch.dtype), ...) of STATE_TOWERS
    rounding: str = "stochastic"
    spec: str = field(default="fp32", compare=False)

    @classmethod
    def parse(cls, spec="fp32", rounding=None) -> "StateStorage":
        """'fp32', 'fp16', 'bf16', then overrides such as ',retnet=fp16', optionally ending in ':nearest' or
        ':stochastic'; `rounding`, where given, is the rounding (--state-rounding). ValueError in one line."""
        text = (spec or "fp32").strip()
        dtype_spec, colon, suffix = text.partition(":")
        if colon and suffix not in ROUNDINGS:
            raise ValueError(f"state rounding must be nearest or stochastic, got {suffix!r}")
        items = [item.strip().lower() for item in dtype_spec.split(",")]
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
        storage = cls(tuple(dtypes.items()), "stochastic", text)
        for given in (suffix, rounding):
            if given:
                storage = storage.with_rounding(given)
        return storage

    def dtype_of(self, tower) -> torch.dtype:
        """The dtype of the tower's matrix state (fp32 for a tower without one)."""
        return dict(self.dtypes).get(tower, torch.float32)

    @property
    def sixteen_bit(self) -> bool:
        """Whether some matrix state is stored in 16 bits (and so rounded)."""
        return any(dtype != torch.float32 for _, dtype in self.dtypes)

    def with_rounding(self, rounding) -> "StateStorage":
        """The same dtypes rounded by `rounding` (--state-rounding), which a spec ending in one must agree with;
        fp32 state is not rounded, so naming a rounding for it is a mistake."""
        if rounding not in ROUNDINGS:
            raise ValueError(f"state rounding must be nearest or stochastic, got {rounding!r}")
        if not self.sixteen_bit:
            raise ValueError(f"--state-rounding {rounding} applies to 16-bit state (--state-dtype fp16 or bf16); "
                             f"fp32 state is not rounded")
        said = self.spec.partition(":")[2]
        if said and said != rounding:
            raise ValueError(f"state storage {self.spec!r} says {said} rounding, and the rounding given is {rounding}")
        return replace(self, rounding=rounding)

    def describe(self) -> str:
        """e.g. 'xlstm fp16, mamba2 fp16, retnet fp32'."""
        return ", ".join(f"{tower} {SHORT_NAMES[dtype]}" for tower, dtype in self.dtypes)

    def __str__(self):
        return self.spec


FP32_STATE = StateStorage.parse("fp32")


state_storage_argument = cli.argument_type(StateStorage.parse)  # argparse type of a state storage spec


_fp32_lock = threading.Lock()
_fp32_holders = 0  # how many blocks, over all threads, are inside fp32_products now
_fp32_saved = None  # the process's settings from before the first of them


@contextlib.contextmanager
def fp32_products():
    """fp32 products stay fp32 while this is open: no TF32, no reduced-precision fp16 reductions in cuBLAS. The
    engine's fp32 parts (RetNet, input_down, the mLSTM's q/k/v inputs) and the reference need it; CUDA graphs keep
    the kernels chosen at capture. The settings are the process's, not a thread's: they stay fp32 until the last
    block open in any thread closes (steps run side by side in threads: runner.precompile, shards, a reference
    beside an engine), and the process's own come back then, whatever they were."""
    global _fp32_holders, _fp32_saved
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    with _fp32_lock:
        if _fp32_holders == 0:
            _fp32_saved = matmul.allow_tf32, cudnn.allow_tf32, matmul.allow_fp16_reduced_precision_reduction
            matmul.allow_tf32 = cudnn.allow_tf32 = matmul.allow_fp16_reduced_precision_reduction = False
        _fp32_holders += 1
    try:
        yield
    finally:
        with _fp32_lock:
            _fp32_holders -= 1
            if _fp32_holders == 0:
                matmul.allow_tf32, cudnn.allow_tf32, matmul.allow_fp16_reduced_precision_reduction = _fp32_saved
