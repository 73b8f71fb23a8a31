"""The team client's journal: every request its steps answered, in the order they advanced the symbols' states, with
its answer, and every request it refused; beside it, each symbol's state checkpointed now and then.

A team client killed mid-session (kill -9, an out-of-memory kill, a reboot of its process) loses every symbol's
state; started again, it took its session back (the server resends what was unanswered) and answered from fresh
states, wrong for every symbol that had played (accuracy ~0.18 after, bench/LOG.md section 76). With a journal
(`team/example_model.py --journal PATH`) the new process first loads the states checkpointed, then replays the
journaled requests after them through its team client, in their order and several of a symbol a step, which
rebuilds each state exactly as the old process left it; a resent request it journaled is answered from the journal
(its answer), never stepped twice.

A request is written when its step's answer comes back, before the answer goes out: whatever the server saw answered
is in the journal, and whatever is not was never answered, so the server resends it to the new process. Each step's
requests are written in one write() (the operating system keeps it through a kill of the process; a crash of the
machine may lose the tail, which then reads as a shorter journal). A request the runtime refuses (answered with an
error, never stepped: a lost shard's symbol's, a malformed or non-finite one, one no tier could place, a failed
step's) is written as its id alone when it is refused, before the error goes out: the server resends it after a
restart, as every request not answered with a prediction, and the new process refuses it again ("rejected earlier")
instead of stepping it. A request whose step answered NaN is both: stepped, then refused. A symbol the team client
forgets as idle (the runtime's `idle_timeout_s`, `--idle-timeout` with `--journal`), or whose state a sharded engine
started afresh when its shard was lost (`--on-shard-loss reset`), is written as forgotten between its last request's
record on the old state and its next one's: the replay forgets it there too, and its next request starts afresh, as
it did.

Bounded (where the team client can export and import its states: team/example_model.py's can): the journal is
written in segments of SEGMENT_BYTES, PATH the one being written and PATH.part<N> the closed ones (N: the number of
their first record in the session). The runtime checkpoints the state of each symbol with records in a closed
segment, between steps, while none of its requests is in a step (client/state_checkpoints.py: after the journal's
first `covers` records, its own among them), and a closed segment goes once every record in it is covered and none
is among the last `keep` answered (the answers a restart keeps for the server's resends: the runtime's CACHE_SIZE).
So the journal holds at most ~3 segments (768 MiB) and a restart replays at most those; the states take what the
engine's states take (146 MiB a symbol in fp32), each written again once a segment (~30 minutes at 400 requests/s).
A team client that cannot export its states journals one segment for the session, ~366 bytes a request answered
(~0.5 GB an hour at 400 requests/s), and replays all of it.

A journal belongs to one session of one server, team and weights: each segment's header names them with the session
key of the server's welcome, which the new process presents to take its team back (the files are readable by their
owner alone). A new session of the server starts it afresh. A tail cut by a kill or a crash is cut off before the new
process appends (appended after it, the next read took the cut record's length for a symbol's and read garbage from
there on). It is read and replayed a chunk at a time: however long it is, a restart holds in memory only the answers
the runtime may resend (its answer cache), the refused ids it tells apart (its REFUSALS_KEPT) and the older ids as
ranges and bits. A write that fails (a full disk) stops journaling for the process, which plays on, and sets the
files aside as PATH.incomplete (its segments and states beside it).

A segment: MAGIC, one JSON line (the header: identity, session key, `first`), then per request answered: unique_id
(int64), the symbol's UTF-8 length (uint16) and bytes, 79 float32 features, the 4 float32 predictions answered; per
request refused: unique_id (int64) and the length 0xFFFF alone; per symbol forgotten: 0 (int64), the length 0xFFFE,
then the symbol's length (uint16) and bytes (no symbol is that long: one of 65534 bytes or more stops journaling, as
does a unique_id beyond int64); little-endian. A file of an older version (1: before answers were journaled, no
predictions, no `first`; 2: before forgotten symbols were) is read, and the session goes on in a new segment.
"""
import errno
import json
import logging
import os
import re
import shutil
import struct
import sys
import threading
import time

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from client import team_api
from client.constants import NUM_FEATURES, NUM_TOWERS
from client.engine.base import CapacityError
from client.engine.sharded import ShardLost
from client.id_ranges import IdBits, IdRanges
from client.runtime import CACHE_SIZE, REFUSALS_KEPT
from client.scheduler import Request, Scheduler
from client.state_checkpoints import CheckpointError, StateCheckpoints, as_json, sync_dir

log = logging.getLogger(__name__)
MAGIC = b"team-client journal 3\n"
MAGIC_V2 = b"team-client journal 2\n"  # no records of symbols forgotten
MAGIC_V1 = b"team-client journal 1\n"  # records without their answers
_VERSIONS = {MAGIC: 3, MAGIC_V2: 2, MAGIC_V1: 1}
_OTHER_VERSION = re.compile(rb"team-client journal ([0-9]+)")  # any version's MAGIC, its newline aside
_HEAD = struct.Struct("<qH")
_LENGTH = struct.Struct("<H")
_REFUSED = 0xFFFF  # the symbol's length of a refused request's record: its unique_id alone follows no symbol
_FORGOTTEN = 0xFFFE  # the symbol's length of a forgotten symbol's record: its length and name follow
_FEATURE_BYTES = NUM_FEATURES * 4
_PREDICTION_BYTES = NUM_TOWERS * 4
REPLAY_ROWS = 4096  # requests a replay call hands the team client at most (the engine splits its own steps)
RESTEPS = 3  # times a replay steps again the symbols whose shard was lost during it, before it gives up on them
READ_BYTES = 1 << 24  # read and replayed this much of the file at a time (~45,000 requests)
SEGMENT_BYTES = 256 << 20  # a segment closes past this (~730,000 requests, ~30 minutes at 400 requests/s)
_NUMBER = re.compile(r"[0-9]+")


