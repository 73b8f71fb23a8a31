"""client/journal.py: what a team client journals, what a restarted one reads and replays."""
import asyncio
import os

import numpy as np
import pytest

from client.engine.reference import ReferenceEngine
from client import journal as journal_module
from client.journal import MAGIC, Journal, JournalError, check_file, replay
from client.model import load_model
from team.example_model import ExampleModel

IDENTITY = {"url": "ws://127.0.0.1:1", "team": "t", "weights": "abc"}


def records(journal):
    return [record for chunk in journal.records() for record in chunk]


class Refused(list):
    """The unique ids of requests refused, a step of journaled()'s written with refuse()."""


def journaled(path, *steps, key="k"):
    """A process's journal of session `key` at `path` (gone on from where it was read), a step of records each
    append (refuse where it is Refused), closed; what it holds, read back."""
    journal = Journal(path, IDENTITY)
    journal.begin(key)
    for step in steps:
        if isinstance(step, Refused):
            journal.refuse(step)
        else:
            journal.append(step)
    journal.close()
    return Journal(path, IDENTITY)


def rows(n, seed=0):
    rng = np.random.default_rng(seed)
    return [(uid, f"SYM_{uid % 3:03d}", rng.standard_normal(79).astype(np.float32)) for uid in range(n)]


def test_a_session_journaled_is_read_back_in_order_and_goes_on_where_it_is_the_same_session(tmp_path):
    path = tmp_path / "j"
    journal = Journal(path, IDENTITY)
    journal.begin("key-1")
    journal.append(rows(5)[:3])
    journal.append(rows(5)[3:])
    journal.close()
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"  # it holds the session key
    again = Journal(path, IDENTITY)
    assert again.session_key == "key-1" and [uid for uid, *_ in records(again)] == list(range(5))
    assert again.count == 5
    assert all(np.array_equal(a[2], b[2]) and a[1] == b[1] for a, b in zip(records(again), rows(5)))
    again.begin("key-1")  # the same session: appended to
    again.append([(5, "SYM_002", np.zeros(79, np.float32))])
    again.close()
    assert [uid for uid, *_ in records(Journal(path, IDENTITY))] == list(range(6))
    other = Journal(path, IDENTITY)
    other.begin("key-2")  # another session: started afresh
    other.close()
    assert records(Journal(path, IDENTITY)) == [] and Journal(path, IDENTITY).session_key == "key-2"


def test_a_new_stream_starts_the_journal_afresh_though_its_server_keeps_the_session_key(tmp_path):
    """The team client drops every state for a new stream: the old stream's records, replayed after a restart, would
    rebuild states the new stream never had, whatever key the server's welcome names."""
    path = tmp_path / "j"
    journal = Journal(path, IDENTITY)
    journal.begin("k")
    journal.append(rows(4))
    journal.end_session()
    journal.begin("k")
    journal.append([(0, "SYM_001", np.zeros(79, np.float32))])
    journal.close()
    again = Journal(path, IDENTITY)
    assert again.session_key == "k" and [(uid, symbol) for uid, symbol, *_ in records(again)] == [(0, "SYM_001")]


@pytest.mark.parametrize("read_before", [False, True])
def test_a_reconnect_to_the_same_session_goes_on_appending(tmp_path, read_before):
    """Each connection's welcome begins the journal again with the session's key: a reconnect of the session it
    journals goes on appending, whether the process started with an empty journal (it was started afresh, every
    record lost) or with one it replayed (cut back to where it was read, every record since lost)."""
    path = tmp_path / "j"
    if read_before:
        journaled(path, rows(6)[:2])
    journal = Journal(path, IDENTITY)
    journal.begin("k")
    journal.append(rows(6)[2:4] if read_before else rows(6)[:4])
    journal.begin("k")  # the connection dropped; the reconnect's welcome
    journal.append(rows(6)[4:])
    journal.close()
    assert [uid for uid, *_ in records(Journal(path, IDENTITY))] == list(range(6))


