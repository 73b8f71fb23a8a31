"""Wire protocol shared by the client runtime and the scoring server.

Each message is one binary websocket frame holding one msgpack map with a ``type`` field:

- ``register`` {team: str, protocol: int, token?: str, preset?: str, weights_fingerprint?: str,
  allow_weights_mismatch?: bool, session_key?: str}: client to server, first. With the client's weights
  fingerprint the server refuses other weights than its own (``error`` weights_mismatch, then close 1008)
  unless allow_weights_mismatch; without it the server cannot tell, and lets the client play. A team
  already registered is taken over (a reconnect) only with the session_key its welcome gave.
  Every refusal of a register is an ``error`` followed by a close: 1008 when trying again cannot help,
  1013 (try again later) for a limit that passes (REFUSALS_THAT_PASS).
- ``welcome`` {preset: str | None, weights_fingerprint: str | None, requests: int, symbols: int,
  weights_match: bool | None, session_key?: str, timeout_s?: float}: server to client, the answer to a register it
  accepts: the model whose predictions are the targets, the team's stream, whether the client's weights are the
  same (None: one side did not say), the key that lets this client's reconnects take the team over, and the
  server's timeout (an answer later than it scores nothing), by which the client's summary tells its answers in
  time as the server does.
- ``end`` {requests: int}: server to client, once every request of the team's stream is scored (after the
  last ``score_update``): nothing more will come, and the client may leave.
- ``inference_request`` {unique_ids: [int], symbols: [str], features: bytes, timestamp: float}:
  features as little-endian float32, 79 per request, row-major; timestamp: the server's send time (of the first
  request, in a reconnect's resend). unreadable_rows?: [int], only from the original protocol's translation
  (client/original.py): the rows of its line that were no 79 numbers, sent as NaN.
- ``inference_response`` {unique_ids: [int], predictions: bytes | [[float]], client_timestamp: float}:
  little-endian float32, 4 per request in tower order xLSTM, Mamba2, RetNet, Hawk.
- ``score_update`` {unique_ids, pnls, correct, latencies_ms}.
- ``heartbeat`` {timestamp}; ``error`` {error: str, details: str}. A client's error whose code is one of
  CLIENT_NOTICES says something of its play that its answers do not show (a sharded engine lost a shard; its
  symbols' states started again): the server shows it on the leaderboard and in the team's summary.

``decode`` checks the frame and every field's type; the ``parse_*`` helpers also check that counts
and byte lengths agree, so a caller never indexes past what was sent.
"""
import math
import reprlib

import msgpack
import numpy as np

from client.constants import NUM_FEATURES, NUM_TOWERS

PROTOCOL_VERSION = 1
# Codes of a client's error messages that are notices, and how the leaderboard names them.
CLIENT_NOTICES = {"state_reset": "states reset", "shard_lost": "shard lost"}
MAX_FRAME_BYTES = 4 * 1024 * 1024
MAX_TEAM_NAME = 64  # characters: a team name is 1..64 printable characters
# Register refusals for a limit that passes (the server closes with 1013, try again later): a client may retry.
REFUSALS_THAT_PASS = ("rate_limited", "too_many_connections", "server_full")
CLOSE_TRY_AGAIN_LATER = 1013

_FEATURE_DTYPE = np.dtype("<f4")


class ProtocolError(ValueError):
    """A frame or message that breaks the protocol; the message says exactly what is wrong.

    That of a malformed inference_request names the integers among its unique_ids (``unique_ids``; None for another
    kind, or ids that are no list): requests the runtime counts as received and refuses, in either protocol."""

    def __init__(self, message: str, unique_ids: list[int] | None = None):
        super().__init__(message)
        self.unique_ids = unique_ids


def request_error(message: str, unique_ids) -> ProtocolError:
    """The ProtocolError of a malformed inference_request whose unique_ids field holds `unique_ids` (anything)."""
    if not isinstance(unique_ids, list):
        return ProtocolError(message)
    integers = [v for v in unique_ids if _is_int(v)]
    if len(integers) < len(unique_ids):
        message += (f" ({len(unique_ids) - len(integers)} of its {len(unique_ids)} unique_ids are no integers: only "
                    f"the integers count as requests)")
    return ProtocolError(message, integers)


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value):
    return (isinstance(value, (int, float)) and not isinstance(value, bool))


# A decoded list's element types looked at in C (set(map(type, ...))) first: a check per element in Python cost the
# client's loop ~0.1 us a value, on every request frame and score_update; one with other types (a subclass) is
# looked at element by element as before.
_INT, _STR, _NUMBER = {int}, {str}, {int, float}


