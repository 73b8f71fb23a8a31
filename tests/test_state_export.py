"""One symbol's recurrent state exported and imported (Engine.export_state, import_state, state_layout): a fresh
engine of the same options that imports every symbol's state continues bit for bit; an export is ordered with the
submits around it; a bad import changes nothing. The reference and fast engines (host tiers, 16-bit state), the
sharded engine over shards in this process and over CPU processes, and the fast engine's staging on a GPU."""
import json

import numpy as np
import pytest
import torch

from client.engine.base import CapacityError, Engine
from client.engine.fast import PAD_SLOT, FastEngine
from client.engine.precision import FP32_PRECISION, StateStorage
from client.engine.reference import ReferenceEngine
from client.engine.shard_process import process_shards
from client.engine.sharded import ModelSpec, ShardedEngine, ShardLost
from client.model import load_model
from shard_checks import ShardHere, one_thread_shards
from test_fast_engine import backlog_steps

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
SYMBOLS = [f"S{i}" for i in range(6)]


@pytest.fixture(scope="module")
def model():
    return load_model("tiny", seed=3)[0]


def steps(seed, count, symbols=SYMBOLS, max_requests=3):
    """Steps of some symbols with up to max_requests requests each, interleaved."""
    return backlog_steps(seed, count, symbols, max_requests)


def in_host_memory(engine) -> int:
    return engine._states.on_host if isinstance(engine, ReferenceEngine) else len(engine.table.offloaded)


# (name, engine maker): tight tables with a host tier, so that some exported states are in host memory
ENGINES = {
    "reference": lambda model: ReferenceEngine(model, "cpu", capacity=3, host_symbols=4),
    "fast-fp32": lambda model: FastEngine(model, "cpu", precision=FP32_PRECISION, capacity=3, host_symbols=4,
                                          progress=False),
    "fast": lambda model: FastEngine(model, "cpu", capacity=3, host_symbols=4, progress=False),
    "fast-no-host-tier": lambda model: FastEngine(model, "cpu", capacity=6, host_symbols=0, progress=False),
    "fast-bf16-state": lambda model: FastEngine(model, "cpu", capacity=3, host_symbols=4,
                                                state_storage=StateStorage.parse("bf16"), progress=False),
}


def exports(engine, symbols=SYMBOLS):
    return {symbol: engine.export_state(symbol).result() for symbol in symbols}


@pytest.mark.parametrize("name", ENGINES)
def test_a_fresh_engine_that_imports_every_state_continues_bit_for_bit(model, name):
    played = ENGINES[name](model)
    for rows, features in steps(0, 6):
        played.step(rows, features)
    assert name.endswith("no-host-tier") or in_host_memory(played) > 0
    states = exports(played)
    for state in states.values():
        assert state.dtype == np.uint8 and state.ndim == 1 and state.flags.c_contiguous and state.flags.owndata
        assert state.size == played.state_layout()["bytes"]
    fresh = ENGINES[name](model)
    for symbol, state in states.items():
        fresh.import_state(symbol, state.tobytes() if symbol == "S0" else state)  # bytes or the array
    for rows, features in steps(1, 6):
        assert np.array_equal(played.step(rows, features), fresh.step(rows, features))
    after = exports(fresh)
    assert all(np.array_equal(state, after[symbol]) for symbol, state in exports(played).items())


@pytest.mark.parametrize("name", ["reference", "fast"])
def test_an_export_is_ordered_with_the_submits_around_it(model, name):
    engine, alone = ENGINES[name](model), ENGINES[name](model)
    (warm, warm_features), (a, a_features), (b, b_features) = steps(2, 3)
    for stepped in (engine, alone):
        stepped.step(warm, warm_features)
    first = engine.submit(a, a_features)
    exported = {symbol: engine.export_state(symbol) for symbol in SYMBOLS}
    second = engine.submit(b, b_features)
    alone.step(a, a_features)
    first.result(), second.result()
    for symbol, state in exported.items():
        want = alone.export_state(symbol).result()
        assert (state.result() is None) if want is None else np.array_equal(state.result(), want)