class JournalError(ValueError):
    """A journal that cannot be read or written, in one line."""


class _Segment:
    """A segment file of the journal: its records from `first` on, `count` of them whole, read up to `end` (bytes)."""

    def __init__(self, path, first, version, records_at):
        self.path, self.first, self.version, self.records_at = str(path), first, version, records_at
        self.count, self.end = 0, records_at
        self.synced = False  # closed and on the disk (Journal._sync_segments)


class Journal:
    """One session's journal at `path`: where its header names `identity` ({url, team, weights}: the server, team and
    weights of this client), its `session_key`, the `count` of whole records held (read with records()), of them
    those `refused` and those of symbols `forgotten`, and the `symbols` of those answered when it was opened;
    appending once begin() has named the session. With `layout` (the team client's state_layout: it can export and
    import its states), segments and state checkpoints (`checkpoints`) bound it."""

    def __init__(self, path, identity: dict, layout=None, segment_bytes=SEGMENT_BYTES, keep=CACHE_SIZE):
        self.path, self.identity = str(path), dict(identity)
        self.layout, self.segment_bytes = layout, segment_bytes
        self.keep = keep  # the answers a restart keeps for the server's resends: none of them is let go
        self.session_key: str | None = None
        self.count = self.refused = self.forgotten = self.symbols = 0
        self.first = self.total = 0  # the number in the session of the first record held, and of the next one
        self._segments: list[_Segment] = []  # the closed ones, then the one written
        self._file = None
        self.failed = False  # a write failed: the files were set aside and nothing more is journaled (_set_aside)
        self.checkpoints_failed = False  # a state could not be exported or written: no more checkpoints
        self.checkpointed = self.dropped = 0  # states written, segments let go, by this process
        self._lock = threading.Lock()  # steps answer from the completer thread and the event loop
        self.checkpoints: StateCheckpoints | None = None
        # symbol -> the number of its first record no checkpoint covers, in that order (records come in order)
        self._dirty: OrderedDict[str, int] = OrderedDict()
        self._exporting: dict[str, int] = {}  # symbol -> its _dirty entry while its checkpoint is being made
        try:
            self._read()
        except OSError as exc:
            raise JournalError(f"--journal {self.path}: cannot read it ({exc.strerror})") from None
        except CheckpointError as exc:
            raise JournalError(f"--journal {self.path}: {exc}") from None

    def _parts(self, path=None) -> list[tuple[int, Path]]:
        """(number, path) of the files PATH.part<number> (or `path`.part<number>), in number order."""
        path = Path(path or self.path)
        prefix = path.name + ".part"
        return sorted((int(name[len(prefix):]), path.parent / name) for name in os.listdir(path.parent)
                      if name.startswith(prefix) and _NUMBER.fullmatch(name[len(prefix):]))

    def _read(self) -> None:
        parts = self._parts()
        # killed while closing a segment (PATH not created again, or created and its header not written yet): the
        # last one is written on
        if parts and (not os.path.exists(self.path) or os.path.getsize(self.path) == 0):
            os.replace(parts.pop()[1], self.path)
        try:
            f = open(self.path, "rb")
        except FileNotFoundError:
            return
        with f:
            header, version, records_at = _read_header(f, self.path)
        if header is None or any(header.get(k) != v for k, v in self.identity.items()):
            return
        self.session_key = header.get("session_key")
        segments = []
        for number, part in parts:
            with open(part, "rb") as f:
                part_header, part_version, part_at = _read_header(f, part)
            if part_header is not None and part_header.get("session_key") == self.session_key \
                    and all(part_header.get(k) == v for k, v in self.identity.items()):
                segments.append(_Segment(part, number, part_version, part_at))
        segments.append(_Segment(self.path, header.get("first", 0), version, records_at))
        if any(a.first > b.first for a, b in zip(segments, segments[1:])):
            raise JournalError(f"--journal {self.path}: its segments are out of order (remove them to begin afresh)")
        states = Path(self.path + ".states")
        if states.is_dir():
            self.checkpoints = StateCheckpoints(states, self.session_key)
        if segments[0].first > 0 and (self.checkpoints is None or self.checkpoints.layout is None):
            # its first segments went, covered by states not there (nor the ids of those segments)
            raise JournalError(f"--journal {self.path}: its first {segments[0].first:,} records were let go for the "
                               f"states checkpointed in {states}, which is not a folder of them (remove the journal "
                               "to begin afresh)")
        covers = self.checkpoints.covers if self.checkpoints is not None else {}
        symbols = set()
        for segment in segments:
            number = segment.first
            with open(segment.path, "rb") as f:
                for chunk, chunk_end in _chunks(f, segment.records_at, None, segment.version, features=False):
                    for uid, symbol, _, _ in chunk:
                        if symbol is None:
                            self.refused += 1
                        else:
                            if uid is None:
                                self.forgotten += 1
                            else:
                                symbols.add(symbol)
                            if number >= covers.get(symbol, 0) and symbol not in self._dirty:
                                self._dirty[symbol] = number
                        number += 1
                    segment.count += len(chunk)
                    segment.end = chunk_end
            if segment is not segments[-1] and number != segments[segments.index(segment) + 1].first:
                raise JournalError(f"--journal {self.path}: segment {segment.path} holds {segment.count} records "
                                   "where the next begins after another number (remove them to begin afresh)")
        self._segments = segments
        self.count, self.symbols = sum(s.count for s in segments), len(symbols)
        self.first, self.total = segments[0].first, segments[-1].first + segments[-1].count
        if max(covers.values(), default=0) > self.total:  # the records appended next would read as covered
            raise JournalError(f"--journal {self.path}: its states cover records it no longer holds (a crash of the "
                               "machine cut its tail): remove the journal to begin afresh")

    @property
    def replayable(self) -> bool:
        """Whether a restart has anything to load or replay."""
        return bool(self.count or self.checkpoints is not None and self.checkpoints.covers)

    def records(self):
        """The journaled (unique_id, symbol, features, prediction) in order, from the session's record `first` on, a
        list a chunk of a file at a time; a refused request's (unique_id, None, None, None); a prediction of a
        version 1 file's None."""
        try:
            for segment in self._segments:  # up to those counted: the file written may have grown since
                if segment.count:
                    with open(segment.path, "rb") as f:
                        for chunk, _ in _chunks(f, segment.records_at, segment.end, segment.version):
                            yield chunk
        except OSError as exc:
            raise JournalError(f"--journal {self.path}: cannot read it ({exc.strerror})") from None

    def begin(self, session_key: str | None) -> None:
        """Journal the session `session_key` (the welcome's, each connection's): go on appending where it is the
        one being written (a reconnect) or the one read (after its last whole record, in a new segment after a
        version 1 file), else start afresh (its records, segments and states forgotten)."""
        with self._lock:
            if self.failed:  # set aside after a failed write: nothing more is journaled in this process
                return
            if self._file is not None:
                if session_key is not None and session_key == self.session_key:
                    return
                self._file.close()
                self._file = None
            go_on = session_key is not None and session_key == self.session_key and (
                self.count > 0 or self.checkpoints is not None and self.checkpoints.covers)
            try:
                if not go_on:
                    self._start_afresh(session_key)
                elif self._segments[-1].version != 3:  # an older version's records: the next in a segment of their own
                    os.truncate(self.path, self._segments[-1].end)
                    self._close_segment()
                else:
                    fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
                    os.ftruncate(fd, self._segments[-1].end)  # a tail cut mid-record is dropped, not appended after
                    self._file = os.fdopen(fd, "ab", buffering=0)
                if go_on and self.layout is not None and self.checkpoints is None:
                    self.checkpoints = StateCheckpoints(self.path + ".states", session_key)
                    self.checkpoints.start(session_key, self.layout)
                elif go_on and self.layout is not None and self.checkpoints.layout != as_json(self.layout):
                    if self.checkpoints.covers:  # (replay() said so before)
                        raise JournalError(f"--journal {self.path}: its states are in another layout than this "
                                           "engine's: restart with the options they were written with")
                    self.checkpoints.name_layout(self.layout)  # none written yet: this engine's from here on
            except OSError as exc:  # (a full disk): as any failed write, not an error that ends the client's run
                self._set_aside(f"it could not be begun ({exc.strerror or exc})")
                return
            self.session_key = session_key

    def end_session(self) -> None:
        """The team client's states were dropped for a new stream: the next begin() starts the journal afresh, even
        where the server's welcome names the same session key (its records would replay the old stream's states
        onto the new one)."""
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
            self.session_key = None

    def _start_afresh(self, session_key) -> None:
        # The new session's first segment replaces PATH whole before the old one's files go: killed in between, a
        # restart reads the new session and passes over the old parts and states (another session's). Removed
        # first, a kill left the old session's head segment without the parts before it, replayed as if whole.
        self._segments = []
        self.count = self.refused = self.forgotten = self.symbols = self.first = self.total = 0
        self._dirty.clear()
        self._exporting.clear()
        self.checkpoints_failed = False  # a state the old session's could not write stops no checkpoint of this one
        self._open_segment(session_key, 0, os.O_TRUNC, at=self.path + ".new")
        os.replace(self.path + ".new", self.path)
        for part in self._parts():
            os.remove(part[1])
        states = self.path + ".states"
        if self.layout is not None:
            self.checkpoints = StateCheckpoints(states, session_key)
            self.checkpoints.start(session_key, self.layout)
        else:
            self.checkpoints = None
            shutil.rmtree(states, ignore_errors=True)

    def _open_segment(self, session_key, first, mode, at=None) -> None:
        """Open PATH as a new segment whose first record is `first` (with `mode` O_TRUNC, or O_EXCL); `at`: the file
        to write it in, renamed PATH by the caller."""
        fd = os.open(at or self.path, os.O_WRONLY | os.O_CREAT | mode, 0o600)
        self._file = os.fdopen(fd, "wb", buffering=0)
        head = MAGIC + json.dumps({**self.identity, "session_key": session_key, "first": first}).encode() + b"\n"
        self._file.write(head)
        self._segments.append(_Segment(self.path, first, 3, len(head)))

    def _close_segment(self) -> None:
        """PATH becomes PATH.part<first> and a new segment begins at PATH (killed between the two, the next read
        takes the part back as PATH)."""
        written = self._segments[-1]
        if self._file is not None:
            self._file.close()
            self._file = None
        written.path = f"{self.path}.part{written.first}"
        os.replace(self.path, written.path)
        self._open_segment(self.session_key, self.total, os.O_EXCL)

    def append(self, requests, predictions=None) -> None:
        """Write (unique_id, symbol, features) of a step's answered requests, in its order, each with its row of
        `predictions` (None: NaN, as a request answered with an error), in one write()."""
        parts = []
        rows = np.full((0, NUM_TOWERS), np.nan, "<f4") if predictions is None else np.asarray(predictions, "<f4")
        symbols = []
        for row, (uid, symbol, features) in enumerate(requests):
            name = symbol.encode()
            if len(name) >= _FORGOTTEN:  # no record holds it (its length would read as a refusal's or a forget's)
                self._cannot_hold(f"symbol {symbol[:20]!r}... is {len(name):,} bytes long")
                return
            try:
                head = _HEAD.pack(uid, len(name))
            except struct.error:  # a server may send any integer: msgpack's go to 2**64 - 1, JSON's further
                self._cannot_hold(f"unique_id {uid} is beyond int64")
                return
            answer = rows[row].tobytes() if row < len(rows) else _NO_ANSWER
            parts += [head, name, np.asarray(features, "<f4").tobytes(), answer]
            symbols.append(symbol)
        self._write(b"".join(parts), symbols)

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
        self._write(records, [None] * len(unique_ids))

    def forget(self, symbols) -> None:
        """Write that the team client forgot these symbols' states (idle: the runtime's idle_timeout_s; or lost with
        their shard and started afresh: --on-shard-loss reset) after their requests journaled so far, in one write():
        a replay forgets them there too, and their next requests start afresh as they did."""
        records = []
        for symbol in symbols:
            name = symbol.encode()
            if len(name) >= _FORGOTTEN:
                self._cannot_hold(f"symbol {symbol[:20]!r}... is {len(name):,} bytes long")
                return
            records += [_HEAD.pack(0, _FORGOTTEN), _LENGTH.pack(len(name)), name]
        self._write(b"".join(records), list(symbols), forgotten=True)

    def _cannot_hold(self, what: str) -> None:
        """A request no record holds: journaling stops (left out, a restart would step it again, or miss its step)."""
        with self._lock:
            if self._file is not None:
                self._set_aside(f"{what}, more than a journal holds")

    def _write(self, records: bytes, symbols, forgotten=False) -> None:
        if not records:
            return
        with self._lock:
            if self._file is None:
                return
            try:
                written = self._file.write(records)
                if written != len(records):  # (a disk filling up writes part of it, then fails the next write)
                    raise OSError(errno.ENOSPC, f"{written} of {len(records)} bytes written")
                segment = self._segments[-1]
                segment.end += written
                segment.count += len(symbols)
                self.count += len(symbols)
                self.refused += symbols.count(None)
                self.forgotten += len(symbols) if forgotten else 0
                for symbol in symbols:
                    if symbol is not None and symbol not in self._dirty:
                        self._dirty[symbol] = self.total
                    self.total += 1
                if self.checkpoints is not None and segment.end >= self.segment_bytes:
                    self._close_segment()
            except OSError as exc:
                self._set_aside(f"a write failed ({exc.strerror or exc})")

    # ---- checkpoints (the runtime's, between steps) ------------------------------------------------------------
    def checkpoint_due(self) -> bool:
        """Whether a closed segment waits for a symbol's checkpoint, or the oldest can go (cheap: asked after every
        step)."""
        if self.checkpoints is None or len(self._segments) < 2 or self.failed or self.checkpoints_failed:
            return False
        with self._lock:
            return self._due()

    def droppable(self) -> bool:
        """Whether the oldest closed segment can go (drop_covered)."""
        with self._lock:
            return self._droppable()

    def _due(self) -> bool:
        """Whether a record of a closed segment is not covered, or the oldest closed segment can go (holding the
        lock)."""
        return len(self._segments) >= 2 and (bool(self._dirty) and next(iter(self._dirty.values()))
                                             < self._segments[-1].first or self._droppable())

    def begin_checkpoint(self, busy) -> tuple[str, int] | None:
        """(symbol, covers): the symbol to checkpoint next, none of whose requests is in a step (`busy`: the symbols
        that have some), whose state after the journal's first `covers` records the runtime exports now; None if no
        closed segment waits for one."""
        with self._lock:
            if self.checkpoints is None or self.failed or self.checkpoints_failed or not self._due():
                return None
            closed_end = self._segments[-1].first
            for symbol, number in self._dirty.items():
                if number >= closed_end:
                    return None
                if symbol not in busy:
                    self._exporting[symbol] = self._dirty.pop(symbol)
                    return symbol, self.total
            return None

    def checkpoint_waiting(self) -> str | None:
        """The symbol a closed segment has waited for longest (its oldest record not covered), or None."""
        with self._lock:
            if self.checkpoints is None or self.failed or self.checkpoints_failed or len(self._segments) < 2:
                return None
            symbol, number = next(iter(self._dirty.items()), (None, None))
            return symbol if number is not None and number < self._segments[-1].first else None

    def end_checkpoint(self, symbol: str, covers: int, state=None, failed: str | None = None) -> None:
        """Write the state exported of `symbol` (a uint8 array; None: the engine held none) as covering the first
        `covers` records, then let go the segments now covered; or, `failed` (why), keep its records needed. Called
        off the event loop (it writes and syncs the state's bytes)."""
        if failed is None:
            try:
                self._sync_segments()
                self.checkpoints.write(symbol, covers, state)
                self.checkpointed += 1
            except OSError as exc:
                failed = f"its file could not be written ({exc.strerror or exc})"
        with self._lock:
            number = self._exporting.pop(symbol)
            if failed is not None:  # its records stay needed: before any of its records since, in number order
                log.error("--journal %s: the state of %s was not checkpointed: %s; checkpoints stop, the journal "
                          "keeps every record from here on", self.path, symbol, failed)
                self._dirty[symbol] = min(number, self._dirty.get(symbol, number))
                self._dirty = OrderedDict(sorted(self._dirty.items(), key=lambda item: item[1]))
                self.checkpoints_failed = True  # (tried again after each step, a full disk took a state's write each)
        if failed is None:
            self.drop_covered()

    def _sync_segments(self) -> None:
        """The journal's records on the disk before a state that covers them is: a crash of the machine loses the
        page cache's tail, and a state ahead of the journal took the records numbered again after it for its own."""
        with self._lock:  # (opened under it: no segment is renamed or deleted meanwhile)
            segments = [(segment, os.open(segment.path, os.O_RDONLY)) for segment in self._segments
                        if not segment.synced]
            written = self._segments[-1]
        try:
            for segment, fd in segments:
                os.fsync(fd)
                segment.synced = segment is not written  # a closed one changes no more
        finally:
            for _, fd in segments:
                os.close(fd)
        if segments:  # and their names: a segment closed (renamed PATH.part<first>) and the next created since
            sync_dir(os.path.dirname(os.path.abspath(self.path)))

    def _droppable(self) -> bool:
        """Whether the oldest closed segment can go: every record of it covered, and none among the last `keep`
        (called holding the lock)."""
        if len(self._segments) < 2:
            return False
        end = self._segments[1].first
        needed = min(self._exporting.values(), default=self.total)
        if self._dirty:
            needed = min(needed, next(iter(self._dirty.values())))
        return needed >= end and end <= self.total - self.keep

    def drop_covered(self) -> None:
        """Let go each oldest closed segment that every checkpoint covers: its ids kept (the answered ones as
        ranges, the refused ones by id) before it is deleted. Called off the event loop (it reads the segment)."""
        while True:
            with self._lock:
                if self.failed or self.checkpoints_failed or not self._droppable():
                    return
                segment = self._segments[0]
            answered, refused, forgotten = [], [], 0
            try:
                with open(segment.path, "rb") as f:
                    for chunk, _ in _chunks(f, segment.records_at, segment.end, segment.version, features=False):
                        for uid, symbol, _, _ in chunk:
                            if uid is not None:  # (a forgotten symbol's record holds no request)
                                (refused if symbol is None else answered).append(uid)
                            else:
                                forgotten += 1
                self.checkpoints.add_gone(answered, refused)
            except (OSError, CheckpointError) as exc:  # said once: raised, the runtime's thread lost it each step
                with self._lock:
                    self.checkpoints_failed = True
                log.error("--journal %s: segment %s could not be let go (%s); checkpoints stop, the journal keeps "
                          "every record from here on", self.path, segment.path, getattr(exc, "strerror", None) or exc)
                return
            with self._lock:
                os.remove(segment.path)
                self._segments.pop(0)
                self.dropped += 1
                self.count -= segment.count
                self.refused -= len(refused)
                self.forgotten -= forgotten
                self.first = self._segments[0].first

    def _set_aside(self, why: str) -> None:
        """A write failed (a full disk, an I/O error) or cannot be made: journaling stops for this process, which
        plays on, and the files are renamed PATH.incomplete (its segments and states beside it), so that a restart
        neither replays a history missing its last steps (the states it rebuilt would be wrong, and said right) nor
        appends after a torn record. Before, the error escaped the step's answer: its answers never went out and the
        event loop's pump stopped (the session hung)."""
        if self._file is not None:  # (None where the next segment could not be created)
            self._file.close()
        self._file, self.failed = None, True
        aside = self.path + ".incomplete"
        try:
            if os.path.exists(self.path + ".new"):  # a new session's first segment, not begun
                os.remove(self.path + ".new")
            for _, part in self._parts(aside):  # a journal set aside before: read with this one's, it mixed them
                os.remove(part)
            # The states first, then the segments oldest first, PATH last: killed at any point, a restart reads
            # the whole journal without states (replayed from the start) or refuses one that lacks its first records.
            # The segments first, it replayed the states and a journal short of its first segments, unsaid.
            if os.path.isdir(self.path + ".states"):
                shutil.rmtree(aside + ".states", ignore_errors=True)
                os.replace(self.path + ".states", aside + ".states")
            for segment in self._segments:  # by their paths: the last one closed where the next could not be opened
                if segment.path != self.path:
                    os.replace(segment.path, f"{aside}.part{segment.first}")
            if os.path.exists(self.path):
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


