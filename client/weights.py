"""Deterministic synthetic weights, weight fingerprints and strict checkpoint loading.

Every tensor is drawn from its own numpy PCG64 stream seeded by (seed, crc32(name)), so the values are the
same on every machine and library version and do not depend on the order of generation. The init of each
tensor (_init, first match wins):

  linear weight [o, i], bias    uniform(+-1/sqrt(i)); output_proj.bias = 0
  residual writers              times a per-tower gain (tower_gain): input_down, fc2 (weight and bias), the
                                layer's out_proj (Mamba2, RetNet, Hawk) and final_norm.weight (xLSTM). All
                                norms are scale-invariant, so the final hidden vector, and with it the
                                tower's prediction, scales linearly with the gain; the gains set each tower's
                                prediction std to about 0.06 on standard-normal features over a long stream.
  norm weights / biases         ones / zeros; mLSTM learnable_skip ones
  conv weight [C,1,4], bias     uniform(+-1/2) (fan-in 4)
  block-linear weight [nb,s,s]  uniform(+-1/sqrt(s)); sLSTM state-gate biases zeros, forget gate +3
  mLSTM gate projections        weights uniform(+-1/sqrt(3*inner)); igate bias 0; fgate bias linspace(3, 6)
  Mamba2 a, d, dt bias          a uniform[-16, -1]; d ones; dt = exp(uniform[log 1e-3, log 1e-1]), bias = softplus^-1(dt)
  RetNet decay, angle           decay[h] = 1 - 2^(-5-h); angle = 10000^(-j/(D/2-1)), j < D/2, each twice
  RG-LRU a                      a = u^(1/8) with u uniform[0.9, 0.999], so a^c lies in [0.9, 0.999]
"""
import hashlib
import math
import os
import pickle
import re
import zipfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from client.model.config import PRESETS, TOWER_NAMES, ModelConfig

# Prediction std of each tower per unit gain, per preset: the std of one symbol's predictions over 10,000 steps
# of standard-normal features (scripts/long_stream.py, seed 0) divided by the gain it ran with; the
# prediction scales linearly with the gain, so these gains give each tower a std of about TARGET_STD.
# A custom configuration uses the full preset's.
UNIT_GAIN_STD = {
    "full": {"xlstm": 2.81, "mamba2": 1.11, "retnet": 0.503, "hawk": 0.739},
    "medium": {"xlstm": 1.24, "mamba2": 0.634, "retnet": 0.307, "hawk": 0.424},
    "small": {"xlstm": 0.949, "mamba2": 0.515, "retnet": 0.291, "hawk": 0.455},
    "tiny": {"xlstm": 0.712, "mamba2": 0.527, "retnet": 0.199, "hawk": 0.267},
}
TARGET_STD = 0.06
RESIDUAL_WRITER = re.compile(r"(\.input_down\.(weight|bias)|\.mlp\.fc2\.(weight|bias)|\.layer\.out_proj\.weight"
                             r"|\.layer\.final_norm\.weight)$")


def tower_gain(cfg: ModelConfig, tower: str) -> float:
    preset = next((name for name, c in PRESETS.items() if c == cfg), "full")
    return TARGET_STD / UNIT_GAIN_STD[preset][tower]


def _rng(seed, name):
    return np.random.Generator(np.random.PCG64([seed, zlib.crc32(name.encode())]))


def _uniform(rng, shape, low, high):
    u = rng.random(int(np.prod(shape)), dtype=np.float32)
    u *= np.float32(high - low)
    u += np.float32(low)
    return u.reshape(shape)


def _tower(name):
    m = re.match(r"towers\.(\d+)\.", name)
    return TOWER_NAMES[int(m.group(1))] if m else None


def _init(name, shape, shapes, cfg, rng):
    ones = lambda: np.ones(shape, np.float32)  # noqa: E731
    zeros = lambda: np.zeros(shape, np.float32)  # noqa: E731
    sym = lambda bound: _uniform(rng, shape, -bound, bound)  # noqa: E731
    if RESIDUAL_WRITER.search(name):
        gain = np.float32(tower_gain(cfg, _tower(name)))
        return gain * (ones() if name.endswith("final_norm.weight") else _linear(name, shape, shapes, rng))
    if name == "output_proj.bias" or re.search(r"(group_norm|outnorm)\.bias$", name):
        return zeros()
    if re.search(r"(norm1|norm2|norm|final_norm|group_norm|outnorm)\.weight$", name) or name.endswith(
            ("learnable_skip", "layer.d")):
        return ones()
    if name.endswith("conv.weight") or name.endswith("conv.bias"):
        return sym(0.5)
    if name.endswith("layer.a"):  # Mamba2
        return _uniform(rng, shape, -16.0, -1.0)
    if name.endswith("dt_proj.bias"):
        dt = np.exp(_uniform(rng, shape, math.log(1e-3), math.log(1e-1)).astype(np.float64))
        return (dt + np.log(-np.expm1(-dt))).astype(np.float32)  # softplus^-1
    if name.endswith("layer.decay"):
        return (1 - 2.0 ** (-5 - np.arange(shape[0]))).astype(np.float32)
    if name.endswith("layer.angle"):
        half = shape[0] // 2
        return np.repeat(10000.0 ** (-np.arange(half) / (half - 1)), 2).astype(np.float32)
    if name.endswith("rglru.a"):
        return (_uniform(rng, shape, 0.9, 0.999).astype(np.float64) ** (1 / 8)).astype(np.float32)
    if name.endswith("fgate_state.bias"):
        return np.full(shape, 3.0, np.float32)
    if name.endswith("gate_state.bias"):
        return zeros()
    if name.endswith("fgate_proj.bias"):
        return np.linspace(3.0, 6.0, shape[0], dtype=np.float32)
    if name.endswith("igate_proj.bias"):
        return zeros()
    if len(shape) == 3:  # block-linear weight [nb, s, s]
        return sym(1 / math.sqrt(shape[2]))
    return _linear(name, shape, shapes, rng)


