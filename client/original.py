"""The original event's wire protocol, and its translation to and from the project's messages.

On the wire: one plain TCP connection per client; each message is one JSON object (UTF-8) followed by a newline,
with a ``message_type`` field naming its kind (docs/facts.md, "The original protocol"):

- ``register`` (client to server, first): no other field. The project's server names such a team by its address.
- ``inference_request`` (server to client): unique_ids [int], symbols [str], features [[float]] (79 a request),
  timestamp (server send time, s). A row that is not 79 numbers is translated as NaN, its index in the project
  message's ``unreadable_rows``: the runtime refuses that request alone.
- ``inference_response`` (client to server): unique_ids [int], predictions [[float]] (4 a request, tower order),
  client_timestamp. A row that is not 4 numbers leaves the message, its id in ``unreadable_ids``: the server leaves
  that request alone unanswered.
- ``score_update`` (server to client): unique_ids, trade_pnls, accuracies (fraction of towers correct),
  latencies_ms.
- ``heartbeat`` (both ways): timestamp. ``error`` (both ways): error (text), details (text or null).
- ``stats_update`` (server to client): its fields were never public. The project's server sends one when a team's
  stream is over: {complete: true, requests: N}, the original's counterpart of the project's ``end``.

The project's server also says why before it closes a connection, as the websocket protocol's close frame would:
an ``error`` {error: "closing", details: "<close code> <reason>"}. An original client prints it and goes on.

``to_original`` and ``from_original`` translate between a project message (client/protocol.py's dicts, with
``type``) and an original object, in either direction, so that the server's and the runtime's logic handle one
kind of message. Reading a line checks it as client/protocol.py checks a frame: a ProtocolError says what is wrong.
Imports no torch and no websockets.
"""
import json
import math

import numpy as np

from client import protocol
from client.constants import NUM_FEATURES, NUM_TOWERS
from client.protocol import ProtocolError

CLOSING = "closing"  # the error kind that carries a closing connection's code and reason
ORIGINAL_KINDS = ("register", "inference_request", "inference_response", "score_update", "heartbeat", "error",
                  "stats_update")
# A line from a server may hold a whole burst of requests in JSON's decimal text (about 1.6 kB a request).
MAX_LINE_BYTES = 64 * 1024 * 1024
_NAN_ROW = [math.nan] * NUM_FEATURES


def encode_line(obj: dict) -> bytes:
    """One original message: compact JSON and a newline."""
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


def decode_line(line: bytes) -> dict:
    """The JSON object of one line, with a known message_type; raises ProtocolError saying what is wrong."""
    try:
        obj = json.loads(line)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"line is not JSON: {exc}; send one JSON object per line") from None
    except RecursionError:  # a line nested deeper than the interpreter's stack (a few kB of brackets)
        raise ProtocolError("line nests values deeper than Python's JSON decoder goes") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"line must hold a JSON object, got {type(obj).__name__}")
    kind = obj.get("message_type")
    if kind not in ORIGINAL_KINDS:
        raise ProtocolError(f"unknown message_type {kind!r}; expected one of {', '.join(ORIGINAL_KINDS)}")
    return obj


def _is_number(value) -> bool:
    """A number a float holds: JSON's integers have no bound, and one past float's range (a 400-digit literal)
    would raise OverflowError wherever it is used as one."""
    if isinstance(value, float):
        return True
    if not isinstance(value, int) or isinstance(value, bool):
        return False
    try:
        float(value)
    except OverflowError:
        return False
    return True


def _field(obj, name, check, expected, default=None, required=True):
    if name not in obj:
        if required:
            raise ProtocolError(f"{obj['message_type']}: missing field {name!r}")
        return default
    value = obj[name]
    if not check(value):
        item = getattr(check, "item", None)
        if item is not None and isinstance(value, list):  # "got list" alone would not say which item is wrong
            index = next(i for i, v in enumerate(value) if not item(v))
            shown = repr(value[index])
            shown = shown if len(shown) <= 40 else shown[:37] + "..."
            got = f"a list whose item {index} is {type(value[index]).__name__} {shown}"
        else:
            got = type(value).__name__
        raise ProtocolError(f"{obj['message_type']}: field {name!r} must be {expected}, got {got}")
    return value