_NO_ANSWER = np.full(NUM_TOWERS, np.nan, "<f4").tobytes()


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


def _read_header(f, path) -> tuple[dict | None, int, int]:
    """(header, version, offset of the first record) of the journal's segment open as `f`; (None, 3, 0) for an empty
    file; JournalError for one that is not a journal."""
    head = f.read(len(MAGIC))
    if not head:
        return None, 3, 0
    line = f.readline(1 << 20)
    magic, ended, _ = (head + line).partition(b"\n")
    other = _OTHER_VERSION.fullmatch(magic) if ended and head not in _VERSIONS else None  # (not one cut short)
    if other:  # an older client restarted on a newer one's journal
        raise JournalError(f"--journal {path}: a journal of version {other[1].decode()}, which this team client "
                           f"cannot read (it reads versions 1 to {_VERSIONS[MAGIC]}): restart the team client that "
                           "wrote it, or give a new path")
    if head not in _VERSIONS or not line.endswith(b"\n"):
        raise JournalError(f"--journal {path}: not a team-client journal (give a new path, or remove the file)")
    try:
        header = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise JournalError(f"--journal {path}: its header is not JSON (give a new path, or remove the file)") from None
    return header, _VERSIONS[head], len(MAGIC) + len(line)


def _chunks(f, at: int, end: int | None = None, version: int = 3, features: bool = True):
    """([(unique_id, symbol, features, prediction)], the offset after the last of them) for each READ_BYTES of the
    records from offset `at` up to offset `end` (None: the file's end), in order (features and predictions None
    unless `features`; a refused request's symbol, features and prediction None; a forgotten symbol's unique_id,
    features and prediction None; a version 1 file's predictions None); a tail cut inside a record (the process
    killed mid-write) ends them."""
    answer_bytes = _PREDICTION_BYTES if version >= 2 else 0
    f.seek(at)
    data = b""
    while more := f.read(READ_BYTES if end is None else min(READ_BYTES, end - at - len(data))):
        data += more
        records, used = [], 0
        while used + _HEAD.size <= len(data):
            uid, length = _HEAD.unpack_from(data, used)
            if length == _REFUSED:
                records.append((uid, None, None, None))
                used += _HEAD.size
                continue
            if length == _FORGOTTEN and version >= 3:
                start = used + _HEAD.size + _LENGTH.size
                if start > len(data):
                    break
                stop = start + _LENGTH.unpack_from(data, used + _HEAD.size)[0]
                if stop > len(data):
                    break
                records.append((None, data[start:stop].decode(), None, None))
                used = stop
                continue
            start = used + _HEAD.size + length
            stop = start + _FEATURE_BYTES + answer_bytes
            if stop > len(data):
                break
            symbol = data[used + _HEAD.size:start].decode()
            if features:
                answer = np.frombuffer(data, "<f4", NUM_TOWERS, start + _FEATURE_BYTES).copy() if answer_bytes else None
                records.append((uid, symbol, np.frombuffer(data, "<f4", NUM_FEATURES, start).copy(), answer))
            else:
                records.append((uid, symbol, None, None))
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
    stepped: int = 0  # of them, those stepped through the team client (not covered by a state loaded)
    held: list = field(default_factory=list)  # the symbols whose states the team client holds after it

    def __len__(self) -> int:
        return self.count


