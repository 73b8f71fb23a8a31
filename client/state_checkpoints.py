"""Each symbol's state, checkpointed beside the team client's journal (client/journal.py), so that a restart loads
the states and replays only the journal's records after them, and the journal's older segments can go.

In the directory PATH.states (PATH the journal's):
- `layout.json`: the engine's state_layout (client/engine/base.py), which every state here is in; a restart whose
  engine lays its states out otherwise cannot load them (one line);
- a file a symbol (named by its name's hash): its state's bytes after the journal's first `covers` records (all of
  its requests among them were applied, none after), or no bytes where the engine held no state of it then (it had
  been forgotten as idle: its next request starts afresh);
- `gone.npz`: the unique ids of the records in the journal's deleted segments, those answered as ranges and those
  refused one by one, which a restart still tells apart (a resend of one is refused, never stepped).
Each file is written whole to a temporary name, synced, then renamed over the old one (the directory synced too):
a kill or a crash leaves the old file or the new one, never part of one, and a segment is deleted only after the
states that cover it are on the disk, each written only after the journal's records it covers are (synced).
"""
import hashlib
import io
import json
import os
import shutil
from pathlib import Path

import numpy as np

STATE_MAGIC = b"team-client state 1\n"
LAYOUT, GONE = "layout.json", "gone.npz"


class CheckpointError(ValueError):
    """Checkpoints that cannot be read, written or loaded, in one line."""


