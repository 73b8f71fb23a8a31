"""client/journal.py's segments and state checkpoints: a bounded journal that a restart replays from the states."""
import asyncio
import contextlib
import os
import time

import numpy as np
import pytest

from client.engine.base import CapacityError, PendingStep
from client.journal import MAGIC_V1, Journal, JournalError, replay
from client.state_checkpoints import StateCheckpoints

IDENTITY = {"url": "ws://127.0.0.1:1", "team": "t", "weights": "abc"}
RECORD_BYTES = 10 + 7 + 79 * 4 + 4 * 4  # a request of a symbol SYM_nnn


class Toy:
    """A team client with a recurrent state a symbol small enough to follow: state = state / 2 + features[:4], its
    prediction the state; it exports and imports its states."""
    requests_per_symbol = "many"

    def __init__(self, layout="toy"):
        self.states, self.stepped, self.layout = {}, [], layout

    def process_batch(self, batch):
        ids, rows = [], []
        for symbol, requests in batch.items():
            for uid, features in requests:
                state = self.states.get(symbol, np.zeros(4, np.float32)) * np.float32(0.5) + features[:4]
                self.states[symbol] = state
                ids.append(uid)
                rows.append(state.copy())
                self.stepped.append(uid)
        return {"unique_ids": ids, "predictions": np.asarray(rows, np.float32).reshape(-1, 4)}

    def submit_batch(self, batch):
        return PendingStep.completed(self.process_batch(batch))

    def state_layout(self):
        return {"toy": self.layout}

    def export_state(self, symbol):
        state = self.states.get(symbol)
        return PendingStep.completed(None if state is None else state.view(np.uint8).copy())

    def import_state(self, symbol, data):
        self.states[symbol] = np.frombuffer(bytes(data), np.float32).copy()

    def release(self, symbols):
        for symbol in symbols:
            self.states.pop(symbol, None)


def stream(n, symbols=3, seed=0):
    rng = np.random.default_rng(seed)
    return [(uid, f"SYM_{uid % symbols:03d}", rng.standard_normal(79).astype(np.float32)) for uid in range(n)]


def play(path, requests, refused=(), busy=frozenset(), segment_records=5, keep=3, team=None):
    """Journal `requests` as the runtime does, a step each (`refused` ids refused instead; a symbol alone among them
    forgotten as idle), checkpointing after each step what the journal asks for (never a symbol of `busy`); the team
    client."""
    team = team or Toy()
    journal = Journal(path, IDENTITY, layout=team.state_layout(), segment_bytes=segment_records * RECORD_BYTES,
                      keep=keep)
    journal.begin("k")
    for request in requests:
        if isinstance(request, str):
            team.release([request])
            journal.forget([request])
            continue
        uid, symbol, features = request
        if uid in refused:
            journal.refuse([uid])
        else:
            answer = team.process_batch({symbol: [(uid, features)]})
            journal.append([(uid, symbol, features)], answer["predictions"])
        while journal.checkpoint_due():
            due = journal.begin_checkpoint(busy)
            if due is None:
                if not journal.droppable():
                    break
                journal.drop_covered()
                continue
            journal.end_checkpoint(due[0], due[1], team.export_state(due[0]).result())
    journal.close()
    return team


@contextlib.asynccontextmanager
async def serving(stream, rate):
    """The url of a scoring server playing `stream` at `rate` (targets zeros), stopped at the end."""
    from server import ScoringServer, ServerConfig

    server = ScoringServer(ServerConfig(rate=rate), stream=stream, targets=np.zeros((len(stream), 4), np.float32))
    port = await server.start()
    try:
        yield f"ws://127.0.0.1:{port}"
    finally:
        await server.stop()


def parts(path):
    return sorted(p.name for p in path.parent.iterdir() if p.name.startswith(path.name + ".part"))


def test_a_journal_bounded_by_checkpoints_replays_only_its_tail_onto_the_states_bit_for_bit(tmp_path):
    """Segments close every 5 records; each symbol with records in a closed one is checkpointed and a segment whose
    records are all covered, and not among the last `keep` answers, is deleted: 60 requests leave <= 2 closed
    segments. A fresh team client loads the states and steps only the records after them, and ends with every
    state bit for bit the first one's; the last `keep` answers are the journaled ones; the ids before them, deleted
    or not, are older ids; the refused ones, deleted or not, are refused again."""
    path, requests, refused = tmp_path / "j", stream(60), {4, 7, 31}
    first = play(path, requests, refused)
    assert 1 <= len(parts(path)) <= 2 and os.path.getsize(path) <= 5 * RECORD_BYTES + 200
    journal = Journal(path, IDENTITY, layout=first.state_layout(), keep=3)
    assert journal.first > 20 and journal.total == 60 and journal.count == 60 - journal.first
    again = Toy()
    replayed = replay(again, journal, keep=3, progress=None)
    assert again.states.keys() == first.states.keys()
    assert all(np.array_equal(again.states[s], first.states[s]) for s in first.states)
    assert set(again.stepped) < set(range(journal.first, 60)) - refused  # the records covered are not stepped
    assert replayed.stepped == len(again.stepped)
    assert len(replayed) == 60 and list(replayed.recent) == [57, 58, 59]
    expected = Toy()
    for uid, symbol, features in requests:
        if uid not in refused:
            prediction = expected.process_batch({symbol: [(uid, features)]})["predictions"][0]
            if uid in replayed.recent:
                assert np.array_equal(replayed.recent[uid][0], prediction) and replayed.recent[uid][1] == symbol
            else:
                assert uid in replayed.older
    assert list(replayed.refused) == sorted(refused) and not any(uid in replayed.recent for uid in refused)


