"""Request streams: ordered requests (symbol, 79 float32 features, gap before it), with optional targets.

Native format is .npz (arrays symbols, features, delay_ms, optional targets, and meta as a JSON
string); the original challenge's parquet schema (feature_00..feature_78, symbol, delay_ms,
optional target_00..target_03) is read and written through pyarrow when it is installed.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from client.constants import NUM_FEATURES, NUM_TOWERS

DEFAULT_MEAN_DELAY_MS = 12.0  # the original's sample files averaged 11-13 ms between requests
FEATURE_COLUMNS = tuple(f"feature_{i:02d}" for i in range(NUM_FEATURES))
TARGET_COLUMNS = tuple(f"target_{i:02d}" for i in range(NUM_TOWERS))
_PARQUET_META_KEY = b"fastens_meta"


@dataclass
class Stream:
    symbols: np.ndarray            # str [M]
    features: np.ndarray           # float32 [M, 79]
    delay_ms: np.ndarray           # float32 [M], gap before each request
    targets: np.ndarray | None = None  # float32 [M, 4], reference predictions
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        self.symbols, self.features, self.delay_ms, self.targets = _validated(
            self.symbols, self.features, self.delay_ms, self.targets)
        if not isinstance(self.meta, dict):
            raise ValueError(f"stream meta must be a dict, got {type(self.meta).__name__}")

    def __len__(self):
        return len(self.symbols)


def _first_bad_row(bad_rows: np.ndarray) -> int:
    return int(np.flatnonzero(bad_rows)[0])


def _numbers(name: str, array) -> np.ndarray:
    """`array` when it holds real numbers: casting complex numbers, text or durations to float32 would drop an
    imaginary part, parse text, or read another time unit as milliseconds."""
    array = np.asarray(array)
    if array.dtype.kind not in "biuf":
        raise ValueError(f"{name} must be real numbers, got dtype {array.dtype}")
    return array


def _float32(name: str, array: np.ndarray) -> np.ndarray:
    """`array` as contiguous float32: a float64 beyond float32's range would become inf, and be told as a NaN or inf
    the file does not hold. A NaN or inf is left as it is, for the check that names its row and feature."""
    if array.dtype.itemsize > 4 and array.size:
        magnitude = np.abs(array.reshape(len(array), -1))
        big = ((magnitude > np.finfo(np.float32).max) & (magnitude < np.inf)).any(axis=1)
        if big.any():
            row = _first_bad_row(big)
            raise ValueError(f"{name} at row {row} exceed float32's range (max |value| "
                             f"{np.abs(array[row]).max():.4g})")
    return np.ascontiguousarray(array, dtype=np.float32)


# A numpy str array is as wide as its longest symbol on every row: one symbol of 2,000 characters in 300,000 rows
# took 2.4 GB. Names of instruments are far shorter.
MAX_SYMBOL_CHARS = 128

# A gap longer than this is a timestamp read as a gap (epoch milliseconds would make a replay wait for decades).
MAX_DELAY_MS = 86_400_000.0


def _validated(symbols, features, delay_ms, targets):
    """Coerce to the stream's dtypes and reject anything that would give a silently wrong answer."""
    # a list's strings as they are: numpy's str dtype drops trailing NULs before they could be seen (below)
    symbols = symbols if isinstance(symbols, np.ndarray) else np.array(symbols, dtype=object)
    if symbols.ndim != 1:
        raise ValueError(f"symbols must be one-dimensional, got shape {symbols.shape}")
    if symbols.dtype.kind == "O":
        # a list's or a parquet column's values: "dtype object" would not say which (a null, a number) nor where
        row = next((row for row, symbol in enumerate(symbols.tolist()) if not isinstance(symbol, str)), None)
        if row is not None:
            raise ValueError(f"symbols must be strings; row {row} holds {symbols[row]!r} "
                             f"({type(symbols[row]).__name__})")
    elif symbols.dtype.kind != "U":
        raise ValueError(f"symbols must be strings, got dtype {symbols.dtype}")
    first_rows = {}  # each symbol's first row: the checks below look at each symbol once
    for row, symbol in enumerate(symbols.tolist()):
        first_rows.setdefault(symbol, row)
    for symbol, row in first_rows.items():
        # held as numpy str (what an .npz stores without pickles), "AB\x00" would become "AB": one state, two symbols
        if symbols.dtype.kind == "O" and symbol.endswith("\x00"):
            raise ValueError(f"symbol {symbol!r} at row {row} ends in a NUL character, which a numpy string "
                             f"array drops: it would be played as {symbol.rstrip(chr(0))!r}")
        if len(symbol) > MAX_SYMBOL_CHARS:
            raise ValueError(f"symbol at row {row} is {len(symbol):,} characters long ({symbol[:20]!r}...); a symbol "
                             f"is a name of at most {MAX_SYMBOL_CHARS}")
        try:  # the fingerprint and the protocols encode symbols as UTF-8: a lone surrogate failed in the codec, unnamed
            symbol.encode("utf-8")
        except UnicodeEncodeError as error:
            raise ValueError(f"symbol {symbol!r} at row {row} is not Unicode text (UTF-8 cannot hold "
                             f"{symbol[error.start]!r})") from None
    symbols = symbols.astype(str)
    num_requests = len(symbols)
    if num_requests == 0:
        raise ValueError("the stream has no requests")

    features = _numbers("features", features)
    if features.ndim != 2 or features.shape[1] != NUM_FEATURES:
        raise ValueError(f"features must have shape [M, {NUM_FEATURES}], got {features.shape} "
                         f"(wrong feature count)")
    bad = ~np.isfinite(features).all(axis=1)
    if bad.any():
        row = _first_bad_row(bad)
        column = int(np.flatnonzero(~np.isfinite(features[row]))[0])  # a parquet file's feature_NN
        raise ValueError(f"features contain NaN or inf at row {row}, feature {column} ({int(bad.sum())} bad rows)")
    features = _float32("features", features)

    delay_ms = _numbers("delay_ms", delay_ms)
    if delay_ms.ndim != 1:
        raise ValueError(f"delay_ms must be one-dimensional, got shape {delay_ms.shape}")
    bad = ~np.isfinite(delay_ms)
    if bad.any():
        raise ValueError(f"delay_ms is NaN or inf at row {_first_bad_row(bad)}")
    bad = delay_ms < 0
    if bad.any():
        row = _first_bad_row(bad)
        raise ValueError(f"delay_ms is negative at row {row} ({delay_ms[row]})")
    bad = delay_ms > MAX_DELAY_MS
    if bad.any():
        row = _first_bad_row(bad)
        raise ValueError(f"delay_ms at row {row} is {delay_ms[row]:.4g} ms, over a day: it holds the gap before each "
                         f"request, not a timestamp")
    delay_ms = np.ascontiguousarray(delay_ms, dtype=np.float32)  # checked first: a float64 past float32 is inf

    if targets is not None:
        targets = _numbers("targets", targets)
        if targets.ndim != 2 or targets.shape[1] != NUM_TOWERS:
            raise ValueError(f"targets must have shape [M, {NUM_TOWERS}], got {targets.shape}")
        bad = ~np.isfinite(targets).all(axis=1)
        if bad.any():
            raise ValueError(f"targets contain NaN or inf at row {_first_bad_row(bad)}")
        targets = _float32("targets", targets)

    lengths = {"symbols": num_requests, "features": len(features), "delay_ms": len(delay_ms)}
    if targets is not None:
        lengths["targets"] = len(targets)
    if len(set(lengths.values())) != 1:
        described = ", ".join(f"{name} {n}" for name, n in lengths.items())
        raise ValueError(f"stream arrays differ in length (rows): {described}")
    return symbols, features, delay_ms, targets


