"""The fast engine against the fp32 reference: same code path on the CPU (kernels' PyTorch references, or the
Triton kernels through the interpreter), CUDA graphs and padding on a GPU."""
import gc
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch

from client.engine.fast import PAD_SLOT, CapacityError, FastEngine
from client.engine.precision import DEFAULT_PRECISION, FP32_PRECISION, Precision, StateStorage
from client.engine.reference import ReferenceEngine
from client.model import ModelLoader, load_model
from kernels._common import INTERPRET
from kernels.slstm_step import supports as slstm_supports

REPO = Path(__file__).resolve().parents[1]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
RUNS_TRITON = INTERPRET or torch.cuda.is_available()


def random_steps(seed, steps, symbols, max_batch=None):
    """Steps of distinct random symbols; new symbols keep appearing as the stream goes on."""
    rng = np.random.default_rng(seed)
    for t in range(steps):
        known = symbols[: min(len(symbols), 2 + t)]
        k = int(rng.integers(1, min(len(known), max_batch or len(known)) + 1))
        chosen = [str(s) for s in rng.choice(known, k, replace=False)]
        yield chosen, rng.standard_normal((k, 79)).astype(np.float32)


def backlog_steps(seed, steps, symbols, max_requests):
    """Steps carrying up to max_requests requests of each of some symbols, interleaved in arrival order."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        chosen = [str(s) for s in rng.choice(symbols, int(rng.integers(1, len(symbols) + 1)), replace=False)]
        rows = [s for s in chosen for _ in range(int(rng.integers(1, max_requests + 1)))]
        rows = [rows[i] for i in rng.permutation(len(rows))]
        yield rows, rng.standard_normal((len(rows), 79)).astype(np.float32)


def one_at_a_time(engine, symbols, features):
    return np.concatenate([engine.step([s], features[i:i + 1]) for i, s in enumerate(symbols)])


def compare(fast, ref, steps, seed=0, n_symbols=6):
    symbols = [f"SYM_{i:03d}" for i in range(n_symbols)]
    errors = []
    for chosen, feats in random_steps(seed, steps, symbols):
        got, want = fast.step(chosen, feats), ref.step(chosen, feats)
        assert np.isfinite(got).all()
        errors.append(np.abs(got - want))
    return np.concatenate(errors)


def test_fp32_fast_path_equals_reference_through_the_host_tier():
    model, _ = load_model("tiny", seed=1)
    fast = FastEngine(model, device="cpu", precision=FP32_PRECISION, capacity=2, host_symbols=8, progress=False)
    err = compare(fast, ReferenceEngine(model, device="cpu"), steps=40)
    assert err.max() < 2e-5, err.max(0)
    assert fast.table.capacity == 2 and fast.table.stats["offloaded"] > 0 and fast.table.stats["restored"] > 0


def test_offloaded_symbols_continue_bit_for_bit():
    model, _ = load_model("tiny", seed=4)
    tight = FastEngine(model, device="cpu", capacity=2, host_symbols=6, reserve=1, progress=False)
    roomy = FastEngine(model, device="cpu", capacity=6, host_symbols=0, progress=False)
    for chosen, feats in random_steps(5, 40, [f"S{i}" for i in range(6)], max_batch=2):
        assert np.array_equal(tight.step(chosen, feats), roomy.step(chosen, feats))
    assert tight.table.stats["restored"] > 0 and roomy.table.stats["offloaded"] == 0


def test_prefetch_and_ready_keep_states_bit_for_bit():
    """Requests announced ahead of their steps (prefetch on arrival, ready polled as a scheduler would) through a
    2-slot table: the same predictions, bit for bit, as an engine that never moves a state."""
    model, _ = load_model("tiny", seed=4)
    tight = FastEngine(model, device="cpu", capacity=2, host_symbols=6, reserve=1, progress=False)
    roomy = FastEngine(model, device="cpu", capacity=6, host_symbols=0, progress=False)
    steps = list(random_steps(6, 40, [f"S{i}" for i in range(6)], max_batch=2))
    for i, (chosen, feats) in enumerate(steps):
        tight.prefetch([s for later, _ in steps[i + 1:i + 3] for s in later])  # the next steps' requests arrived
        for symbol in chosen:
            tight.ready(symbol)
        assert np.array_equal(tight.step(chosen, feats), roomy.step(chosen, feats))
    assert tight.table.stats["restored_ahead"] > 0
    assert tight.describe()["reserve"] == 1 and tight.describe()["host_symbols"] == 6


def test_an_engine_from_a_loader_steps_alike_and_keeps_no_model():
    """A loader instead of the model: called once, the model collected once the engine is built (its tiers are sized
    without it), and the same predictions, bit for bit, as an engine built from the model; the reference engine,
    through make_engine, steps the loaded model. A loader that returns no model is refused."""
    from client.engine import make_engine

    calls, refs = [], []

    def load():
        model, _ = load_model("tiny", seed=4)
        calls.append(1)
        refs.append(weakref.ref(model))
        return model

    loaded = FastEngine(load, device="cpu", capacity=6, host_symbols=0, progress=False)
    gc.collect()
    assert len(calls) == 1 and refs[0]() is None
    model, fingerprint = load_model("tiny", seed=4)
    held = FastEngine(model, device="cpu", capacity=6, host_symbols=0, progress=False)
    loader = ModelLoader("tiny", seed=4)
    assert loader.fingerprint is None  # until it loads
    reference = make_engine("reference", loader, device="cpu", progress=False)
    assert loader.fingerprint == fingerprint
    for chosen, feats in random_steps(7, 20, [f"S{i}" for i in range(6)]):
        got = loaded.step(chosen, feats)
        assert np.array_equal(got, held.step(chosen, feats))
        assert np.abs(got - reference.step(chosen, feats)).max() < 1e-3
    with pytest.raises(TypeError, match="must return the model"):
        FastEngine(lambda: ("not", "a model"), device="cpu", capacity=2, progress=False)
    with pytest.raises(TypeError, match="the model or a loader returning it, got NoneType"):
        FastEngine(None, device="cpu", capacity=2, progress=False)


SLOTS_BESIDE_MODEL = """
import sys
from client.engine.fast import FastEngine
from client.model import load_model
def load():
    return load_model("medium", seed=0, device="cuda")[0]