def _linear(name, shape, shapes, rng):
    """PyTorch's default Linear init: weight and bias uniform(+-1/sqrt(fan_in))."""
    fan_in = shape[1] if len(shape) == 2 else None
    if name.endswith(".bias") and len(shapes.get(name.removesuffix("bias") + "weight", ())) == 2:
        fan_in = shapes[name.removesuffix("bias") + "weight"][1]
    if fan_in is None:
        raise ValueError(f"no init rule for {name} {list(shape)}")
    bound = 1 / math.sqrt(fan_in)
    return _uniform(rng, shape, -bound, bound)


def _threads():
    return min(16, os.cpu_count() or 1)


def make_weights(cfg: ModelConfig, seed: int = 0, progress=None):
    """The synthetic state dict (float32, CPU) for `cfg`, a pure function of (cfg, seed).

    Tensors are independent streams, so they are drawn on a thread pool (numpy releases the GIL)."""
    from client.model import manifest_for  # local import: client.model imports this module

    tensors = manifest_for(cfg)
    shapes = {t["name"]: t["shape"] for t in tensors}

    def draw(t):
        value = _init(t["name"], tuple(t["shape"]), shapes, cfg, _rng(seed, t["name"]))
        return torch.from_numpy(np.ascontiguousarray(value, dtype=np.float32))

    state = {}
    with ThreadPoolExecutor(_threads()) as pool:
        for k, (t, value) in enumerate(zip(tensors, pool.map(draw, tensors))):
            state[t["name"]] = value
            if progress:
                progress(k + 1, len(tensors))
    return state


def _tensor_digest(name, t):
    t = t.detach().cpu().contiguous()
    h = hashlib.sha256(f"{name}|{list(t.shape)}|{str(t.dtype).removeprefix('torch.')}\n".encode())
    if t.numel():
        h.update(t.view(torch.uint8).reshape(-1).numpy().data)
    return h.digest()


def fingerprint(state_dict) -> str:
    """sha256 over the per-tensor sha256 of (name, shape, dtype, bytes), in name order; 16 hex digits."""
    names = sorted(state_dict)
    with ThreadPoolExecutor(_threads()) as pool:
        digests = pool.map(lambda n: _tensor_digest(n, state_dict[n]), names)
        return hashlib.sha256(b"".join(digests)).hexdigest()[:16]


class CheckpointMismatch(ValueError):
    pass


def check_state_dict(state_dict, expected, source="checkpoint", preset=None):
    """Raise CheckpointMismatch listing missing, unexpected and misshapen tensors. `expected`: manifest list;
    `source` (the file) and `preset` name them in the first line, which also says the likely cause."""
    want = {t["name"]: t for t in expected}
    missing = sorted(set(want) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(want))
    misshapen = [f"{n}: {list(state_dict[n].shape)} {str(state_dict[n].dtype).removeprefix('torch.')}, expected "
                 f"{want[n]['shape']} {want[n]['dtype']}"
                 for n in sorted(set(want) & set(state_dict))
                 if list(state_dict[n].shape) != want[n]["shape"]
                 or str(state_dict[n].dtype).removeprefix("torch.") != want[n]["dtype"]]
    if missing or unexpected or misshapen:
        def block(title, items):
            shown = "\n  ".join(items[:20]) + (f"\n  ... and {len(items) - 20} more" if len(items) > 20 else "")
            return f"{title} ({len(items)}):\n  {shown}" if items else ""
        parts = [block("missing", missing), block("unexpected", unexpected), block("misshapen", misshapen)]
        model = f"the {preset} preset's model" if preset else "the model"
        # the CLIs print one line, cut at about 260 characters: the cause first, the lists after it
        raise CheckpointMismatch(f"{source} does not match {model}: "
                                 f"{_mismatch_cause(state_dict, want, missing, unexpected, misshapen)}\n"
                                 + "\n".join(p for p in parts if p))