def test_the_replays_progress_counts_the_records_it_replays_not_the_ids_of_deleted_segments(tmp_path, monkeypatch):
    """400 requests, of which the segments holding the first 400 went (their ids kept in gone.npz), then 20 in the
    segment written: each progress line says how many of those 20 are replayed. It counted the 400 ids of the deleted
    segments too: 'replayed 404 of 20 requests', at a rate they inflated."""
    import io
    import types

    import client.journal as journal_module

    path, requests = tmp_path / "j", stream(420)
    team = play(path, requests[:400])
    play(path, requests[400:], segment_records=10**6, team=team)
    journal = Journal(path, IDENTITY, layout=Toy().state_layout(), keep=3)
    assert journal.first == 400 and journal.count == 20
    clock = iter(range(0, 10**6, 2))  # each look at the clock 2 s after the one before: a line a step
    monkeypatch.setattr(journal_module, "time", types.SimpleNamespace(monotonic=lambda: next(clock)))
    progress = io.StringIO()
    replayed = replay(Toy(), journal, keep=3, max_batch=1, max_per_symbol=1, progress=progress)
    assert len(replayed) == 420 and replayed.stepped == 20
    lines = [line for line in progress.getvalue().splitlines() if line.startswith("journal: replayed")]
    assert lines and lines[-1].startswith("journal: replayed 20 of 20 requests")
    assert all(int(line.split()[2]) <= 20 for line in lines)


class Unbounded(Toy):
    def state_layout(self):  # no checkpoints: one segment, replayed whole
        return None


@pytest.mark.parametrize("team", [Toy, Unbounded], ids=["checkpointed", "one-segment"])
def test_symbols_forgotten_as_idle_are_forgotten_where_they_were_on_replay(tmp_path, team):
    """The team client forgot SYM_001 (idle) three times: its next requests started afresh. The journal says where,
    and a replay forgets it there too (its requests before stepped first, though batched with those after), whether
    a state checkpointed covers the forget or not: every state and the answers kept bit for bit the first one's.
    Without the records the replay carried SYM_001's old state on."""
    path, requests = tmp_path / "j", stream(60)
    for at in (58, 33, 10):  # the last one, before its request 58, in the tail no state covers
        requests.insert(at, "SYM_001")
    first = play(path, requests, refused={20}, team=team())
    journal = Journal(path, IDENTITY, layout=first.state_layout(), keep=3)
    assert journal.total == 63 and journal.count == 63 - journal.first
    assert (journal.first > 30) if team is Toy else (journal.forgotten, journal.refused) == (3, 1)
    again = team()
    replayed = replay(again, journal, keep=3, progress=None)
    assert again.states.keys() == first.states.keys()
    assert all(np.array_equal(again.states[s], first.states[s]) for s in first.states)
    assert len(replayed) == 60 and set(replayed.held) == set(first.states)
    straight = Toy()
    for request in requests:
        if isinstance(request, str):
            straight.release([request])
        elif request[0] != 20:
            answer = straight.process_batch({request[1]: [request[::2]]})["predictions"][0]
            if request[0] in replayed.recent:
                assert np.array_equal(replayed.recent[request[0]][0], answer)
    assert len(replayed.recent) == 3


def test_a_symbol_forgotten_for_good_is_not_held_after_the_replay(tmp_path):
    """SYM_001 was forgotten as idle after its last request, and a state checkpointed as holding none covers that: a
    replay neither holds it nor says it does (Replayed.held, which the runtime forgets after idle_timeout_s). It was
    said held, and each restart forgot it again, each time a record and a checkpoint of its own."""
    path = tmp_path / "j"
    requests = [r for r in stream(60) if not (r[1] == "SYM_001" and r[0] > 20)]
    requests.insert(20, "SYM_001")  # after its request 19, its last
    first = play(path, requests)
    journal = Journal(path, IDENTITY, layout=first.state_layout(), keep=3)
    assert "SYM_001" in journal.checkpoints.covers and journal.first > 20
    again = Toy()
    replayed = replay(again, journal, keep=3, progress=None)
    assert set(replayed.held) == set(again.states) == set(first.states) == {"SYM_000", "SYM_002"}


def test_a_version_2_journal_is_replayed_and_the_session_goes_on_in_a_segment_of_its_own(tmp_path):
    """A journal of before symbols forgotten were journaled (version 2) is read, answers and all, and the session
    goes on in a new segment, whose records it could not hold."""
    from client.journal import MAGIC_V2

    path, requests = tmp_path / "j", stream(8)
    team = Toy()
    records = b"".join(uid.to_bytes(8, "little", signed=True) + len(symbol).to_bytes(2, "little") + symbol.encode()
                       + features.astype("<f4").tobytes()
                       + team.process_batch({symbol: [(uid, features)]})["predictions"][0].astype("<f4").tobytes()
                       for uid, symbol, features in requests[:5])
    path.write_bytes(MAGIC_V2 + b'{"url": "ws://127.0.0.1:1", "team": "t", "weights": "abc", "session_key": "k"}\n'
                     + records)
    replayed = replay(Toy(), Journal(path, IDENTITY), keep=10, progress=None)
    assert sorted(replayed.recent) == list(range(5))
    assert np.array_equal(replayed.recent[4][0], team.states["SYM_001"])
    play(path, [requests[5], "SYM_000", *requests[6:]], keep=10**6, team=team)
    assert parts(path) == ["j.part0"]
    again = Toy()
    replay(again, Journal(path, IDENTITY), keep=10, progress=None)
    assert all(np.array_equal(again.states[s], team.states[s]) for s in team.states) and again.states.keys() == {
        "SYM_001", "SYM_002", "SYM_000"}