class StateCheckpoints:
    """The checkpoints of one journal's session `session_key` in `directory`: `covers` {symbol: the journal's records
    its state covers}, the `layout` they are in (None: none written yet)."""

    def __init__(self, directory, session_key):
        self.dir, self.session_key = Path(directory), session_key
        self.covers: dict[str, int] = {}
        self.layout = None
        self._sizes: dict[str, int] = {}  # symbol -> its state's bytes
        if not self.dir.is_dir():
            return
        try:
            layout_file = self.dir / LAYOUT
            if layout_file.exists():
                saved = json.loads(layout_file.read_text())
                if saved.get("session_key") != session_key:
                    return  # another session's: begin() clears them
                self.layout = saved["layout"]
            for path in self.dir.glob("*.state"):
                header, _ = _read_state_header(path)
                if header["session_key"] == session_key:
                    self.covers[header["symbol"]] = header["covers"]
                    self._sizes[header["symbol"]] = header["bytes"]
        except (OSError, ValueError, KeyError) as exc:
            raise CheckpointError(f"the journal's state checkpoints in {self.dir} cannot be read ({exc}): remove "
                                  f"the journal and {self.dir} to begin afresh") from None

    def start(self, session_key, layout) -> None:
        """Begin the checkpoints of a new session in `layout`: every file of another one removed."""
        if self.dir.exists():
            shutil.rmtree(self.dir)
        self.dir.mkdir(mode=0o700)
        self.session_key, self.covers, self._sizes = session_key, {}, {}
        self.name_layout(layout)

    def name_layout(self, layout) -> None:
        """The states written from now on are in `layout` (none is held: a restart's engine lays them out otherwise
        than the one before, which wrote none)."""
        _write_whole(self.dir / LAYOUT, json.dumps({"session_key": self.session_key, "layout": layout}).encode())
        self.layout = as_json(layout)

    def check_layout(self, layout) -> None:
        """CheckpointError in one line where the states held are in another layout than `layout` (the engine's)."""
        if self.covers and self.layout != as_json(layout):
            raise CheckpointError(f"the journal's state checkpoints in {self.dir} were written by an engine that lays "
                                  "its states out otherwise (another engine, precision or state storage): restart "
                                  "with the options they were written with")

    def write(self, symbol: str, covers: int, state) -> None:
        """The state (a uint8 array, or None: the engine held none) of `symbol` after the journal's first `covers`
        records, on the disk when it returns (OSError where it could not be written)."""
        data = b"" if state is None else memoryview(np.ascontiguousarray(state, np.uint8)).cast("B")
        header = {"session_key": self.session_key, "symbol": symbol, "covers": covers, "held": state is not None,
                  "bytes": len(data)}
        _write_whole(self._path(symbol), STATE_MAGIC + json.dumps(header).encode() + b"\n", data)
        self.covers[symbol], self._sizes[symbol] = covers, len(data)

    @property
    def bytes(self) -> int:
        """Of the states held."""
        return sum(self._sizes.values())

    def load(self, symbol: str):
        """The state checkpointed of `symbol`: a uint8 array, or None where the engine held none."""
        path = self._path(symbol)
        try:
            header, at = _read_state_header(path)
            if not header["held"]:
                return None
            with open(path, "rb") as f:
                f.seek(at)
                data = np.frombuffer(f.read(header["bytes"]), np.uint8)
        except (OSError, ValueError, KeyError) as exc:
            raise CheckpointError(f"the state checkpoint {path} cannot be read ({exc})") from None
        if len(data) != header["bytes"]:
            raise CheckpointError(f"the state checkpoint {path} is cut short ({len(data)} of {header['bytes']} bytes)")
        return data

    def gone(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(starts, ends, refused): the ranges [start, end) of the ids answered in the deleted segments, and the ids
        refused in them."""
        try:
            with np.load(self.dir / GONE) as gone:
                return gone["starts"], gone["ends"], gone["refused"]
        except FileNotFoundError:
            empty = np.zeros(0, np.int64)
            return empty, empty, empty
        except (OSError, ValueError, KeyError) as exc:
            raise CheckpointError(f"{self.dir / GONE} cannot be read ({exc})") from None

    def add_gone(self, answered, refused) -> None:
        """Keep the ids of a segment about to be deleted: `answered` and `refused` (int64 arrays)."""
        starts, ends, was_refused = self.gone()
        starts, ends = merged(starts, ends, *as_ranges(answered))
        refused = np.concatenate([was_refused, np.asarray(refused, np.int64)])
        data = io.BytesIO()
        np.savez(data, starts=starts, ends=ends, refused=refused)
        _write_whole(self.dir / GONE, data.getbuffer())

    def _path(self, symbol) -> Path:
        return self.dir / (hashlib.sha256(symbol.encode()).hexdigest()[:32] + ".state")


def as_json(layout):
    """`layout` as layout.json reads it back (a team client's tuples as lists)."""
    return json.loads(json.dumps(layout))


def as_ranges(ids) -> tuple[np.ndarray, np.ndarray]:
    """The distinct `ids` as sorted disjoint ranges [starts[i], ends[i])."""
    ids = np.unique(np.asarray(ids, np.int64))
    if not len(ids):
        return ids, ids
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    return ids[np.r_[0, breaks]], ids[np.r_[breaks - 1, len(ids) - 1]] + 1


def merged(starts, ends, more_starts, more_ends) -> tuple[np.ndarray, np.ndarray]:
    """The union of two lists of ranges [start, end), as sorted disjoint ranges (those that touch joined)."""
    starts, ends = np.concatenate([starts, more_starts]), np.concatenate([ends, more_ends])
    if not len(starts):
        return starts, ends
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], np.maximum.accumulate(ends[order])
    begins = np.r_[True, starts[1:] > ends[:-1]]  # a range that neither overlaps nor touches the ones before
    last = np.r_[np.flatnonzero(begins)[1:] - 1, len(starts) - 1]
    return starts[begins], ends[last]


def _read_state_header(path) -> tuple[dict, int]:
    with open(path, "rb") as f:
        magic, line = f.read(len(STATE_MAGIC)), f.readline(1 << 16)
    if magic != STATE_MAGIC or not line.endswith(b"\n"):
        raise ValueError("not a state checkpoint")
    return json.loads(line), len(magic) + len(line)


def _write_whole(path: Path, *parts) -> None:
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            for part in parts:
                f.write(part)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:  # a full disk: the part written (up to a state's size) is not left taking its room
        tmp.unlink(missing_ok=True)
        raise
    sync_dir(path.parent)


def sync_dir(directory) -> None:
    """The folder's entries (files created, renamed, removed) on the disk."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