def _int_list(value):
    return isinstance(value, list) and (set(map(type, value)) <= _INT or all(_is_int(v) for v in value))


def _str_list(value):
    return isinstance(value, list) and (set(map(type, value)) <= _STR or all(isinstance(v, str) for v in value))


def _number_list(value):
    return isinstance(value, list) and (set(map(type, value)) <= _NUMBER or all(_is_number(v) for v in value))


def _optional_str(value):
    return value is None or isinstance(value, str)


def _bytes_or_nested_list(value):
    return isinstance(value, (bytes, list))


# field -> (check, what the check expects, required)
_SCHEMAS = {
    "register": {
        "team": (lambda v: isinstance(v, str), "a string", True),
        "protocol": (_is_int, "an integer", True),
        "token": (lambda v: v is None or isinstance(v, str), "a string", False),
        "preset": (_optional_str, "a string", False),
        "weights_fingerprint": (_optional_str, "a string", False),
        "allow_weights_mismatch": (lambda v: isinstance(v, bool), "a boolean", False),
        "session_key": (lambda v: isinstance(v, str), "a string", False),
    },
    "welcome": {
        "preset": (_optional_str, "a string or nil", True),
        "weights_fingerprint": (_optional_str, "a string or nil", True),
        "requests": (_is_int, "an integer", True),
        "symbols": (_is_int, "an integer", True),
        "weights_match": (lambda v: v is None or isinstance(v, bool), "a boolean or nil", False),
        "session_key": (lambda v: isinstance(v, str), "a string", False),
        # finite: inf counted every answer, however late, in time, and the summary's JSON said Infinity
        "timeout_s": (lambda v: _is_number(v) and math.isfinite(v) and v > 0, "a positive finite number", False),
    },
    "end": {
        "requests": (_is_int, "an integer", True),
    },
    "inference_request": {
        "unique_ids": (_int_list, "a list of integers", True),
        "symbols": (_str_list, "a list of strings", True),
        "features": (lambda v: isinstance(v, bytes), "bytes", True),
        "timestamp": (_is_number, "a number", True),
        "unreadable_rows": (_int_list, "a list of integers", False),
    },
    "inference_response": {
        "unique_ids": (_int_list, "a list of integers", True),
        "predictions": (_bytes_or_nested_list, "bytes or a list of 4-number lists", True),
        "client_timestamp": (_is_number, "a number", True),
    },
    "score_update": {
        "unique_ids": (_int_list, "a list of integers", True),
        "pnls": (_number_list, "a list of numbers", True),
        "correct": (_int_list, "a list of integers", True),
        "latencies_ms": (_number_list, "a list of numbers", True),
    },
    "heartbeat": {
        "timestamp": (_is_number, "a number", True),
    },
    "error": {
        "error": (lambda v: isinstance(v, str), "a string", True),
        "details": (lambda v: isinstance(v, str), "a string", True),
    },
}
MESSAGE_TYPES = tuple(_SCHEMAS)


def validate(msg) -> dict:
    """Check that msg is a map with a known ``type`` and well-typed fields; return it."""
    if not isinstance(msg, dict):
        raise ProtocolError(f"message must be a msgpack map, got {type(msg).__name__}")
    kind = msg.get("type")
    if kind is None:
        raise ProtocolError("message has no 'type' field")
    schema = _SCHEMAS.get(kind) if isinstance(kind, str) else None
    if schema is None:
        # reprlib: a kind of lists nested 1,000 deep (msgpack goes to 1,024) overflowed repr's recursion, and the
        # RecursionError escaped the server's handler (1011, a traceback in its log for each such frame)
        raise ProtocolError(f"unknown message type {reprlib.repr(kind)}; expected one of {', '.join(MESSAGE_TYPES)}")
    try:
        for field, (check, expected, required) in schema.items():
            if field not in msg:
                if required:
                    raise ProtocolError(f"{kind}: missing field {field!r}")
                continue
            if not check(msg[field]):
                raise ProtocolError(f"{kind}: field {field!r} must be {expected}, got {type(msg[field]).__name__}")
    except ProtocolError as exc:
        if kind != "inference_request":
            raise
        raise request_error(str(exc), msg.get("unique_ids")) from None
    return msg


def encode(msg: dict) -> bytes:
    """One msgpack map, binary fields as msgpack bin."""
    return msgpack.packb(msg, use_bin_type=True)


# msgpack errors raised without a message, in words
_MSGPACK_SILENT_ERRORS = {"FormatError": "a byte that begins no msgpack value (FormatError)",
                          "StackError": "values nested too deeply (StackError)",
                          "OutOfData": "the frame ends inside a value (OutOfData)"}


