import importlib.util
import re
import subprocess
import sys
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch

from client.engine import ENGINES, make_engine
from client.engine.base import idle_symbols
from client.engine.precision import FP32_STATE, StateStorage
from client.engine.reference import ReferenceEngine
from client.engine.symbol_states import SymbolStates
from client.model import load_model
from conftest import checkout_env

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
    (["A", 7], (2, 79), None, r"symbols must be strings; row 1 holds 7 \(int\)"),
    ([b"A", "B"], (2, 79), None, r"symbols must be strings; row 0 holds b'A' \(bytes\)"),
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


@pytest.mark.parametrize("as_tensor", [
    lambda x: torch.from_numpy(x).requires_grad_(),
    lambda x: torch.from_numpy(x).to(torch.bfloat16),
    lambda x: torch.from_numpy(x).double().T.contiguous().T,  # float64, not contiguous
], ids=["requires_grad", "bf16", "float64_strided"])
def test_features_as_torch_tensors_step_as_their_values(model, as_tensor):
    """A tensor that requires grad, or is bf16, steps as its float32 values (numpy reads neither: they failed
    with torch's own RuntimeError or TypeError)."""
    x = as_tensor(_features(np.random.default_rng(9), 2))
    want = ReferenceEngine(model).step(["A", "B"], x.detach().float().numpy())
    np.testing.assert_array_equal(ReferenceEngine(model).step(["A", "B"], x), want)


@pytest.mark.parametrize("name", ENGINES)
def test_a_step_of_no_rows_given_as_empty_lists_answers_no_rows(model, name):
    """features as lists of lists: a step of no requests is [] (shape (0,), refused as not (0, 79))."""
    engine = make_engine(name, model, "cpu", progress=False)
    for features in ([], np.zeros((0, 79), np.float32)):
        out = engine.step([], features)
        assert out.shape == (0, 4) and out.dtype == np.float32
    with pytest.raises(ValueError, match=r"shape \(1, 79\) for 1 symbols, got \(0,\)"):  # as given, not (0, 79)
        engine.step(["A"], [])
    assert engine.symbols == []


@pytest.mark.parametrize("name", ENGINES)
def test_a_lone_string_of_symbols_is_refused_touching_nothing(model, name):
    """release("AB"), prefetch("AB") and step("AB", ...) are a mistake for ["AB"]: iterated, the string was a symbol
    per character (release forgot A and B, and kept AB; the fast engine's prefetch gave A and B slots)."""
    engine = make_engine(name, model, "cpu", progress=False)
    x = _features(np.random.default_rng(4), 3)
    engine.step(["A", "B", "AB"], x)
    for call in (lambda: engine.release("AB"), lambda: engine.prefetch("XY"), lambda: engine.step("AB", x[:2])):
        with pytest.raises(ValueError, match="symbols must be a list of strings, got the string"):
            call()
    assert engine.symbols == ["A", "B", "AB"]


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


# ------------------------------------------------------------------ the bounded state table (issue 21, item 4)

def test_states_beyond_the_device_capacity_wait_in_host_memory_and_come_back_unchanged(model):
    rng = np.random.default_rng(4)
    steps = [(["A", "B"], _features(rng, 2)), (["C"], _features(rng, 1)), (["A", "B"], _features(rng, 2)),
             (["C", "A"], _features(rng, 2))]
    bounded = ReferenceEngine(model, capacity=2, host_symbols=1)
    unbounded = ReferenceEngine(model, capacity=10)
    for symbols, features in steps:  # C pushes A (least recently used) to host memory, A comes back, ...
        np.testing.assert_array_equal(bounded.step(symbols, features), unbounded.step(symbols, features))
    stats = bounded._states.stats
    assert stats["offloaded"] >= 2 and stats["restored"] >= 2
    assert bounded.symbols == ["A", "B", "C"] and bounded._states.on_host == 1


def test_a_symbol_beyond_every_tier_is_refused_naming_the_limits_and_nothing_changes(model):
    rng = np.random.default_rng(5)
    x = _features(rng, 3)
    engine, untouched = ReferenceEngine(model, capacity=2, host_symbols=1), ReferenceEngine(model, capacity=3)
    engine.step(["A", "B"], x[:2]), engine.step(["C"], x[2:])
    untouched.step(["A", "B"], x[:2]), untouched.step(["C"], x[2:])
    why = engine.unplaceable(["A", "D"])
    assert list(why) == ["D"] and "no room for the state of 1 symbol(s) (D): 2 on cpu and 1 in host memory" in why["D"]
    with pytest.raises(RuntimeError, match=r"raise --state-memory \(or --state-slots\) or --host-symbols, or let idle "
                                           r"symbols expire"):
        engine.step(["A", "D"], x[:2])
    assert engine.unplaceable(["A", "C"]) == {} and engine.symbols == ["A", "B", "C"]
    np.testing.assert_array_equal(engine.step(["A", "B"], x[:2]), untouched.step(["A", "B"], x[:2]))