@pytest.mark.parametrize("name", ["reference", "fast"])
def test_unknown_and_released_symbols_have_no_state(model, name):
    engine = ENGINES[name](model)
    engine.step(["A", "B"], np.zeros((2, 79), np.float32))
    engine.release(["A"])
    assert engine.export_state("A").result() is None and engine.export_state("never").result() is None
    assert engine.export_state("B").result() is not None
    with pytest.raises(ValueError, match="must be a string"):
        engine.export_state(3)
    with pytest.raises(ValueError, match="must be a string"):
        engine.import_state(b"B", engine.export_state("B").result())


def test_a_symbol_forgotten_as_idle_has_no_state(model):
    clock = [0.0]
    engine = FastEngine(model, "cpu", capacity=2, idle_timeout_s=1.0, progress=False)
    engine.table.clock = lambda: clock[0]
    engine.step(["A"], np.zeros((1, 79), np.float32))
    clock[0] = 5.0
    engine.step(["B", "C"], np.zeros((2, 79), np.float32))  # A's slot taken: it was idle
    assert engine.export_state("A").result() is None


@pytest.mark.parametrize("name", ["reference", "fast"])
def test_a_state_of_the_wrong_size_changes_nothing(model, name):
    engine = ENGINES[name](model)
    for rows, features in steps(3, 3):
        engine.step(rows, features)
    before = exports(engine)
    size = engine.state_layout()["bytes"]
    with pytest.raises(ValueError, match=f"{size} bytes, got {size - 1}"):
        engine.import_state("S0", before["S0"][:-1])
    with pytest.raises(ValueError, match=f"{size} bytes, got {size + 1}"):
        engine.import_state("NEW", np.zeros(size + 1, np.uint8))
    with pytest.raises(ValueError, match="uint8"):
        engine.import_state("NEW", before["S0"].view(np.int8))
    assert "NEW" not in engine.symbols
    after = exports(engine)
    assert all((after[s] is None) if state is None else np.array_equal(after[s], state) for s, state in before.items())


@pytest.mark.parametrize("make", [lambda model: ReferenceEngine(model, "cpu", capacity=1),
                                  lambda model: FastEngine(model, "cpu", capacity=1, host_symbols=1, progress=False)],
                         ids=["reference", "fast"])
def test_an_import_into_a_full_table_raises_capacity_error_and_changes_nothing(model, make):
    engine = make(model)
    held = ["A"] if isinstance(engine, ReferenceEngine) else ["A", "B"]  # the fast one: one more, in host memory
    for symbol in held:
        engine.step([symbol], np.ones((1, 79), np.float32))
    before = exports(engine, held)
    with pytest.raises(CapacityError):
        engine.import_state("NEW", before["A"])
    assert sorted(engine.symbols) == held
    assert all(np.array_equal(engine.export_state(s).result(), state) for s, state in before.items())
    engine.import_state("A", before["A"])  # a symbol held takes no more room


def test_an_import_touches_no_other_slot_nor_the_padding_slot(model):
    engine = FastEngine(model, "cpu", capacity=4, progress=False)
    for rows, features in steps(4, 3, SYMBOLS[:3]):
        engine.step(rows, features)
    state = engine.export_state("S0").result()
    slot = engine.table.slot_of["S1"]
    buffer = engine.table.parts[0].chunks[0][0]
    before = buffer.clone()
    engine.import_state("S1", state)
    others = [s for s in range(buffer.shape[0]) if s != slot]
    assert PAD_SLOT in others and torch.equal(buffer[others], before[others])
    assert np.array_equal(buffer[slot].numpy(), state)


def test_layouts_say_what_the_bytes_are(model):
    layouts = {name: make(model).state_layout() for name, make in ENGINES.items()}
    for layout in layouts.values():
        assert json.loads(json.dumps(layout)) == layout
    assert layouts["fast-fp32"] == layouts["fast"] == layouts["fast-no-host-tier"]  # weights' dtypes: same bytes
    assert layouts["fast"] != layouts["fast-bf16-state"] != layouts["reference"] != layouts["fast"]
    nearest = FastEngine(model, "cpu", capacity=1, state_storage=StateStorage.parse("bf16:nearest"), progress=False)
    assert nearest.state_layout() not in (layouts["fast"], layouts["fast-bf16-state"])  # no step counter
    assert layouts["fast-bf16-state"]["bytes"] < layouts["fast"]["bytes"]