def test_a_tail_cut_by_a_kill_and_another_servers_journal_are_read_as_far_as_they_hold(tmp_path):
    path = tmp_path / "j"
    journaled(path, rows(4))
    with open(path, "ab") as f:
        f.write(b"\x07\x00\x00")  # a record cut short
    assert len(records(Journal(path, IDENTITY))) == 4
    assert records(Journal(path, {**IDENTITY, "url": "ws://elsewhere:1"})) == []  # not this server's: not replayed
    # the session goes on after a restart: the cut record is dropped, not appended after (read back, its length
    # field took the new records' bytes for its symbol and features: garbage from there on)
    read = records(journaled(path, [(9, "SYM_009", np.ones(79, np.float32))]))
    assert [(uid, symbol) for uid, symbol, *_ in read] == [(uid, symbol) for uid, symbol, _ in rows(4)] + [
        (9, "SYM_009")] and np.array_equal(read[-1][2], np.ones(79, np.float32))


def test_a_tail_cut_inside_a_refusal_is_read_as_far_as_it_holds_and_cut_off_before_the_session_goes_on(tmp_path):
    path = tmp_path / "j"
    journaled(path, rows(3), Refused([3]))
    with open(path, "ab") as f:
        f.write((4).to_bytes(8, "little") + b"\xff")  # the refusal of id 4 cut one byte short
    journal = Journal(path, IDENTITY)
    assert (journal.count, journal.refused) == (4, 1) and [uid for uid, *_ in records(journal)] == [0, 1, 2, 3]
    read = records(journaled(path, Refused([5]), [(6, "SYM_000", np.ones(79, np.float32))]))
    assert [(uid, symbol) for uid, symbol, *_ in read] == [(0, "SYM_000"), (1, "SYM_001"), (2, "SYM_002"), (3, None),
                                                          (5, None), (6, "SYM_000")]
    assert np.array_equal(read[-1][2], np.ones(79, np.float32))


def test_records_are_those_counted_when_the_file_grew_after_it_was_read(tmp_path):
    """records() reads the whole records counted when the journal was opened, as many as `count` says (and begin()
    goes on after): records appended since (another process of the session) were read too, past the count."""
    path = tmp_path / "j"
    opened = journaled(path, rows(3))
    journaled(path, [(9, "SYM_009", np.ones(79, np.float32))])  # another process of the session goes on
    assert opened.count == 3 and [uid for uid, *_ in records(opened)] == [0, 1, 2]


@pytest.mark.parametrize("content, match", [(b"garbage\n", "not a team-client journal"),
                                            (MAGIC + b"{not json\n", "its header is not JSON")])
def test_a_file_that_is_no_journal_is_one_line_before_anything_loads(tmp_path, content, match):
    path = tmp_path / "j"
    path.write_bytes(content)
    with pytest.raises(JournalError, match=match):
        check_file(path)
    check_file(tmp_path / "missing")  # a new journal


def test_a_journal_of_a_newer_version_is_said_so_not_called_no_journal(tmp_path):
    """A journal written by a newer team client (its segments of a version this one cannot read: an older checkout
    restarted after a crash) is said to be one, and which: it read as no team-client journal at all, to be removed,
    though the client that wrote it could replay it."""
    path = tmp_path / "j"
    path.write_bytes(MAGIC.replace(b"3", b"4") + b'{"session_key": "k"}\n')
    with pytest.raises(JournalError, match="version 4") as raised:
        check_file(path)
    assert "not a team-client journal" not in str(raised.value) and "remove" not in str(raised.value)
    path.write_bytes(MAGIC[:-1])  # this version's, cut short by a crash: no journal of another version
    with pytest.raises(JournalError, match="not a team-client journal"):
        check_file(path)


def test_replay_steps_each_symbols_requests_in_order_as_one_at_a_time_a_chunk_at_a_time(tmp_path, monkeypatch):
    """The journal read and replayed a few records at a time (a journal of hours is GBs): every symbol's requests in
    order across the chunks, the last `keep` answers kept with their requests, the ids before them as ranges."""
    monkeypatch.setattr(journal_module, "READ_BYTES", 1000)  # ~3 records a read
    journal = journaled(tmp_path / "j", *(rows(20)[begin:begin + 4] for begin in range(0, 20, 4)))
    assert journal.count == 20 and len(list(journal.records())) >= 6
    model, _ = load_model("tiny", seed=0)
    replayed = replay(ExampleModel(ReferenceEngine(model)), journal, keep=5, max_batch=2,
                      max_per_symbol=3, progress=None)
    assert len(replayed) == 20 and list(replayed.recent) == list(range(15, 20))
    assert all(uid in replayed.older for uid in range(15)) and 15 not in replayed.older
    assert replayed.older.ranges() == 1
    alone = ReferenceEngine(model)
    for uid, symbol, features in rows(20):
        expected = alone.step([symbol], features[None])[0]
        if uid in replayed.recent:
            prediction, kept_symbol, kept_features = replayed.recent[uid]
            np.testing.assert_allclose(prediction, expected, rtol=1e-5, atol=1e-6)
            assert kept_symbol == symbol and np.array_equal(kept_features, features)