def decode(frame, max_bytes: int = MAX_FRAME_BYTES) -> dict:
    """Decode and validate one frame; raises ProtocolError saying what is wrong."""
    if isinstance(frame, str):
        raise ProtocolError("text frame received; send one binary frame holding a msgpack map")
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"frame must be bytes, got {type(frame).__name__}")
    if len(frame) > max_bytes:
        raise ProtocolError(f"frame of {len(frame)} bytes exceeds the limit of {max_bytes} bytes")
    try:
        msg = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated exception types on bad input
        why = str(exc) or _MSGPACK_SILENT_ERRORS.get(type(exc).__name__, type(exc).__name__)
        raise ProtocolError(f"malformed msgpack: {why}") from None
    return validate(msg)


def team_name_problem(team: str) -> str | None:
    """Why `team` cannot be a team name (None: it can): 1..MAX_TEAM_NAME printable characters."""
    if not team or len(team) > MAX_TEAM_NAME or not team.isprintable():
        shown = team if len(team) <= 80 else team[:80] + "..."
        return f"a team name is 1..{MAX_TEAM_NAME} printable characters, got {shown!r} ({len(team)} characters)"
    return None


def _expect(msg, kind):
    validate(msg)
    if msg["type"] != kind:
        raise ProtocolError(f"expected message type {kind!r}, got {msg['type']!r}")


def _as_id_list(unique_ids):
    return [int(i) for i in (unique_ids.tolist() if isinstance(unique_ids, np.ndarray) else unique_ids)]


def register(team: str, token: str | None = None, *, preset: str | None = None,
             weights_fingerprint: str | None = None, allow_weights_mismatch: bool = False,
             session_key: str | None = None) -> dict:
    msg = {"type": "register", "team": team, "protocol": PROTOCOL_VERSION}
    optional = {"token": token, "preset": preset, "weights_fingerprint": weights_fingerprint,
                "allow_weights_mismatch": allow_weights_mismatch or None, "session_key": session_key}
    msg.update((field, value) for field, value in optional.items() if value is not None)
    return msg


def welcome(preset: str | None, weights_fingerprint: str | None, requests: int, symbols: int,
            weights_match: bool | None, session_key: str | None = None, timeout_s: float | None = None) -> dict:
    msg = {"type": "welcome", "preset": preset, "weights_fingerprint": weights_fingerprint,
           "requests": int(requests), "symbols": int(symbols), "weights_match": weights_match}
    if session_key is not None:
        msg["session_key"] = session_key
    if timeout_s is not None:
        msg["timeout_s"] = float(timeout_s)
    return msg


def end(requests: int) -> dict:
    return {"type": "end", "requests": int(requests)}


def inference_request(unique_ids, symbols, features: np.ndarray, timestamp: float) -> dict:
    ids = _as_id_list(unique_ids)
    symbols = [str(s) for s in symbols]
    features = np.asarray(features)
    if features.shape != (len(ids), NUM_FEATURES):
        raise ProtocolError(f"features must have shape ({len(ids)}, {NUM_FEATURES}), got {features.shape}")
    if len(symbols) != len(ids):
        raise ProtocolError(f"{len(ids)} unique_ids but {len(symbols)} symbols")
    return {"type": "inference_request", "unique_ids": ids, "symbols": symbols,
            "features": np.ascontiguousarray(features, dtype=_FEATURE_DTYPE).tobytes(),
            "timestamp": float(timestamp)}


def parse_inference_request(msg, validated: bool = False) -> tuple[list[int], list[str], np.ndarray]:
    """Return (unique_ids, symbols, features [n, 79] float32). NaN rows pass; the runtime answers them.
    validated: msg came from decode() (or a Connection's decode), which validated it already."""
    if not validated:
        _expect(msg, "inference_request")
    elif msg["type"] != "inference_request":
        raise ProtocolError(f"expected message type 'inference_request', got {msg['type']!r}")
    ids, symbols, raw = msg["unique_ids"], msg["symbols"], msg["features"]
    n = len(ids)
    if len(symbols) != n:
        raise request_error(f"inference_request: {n} unique_ids but {len(symbols)} symbols", ids)
    if len(raw) != n * NUM_FEATURES * 4:
        raise request_error(f"inference_request: features hold {len(raw)} bytes, expected "
                            f"{n * NUM_FEATURES * 4} ({n} requests x {NUM_FEATURES} float32)", ids)
    features = np.frombuffer(raw, dtype=_FEATURE_DTYPE).astype(np.float32).reshape(n, NUM_FEATURES)
    return list(ids), list(symbols), features