def symbol_names(num_symbols: int, ids=None) -> list[str]:
    """The names of num_symbols symbols (SYM_000, ...), or of those numbered `ids` alone."""
    width = max(3, len(str(num_symbols - 1)))
    return [f"SYM_{i:0{width}d}" for i in (range(num_symbols) if ids is None else ids)]


def generate_stream(num_symbols: int, num_requests: int, seed: int, rate: float | None = None) -> Stream:
    """A synthetic stream, identical on every machine (numpy PCG64).

    Features are standard normal like the original's; gaps are exponential with mean 1000/rate ms
    (12 ms without a rate). When num_requests >= num_symbols every symbol appears at least once.
    """
    if int(num_symbols) != num_symbols or num_symbols < 1:
        raise ValueError(f"num_symbols must be a positive integer, got {num_symbols!r}")
    if int(num_requests) != num_requests or num_requests < 1:
        raise ValueError(f"num_requests must be a positive integer, got {num_requests!r}")
    if rate is not None and not (np.isfinite(rate) and rate > 0):
        raise ValueError(f"rate must be a positive number of requests per second, got {rate!r}")
    num_symbols, num_requests = int(num_symbols), int(num_requests)
    rng = np.random.Generator(np.random.PCG64(seed))
    # Each symbol once (while requests last), the rest uniform, then shuffled together.
    covered = min(num_symbols, num_requests)
    symbol_ids = np.concatenate([rng.permutation(num_symbols)[:covered],
                                 rng.integers(0, num_symbols, num_requests - covered)])
    symbol_ids = rng.permutation(symbol_ids)
    features = rng.standard_normal((num_requests, NUM_FEATURES), dtype=np.float32)
    mean_delay_ms = DEFAULT_MEAN_DELAY_MS if rate is None else 1000.0 / rate
    delay_ms = rng.exponential(mean_delay_ms, num_requests).astype(np.float32)
    meta = {"generator": "pcg64", "seed": int(seed), "num_symbols": num_symbols,
            "rate": None if rate is None else float(rate)}
    # only the symbols drawn are named: all num_symbols names took 12 GB for 10^8 symbols and 3 requests
    drawn, rows = np.unique(symbol_ids, return_inverse=True)
    return Stream(np.asarray(symbol_names(num_symbols, drawn.tolist()))[rows], features, delay_ms, meta=meta)