model = load() if sys.argv[1] == "held" else None
engine = FastEngine(model if model is not None else load, device="cuda", graphs=False, host_symbols=0, progress=False)
print(engine.table.capacity)
"""


@cuda
def test_a_loaded_models_memory_counts_as_free_for_the_state_table_on_gpu():
    """On a GPU the state table's share of free memory leaves out a model the engine loaded and dropped: more slots
    than beside a model held on the GPU (the medium preset on an H200: 24,126 and 24,137; the full preset 703 and
    739). Each engine in a process of its own (an engine dropped in a process leaves some of its memory behind)."""
    def slots(mode):
        done = subprocess.run([sys.executable, "-c", SLOTS_BESIDE_MODEL, mode], capture_output=True, text=True,
                              cwd=REPO, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        return int(done.stdout)

    held, loaded = slots("held"), slots("loaded")
    assert loaded > held, (held, loaded)


def test_default_reserve_is_at_most_an_eighth_of_the_table():
    model, _ = load_model("tiny", seed=0)
    assert FastEngine(model, device="cpu", capacity=2, progress=False).table.reserve == 0
    assert FastEngine(model, device="cpu", capacity=200, progress=False).table.reserve == 8


def test_a_host_tier_beyond_the_hosts_memory_is_refused_before_anything_is_built():
    model, _ = load_model("tiny", seed=0)
    with pytest.raises(ValueError, match="lower --host-symbols"):
        FastEngine(model, device="cpu", capacity=2, host_symbols=10**9, progress=False)


def test_symbol_beyond_every_tier_fails_alone():
    model, _ = load_model("tiny", seed=0)
    fast = FastEngine(model, device="cpu", capacity=1, host_symbols=1, progress=False)
    ones = np.ones((1, 79), np.float32)
    first = fast.step(["A"], ones)
    fast.step(["B"], ones)
    assert list(fast.unplaceable(["C"])) == ["C"] and fast.unplaceable(["A"]) == {}
    with pytest.raises(CapacityError, match="1 on the CPU and 1 in host memory"):
        fast.step(["C"], ones)
    fresh = FastEngine(model, device="cpu", capacity=2, progress=False)
    fresh.step(["A"], ones)
    assert np.array_equal(fast.step(["A"], ones), fresh.step(["A"], ones))  # A lost nothing
    assert not np.array_equal(first, fast.step(["A"], ones))


@pytest.mark.parametrize("parts, rows", [({"max_batch": 1}, ["A", "C"]), ({"max_rows_per_symbol": 1}, ["A", "A", "C"])])
def test_a_step_run_as_parts_refuses_a_symbol_beyond_every_tier_before_any_part_runs(parts, rows):
    model, _ = load_model("tiny", seed=0)
    ones = np.ones((len(rows), 79), np.float32)
    fast, fresh = (FastEngine(model, device="cpu", capacity=2, progress=False, **parts) for _ in range(2))
    for engine in (fast, fresh):
        engine.step(["A", "B"], ones[:2])
    with pytest.raises(CapacityError, match=r"\(C\)"):
        fast.step(rows, ones)
    assert np.array_equal(fast.step(["A"], ones[:1]), fresh.step(["A"], ones[:1]))  # A lost nothing


def test_a_prefetch_between_the_parts_of_a_step_takes_none_of_its_room():
    """Room for 3 more symbols in all (3 GPU slots, 1 host slot, X held): a step of A, B, C runs as two parts of at
    most 2 symbols, and a request for a new symbol D arrives between them. D's prefetch must not take C's room (X
    to the host, D into its slot): C would be refused after A and B had advanced. D's own step is refused instead,
    naming the limits."""
    model, _ = load_model("tiny", seed=0)
    fast = FastEngine(model, device="cpu", precision=FP32_PRECISION, capacity=3, host_symbols=1, max_batch=2,
                      progress=False)
    alone = FastEngine(model, device="cpu", precision=FP32_PRECISION, capacity=6, progress=False)
    ones = np.ones((3, 79), np.float32)
    for engine in (fast, alone):
        engine.step(["X"], ones[:1])
    submit_part = fast._submit_part
    parts = []

    def part_then_arrival(*args, **kwargs):
        parts.append(submit_part(*args, **kwargs))
        if len(parts) == 1:
            threading.Thread(target=fast.prefetch, args=(["D"],)).run()  # the receiving thread's prefetch, here
        return parts[-1]

    fast._submit_part = part_then_arrival
    features = np.random.default_rng(3).standard_normal((3, 79)).astype(np.float32)
    np.testing.assert_allclose(fast.step(["A", "B", "C"], features), alone.step(["A", "B", "C"], features),
                               atol=1e-5)
    assert len(parts) == 2 and "D" not in fast.table.symbols()
    with pytest.raises(CapacityError, match=r"\(D\)"):
        fast.step(["D"], ones[:1])
    fast.prefetch(["E"])  # the step's room is let go once its last part is submitted: nothing left for E either
    assert sorted(fast.table.symbols()) == ["A", "B", "C", "X"]


def test_a_step_of_more_symbols_than_gpu_slots_runs_through_the_host_tier():
    """The GPU holds 2 states, the host 4 more: a step of 4 symbols runs as parts that fit the GPU, and none of its
    symbols is refused (the team client answers errors for those unplaceable names)."""
    model, _ = load_model("tiny", seed=0)
    tight = FastEngine(model, device="cpu", precision=FP32_PRECISION, capacity=2, host_symbols=4, progress=False)
    alone = FastEngine(model, device="cpu", precision=FP32_PRECISION, capacity=6, progress=False)
    rows = ["A", "B", "A", "C", "D", "B"]
    assert tight.unplaceable(rows) == {}
    for seed in range(2):
        features = np.random.default_rng(seed).standard_normal((len(rows), 79)).astype(np.float32)
        np.testing.assert_allclose(tight.step(rows, features), one_at_a_time(alone, rows, features), atol=1e-5)
    assert list(tight.unplaceable(["E", "F", "G"])) == ["G"]  # 6 symbols in all: room for two more


def test_default_precision_within_atol_over_a_long_stream():
    model, _ = load_model("small", seed=2)
    fast = FastEngine(model, device="cpu", progress=False)
    assert fast.describe()["precision"]["retnet"] == "float32"
    err = compare(fast, ReferenceEngine(model, device="cpu"), steps=150, seed=3, n_symbols=4)
    assert (err <= 1e-3).mean(axis=0).min() == 1.0, err.max(0)


def test_idle_slots_and_padding_slot_are_untouched():
    model, _ = load_model("tiny", seed=0)
    fast = FastEngine(model, device="cpu", progress=False)
    fast.step(["A", "B", "C"], np.random.default_rng(0).standard_normal((3, 79)).astype(np.float32))
    before = {k: v.clone() for k, v in fast.table.tensors.items()}
    fast.step(["B"], np.random.default_rng(1).standard_normal((1, 79)).astype(np.float32))
    slot_b = fast.table.slot_of["B"]
    tables = fast.table.tensors
    for name, t in tables.items():
        for slot in range(t.shape[0]):
            if slot != slot_b:
                assert torch.equal(t[slot], before[name][slot]), (name, slot)
    assert not torch.equal(tables["mamba2.0.h"][slot_b], before["mamba2.0.h"][slot_b])
    assert PAD_SLOT != slot_b
    # slots not yet given out still hold the initial state, which a new symbol takes over as it is
    table = fast.table
    for name, (_, _, init) in table.parts[0].layout.items():
        assert (tables[name][len(table.slot_of) + 1:] == init).all(), name


def test_bad_input_touches_no_state():
    model, _ = load_model("tiny", seed=0)
    fast = FastEngine(model, device="cpu", progress=False)
    fast.step(["A"], np.zeros((1, 79), np.float32) + 0.5)
    before = {k: v.clone() for k, v in fast.table.tensors.items()}
    bad = np.ones((2, 79), np.float32)
    bad[1, 3] = np.nan
    with pytest.raises(ValueError, match="non-finite"):
        fast.step(["A", "B"], bad)
    bad = np.ones((3, 79), np.float32)
    bad[2, 0] = np.inf  # a symbol's later request is bad: its earlier ones in the step do not run either
    with pytest.raises(ValueError, match="non-finite"):
        fast.step(["A", "A", "A"], bad)
    with pytest.raises(ValueError, match="shape"):
        fast.step(["A"], np.ones((1, 78), np.float32))
    assert fast.symbols == ["A"]
    assert all(torch.equal(v, before[k]) for k, v in fast.table.tensors.items())


def test_every_precision_gives_the_slstm_weights_its_kernel_takes():
    """The sLSTM's maps are packed 16-bit (fp32 ones split into fp16 halves) in every precision: a PyTorch
    reference would read each step's plan on the host, which no CUDA graph can hold (its capture failed at start
    before the split fp32 state maps)."""
    model, _ = load_model("tiny", seed=2)
    for spec, lows in (("auto", (4,)), ("bf16", None), ("fp16", None), ("fp32", (2, 4)),
                       ("auto,xlstm.slstm=fp32", (2, 4))):
        engine = FastEngine(model, device="cpu", precision=Precision.parse(spec), capacity=1, progress=False)
        for block in engine.runner.towers[0].blocks:
            assert slstm_supports(block.s_weight), spec
            assert (None if block.s_weight_lo is None else tuple(block.s_weight_lo.shape[:-3])) == lows, spec


@cuda
def test_fp32_weights_step_through_graphs_on_gpu():
    """The fp32 precision on a GPU: captured in graphs like any other, within 1e-4 of the fp32 reference."""
    model, _ = load_model("tiny", seed=2)
    fast = FastEngine(model, device="cuda", precision=FP32_PRECISION, capacity=2, host_symbols=2, progress=False)
    alone = ReferenceEngine(model, device="cpu")
    assert fast.describe()["graphs"]
    feats = np.random.default_rng(4).standard_normal((3, 79)).astype(np.float32)
    got, want = fast.step(["A", "A", "B"], feats), one_at_a_time(alone, ["A", "A", "B"], feats)
    assert np.abs(got - want).max() < 1e-4


@pytest.mark.parametrize("precision, tolerance", [(FP32_PRECISION, 1e-6), (DEFAULT_PRECISION, 2e-4)])
def test_several_requests_of_a_symbol_in_one_step_equal_one_at_a_time(precision, tolerance):
    """Each symbol's requests of a step advance its state in order: the predictions and the states after are those
    of stepping the requests one at a time (within the rounding of products over other rows: fp32 products, or
    activations rounded to fp16, whose roundings such differences can flip). Steps larger than max_batch symbols
    or max_rows_per_symbol requests of a symbol run as several, in order; states move through the host tier."""
    model, _ = load_model("tiny", seed=2)
    together = FastEngine(model, device="cpu", precision=precision, max_batch=3, max_rows_per_symbol=2, capacity=3,
                          host_symbols=4, progress=False)
    alone = FastEngine(model, device="cpu", precision=precision, capacity=6, progress=False)
    symbols = [f"S{i}" for i in range(6)]
    for rows, feats in backlog_steps(1, 12, symbols, max_requests=5):
        got, want = together.step(rows, feats), one_at_a_time(alone, rows, feats)
        assert np.abs(got - want).max() < tolerance, np.abs(got - want).max(0)
    assert together.table.stats["restored"] > 0
    after = np.random.default_rng(9).standard_normal((6, 79)).astype(np.float32)
    assert np.abs(together.step(symbols, after) - alone.step(symbols, after)).max() < tolerance


def test_a_step_of_several_requests_touches_only_its_symbols_slots():
    model, _ = load_model("tiny", seed=0)
    fast = FastEngine(model, device="cpu", progress=False)
    fast.step(["A", "B", "C"], np.random.default_rng(0).standard_normal((3, 79)).astype(np.float32))
    before = {k: v.clone() for k, v in fast.table.tensors.items()}
    fast.step(["B", "B", "B"], np.random.default_rng(1).standard_normal((3, 79)).astype(np.float32))
    slot_b = fast.table.slot_of["B"]
    for name, t in fast.table.tensors.items():
        for slot in range(t.shape[0]):
            if slot != slot_b:
                assert torch.equal(t[slot], before[name][slot]), (name, slot)


# run on a CPU through the interpreter (tests/triton_interpreter.py); with CUDA the GPU tests run the kernels natively
INTERPRETER_CASES = "through_the_interpreter"


@pytest.mark.skipif(RUNS_TRITON, reason="this process runs the Triton kernels directly")
def test_triton_under_interpreter(interpreter_cases):
    interpreter_cases.check(__file__)


@pytest.mark.skipif(not INTERPRET, reason="the CPU's Triton kernels run under the interpreter (INTERPRETER_CASES)")
def test_triton_kernels_through_the_interpreter_match_reference(monkeypatch):
    """The engine with the real Triton kernels, every product through the skinny kernel."""
    import client.engine.fast.layers as layers

    model, _ = load_model("tiny", seed=5)
    fast = FastEngine(model, device="cpu", max_rows_per_symbol=3, progress=False)
    ref = ReferenceEngine(model, device="cpu")
    monkeypatch.setattr(layers, "skinny_pays", lambda M, N: True)  # the tiny preset's products are all narrow
    fast.runner.set_skinny((torch.float32, torch.float16))
    rng = np.random.default_rng(0)
    for symbols in (["A", "B"], ["B"], ["A", "C", "B"], ["C", "A", "C", "C", "B", "A"]):
        features = rng.standard_normal((len(symbols), 79)).astype(np.float32)
        assert np.abs(fast.step(symbols, features) - ref.step(symbols, features)).max() < 1e-3, symbols


@cuda
def test_graphs_match_eager_and_reference_on_gpu():
    model, _ = load_model("medium", seed=0, device="cuda")
    graphed = FastEngine(model, device="cuda", max_batch=8, capacity=3, host_symbols=8, progress=False)
    eager = FastEngine(model, device="cuda", graphs=False, capacity=8, host_symbols=0, progress=False)
    ref = ReferenceEngine(model, device="cuda")
    symbols = [f"S{i}" for i in range(7)]
    for chosen, feats in random_steps(4, 60, symbols, max_batch=8):
        g, e, r = graphed.step(chosen, feats), eager.step(chosen, feats), ref.step(chosen, feats)
        # a padded bucket may pick another cuBLAS algorithm than the eager batch: compare within fp16 rounding
        assert np.abs(g - e).max() < 5e-4, np.abs(g - e).max(0)
        assert np.abs(g - r).max() < 2e-3, np.abs(g - r).max(0)
    assert graphed.table.stats["restored"] > 0  # 7 symbols through 3 slots, with the graphs never captured again


@cuda
def test_several_requests_per_symbol_through_the_graphs_on_gpu():
    """Steps of several requests per symbol replay the graphs of their shape (rows, symbols, requests of a
    symbol): the predictions of one request at a time; the padding rows and empty sequences touch no slot."""
    model, _ = load_model("small", seed=1, device="cuda")
    graphed = FastEngine(model, device="cuda", max_batch=4, max_rows_per_symbol=4, capacity=5, host_symbols=8,
                         progress=False)
    alone = FastEngine(model, device="cuda", graphs=False, capacity=8, host_symbols=0, progress=False)
    symbols = [f"S{i}" for i in range(7)]
    pending = []
    for rows, feats in backlog_steps(2, 30, symbols, max_requests=6):
        pending.append((graphed.submit(rows, feats), one_at_a_time(alone, rows, feats)))
    for got, want in pending:
        assert np.abs(got.result() - want).max() < 5e-4
    torch.cuda.synchronize()
    before = {k: v.clone() for k, v in graphed.table.tensors.items()}
    graphed.step(["S1", "S1", "S1", "S2"], np.ones((4, 79), np.float32))  # two of the shape's four sequences empty
    torch.cuda.synchronize()
    live = {graphed.table.slot_of[s] for s in ("S1", "S2")}
    for name, t in graphed.table.tensors.items():
        for slot in range(t.shape[0]):
            if slot not in live:
                assert torch.equal(t[slot], before[name][slot]), (name, slot)
    assert graphed.table.stats["restored"] > 0


@cuda
def test_padding_rows_never_touch_live_state_on_gpu():
    model, _ = load_model("small", seed=0, device="cuda")
    fast = FastEngine(model, device="cuda", max_batch=8, capacity=10, host_symbols=0, progress=False)
    fast.step(["A", "B", "C"], np.ones((3, 79), np.float32))
    torch.cuda.synchronize()
    before = {k: v.clone() for k, v in fast.table.tensors.items()}
    fast.step(["B"], np.ones((1, 79), np.float32))
    fast.step(list("ABCDEFG"), np.ones((7, 79), np.float32))  # bucket 8: one padding row
    torch.cuda.synchronize()
    live = {fast.table.slot_of[s] for s in "ABCDEFG"}
    for name, t in fast.table.tensors.items():
        for slot in range(1, t.shape[0]):
            if slot not in live:
                assert torch.equal(t[slot], before[name][slot]), (name, slot)


@cuda
def test_a_tower_on_the_launching_stream_holds_back_no_other_tower_on_gpu():
    """A step launched on one of the towers' own streams (a caller's choice): the towers after that one still
    start with the step, not after its whole chain."""
    from client.engine.fast.runner import padding_plan, step_shapes
    model, _ = load_model("tiny", seed=0, device="cuda")
    runner = FastEngine(model, device="cuda", graphs=False, capacity=4, host_symbols=0, progress=False).runner
    slow_done, later_started = torch.cuda.Event(), torch.cuda.Event()

    class Wrapped:
        def __init__(self, tower, before, after=None):
            self.tower, self.before, self.after = tower, before, after

        def __getattr__(self, name):
            return getattr(self.tower, name)

        def __call__(self, *args):
            self.before()
            out = self.tower(*args)
            if self.after:
                self.after()
            return out

    towers = runner.towers
    runner.towers = [towers[0], Wrapped(towers[1], lambda: torch.cuda._sleep(400_000_000), slow_done.record),
                     Wrapped(towers[2], later_started.record), towers[3]]
    shape = step_shapes(1, 1)[0]
    with torch.cuda.stream(runner.streams[1]):  # launched on the slow tower's own stream
        runner(padding_plan(shape, runner.device), torch.zeros(shape.rows, 79, device="cuda"))
    later_started.synchronize()
    assert not slow_done.query()  # the tower after it started while the slow one still ran
    torch.cuda.synchronize()


@cuda
def test_precompile_threads_touch_only_the_padding_slot_on_gpu():
    """The startup's kernel compile (one eager step a bucket, buckets in threads) leaves every symbol's state as
    it was, and the engine's steps after it are those of an engine stepped alone."""
    from client.engine.fast.runner import precompile, step_shapes
    model, _ = load_model("small", seed=0, device="cuda")
    fast = FastEngine(model, device="cuda", max_batch=8, capacity=10, host_symbols=0, progress=False)
    fast.step(["A", "B", "C"], np.ones((3, 79), np.float32))
    torch.cuda.synchronize()
    before = {k: v.clone() for k, v in fast.table.tensors.items()}
    precompile(fast.runner, step_shapes(8, 3))
    for name, t in fast.table.tensors.items():
        for slot in range(t.shape[0]):
            if slot != PAD_SLOT:
                assert torch.equal(t[slot], before[name][slot]), (name, slot)
    alone = FastEngine(model, device="cuda", max_batch=8, capacity=10, host_symbols=0, progress=False)
    alone.step(["A", "B", "C"], np.ones((3, 79), np.float32))
    features = np.random.default_rng(0).standard_normal((3, 79)).astype(np.float32)
    np.testing.assert_array_equal(fast.step(["A", "B", "C"], features), alone.step(["A", "B", "C"], features))


