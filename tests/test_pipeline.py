"""Pipelined steps: Engine.submit / PendingStep, FastEngine.submit, ExampleModel.submit_batch, and the runtime's
submitter and completer threads against a real in-test websocket server."""
import asyncio
import threading
import time
from collections import deque
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_runtime import SYMBOLS, Recorder, _expected, _play, _request, _stream
from client import protocol

from client.engine.base import PendingStep
from client.engine.fast import PAD_SLOT, RING, FastEngine
from client.engine.fast.engine import JOIN_ROOM, JoinableStep
from client.engine.fast.runner import StepInputs, StepShape
from client.engine.reference import ReferenceEngine
from client.engine.sharded import LATE_ANSWER_S, Shard, ShardedEngine, submit_placeable
from client.model import load_model
from client import runtime
from client.runtime import PIPELINE_DEPTH, StreamingClient
from client.scheduler import Request, Scheduler
from client.step_clock import StepClock
from client import team_api
from client.team_api import MANY, queued
from team.example_model import ExampleModel

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def model():
    return load_model("tiny", seed=1)[0]


def _steps(seed, n, symbols, max_batch):
    """n steps of distinct random symbols, each with its features."""
    rng = np.random.default_rng(seed)
    for _ in range(n):
        chosen = [str(s) for s in rng.choice(symbols, int(rng.integers(1, max_batch + 1)), replace=False)]
        yield chosen, rng.standard_normal((len(chosen), 79)).astype(np.float32)


# ---- engines -------------------------------------------------------------------------------------------
def test_pending_step_fetches_once_and_returns_the_same_object():
    calls = []
    pending = PendingStep(lambda: calls.append(1) or np.ones((2, 4), np.float32))
    first = pending.result()
    assert pending.result() is first and calls == [1]
    done = PendingStep.completed("value")
    assert done.result() == "value" and done.result() == "value"


def test_pending_step_says_whether_it_has_ended_without_waiting():
    landed = threading.Event()
    pending = PendingStep(lambda: "answer", poll=landed.is_set)
    assert not pending.done()
    landed.set()
    assert pending.done() and pending.result() == "answer" and pending.done()
    assert PendingStep(lambda: "answer").done()  # cannot tell: result() waits
    assert PendingStep.completed("value").done()


def test_base_submit_steps_at_once_and_raises_on_bad_input(model):
    engine, plain = ReferenceEngine(model), ReferenceEngine(model)
    features = np.random.default_rng(0).standard_normal((2, 79)).astype(np.float32)
    pending = engine.submit(["A", "B"], features)
    assert engine.symbols == ["A", "B"]  # already stepped
    np.testing.assert_array_equal(pending.result(), plain.step(["A", "B"], features))
    with pytest.raises(ValueError, match="non-finite"):
        engine.submit(["C", "C"], np.full((2, 79), np.nan, np.float32))
    assert engine.symbols == ["A", "B"]


def test_fast_engine_submit_equals_step_on_cpu(model):
    submitted = FastEngine(model, device="cpu", max_batch=4, capacity=4, host_symbols=8, progress=False)
    stepped = FastEngine(model, device="cpu", max_batch=4, capacity=4, host_symbols=8, progress=False)
    symbols = [f"S{i}" for i in range(7)]
    pending = deque()
    for chosen, feats in _steps(0, 20, symbols, max_batch=6):  # some steps larger than max_batch
        pending.append((submitted.submit(chosen, feats), stepped.step(chosen, feats)))
        if len(pending) == 2:
            got, want = pending.popleft()
            np.testing.assert_array_equal(got.result(), want)
    for got, want in pending:
        np.testing.assert_array_equal(got.result(), want)
        assert got.result() is got.result()
    before = {k: v.clone() for k, v in submitted.table.tensors.items()}
    bad = np.ones((2, 79), np.float32)
    bad[1, 0] = np.inf
    with pytest.raises(ValueError, match="non-finite"):
        submitted.submit(["S0", "NEW"], bad)
    assert "NEW" not in submitted.symbols
    assert all(torch.equal(v, before[k]) for k, v in submitted.table.tensors.items())
    assert submitted.submit([], np.zeros((0, 79), np.float32)).result().shape == (0, 4)


@cuda
def test_fast_engine_pipelined_submits_match_sequential_steps_on_gpu():
    model, _ = load_model("small", seed=0, device="cuda")
    # 20 symbols through 8 slots: states move to host memory and back while steps are in flight
    submitted = FastEngine(model, device="cuda", max_batch=8, capacity=8, host_symbols=20, progress=False)
    stepped = FastEngine(model, device="cuda", max_batch=8, capacity=20, host_symbols=0, progress=False)

    def step_plain(chosen, feats):
        """Through the graphs without copies (the same kernels as the staged graphs, so equal to the bit)."""
        out = [stepped.step_slots(stepped.slots_for(chosen[i:i + 8]), torch.from_numpy(feats[i:i + 8]).cuda())
               .cpu().numpy() for i in range(0, len(chosen), 8)]
        return np.concatenate(out)

    symbols = [f"S{i}" for i in range(20)]
    pending, results = deque(), []
    for t, (chosen, feats) in enumerate(_steps(1, 50, symbols, max_batch=8)):
        if t == 25:  # one step larger than max_batch runs synchronously between submitted ones
            chosen = symbols[:12]
            feats = np.random.default_rng(t).standard_normal((12, 79)).astype(np.float32)
        pending.append((submitted.submit(chosen, feats), step_plain(chosen, feats)))
        if len(pending) > 2:
            results.append(pending.popleft())
    results.extend(pending)
    assert len(results) == 50
    for got, want in results:
        np.testing.assert_allclose(got.result(), want, rtol=0, atol=1e-6)
    assert submitted.table.stats["restored"] > 0
    # each staging buffer has its own graphs, whose copies are part of the step: one launch per submit
    graphed = submitted.graphed
    assert set(graphed.staged_graphs) == {(i, shape) for i in range(RING) for shape in graphed.shapes
                                          if shape.max_rows == 1}


def test_a_joined_request_is_one_more_sequence_of_the_staged_step_on_cpu(model):
    """StepInputs.join on a step of one row a symbol: the step's plan then carries it as its next sequence (row),
    the sequences after it empty; the step and the states it leaves equal, to the bit, those of a step formed with
    the three requests at the same shape."""
    engines = [FastEngine(model, device="cpu", max_batch=8, progress=False) for _ in range(2)]
    rng = np.random.default_rng(7)
    features = rng.standard_normal((3, 79)).astype(np.float32)
    shape = StepShape(4, 4, 1)  # launched with room for two: one joined, one padding
    num_features = engines[0].runner.num_features
    got = []
    for joined, engine in zip((True, False), engines):
        inputs = StepInputs(torch.zeros(StepInputs.bytes_for(8, 8, num_features), dtype=torch.uint8), 8, 8,
                            num_features)
        slots = engine.table.slots_for(["A", "B", "C"])
        if joined:
            inputs.fill(slots[:2], [1, 1], features[:2])
            inputs.join(2, slots[2], features[2])
            plan = inputs.plan(shape)
            assert plan.seq_slots.tolist() == [*slots, PAD_SLOT]
            assert plan.seq_starts.tolist() == [0, 1, 2, 3, 3]
        else:
            inputs.fill(slots, [1, 1, 1], features)
        got.append(engine.step_plan(inputs.plan(shape), inputs.features[:shape.rows])[:3].numpy())
    np.testing.assert_array_equal(got[0], got[1])
    again = rng.standard_normal((3, 79)).astype(np.float32)
    np.testing.assert_array_equal(*(engine.step(["A", "B", "C"], again) for engine in engines))


class _HostStaging:
    """A staging on the CPU for JoinableStep's bookkeeping: the real StepInputs, `taken` as a device would write
    it (set_taken), and the outs a finished step would hold."""

    def __init__(self, num_features, rows=8):
        self.inputs = StepInputs(torch.zeros(StepInputs.bytes_for(rows, rows, num_features), dtype=torch.uint8), rows,
                                 rows, num_features)
        self.taken = [torch.full((rows,), -1, dtype=torch.int32)]
        self.taken_views = [taken.numpy() for taken in self.taken]
        self.outs = np.arange(rows * 4, dtype=np.float32).reshape(rows, 4)
        self.done = [SimpleNamespace(synchronize=lambda: None, query=lambda: True)]
        self.step = None

    def read_back(self, batch, step_times=None):
        return self.outs[:batch].copy()

    def ended(self):
        return all(done.query() for done in self.done)

    def wait(self, gpu=0):
        self.done[gpu].synchronize()

    def set_taken(self):
        """What the staged graph's copy of the sequence slots leaves in `taken` when the step starts."""
        self.taken[0][:] = self.inputs.seq_slots


def test_joinable_step_keeps_each_joins_fate_and_leaves_a_missed_one_unanswered():
    slots = {"A": 3, "B": 4, "C": 5}
    running = {"ahead": True}
    engine = SimpleNamespace(device=torch.device("cpu"), table=SimpleNamespace(resident_slot=slots.get),
                             step_times=None, queued=lambda staging, ahead: running["ahead"])
    staging = _HostStaging(79)
    staging.inputs.fill([slots["A"]], [1], np.zeros((1, 79), np.float32))
    step = JoinableStep(engine, staging, ["A"], np.arange(1), capacity=3, ahead=None)
    staging.step = step
    row = np.ones(79, np.float32)
    assert not step.join("A", row) and not step.join("NEW", row)  # in the step; not resident on the GPU
    assert step.join("B", row)
    assert step.fate(0) is None  # the step has not read its inputs
    staging.set_taken()  # it starts: B is in it
    running["ahead"] = False
    assert not step.join("C", row)  # the step ahead is over: too late
    running["ahead"] = True
    assert step.join("C", row)  # the checks passed, but the slot landed after the step read its inputs
    assert step.fate(0) is True and step.fate(1) is False
    out = step.result()
    assert out.shape == (3, 4) and np.array_equal(out[:2], staging.outs[:2]) and np.isnan(out[2]).all()
    staging.taken[0].fill_(-1)  # a later step reuses the staging: the fates stay those its step read
    assert step.fate(0) is True and step.fate(1) is False
    assert not step.join("C", row)  # read back: nothing joins it any more


def test_a_join_looks_its_symbol_up_on_the_engines_gpu(monkeypatch):
    """The table's resident_slot queries the slot's last copy's event, which has no device guard: a join from a
    thread on GPU 0 made a CUDA context there for an engine on another GPU (bench/LOG.md section 74)."""
    import contextlib

    from client.engine.fast import engine as module

    current, seen = [], []

    @contextlib.contextmanager
    def on_device(device):
        current.append(device)
        yield
        current.pop()
    monkeypatch.setattr(module, "_on_device", on_device)
    gpu = torch.device("cuda", 1)
    engine = SimpleNamespace(device=gpu, table=SimpleNamespace(resident_slot=lambda s: seen.append(current[-1:]) or 4),
                             step_times=None, queued=lambda staging, ahead: True)
    staging = _HostStaging(79)
    staging.inputs.fill([3], [1], np.zeros((1, 79), np.float32))
    step = JoinableStep(engine, staging, ["A"], np.arange(1), capacity=3, ahead=None)
    assert step.join("B", np.ones(79, np.float32)) and seen == [[gpu]]


@pytest.mark.parametrize("as_tensor", [lambda x: torch.from_numpy(x).requires_grad_(),
                                       lambda x: torch.from_numpy(x).to(torch.bfloat16)], ids=["requires_grad", "bf16"])
