"""Team code written for the original event: its names from `client`, its process_batch through the adapter, in the
local evaluator and the team client."""
import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import local_evaluator as le
from client import BaseInferenceClient, InferenceResponse, PendingRequest, cli
from client.engine.base import PendingStep
from client.engine.reference import ReferenceEngine
from client.model import load_model
from client.original_team import OriginalStyleClient, as_runtime_client
from test_server_cli import ONE_THREAD, start_server

REPO = Path(__file__).resolve().parent.parent
ORIGINAL_TEAM_DIR = Path(__file__).resolve().parent / "original_team"
TOWERS = ("xlstm", "mamba2", "retnet", "hawk")


def test_the_events_names_import_from_client_without_torch():
    result = subprocess.run([sys.executable, "-c", "import sys; from client import BaseInferenceClient, "
                             "PendingRequest, InferenceResponse; print('torch' in sys.modules)"],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "False", result.stderr


@pytest.fixture(scope="module")
def model():
    return load_model("tiny", seed=4)[0]


def original_team(engine):
    return as_runtime_client(le.load_team_class(ORIGINAL_TEAM_DIR)(engine))


def test_the_adapter_hands_lists_of_pending_requests_and_keeps_each_symbols_order(model):
    rng = np.random.default_rng(0)
    features = rng.standard_normal((5, 79)).astype(np.float32)
    client = original_team(ReferenceEngine(model))
    assert isinstance(client, OriginalStyleClient) and client.requests_per_symbol == "many"
    # several requests of one symbol in one batch, as a runtime batches a "many" client
    answer = client.process_batch({"A": [(0, features[0]), (2, features[2]), (3, features[3])],
                                   "B": [(1, features[1])]})
    later = client.process_batch({"B": (4, features[4])})  # one request a symbol, as the evaluator passes it
    reference = ReferenceEngine(model)
    expected = {0: reference.step(["A", "B"], features[[0, 1]]), 2: reference.step(["A"], features[[2]]),
                3: reference.step(["A"], features[[3]]), 4: reference.step(["B"], features[[4]])}
    expected = {0: expected[0][0], 1: expected[0][1], 2: expected[2][0], 3: expected[3][0], 4: expected[4][0]}
    assert answer["unique_ids"] == [3, 2, 1, 0] and answer["errors"] == {}  # the team's own order
    assert answer["predictions"].dtype == np.float32
    for uid, row in zip(answer["unique_ids"] + later["unique_ids"], [*answer["predictions"], *later["predictions"]]):
        np.testing.assert_array_equal(row, expected[uid])


class Scripted(BaseInferenceClient):
    """Answers with what the test gives it, and records what it was given."""

    def __init__(self, response):
        super().__init__()
        self.response, self.given = response, None

    def process_batch(self, requests_by_symbol):
        self.given = requests_by_symbol
        return self.response


def test_the_adapter_forgets_a_symbol_through_the_team_codes_engine_or_its_own_release(model):
    """--idle-timeout with --journal has the runtime forget idle symbols between steps, journaled, through the team
    client's release: team code in the event's style has none, so its engine forgot them inside steps, where no
    journal could place them, and a restart replayed a forgotten symbol onto its old state."""
    features = np.random.default_rng(1).standard_normal((3, 79)).astype(np.float32)
    client = original_team(ReferenceEngine(model))
    client.process_batch({"A": [(0, features[0])], "B": [(1, features[1])]})
    client.release(["A"])
    after = client.process_batch({"A": [(2, features[2])]})
    fresh = ReferenceEngine(model).step(["A"], features[[2]])[0]  # A afresh
    np.testing.assert_array_equal(after["predictions"][0], fresh)
    assert ReferenceEngine(model).step(["A"], features[[0]])[0].tolist() != fresh.tolist()  # not a step on from it

    class OwnRelease(BaseInferenceClient):
        def __init__(self, engine):
            super().__init__(engine)
            self.released = []

        def process_batch(self, requests_by_symbol):
            return InferenceResponse([], [])

        def release(self, symbols):
            self.released.append(symbols)

    own = as_runtime_client(OwnRelease(ReferenceEngine(model)))
    own.release(("A", "B"))
    assert own.team_client.released == [["A", "B"]]
    assert not hasattr(original_team(None), "release")  # nothing to forget through: the runtime refuses idle_timeout


@pytest.mark.parametrize("response, message", [
    (InferenceResponse([1, 9], [[0.0] * 4, [0.0] * 4]), r"ids it was not given \[9\]"),
    (InferenceResponse([1, 1], [[0.0] * 4, [0.0] * 4]), r"answered twice \[1\]"),
    (InferenceResponse([1], [[0.0] * 3]), r"InferenceResponse\(unique_ids, predictions \[n\]\[4\]\)"),
    ({"unique_ids": [1], "predictions": [[0.0] * 4]}, "got dict"),
])
def test_a_response_that_breaks_the_contract_says_how(response, message):
    with pytest.raises(ValueError, match=message):
        OriginalStyleClient(Scripted(response)).process_batch({"A": [(1, np.zeros(79, np.float32))]})


def test_predictions_one_row_a_tower_are_refused_not_reshaped_into_scrambled_answers():
    """Team code that runs each tower on its own may stack its predictions [4][n], one row a tower: the same number
    of values as [n][4], which a reshape took, answering each request with other requests' and towers' values."""
    tower_major = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]])
    client = OriginalStyleClient(Scripted(InferenceResponse([1, 2], tower_major)))
    with pytest.raises(ValueError, match=r"predictions \[n\]\[4\]\), got predictions of shape \[4, 2\] for 2 "
                                         r"unique_ids"):
        client.process_batch({"A": [(1, np.zeros(79, np.float32))], "B": [(2, np.zeros(79, np.float32))]})
    answer = OriginalStyleClient(Scripted(InferenceResponse([1, 2], tower_major.T))).process_batch(
        {"A": [(1, np.zeros(79, np.float32))], "B": [(2, np.zeros(79, np.float32))]})
    assert answer["predictions"].tolist() == [[1.0, 3.0, 5.0, 7.0], [2.0, 4.0, 6.0, 8.0]]