def test_every_closed_segment_is_covered_while_none_can_go_yet(tmp_path):
    """While the answers a restart keeps (`keep`) reach back past every closed segment, none goes, and each symbol's
    records in all of them are covered still (only the first closed segment's were): a restart steps only the
    records of the segment being written."""
    path = tmp_path / "j"
    first = play(path, stream(40), keep=10**6)
    assert len(parts(path)) >= 6
    again = Toy()
    replayed = replay(again, Journal(path, IDENTITY, layout=first.state_layout(), keep=10**6), keep=10**6,
                      progress=None)
    assert len(again.stepped) <= 5 and len(replayed.recent) == 40
    assert all(np.array_equal(again.states[s], first.states[s]) for s in first.states)


def test_a_busy_symbol_is_never_checkpointed_and_keeps_its_segments(tmp_path):
    """A symbol with a request in a step is not checkpointed (its state would not be the journal's): the segments
    holding its records stay, and a restart replays them."""
    path = tmp_path / "j"
    first = play(path, stream(40), busy={"SYM_001"})
    assert len(parts(path)) >= 6  # SYM_001's records in every segment
    again = Toy()
    replay(again, Journal(path, IDENTITY, layout=first.state_layout()), keep=3, progress=None)
    assert all(np.array_equal(again.states[s], first.states[s]) for s in first.states)


def test_a_restart_goes_on_in_the_same_session_and_a_new_session_clears_segments_and_states(tmp_path):
    path, requests = tmp_path / "j", stream(50)
    first = play(path, requests[:30])
    again = Toy()
    replay(again, Journal(path, IDENTITY, layout=again.state_layout(), keep=3), keep=3, progress=None)
    play(path, requests[30:], team=again)  # the restart goes on journaling the session
    third = Toy()
    replay(third, Journal(path, IDENTITY, layout=third.state_layout(), keep=3), keep=3, progress=None)
    straight = Toy()
    for uid, symbol, features in requests:
        straight.process_batch({symbol: [(uid, features)]})
    assert all(np.array_equal(third.states[s], straight.states[s]) for s in straight.states)
    assert first.states  # (the first process's states were the replay's start)
    journal = Journal(path, IDENTITY, layout=third.state_layout())
    journal.begin("another")
    journal.close()
    assert parts(path) == [] and not StateCheckpoints(tmp_path / "j.states", "another").covers
    assert not Journal(path, IDENTITY, layout=third.state_layout()).replayable


def test_states_of_another_layout_or_a_team_client_that_cannot_import_are_one_line(tmp_path):
    path = tmp_path / "j"
    play(path, stream(30))
    with pytest.raises(JournalError, match="lays its states out otherwise"):
        replay(Toy(layout="other"), Journal(path, IDENTITY), keep=3, progress=None)

    class CannotImport(Toy):
        import_state = None

    with pytest.raises(JournalError, match="cannot import states"):
        replay(CannotImport(), Journal(path, IDENTITY), keep=3, progress=None)


def test_states_that_do_not_fit_the_engine_are_one_line_naming_the_journal(tmp_path):
    """A restart with fewer state slots than the symbols checkpointed: a JournalError (an ordinary mistake, in one
    line) naming the journal and the engine's limits. The engine's CapacityError escaped, an unexpected error."""
    path = tmp_path / "j"
    play(path, stream(30))

    class TwoSlots(Toy):
        def import_state(self, symbol, data):
            if len(self.states) == 2:
                raise CapacityError.no_room([symbol], "2 on cpu", "--state-slots")
            super().import_state(symbol, data)

    with pytest.raises(JournalError, match=r"j: the states checkpointed of 3 symbols do not fit .*2 on cpu"):
        replay(TwoSlots(), Journal(path, IDENTITY), keep=3, progress=None)


def test_a_kill_between_closing_a_segment_and_opening_the_next_reads_the_closed_one_as_written(tmp_path):
    path = tmp_path / "j"
    first = play(path, stream(12), segment_records=100)
    os.replace(path, f"{path}.part0")  # as _close_segment's rename, before PATH is created again
    journal = Journal(path, IDENTITY, layout=first.state_layout())
    assert path.exists() and parts(path) == [] and journal.count == 12
    again = Toy()
    replay(again, journal, keep=3, progress=None)
    assert all(np.array_equal(again.states[s], first.states[s]) for s in first.states)


def test_a_state_that_cannot_be_written_keeps_its_records(tmp_path, monkeypatch, caplog):
    def full_disk(self, symbol, covers, state):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(StateCheckpoints, "write", full_disk)
    path = tmp_path / "j"
    first = play(path, stream(30))
    assert caplog.text.count("was not checkpointed: its file could not be written") == 1  # checkpoints stop
    assert len(parts(path)) >= 5  # nothing covered, nothing deleted
    again = Toy()
    replay(again, Journal(path, IDENTITY, layout=first.state_layout()), keep=3, progress=None)
    assert sorted(again.stepped) == list(range(30))
    assert all(np.array_equal(again.states[s], first.states[s]) for s in first.states)


def test_a_new_session_checkpoints_again_after_the_old_one_stopped_them(tmp_path, monkeypatch, caplog):
    """A state write failed in one session (checkpoints stop, its records kept); the server began a new stream in
    the same process (begin() with a new key: the files started afresh): its checkpoints go on, bounding its journal.
    They stayed stopped, and the new session's journal grew without bound, unsaid."""
    team, path = Toy(), tmp_path / "j"
    journal = Journal(path, IDENTITY, layout=team.state_layout(), segment_bytes=5 * RECORD_BYTES, keep=3)

    def feed(requests):
        for uid, symbol, features in requests:
            journal.append([(uid, symbol, features)], team.process_batch({symbol: [(uid, features)]})["predictions"])
            while journal.checkpoint_due():
                due = journal.begin_checkpoint(set())
                if due is None:
                    journal.drop_covered()
                    break
                journal.end_checkpoint(due[0], due[1], team.export_state(due[0]).result())

    def full_disk(self, symbol, covers, state):
        raise OSError(28, "No space left on device")

    journal.begin("k")
    with monkeypatch.context() as patched:
        patched.setattr(StateCheckpoints, "write", full_disk)
        feed(stream(20))
    assert journal.checkpoints_failed and journal.checkpointed == 0
    journal.begin("k2")
    team = Toy()
    feed(stream(60, seed=1))
    journal.close()
    assert journal.checkpointed > 0 and journal.dropped > 0 and len(parts(path)) <= 2
    again = Toy()
    replay(again, Journal(path, IDENTITY, layout=team.state_layout(), keep=3), keep=3, progress=None)
    assert all(np.array_equal(again.states[s], team.states[s]) for s in team.states)