def test_a_join_takes_features_as_torch_tensors_as_submit_does(as_tensor):
    """A join's row as a tensor that requires grad, or is bf16, joins as its float32 values, as submit's rows do
    (numpy read the row first: torch's RuntimeError or TypeError)."""
    engine = SimpleNamespace(device=torch.device("cpu"), table=SimpleNamespace(resident_slot={"B": 4}.get),
                             step_times=None, queued=lambda staging, ahead: True)
    staging = _HostStaging(79)
    staging.inputs.fill([3], [1], np.zeros((1, 79), np.float32))
    step = JoinableStep(engine, staging, ["A"], np.arange(1), capacity=3, ahead=None)
    row = as_tensor(np.linspace(-1, 1, 79, dtype=np.float32))
    assert step.join("B", row)
    np.testing.assert_array_equal(staging.inputs.features[1].numpy(), row.detach().float().numpy())


def test_the_example_clients_answer_names_the_joins_that_made_it():
    """team/example_model.py's pending step over a JoinableStep: join and fate by unique id; its answer has the
    formed requests and the joins the step read, not the one that came too late."""
    from team.example_model import _JoinableAnswer

    slots = {"A": 3, "B": 4, "C": 5}
    engine = SimpleNamespace(device=torch.device("cpu"), table=SimpleNamespace(resident_slot=slots.get),
                             step_times=None, queued=lambda staging, ahead: True)
    staging = _HostStaging(79)
    staging.inputs.fill([slots["A"]], [1], np.zeros((1, 79), np.float32))
    answer = _JoinableAnswer(JoinableStep(engine, staging, ["A"], np.arange(1), capacity=3, ahead=None), [10], {})
    row = np.ones(79, np.float32)
    assert answer.join(11, "B", row) and not answer.join(11, "C", row)  # an id joins once
    assert answer.fate(11) is None
    staging.set_taken()
    assert answer.join(12, "C", row)  # too late: the step read its inputs
    result = answer.result()
    assert result["unique_ids"] == [10, 11] and result["errors"] == {}
    np.testing.assert_array_equal(result["predictions"], staging.outs[:2])
    assert answer.fate(11) is True and answer.fate(12) is False


@cuda
def test_fast_engine_joins_requests_to_a_step_queued_behind_another_on_gpu():
    model, _ = load_model("small", seed=0, device="cuda")
    engine = FastEngine(model, device="cuda", max_batch=8, capacity=12, host_symbols=0, progress=False)
    plain = FastEngine(model, device="cuda", max_batch=8, capacity=12, host_symbols=0, progress=False)
    rng = np.random.default_rng(5)

    def rows(n):
        return rng.standard_normal((n, 79)).astype(np.float32)

    symbols = [f"S{i}" for i in range(8)]
    first = rows(8)
    np.testing.assert_allclose(engine.step(symbols, first), plain.step(symbols, first), rtol=1e-5, atol=1e-5)
    with torch.cuda.stream(engine.step_streams[0]):
        torch.cuda._sleep(200_000_000)  # holds the engine's stream: the next two steps wait behind it
    joiners = ["S3", "S4"][:JOIN_ROOM]
    fa, fb, fj = rows(2), rows(1), rows(len(joiners))
    a = engine.submit(["S0", "S1"], fa)
    b = engine.submit(["S2"], fb, joinable=True)
    assert all(b.join(symbol, f) for symbol, f in zip(joiners, fj))
    assert not b.join("S2", fj[0])  # already in the step
    assert not b.join("NEW", fj[0])  # no GPU slot yet: it is placed by a step of its own
    assert not b.join("S5", fj[0])  # no room left (launched with room for JOIN_ROOM)
    with pytest.raises(ValueError, match="non-finite"):
        b.join("S6", np.full(79, np.nan, np.float32))
    assert b.fate(0) is None  # its inputs are not read yet
    got_a, got_b = a.result(), b.result()
    assert all(b.fate(j) for j in range(len(joiners)))
    np.testing.assert_allclose(got_a, plain.step(["S0", "S1"], fa), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_b, plain.step(["S2", *joiners], np.concatenate([fb, fj])), rtol=1e-5,
                               atol=1e-5)
    fl = rows(1)
    late = engine.submit(["S5"], fl, joinable=True)  # nothing runs ahead of it: launched without room
    np.testing.assert_allclose(late.result(), plain.step(["S5"], fl), rtol=1e-5, atol=1e-5)
    assert not hasattr(late, "join")
    last = rows(8)  # every state, the joined ones included, moved as stepping the requests did
    np.testing.assert_allclose(engine.step(symbols, last), plain.step(symbols, last), rtol=1e-5, atol=1e-5)


@cuda
def test_the_example_on_one_gpu_runs_its_steps_inline_by_default_with_the_references_answers(model):
    """On one GPU the fast engine's steps run in the background: the runtime, left to its default, submits each
    step from its event loop (no model thread beside it) and polls its end; every answer is the reference's."""
    engine = FastEngine(load_model("tiny", seed=1, device="cuda")[0], device="cuda", max_batch=8, capacity=8,
                        host_symbols=0, progress=False)
    n = 40
    symbols, features = _stream(n, seed=31)
    recorder = Recorder()
    seen_threads = set()
    client, summary = asyncio.run(_play(_paced(n, 0.003, symbols, features, recorder),
                                        _watching_threads(ExampleModel, seen_threads)(engine),
                                        pipeline_min_batch=1))
    assert client.inline_steps and seen_threads == {"MainThread"}
    assert sorted(uid for uid, _ in recorder.responses) == list(range(n)) and summary["responses_sent"] == n
    expected = _expected(model, symbols, features, range(n))  # the same seed's weights, fp32 on the CPU
    for uid, prediction in recorder.responses:
        np.testing.assert_allclose(prediction, expected[uid], rtol=0, atol=2e-3)


@cuda
def test_fast_engine_submit_leaves_the_callers_stream_current():
    """A submit sets the engine's step stream for its launch and puts the caller's stream back (by its id)."""
    model, _ = load_model("small", seed=0, device="cuda")
    engine = FastEngine(model, device="cuda", max_batch=4, capacity=8, host_symbols=0, progress=False)
    rows = np.random.default_rng(6).standard_normal((2, 79)).astype(np.float32)
    for current in (torch.cuda.current_stream(), torch.cuda.Stream()):
        with torch.cuda.stream(current):
            engine.submit(["S0", "S1"], rows).result()
            assert torch.cuda.current_stream() == current != engine.step_streams[0]
    assert torch.cuda.current_stream() == torch.cuda.default_stream()


# ---- team client ---------------------------------------------------------------------------------------
def test_submit_batch_resolves_to_process_batch_answer(model):
    features = np.random.default_rng(0).standard_normal((2, 79)).astype(np.float32)
    requests = {"B": (7, features[0]), "A": (3, features[1])}
    pending = ExampleModel(ReferenceEngine(model)).submit_batch(requests)
    answer = ExampleModel(ReferenceEngine(model)).process_batch(requests)
    assert pending.result()["unique_ids"] == answer["unique_ids"] == [7, 3]
    np.testing.assert_array_equal(pending.result()["predictions"], answer["predictions"])
    assert ExampleModel(ReferenceEngine(model)).submit_batch({}).result()["unique_ids"] == []


def test_submit_batch_runs_a_subclass_process_batch(model):
    class Doubling(ExampleModel):
        def process_batch(self, requests_by_symbol):
            answer = super().process_batch(requests_by_symbol)
            return {**answer, "predictions": 2 * answer["predictions"]}

    requests = {"A": (1, np.ones(79, np.float32))}
    got = Doubling(ReferenceEngine(model)).submit_batch(requests).result()["predictions"]
    np.testing.assert_allclose(got, 2 * ExampleModel(ReferenceEngine(model)).process_batch(requests)["predictions"])


# ---- runtime -------------------------------------------------------------------------------------------
class FakePending:
    def __init__(self, answer, fail):
        self.answer, self.fail = answer, fail
        self.ready = threading.Event()
        self.on_result = None

    def done(self):
        return self.ready.is_set()

    def result(self):
        assert self.ready.wait(30), "never released"
        self.on_result()
        if self.fail:
            raise RuntimeError("device fault")
        return self.answer


class PipelinedClient:
    """A team client whose steps are computed at submission (stream order) but complete later: a fake device
    thread releases each step only once the next one is queued behind it (or nothing came for 50 ms), and
    no sooner than hold_s after the previous one."""

    def __init__(self, model, fail_on_id=None, hold_s=0.0):
        self.engine = ReferenceEngine(model)
        self.fail_on_id, self.hold_s = fail_on_id, hold_s
        self.failed_ids = None
        self.stepped = []        # (symbol, unique_id) in the order the model stepped them
        self.submitted = []      # FakePending, in submission order
        self.in_flight = self.max_in_flight = 0
        self.cond = threading.Condition()
        self.closed = False
        self.device = threading.Thread(target=self._release, daemon=True)
        self.device.start()

    def submit_batch(self, requests_by_symbol):
        symbols = list(requests_by_symbol)
        ids = [requests_by_symbol[s][0] for s in symbols]
        predictions = self.engine.step(symbols, np.stack([requests_by_symbol[s][1] for s in symbols]))
        self.stepped.extend(zip(symbols, ids))
        fail = self.fail_on_id in ids
        if fail:
            self.failed_ids = ids
        pending = FakePending({"unique_ids": ids, "predictions": predictions}, fail)
        pending.on_result = self._resolved
        with self.cond:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            self.submitted.append(pending)
            self.cond.notify_all()
        return pending

    def process_batch(self, requests_by_symbol):
        raise AssertionError("the runtime must use submit_batch")

    def _resolved(self):
        with self.cond:
            self.in_flight -= 1

    def _release(self):
        released = 0
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.closed or len(self.submitted) > released)
                if self.closed:
                    return
                self.cond.wait_for(lambda: len(self.submitted) > released + 1, timeout=0.05)
                step = self.submitted[released]
            time.sleep(self.hold_s)
            step.ready.set()
            released += 1

    def close(self):
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        self.device.join()


def _play_pipelined(team_client, handler, **options):
    try:
        return asyncio.run(_play(handler, team_client, **options))
    finally:
        team_client.close()


def _bursts(n, size, symbols, features, recorder, done=None):
    """A server handler sending requests 0..n-1 in bursts of `size`, then waiting until `done()` (by default:
    every request answered) before it closes."""
    async def handler(ws):
        await ws.recv()
        for start in range(0, n, size):
            await ws.send(_request(list(range(start, min(start + size, n))), symbols, features))
        await recorder.pump(ws, done or (lambda: len(recorder.answered()) >= n))
        await ws.close(1000)
    return handler


def _assert_stepped_in_arrival_order(stepped, symbols, n):
    for symbol in SYMBOLS:
        assert [uid for s, uid in stepped if s == symbol] == [i for i in range(n) if symbols[i] == symbol]


def _no_model_threads_left():
    return not _model_threads()


def _model_threads() -> set:
    return {t.name for t in threading.enumerate() if t.name.startswith("model-")}


def _watching_threads(team_class, seen_threads):
    """team_class whose submit_batch adds to seen_threads the thread it runs on and every model thread alive."""
    class Watched(team_class):
        def submit_batch(self, requests_by_symbol):
            seen_threads.update(_model_threads() | {threading.current_thread().name})
            return super().submit_batch(requests_by_symbol)
    return Watched


