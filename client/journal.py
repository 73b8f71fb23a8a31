"""The team client's journal: every request its steps answered, in the order they advanced the symbols' states, and
every request it refused.

A team client killed mid-session (kill -9, an out-of-memory kill, a reboot of its process) loses every symbol's
state; started again, it took its session back (the server resends what was unanswered) and answered from fresh
states, wrong for every symbol that had played (accuracy ~0.18 after, bench/LOG.md section 76). With a journal
(`team/example_model.py --journal PATH`) the new process first replays the journaled requests through its team
client, in their order and several of a symbol a step, which rebuilds each state exactly as the old process left
it, and answers a resent request it replayed from the replay's prediction rather than stepping it twice.

A request is written when its step's answer comes back, before the answer goes out: whatever the server saw answered
is in the journal, and whatever is not was never answered, so the server resends it to the new process. Each step's
requests are written in one write() (the operating system keeps it through a kill of the process; a crash of the
machine may lose the tail, which then reads as a shorter journal). A request the runtime refuses (answered with an
error, never stepped: a lost shard's symbol's, a malformed or non-finite one, one no tier could place, a failed
step's) is written as its id alone when it is refused, before the error goes out: the server resends it after a
restart, as every request not answered with a prediction, and the new process refuses it again ("rejected earlier")
instead of stepping it (before, it stepped it: the symbol's state advanced by a request the old process never
applied). A request whose step answered NaN is both: stepped, then refused.

A journal belongs to one session of one server, team and weights: its header names them with the session key of the
server's welcome, which the new process presents to take its team back (the file is readable by its owner alone). It
grows ~350 bytes a request answered (~0.5 GB an hour at 400 requests/s) and 10 bytes a request refused; a new
session of the server starts it afresh. A tail cut by a kill or a crash is cut off before the new process appends
(appended after it, the next read took the cut record's length for a symbol's and read garbage from there on). It is
read and replayed a chunk at a time: however long it is, a restart holds in memory only the answers the runtime may
resend (its answer cache), the refused ids it tells apart (its REFUSALS_KEPT) and the older ids as ranges and bits.
A write that fails (a full disk) stops journaling for the process, which plays on, and sets the file aside as
PATH.incomplete.

File: MAGIC, one JSON line (the header), then per request answered: unique_id (int64), the symbol's UTF-8 length
(uint16) and bytes, 79 float32 features; per request refused: unique_id (int64) and the length 0xFFFF alone (no
symbol is that long: one of 65535 bytes or more stops journaling, as does a unique_id beyond int64); little-endian.
(Still version 1: a file written before refusals were journaled holds none and reads the same; a client of before
would misread one that holds some.)
"""
import errno
import json
import logging
import os
import struct
import sys
import threading
import time

from collections import OrderedDict, deque
from dataclasses import dataclass, field

import numpy as np

from client import team_api
from client.constants import NUM_FEATURES
from client.id_ranges import IdBits, IdRanges
from client.runtime import REFUSALS_KEPT
from client.scheduler import Request, Scheduler

log = logging.getLogger(__name__)
MAGIC = b"team-client journal 1\n"
_HEAD = struct.Struct("<qH")
_REFUSED = 0xFFFF  # the symbol's length of a refused request's record: its unique_id alone follows no symbol
_FEATURE_BYTES = NUM_FEATURES * 4
REPLAY_ROWS = 4096  # requests a replay call hands the team client at most (the engine splits its own steps)
READ_BYTES = 1 << 24  # read and replayed this much of the file at a time (~48,000 requests)


class JournalError(ValueError):
    """A journal that cannot be read or written, in one line."""