def test_an_engine_that_cannot_says_so():
    class Plain(Engine):
        name = "plain"
        symbols = []

        def step(self, symbols, features):
            pass

        def release(self, symbols):
            pass

    assert Plain().state_layout() is None
    with pytest.raises(NotImplementedError, match="plain"):
        Plain().export_state("A")
    with pytest.raises(NotImplementedError, match="plain"):
        Plain().import_state("A", b"")


def test_sharded_in_this_process_routes_to_each_symbols_shard(model):
    shards = [FastEngine(model, "cpu", capacity=2, host_symbols=0, progress=False) for _ in range(2)]
    engine = ShardedEngine([ShardHere(shard, index) for index, shard in enumerate(shards)], progress=False)
    alone = FastEngine(model, "cpu", capacity=8, progress=False)
    assert engine.state_layout() == alone.state_layout()
    features = np.random.default_rng(5).standard_normal((3, 79)).astype(np.float32)
    engine.step(["A", "B", "C"], features)
    for symbol in "ABC":
        state = engine.export_state(symbol).result()
        assert np.array_equal(state, shards[engine.shard_of[symbol]].export_state(symbol).result())
    assert engine.export_state("unknown").result() is None
    engine.import_state("D", engine.export_state("A").result())  # placed as a step places it: the emptier shard
    assert engine.shard_of["D"] == 1 and np.array_equal(shards[1].export_state("D").result(),
                                                       engine.export_state("A").result())
    with pytest.raises(CapacityError):  # both shards full
        engine.import_state("E", engine.export_state("A").result())
    with pytest.raises(ValueError, match="bytes, got 3"):
        engine.import_state("E", b"abc")
    assert "E" not in engine.shard_of and engine._load == [2, 2]
    engine.release(["A"])
    assert engine.export_state("A").result() is None
    engine.close()



class _LostShard(ShardHere):
    """A shard in this process that reads as lost (its calls' answers raise ShardLost) once `lost` is set."""
    lost = False

    def result(self, handle):
        if self.lost:
            raise ShardLost("its process exited")
        return super().result(handle)


@pytest.mark.parametrize("on_shard_loss", ["error", "reset"])
def test_a_lost_shards_symbol_exports_no_state(model, on_shard_loss):
    """A lost shard's symbol raised its loss on export, and so did an export on its way when the shard was lost:
    the journal then stopped checkpointing every symbol for the session (its journal unbounded, a restart replaying
    all of it). Its state went with the shard, and its next request starts afresh (reset) or is refused (error):
    it exports None, as a symbol the engine holds no state of; the other shard's symbols export as before."""
    shards = [_LostShard(FastEngine(model, "cpu", capacity=4, progress=False), index) for index in range(2)]
    engine = ShardedEngine(shards, on_shard_loss=on_shard_loss, progress=False)
    try:
        features = np.random.default_rng(7).standard_normal((2, 79)).astype(np.float32)
        engine.step(["A", "B"], features)
        assert (engine.shard_of["A"], engine.shard_of["B"]) == (0, 1)
        shards[1].lost = True
        assert engine.export_state("B").result() is None  # on its way when the shard was lost
        assert len(engine.losses) == 1
        assert engine.export_state("B").result() is None  # asked once the loss is known
        assert np.array_equal(engine.export_state("A").result(), shards[0].engine.export_state("A").result())
    finally:
        engine.close()

