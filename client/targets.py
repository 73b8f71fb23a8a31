"""Targets: the reference model's four predictions for every request of a stream, cached on disk.

Requests are batched across symbols: step k feeds every symbol's k-th request, so each symbol sees
its own requests in order and the result equals running each symbol alone.
"""
from __future__ import annotations

import functools
import hashlib
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from client.constants import NUM_TOWERS, TARGET_SOURCES, TOWER_NAMES
from client.engine.precision import fp32_products
from client.streams import Stream, stream_fingerprint


def default_cache_dir() -> Path:
    """$FASTENS_CACHE/targets, or ~/.cache/fastens/targets."""
    root = os.environ.get("FASTENS_CACHE") or Path.home() / ".cache" / "fastens"
    return Path(root) / "targets"


def source_digest(root: Path) -> str:
    """sha256 over the .py files under root: each one's path relative to root and its contents, not mtimes or where
    root lies, so that equal sources give the same digest in every process and on every machine."""
    digest = hashlib.sha256(b"fastens-model-source-v1")
    for name in sorted(path.relative_to(root).as_posix() for path in root.rglob("*.py")):
        data = (root / name).read_bytes().replace(b"\r\n", b"\n")  # a Windows checkout's line endings: same code
        digest.update(f"{name}\0{len(data)}\0".encode() + data)  # the length: no file's end reads as the next's start
    return digest.hexdigest()


@functools.cache
def model_code_version() -> str:
    """The reference model's code (client/model/) as source_digest, read once a process."""
    return source_digest(Path(__file__).resolve().parent / "model")


def targets_cache_path(cache_dir, weights_fingerprint: str, stream_fp: str) -> Path:
    # the model's code is part of the key: targets an older reference computed would otherwise outlive a fix to it
    key = hashlib.sha256(f"{model_code_version()}\0{weights_fingerprint}\0{stream_fp}".encode()).hexdigest()
    return Path(cache_dir) / f"{key}.npy"


def targets_fingerprint(targets: np.ndarray) -> str:
    """sha256 over the targets' float32 values, which make_stream stores with them."""
    return hashlib.sha256(np.asarray(targets, dtype="<f4").tobytes()).hexdigest()


def _model_device(model) -> torch.device:
    for tensor in model.parameters():
        return tensor.device
    return torch.device("cpu")


def _choose_device(model, device) -> torch.device:
    if device is not None:
        return torch.device(device)
    model_device = _model_device(model)
    if model_device.type == "cuda":
        return model_device
    return torch.device("cuda" if torch.cuda.is_available() else model_device)


# The stacked state of the symbols run at once (_run_reference), at least: each step holds it about twice (old and
# new), so a GPU with more free memory takes a third of it (fewer groups, each a pass over its symbols' requests).
STATE_BUDGET_BYTES = 8 << 30


class _Progress:
    """Progress on stderr, steps done/total and steps per second: on a terminal one line rewritten in place, in a
    log one line every 5 s (no carriage returns), and always the last."""

    def __init__(self, total: int, label: str, enabled: bool):
        self.total, self.label, self.enabled = total, label, enabled
        self.live = enabled and sys.stderr.isatty()
        self.every_s = 0.2 if self.live else 5.0
        self.start = self.last_draw = time.monotonic()
        self.done = 0

    def update(self, done: int):
        self.done = done
        now = time.monotonic()
        if self.enabled and (now - self.last_draw >= self.every_s or done == self.total):
            self.last_draw = now
            rate = done / max(now - self.start, 1e-9)
            line = f"{self.label}: {done}/{self.total} steps, {rate:.1f} steps/s"
            sys.stderr.write(f"\r{line}" + ("\n" if done == self.total else "") if self.live else line + "\n")
            sys.stderr.flush()


def _load_cached(path: Path, num_requests: int) -> np.ndarray | None:
    """The cached targets, or None when absent or unusable (then they are recomputed and rewritten)."""
    try:
        with open(path, "rb") as file:  # .npy only: np.load would open an .npz there too, or fail with EOFError
            targets = np.lib.format.read_array(file, allow_pickle=False)
    except (OSError, ValueError):
        return None
    # computed targets are finite (_run_reference), so a NaN or inf here is damage
    if targets.shape != (num_requests, NUM_TOWERS) or targets.dtype != np.float32 or not np.isfinite(targets).all():
        return None
    return targets