def test_a_request_left_out_is_asked_again_and_an_error_once_a_call_answers_nothing():
    class Twice(BaseInferenceClient):
        def __init__(self):
            super().__init__()
            self.given = []

        def process_batch(self, requests_by_symbol):
            self.given.append(requests_by_symbol)
            return (InferenceResponse([2], [[1.0, 2.0, 3.0, 4.0]]) if len(self.given) == 1
                    else InferenceResponse([], []))

    team = Twice()
    answer = OriginalStyleClient(team).process_batch({"A": [(1, np.ones(79, np.float32))],
                                                     "B": [(2, np.zeros(79, np.float32))]})
    assert answer["unique_ids"] == [2] and answer["errors"] == {1: "process_batch did not answer it"}
    assert team.given == [{"A": [PendingRequest(1, "A", [1.0] * 79)], "B": [PendingRequest(2, "B", [0.0] * 79)]},
                          {"A": [PendingRequest(1, "A", [1.0] * 79)]}]


def test_team_code_that_steps_one_request_a_symbol_a_call_answers_every_request_in_order():
    """The event's client called process_batch while requests stayed queued, and its best-known solutions stepped
    one request a symbol a call: the rest of each symbol's requests come in the calls that follow, in order."""
    class OneASymbol(BaseInferenceClient):
        def __init__(self):
            super().__init__()
            self.calls = []

        def process_batch(self, requests_by_symbol):
            firsts = [queue.pop(0) for queue in requests_by_symbol.values()]
            self.calls.append([r.unique_id for r in firsts])
            return InferenceResponse([r.unique_id for r in firsts], [[float(r.unique_id)] * 4 for r in firsts])

        def submit_batch(self, requests_by_symbol):
            response = self.process_batch(requests_by_symbol)
            return PendingStep(lambda: response)

    batch = {"A": [(1, np.zeros(79, np.float32)), (3, np.zeros(79, np.float32)), (4, np.zeros(79, np.float32))],
             "B": [(2, np.zeros(79, np.float32))]}
    for step in ("process_batch", "submit_batch"):
        team = OneASymbol()
        answer = getattr(OriginalStyleClient(team), step)(batch)
        answer = answer.result() if step == "submit_batch" else answer
        assert team.calls == [[1, 2], [3], [4]]
        assert answer["unique_ids"] == [1, 2, 3, 4] and answer["errors"] == {}
        assert answer["predictions"][:, 0].tolist() == [1.0, 2.0, 3.0, 4.0]