def test_a_version_1_journal_is_replayed_and_the_session_goes_on_in_a_segment_of_its_own(tmp_path):
    """A journal written before answers were journaled (version 1: no predictions) is replayed whole, and the
    session goes on in a new segment (its records could not be appended to the old file)."""
    path, requests = tmp_path / "j", stream(8)
    records = b"".join(uid.to_bytes(8, "little", signed=True) + len(symbol).to_bytes(2, "little") + symbol.encode()
                       + features.astype("<f4").tobytes() for uid, symbol, features in requests[:5])
    path.write_bytes(MAGIC_V1 + b'{"url": "ws://127.0.0.1:1", "team": "t", "weights": "abc", "session_key": "k"}\n'
                     + records)
    journal = Journal(path, IDENTITY, layout={"toy": "toy"})
    assert journal.count == 5 and all(prediction is None for chunk in journal.records() for *_, prediction in chunk)
    team = Toy()
    replayed = replay(team, journal, keep=10, progress=None)
    assert sorted(team.stepped) == list(range(5)) and sorted(replayed.recent) == list(range(5))
    journal.begin("k")
    for uid, symbol, features in requests[5:]:
        journal.append([(uid, symbol, features)], team.process_batch({symbol: [(uid, features)]})["predictions"])
    journal.close()
    assert parts(path) == ["j.part0"]
    again = Toy()
    replay(again, Journal(path, IDENTITY, layout={"toy": "toy"}), keep=10, progress=None)
    assert sorted(again.stepped) == list(range(8))
    assert all(np.array_equal(again.states[s], team.states[s]) for s in team.states)


def test_the_runtime_checkpoints_between_steps_and_a_restart_answers_on_right(tmp_path):
    """Through the runtime and a scoring server: the first process journals with segments of 5 records and
    checkpoints as it plays, and is stopped mid-stream; a process restarted from the journal loads the states,
    replays the tail, takes its session back and answers the rest: every answer of both the straight-through one,
    and the journal stays bounded."""
    from client.runtime import StreamingClient
    from client.streams import generate_stream

    n = 120
    stream_ = generate_stream(3, n, seed=4)
    path = tmp_path / "j"
    answers = {}

    class Noted(Toy):
        def process_batch(self, batch):
            answer = super().process_batch(batch)
            answers.update(zip(answer["unique_ids"], answer["predictions"]))
            return answer

    async def main():
        async with serving(stream_, 200.0) as url:
            team = Noted()
            journal = Journal(path, IDENTITY, layout=team.state_layout(), segment_bytes=5 * RECORD_BYTES, keep=3)
            first = StreamingClient(team, url, "testers", leave_at_end=True, journal=journal)
            playing = asyncio.create_task(first.run())
            while first.stats.requests < 60:
                await asyncio.sleep(0.01)
            first.stop()
            await asyncio.wait_for(playing, 30)
            journal.close()
            most_parts = len(parts(path))
            team = Noted()
            journal = Journal(path, IDENTITY, layout=team.state_layout(), segment_bytes=5 * RECORD_BYTES, keep=3)
            assert journal.first > 0  # segments were deleted
            replayed = replay(team, journal, 3, progress=None)
            again = StreamingClient(team, url, "testers", leave_at_end=True, session_key=journal.session_key,
                                    journal=journal, replayed=replayed)
            summary = await asyncio.wait_for(again.run(), 60)
            journal.close()
            return most_parts, summary

    most_parts, summary = asyncio.run(main())
    # ~12 and ~24 segments closed; those closed since the last submits' checkpoints stay (the writer's pace)
    assert summary["outcome"] == "complete" and most_parts <= 8 and len(parts(path)) <= 8
    assert set(answers) == set(range(n))
    straight = Toy()
    for uid in range(n):
        features = np.asarray(stream_.features[uid], np.float32)
        expected = straight.process_batch({stream_.symbols[uid]: [(uid, features)]})["predictions"][0]
        assert np.array_equal(answers[uid], expected), uid