def _save_atomically(path: Path, targets: np.ndarray) -> None:
    # Write then rename, so that a concurrent or interrupted run never sees a partial file.
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            np.save(out, targets)
        os.replace(tmp_name, path)
    except BaseException:
        os.unlink(tmp_name)
        raise


def compute_targets(model, stream: Stream, weights_fingerprint: str, device=None, cache_dir=None,
                    progress: bool = True) -> np.ndarray:
    """Reference predictions float32 [M, 4] for every request of `stream`, in stream order.

    Targets stored in the stream are returned only when its meta names the same weights fingerprint and
    model_code_version, and their own targets_fingerprint (as make_stream stores them). Otherwise the on-disk
    cache (keyed by the model's code and the weights and stream fingerprints) is used, or the model is run and the
    cache filled. device=None runs on the model's GPU, else on CUDA when available, else on the CPU; the model is
    moved there in place.
    """
    if not isinstance(stream, Stream):
        raise TypeError(f"stream must be a client.streams.Stream, got {type(stream).__name__}")
    if not isinstance(weights_fingerprint, str) or not weights_fingerprint:
        raise ValueError(f"weights_fingerprint must be a non-empty string, got {weights_fingerprint!r}")
    # a stream's own targets stand for the model's only where the same weights and model code made them (make_stream
    # stores both): else a fix to client/model/ would leave a file's older targets scored as the model's. And only
    # the targets it made: edited after, they were scored as the model's and said to match it (max diff 0)
    if (stream.targets is not None and stream.meta.get("weights_fingerprint") == weights_fingerprint
            and stream.meta.get("model_code_version") == model_code_version()
            and stream.meta.get("targets_fingerprint") == targets_fingerprint(stream.targets)):
        return stream.targets.copy()

    cache_path = targets_cache_path(cache_dir or default_cache_dir(), weights_fingerprint,
                                    stream_fingerprint(stream))
    cached = _load_cached(cache_path, len(stream))
    if cached is not None:
        return cached
    targets = _run_reference(model, stream, _choose_device(model, device), progress)
    try:
        _save_atomically(cache_path, targets)
    except OSError as error:  # the cache only saves time: targets computed (minutes for a large preset) are kept
        print(f"warning: the targets are not cached: {error}", file=sys.stderr, flush=True)
    return targets


