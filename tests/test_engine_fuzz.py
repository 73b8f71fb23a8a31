"""A seeded random-sequence driver of the engines' contract (client/engine/base.py) on the tiny preset, on the CPU.

Each session mixes steps of several requests of a symbol (1 .. max_rows_per_symbol + 3 of each, interleaved in
arrival order), steps of more symbols than the max batch, rows with NaN or inf in the middle of a symbol's run,
steps submitted ahead and joined later (in any order), releases (a released symbol comes back with a fresh state),
prefetches, and GPU tiers of 2-3 slots, so that states keep moving to the host tier and back. Every engine answers
what one request at a time through the fp32 reference answers: row i the prediction after request i.

A step with a non-finite row is refused whole, touching no state; the runtime then steps its other rows (the bad
request is answered with an error alone), which go on in order from the state before it."""
import weakref

import numpy as np
import pytest
import torch

from client.engine.base import CapacityError
from client.engine.fast import PAD_SLOT, FastEngine
from client.engine.fast.layers import StepPlan
from client.engine.fast.runner import shape_for
from client.engine.precision import DEFAULT_PRECISION, FP32_PRECISION
from client.engine.reference import ReferenceEngine
from client.engine.sharded import ShardedEngine
from client.model import load_model
from shard_checks import ShardHere

CAP = 2        # the fast engines' max_rows_per_symbol: a symbol's 1 .. CAP + 3 requests of a step run as parts
MAX_BATCH = 3  # the fast engines' max batch: steps of up to MAX_BATCH + 2 symbols run as parts
POOL = [f"Z{i}" for i in range(7)]
FP32_TOLERANCE = dict(rtol=1e-4, atol=2e-5)  # fp32 products over other rows round otherwise: a few ulps a step


@pytest.fixture(scope="module")
def model():
    return load_model("tiny", seed=6)[0]


