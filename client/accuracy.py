"""The accuracy suite: an engine's predictions against the fp32 reference on every input family.

Each symbol is fed one family (client/families.py) for the whole stream, all symbols stepped together, once per
input seed (a family's narrowest tower moves from seed to seed: a family is judged by its worst seed); a few
symbols also run a long standard-normal stream. The reference's predictions are computed once per suite and
reused for every engine measured against it (precisions, state dtypes). The gate: on every family, every
tower has at least GATE_WITHIN of its predictions within the scoring tolerance, and none is NaN or inf.
"""
import math
import time

import numpy as np
import torch

from client.constants import ATOL, TOWER_NAMES
from client.engine.base import Engine
from client.engine.cuda_streams import own_stream, reset_graphs_when_dropped
from client.engine.precision import fp32_products
from client.families import FAMILIES, LONG_FAMILY, family_features

GATE_WITHIN = 0.999


class ReferenceStepper:
    """The fp32 reference stepping a fixed batch of symbols. On CUDA one step is captured as a CUDA graph:
    the same kernels as eagerly (so the same results), without ~1,000 launches from Python per step."""

    def __init__(self, model, batch, device):
        self.model, self.device = model, torch.device(device)
        dtype = model.output_proj.weight.dtype  # float64 for a check of the fp32 reference itself
        self.state = {k: v.to(dtype) if v.is_floating_point() else v
                      for k, v in model.init_state(batch, device=self.device).items()}
        self.features = torch.zeros(batch, model.cfg.features, device=self.device, dtype=dtype)
        self.graph = None
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):  # torch.cuda.graph synchronizes the current GPU: make it this one
                self._capture()

    @torch.no_grad()
    def _capture(self):
        warm = torch.cuda.Stream(self.device)
        warm.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(warm):  # cuBLAS picks its algorithms outside the capture
            self.model(self.features, {k: v.clone() for k, v in self.state.items()})
        torch.cuda.current_stream(self.device).wait_stream(warm)
        self.graph = torch.cuda.CUDAGraph()
        # captured on a stream of its own: the graph keeps that stream's cuBLAS workspace (cuda_streams.py)
        with torch.cuda.graph(self.graph, stream=own_stream(self.device)):
            self.out, self.new_state = self.model(self.features, self.state)
        reset_graphs_when_dropped(self, self.device, [self.graph])

    @torch.no_grad()
    def step(self, features: torch.Tensor) -> torch.Tensor:
        """Predictions [B, 4] (fp32) for one step of every symbol; the states advance."""
        with fp32_products():
            if self.graph is None:
                out, self.state = self.model(features.to(self.features.dtype), self.state)
                return out
            self.features.copy_(features)
            self.graph.replay()
            for name, tensor in self.state.items():
                tensor.copy_(self.new_state[name])
            return self.out.clone()