def test_a_pipelined_step_of_a_symbol_is_submitted_after_the_leftovers_of_the_step_before():
    """The runtime submits a step before it takes the answer of the one before: what that one left out is asked of
    process_batch first, or a symbol's next request stepped before it (accuracy 0.31 in the team client); a step of
    other symbols does not wait."""
    class OneASymbol(BaseInferenceClient):
        def __init__(self):
            super().__init__()
            self.calls = []

        def process_batch(self, requests_by_symbol):
            firsts = [queue[0] for queue in requests_by_symbol.values()]
            self.calls.append([r.unique_id for r in firsts])
            return InferenceResponse([r.unique_id for r in firsts], [[float(r.unique_id)] * 4 for r in firsts])

        def submit_batch(self, requests_by_symbol):
            response = self.process_batch(requests_by_symbol)
            return PendingStep(lambda: response)

    zeros = np.zeros(79, np.float32)
    team = OneASymbol()
    client = OriginalStyleClient(team)
    first = client.submit_batch({"A": [(1, zeros), (3, zeros)], "B": [(2, zeros)]})
    other = client.submit_batch({"C": [(4, zeros), (6, zeros)]})
    assert team.calls == [[1, 2], [4]]  # first's answer not taken for a step of other symbols
    second = client.submit_batch({"A": [(5, zeros)]})
    assert team.calls == [[1, 2], [4], [3], [5]]
    assert first.result()["unique_ids"] == [1, 2, 3] and second.result()["unique_ids"] == [5]
    assert other.result()["unique_ids"] == [4, 6] and team.calls[-1] == [6]


def test_team_code_is_never_called_from_two_threads_at_once():
    """Pipelined, a step's leftovers are asked of process_batch on the runtime's completing thread while its
    submitting thread submits a step of other symbols: the team code, written for one thread, gets one call at a
    time."""
    class Slow(BaseInferenceClient):
        def __init__(self):
            super().__init__()
            self.inside, self.overlaps = 0, 0

        def _enter(self):
            self.inside += 1
            self.overlaps += self.inside > 1
            time.sleep(0.05)
            self.inside -= 1

        def process_batch(self, requests_by_symbol):
            self._enter()
            firsts = [queue[0] for queue in requests_by_symbol.values()]
            return InferenceResponse([r.unique_id for r in firsts], [[0.0] * 4 for _ in firsts])

        def submit_batch(self, requests_by_symbol):
            response = self.process_batch(requests_by_symbol)
            return PendingStep(lambda: response)

    zeros = np.zeros(79, np.float32)
    team = Slow()
    client = OriginalStyleClient(team)
    first = client.submit_batch({"A": [(1, zeros), (2, zeros), (3, zeros)]})
    completer = threading.Thread(target=first.result)  # two leftovers: two calls of 50 ms
    completer.start()
    time.sleep(0.02)
    others = [client.submit_batch({"B": [(10 + i, zeros)]}) for i in range(3)]
    completer.join()
    assert first.result()["unique_ids"] == [1, 2, 3]
    assert [o.result()["unique_ids"] for o in others] == [[10], [11], [12]] and team.overlaps == 0