def test_the_runtime_forgets_idle_symbols_between_steps_and_a_replay_forgets_them_where_it_did(tmp_path):
    """The runtime's idle_timeout_s (--idle-timeout with --journal): SYM_002 pauses 300 ms mid-stream while the
    others play a request each 10 ms, so the team client forgets it once no request of it came for 50 ms, and its
    first request back starts afresh. The journal says where: its replay (no checkpoints: all of it) ends with every
    state the live one held, bit for bit."""
    from client.runtime import StreamingClient
    from client.streams import Stream

    rng = np.random.default_rng(6)
    names = [f"SYM_{i % 3:03d}" for i in range(30)] + [f"SYM_{i % 2:03d}" for i in range(60)] + \
        [f"SYM_{i % 3:03d}" for i in range(30)]
    stream_ = Stream(np.array(names), rng.standard_normal((len(names), 79)).astype(np.float32),
                     np.full(len(names), 5.0, np.float32))
    back = 92  # SYM_002's first request after its pause
    path = tmp_path / "j"
    answers = {}

    class Noted(Unbounded):
        def process_batch(self, batch):
            answer = super().process_batch(batch)
            answers.update(zip(answer["unique_ids"], answer["predictions"]))
            return answer

    async def main():
        async with serving(stream_, None) as url:
            team = Noted()
            journal = Journal(path, IDENTITY, keep=3)
            client = StreamingClient(team, url, "testers", leave_at_end=True, journal=journal, idle_timeout_s=0.05)
            summary = await asyncio.wait_for(client.run(), 60)
            journal.close()
            return team, client, summary

    team, client, summary = asyncio.run(main())
    assert summary["outcome"] == "complete" and set(answers) == set(range(len(names)))
    assert client.forgotten_idle >= 1
    assert np.array_equal(answers[back], stream_.features[back][:4])  # afresh: 0 / 2 + its features
    again = Unbounded()
    replay(again, Journal(path, IDENTITY, keep=3), keep=3, progress=None)
    assert again.states.keys() == team.states.keys()
    assert all(np.array_equal(again.states[s], team.states[s]) for s in team.states)

    class CannotForget(Toy):
        release = None

    with pytest.raises(ValueError, match="able to forget a symbol"):
        StreamingClient(CannotForget(), "ws://127.0.0.1:1", "testers", idle_timeout_s=1.0)


def test_a_lost_shards_symbols_started_afresh_are_forgotten_where_they_were_on_replay(tmp_path):
    """--on-shard-loss reset with --journal, through the runtime and a scoring server: shard 0 answers nothing for
    50 ms mid-stream, then is lost; its symbols start afresh on shard 1, their unanswered requests first. The journal
    says where each old state ended, so a replay (no checkpoints: all of it) ends with every symbol's state the
    live one's; without the records it carried the lost shard's symbols' old states on."""
    from client.engine.reference import ReferenceEngine
    from client.engine.sharded import ShardedEngine
    from client.model import load_model
    from client.runtime import StreamingClient
    from client.streams import Stream
    from shard_checks import LosableHere
    from team.example_model import ExampleModel

    model = load_model("tiny", seed=3)[0]
    names = [f"SYM_{i % 4:03d}" for i in range(120)]
    stream_ = Stream(np.array(names), np.random.default_rng(7).standard_normal((120, 79)).astype(np.float32),
                     np.full(120, 5.0, np.float32))
    lossy = LosableHere(ReferenceEngine(model, device="cpu"), 0)
    engine = ShardedEngine([lossy, LosableHere(ReferenceEngine(model, device="cpu"), 1)], progress=False,
                           on_shard_loss="reset")
    path = tmp_path / "j"

    async def main():
        async with serving(stream_, None) as url:
            team = ExampleModel(engine)
            journal = Journal(path, IDENTITY, keep=3)
            client = StreamingClient(team, url, "testers", leave_at_end=True, journal=journal)
            playing = asyncio.create_task(client.run())
            while client.stats.responses_sent < 40:
                await asyncio.sleep(0.002)
            lossy.gate.clear()
            await asyncio.sleep(0.05)
            lossy.lose()
            summary = await asyncio.wait_for(playing, 60)
            journal.close()
            return summary

    try:
        summary = asyncio.run(main())
        assert summary["outcome"] == "complete" and summary["responses_sent"] == 120
        [loss] = engine.losses
        assert loss["symbols"] and loss["unanswered_parts"] >= 1  # requests of its symbols were on their way
        live = {s: engine.export_state(s).result() for s in sorted(set(names))}
    finally:
        engine.close()
    journal = Journal(path, IDENTITY, keep=3)
    assert journal.forgotten == len(loss["symbols"])
    again = ExampleModel(ReferenceEngine(model, device="cpu"))
    replay(again, journal, keep=3, progress=None)
    for symbol, state in live.items():
        np.testing.assert_allclose(np.frombuffer(again.export_state(symbol).result(), np.float32),
                                   np.frombuffer(state, np.float32), rtol=1e-4, atol=2e-5, err_msg=symbol)


class SlowToy(Toy):
    """Each step's answer comes 20 ms after its submit: the next step forms while one is in flight, so a symbol
    with a request every few ms has one in every step."""

    def submit_batch(self, batch):
        answer, ready_at = self.process_batch(batch), time.monotonic() + 0.02
        return PendingStep(lambda: time.sleep(max(0.0, ready_at - time.monotonic())) or answer,
                           poll=lambda: time.monotonic() >= ready_at)


def test_a_symbol_in_every_step_is_held_out_of_one_for_its_checkpoint(tmp_path, monkeypatch):
    """One symbol at 400 requests/s, steps of 20 ms: it has a request in every step in flight, so no submit finds it
    free to checkpoint and its segments stayed for the session. After CHECKPOINT_MISSES submits it is held out of
    steps until those in flight are answered, then checkpointed: segments go, and a restart loads its state and
    replays the rest onto it, as the live one stood."""
    from client import runtime
    from client.runtime import StreamingClient
    from client.streams import generate_stream

    monkeypatch.setattr(runtime, "CHECKPOINT_MISSES", 4)  # ~50 submits in the session: several checkpoints
    n = 400
    stream_ = generate_stream(1, n, seed=5)
    path = tmp_path / "j"

    async def main():
        async with serving(stream_, 400.0) as url:
            team = SlowToy()
            journal = Journal(path, IDENTITY, layout=team.state_layout(), segment_bytes=20 * RECORD_BYTES, keep=10)
            summary = await asyncio.wait_for(StreamingClient(team, url, "testers", leave_at_end=True,
                                                             journal=journal).run(), 60)
            journal.close()
            return team, journal, summary

    team, journal, summary = asyncio.run(main())
    assert summary["outcome"] == "complete" and summary["responses"] == n
    assert journal.checkpointed >= 3 and journal.dropped >= 3 and len(parts(path)) <= 4
    again = Toy()
    replay(again, Journal(path, IDENTITY, layout=again.state_layout(), keep=10), keep=10, progress=None)
    assert np.array_equal(again.states["SYM_000"], team.states["SYM_000"])


