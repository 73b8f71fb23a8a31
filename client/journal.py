"""The team client's journal: every request its steps answered, in the order they advanced the symbols' states.

A team client killed mid-session (kill -9, an out-of-memory kill, a reboot of its process) loses every symbol's
state; started again, it took its session back (the server resends what was unanswered) and answered from fresh
states, wrong for every symbol that had played (accuracy ~0.18 after, bench/LOG.md section 76). With a journal
(`team/example_model.py --journal PATH`) the new process first replays the journaled requests through its team
client, in their order and several of a symbol a step, which rebuilds each state exactly as the old process left
it, and answers a resent request it replayed from the replay's prediction rather than stepping it twice.

A request is written when its step's answer comes back, before the answer goes out: whatever the server saw
answered is in the journal, and whatever is not was never answered, so the server resends it to the new process.
Each step's requests are written in one write() (the operating system keeps it through a kill of the process; a
crash of the machine may lose the tail, which then reads as a shorter journal). A journal belongs to one session of
one server, team and weights: its header names them with the session key of the server's welcome, which the new
process presents to take its team back (the file is readable by its owner alone). It grows ~350 bytes a request
(~0.5 GB an hour at 400 requests/s); a new session of the server starts it afresh.

File: MAGIC, one JSON line (the header), then per request: unique_id (int64), the symbol's UTF-8 length (uint16)
and bytes, 79 float32 features, little-endian.
"""
import json
import os
import struct
import sys
import threading
import time

import numpy as np

from client import team_api
from client.constants import NUM_FEATURES
from client.scheduler import Request, Scheduler

MAGIC = b"team-client journal 1\n"
_HEAD = struct.Struct("<qH")
_FEATURE_BYTES = NUM_FEATURES * 4
REPLAY_ROWS = 4096  # requests a replay call hands the team client at most (the engine splits its own steps)


class JournalError(ValueError):
    """A journal that cannot be read or written, in one line."""


class Journal:
    """One session's journal at `path`: the requests read from it (`records`, [(unique_id, symbol, features)]) where
    its header names `identity` ({url, team, weights}: the server, team and weights of this client), and appending
    once begin() has named the session."""

    def __init__(self, path, identity: dict):
        self.path, self.identity = str(path), dict(identity)
        self.session_key: str | None = None
        self.records: list[tuple[int, str, np.ndarray]] = []
        self._file = None
        self._lock = threading.Lock()  # steps answer from the completer thread and the event loop
        try:
            with open(self.path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return
        except OSError as exc:
            raise JournalError(f"--journal {self.path}: cannot read it ({exc.strerror})") from None
        header, records = _parse(data, self.path)
        if header is not None and all(header.get(k) == v for k, v in self.identity.items()):
            self.session_key, self.records = header.get("session_key"), records

    def begin(self, session_key: str | None) -> None:
        """Journal the session `session_key` (the welcome's): go on appending where it is the one read, else start
        the file afresh (its records forgotten)."""
        with self._lock:
            if self._file is not None:
                self._file.close()
            go_on = session_key is not None and session_key == self.session_key and bool(self.records)
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | (os.O_APPEND if go_on else os.O_TRUNC), 0o600)
                self._file = os.fdopen(fd, "ab" if go_on else "wb", buffering=0)
                if not go_on:
                    self._file.write(MAGIC + json.dumps({**self.identity, "session_key": session_key}).encode()
                                     + b"\n")
                    self.records = []
            except OSError as exc:
                raise JournalError(f"--journal {self.path}: cannot write it ({exc.strerror})") from None
            self.session_key = session_key

    def append(self, requests) -> None:
        """Write (unique_id, symbol, features) of a step's answered requests, in its order, in one write()."""
        parts = []
        for uid, symbol, features in requests:
            name = symbol.encode()
            parts += [_HEAD.pack(uid, len(name)), name, np.asarray(features, "<f4").tobytes()]
        if not parts:
            return
        with self._lock:
            if self._file is not None:
                self._file.write(b"".join(parts))

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
            head = f.readline(len(MAGIC)) + f.readline(1 << 20)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise JournalError(f"--journal {path}: cannot read it ({exc.strerror})") from None
    _parse(head if head.endswith(b"\n") or not head else head + b"\n", path)


def _parse(data: bytes, path: str):
    """(header, records) of a journal's bytes; a tail cut inside a record (the process killed mid-write) ends it.
    (None, []) for an empty file; JournalError for one that is not a journal."""
    if not data:
        return None, []
    end = data.find(b"\n", len(MAGIC))
    if not data.startswith(MAGIC) or end < 0:
        raise JournalError(f"--journal {path}: not a team-client journal (give a new path, or remove the file)")
    try:
        header = json.loads(data[len(MAGIC):end])
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise JournalError(f"--journal {path}: its header is not JSON (give a new path, or remove the file)") from None
    records, at = [], end + 1
    while at + _HEAD.size <= len(data):
        uid, length = _HEAD.unpack_from(data, at)
        start, stop = at + _HEAD.size + length, at + _HEAD.size + length + _FEATURE_BYTES
        if stop > len(data):
            break
        records.append((uid, data[at + _HEAD.size:start].decode(), np.frombuffer(data[start:stop], "<f4").copy()))
        at = stop
    return header, records


def replay(team_client, records, max_batch=None, max_per_symbol=8, progress=sys.stderr) -> dict:
    """Step `records` ([(unique_id, symbol, features)], in journal order) through the team client's process_batch,
    batched as the runtime's scheduler batches them (each symbol's in order); {unique_id: prediction [4]} of those
    it answered. A line of progress every second on `progress` (None: quiet)."""
    scheduler = Scheduler()
    for uid, symbol, features in records:
        scheduler.push(Request(uid, symbol, features))
    per_symbol = team_api.max_per_symbol(team_client, max_per_symbol)
    answers, began, said = {}, time.monotonic(), time.monotonic()
    while len(scheduler):
        batch = scheduler.next_batch(max_batch, per_symbol, rows_for=lambda rows, _: min(rows, REPLAY_ROWS))
        answer = team_client.process_batch(team_api.batch_for(team_client, batch))
        answers.update(zip(answer["unique_ids"], np.asarray(answer["predictions"], np.float32)))
        if progress is not None and time.monotonic() - said >= 1.0:
            said = time.monotonic()
            print(f"journal: replayed {len(answers):,} of {len(records):,} requests "
                  f"({len(answers) / (said - began):,.0f}/s)", file=progress)
    return answers