def test_a_call_after_the_first_that_fails_leaves_the_answers_before_it_standing():
    """Team code stepping one request a symbol a call that raises (or answers wrongly) on a later call: the requests
    it answered have advanced their states and stay answered; the rest are errors naming why (the whole batch
    failed before, the answers computed thrown away)."""
    class FailsLater(BaseInferenceClient):
        def __init__(self, failure):
            super().__init__()
            self.failure, self.calls = failure, 0

        def process_batch(self, requests_by_symbol):
            self.calls += 1
            firsts = [queue[0] for queue in requests_by_symbol.values()]
            if self.calls > 1:
                if self.failure == "raises":
                    raise RuntimeError("symbol A broke")
                return InferenceResponse([9], [[0.0] * 4])
            return InferenceResponse([r.unique_id for r in firsts], [[float(r.unique_id)] * 4 for r in firsts])

    batch = {"A": [(1, np.zeros(79, np.float32)), (3, np.zeros(79, np.float32))], "B": [(2, np.zeros(79, np.float32))]}
    for failure, why in (("raises", "process_batch failed: RuntimeError: symbol A broke"),
                         ("answers wrongly", "process_batch failed: ValueError: process_batch answered ids it was "
                                             "not given [9] or answered twice []")):
        answer = OriginalStyleClient(FailsLater(failure)).process_batch(batch)
        assert answer["unique_ids"] == [1, 2] and answer["predictions"][:, 0].tolist() == [1.0, 2.0]
        assert answer["errors"] == {3: why}


def test_a_team_that_drains_its_queues_is_answered():
    """Team code may consume the lists it is handed (pop each symbol's queue, as a queue is consumed): what it was
    given is what the adapter handed it, not what is left."""
    class Draining(BaseInferenceClient):
        def process_batch(self, requests_by_symbol):
            ids = []
            for queue in requests_by_symbol.values():
                while queue:
                    ids.append(queue.pop(0).unique_id)
            requests_by_symbol.clear()
            return InferenceResponse(ids, [[float(uid)] * 4 for uid in ids])

        def submit_batch(self, requests_by_symbol):
            response = self.process_batch(requests_by_symbol)
            return PendingStep(lambda: response)

    batch = {"A": [(1, np.zeros(79, np.float32)), (3, np.zeros(79, np.float32))], "B": [(2, np.zeros(79, np.float32))]}
    client = OriginalStyleClient(Draining())
    for answer in (client.process_batch(batch), client.submit_batch(batch).result()):
        assert answer["unique_ids"] == [1, 3, 2] and answer["errors"] == {}
        assert answer["predictions"][:, 0].tolist() == [1.0, 3.0, 2.0]


def test_a_team_with_submit_batch_stays_pipelined():
    class Pipelined(Scripted):
        def submit_batch(self, requests_by_symbol):
            return PendingStep(lambda: self.process_batch(requests_by_symbol))

    assert not hasattr(OriginalStyleClient(Scripted(None)), "submit_batch")
    pending = OriginalStyleClient(Pipelined(InferenceResponse([1], [[1.0] * 4]))).submit_batch(
        {"A": [(1, np.zeros(79, np.float32))]})
    assert pending.result()["unique_ids"] == [1]


def test_a_team_file_imports_a_module_of_its_own_beside_it(tmp_path, monkeypatch):
    """As running the file would: a team folder of several files (ModuleNotFoundError before)."""
    monkeypatch.setattr(sys, "path", list(sys.path))  # the folder the load adds, gone after the test
    (tmp_path / "helpers_beside_the_team_file.py").write_text("ANSWER = [0.5] * 4\n")
    (tmp_path / "example_model.py").write_text(
        "from client import BaseInferenceClient, InferenceResponse\n"
        "from helpers_beside_the_team_file import ANSWER\n\n\n"
        "class ExampleModel(BaseInferenceClient):\n"
        "    def process_batch(self, requests_by_symbol):\n"
        "        ids = [r.unique_id for queue in requests_by_symbol.values() for r in queue]\n"
        "        return InferenceResponse(ids, [ANSWER for _ in ids])\n")
    answer = as_runtime_client(le.load_team_class(tmp_path)(None)).process_batch({"A": [(1, np.zeros(79))]})
    assert answer["unique_ids"] == [1] and answer["predictions"].tolist() == [[0.5] * 4]