@cuda
def test_offload_and_return_with_steps_in_flight_on_gpu():
    """Pipelined submits (several steps enqueued) through a 3-slot table: every state moved to host memory and
    back lands byte for byte, as in an engine that never offloads."""
    model, _ = load_model("small", seed=1, device="cuda")
    tight = FastEngine(model, device="cuda", max_batch=4, capacity=3, host_symbols=16, reserve=1, progress=False)
    roomy = FastEngine(model, device="cuda", max_batch=4, capacity=12, host_symbols=0, progress=False)
    steps = list(random_steps(7, 80, [f"S{i}" for i in range(12)], max_batch=3))
    pending = [tight.submit(chosen, feats) for chosen, feats in steps[:2]]
    for i, (chosen, feats) in enumerate(steps):
        if i + 2 < len(steps):
            pending.append(tight.submit(*steps[i + 2]))
        assert np.array_equal(pending[i].result(), roomy.step(chosen, feats)), i
    assert tight.table.stats["offloaded"] > 10 and tight.table.stats["restored"] > 10


@cuda
def test_a_slow_return_holds_back_only_its_own_symbol_on_gpu():
    """X's return sits behind a long sleep on its copy stream: steps of other symbols are answered meanwhile, X is
    not ready until its copy is done, and every prediction is the one of an engine that never moves a state. No
    host memory is allocated or pinned after start."""
    model, _ = load_model("small", seed=2, device="cuda")
    tight = FastEngine(model, device="cuda", max_batch=4, capacity=4, host_symbols=8, reserve=1, progress=False)
    roomy = FastEngine(model, device="cuda", max_batch=4, capacity=12, host_symbols=0, progress=False)
    pool = tight.table.parts[0].host
    assert pool.pinned == pool.count == 9 and pool.slots.is_pinned()
    host_allocations = getattr(torch.cuda, "host_memory_stats", lambda: {})().get("num_host_alloc")
    rng = np.random.default_rng(0)

    def both(chosen):
        feats = rng.standard_normal((len(chosen), 79)).astype(np.float32)
        return tight.submit(chosen, feats), roomy.step(chosen, feats)

    def check(pending, want):
        np.testing.assert_array_equal(pending.result(), want)

    check(*both(["X"]))
    check(*both(["A", "B", "C"]))  # X out, to keep a slot free
    torch.cuda.synchronize()
    assert list(tight.table.offloaded) == ["X"]
    tight.table.before_copy = lambda symbol, direction: (
        torch.cuda._sleep(2_000_000_000) if (symbol, direction) == ("X", "to_gpu") else None)
    tight.prefetch(["X"])
    began = time.perf_counter()
    for _ in range(5):
        check(*both(["A", "B"]))
    quick = time.perf_counter() - began
    assert not tight.ready("X")
    while not tight.ready("X"):
        time.sleep(0.001)
    slow = time.perf_counter() - began
    assert quick < slow / 4, (quick, slow)
    tight.table.before_copy = None
    check(*both(["X", "A"]))
    for _ in range(30):  # symbols through the host tier, announced ahead
        chosen = [str(s) for s in rng.choice(list("ABCDEFGHX"), 3, replace=False)]
        tight.prefetch(chosen)
        check(*both(chosen))
    assert tight.table.stats["restored_ahead"] > 5
    assert getattr(torch.cuda, "host_memory_stats", lambda: {})().get("num_host_alloc") == host_allocations