@pytest.mark.parametrize("inline_steps", [False, True])
def test_pipelined_answers_are_correct_in_order_and_at_most_depth_in_flight(model, inline_steps):
    n = 60
    symbols, features = _stream(n, seed=3)
    recorder = Recorder()

    handler = _bursts(n, 20, symbols, features, recorder)  # several requests per symbol queued at once
    team_client = PipelinedClient(model, hold_s=0.01)  # a slow device: the runtime could queue more steps
    client, summary = _play_pipelined(team_client, handler, pipeline_min_batch=1, timeline=True,  # early
                                      inline_steps=inline_steps)

    assert sorted(uid for uid, _ in recorder.responses) == list(range(n))
    expected = _expected(model, symbols, features, range(n))
    for uid, prediction in recorder.responses:
        np.testing.assert_allclose(prediction, expected[uid], rtol=1e-5, atol=1e-6)
    _assert_stepped_in_arrival_order(team_client.stepped, symbols, n)
    assert team_client.max_in_flight == PIPELINE_DEPTH  # two really were in flight, never more
    assert summary["responses_sent"] == n and _no_model_threads_left()
    assert set(client.timeline) == set(range(n))  # every answer's stages, in order
    for stages in client.timeline.values():
        order = [stages[s] for s in ("received", "batched", "submitted", "done", "answered")]
        assert order == sorted(order)


class SerialDevice:
    """A team client whose steps run one after another on a fake device, each step_s long (or step_s(rows)) from
    when it can start (its submission, or the end of the step before it): the order and timing of a GPU's
    stream."""

    def __init__(self, model, step_s):
        self.engine, self.step_s = ReferenceEngine(model), step_s
        self.batches = []  # the unique ids of each submitted step, in order
        self.formed_busy = []  # whether each step was formed while the one before it still ran
        self.formed_at = []  # time.monotonic() when each step was formed
        self._free_at = 0.0
        self._lock = threading.Lock()

    def submit_batch(self, requests_by_symbol):
        self.formed_at.append(time.monotonic())
        self.formed_busy.append(self.formed_at[-1] < self._free_at)
        rows = [(symbol, *request) for symbol, value in requests_by_symbol.items() for request in queued(value)]
        ids = [uid for _, uid, _ in rows]
        predictions = self.engine.step([symbol for symbol, _, _ in rows], np.stack([f for _, _, f in rows]))
        step_s = self.step_s(len(ids)) if callable(self.step_s) else self.step_s
        with self._lock:
            self.batches.append(ids)
            self._free_at = ends = max(time.monotonic(), self._free_at) + step_s
        return PendingStep(lambda: time.sleep(max(0.0, ends - time.monotonic()))
                           or {"unique_ids": ids, "predictions": predictions})

    def process_batch(self, requests_by_symbol):
        raise AssertionError("the runtime must use submit_batch")


@pytest.mark.parametrize("form_late, late_after_s, punctual_late_after_s, late",
                         [(True, None, None, True), (False, None, None, False), (True, 0.0, None, True),
                          (True, 1.0, None, False), (True, 1.0, 0.0, True)])