def stream_fingerprint(stream: Stream) -> str:
    """sha256 over the requests (symbols, feature bytes, delays); targets and meta are not part of it."""
    digest = hashlib.sha256(b"fastens-stream-v1")
    digest.update(np.int64(len(stream)).tobytes())
    for symbol in stream.symbols.tolist():
        encoded = symbol.encode("utf-8")
        digest.update(np.int64(len(encoded)).tobytes() + encoded)
    digest.update(stream.features.astype("<f4", copy=False).tobytes())
    digest.update(stream.delay_ms.astype("<f4", copy=False).tobytes())
    return digest.hexdigest()


def _import_parquet():
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise ImportError("parquet streams need the optional package pyarrow: pip install pyarrow") from None
    return pyarrow, pyarrow.parquet


def _format_of(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix not in (".npz", ".parquet"):
        raise ValueError(f"unknown stream format {suffix or '(no extension)'!r} for {path}: use .npz or .parquet")
    return suffix


def save_stream(stream: Stream, path) -> None:
    """Write .npz or .parquet (by extension) atomically; meta gains the stream's fingerprint."""
    path = Path(path)
    suffix = _format_of(path)
    meta = dict(stream.meta, stream_fingerprint=stream_fingerprint(stream))
    path.parent.mkdir(parents=True, exist_ok=True)
    # A fresh name opened exclusively, not mkstemp: its file is private (0600), and a stream is made to be read by
    # a server or a team that may run as another user, so it gets the mode the umask gives
    tmp_name = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    out = open(tmp_name, "xb")
    try:
        with out:
            if suffix == ".npz":
                arrays = {"symbols": stream.symbols, "features": stream.features,
                          "delay_ms": stream.delay_ms, "meta": np.asarray(json.dumps(meta))}
                if stream.targets is not None:
                    arrays["targets"] = stream.targets
                np.savez(out, **arrays)
            else:
                _write_parquet(stream, meta, out)
        os.replace(tmp_name, path)
    except BaseException:
        os.unlink(tmp_name)
        raise


def _write_parquet(stream: Stream, meta: dict, out) -> None:
    pa, pq = _import_parquet()
    columns = {name: stream.features[:, i] for i, name in enumerate(FEATURE_COLUMNS)}
    columns["symbol"] = stream.symbols.tolist()
    columns["delay_ms"] = stream.delay_ms
    if stream.targets is not None:
        columns.update({name: stream.targets[:, i] for i, name in enumerate(TARGET_COLUMNS)})
    table = pa.table(columns).replace_schema_metadata({_PARQUET_META_KEY: json.dumps(meta).encode()})
    pq.write_table(table, out)


def load_stream(path) -> Stream:
    """Read a stream from .npz or .parquet, validating every request."""
    path = Path(path)
    suffix = _format_of(path)
    if not path.is_file():
        raise FileNotFoundError(f"stream file not found: {path}")
    if suffix == ".npz":
        stream = _read_npz(path)
    else:
        stream = _read_parquet(path)
    stored = stream.meta.get("stream_fingerprint")
    if stored is not None and stored != stream_fingerprint(stream):
        raise ValueError(f"stream {path} does not match the fingerprint stored with it (corrupted or edited)")
    return stream


def _meta(stored) -> dict:
    """The meta stored as JSON text, str or UTF-8 bytes (an .npz written by another tool may hold bytes, whose str()
    is "b'...'"); a ValueError that names it."""
    try:
        return json.loads(stored.decode() if isinstance(stored, bytes) else str(stored))
    except ValueError as error:
        raise ValueError(f"its meta is not JSON text: {error}") from error


def _read_npz(path: Path) -> Stream:
    if not zipfile.is_zipfile(path):  # np.load would unpickle it, refuse, and advise allow_pickle, which runs its code
        with open(path, "rb") as file:
            head = file.read(8)
        raise ValueError(f"cannot read stream {path} as .npz: not a whole zip archive, which an .npz is (it starts "
                         f"with {head!r})")
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {name: archive[name] for name in archive.files}
    except Exception as error:
        raise ValueError(f"cannot read stream {path} as .npz: {error}") from error
    missing = [name for name in ("symbols", "features", "delay_ms") if name not in arrays]
    if missing:
        raise ValueError(f"stream {path} lacks the arrays {', '.join(missing)}")
    try:
        meta = _meta(arrays["meta"][()]) if "meta" in arrays else {}
        return Stream(arrays["symbols"], arrays["features"], arrays["delay_ms"], arrays.get("targets"), meta)
    except ValueError as error:
        raise ValueError(f"stream {path}: {error}") from error


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split())  # pyarrow's messages may run over lines (a corrupted page's: two)