@pytest.mark.parametrize("state_dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_16_bit_state_stays_close_to_fp32_state(state_dtype, rounding):
    model, _ = load_model("small", seed=6)
    half = FastEngine(model, device="cpu", capacity=4, state_storage=StateStorage.parse(state_dtype, rounding),
                      progress=False)
    full = FastEngine(model, device="cpu", capacity=4, progress=False)
    assert half.state_bytes < 0.75 * full.state_bytes
    assert half.describe()["state_dtype"] == state_dtype
    err = compare(half, full, steps=60, seed=2, n_symbols=4)
    assert np.isfinite(err).all() and err.max() < (2e-3 if state_dtype == "fp16" else 2e-2), err.max(0)
    if rounding == "stochastic":
        counter = half.table.tensors["steps"]
        assert int(counter[1:].sum()) == sum(len(c) for c, _ in random_steps(2, 60, [f"SYM_{i:03d}" for i in range(4)]))


def test_16_bit_state_moves_through_the_host_tier_bit_for_bit():
    model, _ = load_model("tiny", seed=7)
    options = dict(device="cpu", state_storage=StateStorage.parse("fp16:stochastic"), progress=False)
    tight = FastEngine(model, capacity=2, host_symbols=6, **options)
    roomy = FastEngine(model, capacity=6, host_symbols=0, **options)
    for chosen, feats in random_steps(8, 40, [f"S{i}" for i in range(6)], max_batch=2):
        assert np.array_equal(tight.step(chosen, feats), roomy.step(chosen, feats))
    assert tight.table.stats["restored"] > 0


def test_settings_are_values_parsed_where_they_come_in():
    model, _ = load_model("tiny", seed=0)
    with pytest.raises(TypeError, match=r"Precision.parse\('bf16'\)"):
        FastEngine(model, device="cpu", precision="bf16", progress=False)
    with pytest.raises(TypeError, match=r"StateStorage.parse\('fp16'\)"):
        FastEngine(model, device="cpu", state_storage="fp16", progress=False)


@cuda
def test_precompile_runs_a_shape_that_failed_in_the_threads_again_alone(monkeypatch, capsys):
    """A step shape that raises once in precompile's threads compiles in its launch after them and the engine
    starts; one that keeps raising raises."""
    from client.engine.fast import runner as runner_module

    model, _ = load_model("tiny", seed=0, device="cuda")
    engine = FastEngine(model, device="cuda", graphs=False, capacity=4, host_symbols=0, progress=False)
    runner = engine.shards[0].runner
    target = engine.shapes[-1]
    step = type(runner).__call__
    raised = []

    def flaky(self, plan, features, hand_fused=False):
        if features.shape[0] == target.rows and plan.seq_slots.shape[0] == target.sequences and (
                always or not raised):
            raised.append(target)
            raise TypeError("injected compile failure")
        return step(self, plan, features, hand_fused)

    monkeypatch.setattr(type(runner), "__call__", flaky)
    always = False
    runner_module.precompile(runner, engine.shapes)
    assert raised == [target] and "1 step shape(s) failed to compile side by side" in capsys.readouterr().err
    always = True
    with pytest.raises(TypeError, match="injected"):
        runner_module.precompile(runner, engine.shapes)


@cuda
def test_precompile_launches_every_kernel_it_compiled_one_at_a_time_after_the_threads():
    """compile_only compiles a kernel call of its thread and launches nothing (another thread's launches); after
    precompile every compiled kernel of the step was launched (its binary loaded), and running the shapes again
    compiles nothing new."""
    from client.engine.fast.runner import padding_plan
    from kernels._jit import compile_only, compiled_count, forget_compiled, jit_kernels, unlaunched
    from kernels.add_rms_norm import add_rms_norm

    x, delta, weight = torch.ones(3, 40, device="cuda"), torch.ones(3, 40, device="cuda"), torch.ones(40, device="cuda")
    other = torch.ones(3, 40, device="cuda")
    with compile_only(jit_kernels()):
        add_rms_norm(x, delta, None, weight, 1e-6)  # x += delta in place, had it been launched
        beside = threading.Thread(target=add_rms_norm, args=(other, delta, None, weight, 1e-6))
        beside.start()
        beside.join()
        torch.cuda.synchronize()
        assert torch.equal(x, torch.ones_like(x)) and torch.equal(other, torch.full_like(other, 2.0))
    add_rms_norm(x, delta, None, weight, 1e-6)
    assert torch.equal(x, torch.full_like(x, 2.0))

    forget_compiled(jit_kernels())  # this engine's compiles alone, as in a fresh process
    model, _ = load_model("tiny", seed=0, device="cuda")
    engine = FastEngine(model, device="cuda", graphs=False, capacity=4, host_symbols=0, progress=False)
    kernels = jit_kernels()
    assert compiled_count(kernels) > 0 and unlaunched(kernels) == []
    compiled, runner = compiled_count(kernels), engine.shards[0].runner
    features = torch.zeros(max(s.rows for s in engine.shapes), 79, device="cuda")
    for shape in engine.shapes:
        runner(padding_plan(shape, runner.device), features[:shape.rows], hand_fused=True)
    torch.cuda.synchronize()
    assert compiled_count(kernels) == compiled


@cuda
def test_precompile_recovers_a_kernel_that_kept_a_wrong_launcher(capsys):
    """The failure seen on Triton 3.6 (bench/LOG.md sections 45, 67): a compiled kernel whose launcher takes other
    arguments than its own, kept for the process. precompile's launches drop Triton's compiled kernels and run
    the shape again, and the engine's steps are then those of an engine that never failed."""
    from client.engine.fast import runner as runner_module
    from kernels._jit import jit_kernels

    slstm_module = sys.modules["kernels.slstm_step"]  # the package's slstm_step is the function
    model, _ = load_model("tiny", seed=0, device="cuda")
    engine = FastEngine(model, device="cuda", graphs=False, capacity=4, host_symbols=0, progress=False)
    runner = engine.shards[0].runner

    def wrong_launcher(*args, **kwargs):
        raise TypeError("only integer tensors of a single element can be converted to an index")

    poisoned = [compiled for caches in slstm_module._slstm_step_kernel.device_caches.values()
                for compiled in caches[0].values()]
    assert poisoned
    for compiled in poisoned:  # the launcher as Triton keeps it: `_run` behind a property, or `run` itself
        setattr(compiled, "_run" if "_run" in vars(compiled) else "run", wrong_launcher)
    runner_module.precompile(runner, engine.shapes)
    err = capsys.readouterr().err
    assert err.count("the first launches of step shape") == 1 and "only integer tensors" in err
    assert all(compiled not in caches[0].values() for kernel in jit_kernels()
               for caches in kernel.device_caches.values() for compiled in poisoned)
    alone = FastEngine(model, device="cuda", graphs=False, capacity=4, host_symbols=0, progress=False)
    features = np.random.default_rng(0).standard_normal((2, 79)).astype(np.float32)
    np.testing.assert_array_equal(engine.step(["A", "B"], features), alone.step(["A", "B"], features))


def test_step_shapes_hold_every_step():
    """Every step of at most max_batch symbols and K requests each has a captured shape that holds it."""
    from client.engine.fast.runner import shape_for, step_shapes

    for max_batch, k in ((64, 1), (64, 4), (64, 8), (8, 3), (2, 8), (1, 8), (20, 8)):
        shapes = step_shapes(max_batch, k)
        assert len(set(shapes)) == len(shapes)
        for symbols in range(1, max_batch + 1):
            for longest in range(1, k + 1):
                for rows in {symbols - 1 + longest, symbols * longest}:
                    shape = shape_for(shapes, rows, symbols, longest)
                    assert shape.rows >= rows and shape.sequences >= symbols and shape.max_rows >= longest
    assert len(step_shapes(64, 4)) == 24
    several = [shape.rows for shape in step_shapes(64, 8) if shape.max_rows > 1]
    assert several == [8, 16, 32, 64, 128, 256, 384, 512]  # a power of two apart, the two largest's midpoint
    assert [shape_for(step_shapes(64, 8), rows, 64, 8).rows for rows in (340, 384, 385)] == [384, 384, 512]
    assert [s.rows for s in step_shapes(20, 8) if s.max_rows > 1][-3:] == [128, 144, 160]
    assert not [s for s in step_shapes(64, 2) if s.rows == 96]  # two requests a symbol: no midpoint
    with pytest.raises(ValueError, match="exceeds every captured shape"):
        shape_for(step_shapes(64, 4), 10, 2, 5)


def test_a_steps_live_row_count_is_its_own_threads():
    """live_rows() is per thread: a step running beside another (precompile's threads, shards stepping eagerly)
    never reads the other's count, nor none where it set one."""
    from client.engine.fast import layers

    mine, theirs = torch.tensor([1], dtype=torch.int32), torch.tensor([2], dtype=torch.int32)
    inside, may_leave, seen = threading.Event(), threading.Event(), []

    def other():
        with layers.live_rows(theirs):
            inside.set()
            may_leave.wait(10)
            seen.append(layers._live_rows())

    thread = threading.Thread(target=other)
    thread.start()
    inside.wait(10)
    assert layers._live_rows() is None
    with layers.live_rows(mine):
        may_leave.set()
        thread.join(10)
        assert layers._live_rows() is mine
    assert seen == [theirs] and layers._live_rows() is None