def test_idle_symbols_are_forgotten_so_new_ones_fit(model):
    rng = np.random.default_rng(6)
    engine = ReferenceEngine(model, capacity=2, idle_timeout_s=0.2)
    fresh = ReferenceEngine(model, capacity=2)
    for round_ in range(3):  # 6 symbols through 2 places: each pair expires before the next arrives
        symbols = [f"S{2 * round_}", f"S{2 * round_ + 1}"]
        x = _features(rng, 2)
        np.testing.assert_array_equal(engine.step(symbols, x), fresh.step(symbols, x))
        fresh.release(symbols)
        assert engine.symbols == symbols or engine.symbols[-2:] == symbols
        time.sleep(0.25)
    assert len(engine.symbols) <= 2 and engine._states.stats["expired"] >= 4


def test_many_new_symbols_keep_the_table_bounded(model):
    engine = ReferenceEngine(model, capacity=8, host_symbols=8, idle_timeout_s=0.05)
    rng = np.random.default_rng(7)
    answered = refused = 0
    for start in range(0, 400, 4):  # 400 symbols, 4 a step, each seen once
        symbols = [f"N{i}" for i in range(start, start + 4)]
        placeable = [s for s in symbols if s not in engine.unplaceable(symbols)]
        refused += len(symbols) - len(placeable)
        answered += len(engine.step(placeable, _features(rng, len(placeable))))
        assert len(engine.symbols) <= 16
        time.sleep(0.01)
    assert answered + refused == 400 and answered > 0


def test_placing_a_step_reads_the_table_once_and_expiry_only_its_idle_front():
    """With many symbols in host memory, a step's placement read every symbol's last use once for each state it
    moved out (64 new symbols, 20,000 in host memory: 79 ms a step) and the idle check read every symbol three
    times a step (4 ms): now the least recently used are found in one read of the table, and the idle ones at
    the front of the symbols in order of last use. The same states move and expire."""
    class CountingReads(OrderedDict):
        reads = 0

        def __getitem__(self, symbol):
            CountingReads.reads += 1
            return super().__getitem__(symbol)

        def items(self):
            for item in super().items():
                CountingReads.reads += 1
                yield item
    now = [0.0]
    states = SymbolStates("cpu", capacity=100, host_capacity=1000, idle_timeout_s=50.0, clock=lambda: now[0])
    states._last_seen = CountingReads()
    for i in range(1000):  # 1,000 symbols seen 1 s apart: the first 100 resident, the rest in host memory
        states[f"S{i:04d}"] = {}
        now[0] += 1.0
    states._on_host.update(f"S{i:04d}" for i in range(100, 1000))
    now[0] = 999.5  # S0000..S0949 idle
    CountingReads.reads = 0
    assert (idle_symbols(states._last_seen, now[0], states.idle_timeout_s, {"S0001"})
            == [f"S{i:04d}" for i in range(950) if i != 1])
    assert CountingReads.reads == 951  # the idle ones and the first one that is not (a whole scan: 1,000)
    states.idle_timeout_s = None
    CountingReads.reads = 0
    states.place([f"N{i}" for i in range(10)])  # 10 new symbols: the 10 least recently used residents move out
    assert states._on_host == {f"S{i:04d}" for i in list(range(10)) + list(range(100, 1000))}
    assert CountingReads.reads == 100  # each resident's last use read once (once a move: 1,000)


def test_default_capacity_on_a_cpu_is_bounded_and_said(model, capsys):
    engine = make_engine("reference", model, "cpu")
    described = engine.describe()
    assert 1 <= described["capacity"] <= 1024 and described["host_symbols"] == 0
    assert described["state_bytes_per_symbol"] > 0
    assert capsys.readouterr().err.startswith(f"[reference engine] state table: {described['capacity']} symbols "
                                               f"on cpu (")