def test_the_next_step_is_formed_just_before_the_one_in_flight_ends(model, form_late, late_after_s,
                                                                    punctual_late_after_s, late, monkeypatch):
    """Requests arriving while a step runs all go into the next step: it is formed when the one in flight is about
    to end (client/step_clock.py), not as soon as the first of them arrives (form_late=False, the rule before, or
    behind steps shorter than late_after_s, unless punctual_late_after_s says so while the submitter wakes on
    time: its timed waits are reported to the clock)."""
    wakes = []
    monkeypatch.setattr(StepClock, "woke", lambda clock, late_by_s: wakes.append(late_by_s))
    symbols, features = _stream(9, seed=5)
    recorder = Recorder()
    step_s = 0.3  # long beside a slow machine's reference step (~20 ms), which runs in submit_batch

    async def handler(ws):
        await ws.recv()
        for uid in range(5):  # one at a time, the device idle between them: the clock learns a step's time
            await ws.send(_request([uid], symbols, features))
            await recorder.pump(ws, lambda: len(recorder.answered()) > uid)
        await ws.send(_request([5], symbols, features))  # a step of one row starts at once
        for uid in (6, 7, 8):  # three more while it runs, 60 ms apart
            await asyncio.sleep(0.06)
            await ws.send(_request([uid], symbols, features))
        await recorder.pump(ws, lambda: len(recorder.answered()) >= 9)
        await ws.close(1000)

    team_client = SerialDevice(model, step_s)
    # a 50 ms margin: a loaded machine's late wake-ups neither miss the step's end nor count as late
    _, summary = asyncio.run(_play(handler, team_client, max_requests_per_symbol=4, form_late=form_late,
                                   late_after_s=late_after_s, form_margin_s=0.05,
                                   punctual_late_after_s=punctual_late_after_s))
    assert summary["responses_sent"] == 9
    if late:
        assert team_client.batches[-2:] == [[5], [6, 7, 8]]  # 6, 7 and 8 are of three symbols
        assert team_client.formed_busy[-1]  # formed while [5] ran, not once the device was idle
        assert wakes and all(late_by_s > -0.01 for late_by_s in wakes)  # the wait timed out, then was reported
    else:
        assert team_client.batches[-3:-1] == [[5], [6]]
    expected = _expected(model, symbols, features, range(9))
    for uid, prediction in recorder.responses:
        np.testing.assert_allclose(prediction, expected[uid], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("inline_steps", [False, True])
def test_the_step_clocks_lead_counts_forming_the_step_not_only_submitting_it(model, monkeypatch, inline_steps):
    """The step clock forms the next step its host time before the one in flight ends: forming it (the scheduler's
    batch, ready() asked of each waiting symbol) and submitting it. Measured from after the batch was formed, a
    slow forming was left out of the lead, and the next step started that much after the GPU went idle."""
    leads = []
    monkeypatch.setattr(StepClock, "submitted", lambda clock, formed_at, submitted_at:
                        leads.append(submitted_at - formed_at))
    forming_s = 0.05

    def slow_next_batch(scheduler, *args, _next_batch=Scheduler.next_batch, **kwargs):
        time.sleep(forming_s)
        return _next_batch(scheduler, *args, **kwargs)

    monkeypatch.setattr(Scheduler, "next_batch", slow_next_batch)
    symbols, features = _stream(3, seed=5)
    recorder = Recorder()

    async def handler(ws):
        await ws.recv()
        for uid in range(3):
            await ws.send(_request([uid], symbols, features))
            await recorder.pump(ws, lambda: len(recorder.answered()) > uid)
        await ws.close(1000)

    _, summary = asyncio.run(_play(handler, SerialDevice(model, 0.01), inline_steps=inline_steps))
    assert summary["responses_sent"] == 3 and len(leads) == 3
    assert all(lead >= forming_s for lead in leads), leads


def test_a_step_already_full_is_formed_at_once_not_late(model):
    """Behind a long step, a next step that is already full (max_batch symbols with K requests each waiting) is
    formed as soon as it fills: waiting for the step in flight to end could add nothing to it."""
    symbols, features = _stream(8, seed=6)
    recorder = Recorder()
    step_s = 0.4

    async def handler(ws):
        await ws.recv()
        for uid in range(5):  # one at a time: the clock learns a step's time
            await ws.send(_request([uid], symbols, features))
            await recorder.pump(ws, lambda: len(recorder.answered()) > uid)
        await ws.send(_request([5], symbols, features))
        await asyncio.sleep(0.05)
        await ws.send(_request([6, 7], symbols, features))  # two symbols: a full step of max_batch 2
        await recorder.pump(ws, lambda: len(recorder.answered()) >= 8)
        await ws.close(1000)

    team_client = SerialDevice(model, step_s)
    _, summary = asyncio.run(_play(handler, team_client, max_batch=2, max_requests_per_symbol=1))
    assert summary["responses_sent"] == 8 and team_client.batches[-2:] == [[5], [6, 7]]
    assert team_client.formed_busy[-1]
    assert team_client.formed_at[-1] - team_client.formed_at[-2] < step_s / 2  # formed late: ~step_s after [5]
    expected = _expected(model, symbols, features, range(8))
    for uid, prediction in recorder.responses:
        np.testing.assert_allclose(prediction, expected[uid], rtol=1e-5, atol=1e-6)


def test_arrivals_wake_the_submitter_only_when_they_can_change_its_step(model, monkeypatch):
    """While the submitter waits to form the next step late, an arrival that cannot fill that step does not wake
    it (each wake-up is a GIL handoff between the event loop and the submitter: thousands a second at a high
    rate); idle, it wakes on every arrival. Counted: the notifies the event loop's thread sends the submitter."""
    loop_notifies = []

    class CountingCondition(threading.Condition):
        def notify(self, n=1):
            if threading.current_thread() is threading.main_thread():
                loop_notifies.append(time.monotonic())
            super().notify(n)

    def init(self, *args, _init=StreamingClient.__init__, **kwargs):
        _init(self, *args, **kwargs)
        self._work_ready = CountingCondition(self._steps_ready._lock)  # the lock the runtime's two share

    monkeypatch.setattr(StreamingClient, "__init__", init)
    symbols, features = _stream(12, seed=7)
    recorder = Recorder()

    async def handler(ws):
        await ws.recv()
        for uid in range(5):  # one at a time, the device idle between them: each wakes the idle submitter
            await ws.send(_request([uid], symbols, features))
            await recorder.pump(ws, lambda: len(recorder.answered()) > uid)
        await ws.send(_request([5], symbols, features))  # a step of one row starts at once
        for uid in range(6, 12):  # six more while it runs, two of each symbol
            await asyncio.sleep(0.03)
            await ws.send(_request([uid], symbols, features))
        await recorder.pump(ws, lambda: len(recorder.answered()) >= 12)
        await ws.close(1000)

    team_client = SerialDevice(model, 0.4)
    _, summary = asyncio.run(_play(handler, team_client, max_batch=8, max_requests_per_symbol=4))
    assert summary["responses_sent"] == 12 and team_client.batches[-2:] == [[6, 7, 8], [9, 10, 11]]
    # 0-5 woke the idle submitter, and 6 the submitter idle behind [5]; of 7-11 at most the one that filled a step
    # (this team client takes one request a symbol); with a notify for every arrival the count was 13
    assert len(loop_notifies) <= 8, len(loop_notifies)
    expected = _expected(model, symbols, features, range(12))
    for uid, prediction in recorder.responses:
        np.testing.assert_allclose(prediction, expected[uid], rtol=1e-5, atol=1e-6)


class SerialDeviceOfMany(SerialDevice):
    requests_per_symbol = MANY


def test_a_step_leaves_requests_to_the_next_when_a_smaller_step_serves_more_a_second(model):
    """Steps of up to 4 rows take 0.1 s, of 5 to 8 rows 0.8 s (a step of several requests a symbol is padded to its
    size): once the clock knows both, 6 requests of 3 symbols waiting go as the oldest 4 and then 2, 40 requests a
    second against 7.5, each symbol's requests in order. (The clock times each step from its submission, the
    reference step computed there included: a wide margin, and the engine's first step, its slowest, taken
    before, keep a busy 2-core CPU's compute from turning the choice.)"""
    symbols, features = _stream(16, seed=7)  # three symbols in turn
    recorder = Recorder()

    async def handler(ws):
        await ws.recv()
        for ids in ([0, 1, 2, 3], [4, 5, 6, 7, 8, 9]):  # the clock learns both sizes' times
            await ws.send(_request(ids, symbols, features))
            await recorder.pump(ws, lambda: len(recorder.answered()) > ids[-1])
        await ws.send(_request(list(range(10, 16)), symbols, features))
        await recorder.pump(ws, lambda: len(recorder.answered()) >= 16)
        await ws.close(1000)

    team_client = SerialDeviceOfMany(model, lambda rows: 0.1 if rows <= 4 else 0.8)
    team_client.engine.step(["WARM_UP"], features[:1])
    team_client.engine.release(["WARM_UP"])
    client, summary = asyncio.run(_play(handler, team_client, max_requests_per_symbol=4, timeline=True))
    assert summary["responses_sent"] == 16
    assert [sorted(ids) for ids in team_client.batches] == [[0, 1, 2, 3], [4, 5, 6, 7, 8, 9], [10, 11, 12, 13],
                                                            [14, 15]]
    # the timeline's step log: each step's rows and symbols, in order, each ended after it was submitted
    assert [(s["rows"], s["symbols"]) for s in client.steps] == [(4, 3), (6, 3), (4, 3), (2, 2)]
    assert all(s["formed"] <= s["submitted"] <= s["ended"] for s in client.steps)
    expected = _expected(model, symbols, features, range(16))
    for uid, prediction in recorder.responses:
        np.testing.assert_allclose(prediction, expected[uid], rtol=1e-5, atol=1e-6)


def test_light_load_waits_for_the_gpu_instead_of_submitting_early(model):
    """Fewer waiting symbols than pipeline_min_batch: each batch is formed only when no step is in flight, so
    it collects everything that arrived meanwhile."""
    n = 30
    symbols, features = _stream(n, seed=4)
    recorder = Recorder()

    team_client = PipelinedClient(model, hold_s=0.01)
    client, summary = _play_pipelined(team_client, _bursts(n, 10, symbols, features, recorder),
                                      pipeline_min_batch=len(SYMBOLS) + 1)
    assert sorted(uid for uid, _ in recorder.responses) == list(range(n))
    _assert_stepped_in_arrival_order(team_client.stepped, symbols, n)
    assert team_client.max_in_flight == 1 and summary["responses_sent"] == n


@pytest.mark.parametrize("inline_steps", [False, True])
def test_failing_result_answers_that_batch_with_client_error_and_later_ones_normally(model, inline_steps):
    n = 30
    symbols, features = _stream(n, seed=4)
    recorder = Recorder()

    handler = _bursts(n, 15, symbols, features, recorder,
                      done=lambda: recorder.errors and len(recorder.answered()) + 3 >= n)
    team_client = PipelinedClient(model, fail_on_id=7)
    _play_pipelined(team_client, handler, max_batch=3, inline_steps=inline_steps)

    failed = team_client.failed_ids
    assert 7 in failed and len(failed) == 3
    assert len(recorder.errors) == 1 and f"unique_ids {failed} not answered" in recorder.errors[0]
    assert "device fault" in recorder.errors[0]
    assert recorder.answered() == set(range(n)) - set(failed)  # later batches answered, also of those symbols
    expected = _expected(model, symbols, features, range(n))  # the failed step still advanced the states
    for uid, prediction in recorder.responses:
        np.testing.assert_allclose(prediction, expected[uid], rtol=1e-5, atol=1e-6)
    _assert_stepped_in_arrival_order(team_client.stepped, symbols, n)


@pytest.mark.parametrize("inline_steps", [False, True])
def test_failing_submit_batch_answers_that_batch_with_client_error(model, inline_steps):
    symbols, features = _stream(6)
    recorder = Recorder()

    class FailingSubmit(PipelinedClient):
        def submit_batch(self, requests_by_symbol):
            if any(uid == 1 for uid, _ in requests_by_symbol.values()):
                raise ValueError("bad batch")
            return super().submit_batch(requests_by_symbol)

    async def handler(ws):
        await ws.recv()
        await ws.send(_request(list(range(6)), symbols, features))
        await recorder.pump(ws, lambda: recorder.errors and len(recorder.answered()) >= 5)
        await ws.close(1000)

    _play_pipelined(FailingSubmit(model), handler, max_batch=1, inline_steps=inline_steps)
    assert recorder.answered() == {0, 2, 3, 4, 5}
    assert "unique_ids [1] not answered: ValueError: bad batch" in recorder.errors[0]


@pytest.mark.parametrize("inline_steps", [False, True])
def test_stopping_keeps_every_submitted_step(model, inline_steps):
    n = 30
    symbols, features = _stream(n, seed=5)
    recorder = Recorder()

    handler = _bursts(n, n, symbols, features, recorder, done=recorder.answered)  # closes with steps in flight

    team_client = PipelinedClient(model, hold_s=0.02)
    client, _ = _play_pipelined(team_client, handler, max_batch=1, inline_steps=inline_steps)

    submitted = [uid for _, uid in team_client.stepped]
    assert submitted == list(range(len(submitted))) and len(submitted) < n  # it stopped mid-stream...
    assert set(client._cache) == set(submitted)  # ...but every submitted step was collected
    assert set(client._in_flight) == set(range(len(submitted), n))  # and the unsubmitted rest still waits
    assert _no_model_threads_left()


def test_inline_steps_run_on_the_event_loop_with_no_model_thread(model):
    """With inline_steps the event loop submits each step, sees it end by polling, and sends its answer: no
    submitter or completer thread runs, and the answers are those of the threads' way, in order."""
    n = 30
    symbols, features = _stream(n, seed=21)
    recorder = Recorder()
    seen_threads = set()
    team_client = _watching_threads(JoiningDevice, seen_threads)(model, step_s=0.02)
    client, summary = _play_pipelined(team_client, _paced(n, 0.008, symbols, features, recorder),
                                      pipeline_min_batch=1, inline_steps=True, timeline=True)
    assert seen_threads == {"MainThread"}  # every submit from the event loop's thread, no model thread beside it
    expected = _expected(model, symbols, features, range(n))
    assert sorted(uid for uid, _ in recorder.responses) == list(range(n))
    for uid, prediction in recorder.responses:
        np.testing.assert_allclose(prediction, expected[uid], rtol=1e-5, atol=1e-6)
    _assert_stepped_in_arrival_order(team_client.stepped, symbols, n)
    assert summary["responses_sent"] == n
    for stages in client.timeline.values():
        order = [stages[s] for s in ("received", "batched", "submitted", "done", "answered")]
        assert order == sorted(order)


def test_inline_steps_pump_in_a_frames_handler_only_where_no_step_is_in_flight(model, monkeypatch):
    """With a step in flight the loop already looks at the steps on its next turn: a frame's handler leaves the
    pump to it (a pump after every frame cost the loop more than the frame, and fell behind past 16,000 req/s on an
    H200: bench/LOG.md section 79); with none in flight the handler pumps, so that a request steps at once. Every
    request is answered, in order."""
    n = 48
    symbols, features = _stream(n, seed=25)
    recorder = Recorder()
    in_handler, pumps = [], {"in flight": 0, "idle": 0, "turn": 0}
    on_frame, pump = StreamingClient._on_frame, StreamingClient._pump

    def counted_on_frame(self, ws, frame):
        in_handler.append(bool(self._steps))
        try:
            return on_frame(self, ws, frame)
        finally:
            in_handler.pop()

    def counted_pump(self):
        pumps["turn" if not in_handler else "in flight" if in_handler[-1] else "idle"] += 1
        return pump(self)

    monkeypatch.setattr(StreamingClient, "_on_frame", counted_on_frame)
    monkeypatch.setattr(StreamingClient, "_pump", counted_pump)
    team_client = JoiningDevice(model, step_s=0.02)
    _play_pipelined(team_client, _bursts(n, 2, symbols, features, recorder), pipeline_min_batch=1, inline_steps=True)
    assert recorder.answered() == set(range(n))
    _assert_stepped_in_arrival_order(team_client.stepped, symbols, n)
    assert pumps["idle"] >= 1 and pumps["turn"] > 0  # the first frame stepped at once; the loop's turns did the rest
    assert pumps["in flight"] == 0


def test_a_failure_in_the_pump_is_logged_and_looked_at_again_never_a_hang(model, monkeypatch, caplog):
    """A failure of the pump's own while it answers a step (none known now: a journal's failed write was one) is
    logged with its traceback and the pump looks again: the step is answered then and the session ends. Before, the
    pump was not scheduled again, and with the stream's last frame come the session waited for ever."""
    n = 8
    symbols, features = _stream(n, seed=26)
    recorder = Recorder()
    answer, failed = StreamingClient._answer, []

    def answer_failing_once(self, ids, *rest):
        if not failed:
            failed.append(list(ids))
            raise RuntimeError("a fault of the pump's own")
        return answer(self, ids, *rest)

    monkeypatch.setattr(StreamingClient, "_answer", answer_failing_once)
    team_client = JoiningDevice(model, step_s=0.01)
    with caplog.at_level("ERROR", logger="client.runtime"):
        asyncio.run(asyncio.wait_for(_play(_bursts(n, n, symbols, features, recorder), team_client,
                                           pipeline_min_batch=1, inline_steps=True), 30))
    team_client.close()
    assert failed and recorder.answered() == set(range(n))  # one frame: no later one pumped it again
    _assert_stepped_in_arrival_order(team_client.stepped, symbols, n)
    assert "the runtime's step pump failed; looking again" in caplog.text and "a fault of the pump's own" in caplog.text


@pytest.mark.parametrize("declared, inline_steps, expected", [
    (True, None, True), (None, None, False), (1, None, False), (True, False, False), (None, True, True)])
def test_inline_steps_by_default_exactly_where_the_team_client_says_its_steps_run_in_the_background(
        model, declared, inline_steps, expected):
    """Left to the runtime (inline_steps None), the event loop runs the steps itself where the team client's
    steps_in_background is True (nothing else counts), and threads run them otherwise; given, the runtime does as
    told. Either way every request is answered, in order."""
    n = 12
    symbols, features = _stream(n, seed=24)
    recorder = Recorder()
    submitted_on = set()
    team_client = _watching_threads(JoiningDevice, submitted_on)(model, step_s=0.01)
    if declared is not None:
        team_client.steps_in_background = declared
    options = {} if inline_steps is None else {"inline_steps": inline_steps}
    client, _ = _play_pipelined(team_client, _bursts(n, 4, symbols, features, recorder), pipeline_min_batch=1,
                                **options)
    assert client.inline_steps is expected
    assert (submitted_on == {"MainThread"}) is expected
    assert recorder.answered() == set(range(n))
    _assert_stepped_in_arrival_order(team_client.stepped, symbols, n)


def test_inline_steps_wait_on_the_loop_for_a_step_that_cannot_say_it_ended(model):
    """A team client's pending step without done(): the loop takes it as ended and its result() waits there; every
    request is still answered, in order."""
    n = 12
    symbols, features = _stream(n, seed=22)
    recorder = Recorder()

    class NoDone(PipelinedClient):
        def submit_batch(self, requests_by_symbol):
            pending = super().submit_batch(requests_by_symbol)
            return SimpleNamespace(result=pending.result)  # no done()

    team_client = NoDone(model)
    _play_pipelined(team_client, _bursts(n, 4, symbols, features, recorder), pipeline_min_batch=1,
                    inline_steps=True)
    assert recorder.answered() == set(range(n))
    _assert_stepped_in_arrival_order(team_client.stepped, symbols, n)


def test_inline_steps_go_on_past_a_done_that_raises(model, caplog):
    """A team client's done() that raises is logged and the step taken as ended: its result() answers it, and the
    loop goes on stepping the rest."""
    n = 12
    symbols, features = _stream(n, seed=23)
    recorder = Recorder()

    class FailingDone(PipelinedClient):
        def submit_batch(self, requests_by_symbol):
            pending = super().submit_batch(requests_by_symbol)
            pending.done = lambda: 1 / 0
            return pending

    team_client = FailingDone(model)
    _play_pipelined(team_client, _bursts(n, 4, symbols, features, recorder), pipeline_min_batch=1,
                    inline_steps=True)
    assert recorder.answered() == set(range(n))
    assert "team client's done() failed" in caplog.text


@pytest.mark.parametrize("inline_steps", [False, True])  # inline steps need submit_batch: the worker stays
def test_a_client_with_only_process_batch_runs_the_single_worker(model, inline_steps):
    n = 12
    symbols, features = _stream(n, seed=6)
    recorder = Recorder()
    threads = set()

    class ProcessOnly:
        def __init__(self):
            self.engine = ReferenceEngine(model)

        def process_batch(self, requests_by_symbol):
            threads.add(threading.current_thread().name)
            return ExampleModel(self.engine).process_batch(requests_by_symbol)

    async def handler(ws):
        await ws.recv()
        await ws.send(_request(list(range(n)), symbols, features))
        await recorder.pump(ws, lambda: len(recorder.answered()) >= n)
        await ws.close(1000)

    asyncio.run(_play(handler, ProcessOnly(), inline_steps=inline_steps))
    expected = _expected(model, symbols, features, range(n))
    assert recorder.answered() == set(range(n))
    for uid, prediction in recorder.responses:
        np.testing.assert_allclose(prediction, expected[uid], rtol=1e-5, atol=1e-6)
    assert threads == {"model-step"}


# ---- joins: a request arriving while a step waits on the device behind another goes into that step ----------
class _DeviceStep(PendingStep):
    """One step of JoiningDevice: it reads its rows (the formed ones and those joined so far) when it starts."""

    def __init__(self, rows, room, miss, fate_fails=lambda uid: False, ready=lambda symbol: True, refuse=()):
        super().__init__(self._answer, poll=lambda: self.finished.is_set())
        self.rows, self.room, self.miss = rows, room, miss  # miss(uid): a join the device reads too late
        self.ready = ready  # ready(symbol): False while its state is on its way (a join of it is refused)
        self.refuse = refuse  # symbols whose joins it refuses (as the engine one with no slot on the GPU yet)
        self.submitted_at = None  # when submit_batch returned it
        self.fate_fails = fate_fails  # fate_fails(uid): fate() raises for this join once the step has read it
        self.joins, self.taken = [], None  # taken: the joins read when it started
        self.finished = threading.Event()
        self.lock = threading.Lock()

    def join(self, unique_id, symbol, features):
        with self.lock:
            if self.taken is not None or len(self.joins) >= self.room or symbol in {s for s, _, _ in
                                                                                     self.rows + self.joins} \
                    or not self.ready(symbol) or symbol in self.refuse:
                return False
            self.joins.append((symbol, unique_id, features))
            return True

    def fate(self, unique_id):
        with self.lock:
            if self.taken is not None and self.fate_fails(unique_id):
                raise RuntimeError("fate lost")
            return None if self.taken is None else any(uid == unique_id for _, uid, _ in self.taken)

    def start(self):
        with self.lock:
            self.taken = [j for j in self.joins if not self.miss(j[1])]
            return self.rows + self.taken

    def _answer(self):
        assert self.finished.wait(30), "never finished"
        if self.answer is None:
            raise RuntimeError("device fault")
        return self.answer


class JoiningDevice:
    """A team client whose steps run one after another on a fake device, each step_s long; a step reads its
    inputs when it starts, so a request joined to it before then is stepped with it (FastEngine's JoinableStep,
    in time). miss(unique_id): joins the device reads as too late, as when one lands just after the step began.
    submit_s: the host's time in submit_batch, the step queued on the device at its end. lands_at {symbol: time}:
    states on their way to the device until time.monotonic() passes that (ready() False, joins refused). refuse:
    symbols whose joins every step refuses."""

    requests_per_symbol = MANY

    def __init__(self, model, step_s, room=2, miss=lambda uid: False, fail_first_join=False,
                 fate_fails=lambda uid: False, submit_s=0.0, lands_at=None, refuse=()):
        self.engine, self.step_s, self.room, self.miss = ReferenceEngine(model), step_s, room, miss
        self.refuse = refuse
        self.fate_fails, self.submit_s, self.lands_at = fate_fails, submit_s, lands_at or {}
        self.submitted = []  # every step, in submission order
        self.step_of = {}  # unique_id -> the index of the step that stepped it
        self.failed = None if fail_first_join else []  # the unique ids of the step made to fail
        self.stepped = []  # (symbol, unique_id) in the order the device stepped them
        self.steps = deque()
        self.cond = threading.Condition()
        self.closed = False
        self.device = threading.Thread(target=self._run, daemon=True)
        self.device.start()

    def submit_batch(self, requests_by_symbol):
        rows = [(symbol, *request) for symbol, value in requests_by_symbol.items() for request in queued(value)]
        time.sleep(self.submit_s)
        step = _DeviceStep(rows, self.room, self.miss, self.fate_fails, self.ready, self.refuse)
        with self.cond:
            self.steps.append(step)
            self.submitted.append(step)
            self.cond.notify_all()
        step.submitted_at = time.monotonic()
        return step

    def ready(self, symbol):
        return time.monotonic() >= self.lands_at.get(symbol, 0.0)

    @property
    def moves_states(self):
        return bool(self.lands_at)

    def process_batch(self, requests_by_symbol):
        raise AssertionError("the runtime must use submit_batch")

    def _run(self):
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.closed or self.steps)
                if self.closed:
                    return
                step = self.steps.popleft()
            rows = step.start()
            assert all(self.ready(s) for s, _, _ in rows), "a step started with a state still on its way"
            predictions = self.engine.step([s for s, _, _ in rows], np.stack([f for _, _, f in rows]))
            self.stepped.extend((s, uid) for s, uid, _ in rows)
            self.step_of.update((uid, self.submitted.index(step)) for _, uid, _ in rows)
            time.sleep(self.step_s)
            step.answer = {"unique_ids": [uid for _, uid, _ in rows], "predictions": predictions}
            if self.failed is None and step.taken:
                self.failed = [uid for _, uid, _ in rows]
                step.answer = None
            step.finished.set()

    def close(self):
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        self.device.join()