def test_sharded_over_processes_exports_and_imports_in_order(model):
    with one_thread_shards():
        engine = ShardedEngine(process_shards(ModelSpec("tiny", seed=3), ["cpu", "cpu"],
                                              options={"capacity": 4, "host_symbols": 0}, progress=False),
                               progress=False)
    try:
        alone = FastEngine(model, "cpu", capacity=8, progress=False)
        assert engine.state_layout() == alone.state_layout()
        rng = np.random.default_rng(6)
        features = [rng.standard_normal((1, 79)).astype(np.float32) for _ in range(4)]
        for symbol in "AB":  # one symbol a step: the same products as the engine alone's
            engine.step([symbol], features[0])
            alone.step([symbol], features[0])
        assert engine.shard_of["A"] != engine.shard_of["B"]
        first = engine.submit(["A"], features[1])
        exported = engine.export_state("A")
        second = engine.submit(["A"], features[2])
        alone.step(["A"], features[1])
        assert np.array_equal(exported.result(), alone.export_state("A").result())
        first.result(), second.result()
        assert engine.export_state("unknown").result() is None
        engine.import_state("C", exported.result())
        alone.import_state("C", exported.result())
        assert np.array_equal(engine.step(["C"], features[3]), alone.step(["C"], features[3]))
        assert np.array_equal(engine.export_state("C").result(), alone.export_state("C").result())
        for symbol in ("D", "E", "F", "G", "H"):  # 8 symbols fill both shards
            engine.import_state(symbol, exported.result())
        with pytest.raises(CapacityError):
            engine.import_state("I", exported.result())
        assert "I" not in engine.shard_of
    finally:
        engine.close()


@cuda
def test_gpu_staging_is_ordered_with_steps_in_flight(model):
    """Exports between submits still in flight (through the graphs, a host tier): each equals the state that an
    engine stepping one step at a time had then, and imported into a fresh engine, continues bit for bit."""
    def make():
        return FastEngine(model, "cuda", max_batch=4, capacity=3, host_symbols=6, progress=False)
    engine, alone = make(), make()
    symbols = SYMBOLS[:5]
    in_flight, exported, want = [], [], []
    for k, (rows, features) in enumerate(steps(7, 12, symbols, max_requests=2)):
        in_flight.append(engine.submit(rows, features))
        alone.step(rows, features)
        if k % 3 == 2:
            exported.append({s: engine.export_state(s) for s in symbols})
            want.append(exports(alone, symbols))
    assert engine.table.stats["offloaded"] > 0
    for pending in in_flight:
        pending.result()
    for got, expected in zip(exported, want):
        for symbol in symbols:
            state = got[symbol].result()
            assert (state is None) if expected[symbol] is None else np.array_equal(state, expected[symbol])
    fresh = make()
    for symbol, state in exports(engine, symbols).items():
        fresh.import_state(symbol, state)
    for rows, features in steps(8, 6, symbols, max_requests=2):
        assert np.array_equal(engine.step(rows, features), fresh.step(rows, features))
    assert all(np.array_equal(state, fresh.export_state(s).result()) for s, state in exports(engine, symbols).items())


@cuda
def test_gpu_exports_are_taken_from_any_thread_and_kept_by_no_one_else(model):
    """Exports taken on another thread (result()) or polled (done()), while steps go on: each equals the state an
    engine stepped alike had then; the bytes returned are the caller's alone: dropped, they are freed, not kept by
    the table until the next export (which let 146 MiB go on the thread that steps)."""
    import gc
    import threading
    import time
    import weakref

    engine, alone = (FastEngine(model, "cuda", max_batch=4, capacity=6, host_symbols=0, progress=False)
                     for _ in range(2))
    batches = list(steps(9, 4))
    for rows, features in batches[:2]:
        engine.step(rows, features), alone.step(rows, features)
    want = exports(alone)
    pending = engine.export_state("S1")
    polled = engine.export_state("S2")
    for rows, features in batches[2:]:
        engine.submit(rows, features)
    taken = {}
    thread = threading.Thread(target=lambda export: taken.update(S1=export.result()), args=(pending,))
    thread.start()
    thread.join(timeout=60)
    deadline = time.monotonic() + 60
    while not polled.done():
        assert time.monotonic() < deadline, "an export that is only polled never ends"
        time.sleep(0.001)
    assert np.array_equal(taken["S1"], want["S1"]) and np.array_equal(polled.result(), want["S2"])
    freed = weakref.ref(polled.result())  # the last export: the table still holds its buffers
    del polled
    gc.collect()
    assert freed() is None