def test_a_kill_after_the_next_segment_is_created_before_its_header_reads_the_closed_one_as_written(tmp_path):
    """_close_segment creates PATH (O_EXCL) then writes its header: killed between the two, PATH is empty beside the
    closed parts. It read as no journal at all: every state lost, the session taken back from fresh states."""
    path = tmp_path / "j"
    first = play(path, stream(40), keep=10**6)
    os.replace(path, f"{path}.part40")
    path.write_bytes(b"")
    journal = Journal(path, IDENTITY, layout=first.state_layout(), keep=10**6)
    assert journal.session_key == "k" and journal.total == 40
    again = Toy()
    replay(again, journal, keep=10**6, progress=None)
    assert all(np.array_equal(again.states[s], first.states[s]) for s in first.states)


def test_the_ids_of_deleted_segments_are_kept_where_no_state_was_checkpointed(tmp_path):
    """Segments of refused requests alone need no state to go: their ids, kept in gone.npz, are refused again after
    a restart (they were ignored where no symbol's state was checkpointed, and a resend of one stepped)."""
    path = tmp_path / "j"
    play(path, stream(400), refused=set(range(400)))
    journal = Journal(path, IDENTITY, layout=Toy().state_layout(), keep=3)
    assert journal.first > 0 and not journal.checkpoints.covers
    replayed = replay(Toy(), journal, keep=3, keep_refused=10**6, progress=None)
    assert len(replayed) == 400 and list(replayed.refused) == list(range(400))


def test_a_state_is_written_only_once_the_records_it_covers_are_on_the_disk(tmp_path, monkeypatch):
    """A crash of the machine may lose the journal's tail that the page cache held: a state synced before the records
    it covers would be ahead of the journal, and the records numbered again after it read as covered by it."""
    import client.journal as journal_module

    synced, write = {}, StateCheckpoints.write  # inode -> its size when synced
    real_fsync = os.fsync

    def fsync(fd):
        synced[os.fstat(fd).st_ino] = os.fstat(fd).st_size
        real_fsync(fd)

    def checked_write(self, symbol, covers, state):
        for p in tmp_path.iterdir():
            if p.name == "j" or p.name.startswith("j.part"):
                assert synced.get(p.stat().st_ino) == p.stat().st_size, f"{p.name} not on the disk"
        write(self, symbol, covers, state)

    monkeypatch.setattr(journal_module.os, "fsync", fsync)
    monkeypatch.setattr(StateCheckpoints, "write", checked_write)
    first = play(tmp_path / "j", stream(40))
    assert first.states and Journal(tmp_path / "j", IDENTITY, layout=first.state_layout()).checkpoints.covers


def test_a_journal_whose_segments_went_and_whose_states_are_missing_is_one_line(tmp_path):
    """Segments go once states cover them: without those states (PATH.states removed, or a file) a restart stepped
    the rest onto fresh states, wrong and said right."""
    import shutil

    path = tmp_path / "j"
    play(path, stream(60))
    shutil.rmtree(tmp_path / "j.states")
    (tmp_path / "j.states").write_bytes(b"")
    with pytest.raises(JournalError, match="states"):
        Journal(path, IDENTITY, layout=Toy().state_layout())


def test_a_restart_in_another_layout_before_any_state_was_checkpointed_writes_its_states_in_its_layout(tmp_path):
    """layout.json names the layout of the states beside it: a restart whose engine lays them out otherwise, before
    any was written, went on writing its own under the old name, and the next restart refused them (or, with the
    old options, imported them in the wrong layout)."""
    path, requests = tmp_path / "j", stream(40)
    first = play(path, requests[:4])
    assert not StateCheckpoints(tmp_path / "j.states", "k").covers
    again = Toy(layout="other")
    replay(again, Journal(path, IDENTITY, layout=again.state_layout(), keep=3), keep=3, progress=None)
    play(path, requests[4:], team=again)
    assert Journal(path, IDENTITY, layout=again.state_layout()).checkpoints.covers
    third = Toy(layout="other")
    replay(third, Journal(path, IDENTITY, layout=third.state_layout(), keep=3), keep=3, progress=None)
    assert all(np.array_equal(third.states[s], again.states[s]) for s in again.states) and first.states


def test_a_layout_with_tuples_is_the_same_layout_read_back_from_json(tmp_path):
    """layout.json reads back a team client's tuples as lists: compared as given, every restart said its states
    were laid out otherwise."""
    class Tuples(Toy):
        def state_layout(self):
            return {"toy": ("a", (4,), "float32")}

    path = tmp_path / "j"
    first = play(path, stream(30), team=Tuples())
    again = Tuples()
    replay(again, Journal(path, IDENTITY, layout=again.state_layout(), keep=3), keep=3, progress=None)
    assert all(np.array_equal(again.states[s], first.states[s]) for s in first.states)


@pytest.mark.parametrize("fails", ["create", "header"])
def test_a_segment_that_cannot_be_opened_sets_every_segment_aside(tmp_path, monkeypatch, caplog, fails):
    """Closing a segment, the next one cannot be created (no room for a file) or its header written: journaling
    stops and every segment is set aside. The closed file was left: the error escaped the step's answer (no file
    to close), or the closed segment stayed beside the files set aside, read back as the whole journal."""
    import client.journal as journal_module

    real_open = os.open

    def full(name, flags, *args):
        if flags & os.O_EXCL:
            if fails == "create":
                raise OSError(28, "No space left on device")
            return real_open(name, (flags & ~os.O_WRONLY) | os.O_RDONLY, *args)  # its header's write fails
        return real_open(name, flags, *args)

    monkeypatch.setattr(journal_module.os, "open", full)
    path = tmp_path / "j"
    play(path, stream(12))
    assert "set aside as" in caplog.text and parts(path) == [] and not path.exists()
    assert not Journal(path, IDENTITY, layout=Toy().state_layout()).replayable