class Journal:
    """One session's journal at `path`: where its header names `identity` ({url, team, weights}: the server, team and
    weights of this client), its `session_key`, the `count` of whole records (read with records()), of them those
    `refused`, and the `symbols` of those answered; appending once begin() has named the session."""

    def __init__(self, path, identity: dict):
        self.path, self.identity = str(path), dict(identity)
        self.session_key: str | None = None
        self.count = self.refused = self.symbols = 0
        self._records_at = self._records_end = 0  # the records' bytes: after the header, up to the last whole one
        self._file = None
        self.failed = False  # a write failed: the file was set aside and nothing more is journaled (_set_aside)
        self._lock = threading.Lock()  # steps answer from the completer thread and the event loop
        try:
            with open(self.path, "rb") as f:
                header, self._records_at = _read_header(f, self.path)
                if header is None or any(header.get(k) != v for k, v in self.identity.items()):
                    return
                count, refused, end, symbols = 0, 0, self._records_at, set()
                for chunk, chunk_end in _chunks(f, self._records_at, None, features=False):
                    count, end = count + len(chunk), chunk_end
                    refused += sum(symbol is None for _, symbol, _ in chunk)
                    symbols.update(symbol for _, symbol, _ in chunk)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise JournalError(f"--journal {self.path}: cannot read it ({exc.strerror})") from None
        symbols.discard(None)  # (a refused request's record names none)
        self.session_key, self.count, self.refused = header.get("session_key"), count, refused
        self.symbols = len(symbols)
        self._records_end = end

    def records(self):
        """The journaled (unique_id, symbol, features) in order, a list a chunk of the file at a time; a refused
        request's (unique_id, None, None)."""
        if not self.count:
            return
        try:
            with open(self.path, "rb") as f:  # up to those counted: the file may have grown since
                for chunk, _ in _chunks(f, self._records_at, self._records_end):
                    yield chunk
        except OSError as exc:
            raise JournalError(f"--journal {self.path}: cannot read it ({exc.strerror})") from None

    def begin(self, session_key: str | None) -> None:
        """Journal the session `session_key` (the welcome's, each connection's): go on appending where it is the
        one being written (a reconnect) or the one read (after its last whole record), else start the file afresh
        (its records forgotten). (A reconnect had started it afresh, or cut it back to where it was read.)"""
        with self._lock:
            if self.failed:  # set aside after a failed write: nothing more is journaled in this process
                return
            if self._file is not None:
                if session_key is not None and session_key == self.session_key:
                    return
                self._file.close()
                self._file = None
            go_on = session_key is not None and session_key == self.session_key and self.count > 0
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | (os.O_APPEND if go_on else os.O_TRUNC), 0o600)
                if go_on:
                    os.ftruncate(fd, self._records_end)  # a tail cut mid-record is dropped, not appended after
                self._file = os.fdopen(fd, "ab" if go_on else "wb", buffering=0)
                if not go_on:
                    self._file.write(MAGIC + json.dumps({**self.identity, "session_key": session_key}).encode()
                                     + b"\n")
                    self.count = self.refused = self.symbols = 0
            except OSError as exc:
                raise JournalError(f"--journal {self.path}: cannot write it ({exc.strerror})") from None
            self.session_key = session_key

    def append(self, requests) -> None:
        """Write (unique_id, symbol, features) of a step's answered requests, in its order, in one write()."""
        parts = []
        for uid, symbol, features in requests:
            name = symbol.encode()
            if len(name) >= _REFUSED:  # no record holds it (its length would read as a refusal's)
                self._cannot_hold(f"symbol {symbol[:20]!r}... is {len(name):,} bytes long")
                return
            try:
                head = _HEAD.pack(uid, len(name))
            except struct.error:  # a server may send any integer: msgpack's go to 2**64 - 1, JSON's further
                self._cannot_hold(f"unique_id {uid} is beyond int64")
                return
            parts += [head, name, np.asarray(features, "<f4").tobytes()]
        self._write(b"".join(parts))

    def refuse(self, unique_ids) -> None:
        """Write the unique_ids of requests refused (answered with an error, never stepped) in one write(): a
        restarted client refuses their resends again rather than step them."""
        unique_ids = list(unique_ids)
        try:
            records = b"".join(_HEAD.pack(uid, _REFUSED) for uid in unique_ids)
        except struct.error:  # (as in append): raised here, it ended the client's run()
            beyond = next(uid for uid in unique_ids if not -2**63 <= uid < 2**63)
            self._cannot_hold(f"unique_id {beyond} is beyond int64")
            return
        self._write(records)

    def _cannot_hold(self, what: str) -> None:
        """A request no record holds: journaling stops (left out, a restart would step it again, or miss its step)."""
        with self._lock:
            if self._file is not None:
                self._set_aside(f"{what}, more than a journal holds")

    def _write(self, records: bytes) -> None:
        if not records:
            return
        with self._lock:
            if self._file is None:
                return
            try:
                written = self._file.write(records)
                if written != len(records):  # (a disk filling up writes part of it, then fails the next write)
                    raise OSError(errno.ENOSPC, f"{written} of {len(records)} bytes written")
            except OSError as exc:
                self._set_aside(f"a write failed ({exc.strerror or exc})")

    def _set_aside(self, why: str) -> None:
        """A write failed (a full disk, an I/O error) or cannot be made: journaling stops for this process, which
        plays on, and the file is renamed PATH.incomplete, so that a restart neither replays a history missing its
        last steps (the states it rebuilt would be wrong, and said right) nor appends after a torn record. Before,
        the error escaped the step's answer: its answers never went out and the event loop's pump stopped (the
        session hung)."""
        self._file.close()
        self._file, self.failed = None, True
        aside = self.path + ".incomplete"
        try:
            os.replace(self.path, aside)
            where = f"set aside as {aside}; a restart begins a new journal"
        except OSError as rename:
            where = f"and it could not be set aside ({rename.strerror}): do not restart from it"
        log.error("--journal %s: %s; journaling stops, the session plays on without it: the journal is %s",
                  self.path, why, where)

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def check_file(path) -> None:
    """JournalError in one line where `path` holds something other than a journal (read its header only: said when
    the arguments are parsed, before the model loads)."""
    try:
        with open(path, "rb") as f:
            _read_header(f, path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise JournalError(f"--journal {path}: cannot read it ({exc.strerror})") from None


def _read_header(f, path) -> tuple[dict | None, int]:
    """(header, offset of the first record) of the journal open as `f`; (None, 0) for an empty file; JournalError for
    one that is not a journal."""
    head = f.read(len(MAGIC))
    if not head:
        return None, 0
    line = f.readline(1 << 20)
    if head != MAGIC or not line.endswith(b"\n"):
        raise JournalError(f"--journal {path}: not a team-client journal (give a new path, or remove the file)")
    try:
        header = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise JournalError(f"--journal {path}: its header is not JSON (give a new path, or remove the file)") from None
    return header, len(MAGIC) + len(line)


def _chunks(f, at: int, end: int | None = None, features: bool = True):
    """([(unique_id, symbol, features)], the offset after the last of them) for each READ_BYTES of the records from
    offset `at` up to offset `end` (None: the file's end), in order (features None unless `features`; a refused
    request's symbol and features None); a tail cut inside a record (the process killed mid-write) ends them."""
    f.seek(at)
    data = b""
    while more := f.read(READ_BYTES if end is None else min(READ_BYTES, end - at - len(data))):
        data += more
        records, used = [], 0
        while used + _HEAD.size <= len(data):
            uid, length = _HEAD.unpack_from(data, used)
            if length == _REFUSED:
                records.append((uid, None, None))
                used += _HEAD.size
                continue
            start = used + _HEAD.size + length
            stop = start + _FEATURE_BYTES
            if stop > len(data):
                break
            records.append((uid, data[used + _HEAD.size:start].decode(),
                            np.frombuffer(data, "<f4", NUM_FEATURES, start).copy() if features else None))
            used = stop
        at, data = at + used, data[used:]
        if records:
            yield records, at


@dataclass
class Replayed:
    """What replay() answered: the last `keep` answers in order, {unique_id: (prediction [4], symbol, features)} (the
    runtime's answer cache), and the ids answered before them (the runtime's ids whose answers left its cache); the
    last `keep_refused` ids refused, in order, {unique_id: None} (the runtime's _rejected_ids), and those refused
    before them (its _refused_long_ago, in `older` too); the `count` of requests replayed, answered or refused."""
    recent: OrderedDict = field(default_factory=OrderedDict)
    older: IdRanges = field(default_factory=IdRanges)
    refused: OrderedDict = field(default_factory=OrderedDict)
    refused_long_ago: IdBits = field(default_factory=IdBits)
    count: int = 0

    def __len__(self) -> int:
        return self.count


def replay(team_client, chunks, total: int, keep: int, max_batch=None, max_per_symbol=8,
           progress=sys.stderr, keep_refused=REFUSALS_KEPT) -> Replayed:
    """Step the journaled requests (`chunks`: lists of (unique_id, symbol, features) in journal order, `total` in
    all, Journal.records()) through the team client's process_batch, batched as the runtime's scheduler batches
    them (each symbol's in order), a chunk at a time, the refused ones never; what it answered, the last `keep`
    answers kept, and what was refused, the last `keep_refused` ids kept. A line of progress every second on
    `progress` (None: quiet)."""
    per_symbol = team_api.max_per_symbol(team_client, max_per_symbol)
    replayed, began, said = Replayed(), time.monotonic(), time.monotonic()
    steps, kept = deque(), 0  # (requests by id, [(unique_id, prediction)]) of the last steps: ~keep answers
    refusals = 0
    for chunk in chunks:
        scheduler = Scheduler()
        for uid, symbol, features in chunk:
            if symbol is not None:
                scheduler.push(Request(uid, symbol, features))
                continue
            # refused, never stepped (the old process never applied it): a resend is refused again
            refusals, replayed.count = refusals + 1, replayed.count + 1
            replayed.refused[uid] = None
            if len(replayed.refused) > keep_refused:  # as the runtime keeps them: the older ones a bit each
                aged = replayed.refused.popitem(last=False)[0]
                replayed.refused_long_ago.add(aged)
                replayed.older.add(aged)
        while len(scheduler):
            batch = scheduler.next_batch(max_batch, per_symbol, rows_for=lambda rows, _: min(rows, REPLAY_ROWS))
            answer = team_client.process_batch(team_api.batch_for(team_client, batch))
            by_id = {request.unique_id: request for request in batch}
            answered = [(uid, prediction) for uid, prediction in
                        zip(answer["unique_ids"], np.asarray(answer["predictions"], np.float32)) if uid in by_id]
            steps.append((by_id, answered))
            replayed.count, kept = replayed.count + len(answered), kept + len(answered)
            while steps and kept - len(steps[0][1]) >= keep:  # the oldest step's answers are older than the last keep
                _, old = steps.popleft()
                kept -= len(old)
                for uid, _ in old:
                    replayed.older.add(uid)
            if progress is not None and time.monotonic() - said >= 1.0:
                said = time.monotonic()
                refused = f", {refusals:,} of them refused: not stepped" if refusals else ""
                print(f"journal: replayed {replayed.count:,} of {total:,} requests{refused} "
                      f"({replayed.count / (said - began):,.0f}/s)", file=progress)
    for by_id, answered in steps:
        for uid, prediction in answered:
            if np.isfinite(prediction).all():
                replayed.recent[uid] = prediction, by_id[uid].symbol, by_id[uid].features
            else:  # answered with an error then: a resend is refused, never answered with NaN from the cache
                replayed.older.add(uid)
    while len(replayed.recent) > keep:
        replayed.older.add(replayed.recent.popitem(last=False)[0])
    return replayed
