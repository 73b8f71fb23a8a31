import importlib.util

import numpy as np
import pytest

from client.engine import ENGINES, make_engine
from client.engine.reference import ReferenceEngine
from client.model import load_model

SYMBOLS = ["SYM_000", "SYM_001", "SYM_002"]


@pytest.fixture(scope="module")
def model():
    return load_model("tiny", seed=3)[0]


def _features(rng, n):
    return rng.standard_normal((n, 79)).astype(np.float32)


def test_batched_equals_each_symbol_alone(model):
    rng = np.random.default_rng(0)
    steps = [_features(rng, len(SYMBOLS)) for _ in range(4)]
    batched = ReferenceEngine(model)
    batched_out = [batched.step(SYMBOLS, f) for f in steps]
    for i, symbol in enumerate(SYMBOLS):
        alone = ReferenceEngine(model)
        for step, features in enumerate(steps):
            out = alone.step([symbol], features[i:i + 1])
            np.testing.assert_allclose(out[0], batched_out[step][i], rtol=1e-5, atol=1e-6)
    assert batched_out[0].dtype == np.float32 and batched_out[0].shape == (3, 4)
    assert batched.symbols == SYMBOLS


def test_state_advances_and_new_symbols_start_fresh(model):
    rng = np.random.default_rng(1)
    x = _features(rng, 1)
    engine = ReferenceEngine(model)
    first = engine.step(["A"], x)
    second = engine.step(["A"], x)
    assert not np.allclose(first, second)  # the state moved
    # A symbol first seen later starts from a fresh state, whatever the others did.
    np.testing.assert_allclose(engine.step(["A", "B"], np.concatenate([x, x]))[1], first[0], rtol=1e-5, atol=1e-6)
    assert engine.symbols == ["A", "B"]


@pytest.mark.parametrize("symbols, shape, poison, match", [
    (["A", "B"], (2, 78), None, "shape"),
    (["A", "B"], (3, 79), None, "shape"),
    (["A", "B"], (2, 79), np.nan, "non-finite"),
    (["A", "B"], (2, 79), np.inf, "non-finite"),
    (["A", 7], (2, 79), None, "strings"),
])
def test_bad_input_raises_without_touching_state(model, symbols, shape, poison, match):
    rng = np.random.default_rng(2)
    x = _features(rng, 2)
    engine, untouched = ReferenceEngine(model), ReferenceEngine(model)
    engine.step(["A", "B"], x)
    untouched.step(["A", "B"], x)
    bad = np.ones(shape, np.float32)
    if poison is not None:
        bad[1, 5] = poison
    with pytest.raises(ValueError, match=match):
        engine.step(symbols, bad)
    np.testing.assert_array_equal(engine.step(["A", "B"], x), untouched.step(["A", "B"], x))
    assert engine.symbols == ["A", "B"]


@pytest.mark.parametrize("seed", range(3))
def test_repeated_symbols_equal_one_request_at_a_time(model, seed):
    """A step carrying several requests of a symbol (in arrival order, interleaved with other symbols) gives
    the predictions and states of stepping those requests one at a time."""
    rng = np.random.default_rng(seed)
    symbols = list(rng.choice(["A", "B", "C", "D"], size=11))
    x = _features(rng, len(symbols))
    warm = _features(rng, 2)
    together, alone = ReferenceEngine(model), ReferenceEngine(model)
    together.step(["A", "C"], warm)
    alone.step(["A", "C"], warm)
    got = together.step(symbols, x)
    want = np.concatenate([alone.step([s], x[i:i + 1]) for i, s in enumerate(symbols)])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    after = _features(rng, 4)  # the states after the step agree too
    np.testing.assert_allclose(together.step(["A", "B", "C", "D"], after), alone.step(["A", "B", "C", "D"], after),
                               rtol=1e-5, atol=1e-6)


def test_a_bad_row_leaves_every_state_of_the_step_as_it_was(model):
    rng = np.random.default_rng(5)
    engine, untouched = ReferenceEngine(model), ReferenceEngine(model)
    x = _features(rng, 4)
    x[2, 3] = np.nan
    with pytest.raises(ValueError, match=r"non-finite features in rows \[2\]"):
        engine.step(["A", "A", "A", "B"], x)
    y = _features(rng, 2)
    np.testing.assert_array_equal(engine.step(["A", "B"], y), untouched.step(["A", "B"], y))


def test_integer_features_are_rejected(model):
    with pytest.raises(ValueError, match="floating point"):
        ReferenceEngine(model).step(["A"], np.ones((1, 79), np.int64))


def test_empty_step(model):
    assert ReferenceEngine(model).step([], np.zeros((0, 79), np.float32)).shape == (0, 4)


def test_make_engine(model):
    assert make_engine("reference", model).name == "reference"
    assert "reference" in ENGINES
    with pytest.raises(ValueError, match="unknown engine 'slow'"):
        make_engine("slow", model)


@pytest.mark.skipif(importlib.util.find_spec("client.engine.fast") is not None, reason="the fast engine is present")
def test_missing_fast_engine_says_so(model):
    with pytest.raises(ValueError, match="engine 'fast' is not available"):
        make_engine("fast", model)