def replay(team_client, journal: Journal, keep: int, max_batch=None, max_per_symbol=8, progress=sys.stderr,
           keep_refused=REFUSALS_KEPT) -> Replayed:
    """Load the journal's checkpointed states into the team client (import_state), then step the journaled requests
    after them (Journal.records(): each symbol's records its state covers are answered with the answers journaled)
    through its process_batch, batched as the runtime's scheduler batches them (each symbol's in order), a chunk at
    a time, the refused ones never; what it answered, the last `keep` answers kept, and what was refused, the last
    `keep_refused` ids kept. A line of progress every second on `progress` (None: quiet). A request the team client
    refuses on replay (an error in its answer: tiers too small for the session, say) is counted among the refused,
    with a warning that names its symbols (their states miss it)."""
    per_symbol = team_api.max_per_symbol(team_client, max_per_symbol)
    replayed, began, said = Replayed(), time.monotonic(), time.monotonic()
    losses = len(_losses(team_client))
    # the records each symbol's loaded state covers; the symbols whose states the team client holds now
    covers, held = _load_states(team_client, journal, replayed, keep_refused, progress)
    gone = replayed.count  # the ids of deleted segments: none of the journal's records, none replayed now
    steps, kept = deque(), 0  # (requests by id, [(unique_id, prediction)]) of the last steps: ~keep answers
    refusals, number = 0, journal.first
    lost, why = {}, None  # {symbol: requests the team client refused on replay}, the first refusal's reason
    lost_states = {}  # {symbol: None} started afresh mid-replay (its shard lost, --on-shard-loss reset)

    def started_afresh():
        """Those of lost_states, and the symbols of the team client's engine's shards lost since, for a reset."""
        nonlocal losses
        lost = _losses(team_client)
        lost_states.update(dict.fromkeys(symbol for loss in lost[losses:] if loss.get("policy") == "reset"
                                         for symbol in loss.get("symbols", ())))
        losses = len(lost)
        return list(lost_states)

    def answered(by_id, answers):
        nonlocal kept
        steps.append((by_id, answers))
        replayed.count, kept = replayed.count + len(answers), kept + len(answers)
        while steps and kept - len(steps[0][1]) >= keep:  # the oldest step's answers are older than the last keep
            _, old = steps.popleft()
            kept -= len(old)
            for uid, _ in old:
                replayed.older.add(uid)

    def step(scheduler):
        """Step every request queued, as the runtime's scheduler batches them."""
        nonlocal said, why
        for batch, answer in _steps(team_client, scheduler, max_batch, per_symbol):
            by_id = {request.unique_id: request for request in batch}
            lost_states.update(_restarted(answer, by_id))
            answered(by_id, [(uid, prediction) for uid, prediction in
                             zip(answer["unique_ids"], np.asarray(answer["predictions"], np.float32)) if uid in by_id])
            for uid, reason in (answer.get("errors") or {}).items():
                if (uid := int(uid)) in by_id:  # answered then, refused now (no room, say): a resend is refused
                    replayed.count += 1
                    _refused(replayed, uid, keep_refused)
                    lost[by_id[uid].symbol] = lost.get(by_id[uid].symbol, 0) + 1
                    why = why or reason
            replayed.stepped += len(batch)
            held.update(dict.fromkeys(by_id[uid].symbol for uid in by_id))
            if progress is not None and time.monotonic() - said >= 1.0:
                said = time.monotonic()
                refused = f", {refusals:,} of them refused: not stepped" if refusals else ""
                done = replayed.count - gone
                print(f"journal: replayed {done:,} of {journal.count - journal.forgotten:,} "
                      f"requests{refused} ({done / (said - began):,.0f}/s)", file=progress)

    for chunk in journal.records():
        scheduler, covered = Scheduler(), {}
        for uid, symbol, features, prediction in chunk:
            number += 1
            if symbol is None:  # refused, never stepped (the old process never applied it): a resend is refused again
                refusals, replayed.count = refusals + 1, replayed.count + 1
                _refused(replayed, uid, keep_refused)
            elif number - 1 < covers.get(symbol, 0):  # in its state loaded: answered as journaled (or forgotten)
                if uid is not None:
                    covered[uid] = Request(uid, symbol, features), prediction
            elif uid is None:  # forgotten as idle there: its requests before step first, those after afresh
                if scheduler.has(symbol):
                    step(scheduler)
                _forget(team_client, journal, symbol)
                held.pop(symbol, None)
            else:
                scheduler.push(Request(uid, symbol, features))
        if covered:
            answered({uid: request for uid, (request, _) in covered.items()},
                     [(uid, prediction) for uid, (_, prediction) in covered.items()])
        step(scheduler)
    for _ in range(RESTEPS):  # their states missed the records before: each stepped again through all of its own
        again = started_afresh()
        if not again:
            break
        if progress is not None:
            print(f"journal: stepping the records of {len(again):,} symbols again, started afresh mid-replay "
                  f"(their shard lost)", file=progress)
        lost_states = _restep(team_client, journal, again, covers, max_batch, per_symbol)
    if started_afresh():
        log.warning("journal %s: %d symbols were started afresh during the replay %d times (their shards lost): "
                    "their states miss the records before", journal.path, len(lost_states), RESTEPS + 1)
    replayed.held = list(held)
    for by_id, answers in steps:
        for uid, prediction in answers:
            if prediction is not None and np.isfinite(prediction).all():
                replayed.recent[uid] = prediction, by_id[uid].symbol, by_id[uid].features
            else:  # answered with an error then: a resend is refused, never answered with NaN from the cache
                replayed.older.add(uid)
    while len(replayed.recent) > keep:
        replayed.older.add(replayed.recent.popitem(last=False)[0])
    if lost:
        named = ", ".join(list(lost)[:5]) + (", ..." if len(lost) > 5 else "")
        log.warning("journal %s: %d of its requests (%d symbols: %s) were refused on replay (%s): those symbols' "
                    "states miss them, and a resend of one is refused; restart with room for every symbol of the "
                    "session (--state-memory, --host-symbols)", journal.path, sum(lost.values()), len(lost), named,
                    why)
    return replayed