def _paced(n, gap_s, symbols, features, recorder, done=None):
    """A server handler sending requests 0..n-1 one at a time, gap_s apart, then waiting until `done()` (by
    default: every request answered)."""
    async def handler(ws):
        await ws.recv()
        for i in range(n):
            await ws.send(_request([i], symbols, features))
            await asyncio.sleep(gap_s)
        await recorder.pump(ws, done or (lambda: len(recorder.answered()) >= n))
        await ws.close(1000)
    return handler


@pytest.mark.parametrize("miss_every", [0, 3])
def test_arrivals_join_the_step_queued_behind_the_one_in_flight_in_order(model, miss_every):
    """With two steps on the device, an arriving request of a symbol with nothing waiting joins the queued one;
    one the device read too late goes back to the front of its symbol's queue. Every answer is right and every
    symbol steps in arrival order."""
    n = 45
    symbols, features = _stream(n, seed=11)
    recorder = Recorder()
    team_client = JoiningDevice(model, step_s=0.04,
                                miss=(lambda uid: uid % miss_every == 0) if miss_every else (lambda uid: False))
    client, summary = _play_pipelined(team_client, _paced(n, 0.012, symbols, features, recorder),
                                      pipeline_min_batch=1, step_log=True)
    expected = _expected(model, symbols, features, range(n))
    assert sorted(uid for uid, _ in recorder.responses) == list(range(n))
    for uid, prediction in recorder.responses:
        np.testing.assert_allclose(prediction, expected[uid], rtol=1e-5, atol=1e-6)
    _assert_stepped_in_arrival_order(team_client.stepped, symbols, n)
    assert sorted(uid for _, uid in team_client.stepped) == list(range(n))  # each stepped once
    assert client.joins["taken"] > 0
    assert (client.joins["missed"] > 0) == bool(miss_every)
    assert sum(step.get("joined", 0) for step in client.steps) == client.joins["taken"]
    assert summary["responses_sent"] == n and _no_model_threads_left()


def test_no_joins_when_switched_off(model):
    n = 24
    symbols, features = _stream(n, seed=12)
    recorder = Recorder()
    team_client = JoiningDevice(model, step_s=0.04)
    client, _ = _play_pipelined(team_client, _paced(n, 0.012, symbols, features, recorder), pipeline_min_batch=1,
                                join_queued=False)
    assert recorder.answered() == set(range(n))
    assert client.joins == {"taken": 0, "missed": 0}
    _assert_stepped_in_arrival_order(team_client.stepped, symbols, n)


def test_requests_that_arrive_while_a_step_is_submitted_join_it_once_it_is(model):
    """A submit takes the host a while (the engine's ~0.3 ms); a request arriving meanwhile finds no queued step to
    join and then a full pipeline. It joins the step that was being submitted as soon as that is queued, instead of
    waiting for the step after it. Answers right, in order, each request stepped once."""
    n = 45
    symbols, features = _stream(n, seed=15)
    recorder = Recorder()

    async def handler(ws):
        await ws.recv()
        for i in range(n):
            await ws.send(_request([i], symbols, features))
            await asyncio.sleep(0.012)
        await recorder.pump(ws, lambda: len(recorder.answered()) >= n)
        await ws.close(1000)

    team_client = JoiningDevice(model, step_s=0.04, submit_s=0.015)
    client, summary = _play_pipelined(team_client, handler, pipeline_min_batch=1, timeline=True)
    expected = _expected(model, symbols, features, range(n))
    assert sorted(uid for uid, _ in recorder.responses) == list(range(n))
    for uid, prediction in recorder.responses:
        np.testing.assert_allclose(prediction, expected[uid], rtol=1e-5, atol=1e-6)
    _assert_stepped_in_arrival_order(team_client.stepped, symbols, n)
    assert sorted(uid for _, uid in team_client.stepped) == list(range(n))
    joined_during_submit = [uid for step in team_client.submitted for _, uid, _ in step.taken or ()
                            if client.timeline[uid]["received"] < step.submitted_at]
    assert joined_during_submit  # received before its step was submitted, and joined to it


@pytest.mark.parametrize("queued_behind, inline_steps", [(0, False), (1, False), (0, True), (1, True)])
def test_a_state_that_lands_while_the_pipeline_is_full_joins_the_queued_step(model, queued_behind, inline_steps):
    """Steps A and B on the device (B queued), then a request of a symbol whose state is still on its way: when
    the state lands before B starts, the request joins B rather than waiting for the step after. With a second
    request of that symbol queued behind it, neither joins (the later one must follow it): both go to a later
    step, in order."""
    a, b, x = SYMBOLS[:3]
    symbols = [a, b, x] + [x] * queued_behind
    features = np.random.default_rng(16).standard_normal((len(symbols), 79)).astype(np.float32)
    recorder = Recorder()
    team_client = JoiningDevice(model, step_s=0.25, lands_at={x: time.monotonic() + 3600})

    async def handler(ws):
        await ws.recv()
        await ws.send(_request([0], symbols, features))
        await asyncio.sleep(0.02)
        await ws.send(_request([1], symbols, features))  # B queued behind A
        await asyncio.sleep(0.01)
        team_client.lands_at[x] = time.monotonic() + 0.02  # x's state lands ~200 ms before B starts
        await ws.send(_request(list(range(2, len(symbols))), symbols, features))
        await recorder.pump(ws, lambda: len(recorder.answered()) >= len(symbols))
        await ws.close(1000)

    client, _ = _play_pipelined(team_client, handler, pipeline_min_batch=1, inline_steps=inline_steps)
    expected = _expected(model, symbols, features, range(len(symbols)))
    assert recorder.answered() == set(range(len(symbols)))
    for uid, prediction in recorder.responses:
        np.testing.assert_allclose(prediction, expected[uid], rtol=1e-5, atol=1e-6)
    step_of = team_client.step_of
    assert step_of[0] == 0 and step_of[1] == 1
    if queued_behind:
        assert step_of[2] > 1 and [uid for s, uid in team_client.stepped if s == x] == [2, 3]
    else:
        assert step_of[2] == 1 and client.joins["taken"] == 1