def _mismatch_cause(state_dict, want, missing, unexpected, misshapen):
    """What a user can do about a mismatch: another preset's weights, another dtype, a wrapper's name prefix."""
    from client.model import manifest_for  # local import: client.model imports this module

    shapes = {n: list(t.shape) for n, t in state_dict.items()}
    if shapes == {n: t["shape"] for n, t in want.items()}:
        dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in state_dict.values()})
        return (f"its tensors are {', '.join(dtypes)}; the reference model loads float32 only "
                f"(save them converted with .float())")
    for name, cfg in PRESETS.items():
        if shapes == {t["name"]: t["shape"] for t in manifest_for(cfg)}:
            return f"it holds the {name} preset's tensors (pass --preset {name})"
    first = next(iter(want))
    prefix = next((n.removesuffix(first) for n in state_dict if n.endswith("." + first)), None)
    if prefix and all(n.startswith(prefix) for n in state_dict):
        return f"every tensor name starts with {prefix!r} (save the inner model's state_dict())"
    return (f"{len(missing)} missing, {len(unexpected)} unexpected and {len(misshapen)} misshapen tensors "
            f"(first: {(missing + unexpected + misshapen)[0]})")


def read_checkpoint(path):
    """A state dict from a .pt/.pth torch file or a .safetensors file (CPU tensors)."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"weights {path} is a folder; give the checkpoint file")
    if not path.is_file():
        raise FileNotFoundError(f"weights file not found: {path}")
    if path.stat().st_size == 0:
        raise ValueError(f"checkpoint {path} is empty")
    # mmap needs torch's zip format: a file of torch.save's older format is read whole; safetensors maps its file
    safetensors = path.suffix == ".safetensors"
    mapped = safetensors or zipfile.is_zipfile(path)
    try:
        if safetensors:
            state = _load_safetensors(path)
        else:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=mapped)
    except ImportError:
        raise
    except Exception as e:  # noqa: BLE001 - torch and safetensors raise many types for a bad file
        raise ValueError(f"cannot read checkpoint {path}: {_why_unreadable(path, e)}") from None
    state = _unwrap(state)
    if not isinstance(state, dict):
        raise ValueError(f"{path} is not a state dict of tensors")
    for name, value in state.items():
        # what check_state_dict and load_state_dict cannot take: they would fail with a TypeError or RuntimeError
        if not isinstance(name, str):
            raise ValueError(f"{path} is not a state dict of tensors: key {name!r} is not a tensor name")
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{path} is not a state dict of tensors: {name} is a {type(value).__name__}")
        if value.layout != torch.strided or value.is_meta:
            raise ValueError(f"{path}: tensor {name} is {'meta' if value.is_meta else value.layout}, not a dense "
                             f"tensor with values")
    if mapped:
        # the mapped tensors are the file's pages: a checkpoint saved again at this path (a training script's next
        # one) would change the model under its fingerprint, or crash it (SIGBUS) where the file got shorter. Copied
        # here, only the state dict's tensors are read: a training checkpoint's optimizer state is not
        state = {name: value.clone() for name, value in state.items()}
    return state


def _unwrap(state):
    """A training checkpoint's state dict: the dict under one of these keys, beside the step, the loss (often 0-d
    tensors), the optimizer's state, ..., when it holds more tensors than the checkpoint's top level (a state dict
    with one stray dict entry stays as it is, and is refused for it)."""
    if not isinstance(state, dict):
        return state
    tensors = lambda d: sum(isinstance(v, torch.Tensor) for v in d.values())  # noqa: E731
    top = tensors(state)
    return next((state[k] for k in ("state_dict", "model_state_dict", "model") if isinstance(state.get(k), dict)
                 and tensors(state[k]) > top), state)


def _why_unreadable(path, error):
    """torch.load's error in words: its own is a number for a file that is no pickle, nothing for one cut short, and
    for a pickle of other objects advice to pass weights_only=False, which would run the file's code."""
    with open(path, "rb") as file:
        head = file.read(9)
    zipped = head.startswith(b"PK\x03\x04")  # torch.save's format; its older one is a pickle, starting b"\x80"
    if path.suffix == ".safetensors":
        return "it is a torch.save file: name it .pt" if zipped else str(error)
    if (zipped and not zipfile.is_zipfile(path)) or isinstance(error, EOFError):
        return "the file ends early (cut short, or damaged): copy it again"
    if head[8:9] == b"{":  # safetensors: an 8-byte header length, then the JSON header
        return "it looks like a safetensors file: name it .safetensors"
    if not zipped and not head.startswith(b"\x80"):
        return f"not a torch.save file (it starts with {head[:8]!r})"
    if isinstance(error, pickle.UnpicklingError) and "Weights only load failed" in str(error):
        found = re.search(r"Unsupported [^\n]*?(?=\.? was not|\n|$)", str(error))
        return (f"it holds Python objects besides tensors, which are not loaded since that would run the file's code "
                f"({found.group(0) if found else 'WeightsUnpickler error'}): save the state dict alone")
    return str(error) or type(error).__name__


def _load_safetensors(path):
    try:
        from safetensors.torch import load_file
    except ImportError:
        raise ImportError("reading .safetensors needs the safetensors package: pip install safetensors") from None
    return load_file(str(path))