def _steps(team_client, scheduler, max_batch, per_symbol):
    """Step every request queued, as the runtime's scheduler batches them: (batch, answer) of each step."""
    while len(scheduler):
        batch = scheduler.next_batch(max_batch, per_symbol, rows_for=lambda rows, _: min(rows, REPLAY_ROWS))
        yield batch, team_client.process_batch(team_api.batch_for(team_client, batch))


def _restarted(answer, by_id) -> dict:
    """{symbol: None} of the requests of `by_id` whose states the team client started afresh with this step."""
    return dict.fromkeys(by_id[uid].symbol for uid in answer.get("restarted") or () if uid in by_id)


def _restep(team_client, journal: Journal, symbols, covers, max_batch, per_symbol) -> dict:
    """Step `symbols` again from their checkpointed states (or afresh) through each of their records after them,
    the answers already taken aside: the team client started them afresh mid-replay, and the records before are
    missing from their states (no forget record can say where: the journal goes on at its end). Returns the symbols
    started afresh again."""
    for symbol in symbols:
        _forget(team_client, journal, symbol)
        state = _checkpointed(journal, symbol) if covers.get(symbol) else None
        if state is not None:
            _import(team_client, journal, symbol, state)
    only, again, number = set(symbols), {}, journal.first

    def step(scheduler):
        for batch, answer in _steps(team_client, scheduler, max_batch, per_symbol):
            again.update(_restarted(answer, {request.unique_id: request for request in batch}))

    for chunk in journal.records():
        scheduler = Scheduler()
        for uid, symbol, features, _ in chunk:
            number += 1
            if symbol not in only or number - 1 < covers.get(symbol, 0):
                continue
            if uid is None:  # forgotten there
                step(scheduler)
                _forget(team_client, journal, symbol)
            else:
                scheduler.push(Request(uid, symbol, features))
        step(scheduler)
    return again