def _column_meant(name: str) -> str:
    """The stream column a near-miss name means: "Symbol", "delay_ms " (a header's stray space), "feature_5"."""
    name = name.strip().lower()
    numbered = re.fullmatch(r"(feature|target)_0*(\d+)", name)
    return f"{numbered[1]}_{int(numbered[2]):02d}" if numbered else name


def _read_parquet(path: Path) -> Stream:
    pa, pq = _import_parquet()
    try:
        # the names first: read_table refuses a name held twice with the whole schema (80-odd lines) in its message
        names = pq.read_schema(path).names
    except Exception as error:
        raise ValueError(f"cannot read stream {path} as parquet: {_one_line(error)}") from error
    twice = [name for name in (*FEATURE_COLUMNS, "symbol", "delay_ms", *TARGET_COLUMNS) if names.count(name) > 1]
    if twice:
        raise ValueError(f"stream {path} has {names.count(twice[0])} columns named {twice[0]}")
    missing = [name for name in (*FEATURE_COLUMNS, "symbol", "delay_ms") if name not in names]
    if missing:
        # "Symbol" or "delay_ms " (a header's stray space) is the column meant: say so
        near = [repr(name) for name in names if _column_meant(name) in missing and name not in missing]
        raise ValueError(f"stream {path} lacks the columns {', '.join(missing)}"
                         + (f" (it has {', '.join(near)})" if near else ""))
    present_targets = [name for name in TARGET_COLUMNS if name in names]
    if present_targets and len(present_targets) != NUM_TOWERS:
        raise ValueError(f"stream {path} has only some target columns ({', '.join(present_targets)}); "
                         f"expected all of {', '.join(TARGET_COLUMNS)} or none")
    # a feature_79 would make 80 features played as their first 79: another model's stream
    beyond = [name for name in names if re.fullmatch(r"(feature|target)_\d+", name)
              and name not in FEATURE_COLUMNS + TARGET_COLUMNS]
    if beyond:
        raise ValueError(f"stream {path} has numbered columns other than {FEATURE_COLUMNS[0]}..{FEATURE_COLUMNS[-1]} "
                         f"and {TARGET_COLUMNS[0]}..{TARGET_COLUMNS[-1]}: {', '.join(beyond)}")
    try:  # only the stream's columns: others (a pandas index, notes) are not read. pre_buffer (for S3) held the
        # whole file's bytes besides its table: a million requests' took 1.9 GB, not 1.2
        table = pq.read_table(path, columns=[*FEATURE_COLUMNS, "symbol", "delay_ms", *present_targets],
                              pre_buffer=False)
    except Exception as error:
        raise ValueError(f"cannot read stream {path} as parquet: {_one_line(error)}") from error

    def column(name):
        values = table.column(name)
        kind = values.type.value_type if pa.types.is_dictionary(values.type) else values.type
        if name == "symbol":
            if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or str(kind) == "string_view"):
                raise ValueError(f"column symbol holds {values.type} values, not text")
        elif not (pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)):
            # to_numpy() would give an object array, told as "dtype object" without the column
            raise ValueError(f"column {name} holds {values.type} values, not numbers")
        if values.null_count:
            # to_numpy() gives a number's null as NaN (told as a NaN the file does not hold), and a dictionary's as
            # whichever symbol its index points to
            raise ValueError(f"column {name} is null (missing, or a NaN as pandas writes one) at row "
                             f"{_first_bad_row(values.is_null().to_numpy())} ({values.null_count} null rows)")
        return values.to_numpy()

    stored_meta = (table.schema.metadata or {}).get(_PARQUET_META_KEY)
    try:
        if not table.num_rows:  # before the types: an empty column's may be null or double, whatever it was meant to be
            raise ValueError("the stream has no requests")
        # float32 a column at a time: stacked as float64 first, a million requests' features took 3 GB at peak
        features = np.empty((table.num_rows, NUM_FEATURES), np.float32)
        for i, name in enumerate(FEATURE_COLUMNS):
            features[:, i] = _float32(f"{name} values", column(name))
        targets = np.stack([column(name) for name in TARGET_COLUMNS], axis=1) if present_targets else None
        symbols, delay_ms = np.asarray(column("symbol"), dtype=object), column("delay_ms")
        meta = _meta(stored_meta) if stored_meta else {}
        return Stream(symbols, features, delay_ms, targets, meta)
    except ValueError as error:
        raise ValueError(f"stream {path}: {error}") from error