def test_a_journal_set_aside_replaces_the_segments_of_one_set_aside_before(tmp_path):
    """Two journals of the team's session (the server kept its key) each set aside after a failed write: the second
    one's segments replace the first one's, as its file and states do. The first one's segments numbered otherwise
    were left beside them, read with them as one journal (its segments out of order, or records of both)."""
    class Full:
        def write(self, data):
            raise OSError(28, "No space left on device")

        def close(self):
            pass

    path = tmp_path / "j"
    for n in (40, 12):  # segments 0, 5, ..., 35 and the one from 40 set aside; then 0, 5 and the one from 10
        team = play(path, stream(n), keep=10**6)
        journal = Journal(path, IDENTITY, layout=team.state_layout(), keep=10**6)
        journal.begin("k")
        journal._file = Full()
        journal.append(stream(1))
        assert journal.failed and not path.exists()
        journal.close()
    assert parts(tmp_path / "j.incomplete") == ["j.incomplete.part0", "j.incomplete.part5"]
    aside = Journal(tmp_path / "j.incomplete", IDENTITY, layout=team.state_layout(), keep=10**6)
    assert aside.first == 0 and aside.total == 12


def test_ids_that_cannot_be_kept_keep_their_segment_and_stop_checkpoints(tmp_path, monkeypatch, caplog):
    """gone.npz that cannot be written (a full disk): the segment stays, said once, and nothing more is let go. The
    error escaped drop_covered into the runtime's checkpoint thread, unsaid, and every step read the segment again."""
    calls = []

    def full_disk(self, answered, refused):
        calls.append(1)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(StateCheckpoints, "add_gone", full_disk)
    path = tmp_path / "j"
    first = play(path, stream(60))
    assert len(calls) == 1 and caplog.text.count("could not be let go") == 1 and "j.part0" in parts(path)
    again = Toy()
    replay(again, Journal(path, IDENTITY, layout=first.state_layout(), keep=3), keep=3, progress=None)
    assert all(np.array_equal(again.states[s], first.states[s]) for s in first.states)


def test_states_ahead_of_a_journal_whose_tail_a_crash_lost_are_one_line(tmp_path):
    """A state covering records the journal no longer holds (written before they were synced): the records
    appended after a restart were numbered as if covered by it, and a second restart skipped them."""
    path = tmp_path / "j"
    first = play(path, stream(43), keep=10**6)
    states = StateCheckpoints(tmp_path / "j.states", "k")
    states.write("SYM_000", 43, first.export_state("SYM_000").result())  # as a checkpoint in the segment written
    os.truncate(path, os.path.getsize(path) - RECORD_BYTES)  # its last record lost
    with pytest.raises(JournalError, match="a crash"):
        Journal(path, IDENTITY, layout=Toy().state_layout())


def test_a_state_or_ids_write_that_fails_leaves_no_part_of_its_file(tmp_path, monkeypatch):
    """A full disk failing a state's write (or gone.npz's) partway: its temporary file is removed. It was left in
    PATH.states, up to a state's size (146 MiB) of a full disk's room held for the rest of the session."""
    import client.state_checkpoints as state_checkpoints

    checkpoints = StateCheckpoints(tmp_path / "j.states", "k")
    checkpoints.start("k", {"toy": "toy"})

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(state_checkpoints.os, "fsync", full_disk)
    with pytest.raises(OSError):
        checkpoints.write("SYM_000", 5, np.ones(1 << 16, np.uint8))
    with pytest.raises(OSError):
        checkpoints.add_gone([1, 2, 3], [4])
    assert sorted(p.name for p in (tmp_path / "j.states").iterdir()) == ["layout.json"]
    assert checkpoints.covers == {}


class Killed(BaseException):
    """The process killed at this point (no handler of the journal's sees it)."""


@pytest.mark.parametrize("at_removal", [1, 2])
def test_a_kill_as_a_new_session_begins_reads_the_new_session_or_the_old_one_whole(tmp_path, monkeypatch, at_removal):
    """A new session's begin() removed the old one's segments, then wrote PATH afresh: killed in between, PATH held the
    old session's head segment without the records before it, and the restart stepped it onto fresh states (wrong,
    and said right) or refused the journal. Now the new session's PATH is in place before anything old goes."""
    import client.journal as journal_module

    path = tmp_path / "j"
    team = play(path, stream(60), keep=10**6)  # segments 0, 5, ..., 55: none let go
    assert len(parts(path)) > 2
    removals, remove = [], os.remove

    def killed_at_a_removal(name):
        removals.append(name)
        if len(removals) == at_removal:
            raise Killed
        remove(name)

    monkeypatch.setattr(journal_module.os, "remove", killed_at_a_removal)
    journal = Journal(path, IDENTITY, layout=team.state_layout(), keep=10**6)
    with pytest.raises(Killed):
        journal.begin("another")
    journal.close()
    monkeypatch.setattr(journal_module.os, "remove", remove)
    again = Journal(path, IDENTITY, layout=team.state_layout(), keep=10**6)
    assert again.session_key == "another" and not again.replayable  # the old parts and states are another session's
    again.begin("another")
    again.append(stream(3))
    again.close()
    assert parts(path) == [] and Journal(path, IDENTITY, layout=team.state_layout()).count == 3