def run_main(capsys, *argv):
    rc = cli.run_cli(le.main, le.PROG, list(map(str, argv)))
    out, err = capsys.readouterr()
    return rc, out, err


def test_the_evaluator_runs_an_original_style_team(tmp_path, capsys):
    out_json = tmp_path / "l.json"
    rc, _, err = run_main(capsys, "--team-dir", ORIGINAL_TEAM_DIR, "--preset", "tiny", "--symbols", 3,
                          "--requests", 24, "--rate", 1e5, "--cache-dir", tmp_path / "cache", "--device", "cpu",
                          "--json", out_json)
    assert rc == 0, err
    summary = json.loads(out_json.read_text())
    assert summary["responses"] == 24
    # the fp32 reference, in batches of other sizes than the targets' run: rounding apart
    assert all(summary["towers"][t]["within_atol"] == 1.0 and summary["towers"][t]["max_abs_err"] < 1e-5
               for t in TOWERS)


def test_the_team_client_plays_an_original_style_team_in_the_original_protocol_without_websockets(tmp_path):
    """The project's server in a process of its own; the team client, in the original protocol, where websockets
    cannot be imported (as on a machine that has none)."""
    shim = tmp_path / "shim" / "websockets"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ImportError('websockets is not installed here')\n")
    server, port = start_server(["--preset", "tiny", "--seed", "0", "--symbols", "4", "--requests", "60", "--rate",
                                 "100", "--timeout-s", "60", "--once", "--cache-dir", str(tmp_path / "cache")],
                                tmp_path / "server.log")
    out = tmp_path / "summary.json"
    try:
        result = subprocess.run([sys.executable, str(REPO / "team" / "example_model.py"), "--host", "127.0.0.1",
                                 "--port", str(port), "--protocol", "tcp-json", "--team-dir", str(ORIGINAL_TEAM_DIR),
                                 "--preset", "tiny", "--engine", "reference", "--device", "cpu", "--json", str(out)],
                                cwd=tmp_path, env={**ONE_THREAD, "PYTHONPATH": str(shim.parent)},
                                capture_output=True, text=True, timeout=300)
        table, _ = server.communicate(timeout=60)
    finally:
        server.kill()
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["outcome"] == "complete" and summary["responses"] == 60 and summary["accuracy"] == 1.0
    assert f"playing tcp://127.0.0.1:{port} in the original protocol" in result.stderr
    assert re.search(r"^tcp-json:127\.0\.0\.1\s+60\s+60\s+0\s+0\s+0\s+1\.0000", table, re.M), table


def test_a_pipelined_step_that_failed_is_not_stepped_again_when_its_answer_is_taken():
    """A step whose answer a later step of its symbols took first (and failed: team code that raised after stepping)
    ran the team code again when the runtime took its answer: the symbol's state advanced twice through the same
    request, every later answer of it off the stream."""
    class FailsAfterStepping(BaseInferenceClient):
        def __init__(self):
            super().__init__()
            self.stepped = []

        def process_batch(self, requests_by_symbol):
            ids = [r.unique_id for queue in requests_by_symbol.values() for r in queue]
            self.stepped += ids
            if 1 in ids:
                raise RuntimeError("broke after stepping")
            return InferenceResponse(ids, [[0.0] * 4 for _ in ids])

        def submit_batch(self, requests_by_symbol):
            return PendingStep(lambda: self.process_batch(requests_by_symbol))

    zeros = np.zeros(79, np.float32)
    team = FailsAfterStepping()
    client = OriginalStyleClient(team)
    first = client.submit_batch({"A": [(1, zeros)]})
    second = client.submit_batch({"A": [(2, zeros)]})  # takes first's answer before it steps
    with pytest.raises(RuntimeError, match="broke after stepping"):
        first.result()
    assert second.result()["unique_ids"] == [2] and team.stepped == [1, 2]