def _losses(team_client) -> list:
    """The losses of the team client's engine so far (client/engine/base.py: a sharded engine's shards lost)."""
    return list(getattr(getattr(team_client, "engine", None), "losses", None) or ())


def _import(team_client, journal: Journal, symbol, state) -> None:
    """import_state, once more where the symbol's shard is lost under it (--on-shard-loss reset places it anew)."""
    try:
        team_client.import_state(symbol, state)
    except ShardLost:
        try:
            team_client.import_state(symbol, state)
        except ShardLost as exc:
            raise JournalError(f"--journal {journal.path}: the state of {symbol} could not be loaded ({exc})") from None


def _checkpointed(journal: Journal, symbol: str):
    """The state checkpointed of `symbol` (a uint8 array, or None: none held), or JournalError in one line."""
    try:
        return journal.checkpoints.load(symbol)
    except CheckpointError as exc:
        raise JournalError(f"--journal {journal.path}: {exc}") from None


def _forget(team_client, journal: Journal, symbol: str) -> None:
    release = getattr(team_client, "release", None)
    if not callable(release):
        raise JournalError(f"--journal {journal.path}: its records forget symbols (idle, or lost with a shard), and "
                           "this team client cannot forget a symbol (release): use the team client that wrote it")
    release([symbol])