def _list_of(check):
    def check_list(value):
        return isinstance(value, list) and all(check(v) for v in value)

    check_list.item = check
    return check_list


def _is_text(value) -> bool:
    """A string that UTF-8 can carry: JSON's \\u escapes can spell a lone surrogate, which a msgpack string cannot
    hold and which breaks whatever later encodes it (the leaderboard page showing a client's notice)."""
    if not isinstance(value, str):
        return False
    if value.isascii():
        return True
    try:
        value.encode()
    except UnicodeEncodeError:
        return False
    return True


_ints = _list_of(lambda v: isinstance(v, int) and not isinstance(v, bool))
_strs = _list_of(_is_text)
_numbers = _list_of(_is_number)


def _is_row(row, width) -> bool:
    return isinstance(row, list) and len(row) == width and all(_is_number(v) for v in row)


def _inference_request(obj: dict) -> dict:
    ids = _field(obj, "unique_ids", _ints, "a list of integers")
    symbols = _field(obj, "symbols", _strs, "a list of strings of Unicode text (no lone surrogate)")
    features = _field(obj, "features", lambda v: isinstance(v, list), "a list of lists of numbers")
    timestamp = _field(obj, "timestamp", _is_number, "a number")
    if not len(ids) == len(symbols) == len(features):
        raise ProtocolError(f"inference_request: {len(ids)} unique_ids, {len(symbols)} symbols and "
                            f"{len(features)} feature rows")
    # A row that is not 79 numbers is sent on as NaN and named, for the runtime to refuse that request alone:
    # refusing the line would drop the other symbols' requests with it, and desynchronise their states.
    unreadable = [i for i, row in enumerate(features)
                  if not (isinstance(row, list) and len(row) == NUM_FEATURES and all(_is_number(v) for v in row))]
    if unreadable:
        features = list(features)
        for i in unreadable:
            features[i] = _NAN_ROW
    rows = np.array(features, dtype=np.float32).reshape(len(ids), NUM_FEATURES)
    msg = protocol.inference_request(ids, symbols, rows, timestamp)
    if unreadable:
        msg["unreadable_rows"] = unreadable
    return msg