def inference_response(unique_ids, predictions: np.ndarray, client_timestamp: float) -> dict:
    ids = _as_id_list(unique_ids)
    predictions = np.asarray(predictions)
    if predictions.shape != (len(ids), NUM_TOWERS):
        raise ProtocolError(f"predictions must have shape ({len(ids)}, {NUM_TOWERS}), got {predictions.shape}")
    return {"type": "inference_response", "unique_ids": ids,
            "predictions": np.ascontiguousarray(predictions, dtype=_FEATURE_DTYPE).tobytes(),
            "client_timestamp": float(client_timestamp)}


def parse_inference_response(msg) -> tuple[list[int], np.ndarray]:
    """Return (unique_ids, predictions [n, 4] float32); predictions may be bytes or nested lists."""
    _expect(msg, "inference_response")
    ids, raw = msg["unique_ids"], msg["predictions"]
    n = len(ids)
    if isinstance(raw, bytes):
        if len(raw) != n * NUM_TOWERS * 4:
            raise ProtocolError(f"inference_response: predictions hold {len(raw)} bytes, expected "
                                f"{n * NUM_TOWERS * 4} ({n} responses x {NUM_TOWERS} float32)")
        predictions = np.frombuffer(raw, dtype=_FEATURE_DTYPE).astype(np.float32).reshape(n, NUM_TOWERS)
        return list(ids), predictions
    if not all(isinstance(row, list) and len(row) == NUM_TOWERS and all(_is_number(v) for v in row)
               for row in raw):
        raise ProtocolError(f"inference_response: each prediction must be a list of {NUM_TOWERS} numbers")
    if len(raw) != n:
        raise ProtocolError(f"inference_response: {n} unique_ids but {len(raw)} predictions")
    values = np.array(raw, dtype=np.float64).reshape(n, NUM_TOWERS)
    # a finite number past float32's range stays finite, a wrong tower: cast, it became inf and the server refused the
    # whole answer as non-finite, the request's right towers with it
    limit = np.finfo(np.float32).max
    return list(ids), np.where(np.isfinite(values), values.clip(-limit, limit), values).astype(np.float32)


def check_score_values(unique_ids, pnls, latencies_ms) -> None:
    """Refuse a score update whose pnls are not finite or whose latencies are negative or not finite, naming the
    unique_ids they score: the server's builder and the client's count both check here (a NaN pnl made a team's
    total NaN for good; a negative latency counted in time however late it came)."""
    if all(map(math.isfinite, pnls)) and all(map(math.isfinite, latencies_ms)) and min(latencies_ms, default=0) >= 0:
        return
    bad_pnls = [uid for uid, v in zip(unique_ids, pnls) if not math.isfinite(v)]
    bad_latencies = [uid for uid, v in zip(unique_ids, latencies_ms) if not (math.isfinite(v) and v >= 0)]
    said = ([f"pnls not finite for unique_ids {few_ids(bad_pnls)}"] if bad_pnls else []) + (
        [f"latencies_ms negative or not finite for unique_ids {few_ids(bad_latencies)}"] if bad_latencies else [])
    raise ProtocolError("score_update: " + "; ".join(said))


def few_ids(ids, limit=10) -> str:
    """The first `limit` of `ids` for an error's text, and how many in all where there are more."""
    shown = ", ".join(str(int(i)) for i in ids[:limit])  # ints, whatever their size, as the client sent them
    return shown + (f" ... ({len(ids)} in all)" if len(ids) > limit else "")


def score_update(unique_ids, pnls, correct, latencies_ms) -> dict:
    ids = _as_id_list(unique_ids)
    pnls = [float(v) for v in pnls]
    correct = [int(v) for v in correct]
    latencies_ms = [float(v) for v in latencies_ms]
    if not len(ids) == len(pnls) == len(correct) == len(latencies_ms):
        raise ProtocolError(f"score_update: lengths differ: {len(ids)} ids, {len(pnls)} pnls, "
                            f"{len(correct)} correct, {len(latencies_ms)} latencies")
    check_score_values(ids, pnls, latencies_ms)
    return {"type": "score_update", "unique_ids": ids, "pnls": pnls, "correct": correct,
            "latencies_ms": latencies_ms}


def heartbeat(timestamp: float) -> dict:
    if not math.isfinite(timestamp):
        raise ProtocolError(f"heartbeat timestamp must be finite, got {timestamp}")
    return {"type": "heartbeat", "timestamp": float(timestamp)}


def error(error: str, details: str) -> dict:
    return {"type": "error", "error": str(error), "details": str(details)}