def test_a_symbol_the_queued_step_refuses_does_not_keep_later_ones_from_joining_it(model):
    """Two requests arrive while step B is being submitted behind A; B refuses the older one's symbol (as the engine
    does one with no slot on the GPU yet): the younger one still joins B, the older one steps after it."""
    a, b, x = SYMBOLS[:3]
    symbols = [a, b, x, a]
    features = np.random.default_rng(17).standard_normal((len(symbols), 79)).astype(np.float32)
    recorder = Recorder()
    team_client = JoiningDevice(model, step_s=0.3, submit_s=0.06, refuse={x})

    async def handler(ws):
        await ws.recv()
        await ws.send(_request([0], symbols, features))
        await asyncio.sleep(0.08)  # A on the device
        await ws.send(_request([1], symbols, features))  # B being submitted for 60 ms from now
        await asyncio.sleep(0.015)
        await ws.send(_request([2, 3], symbols, features))  # both queued while B is submitted
        await recorder.pump(ws, lambda: len(recorder.answered()) >= len(symbols))
        await ws.close(1000)

    _play_pipelined(team_client, handler, pipeline_min_batch=1)
    assert recorder.answered() == set(range(len(symbols)))
    expected = _expected(model, symbols, features, range(len(symbols)))
    for uid, prediction in recorder.responses:
        np.testing.assert_allclose(prediction, expected[uid], rtol=1e-5, atol=1e-6)
    assert team_client.step_of[0] == 0 and team_client.step_of[1] == 1
    assert team_client.step_of[3] == 1 and team_client.step_of[2] == 2


def test_joining_waiting_requests_offers_each_waiting_symbol_once():
    """A queued step that refuses every join (full, or started) is offered each waiting symbol's request once, oldest
    first, and not again at the next look: taken one at a time, each take once looked again at every symbol held
    back before it (4,000 waiting symbols held the lock 5.3 s), and each look once popped every waiting head
    (0.5 ms at 1,000 symbols, every READY_POLL_S). Every request stays queued, in its place."""
    class Team:
        requests_per_symbol = MANY

        def submit_batch(self, requests_by_symbol):
            raise AssertionError("no step is formed here")

    client = StreamingClient(Team(), "ws://127.0.0.1:1", "testers", inline_steps=False)
    for _ in range(PIPELINE_DEPTH):  # a full pipeline whose queued step has no room
        client._steps.append(runtime._Step([], _DeviceStep([], room=0, miss=lambda uid: False), 0.0, (1, 1), None))
    n = 300
    for uid in reversed(range(n)):  # the symbols' names in the opposite order to their arrival
        client._scheduler.push(Request(n - 1 - uid, f"S{uid:03d}", np.zeros(79, np.float32)))
    client._scheduler.push(Request(n, "S000", np.zeros(79, np.float32)))  # two queued: its later one must wait
    offered, take_front = [], client._scheduler.take_front

    def counting_takes(symbol):
        offered.append(symbol)
        return take_front(symbol)
    client._scheduler.take_front = counting_takes
    with client._work_ready:
        client._join_waiting()
        assert offered == [f"S{uid:03d}" for uid in reversed(range(1, n))]
        client._join_waiting()
    assert len(offered) == n - 1 and client._refused[1] == set(offered)
    assert len(client._scheduler) == n + 1 and client._scheduler.waiting_symbols() == n
    assert [r.unique_id for r in client._scheduler.next_batch(None, 2)] == list(range(n - 1)) + [n - 1, n]


def test_a_failing_step_answers_its_joins_with_client_error_and_the_rest_normally(model):
    n = 30
    symbols, features = _stream(n, seed=13)
    recorder = Recorder()
    team_client = JoiningDevice(model, step_s=0.04, fail_first_join=True)
    handler = _paced(n, 0.012, symbols, features, recorder,
                     done=lambda: len(recorder.answered()) + len(team_client.failed or ()) >= n and recorder.errors)
    _play_pipelined(team_client, handler, pipeline_min_batch=1)
    failed = set(team_client.failed)
    assert len(failed) >= 2  # a formed request and at least one joined
    assert all(any(str(uid) in error for error in recorder.errors) for uid in failed)
    assert recorder.answered() == set(range(n)) - failed
    expected = _expected(model, symbols, features, range(n))  # the device stepped every request
    for uid, prediction in recorder.responses:
        np.testing.assert_allclose(prediction, expected[uid], rtol=1e-5, atol=1e-6)


def test_a_failing_fate_is_settled_by_its_steps_answer(model, caplog):
    """fate() raising for every join the device read: the runtime holds the symbol until the step's answer says
    whether the join made it; every request is answered right, in order, and the runtime goes on to the end."""
    n = 45
    symbols, features = _stream(n, seed=14)
    recorder = Recorder()
    team_client = JoiningDevice(model, step_s=0.04, fate_fails=lambda uid: True)
    client, summary = _play_pipelined(team_client, _paced(n, 0.012, symbols, features, recorder),
                                      pipeline_min_batch=1)
    assert recorder.answered() == set(range(n)) and not recorder.errors
    expected = _expected(model, symbols, features, range(n))
    for uid, prediction in recorder.responses:
        np.testing.assert_allclose(prediction, expected[uid], rtol=1e-5, atol=1e-6)
    _assert_stepped_in_arrival_order(team_client.stepped, symbols, n)
    assert sorted(uid for _, uid in team_client.stepped) == list(range(n))
    assert client.joins["taken"] > 0 and summary["responses_sent"] == n and _no_model_threads_left()
    assert "settled by its step's answer" in caplog.text  # the path under test was taken


# ---- randomized arrivals: the runtime's rules over many patterns ------------------------------------------
def _random_arrivals(seed, n=40):
    """A deterministic random stream: bursts of one symbol or many, several symbols, repeats, occasional NaN rows,
    sent as messages with short random gaps. Returns (symbols, features, messages: [(ids, gap_s)])."""
    rng = np.random.default_rng(seed)
    pool = [f"R{seed}_{i}" for i in range(int(rng.integers(1, 9)))]
    symbols = []
    while len(symbols) < n:
        if rng.random() < 0.3:  # a run of one symbol
            symbols += [str(rng.choice(pool))] * int(rng.integers(2, 7))
        else:
            symbols.append(str(rng.choice(pool)))
    symbols = symbols[:n]
    features = rng.standard_normal((n, 79)).astype(np.float32)
    for i in np.flatnonzero(rng.random(n) < 0.07):
        features[i, int(rng.integers(79))] = np.nan
    messages, start = [], 0
    while start < n:
        size = int(rng.choice([1, 1, 2, 3, 8, 16]))
        gap = float(rng.choice([0.0, 0.0, 0.001, 0.004, 0.012]))
        messages.append((list(range(start, min(start + size, n))), gap))
        start += size
    return symbols, features, messages


def _random_client(kind, model):
    """(team client, steps(): each step's [(symbol, unique_id)] as the model stepped it) for a kind of client."""
    if kind == "process":
        class ProcessOnly:
            requests_per_symbol = MANY

            def __init__(self):
                self.example, self.steps = ExampleModel(ReferenceEngine(model)), []

            def process_batch(self, requests_by_symbol):
                self.steps.append([(s, uid) for s, value in requests_by_symbol.items() for uid, _ in queued(value)])
                return self.example.process_batch(requests_by_symbol)

            def close(self):
                pass
        client = ProcessOnly()
        return client, lambda: client.steps
    if kind == "serial":
        client = SerialDeviceOfMany(model, 0.003)
        client.close = lambda: None
        return client, lambda: [[(None, uid) for uid in ids] for ids in client.batches]
    if kind == "one":
        client = PipelinedClient(model)
        return client, lambda: [[(s, uid)] for s, uid in client.stepped]
    options = {"miss": lambda uid: uid % 4 == 1}
    if kind == "landing":  # states on their way, joins that come while a step is submitted, fates that fail
        options.update(submit_s=0.002, lands_at={"": 0.0}, fate_fails=lambda uid: uid % 3 == 0)
    client = JoiningDevice(model, step_s=0.004, **options)
    if kind == "landing":
        landing = client.ready

        def ready(symbol, _seen=set()):
            if symbol not in _seen:  # each symbol's state lands 5 ms after it is first asked for
                _seen.add(symbol)
                client.lands_at[symbol] = time.monotonic() + 0.005
            return landing(symbol)
        client.ready = ready
    return client, lambda: [[(s, uid) for s, uid, _ in step.rows + (step.taken or [])] for step in client.submitted]


@pytest.mark.parametrize("seed, kind, per_symbol, inline_steps", [
    (0, "process", 1, None), (1, "process", 4, None), (2, "serial", 2, False), (3, "one", 4, False),
    (4, "joining", 1, False), (5, "joining", 2, True), (6, "landing", 4, False), (7, "landing", 4, True)])