def _refused(replayed: Replayed, uid: int, keep_refused: int) -> None:
    replayed.refused[uid] = None
    if len(replayed.refused) > keep_refused:  # as the runtime keeps them: the older ones a bit each
        aged = replayed.refused.popitem(last=False)[0]
        replayed.refused_long_ago.add(aged)
        replayed.older.add(aged)


def _load_states(team_client, journal: Journal, replayed: Replayed, keep_refused: int,
                 progress) -> tuple[dict, dict]:
    """Import the journal's checkpointed states into the team client, and the ids of its deleted segments into
    `replayed`; the records each symbol's state covers ({symbol: covers}), and the symbols whose states the team
    client holds now ({symbol: None}: not those checkpointed as holding none, forgotten as idle, say)."""
    checkpoints = journal.checkpoints
    if checkpoints is None:
        return {}, {}
    _load_gone(journal, replayed, keep_refused)  # (segments of refused requests alone go without a state)
    if not checkpoints.covers:
        return {}, {}
    layout = team_api.state_layout(team_client)
    if layout is None:
        raise JournalError(f"--journal {journal.path}: its states are checkpointed, and this team client cannot "
                           "import states (state_layout, import_state): use the team client that wrote them")
    try:
        checkpoints.check_layout(layout)
    except CheckpointError as exc:
        raise JournalError(f"--journal {journal.path}: {exc}") from None
    if progress is not None:
        print(f"journal: loading the checkpointed states of {len(checkpoints.covers):,} symbols "
              f"({checkpoints.bytes / 2**30:.2f} GiB)", file=progress)
    held = {}
    for symbol in checkpoints.covers:
        state = _checkpointed(journal, symbol)
        if state is not None:
            try:
                _import(team_client, journal, symbol, state)
            except CapacityError as exc:  # (its records covered may be gone: they cannot be stepped instead)
                raise JournalError(f"--journal {journal.path}: the states checkpointed of "
                                   f"{len(checkpoints.covers):,} symbols do not fit this engine's tiers ({exc}): "
                                   "restart with room for every symbol of the session") from None
            held[symbol] = None
    return checkpoints.covers, held


def _load_gone(journal: Journal, replayed: Replayed, keep_refused: int) -> None:
    """The ids of the journal's deleted segments into `replayed`."""
    try:
        starts, ends, refused = journal.checkpoints.gone()
    except CheckpointError as exc:
        raise JournalError(f"--journal {journal.path}: {exc}") from None
    for start, end in zip(starts.tolist(), ends.tolist()):
        replayed.older.add_range(start, end)
    for uid in refused.tolist():
        replayed.count += 1
        _refused(replayed, uid, keep_refused)
    replayed.count += int((ends - starts).sum())