def test_a_state_is_written_only_once_the_journals_renamed_segments_are_in_its_folder_on_the_disk(tmp_path,
                                                                                                   monkeypatch):
    """A closed segment is renamed PATH.part<first> and PATH created again: a crash of the machine before the folder's
    entries reach the disk may lose the rename, and with it the records of the new PATH that a state covers."""
    import client.journal as journal_module

    folder, real_replace, real_fsync, write = tmp_path.stat().st_ino, os.replace, os.fsync, StateCheckpoints.write
    unsynced = []  # renames in the journal's folder since it was last synced

    def replace(src, dst):
        real_replace(src, dst)
        if os.path.dirname(os.path.abspath(src)) == str(tmp_path):
            unsynced.append(os.path.basename(dst))

    def fsync(fd):
        real_fsync(fd)
        if os.fstat(fd).st_ino == folder:
            unsynced.clear()

    def checked_write(self, symbol, covers, state):
        assert not unsynced, f"{unsynced} not in the folder on the disk"
        write(self, symbol, covers, state)

    monkeypatch.setattr(journal_module.os, "replace", replace)
    monkeypatch.setattr(journal_module.os, "fsync", fsync)
    monkeypatch.setattr(StateCheckpoints, "write", checked_write)
    first = play(tmp_path / "j", stream(40))
    assert first.states and Journal(tmp_path / "j", IDENTITY, layout=first.state_layout()).checkpoints.covers


@pytest.mark.parametrize("dropped", [False, True], ids=["a-symbol-never-checkpointed", "segments-let-go"])
def test_a_kill_while_a_journal_is_set_aside_leaves_it_whole_or_refused(tmp_path, monkeypatch, dropped):
    """A failed write sets the journal aside file by file: killed at each rename in turn, a restart replays every
    record onto the states it ends with, or refuses the journal in one line. Its segments went first, and a restart
    loaded the states and replayed a journal short of its first segments, wrong and said right (SYM_000, in every
    step, is never checkpointed: its records are needed from the first)."""
    import client.journal as journal_module

    class Full:
        def write(self, data):
            raise OSError(28, "No space left on device")

        def close(self):
            pass

    requests, real_replace = stream(60), os.replace
    straight = Toy()
    for uid, symbol, features in requests:
        straight.process_batch({symbol: [(uid, features)]})
    for kill_at in range(1, 30):
        path = tmp_path / str(kill_at) / "j"
        path.parent.mkdir()
        team = play(path, requests, busy=frozenset() if dropped else {"SYM_000"})
        renames = []

        def killed_at_a_rename(src, dst):
            renames.append(src)
            if len(renames) == kill_at:
                raise Killed
            real_replace(src, dst)

        journal = Journal(path, IDENTITY, layout=team.state_layout(), keep=3)
        journal.begin("k")
        journal._file = Full()
        monkeypatch.setattr(journal_module.os, "replace", killed_at_a_rename)
        try:
            journal.append(stream(61)[60:])
        except Killed:
            pass
        monkeypatch.setattr(journal_module.os, "replace", real_replace)
        if len(renames) < kill_at:  # set aside whole before this kill: every rename tried
            break
        again = Toy()
        try:
            replay(again, Journal(path, IDENTITY, layout=team.state_layout(), keep=3), keep=3, progress=None)
        except JournalError as exc:
            assert "remove" in str(exc), exc  # one line that says what to do
            continue
        assert again.states.keys() == straight.states.keys(), kill_at
        assert all(np.array_equal(again.states[s], straight.states[s]) for s in straight.states), kill_at
    assert kill_at > 2


@pytest.mark.parametrize("lost_at", ["step", "import"])
def test_a_shard_lost_during_a_replay_has_its_symbols_stepped_again_through_their_records(tmp_path, lost_at):
    """--on-shard-loss reset: a shard lost mid-replay starts its symbols afresh on another, and the replay stepped
    their later records onto those fresh states: they missed every record before, and no forget record could say
    where (the journal goes on at its end); one lost as the states loaded ended the replay (ShardLost). Now the
    replay steps those symbols again from their checkpointed states through each of their records, and ends with
    every state the one the journal's history gives."""
    from client.engine.reference import ReferenceEngine
    from client.engine.sharded import ShardedEngine
    from client.model import load_model
    from shard_checks import LosableHere
    from team.example_model import ExampleModel

    model = load_model("tiny", seed=3)[0]
    requests = stream(90, symbols=6)
    # three symbols never checkpointed (busy): their records are replayed from the first, the others' from states
    played = play(tmp_path / "j", requests, busy={"SYM_000", "SYM_001", "SYM_002"},
                  team=ExampleModel(ReferenceEngine(model, device="cpu")))

    class Lost(LosableHere):
        steps = 0

        def submit(self, symbols, features):  # at its third step
            self.steps += 1
            self.lost = self.lost or (lost_at == "step" and self.steps == 3)
            return super().submit(symbols, features)

        def import_state(self, symbol, data):  # at its first state
            self.lost = self.lost or lost_at == "import"
            return super().import_state(symbol, data)

    engine = ShardedEngine([Lost(ReferenceEngine(model, device="cpu"), 0),
                            LosableHere(ReferenceEngine(model, device="cpu"), 1)], progress=False,
                           on_shard_loss="reset")
    try:
        again = ExampleModel(engine)
        journal = Journal(tmp_path / "j", IDENTITY, layout=again.state_layout(), keep=3)
        assert len(journal.checkpoints.covers) == 3
        replay(again, journal, keep=3, progress=None)
        [loss] = engine.losses
        assert lost_at == "import" or {"SYM_000", "SYM_001", "SYM_002"} & set(loss["symbols"]), loss["symbols"]
        for symbol in sorted({symbol for _, symbol, _ in requests}):
            np.testing.assert_allclose(np.frombuffer(again.export_state(symbol).result(), np.float32),
                                       np.frombuffer(played.export_state(symbol).result(), np.float32),
                                       rtol=1e-4, atol=2e-5, err_msg=symbol)
    finally:
        engine.close()