def test_random_arrivals_keep_every_rule(model, seed, kind, per_symbol, inline_steps):
    """Random arrivals (bursts, many symbols, repeated symbols, NaN rows) through the real runtime: each valid
    request is stepped once and answered once, NaN rows get an error alone, each symbol's requests step in arrival
    order, a step carries at most K requests of a symbol, and every answer equals stepping each symbol's requests
    one at a time."""
    symbols, features, messages = _random_arrivals(seed)
    n = len(symbols)
    nan_ids = {i for i in range(n) if not np.isfinite(features[i]).all()}
    valid = [i for i in range(n) if i not in nan_ids]
    recorder = Recorder()

    async def handler(ws):
        await ws.recv()
        for ids, gap in messages:
            await ws.send(protocol.encode(protocol.inference_request(ids, [symbols[i] for i in ids], features[ids],
                                                                     0.0)))
            if gap:
                await asyncio.sleep(gap)
        await recorder.pump(ws, lambda: recorder.answered() >= set(valid) and len(recorder.errors) >= len(nan_ids),
                            timeout_s=30)
        await ws.close(1000)

    team_client, steps = _random_client(kind, model)
    options = {} if inline_steps is None else {"inline_steps": inline_steps}
    try:
        client, summary = asyncio.run(_play(handler, team_client, max_requests_per_symbol=per_symbol,
                                            pipeline_min_batch=1, **options))
    finally:
        team_client.close()
    answered = [uid for uid, _ in recorder.responses]
    assert sorted(answered) == valid  # each valid request answered once
    assert summary["responses_sent"] == len(valid) and summary["errors"] == len(nan_ids)
    for uid in nan_ids:
        assert sum(f"unique_id {uid} " in e for e in recorder.errors) == 1, recorder.errors
    stepped = [uid for step in steps() for _, uid in step]
    assert sorted(stepped) == valid  # each stepped once, NaN rows never
    for step in steps():
        per = {}
        for _, uid in step:
            per[symbols[uid]] = per.get(symbols[uid], 0) + 1
        assert max(per.values()) <= per_symbol, step
    for symbol in set(symbols):
        assert [uid for uid in stepped if symbols[uid] == symbol] == [i for i in valid if symbols[i] == symbol]
    references = {s: ReferenceEngine(model) for s in set(symbols)}
    expected = {i: references[symbols[i]].step([symbols[i]], features[i:i + 1])[0] for i in valid}
    for uid, prediction in recorder.responses:
        np.testing.assert_allclose(prediction, expected[uid], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("row_sizes, known, rows, expected", [
    ((384,), {256: 0.0172, 384: 0.0198}, 270, 256),  # below 384 comes 256 (192 was weighed: 270 were taken)
    ((384, 768), {512: 0.030, 768: 0.050}, 600, 512),  # below 768 comes 512 (384's time unknown: all 600)
    ((256, 384, 512), {256: 0.0172, 384: 0.0198}, 270, 256)])
def test_the_next_size_down_is_the_largest_size_below_a_row_size_too(row_sizes, known, rows, expected):
    """rows_to_take weighs the next smaller size a step runs at: below a row size that is no power of two that is
    the power of two (or row size) under it, not half of it."""
    clock = StepClock(smoothing=1.0, margin_s=0.0, late_after_s=0.0, clock=lambda: 0.0, row_sizes=row_sizes)
    start = 0.0
    for size_rows, seconds in known.items():
        clock.ended(clock.size(size_rows, 64), submitted_at=start, ended_at=start + seconds)
        start += seconds
    assert clock.rows_to_take(rows, 64) == expected


# ---- steps answered in parts: a hung shard ----------------------------------------------------------------
class _GatedShard(Shard):
    """A shard in this process (its own engine on the CPU, run as the transports run theirs) whose answers wait
    while its gate is closed: a shard alive and answering nothing, as a stopped process or a stuck node's."""
    where, info = "this process", {}

    def __init__(self, index, model):
        from client.engine.precision import FP32_PRECISION
        self.index = index
        self.engine = FastEngine(model, device="cpu", precision=FP32_PRECISION, capacity=8, host_symbols=0,
                                 progress=False)
        self.engine.expired()  # as build_shard_engine
        self.gate = threading.Event()
        self.gate.set()

    def submit(self, symbols, features):
        return submit_placeable(self.engine, symbols, features)

    def result(self, handle):
        self.gate.wait(60)
        return handle.result()

    def release(self, symbols):
        self.engine.release(symbols)

    def stop(self):
        self.gate.set()


class _AskedReady(ExampleModel):
    """The example client, noting the symbols its ready() is asked about."""

    def __init__(self, engine):
        super().__init__(engine)
        self.asked = []

    def ready(self, symbol):
        self.asked.append(symbol)
        return super().ready(symbol)


@pytest.mark.parametrize("inline_steps", [False, True])
def test_a_hung_shard_holds_up_its_own_symbols_alone(model, inline_steps):
    """A shard alive but answering nothing held every symbol until --shard-timeout-s (60 s): the runtime answered a
    step whole, and two steps waiting on that shard filled its pipeline. Now a step whose last parts are late is
    answered for the parts that came and the next steps form without it: the live shard's symbols are answered
    while the hung shard's wait, then the hung shard's are answered in order once it answers, every answer the one
    of stepping each symbol's requests one at a time."""
    shards = [_GatedShard(0, model), _GatedShard(1, model)]
    engine = ShardedEngine(shards, progress=False)
    names = ["H0", "H1", "H2", "H3"]  # placed alternately: H0 and H2 on shard 0, H1 and H3 on shard 1
    rounds = 8
    n = 4 * (rounds + 1)
    symbols = [names[i % 4] for i in range(n)]
    features = np.random.default_rng(8).standard_normal((n, 79)).astype(np.float32)
    live = {uid for uid in range(n) if symbols[uid] in ("H0", "H2")}
    recorder, seen = Recorder(), {}

    async def handler(ws):
        await ws.recv()
        try:
            await ws.send(_request([0, 1, 2, 3], symbols, features))
            await recorder.pump(ws, lambda: len(recorder.answered()) == 4)
            seen["placed"], seen["asked_before"] = dict(engine.shard_of), len(team_client.asked)
            shards[1].gate.clear()
            started = time.monotonic()
            for r in range(1, rounds + 1):
                await ws.send(_request(list(range(4 * r, 4 * r + 4)), symbols, features))
                await asyncio.sleep(0.05)
            await recorder.pump(ws, lambda: recorder.answered() >= live, timeout_s=10)
            seen["held_up_s"], seen["answered"] = time.monotonic() - started, set(recorder.answered())
            shards[1].gate.set()
            await recorder.pump(ws, lambda: len(recorder.answered()) == n)
        finally:
            shards[1].gate.set()
            await ws.close(1000)

    try:
        team_client = _AskedReady(engine)
        _, summary = asyncio.run(_play(handler, team_client, inline_steps=inline_steps, late_parts_s=0.2))
    finally:
        engine.close()
    assert seen["placed"] == {"H0": 0, "H1": 1, "H2": 0, "H3": 1}
    # the engine's ready() (its late shard's symbols held back) asked only while a step had late parts
    assert seen["asked_before"] == 0 and team_client.asked
    assert seen["answered"] == live | {1, 3} and seen["held_up_s"] < 5  # the hung shard's symbols alone waited
    answered = [uid for uid, _ in recorder.responses]
    assert sorted(answered) == list(range(n)) and summary["responses_sent"] == n
    for name in names:
        assert [uid for uid in answered if symbols[uid] == name] == [i for i in range(n) if symbols[i] == name]
    references = {name: ReferenceEngine(model) for name in names}
    expected = {i: references[symbols[i]].step([symbols[i]], features[i:i + 1])[0] for i in range(n)}
    for uid, prediction in recorder.responses:
        np.testing.assert_allclose(prediction, expected[uid], rtol=1e-4, atol=2e-5)
    assert _no_model_threads_left()


def test_a_hung_shard_lost_at_its_timeout_moves_its_held_symbols_on_in_order(model, tmp_path):
    """The hung shard is lost at its answer timeout (--on-shard-loss reset): its symbols, held back meanwhile while
    the others were answered, start again from a fresh state on the live shard, their unanswered requests first,
    in order; each answer is the one of stepping that symbol's requests one at a time from where it started. The
    journal (--journal) says where they started afresh, though their steps were answered in parts: a replay ends with
    every state the live one's."""
    from client.journal import Journal, replay
    shards = [_GatedShard(0, model), _GatedShard(1, model)]
    engine = ShardedEngine(shards, progress=False, on_shard_loss="reset", answer_timeout_s=1.0)
    names = ["H0", "H1", "H2", "H3"]
    n = 4 * 6
    symbols = [names[i % 4] for i in range(n)]
    features = np.random.default_rng(9).standard_normal((n, 79)).astype(np.float32)
    recorder = Recorder()

    async def handler(ws):
        await ws.recv()
        await ws.send(protocol.encode(protocol.welcome("tiny", None, n, 4, None, session_key="k")))  # journaled
        try:
            await ws.send(_request([0, 1, 2, 3], symbols, features))
            await recorder.pump(ws, lambda: len(recorder.answered()) == 4)
            shards[1].gate.clear()  # for good: only the loss moves its symbols on
            for r in range(1, 6):
                await ws.send(_request(list(range(4 * r, 4 * r + 4)), symbols, features))
                await asyncio.sleep(0.05)
            await recorder.pump(ws, lambda: len(recorder.answered()) == n)
        finally:
            await ws.close(1000)

    identity = {"url": "ws://127.0.0.1:1", "team": "testers", "weights": "tiny"}
    journal = Journal(tmp_path / "j", identity, keep=3)
    try:
        asyncio.run(_play(handler, ExampleModel(engine), late_parts_s=0.2, journal=journal))
    finally:
        engine.close()
        journal.close()
    again = ExampleModel(_GatedShard(0, model).engine)
    replay(again, Journal(tmp_path / "j", identity, keep=3), keep=3, progress=None)
    for name in names:  # every symbol on the live shard 0 since the loss (the replay's steps batched otherwise)
        np.testing.assert_allclose(np.frombuffer(again.export_state(name).result(), np.float32),
                                   np.frombuffer(shards[0].engine.export_state(name).result(), np.float32),
                                   rtol=1e-4, atol=2e-5, err_msg=name)
    assert [loss["symbols"] for loss in engine.losses] == [["H1", "H3"]]
    answered = [uid for uid, _ in recorder.responses]
    assert sorted(answered) == list(range(n))
    for name in names:
        assert [uid for uid in answered if symbols[uid] == name] == [i for i in range(n) if symbols[i] == name]
    references = {name: ReferenceEngine(model) for name in names}
    expected = {}
    for i in range(n):
        if i == 4 * 1 + 1 or i == 4 * 1 + 3:  # the first request on the live shard: a fresh state
            references[symbols[i]] = ReferenceEngine(model)
        expected[i] = references[symbols[i]].step([symbols[i]], features[i:i + 1])[0]
    for uid, prediction in recorder.responses:
        np.testing.assert_allclose(prediction, expected[uid], rtol=1e-4, atol=2e-5)


def test_a_step_of_a_hung_shard_says_what_came_its_symbols_wait_and_new_ones_go_to_a_shard_that_answers(model):
    """While a shard answers nothing: its step says which parts came (arrived, without waiting), and that it has not
    ended (done, wait); its symbols are not ready (the runtime holds them back: a symbol of it with no request in the
    late steps would put a part of every step formed meanwhile on it); a symbol seen for the first time goes to the
    shard answering on time, though the hung one holds fewer; once it answers again, all is as before."""
    shards = [_GatedShard(0, model), _GatedShard(1, model)]
    engine = ShardedEngine(shards, progress=False)
    features = np.random.default_rng(10).standard_normal((3, 79)).astype(np.float32)
    try:
        engine.step(["A", "B", "C"], features)  # A and C on shard 0, B on shard 1
        shards[1].gate.clear()
        pending = engine.submit(["A", "B"], features[:2])
        assert not pending.wait(LATE_ANSWER_S + 0.1) and not pending.done()
        [(rows, outcome)] = pending.arrived()
        assert rows.tolist() == [0] and np.isfinite(outcome).all()
        # the runtime holds back the late shard's symbols, B with its later requests, the others step
        assert team_api.holds_back(ExampleModel(engine))
        assert not engine.ready("B") and engine.ready("A") and engine.ready("C") and engine.ready("UNSEEN")
        engine.step(["NEW"], features[:1])
        assert engine.shard_of["NEW"] == 0
        shards[1].gate.set()
        assert pending.wait(10) and pending.done() and [r.tolist() for r, _ in pending.arrived()] == [[0], [1]]
        assert engine.ready("B")
        engine.step(["NEWER"], features[:1])
        assert engine.shard_of["NEWER"] == 1
    finally:
        engine.close()


class _PartsTeam:
    """A team client for the runtime's late steps alone (no step is formed here)."""

    def process_batch(self, requests_by_symbol):
        raise AssertionError("no step is formed here")

    def submit_batch(self, requests_by_symbol):
        raise AssertionError("no step is formed here")


class _Parts:
    """A pending step answered in parts (client/team_api.py): a request's part has come once `came` holds its id;
    after_look() runs once a partial() has taken what had come (a part that comes while the runtime looks)."""

    def __init__(self, ids, came, after_look=None, fails=False):
        self.ids, self.came, self.after_look, self.fails = ids, came, after_look, fails

    def partial(self):
        ids = [uid for uid in self.ids if uid in self.came]
        answer = {"unique_ids": ids, "predictions": np.full((len(ids), 4), 1.0, np.float32)}
        if self.after_look is not None:
            self.after_look, after_look = None, self.after_look
            after_look()
        return answer

    def done(self):
        return set(self.ids) <= self.came

    def wait(self, timeout):
        return self.done()

    def fate(self, unique_id):
        return True  # a join: taken

    def result(self):
        if self.fails:
            raise RuntimeError("device fault")
        return {"unique_ids": list(self.ids), "predictions": np.full((len(self.ids), 4), 1.0, np.float32)}


def _late_client(**options):
    """A runtime whose answers are recorded in `client.answered` (ids, then the failed ones' ids) in order."""
    client = StreamingClient(_PartsTeam(), "ws://127.0.0.1:1", "testers", inline_steps=False, **options)
    client.answered = []
    client._answer = lambda ids, predictions, errors, requests, restarted=(): client.answered.extend([*ids, *errors])
    client._fail = lambda batch, exc, what: client.answered.extend(r.unique_id for r in batch)
    return client


def _late(client, batch, pending):
    """`batch` (uid, symbol) submitted as `pending`, gone late (its parts all missing)."""
    step = runtime._Step([Request(uid, symbol, np.zeros(79, np.float32)) for uid, symbol in batch], pending,
                         time.monotonic(), (1, 1), None)
    with client._work_ready:
        client._late.append(step)
        client._hold(step, {symbol for _, symbol in batch})
    return step


def test_late_steps_answer_a_symbols_requests_in_order_though_their_parts_come_while_looked_at():
    """Y's request 0 is in a late step, its request 2 in the late step behind it (both on the hung shard). The shard
    answers both parts just after the runtime looked at the first step, before it looks at the second: request 2
    must still wait for request 0 (it was answered first, the second step having ended)."""
    client, came = _late_client(), set()
    _late(client, [(0, "Y"), (1, "X")], _Parts([0, 1], came, after_look=lambda: came.update({0, 1, 2})))
    _late(client, [(2, "Y")], _Parts([2], came))
    client._look_at_late_steps()
    client._look_at_late_steps()
    assert client.answered == [0, 1, 2] and not client._late and not client._held


def test_a_step_ended_behind_a_late_one_answers_its_symbols_after_the_late_ones_parts():
    """A step formed while the one ahead went late (the submitter formed it as the completer took that one off the
    pipeline) carries Y's next request; its parts and the late step's come together, just after the completer
    looked at the late step: Y's late request is answered first."""
    client, came = _late_client(), set()
    _late(client, [(0, "Y")], _Parts([0], came, after_look=lambda: came.update({0, 1})))
    client._steps.append(runtime._Step([Request(1, "Y", np.zeros(79, np.float32))], _Parts([1], came),
                                       time.monotonic(), (1, 1), None))
    client._submitter_done = True
    client._complete_steps()
    assert client.answered == [0, 1] and not client._late and not client._held and not client._steps


def test_a_held_symbols_request_does_not_join_the_queued_step():
    """Y's request in a late step has not been answered (its part missing): Y's next request, arriving or queued,
    must not join the step queued behind the one in flight (answered with it, before the late one)."""
    client = _late_client()
    for _ in range(PIPELINE_DEPTH):  # a full pipeline whose queued step takes joins
        client._steps.append(runtime._Step([], _DeviceStep([], room=4, miss=lambda uid: False), 0.0, (1, 1), None))
    _late(client, [(0, "Y")], _Parts([0], set()))
    with client._work_ready:
        assert not client._join(Request(1, "Y", np.zeros(79, np.float32)))
        client._scheduler.push(Request(2, "Y", np.zeros(79, np.float32)))
        client._scheduler.push(Request(3, "Z", np.zeros(79, np.float32)))
        client._join_waiting()
    assert [symbol for symbol, _, _ in client._steps[-1].pending.joins] == ["Z"]
    assert client._scheduler.has("Y") and "Y" not in client._refused[1]


def test_a_request_joined_to_a_step_that_goes_late_holds_its_symbol_until_answered_from_its_parts():
    """W's request joined the queued step, which then went late: once its fate is known (taken) W must stay held
    until that request is answered (else W's next request steps and is answered first), and its part, when it
    comes, is answered (a partial answer may name the step's joined requests)."""
    client, came = _late_client(), set()
    pending = _Parts([0, 1], came)
    step = runtime._Step([Request(0, "Y", np.zeros(79, np.float32))], pending, time.monotonic() - 1, (1, 1), None)
    joined = Request(1, "W", np.zeros(79, np.float32))
    client._scheduler.stamp(joined)
    step.joined.append(joined)
    client._joining["W"] = (joined, pending, step.joined)
    client._steps.append(step)
    client._go_on_without()
    with client._work_ready:
        client._settle_joins()  # taken
        assert "W" not in client._joining and not client._is_ready("W")
    came.add(1)
    client._look_at_late_steps()
    assert client.answered == [1] and set(client._held) == {"Y"} and not step.partial_failed
    came.add(0)
    client._look_at_late_steps()
    assert client.answered == [1, 0] and not client._held and not client._late


@pytest.mark.parametrize("inline_steps", [False, True])
def test_while_only_held_symbols_wait_no_step_is_formed_until_one_is_released(inline_steps):
    """Y is held back (its request in a late step, its part missing: a hung shard, for up to --shard-timeout-s) and
    only Y waits: the runtime looked for a step to form every READY_POLL_S (0.5 ms), each look over every waiting
    symbol, on the event loop with inline steps, for as long as the shard hung. It forms one as soon as Y is
    released."""
    client = _late_client()
    client.inline_steps = inline_steps
    step = _late(client, [(0, "Y")], _Parts([0], set()))
    client._scheduler.push(Request(1, "Y", np.zeros(79, np.float32)))
    looks, next_batch = [], client._next_batch
    client._next_batch = lambda: looks.append(1) or next_batch()
    formed = []

    def release():
        with client._work_ready:
            client._hold(step, set())
            client._late.clear()

    if inline_steps:
        client._submit = lambda batch, formed_at: formed.append([r.unique_id for r in batch])

        async def play():
            client._loop = asyncio.get_running_loop()
            client._pump()
            await asyncio.sleep(0.3)
            held_looks = len(looks)
            release()
            await asyncio.sleep(0.05)
            if client._pump_handle is not None:
                client._pump_handle.cancel()
            return held_looks
        held_looks = asyncio.run(play())
    else:
        taker = threading.Thread(target=lambda: formed.append([r.unique_id for r in
                                                               client._take_batch(client._submit_in)[0]]))
        taker.start()
        time.sleep(0.3)
        held_looks = len(looks)
        release()
        taker.join(1)
    assert held_looks <= 0.3 / runtime.LATE_POLL_S + 5 and formed == [[1]]


def test_a_late_step_whose_result_fails_after_its_parts_were_all_answered_fails_no_request():
    """Every request of a late step was answered from its parts, then its result() raised (or gave a malformed
    answer): there is nothing left to fail, and the server got a client_error naming no unique_id."""
    for bad in ({"fails": True}, {}):
        client, sent = _late_client(), []
        del client._fail  # the runtime's own
        client._on_loop = lambda callback, *args: callback(*args)
        client._send = lambda ws, msg: sent.append(msg)
        pending = _Parts([0, 1], {0, 1}, **bad)
        if not bad:
            pending.result = lambda: {"unique_ids": [0], "predictions": np.ones((1, 4), np.float32)}
        step = _late(client, [(0, "Y"), (1, "X")], pending)
        client._take_parts(step)
        client._retire(step)
        assert client.answered == [0, 1] and sent == [] and client.stats.rejected == 0 and not client._late


def test_the_event_loop_asks_a_step_whether_it_answers_in_parts_once_not_at_each_turn():
    """With inline steps the event loop looks at the step in flight at each of its turns (~2 us each): asking the
    team client's pending step for partial() and wait() there, and looking at the (no) late steps, cost ~15% more."""
    class Pending(PendingStep):
        asked = 0

        def __getattr__(self, name):  # only for the attributes it lacks
            Pending.asked += 1
            raise AttributeError(name)

    client = StreamingClient(_PartsTeam(), "ws://127.0.0.1:1", "testers", inline_steps=True)
    client._steps.append(runtime._Step([], Pending(lambda: None, poll=lambda: False), time.monotonic(), (1, 1), None))
    looks = []
    client._look_at_late_steps = lambda: looks.append(1)

    async def turns():
        client._loop = asyncio.get_running_loop()
        for _ in range(100):
            client._pump()
        client._pump_handle.cancel()
    asyncio.run(turns())
    assert Pending.asked <= 2 and not looks


def test_a_team_clients_wait_that_fails_does_not_stop_the_completer():
    """A pending step answered in parts whose wait() raised killed the completer thread: no step was answered again
    (the pipeline full, the session stalled). Its result() answers it, as where done() fails."""
    client = _late_client()
    pending = _Parts([0], {0})

    def broken(timeout):
        raise RuntimeError("wait lost")
    pending.wait = broken
    client._steps.append(runtime._Step([Request(0, "Y", np.zeros(79, np.float32))], pending, time.monotonic(),
                                       (1, 1), None))
    client._submitter_done = True
    client._complete_steps()
    assert client.answered == [0] and not client._steps


def test_a_late_shards_symbol_with_no_request_in_the_late_steps_is_held_back_too(model):
    """Once a step has late parts, the runtime asks the sharded engine's ready(), False for every symbol of the shard
    late to answer: a symbol of it whose requests were in no late step (so not held by them) would otherwise put a
    part of the next step on the hung shard, and that step's other symbols would wait with it for another late
    round. Here H3 (hung shard) arrives beside H0 (live) after the hang is known: H0 is answered at once."""
    shards = [_GatedShard(0, model), _GatedShard(1, model)]
    engine = ShardedEngine(shards, progress=False)
    names = ["H0", "H1", "H2", "H3"]  # H0, H2 on shard 0; H1, H3 on shard 1
    symbols = names + ["H0", "H1", "H0", "H3"]
    features = np.random.default_rng(11).standard_normal((len(symbols), 79)).astype(np.float32)
    recorder, seen = Recorder(), {}

    async def handler(ws):
        await ws.recv()
        try:
            await ws.send(_request([0, 1, 2, 3], symbols, features))
            await recorder.pump(ws, lambda: len(recorder.answered()) == 4)
            shards[1].gate.clear()
            await ws.send(_request([4, 5], symbols, features))  # H1's part hangs: its step goes late at 0.5 s
            await recorder.pump(ws, lambda: 4 in recorder.answered(), timeout_s=10)
            await asyncio.sleep(0.3)
            sent = time.monotonic()
            await ws.send(_request([6, 7], symbols, features))  # H0 beside H3, a symbol of no late step
            await recorder.pump(ws, lambda: 6 in recorder.answered(), timeout_s=10)
            seen["h0_s"] = time.monotonic() - sent
            shards[1].gate.set()
            await recorder.pump(ws, lambda: len(recorder.answered()) == len(symbols))
        finally:
            shards[1].gate.set()
            await ws.close(1000)

    try:
        asyncio.run(_play(handler, ExampleModel(engine), late_parts_s=0.5))
    finally:
        engine.close()
    assert seen["h0_s"] < 0.4  # a late round of its own would take 0.5 s
    answered = [uid for uid, _ in recorder.responses]
    assert sorted(answered) == list(range(len(symbols)))
    references = {name: ReferenceEngine(model) for name in names}
    for uid, prediction in sorted(recorder.responses):
        expected = references[symbols[uid]].step([symbols[uid]], features[uid:uid + 1])[0]
        np.testing.assert_allclose(prediction, expected, rtol=1e-4, atol=2e-5)