def test_a_request_the_team_client_refuses_on_replay_is_counted_refused_and_said(tmp_path, caplog):
    """Replayed into tiers smaller than the session needed, a symbol without room is refused by the team client:
    its requests are counted among those refused (a resend is refused again, never stepped onto a state that
    missed it), and a warning names them; the other symbols replay as they were played."""
    journal = journaled(tmp_path / "j", rows(9))
    model, _ = load_model("tiny", seed=0)
    replayed = replay(ExampleModel(ReferenceEngine(model, device="cpu", capacity=2)), journal, keep=100,
                      progress=None)
    assert len(replayed) == 9 and list(replayed.refused) == [2, 5, 8]  # SYM_002's: no room for a third symbol
    assert sorted(replayed.recent) == [0, 1, 3, 4, 6, 7]
    assert "3 of its requests (1 symbols: SYM_002) were refused on replay" in caplog.text
    assert "no room" in caplog.text and "--host-symbols" in caplog.text


class _Noting(ExampleModel):
    """The example client, noting the unique ids of the requests it is handed to step."""

    def __init__(self, engine):
        super().__init__(engine)
        self.handed = []

    def process_batch(self, requests_by_symbol):
        self.handed += [uid for requests in requests_by_symbol.values() for uid, _ in requests]
        return super().process_batch(requests_by_symbol)


def test_refused_requests_are_read_back_in_their_place_and_replay_steps_none_of_them(tmp_path):
    """A request the runtime refused (answered with an error, never stepped) is journaled as its id alone (10 bytes)
    in its place among those answered: replayed, it is never stepped, its symbol's requests after it step in order
    from a state without it, and it comes back among the ids refused (a resend refused again), the last keep_refused
    of them by id and the older ones among the older ids too, as the runtime keeps them."""
    stream, refused = rows(12), [4, 7, 8]
    steps = [stream[:4], Refused([4]), stream[5:7], Refused([7, 8]), stream[9:]]
    journal = journaled(tmp_path / "j", *steps)
    read = records(journal)
    assert [(uid, symbol is None, features is None) for uid, symbol, features, _ in read] == [
        (uid, uid in refused, uid in refused) for uid in range(12)]
    assert (journal.count, journal.refused, journal.symbols) == (12, 3, 3)
    answered_alone = journaled(tmp_path / "answered", *(step for step in steps if not isinstance(step, Refused)))
    assert os.path.getsize(tmp_path / "j") - os.path.getsize(tmp_path / "answered") == 3 * 10
    assert answered_alone.refused == 0
    model, _ = load_model("tiny", seed=0)
    team = _Noting(ReferenceEngine(model))
    replayed = replay(team, journal, keep=100, max_per_symbol=3, progress=None)
    assert sorted(team.handed) == [uid for uid in range(12) if uid not in refused]
    assert len(replayed) == 12 and list(replayed.refused) == refused
    assert not set(refused) & set(replayed.recent) and not any(uid in replayed.older for uid in range(12))
    alone = ReferenceEngine(model)  # each symbol straight through the requests answered
    for uid, symbol, features in stream:
        if uid not in refused:
            np.testing.assert_allclose(replayed.recent[uid][0], alone.step([symbol], features[None])[0], rtol=1e-5,
                                       atol=1e-6)
    bounded = replay(_Noting(ReferenceEngine(model)), journal, keep=100, progress=None,
                     keep_refused=1)
    assert list(bounded.refused) == [8] and 8 not in bounded.refused_long_ago
    assert all(uid in bounded.refused_long_ago and uid in bounded.older for uid in (4, 7))


def test_a_symbol_too_long_for_a_record_stops_journaling_rather_than_read_back_as_a_refusal(tmp_path, caplog):
    path = tmp_path / "j"
    journal = Journal(path, IDENTITY)
    journal.begin("k")
    journal.append(rows(1))
    journal.append([(1, "S" * 0xFFFF, np.zeros(79, np.float32))])
    assert journal.failed and (tmp_path / "j.incomplete").exists() and "more than a journal holds" in caplog.text
    journal.close()