def session(seed, actions, pool=POOL, cap=CAP, max_batch=MAX_BATCH):
    """The actions of one random session: ("step", symbols, features, how) with how "step" or "submit";
    ("join",) collects the steps submitted so far, in a random order; ("release", symbols); ("prefetch", symbols).
    Features hold NaN or inf in about a quarter of the steps, in the middle of a symbol's run where it has one."""
    rng = np.random.default_rng(seed)
    for _ in range(actions):
        kind = rng.choice(["step", "release", "prefetch", "join"], p=[0.65, 0.1, 0.15, 0.1])
        if kind == "join":
            yield ("join", int(rng.integers(1 << 30)))
        elif kind in ("release", "prefetch"):
            chosen = [str(s) for s in rng.choice(pool, int(rng.integers(1, 4)))]  # repeats, and unknown symbols
            yield (kind, chosen)
        else:
            distinct = int(rng.integers(0 if rng.random() < 0.05 else 1, min(len(pool), max_batch + 2) + 1))
            chosen = [str(s) for s in rng.choice(pool, distinct, replace=False)]
            rows = [s for s in chosen for _ in range(int(rng.integers(1, cap + 4)))]
            rows = [rows[i] for i in rng.permutation(len(rows))]
            features = rng.standard_normal((len(rows), 79)).astype(np.float32)
            if rows and rng.random() < 0.25:
                runs = {s: [i for i, r in enumerate(rows) if r == s] for s in chosen}
                symbol = max(runs, key=lambda s: (len(runs[s]), s))
                run = runs[symbol]
                bad = run[len(run) // 2] if len(run) > 2 else run[-1]
                features[bad, int(rng.integers(79))] = rng.choice([np.nan, np.inf, -np.inf])
                if rng.random() < 0.3:  # another symbol's first request too
                    features[int(rng.integers(len(rows))), 0] = np.nan
            yield ("step", rows, features, "submit" if rng.random() < 0.4 else "step")


class Oracle:
    """The contract's answer: each request alone, one at a time, through an fp32 reference with room for all."""

    def __init__(self, model):
        self.engine = ReferenceEngine(model, device="cpu", capacity=64)

    def step(self, symbols, features):
        out = np.zeros((len(symbols), 4), np.float32)
        for i, symbol in enumerate(symbols):
            out[i] = self.engine.step([symbol], features[i:i + 1])[0]
        return out

    def release(self, symbols):
        self.engine.release(symbols)


def play(engine, model, actions, tolerance, check=None, clock=None):
    """Drive `engine` through the actions beside the oracle; compare every answer. check(engine): invariants of the
    engine's own, after each action. clock: [now], the engine's idle clock, moved on by up to a second after each
    action; the symbols the engine says it forgot as idle are then released in the oracle (a fresh state next).
    Returns the counts of what ran."""
    oracle = Oracle(model)
    pending, ran = [], {"rows": 0, "refused": 0, "joined": 0, "released": 0, "capacity": 0, "expired": 0}
    live, prefetched = set(), set()
    ticks = np.random.default_rng(0)  # the idle clock's steps
    if clock is not None:
        engine.expired()  # from now on it keeps them

    def compare(got, want, what):
        assert got.shape == want.shape and got.dtype == np.float32, what
        np.testing.assert_allclose(got, want, **tolerance, err_msg=what)

    for number, action in enumerate(actions):
        what = f"action {number}: {action[0]} {action[1] if action[0] != 'join' else ''}"
        if action[0] == "step":
            _, symbols, features, how = action
            finite = np.isfinite(features).all(axis=1)
            if not finite.all():  # refused whole, touching no state; the runtime steps the other rows
                with pytest.raises(ValueError, match="non-finite"):
                    (engine.submit if how == "submit" else engine.step)(symbols, features)
                ran["refused"] += int((~finite).sum())
                symbols, features = [s for s, ok in zip(symbols, finite) if ok], features[finite]
            if engine.unplaceable(symbols):  # no room in any tier: refused whole, touching no state
                with pytest.raises(CapacityError):
                    engine.step(symbols, features)
                ran["capacity"] += 1
            else:
                want = oracle.step(symbols, features)
                live.update(symbols)
                ran["rows"] += len(symbols)
                if how == "submit":
                    pending.append((engine.submit(symbols, features), want, what))
                else:
                    compare(engine.step(symbols, features), want, what)
        elif action[0] == "join":
            for i in np.random.default_rng(action[1]).permutation(len(pending)):
                step, want, submitted = pending[i]
                compare(step.result(), want, f"{submitted}, joined at {what}")
            ran["joined"] += len(pending)
            pending = []
        elif action[0] == "release":
            engine.release(action[1])
            oracle.release(action[1])
            live.difference_update(action[1])
            prefetched.difference_update(action[1])
            ran["released"] += 1
        else:
            engine.prefetch(action[1])
            for symbol in action[1]:
                assert engine.ready(symbol) in (True, False)
            prefetched.update(action[1])
        if clock is not None:
            clock[0] += ticks.random()
            gone = engine.expired()
            oracle.release(gone)
            live.difference_update(gone)
            prefetched.difference_update(gone)
            ran["expired"] += len(gone)
        if not pending:  # an engine that steps elsewhere may list a symbol only once its step is collected
            held = set(engine.symbols)
            assert live <= held <= live | prefetched, (what, sorted(held), sorted(live))
        if check is not None:
            check(engine)
    for step, want, submitted in pending:
        compare(step.result(), want, f"{submitted}, joined at the end")
    return ran


def check_table(engine):
    """The fast engine's table: every symbol in one tier, in a slot of its own (never the padding slot), and every
    free GPU slot holding the initial state (a new symbol takes it as it is)."""
    table = engine.table
    resident, offloaded = table.slot_of, dict(table.offloaded)
    assert not set(resident) & set(offloaded)
    assert len(set(resident.values())) == len(resident) and PAD_SLOT not in resident.values()
    assert len(set(offloaded.values())) == len(offloaded) and len(offloaded) <= table.host_capacity
    assert len(resident) + len(offloaded) <= table.capacity + table.host_capacity
    assert sorted([*resident.values(), *table.free]) == list(range(1, table.capacity + 1))
    for part in table.parts:
        for copy in list(part.slot_copy.values()):
            part.wait(copy)
        for buffer, start in part.chunks:
            initial = part.initial[0, start:start + buffer.shape[1]]
            for slot in table.free:
                assert torch.equal(buffer[slot], initial), f"free slot {slot} does not hold the initial state"


def pad_like_the_gpu(engine, padding_value=3.0):
    """Step the engine's CPU path at its captured shapes, as its graphs do on a GPU: rows past the step's hold stale
    features, sequences past its own are empty at the padding slot. Their predictions are dropped."""
    engine_ref = weakref.ref(engine)  # not a cycle: its table's copy threads end with it, not at a collection

    def padded(sequences, grouped):
        engine = engine_ref()
        rows, count = len(grouped), len(sequences.symbols)
        shape = shape_for(engine.shapes, rows, count, sequences.max_length)
        slots = [*engine.table.slots_for(sequences.symbols), *[PAD_SLOT] * (shape.sequences - count)]
        starts = [*np.concatenate([[0], np.cumsum(sequences.lengths)]), *[rows] * (shape.sequences - count)]
        features = np.full((shape.rows, grouped.shape[1]), padding_value, np.float32)
        features[:rows] = grouped
        plan = StepPlan(torch.tensor(slots, dtype=torch.int32), torch.tensor(starts, dtype=torch.int32),
                        shape.max_rows)
        return engine.step_plan(plan, torch.from_numpy(features)).numpy()[:rows]
    engine._step_now = padded
    return engine


def fast_engine(model, **options):
    options = {"precision": FP32_PRECISION, "capacity": 3, "host_symbols": 6, "reserve": 1, "max_batch": MAX_BATCH,
               "max_rows_per_symbol": CAP, **options}
    return FastEngine(model, **{"device": "cpu", "progress": False, **options})


def test_the_reference_engine_through_two_device_slots_equals_one_request_at_a_time(model):
    engine = ReferenceEngine(model, device="cpu", capacity=2, host_symbols=5)
    ran = play(engine, model, session(1, 50), FP32_TOLERANCE)
    assert ran["refused"] and ran["joined"] and ran["released"]
    assert engine._states.stats["offloaded"] and engine._states.stats["restored"]


def test_the_fast_engine_through_three_gpu_slots_equals_one_request_at_a_time(model):
    engine = fast_engine(model)
    ran = play(engine, model, session(10, 60), FP32_TOLERANCE, check_table)
    assert ran["refused"] and ran["joined"] and ran["released"]
    stats = engine.table.stats
    assert stats["offloaded"] and stats["restored"] and stats["restored_ahead"]


def test_the_fast_engine_padded_to_its_captured_shapes_equals_one_request_at_a_time(model):
    """Padding rows (stale features) and empty sequences at the padding slot, as on a GPU, touch no live state."""
    engine = pad_like_the_gpu(fast_engine(model, capacity=2, max_batch=2, max_rows_per_symbol=3))
    assert play(engine, model, session(20, 40, cap=3, max_batch=2), FP32_TOLERANCE, check_table)["rows"]


def test_the_fast_engine_at_its_default_precision_stays_close_to_one_request_at_a_time(model):
    engine = fast_engine(model, precision=DEFAULT_PRECISION, capacity=2)
    assert play(engine, model, session(30, 30), {"rtol": 0, "atol": 1e-3}, check_table)["rows"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("precision, tolerance", [(FP32_PRECISION, {"rtol": 1e-4, "atol": 1e-4}),
                                                  (DEFAULT_PRECISION, {"rtol": 0, "atol": 2e-3})],
                         ids=["fp32", "default"])
def test_the_fast_engine_on_a_gpu_equals_one_request_at_a_time(model, precision, tolerance):
    """As on the CPU, through what only a GPU runs: the graphs of the captured shapes (padding rows, empty
    sequences), the pinned host tier and its copy stream, submitted steps joined while they run."""
    engine = fast_engine(model, device="cuda", precision=precision)
    try:
        ran = play(engine, model, session(60, 80), tolerance, check_table)
        assert ran["refused"] and ran["joined"] and ran["released"]
        assert engine.table.stats["offloaded"] and engine.table.stats["restored"]
    finally:
        engine.close()


@pytest.mark.parametrize("make", [
    lambda model: ReferenceEngine(model, device="cpu", capacity=2, host_symbols=2),
    lambda model: fast_engine(model, capacity=2, host_symbols=2, max_batch=2),
], ids=["reference", "fast"])
def test_steps_beyond_every_tier_are_refused_whole_and_the_others_go_on(model, make):
    """Seven symbols, room for four: a step that would need more is refused (CapacityError, touching nothing) as
    unplaceable() says beforehand; releases make room again."""
    ran = play(make(model), model, session(40, 60), FP32_TOLERANCE)
    assert ran["capacity"] and ran["rows"]



@pytest.mark.parametrize("name", ["reference", "fast"])
def test_symbols_forgotten_as_idle_start_afresh_and_the_others_go_on(model, name):
    """An idle timeout on a clock moved on by the driver: each symbol the engine says it forgot starts from a fresh
    state at its next request; no other symbol loses its state, and the table never holds more than its tiers."""
    clock = [0.0]
    if name == "fast":
        engine = fast_engine(model, capacity=2, host_symbols=3, idle_timeout_s=2.0)
        engine.table.clock = lambda: clock[0]
    else:
        engine = ReferenceEngine(model, device="cpu", capacity=2, host_symbols=3, idle_timeout_s=2.0)
        engine._states.clock = lambda: clock[0]
    ran = play(engine, model, session(205, 50), FP32_TOLERANCE, check_table if name == "fast" else None, clock)
    assert ran["expired"] and ran["capacity"] and ran["rows"]


def test_a_sharded_engine_over_a_fast_and_a_reference_shard_equals_one_request_at_a_time(model):
    engine = ShardedEngine([ShardHere(fast_engine(model, capacity=2)),
                            ShardHere(ReferenceEngine(model, device="cpu", capacity=1, host_symbols=6), 1)],
                           progress=False)
    try:
        ran = play(engine, model, session(50, 40), FP32_TOLERANCE)
        assert ran["refused"] and ran["joined"] and set(engine.shard_of.values()) == {0, 1}
    finally:
        engine.close()


ENGINES = {
    "reference": lambda model: ReferenceEngine(model, device="cpu", capacity=2, host_symbols=2),
    "fast": lambda model: fast_engine(model, capacity=2, host_symbols=2),
    "sharded": lambda model: ShardedEngine([ShardHere(fast_engine(model, capacity=2, host_symbols=2))],
                                           progress=False),
}


@pytest.mark.parametrize("name", ENGINES)
def test_release_and_prefetch_take_strings_alone_as_step_does_touching_nothing_else(model, name):
    """An element that is no string is refused in one line naming it, touching nothing: release ignored an int,
    bytes or None, and the fast engine's prefetch gave each a slot of the state table (listed among its symbols,
    holding room that real symbols then lacked). A numpy str_ is a string, as in step()."""
    engine = ENGINES[name](model)
    try:
        x = np.random.default_rng(5).standard_normal((2, 79)).astype(np.float32)
        engine.step(["A", "B"], x)
        for bad, shown in ((7, r"7 \(int\)"), (b"A", r"b'A' \(bytes\)"), (None, r"None \(NoneType\)"),
                           (2.5, r"2.5 \(float\)")):
            for call in (engine.release, engine.prefetch):
                with pytest.raises(ValueError, match=rf"symbols must be strings; row 1 holds {shown}$"):
                    call(["A", bad])
            with pytest.raises(ValueError, match=rf"symbols must be strings; row 1 holds {shown}$"):
                engine.step(["A", bad], x)
        for call in (engine.release, engine.prefetch):
            with pytest.raises(ValueError, match="symbols must be a list of strings, got None$"):
                call(None)
        assert sorted(engine.symbols) == ["A", "B"]
        engine.prefetch([np.str_("B"), "C"])
        engine.release(np.array(["A", "C"]))  # numpy's strings are strings
        assert engine.symbols == ["B"]
        engine.release([])
        engine.prefetch([])
        assert engine.step([], []).shape == (0, 4) and engine.symbols == ["B"]
    finally:
        engine.close()


@pytest.mark.parametrize("name", ENGINES)
def test_unplaceable_takes_strings_alone_as_step_does(model, name):
    """unplaceable("AB") is a mistake for ["AB"]: iterated, the string was a symbol per character (with the tiers
    full, AB, which is held, was answered as A and B without room). An element that is no string is named, as
    step names it (the engines raised join's TypeError, or answered it as a symbol)."""
    engine = ENGINES[name](model)
    try:
        engine.step(["AB", "C", "D", "E"], np.random.default_rng(7).standard_normal((4, 79)).astype(np.float32))
        assert engine.unplaceable(["AB", "C"]) == {}
        with pytest.raises(ValueError, match="symbols must be a list of strings, got the string 'AB'$"):
            engine.unplaceable("AB")
        for bad, shown in ((7, r"7 \(int\)"), (None, r"None \(NoneType\)")):
            with pytest.raises(ValueError, match=rf"symbols must be strings; row 1 holds {shown}$"):
                engine.unplaceable(["AB", bad])
        assert sorted(engine.symbols) == ["AB", "C", "D", "E"]
    finally:
        engine.close()


@pytest.mark.parametrize("name", ENGINES)
def test_features_of_a_wrong_shape_or_kind_are_refused_in_one_line_touching_nothing(model, name):
    engine, untouched = ENGINES[name](model), ReferenceEngine(model, device="cpu")
    try:
        x = np.random.default_rng(6).standard_normal((2, 79)).astype(np.float32)
        np.testing.assert_allclose(engine.step(["A", "B"], x), untouched.step(["A", "B"], x), **FP32_TOLERANCE)
        big = x.astype(np.float64)
        big[1, 3] = -1e39  # finite, past float32's range: it was told as a non-finite feature, which it is not
        past_range = r"features in rows \[1\] \(symbols \['B'\]\) exceed float32's range \(max \|value\| 1e\+39\)$"
        for features, match in ((x[:, :78], r"shape \(2, 79\) for 2 symbols, got \(2, 78\)"),
                                (x[:1], r"got \(1, 79\)"), (x[0], r"got \(79,\)"), ([], r"got \(0,\)"),
                                (x.astype(np.int32), "floating point, got int32"),
                                (x.astype(np.complex64), "floating point, got complex64"),
                                (x > 0, "floating point, got bool"), (x.astype(str), "floating point, got <U"),
                                (np.full((2, 79), None), "floating point, got object"),
                                (torch.ones(2, 79, dtype=torch.int64), "floating point, got int64"),
                                (big, past_range), (torch.from_numpy(big), past_range)):
            for call in (engine.step, engine.submit):
                with pytest.raises(ValueError, match=match):
                    call(["A", "B"], features)
        assert sorted(engine.symbols) == ["A", "B"]
        x = x[::-1].astype(np.float64)  # another dtype, not contiguous: stepped as its float32 values
        np.testing.assert_allclose(engine.step(["B", "A"], x), untouched.step(["B", "A"], x), **FP32_TOLERANCE)
    finally:
        engine.close()