@torch.inference_mode()
def _run_reference(model, stream: Stream, device: torch.device, progress: bool) -> np.ndarray:
    model.to(device)
    _, symbol_ids, counts = np.unique(stream.symbols, return_inverse=True, return_counts=True)
    # Symbols are independent, so they run in groups whose stacked state fits the budget: all at once, a
    # stream of a thousand symbols of the full preset (146 MiB of state each) would not fit on any device.
    per_symbol = sum(t.numel() * t.element_size() for t in model.init_state(1, device=torch.device("meta")).values())
    budget = STATE_BUDGET_BYTES
    if device.type == "cuda":
        budget = max(budget, torch.cuda.mem_get_info(device)[0] // 3)
    group = max(1, budget // max(per_symbol, 1))
    groups = [np.flatnonzero(symbol_ids // group == g) for g in range(-(-len(counts) // group))]
    bar = _Progress(sum(int(counts[g * group:(g + 1) * group].max()) for g in range(len(groups))), "targets",
                    progress)
    targets = np.empty((len(stream), NUM_TOWERS), dtype=np.float32)
    # TF32 off whatever the process set (a team module may turn it on at import, before the evaluator's targets): in
    # TF32 the full preset's RetNet targets were 93% within atol of its fp32 ones, and cached as the model's
    with fp32_products():
        for g, rows in enumerate(groups):
            targets[rows] = _run_symbols(model, stream.features[rows], symbol_ids[rows] - g * group, device, bar)
    bad = ~np.isfinite(targets).all(axis=1)
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        raise ValueError(f"the reference model gave a NaN or inf prediction at request row {row} "
                         f"(symbol {stream.symbols[row]}); {int(bad.sum())} bad rows in all")
    return targets


def _run_symbols(model, features: np.ndarray, symbol_ids: np.ndarray, device: torch.device, bar) -> np.ndarray:
    """Predictions [M, 4] for requests of the symbols 0..S-1 (symbol_ids [M]), all symbols' states stacked."""
    counts = np.bincount(symbol_ids)
    # Order symbols by request count, longest first: the symbols with a k-th request are then a
    # prefix of that order, and since that prefix only shrinks with k, the stacked state is sliced,
    # never gathered or scattered.
    symbol_order = np.argsort(-counts, kind="stable")
    rank_of_symbol = np.empty_like(symbol_order)
    rank_of_symbol[symbol_order] = np.arange(len(symbol_order))
    request_rank = rank_of_symbol[symbol_ids]
    # Index of each request within its symbol's requests (0 for its first, 1 for its second, ...).
    by_symbol = np.argsort(request_rank, kind="stable")
    sorted_counts = counts[symbol_order]
    group_starts = np.repeat(np.cumsum(sorted_counts) - sorted_counts, sorted_counts)
    step_of_request = np.empty(len(features), dtype=np.int64)
    step_of_request[by_symbol] = np.arange(len(features)) - group_starts
    # Requests ordered by (step, symbol rank): step k is the contiguous block of active_k rows.
    execution_order = np.lexsort((request_rank, step_of_request))
    num_steps = int(sorted_counts[0])
    active_per_step = np.bincount(step_of_request, minlength=num_steps)

    ordered = torch.from_numpy(features[execution_order]).to(device)
    predictions = torch.empty(len(features), NUM_TOWERS, dtype=torch.float32, device=device)
    state = model.init_state(len(counts), device=device)
    start = 0
    for active in active_per_step.tolist():
        state = {name: tensor[:active] for name, tensor in state.items()}
        step_predictions, state = model(ordered[start:start + active], state)
        predictions[start:start + active] = step_predictions
        start += active
        bar.update(bar.done + 1)

    result = np.empty((len(features), NUM_TOWERS), dtype=np.float32)
    result[execution_order] = predictions.cpu().numpy()
    return result


# --------------------------------------------------------------------------- a stream file's own targets

def compare_targets(file_targets: np.ndarray, model_targets: np.ndarray, atol: float) -> dict:
    """How far a stream file's own targets are from the chosen weights' model: the max |file - model| per tower,
    the fraction of predictions within atol, and whether all are (match)."""
    diff = np.abs(np.asarray(file_targets, np.float64) - np.asarray(model_targets, np.float64))
    return {"max_abs_diff": {name: float(diff[:, i].max()) for i, name in enumerate(TOWER_NAMES)},
            "within_atol": float((diff <= atol).mean()), "atol": float(atol), "match": bool((diff <= atol).all())}


def check_targets_source(stream: Stream, source: str) -> None:
    """ValueError unless --targets `source` can be scored for this stream (before any targets are computed)."""
    if source not in TARGET_SOURCES:
        raise ValueError(f"--targets must be one of {', '.join(TARGET_SOURCES)}, got {source!r}")
    if source == "file" and stream.targets is None:
        raise ValueError("--targets file: the stream carries no targets (target_00..target_03 in a parquet file, "
                         "`targets` in an .npz); use --targets model")


def choose_targets(stream: Stream, model_targets: np.ndarray, source: str, atol: float):
    """(the targets to score against, compare_targets of the stream's own or None when it carries none) for
    --targets `source` (check_targets_source's errors)."""
    check_targets_source(stream, source)
    if stream.targets is None:
        return model_targets, None
    comparison = compare_targets(stream.targets, model_targets, atol)
    return (stream.targets if source == "file" else model_targets), comparison


def describe_targets(comparison: dict, source: str, model: str) -> str:
    """One line: whether the stream's own targets match `model` (e.g. "preset tiny, seed 0"), and which are scored."""
    worst = max(comparison["max_abs_diff"], key=comparison["max_abs_diff"].get)
    per_tower = ", ".join(f"{name} {value:.1e}" for name, value in comparison["max_abs_diff"].items())
    if comparison["match"]:
        verdict = f"match the model ({model}) within atol {comparison['atol']:g}"
    else:
        # rounded down: rounded to nearest, 1 miss in 40,000 read "100.0% within" beside "differ"
        within = math.floor(round(1000 * comparison["within_atol"], 6)) / 10
        verdict = (f"differ from the model ({model}): {within:.1f}% within atol "
                   f"{comparison['atol']:g}, worst on {worst}; other weights made them")
    other = "model" if source == "file" else "file"
    return (f"the stream's own targets {verdict} (max |file - model|: {per_tower}); scoring against the "
            f"{'file' if source == 'file' else 'model'}'s (--targets {other} to score against the {other}'s)")