@pytest.mark.parametrize("uid", [2**63, -2**63 - 1])
@pytest.mark.parametrize("refused", [False, True])
def test_a_unique_id_beyond_int64_stops_journaling_rather_than_raise(tmp_path, caplog, uid, refused):
    """A server may send any integer as a unique_id (msgpack's go to 2**64 - 1, JSON's further): one no record holds
    raised struct.error out of refuse() (the runtime's refusal of a malformed or non-finite request: the client's
    run() with it) and out of append() (a step's answer). It stops journaling, as a symbol too long does."""
    path = tmp_path / "j"
    journal = Journal(path, IDENTITY)
    journal.begin("k")
    journal.append(rows(1))
    if refused:
        journal.refuse([1, uid])
    else:
        journal.append([(1, "SYM_001", np.zeros(79, np.float32)), (uid, "SYM_001", np.zeros(79, np.float32))])
    assert journal.failed and (tmp_path / "j.incomplete").exists()
    assert f"unique_id {uid} is beyond int64, more than a journal holds" in caplog.text
    journal.close()
    assert [uid for uid, *_ in records(Journal(tmp_path / "j.incomplete", IDENTITY))] == [0]


class _LostShard(ReferenceEngine):
    """A reference engine whose shard of `lost` is gone: the symbol is unplaceable, each of its requests answered with
    an error for the rest of the stream and never stepped (as a sharded engine's after a loss)."""

    def __init__(self, model, lost):
        super().__init__(model)
        self.lost = lost

    def unplaceable(self, symbols):
        return {symbol: "shard 1 lost" for symbol in symbols if symbol == self.lost}


def test_a_request_refused_before_a_kill_is_refused_again_after_the_restart_never_stepped(tmp_path, caplog):
    """The first process refuses a lost shard's symbol's requests and is killed; the server resends them (as every
    request not answered with a prediction) to the process restarted from the journal, which refuses them again
    ('rejected earlier'). Before, refusals were not journaled: the new process stepped them as new requests, its
    symbol's state advanced by requests the old process never applied, an earlier refusal now an answer."""
    from client.runtime import CACHE_SIZE, StreamingClient
    from client.streams import generate_stream
    from server import ScoringServer, ServerConfig

    n, lost = 60, "SYM_001"
    stream = generate_stream(3, n, seed=3)
    model, _ = load_model("tiny", seed=0)
    path = tmp_path / "j"

    async def main():
        server = ScoringServer(ServerConfig(rate=50.0), stream=stream, targets=np.zeros((n, 4), np.float32))
        url = f"ws://127.0.0.1:{await server.start()}"
        try:
            journal = Journal(path, IDENTITY)
            first = StreamingClient(ExampleModel(_LostShard(model, lost)), url, "testers", leave_at_end=True,
                                    journal=journal)
            playing = asyncio.create_task(first.run())

            async def until_two_refused():
                while first.stats.rejected < 2:
                    await asyncio.sleep(0.01)

            await asyncio.wait_for(until_two_refused(), 30)
            first.stop()
            await asyncio.wait_for(playing, 30)
            refused = set(first._rejected_ids)  # those the journal holds: it is closed with them, as by a kill
            journal.close()
            journal = Journal(path, IDENTITY)
            team = _Noting(ReferenceEngine(model))
            replayed = replay(team, journal, CACHE_SIZE, progress=None)
            again = StreamingClient(team, url, "testers", leave_at_end=True, session_key=journal.session_key,
                                    journal=journal, replayed=replayed)
            summary = await asyncio.wait_for(again.run(), 60)
            journal.close()
            return refused, team.handed, summary
        finally:
            await server.stop()

    refused, handed, summary = asyncio.run(main())
    assert refused and all(stream.symbols[uid] == lost for uid in refused)
    assert summary["outcome"] == "complete"
    assert refused.isdisjoint(handed)  # neither replayed nor stepped as a resend
    assert "rejected earlier" in caplog.text
    # every request of the stream in the session's journal once: answered, or refused by the first process
    journal = records(Journal(path, IDENTITY))
    assert {uid for uid, symbol, *_ in journal if symbol is None} == refused
    assert sorted(uid for uid, symbol, *_ in journal if symbol is not None) == sorted(set(range(n)) - refused)


