"""Input families a real feed produces, for the accuracy suite (scripts/bench.py, section `accuracy`).

The benchmark's own workload is standard-normal features. A feed can also be far smaller or larger than
unit scale, heavy-tailed, mostly zero, shifted, stuck on one row, or change regime mid-stream. Real feeds are not
standardised at all: side by side, columns of prices (large levels moving little), volumes (large, skewed) and
returns (tiny) differ in scale by many orders of magnitude. A recurrent
state integrates whatever error a step makes: random errors average out over the state's memory, while
the same error made step after step (a stuck feed) accumulates. Each family is a function
(rng, steps, symbols) -> float32 features [steps, symbols, 79], deterministic for a seed.
"""
import numpy as np

from client.model.config import NUM_FEATURES


def _normal(rng, steps, symbols, scale=1.0):
    return (scale * rng.standard_normal((steps, symbols, NUM_FEATURES))).astype(np.float32)


def _student_t(rng, steps, symbols, df=2.0):
    return rng.standard_t(df, (steps, symbols, NUM_FEATURES)).astype(np.float32)


def _sparse(rng, steps, symbols, density=0.1):
    features = _normal(rng, steps, symbols)
    return np.where(rng.random(features.shape) < density, features, 0.0).astype(np.float32)


def _shifted(rng, steps, symbols, spread=3.0):
    means = spread * rng.standard_normal((1, symbols, NUM_FEATURES))  # each symbol its own fixed means
    return (means + rng.standard_normal((steps, symbols, NUM_FEATURES))).astype(np.float32)


def _stuck(rng, steps, symbols, noise=0.0):
    row = rng.standard_normal((1, symbols, NUM_FEATURES))
    return (row + noise * rng.standard_normal((steps, symbols, NUM_FEATURES))).astype(np.float32)


def _regime_change(rng, steps, symbols):
    """Standard normal, then from halfway on ten times larger around a shifted mean."""
    features = _normal(rng, steps, symbols)
    half = steps // 2
    shift = 2.0 * rng.standard_normal((1, symbols, NUM_FEATURES))
    features[half:] = (10.0 * features[half:] + shift).astype(np.float32)
    return features


def _column_scales(rng, steps, symbols, low=-2.0, high=5.0):
    """Each column at its own fixed scale, 10^low .. 10^high (log-uniform)."""
    scales = 10.0 ** rng.uniform(low, high, (1, 1, NUM_FEATURES))
    return (scales * rng.standard_normal((steps, symbols, NUM_FEATURES))).astype(np.float32)


def _prices(rng, shape, low=1.0, high=4.0, move=1e-3):
    """Levels 10^low .. 10^high per (symbol, column), a random walk of relative steps `move`."""
    level = 10.0 ** rng.uniform(low, high, (1, *shape[1:]))
    return level * np.exp(np.cumsum(move * rng.standard_normal(shape), axis=0))


def _offsets(rng, steps, symbols):
    """Large levels with small moves: every column a price (10 .. 1e4) moving 0.1% a step."""
    return _prices(rng, (steps, symbols, NUM_FEATURES)).astype(np.float32)


def _feed_mix(rng, steps, symbols):
    """A market feed's columns side by side: prices (10 .. 1e4, random walk), volumes (lognormal, 1e3 .. 1e5)
    and returns (~1e-3), a third each in a fixed column order."""
    shape = (steps, symbols, NUM_FEATURES)
    kind = np.arange(NUM_FEATURES) % 3
    prices = _prices(rng, shape)
    volumes = 10.0 ** rng.uniform(3, 5, (1, symbols, NUM_FEATURES)) * rng.lognormal(0.0, 0.5, shape)
    returns = 1e-3 * rng.standard_normal(shape)
    return np.where(kind == 0, prices, np.where(kind == 1, volumes, returns)).astype(np.float32)


FAMILIES = {
    "normal": _normal,
    "scale_1e-3": lambda rng, steps, symbols: _normal(rng, steps, symbols, 1e-3),
    "scale_1e-2": lambda rng, steps, symbols: _normal(rng, steps, symbols, 1e-2),
    "scale_1e-1": lambda rng, steps, symbols: _normal(rng, steps, symbols, 1e-1),
    "scale_1e1": lambda rng, steps, symbols: _normal(rng, steps, symbols, 1e1),
    "scale_1e2": lambda rng, steps, symbols: _normal(rng, steps, symbols, 1e2),
    "student_t2": _student_t,
    "sparse": _sparse,
    "shifted": _shifted,
    "stuck": _stuck,
    "near_stuck": lambda rng, steps, symbols: _stuck(rng, steps, symbols, 1e-3),
    "zeros": lambda rng, steps, symbols: np.zeros((steps, symbols, NUM_FEATURES), np.float32),
    "regime_change": _regime_change,
    "column_scales": _column_scales,
    "offsets": _offsets,
    "feed_mix": _feed_mix,
}
# Long streams: standard normal for many steps, where errors in the recurrent state have time to grow.
LONG_FAMILY = "long"


def family_features(name: str, steps: int, symbols: int, seed: int) -> np.ndarray:
    """Features [steps, symbols, 79] of one family (`long` is standard normal)."""
    if name != LONG_FAMILY and name not in FAMILIES:
        raise ValueError(f"unknown input family {name!r}; choose from {', '.join([*FAMILIES, LONG_FAMILY])}")
    rng = np.random.default_rng([seed, sum(map(ord, name))])
    return (FAMILIES.get(name, _normal))(rng, steps, symbols)