class Suite:
    """The inputs and the reference's predictions of one suite: `runs` maps a run name to (symbol families,
    features [steps, symbols, 79], input seed): one run of every family side by side per seed in `seeds` (by
    default `seed` alone), one of long streams (the first seed)."""

    def __init__(self, model, device, *, families=tuple(FAMILIES), symbols_per_family=4, steps=1000,
                 long_symbols=4, long_steps=10_000, seed=0, seeds=None, progress=None):
        self.device = torch.device(device)
        self.progress = progress or (lambda message: None)
        self.runs = {}
        unknown = [name for name in families if name not in FAMILIES]
        if unknown:
            raise ValueError(f"unknown input families {unknown}; choose from {', '.join(FAMILIES)}")
        seeds = list(dict.fromkeys(seeds if seeds is not None else [seed]))
        if not seeds:
            raise ValueError("the suite needs at least one input seed")
        if families and symbols_per_family and steps:
            for s in seeds:
                self.runs[f"families@{s}"] = (
                    [name for name in families for _ in range(symbols_per_family)],
                    np.concatenate([family_features(name, steps, symbols_per_family, s) for name in families],
                                   axis=1), s)
        if long_symbols and long_steps:
            self.runs[LONG_FAMILY] = ([LONG_FAMILY] * long_symbols,
                                      family_features(LONG_FAMILY, long_steps, long_symbols, seeds[0]), seeds[0])
        self.targets = {name: self._reference(model, name, features)
                        for name, (_, features, _) in self.runs.items()}

    @property
    def symbols(self) -> int:
        """Symbols an engine must hold at once: the largest run's (measure steps one run at a time)."""
        return max((features.shape[1] for _, features, _ in self.runs.values()), default=0)

    def _reference(self, model, name, features):
        steps, batch, _ = features.shape
        begin = time.monotonic()
        stepper = ReferenceStepper(model, batch, self.device)
        targets = torch.empty(steps, batch, len(TOWER_NAMES), device=self.device)
        report_every = max(steps // 5, 1)
        for step in range(steps):
            targets[step] = stepper.step(torch.from_numpy(features[step]).to(self.device))
            if (step + 1) % report_every == 0:
                self.progress(f"accuracy suite: reference {name} {step + 1}/{steps} steps "
                              f"({time.monotonic() - begin:.0f} s)")
        return targets

    def measure(self, engine: Engine, prefix="", per_symbol=1) -> dict:
        """{"families": {family: {tower: tower_errors}}, each family's worst seed per tower; "seeds": {seed:
        {family: {tower: tower_errors}}}; "gate" {passed, worst: (family, tower, within_atol), nan_or_inf}} of
        `engine`, stepped through its public step on fresh symbols named `prefix`... and released after.
        per_symbol: each step carries that many consecutive requests of every symbol (a backlog of per_symbol
        requests in every step; the last step of a stream what is left)."""
        by_seed = {}
        for name, (families, features, seed) in self.runs.items():
            stats = by_seed.setdefault(seed, {})
            steps, batch, _ = features.shape
            symbols = [f"{prefix}{name}/{i:03d}" for i in range(batch)]
            predictions = np.empty((steps, batch, len(TOWER_NAMES)), dtype=np.float32)
            for first in range(0, steps, per_symbol):
                k = min(per_symbol, steps - first)
                rows = features[first:first + k].transpose(1, 0, 2).reshape(batch * k, -1)  # each symbol's k in order
                out = engine.step([symbol for symbol in symbols for _ in range(k)], rows)
                predictions[first:first + k] = out.reshape(batch, k, -1).transpose(1, 0, 2)
            engine.release(symbols)
            targets = self.targets[name].cpu().numpy()
            for family in dict.fromkeys(families):
                columns = [i for i, f in enumerate(families) if f == family]
                stats[family] = tower_errors(predictions[:, columns].reshape(-1, len(TOWER_NAMES)),
                                             targets[:, columns].reshape(-1, len(TOWER_NAMES)))
        worst = worst_of(list(by_seed.values()))
        return {"families": worst, "seeds": {str(seed): stats for seed, stats in by_seed.items()},
                "gate": gate(worst)}


def worst_of(results: list[dict]) -> dict:
    """{family: {tower: errors}}: per family and tower, the worst of several measurements' tower_errors (the least
    within atol, the largest errors, a NaN error where one measurement had no finite prediction, NaN or inf
    predictions counted over all), families in first-seen order."""
    worst = {}
    for stats in results:
        for family, towers in stats.items():
            for tower, row in towers.items():
                kept = worst.setdefault(family, {}).get(tower)
                worst[family][tower] = row if kept is None else _worse(kept, row)
    return worst


def _worse(a: dict, b: dict) -> dict:
    def worse(key):
        if key == "nan_or_inf":
            return a[key] + b[key]
        values = [v for v in (a[key], b[key]) if v is not None]  # None: a target too flat to scale errors by
        if not values:
            return None
        if any(math.isnan(v) for v in values):  # no finite prediction at all: no error can stand for it
            return math.nan
        return min(values) if key == "within_atol" else max(values)  # the others are errors
    return {key: worse(key) for key in a}


def tower_errors(predictions, targets, atol: float = ATOL) -> dict:
    """Per tower, of predictions against targets [n, towers]: the fraction within atol (a NaN or inf prediction is
    wrong), the max and mean absolute error and the rmse over the finite predictions (NaN where there are none),
    the rmse relative to the targets' std (None where the std is within atol: too small a spread to measure errors
    by), and the count of NaN or inf predictions. In float64, so that the statistics add no rounding of their own."""
    predictions = np.asarray(predictions, dtype=np.float64)
    targets = np.asarray(targets, dtype=np.float64)
    if predictions.shape != targets.shape or predictions.ndim != 2 or predictions.shape[1] != len(TOWER_NAMES):
        raise ValueError(f"predictions {predictions.shape} and targets {targets.shape} must both be "
                         f"[n, {len(TOWER_NAMES)}]")
    rows, result = len(predictions), {}
    for column, name in enumerate(TOWER_NAMES):
        finite = np.isfinite(predictions[:, column])
        error = np.abs(predictions[finite, column] - targets[finite, column])
        rmse = float(np.sqrt(np.mean(error ** 2))) if error.size else math.nan
        std = float(np.std(targets[:, column]))
        # A std within atol is no scale to measure errors by: the targets' mean alone is then within atol in rms, and
        # a constant target's std is float rounding (1e-17 for 0.1 three times) or a few ulps of settling (RetNet's
        # on the zeros family, 4e-8), against which errors within atol read as 1e4 or more. Above atol, an rmse
        # within atol reads under 1, the rel_rmse of predicting the mean.
        result[name] = {"within_atol": float((error <= atol).sum() / rows) if rows else math.nan,
                        "max_abs_err": float(error.max()) if error.size else math.nan,
                        "mean_abs_err": float(error.mean()) if error.size else math.nan,
                        "rmse": rmse,
                        "rel_rmse": rmse / std if std > atol else None,
                        "nan_or_inf": int((~finite).sum())}
    return result


def gate(stats) -> dict:
    """Whether every tower holds GATE_WITHIN on every family with no NaN, and the worst (family, tower)."""
    # a NaN share (no rows) ranks worst: min() compares with <, always False for NaN, so NaN would be kept or
    # skipped by where it stands, and the gate pass with it
    worst = min(((family, tower, row["within_atol"]) for family, towers in stats.items()
                 for tower, row in towers.items()), key=lambda item: -math.inf if math.isnan(item[2]) else item[2])
    nan = sum(row["nan_or_inf"] for towers in stats.values() for row in towers.values())
    return {"passed": bool(worst[2] >= GATE_WITHIN and nan == 0), "worst": list(worst), "nan_or_inf": nan}


def percent_down(share: float) -> float:
    """share as a percentage rounded down to 2 decimals, for display: rounded to nearest, a share just under the
    gate (0.99899) reads 99.90%, as if it held. round(.., 6) first takes off the product's float noise (0.999 * 1e4
    must not floor to 9989); NaN stays NaN."""
    return share * 100 if math.isnan(share) else math.floor(round(share * 1e4, 6)) / 100


def format_table(result) -> str:
    """One line per family: within 1e-3 (%) and max error per tower."""
    lines = [f"{'family':<14}" + "".join(f"{name:>20}" for name in TOWER_NAMES)]
    for family, towers in result["families"].items():
        lines.append(f"{family:<14}" + "".join(f"{percent_down(row['within_atol']):>10.2f}% {row['max_abs_err']:>8.1e}"
                                               for row in towers.values()))
    if len(result.get("seeds", ())) > 1:
        lines.append(f"each family's worst of input seeds {', '.join(result['seeds'])}")
    g = result["gate"]
    lines.append(f"gate (>= {100 * GATE_WITHIN:g}% on every tower and family, no NaN): "
                 f"{'passed' if g['passed'] else 'FAILED'}; worst {g['worst'][0]} {g['worst'][1]} "
                 f"{percent_down(g['worst'][2]):.2f}%")
    return "\n".join(lines)