class _NaNForSymbol0:
    """A team client answering every request at once, with NaN for SYM_000's (whose state went non-finite)."""
    requests_per_symbol = "many"

    def process_batch(self, batch):
        ids = [uid for requests in batch.values() for uid, _ in requests]
        symbols = [symbol for symbol, requests in batch.items() for _ in requests]
        return {"unique_ids": ids, "predictions": np.array([[np.nan if s == "SYM_000" else 1.0] * 4 for s in symbols],
                                                           np.float32)}


@pytest.mark.parametrize("keep", [0, 3, 100])
def test_a_replayed_non_finite_answer_is_never_kept_to_answer_a_resend(tmp_path, keep):
    """A request answered with a non-finite prediction went out as an error: replayed, its id is among the older
    ones (a resend refused), never in the answers a resend is given; keep = 0 keeps none."""
    journal = journaled(tmp_path / "j", rows(12))
    replayed = replay(_NaNForSymbol0(), journal, keep=keep, progress=None)
    assert len(replayed) == 12 and len(replayed.recent) <= keep
    assert all(np.isfinite(prediction).all() for prediction, _, _ in replayed.recent.values())
    assert sorted([*replayed.recent, *(uid for uid in range(12) if uid in replayed.older)]) == list(range(12))
    assert not set(replayed.recent) & {uid for uid in range(12) if uid in replayed.older}


class _FailingFile:
    """A journal's file whose writes fail from the `fail_at`-th on: with an OSError (a full disk), or short (a disk
    filling up: part of the record written, no error)."""

    def __init__(self, file, fail_at, short):
        self.file, self.fail_at, self.short, self.writes = file, fail_at, short, 0

    def write(self, data):
        self.writes += 1
        if self.writes < self.fail_at:
            return self.file.write(data)
        if self.short:
            return self.file.write(data[:len(data) // 2])
        raise OSError(28, "No space left on device")

    def close(self):
        self.file.close()


@pytest.mark.parametrize("short", [False, True])
def test_a_failed_write_stops_journaling_and_sets_the_file_aside_the_session_playing_on(tmp_path, caplog, short):
    """A write that fails (or writes part of a record) stops journaling for the process and renames the file
    PATH.incomplete: a restart neither replays a history missing its last steps nor appends after a torn record;
    later appends and a reconnect's begin write nothing, and nothing raises to the step's answer."""
    path = tmp_path / "j"
    journal = Journal(path, IDENTITY)
    journal.begin("k")
    journal.append(rows(9)[:3])
    journal._file = _FailingFile(journal._file, fail_at=1, short=short)
    journal.append(rows(9)[3:6])  # fails: no exception
    assert journal.failed and not path.exists() and (tmp_path / "j.incomplete").exists()
    assert "a write failed" in caplog.text and "set aside as" in caplog.text
    journal.append(rows(9)[6:])
    journal.begin("k")  # a reconnect's welcome: no new file
    journal.append(rows(9)[6:])
    journal.close()
    assert not path.exists()
    assert Journal(path, IDENTITY).count == 0  # a restart begins a new journal
    aside = Journal(tmp_path / "j.incomplete", IDENTITY)  # what was written before, for whoever looks
    assert [uid for uid, *_ in records(aside)][:3] == [0, 1, 2]


@pytest.mark.parametrize("held", [False, True], ids=["afresh", "going-on"])
def test_a_journal_that_cannot_be_begun_stops_journaling_and_the_session_plays_on(tmp_path, monkeypatch, caplog, held):
    """A full disk as a session begins (its first welcome, a new stream's between streams, or a restart going on in
    the journal read): journaling stops and the journal is set aside, as after any failed write. The error escaped
    the welcome's handling and ended the client's run (exit 2), between two streams too."""
    path = tmp_path / "j"
    if held:
        journaled(path, rows(3))
    real_open = os.open

    def full(name, flags, *args):
        if str(name) in (str(path), f"{path}.new") and flags & (os.O_CREAT | os.O_APPEND):  # (.new: a new session's)
            raise OSError(28, "No space left on device")
        return real_open(name, flags, *args)

    monkeypatch.setattr(journal_module.os, "open", full)
    journal = Journal(path, IDENTITY)
    journal.begin("k")  # no exception
    journal.append(rows(6)[3:])
    journal.close()
    assert journal.failed and "No space left on device" in caplog.text and "set aside as" in caplog.text
    assert not path.exists() and not (tmp_path / "j.new").exists() and (tmp_path / "j.incomplete").exists() == held