@pytest.mark.parametrize("options, message", [
    ({"state_storage": StateStorage.parse("fp16")},
     "--state-dtype fp16 applies to the fast engine; the reference engine keeps fp32 state"),
    ({"state_storage": StateStorage.parse("fp32,retnet=bf16")},
     "--state-dtype fp32,retnet=bf16 applies to the fast engine"),
    ({"split": "symbols"}, "--split symbols applies with --gpus 2 or more"),
    ({"capacity": 4, "state_memory": 0.5}, "capacity or its memory share, not both"),
    ({"state_memory": 0.99}, "--state-memory must be a share in (0, 0.95]"),
])
def test_engine_options_the_reference_engine_cannot_honour_are_refused(model, options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make_engine("reference", model, "cpu", **options)


@pytest.mark.parametrize("engine, options, message", [
    ("reference", {"capacity": 2.5}, "need whole numbers capacity >= 1 and host_capacity >= 0, got 2.5 and 0"),
    ("reference", {"host_symbols": 1.5}, "need whole numbers capacity >= 1 and host_capacity >= 0, got 1024 and 1.5"),
    ("fast", {"capacity": 2.5}, "capacity must be a positive whole number of symbols, got 2.5"),
    ("fast", {"host_symbols": -1}, "host_symbols must be a whole number of symbols >= 0, got -1"),
    ("fast", {"max_rows_per_symbol": 2.0}, "max_batch and max_rows_per_symbol must be positive whole numbers"),
    ("reference", {"gpus": 0}, "--gpus must be a whole number of at least 1, got 0"),
])
def test_counts_that_are_not_whole_numbers_are_refused_in_one_line(model, engine, options, message):
    """A float capacity was taken: the reference engine then failed every step ("slice indices must be integers"),
    the fast engine its start ("empty() takes 1 positional argument"); --gpus 0 ran on one device."""
    with pytest.raises(ValueError, match=re.escape(message)):
        make_engine(engine, model, "cpu", progress=False, **options)


def test_table_options_reach_the_reference_engine(model):
    engine = make_engine("reference", model, "cpu", capacity=3, host_symbols=2, idle_timeout_s=7.0,
                         state_storage=FP32_STATE)
    described = engine.describe()
    assert (described["capacity"], described["host_symbols"], described["idle_timeout_s"]) == (3, 2, 7.0)


def test_a_symbol_several_times_in_a_step_takes_one_place(model):
    rng = np.random.default_rng(8)
    x = _features(rng, 4)
    bounded, unbounded = ReferenceEngine(model, capacity=1, host_symbols=1), ReferenceEngine(model, capacity=4)
    np.testing.assert_array_equal(bounded.step(["A", "A", "A"], x[:3]), unbounded.step(["A", "A", "A"], x[:3]))
    np.testing.assert_array_equal(bounded.step(["B", "B"], x[:2]), unbounded.step(["B", "B"], x[:2]))  # A to host
    np.testing.assert_array_equal(bounded.step(["A"], x[3:]), unbounded.step(["A"], x[3:]))  # A back, as it was


def test_a_step_of_more_symbols_than_device_places_runs_through_the_host_tier(model):
    """One place on the device, three in host memory: a step of three symbols runs them in turn, none refused (the
    team client answers errors for those unplaceable names, and a refused request is lost to its symbol's state)."""
    rng = np.random.default_rng(9)
    bounded, unbounded = ReferenceEngine(model, capacity=1, host_symbols=3), ReferenceEngine(model, capacity=4)
    rows = ["A", "B", "A", "C", "B"]
    assert bounded.unplaceable(rows) == {}
    for _ in range(2):
        x = _features(rng, len(rows))
        np.testing.assert_allclose(bounded.step(rows, x), unbounded.step(rows, x), rtol=1e-5, atol=1e-6)
    assert list(bounded.unplaceable(["D", "E"])) == ["E"]  # four symbols in all: room for one more
    assert bounded._states.on_host == 2


def test_a_step_run_in_groups_forgets_none_of_its_own_symbols_as_idle(model):
    """An idle symbol with a request in the step keeps its state, however many groups the step runs as: the first
    group's placement forgot C, idle since before it, so C's request in the second group started from a fresh
    state (0.067 off)."""
    rng = np.random.default_rng(10)
    first, x = _features(rng, 1), _features(rng, 3)
    now = [0.0]
    grouped = ReferenceEngine(model, capacity=2, host_symbols=4, idle_timeout_s=5.0)  # [A, B], then [C]
    at_once = ReferenceEngine(model, capacity=3, idle_timeout_s=5.0)
    for engine in (grouped, at_once):
        engine._states.clock = lambda: now[0]
        engine.step(["C"], first)
    now[0] = 10.0  # C idle past the timeout, and requested again
    np.testing.assert_allclose(grouped.step(["A", "B", "C"], x), at_once.step(["A", "B", "C"], x), rtol=1e-5,
                               atol=1e-6)
    assert grouped._states.stats["expired"] == 0


def test_the_reference_engine_starts_without_triton():
    # pip installs Triton on Linux alone (pyproject.toml): elsewhere every CPU tool plays the reference engine
    root = Path(__file__).resolve().parent.parent
    code = ("import sys; sys.modules['triton'] = None  # import triton now raises ImportError\n"
            "import numpy as np\n"
            "from client.engine import make_engine\n"
            "from client.model import load_model\n"
            "engine = make_engine('reference', load_model('tiny', seed=0)[0], device='cpu')\n"
            "print(engine.step(['SYM_000'], np.zeros((1, 79), np.float32)).shape)")
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env=checkout_env(root), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stdout == "(1, 4)\n", done.stderr


def test_steps_run_with_fp32_products_whatever_the_process_set(model, monkeypatch):
    """The fp32 reference engine ran its products as the process set them: a team module turning TF32 on at import
    made the default engine's steps TF32 on a GPU (the targets and the fast engine's fp32 parts were kept fp32)."""
    seen = []
    forward = model.forward

    def recording(*args, **kwargs):
        seen.append(torch.backends.cuda.matmul.allow_tf32)
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", recording)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", True)
    engine = ReferenceEngine(model, device="cpu", capacity=2)
    engine.step(["A", "B", "A"], _features(np.random.default_rng(0), 3))
    assert seen == [False, False] and torch.backends.cuda.matmul.allow_tf32  # two rounds; the process's own back