def from_original(obj: dict, team: str = "") -> dict:
    """The project's message for an original object (decoded by decode_line); `team` names a register's team.

    A stats_update that does not say the stream is complete has no project counterpart: None."""
    kind = obj["message_type"]
    if kind == "register":
        return protocol.register(team)
    if kind == "inference_request":
        try:
            return _inference_request(obj)
        except ProtocolError as exc:  # naming its ids, as a malformed frame's: the runtime counts and refuses them
            raise protocol.request_error(str(exc), obj.get("unique_ids")) from None
    if kind == "inference_response":
        ids = _field(obj, "unique_ids", _ints, "a list of integers")
        predictions = _field(obj, "predictions", lambda v: isinstance(v, list), "a list of lists of numbers")
        # never read by the server: one that is no number (text, null) is taken as missing, not the answers refused
        client_timestamp = obj.get("client_timestamp")
        client_timestamp = float(client_timestamp) if _is_number(client_timestamp) else 0.0
        if len(ids) != len(predictions):
            raise ProtocolError(f"inference_response: {len(ids)} unique_ids but {len(predictions)} predictions")
        # A row that is not 4 numbers (null: NaN as most languages but Python write it) leaves its request alone
        # unanswered, as a NaN row does: refusing the line lost the batch's other answers with it.
        readable = [_is_row(row, NUM_TOWERS) for row in predictions]
        msg = {"type": "inference_response", "unique_ids": [uid for uid, ok in zip(ids, readable) if ok],
               "predictions": [row for row, ok in zip(predictions, readable) if ok],
               "client_timestamp": client_timestamp}
        if not all(readable):
            msg["unreadable_ids"] = [uid for uid, ok in zip(ids, readable) if not ok]
        return msg
    if kind == "score_update":
        ids = _field(obj, "unique_ids", _ints, "a list of integers")
        pnls = _field(obj, "trade_pnls", _numbers, "a list of numbers")
        accuracies = _field(obj, "accuracies", _numbers, "a list of numbers")
        latencies = _field(obj, "latencies_ms", _numbers, "a list of numbers")
        if not all(0.0 <= a <= 1.0 for a in accuracies):
            raise ProtocolError("score_update: accuracies must be fractions of the towers, in 0..1")
        if not len(ids) == len(pnls) == len(accuracies) == len(latencies):
            raise ProtocolError(f"score_update: lengths differ: {len(ids)} ids, {len(pnls)} trade_pnls, "
                                f"{len(accuracies)} accuracies, {len(latencies)} latencies")
        return protocol.score_update(ids, pnls, [round(a * NUM_TOWERS) for a in accuracies], latencies)
    if kind == "heartbeat":
        timestamp = _field(obj, "timestamp", lambda v: _is_number(v) and math.isfinite(v), "a finite number")
        return protocol.heartbeat(timestamp)
    if kind == "error":
        error = _field(obj, "error", _is_text, "a string of Unicode text (no lone surrogate)")
        details = _field(obj, "details", lambda v: v is None or _is_text(v),
                         "a string or null, of Unicode text (no lone surrogate)", required=False)
        return protocol.error(error, details or "")
    # stats_update
    if _field(obj, "complete", lambda v: isinstance(v, bool), "a boolean", default=False, required=False):
        return protocol.end(_field(obj, "requests", lambda v: isinstance(v, int) and not isinstance(v, bool),
                                   "an integer"))
    return None


def to_original(msg: dict) -> dict | None:
    """The original object for a project message; None for one the original protocol has no kind for (welcome:
    an original client is not told it registered)."""
    kind = msg["type"]
    if kind == "register":  # no team, token or fingerprint: the original's register has no other field
        return {"message_type": "register"}
    if kind == "inference_request":
        features = np.frombuffer(msg["features"], dtype="<f4").reshape(-1, NUM_FEATURES)
        return {"message_type": "inference_request", "unique_ids": msg["unique_ids"], "symbols": msg["symbols"],
                "features": features.tolist(), "timestamp": msg["timestamp"]}
    if kind == "inference_response":
        predictions = msg["predictions"]
        if isinstance(predictions, bytes):
            predictions = np.frombuffer(predictions, dtype="<f4").reshape(-1, NUM_TOWERS).tolist()
        return {"message_type": "inference_response", "unique_ids": msg["unique_ids"], "predictions": predictions,
                "client_timestamp": msg["client_timestamp"]}
    if kind == "score_update":
        return {"message_type": "score_update", "unique_ids": msg["unique_ids"], "trade_pnls": msg["pnls"],
                "accuracies": [c / NUM_TOWERS for c in msg["correct"]], "latencies_ms": msg["latencies_ms"]}
    if kind == "heartbeat":
        return {"message_type": "heartbeat", "timestamp": msg["timestamp"]}
    if kind == "error":
        return {"message_type": "error", "error": msg["error"], "details": msg["details"]}
    if kind == "end":
        return {"message_type": "stats_update", "complete": True, "requests": msg["requests"]}
    if kind == "welcome":
        return None
    raise ValueError(f"no original counterpart for a project message of type {kind!r}")


def closing(code: int, reason: str) -> dict:
    """The error a server sends before it closes a connection: what a websocket close frame says."""
    return {"message_type": "error", "error": CLOSING, "details": f"{int(code)} {reason}"}


def parse_closing(details: str) -> tuple[int | None, str]:
    """(close code, reason) of a closing error's details; code None when they do not start with one."""
    code, _, reason = (details or "").partition(" ")
    return (int(code), reason) if code.isdigit() else (None, details or "")
